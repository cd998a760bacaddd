"""Label-shift DP-FedCP: federated conformal prediction under label shift, with differential privacy.

V. Plassier, M. Makni, A. Rubashevskii, E. Moulines, M. Panov, "Conformal Prediction for
Federated Uncertainty Quantification Under Label Shift", ICML 2023 (arXiv:2306.05131); equation,
algorithm and theorem numbers in this package are the paper's, and ``docs/labelshift.md``
explains the choices made where its text is silent. The maths: scores (:mod:`.scores`),
weighted and smoothed quantiles (:mod:`.quantiles`), importance weights and the subsample
(:mod:`.weights`), Theorem 4.4 (:mod:`.privacy`), Algorithm 1 (:mod:`.fedavgqe`); the
experiments (:mod:`.experiments`), Algorithm 2 and the baselines (:mod:`.protocol`) and the task
``python -m fedring conformal labelshift`` (:mod:`.task`).
"""

from .experiments import (
    GaussianExperiment,
    LogitsExperiment,
    load_logits_npz,
    logits_from_run,
)
from .fedavgqe import dp_fedavgqe, fedavgqe_local_round
from .privacy import count_noise_epsilon, epsilon_for_sigma, sigma_g_min
from .protocol import dp_fedcp_thresholds, predict_sets
from .quantiles import (
    AtomRows,
    label_shift_thresholds,
    moreau_pinball,
    moreau_pinball_grad,
    smoothed_quantile,
    unweighted_threshold,
    weighted_quantile,
)
from .scores import aps_scores, softmax
from .weights import (
    calibration_prior,
    discrete_gaussian,
    label_counts,
    local_measure,
    mle_weights,
    oracle_weights,
    privatise_counts,
    query_decomposition,
    select_subset,
    subsample_sizes,
    weight_error,
)

__all__ = [
    "softmax",
    "aps_scores",
    "weighted_quantile",
    "label_shift_thresholds",
    "unweighted_threshold",
    "moreau_pinball",
    "moreau_pinball_grad",
    "AtomRows",
    "smoothed_quantile",
    "label_counts",
    "discrete_gaussian",
    "privatise_counts",
    "mle_weights",
    "oracle_weights",
    "calibration_prior",
    "weight_error",
    "subsample_sizes",
    "select_subset",
    "local_measure",
    "query_decomposition",
    "fedavgqe_local_round",
    "dp_fedavgqe",
    "sigma_g_min",
    "epsilon_for_sigma",
    "count_noise_epsilon",
    "dp_fedcp_thresholds",
    "predict_sets",
    "GaussianExperiment",
    "LogitsExperiment",
    "load_logits_npz",
    "logits_from_run",
]
