"""Federated training over MPI: data, models, learning-rate schedules, the round and the run.

:func:`fedring.train.trainer.train_round` is one round, top to bottom; :func:`train` a run.
"""
