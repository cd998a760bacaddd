"""Turn fedring's HDF5 results files into tidy tables, paper-layout tables and plots.

Needs the ``analysis`` extra (``pip install 'fedring[analysis]'``: pandas, matplotlib); works
from any directory. ``python -m analysis --help`` lists the commands, ``python -m analysis
COMMAND --help`` their options::

    python -m analysis load            FILES|DIRS... [--out runs.csv] [--all]
    python -m analysis table           FILES|DIRS... [--out PREFIX] [--rows attack] [--cols method]
                                       [--metric test_error] [--final-window K] [--diff-to COLUMN]
    python -m analysis conformal-table FILES|DIRS... [--out PREFIX]
    python -m analysis worst-case      FILES|DIRS... --tune lr[,KEY...] [--by aggregator] [--out PREFIX]
    python -m analysis heatmap         FILES|DIRS... --out heatmap.png [--tune lr | --metric test_accuracy]
    python -m analysis plot-accuracy   FILES|DIRS... --out accuracy.png
    python -m analysis plot-bytes      FILES|DIRS... --out bytes.png
    python -m analysis plot-drift      FILES|DIRS... --out drift.png
    python -m analysis plot-conformal  FILES|DIRS... --out conformal.png

- ``load``: one row per training run and evaluated round (:mod:`analysis.load`).
- ``table``: the BRACE paper's Table 2 layout, attacks x defences, each run's metric at its
  last evaluation (or the mean of its last K), mean ± sd (n) over seeds, or the per-seed
  paired difference to one column (:mod:`analysis.tables`).
- ``conformal-table``: coverage and interval width / set size of every case of the conformal
  runs' ``/calibration`` (:mod:`analysis.conformal`).
- ``worst-case``: per defence, the tuned setting with the best worst-case validation accuracy
  over the attacks, and its test accuracy under each (:mod:`analysis.worst_case`).
- ``heatmap``, ``plot-accuracy``, ``plot-bytes``, ``plot-drift``, ``plot-conformal``: PNG figures
  (:mod:`analysis.plots`).

A directory stands for every ``*.h5`` file under it. Files that cannot be read, are being
written (HDF5 file lock held), or whose run did not complete are skipped and named on
stderr (``load --all`` keeps incomplete runs, with their ``status``).

This module itself needs neither pandas nor matplotlib.
"""

#: ``python -m analysis COMMAND``: (module, function, what it does in one line)
COMMANDS = {
    "load": ("analysis.load", "main", "tidy table of training runs: one row per run and evaluated round (CSV)"),
    "table": (
        "analysis.tables",
        "main_table",
        "paper-layout table (attacks x defences) of a final metric, mean ± sd (n) over seeds, or paired differences",
    ),
    "conformal-table": (
        "analysis.conformal",
        "main_table",
        "coverage and interval width / set size per case of conformal runs (/calibration)",
    ),
    "worst-case": (
        "analysis.worst_case",
        "main",
        "per defence, the tuned setting with the best worst-case validation accuracy over the attacks, and its test accuracy",
    ),
    "heatmap": (
        "analysis.plots",
        "main_heatmap",
        "defence x attack (and defence x Byzantine share) heatmap of worst-case-tuned or final accuracy",
    ),
    "plot-accuracy": (
        "analysis.plots",
        "main_accuracy",
        "test accuracy vs round, a line per defence, a panel per attack",
    ),
    "plot-bytes": ("analysis.plots", "main_bytes", "bytes sent per client and round vs number of clients"),
    "plot-drift": (
        "analysis.plots",
        "main_drift",
        "weight mean change and the sign rules' +/-/0 consensus fractions vs round, a line per run",
    ),
    "plot-conformal": (
        "analysis.plots",
        "main_conformal",
        "coverage (with the 1 - alpha target) and size per conformal case",
    ),
}

#: the optional dependencies of the commands (``pip install 'fedring[analysis]'``)
EXTRAS = ("pandas", "matplotlib")
INSTALL_EXTRA = "pip install 'fedring[analysis]'"

# The BRACE paper's names and order (Table 2): attacks as rows, defences as columns; then the
# other attacks and rules, named as their papers name them (docs/attacks.md, docs/aggregators.md).
ATTACK_LABELS = {
    "none": "no attack",
    "labelflip": "LF attack",
    "gaussian": "Gaussian attack",
    "fang_krum": "Krum attack",
    "fang_trim": "Trim attack",
    "minmax": "Min-Max attack",
    "minsum": "Min-Sum attack",
    "backdoor": "Backdoor attack",
    "adaptive": "Adaptive attack",
    "alie": "ALIE attack",
    "ipm": "IPM attack",
    "foe": "FoE attack",
    "hplus_attack": "H+ attack",
    "mimic": "Mimic attack",
    "scaling": "Scaling attack",
    "signflip": "Sign-flip attack",
    "nonfinite": "Non-finite attack",
    "optimal_alie": "Optimal ALIE attack",
    "optimal_ipm": "Optimal IPM attack",
    "dba": "DBA attack",
    "neurotoxin": "Neurotoxin attack",
    "edgecase": "EdgeCase attack",
    "altermin": "AlterMin attack",
    "clippedclustering_attack": "ClippedClustering attack",
    "signguard_attack": "SignGuard attack",
}
AGGREGATOR_LABELS = {
    "mean": "RAR",
    "krum": "Krum",
    "median": "Median",
    "trimmed_mean": "Trim-mean",
    "signsgd": "signSGD",
    "rlr": "RLR",
    "brace": "BRACE",
    "multikrum": "Multi-Krum",
    "bulyan": "Bulyan",
    "geomed": "GeoMed",
    "cclip": "CClip",
    "huber": "Huber",
    "fltrust": "FLTrust",
    "zenopp": "Zeno++",
    "fldetector": "FLDetector",
    "fedseca": "FedSECA",
    "hplus": "H+",
    "copod": "COPOD",
    "mca": "MCA",
    "ties": "TIES",
    "mda": "MDA",
    "monna": "MoNNA",
    "meamed": "Meamed",
    "caf": "CAF",
    "smea": "SMEA",
    "dnc": "DnC",
    "signguard": "SignGuard",
    "clippedclustering": "ClippedClustering",
    "flame": "FLAME",
    "foolsgold": "FoolsGold",
    "deepsight": "DeepSight",
    "crfl": "CRFL",
    "auror": "Auror",
    "lasa": "LASA",
    "simpleclustering": "SimpleClustering",
    "normclipping": "NormClipping",
}
#: the pre-aggregators, as in ``NNM+Krum``
PRE_AGGREGATOR_LABELS = {"bucketing": "Bucketing", "clipping": "Clipping", "nnm": "NNM", "arc": "ARC"}
#: DP-FedAvg's modes, as in ``Mean+DP`` (central DP with a small noise multiplier is the backdoor
#: literature's "weak DP")
DP_LABELS = {"central": "DP", "local": "LDP"}
#: BRACE with ``brace.rule = symmetric`` (+1 / -1 / 0 around lambda; not the paper's eq. (1))
BRACE_SYMMETRIC = "BRACE-sym"
#: the column order of the defences: the paper's (BRACE-sym beside BRACE), then the others
METHOD_ORDER = [*list(AGGREGATOR_LABELS.values())[:7], BRACE_SYMMETRIC, *list(AGGREGATOR_LABELS.values())[7:]]
