"""Federated training over MPI: data, models, learning-rate schedules, the topologies, the round and the run.

:func:`fedring.train.loop.train_round` is one round, top to bottom, returning a
:class:`~fedring.train.loop.RoundResult`; :class:`~fedring.train.loop.TrainJob` is the run, as
a job of :class:`fedring.job.Driver`.
"""
