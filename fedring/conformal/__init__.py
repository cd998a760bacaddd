"""Federated conformal prediction: the split-conformal helpers every method shares
(:mod:`fedring.conformal.split`), the trial loop of the conformal tasks
(:mod:`fedring.conformal.trials`), PRISM-FCP (:mod:`fedring.conformal.prism`) and label-shift
DP-FedCP (:mod:`fedring.conformal.labelshift`)."""

from .split import (
    absolute_residual_scores,
    check_alpha,
    conformal_rank,
    interval_coverage,
    split_conformal_quantile,
)

__all__ = ["absolute_residual_scores", "check_alpha", "conformal_rank", "interval_coverage", "split_conformal_quantile"]
