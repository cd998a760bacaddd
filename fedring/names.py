"""The names of the groups and datasets of a results file, for the code that writes and reads it.

``docs/hdf5.md`` documents each one (``tests/test_docs.py`` checks that it names every one).
Plain strings, so a reader such as :mod:`analysis` needs nothing else from fedring to name them.
"""

# groups whose datasets the writers name: ``/<group>/<name>``
#: one entry per evaluated round (``round``, ``test_accuracy`` ...)
METRICS = "metrics"
#: the ring sign rules' per-round figures
RING = "ring"
#: :data:`RING` in files written by 0.1.0 and 0.2.0
RING_BEFORE_0_3 = "brace"
#: the conformal tasks' per-trial rows (``coverage``, ``size``, ``threshold`` ...); its attrs
#: describe the cases
CALIBRATION = "calibration"
#: two slots, ``a`` and ``b``; attr ``current`` names the one holding the last checkpoint
CHECKPOINT = "checkpoint"

#: (steps, clients) protocol bytes each client sent
BYTES_SENT = "comm/bytes_sent"
#: (steps,) protocol bytes the server sent
SERVER_BYTES_SENT = "comm/server_bytes_sent"
#: (trials,) the trial index of each row of :data:`CALIBRATION`
CALIBRATION_TRIAL = f"{CALIBRATION}/trial"

#: (rounds, clients) each client's weight in [0, 1], for rules that select or weight clients
SELECTED = "aggregation/selected"
#: (rounds, clients) 1 where a client's upload held NaN or an infinity
NONFINITE = "aggregation/nonfinite"
#: (rounds,) 1 where the applied update was not finite
NONFINITE_UPDATE = "aggregation/nonfinite_update"
#: (rounds, clients) 1 for the clients of the round's cohort (client sampling)
COHORT = "participation/cohort"
#: (rounds,) how many Byzantine clients the cohort held
COHORT_BYZANTINE = "participation/byzantine"
#: (rounds,) 0 where the round had no update
UPDATED = "participation/updated"

#: (b,) the sorted ids of the Byzantine clients
BYZANTINE_CLIENTS = "byzantine/clients"
#: (d,) the final parameters
MODEL_FINAL = "model/final"
#: the final buffers (BatchNorm statistics) of a model that has them
MODEL_BUFFERS = "model/buffers"

#: (rounds,) the privacy spent so far, epsilon at the run's delta (``dp`` = central or local)
DP_EPSILON = "dp/epsilon"
