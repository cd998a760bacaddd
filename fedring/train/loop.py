"""One round of federated training (:func:`train_round`) and the run as a job (:class:`TrainJob`).

The job's driver (:class:`fedring.job.Driver`) streams the results into the run's HDF5 file
(:mod:`fedring.results`): one row per round, metrics at every evaluation, a checkpoint every
``checkpoint_every`` rounds; a stop signal ends the run after the current round with a
checkpoint (exit code 75).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedring.aggregators import nonfinite_rows
from fedring.job import Entry, Recorder

from .participation import Cohort
from .trainer import PER_RANK, Trainer


@dataclass(frozen=True)
class RoundResult:
    """What one round produced, on every rank (``selected`` on rank 0 only).

    ``update``: the ``(d,)`` aggregate every replica applied; ``batch_loss``: each of this
    rank's clients' first batch loss, in a ``(clients,)`` array with zeros elsewhere;
    ``nonfinite``: which of this rank's uploads held NaN or an infinity (same layout; measured,
    not sent); ``update_finite``: whether the update was finite; ``selected``: the server
    rule's weight per client (None on the ring and for rules that report none); ``figures``
    and ``rows``: the ring rule's scalars and per-client rows (``/ring``).
    """

    update: np.ndarray
    batch_loss: np.ndarray
    nonfinite: np.ndarray
    update_finite: bool
    selected: np.ndarray | None
    figures: dict
    rows: dict
    #: the round's cohort (None: every client took part) and whether it had an update
    cohort: Cohort | None = None
    updated: bool = True


def train_round(tr: Trainer, t: int) -> RoundResult:
    """Round ``t``: the cohort's clients compute updates, its Byzantine ones attack, the topology
    aggregates, all apply. Without client sampling every client is in the cohort (``cohort`` None)."""
    tr.net.ledger.reset()
    cohort = tr.cohort(t)
    lay = tr.layout
    taking = np.ones(lay.n_local, bool) if cohort is None else cohort.member[lay.lo : lay.hi]
    batch_loss = np.zeros(tr.cfg.n_clients)
    if tr.batched is not None:  # batched_clients: B clients per call (fedring.train.batched)
        tr.batched.round(t, batch_loss, taking)
    else:
        for k, client in enumerate(lay.local_clients):
            if taking[k]:
                batch_loss[client] = tr.client_gradient(k, t, tr.grads[k])
    reference = tr.reference_gradient()  # the server's clean-data gradient, for the rules that need one
    tr.adversary.attack_model(tr.grads, t, reference, cohort)
    nonfinite = np.zeros(tr.cfg.n_clients, np.uint8)
    nonfinite[lay.lo : lay.hi] = nonfinite_rows(tr.grads) & taking
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite uploads are recorded instead
        agg = tr.topology.aggregate(tr.grads, t, reference, cohort)
    update_finite = bool(np.isfinite(agg.update).all())
    if agg.updated:
        tr.apply(agg.update, t, cohort)
    return RoundResult(
        agg.update, batch_loss, nonfinite, update_finite, agg.selected, agg.figures, agg.rows, cohort, agg.updated
    )


class TrainJob:
    """The training run as a :class:`fedring.job.Job`: one step is one round."""

    unit = "round"

    per_rank = PER_RANK

    def __init__(self, tr: Trainer):
        self.tr = tr
        self.total, self.checkpoint_every = tr.cfg.rounds, tr.cfg.checkpoint_every
        self.bytes_sent_total = 0  # rank 0's count (the ledgers are gathered there)

    def file_attrs(self) -> dict:
        return {
            "n_clients": self.tr.cfg.n_clients,
            "n_parameters": self.tr.d,
            # what the arithmetic ran on: other kernels round differently (docs/training.md)
            "torch_version": str(torch.__version__),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        }

    def begin(self, recorder: Recorder) -> None:
        recorder.write("byzantine/clients", self.tr.byzantine)

    def restore(self, arrays: dict[str, np.ndarray], attrs: dict) -> None:
        self.tr.restore(arrays)
        self.bytes_sent_total = int(attrs.get("bytes_sent_total", 0))

    def checkpoint(self) -> tuple[dict[str, np.ndarray], dict]:
        return self.tr.checkpoint_arrays(), {"bytes_sent_total": self.bytes_sent_total}

    def step(self, t: int, recorder: Recorder) -> int:
        """Round ``t``, its measurements gathered on rank 0 and, at an evaluation, the test scores."""
        tr, rnd = self.tr, t + 1
        result = train_round(tr, t)
        client_bytes, server_bytes = tr.net.gather_ledger()
        nonfinite = tr.net.sum_to_server(result.nonfinite)
        evaluated = rnd % tr.cfg.eval_every == 0 or rnd == tr.cfg.rounds
        scores = (
            {**tr.evaluate(), "train_loss": tr.mean_batch_loss(result.batch_loss, result.cohort)} if evaluated else None
        )
        recorder.record(self.entries, t, result, client_bytes, server_bytes, nonfinite, scores, recorder.elapsed())
        return rnd

    def entries(
        self,
        t: int,
        result: RoundResult,
        client_bytes: np.ndarray,
        server_bytes: int,
        nonfinite: np.ndarray,
        scores: dict | None,
        elapsed: float,
    ) -> list[Entry]:
        """Rank 0: round ``t``'s rows, and its metrics when it was evaluated (``scores``)."""
        tr, figures = self.tr, result.figures
        self.bytes_sent_total += int(client_bytes.sum())
        rows = {
            **{f"ring/{name}": value for name, value in {**result.rows, **figures}.items()},
            "comm/bytes_sent": client_bytes,
            "comm/server_bytes_sent": np.int64(server_bytes),
            "aggregation/nonfinite": nonfinite,
            "aggregation/nonfinite_update": np.uint8(not result.update_finite),
        }
        if result.selected is not None:
            rows["aggregation/selected"] = result.selected
        if result.cohort is not None:
            rows["participation/cohort"] = result.cohort.member.astype(np.uint8)
            rows["participation/byzantine"] = np.int64(result.cohort.byzantine)
            rows["participation/updated"] = np.uint8(result.updated)
        if scores is None:
            return [Entry(t + 1, {}, rows)]
        metrics = {
            "round": t + 1,
            **scores,
            "bytes_sent": int(client_bytes.sum()),
            "bytes_sent_total": self.bytes_sent_total,
            "server_bytes_sent": server_bytes,
            "wall_seconds": elapsed,
            "lr": tr.lr_at(t),
            "weight_mean_change": tr.weight_mean_change(),
            **figures,
        }
        line = f"test_acc {scores['test_accuracy']:.4f}  bytes_sent_total {self.bytes_sent_total / 1e6:,.1f} MB"
        return [Entry(t + 1, metrics, rows, line)]

    def finish(self, recorder: Recorder) -> None:
        buffers = self.tr.buffers.checkpoint()  # collective: BatchNorm statistics, shared or every client's
        recorder.write("model/final", self.tr.w)
        if buffers:
            recorder.write("model/buffers", buffers["buffers"])
