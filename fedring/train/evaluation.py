"""Evaluation of the shared model: test (and validation) accuracy and loss, the backdoor's attack
success rate, and the round's mean training loss.

Each rank scores the test slices of its own clients (:class:`fedring.train.data.FederatedData`)
and the sums are reduced: one entry per client, zeros elsewhere, so they are exact whatever the
number of ranks.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from fedring.attacks import Backdoor
from fedring.comm import Layout

from .data import FederatedData, Shard
from .device import Staging
from .participation import Cohort
from .state import ModelBuffers

EVAL_BATCH = 500


class Evaluation:
    """Scores of ``model`` (the replica's) on this rank's clients' test and validation slices."""

    def __init__(
        self,
        model: nn.Module,
        stage: Staging,
        buffers: ModelBuffers,
        data: FederatedData,
        layout: Layout,
        backdoor: Backdoor | None,
        validation: bool,
    ):
        self.model, self.stage, self.buffers, self.data = model, stage, buffers, data
        self.layout, self.backdoor, self.validation = layout, backdoor, validation
        # the attack's own samples for its success rate (EdgeCase), checked against the run's before training
        self.own = None if backdoor is None else backdoor.success_set(tuple(data.shape))

    def scores(self) -> dict[str, float]:
        """Collective: test accuracy and loss (and the backdoor's success rate), and the validation
        set's, in eval mode (BatchNorm uses its running statistics, dropout is off)."""
        self.model.eval()
        try:
            out = self.part("test", self.data.test_slice, self.backdoor)
            if self.validation:
                out.update(self.part("validation", lambda k: self.data.validation[k], None))
        finally:
            self.model.train()
        return out

    def part(self, name: str, part_of, backdoor: Backdoor | None) -> dict[str, float]:
        stats = np.zeros((5, self.layout.n_clients))  # loss sum, correct, count, triggered hits, triggered count
        with torch.no_grad():
            for k, client in enumerate(self.layout.local_clients):
                part: Shard = part_of(k)
                self.buffers.use(k)
                for a in range(0, len(part.y), EVAL_BATCH):
                    x, y = self.stage.tensor(part.x[a : a + EVAL_BATCH]), self.stage.tensor(part.y[a : a + EVAL_BATCH])
                    logits = self.model(x)
                    stats[0, client] += F.cross_entropy(logits, y, reduction="sum").item()
                    stats[1, client] += (logits.argmax(1) == y).sum().item()
                    if backdoor is not None and self.own is None:
                        keep = backdoor.counted(part.y[a : a + EVAL_BATCH])
                        triggered = self.stage.tensor(backdoor.stamp(part.x[a : a + EVAL_BATCH][keep]))
                        if len(triggered):
                            stats[3, client] += (self.model(triggered).argmax(1) == backdoor.target).sum().item()
                        stats[4, client] += keep.sum()
                stats[2, client] = len(part.y)
                if backdoor is not None and self.own is not None:  # every n-th of its own samples, from client c on
                    own = self.own[client :: self.layout.n_clients]
                    for a in range(0, len(own), EVAL_BATCH):
                        hits = self.model(self.stage.tensor(own[a : a + EVAL_BATCH])).argmax(1) == backdoor.target
                        stats[3, client] += hits.sum().item()
                    stats[4, client] += len(own)
        self.layout.comm.Allreduce(MPI.IN_PLACE, stats, op=MPI.SUM)
        total = stats.sum(axis=1)
        out = {f"{name}_accuracy": total[1] / total[2], f"{name}_loss": total[0] / total[2]}
        if backdoor is not None:
            out["attack_success_rate"] = total[3] / max(total[4], 1)
        return out

    def mean_batch_loss(self, batch_loss: np.ndarray, cohort: Cohort) -> float:
        """Collective: the mean over the ``cohort``'s members (NaN for an empty one) of ``batch_loss``
        (each rank fills its clients' entries)."""
        total = batch_loss.copy()
        self.layout.comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
        return float(total.sum() / cohort.size) if cohort.size else float("nan")
