"""PRISM-FCP: Byzantine-resilient federated conformal prediction via partial sharing.

E. Lari, R. Arablouei, S. Werner, "PRISM-FCP: Byzantine-Resilient Federated Conformal
Prediction via Partial Sharing" (arXiv 2602.18396, 2026), with its baselines Rob-FCP
(M. Kang et al., ICML 2024: the same calibration filter after full sharing) and FCP (C. Lu
et al., ICML 2023: full sharing, no filter). Equation numbers are the paper's;
``docs/prism-fcp.md`` describes the task and the choices the paper leaves open.

- :mod:`.calibration`: characterization vectors, distances, maliciousness, filters, the
  robust threshold (pure numpy);
- :mod:`.attacks`: the calibration-phase attacks (registry ``CALIB_ATTACKS``);
- :mod:`.psofed`: PSO-Fed training over :class:`fedring.comm.Network`;
- :mod:`.environment`, :mod:`.uci`: the synthetic world and the UCI Superconductivity split;
- :mod:`.experiment`: one trial of every case, the paper's tables, the job;
- :mod:`.task`: the ``prism`` task, its settings and ``python -m fedring conformal prism``.
"""

from .attacks import (
    CALIB_ATTACKS,
    CoverageAttack,
    EfficiencyAttack,
    RandomAttack,
    make_calib_attack,
)
from .calibration import (
    FILTERS,
    Calibration,
    characterization_vectors,
    coverage_bounds,
    filter_clients,
    flag_largest,
    flag_mad,
    maliciousness_scores,
    pairwise_distances,
    robust_calibrate,
)

__all__ = [
    "CALIB_ATTACKS",
    "FILTERS",
    "Calibration",
    "CoverageAttack",
    "EfficiencyAttack",
    "RandomAttack",
    "characterization_vectors",
    "coverage_bounds",
    "filter_clients",
    "flag_largest",
    "flag_mad",
    "make_calib_attack",
    "maliciousness_scores",
    "pairwise_distances",
    "robust_calibrate",
]
