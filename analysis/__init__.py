"""Turn fedring's HDF5 results files into tidy tables, paper-layout tables and plots.

Run from the repository root (needs the ``analysis`` extra: pandas, matplotlib)::

    python -m analysis load            FILES|DIRS... [--out runs.csv] [--all]
    python -m analysis table           FILES|DIRS... [--out PREFIX] [--rows attack] [--cols method]
    python -m analysis conformal-table FILES|DIRS... [--out PREFIX]
    python -m analysis plot-accuracy   FILES|DIRS... --out accuracy.png
    python -m analysis plot-bytes      FILES|DIRS... --out bytes.png
    python -m analysis plot-conformal  FILES|DIRS... --out conformal.png

A directory stands for every ``*.h5`` file under it. Files that cannot be read, are being
written (HDF5 file lock held), or whose run did not complete are skipped and named on
stderr (``load --all`` keeps incomplete runs, with their ``status``).
"""

# The BRACE paper's names and order (Table 2): attacks as rows, defences as columns.
ATTACK_LABELS = {
    "none": "None attack",
    "labelflip": "LF attack",
    "gaussian": "Gaussian attack",
    "fang_krum": "Krum attack",
    "fang_trim": "Trim attack",
    "minmax": "Min-Max attack",
    "minsum": "Min-Sum attack",
    "backdoor": "Backdoor attack",
    "adaptive": "Adaptive attack",
}
AGGREGATOR_LABELS = {
    "mean": "RAR",
    "krum": "Krum",
    "median": "Median",
    "trimmed_mean": "Trim-mean",
    "signsgd": "signSGD",
    "rlr": "RLR",
    "brace": "BRACE",
}
CONFORMAL_METHOD_LABELS = {"prism": "PRISM-FCP", "robfcp": "Rob-FCP", "fcp": "FCP"}
