"""One round of federated training (:func:`train_round`) and the run as a job (:class:`TrainJob`).

The job's driver (:class:`fedring.job.Driver`) streams the results into the run's HDF5 file
(:mod:`fedring.results`): one row per round, metrics at every evaluation, a checkpoint every
``checkpoint_every`` rounds; a stop signal ends the run after the current round with a
checkpoint (exit code 75).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from fedring import names
from fedring.aggregators import nonfinite_flags
from fedring.arrays import host
from fedring.comm.ring import Aggregation
from fedring.job import Recorder
from fedring.results import Entry

from .participation import Cohort
from .trainer import PER_RANK, Trainer


@dataclass(frozen=True)
class RoundResult:
    """What one round produced, on every rank: the cohort's ``aggregation`` (its ``update`` is what
    every replica applied, of the rows' kind, and may be a view of the clients' upload buffer until
    the next round);
    ``batch_loss``: each of this rank's clients' first batch loss, in a ``(clients,)`` array with
    zeros elsewhere; ``nonfinite``: which of this rank's uploads held NaN or an infinity (same
    layout; measured, not sent); ``cohort``: who took part."""

    aggregation: Aggregation
    batch_loss: np.ndarray
    nonfinite: np.ndarray
    cohort: Cohort

    @property
    def update_finite(self) -> bool:
        return bool(np.isfinite(host(self.aggregation.update)).all())


def train_round(tr: Trainer, t: int) -> RoundResult:
    """Round ``t``: the cohort's clients compute their uploads, its Byzantine ones attack, the topology
    aggregates, every replica applies. Full participation is the cohort of every client. On the
    device path the rows stay a tensor on the device from the clients' updates to the topology's
    update (docs/arrays.md), and the replica applies it there."""
    tr.net.ledger.reset()
    lay = tr.layout
    cohort = tr.participation.draw(t, tr.adversary.is_byzantine, tr.f)
    taking = cohort.member[lay.lo : lay.hi]
    rows, losses = tr.clients.updates(t, tr.replica.w_staged, taking)
    rows = tr.privacy.release(rows, t, lay.lo, taking & ~tr.adversary.is_byzantine[lay.lo : lay.hi])  # local DP
    reference = tr.reference()  # the server's clean-data gradient, for the rules that need one
    probe = tr.probe(t)  # the round's model, for the rules that inspect it
    rows = tr.adversary.attack(rows, t, reference, cohort, probe, tr.attacker_model(t))
    flags = nonfinite_flags(rows)  # where the rows are, read below
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite uploads are recorded instead
        aggregation = tr.topology.aggregate(rows, t, reference, cohort, probe)
    aggregation = tr.privacy.noised(aggregation, t, cohort.size)  # central DP
    if aggregation.updated:
        tr.replica.apply(aggregation.update, t, cohort.member)
    # the round's reads come last: on a device each waits for the work queued before it, and the
    # host queues the ring's steps while the device still computes the clients' gradients
    nonfinite = np.zeros(tr.cfg.n_clients, np.uint8)
    nonfinite[lay.lo : lay.hi] = host(flags) & taking
    return RoundResult(aggregation, losses.read(), nonfinite, cohort)


class TrainJob:
    """The training run as a :class:`fedring.job.Job`: one step is one round."""

    unit = "round"

    per_rank = PER_RANK

    def __init__(self, tr: Trainer):
        self.tr = tr
        self.total, self.checkpoint_every = tr.cfg.rounds, tr.cfg.checkpoint_every
        self.sampled = not tr.participation.everyone  # the file records the cohorts of sampled runs only
        self.sampling_rate = tr.participation.size / tr.cfg.n_clients  # q of the privacy accountant
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
        recorder.write(names.BYZANTINE_CLIENTS, self.tr.byzantine)

    def restore(self, arrays: dict[str, np.ndarray], attrs: dict) -> None:
        self.tr.restore(arrays)
        self.bytes_sent_total = int(attrs.get("bytes_sent_total", 0))

    def checkpoint(self) -> tuple[dict[str, np.ndarray], dict]:
        return self.tr.checkpoint(), {"bytes_sent_total": self.bytes_sent_total}

    def step(self, t: int, recorder: Recorder) -> int:
        """Round ``t``, its measurements gathered on rank 0 and, at an evaluation, the test scores."""
        tr, rnd = self.tr, t + 1
        result = train_round(tr, t)
        client_bytes, server_bytes = tr.net.gather_ledger()
        nonfinite = tr.net.sum_to_server(result.nonfinite)
        scores = None
        if rnd % tr.cfg.eval_every == 0 or rnd == tr.cfg.rounds:
            scores = {
                **tr.evaluation.scores(),
                "train_loss": tr.evaluation.mean_batch_loss(result.batch_loss, result.cohort),
            }
        recorder.record(self.entries(t, result, client_bytes, server_bytes, nonfinite, scores, recorder.elapsed()))
        return rnd

    def entries(
        self,
        t: int,
        result: RoundResult,
        client_bytes: np.ndarray | None,
        server_bytes: int,
        nonfinite: np.ndarray | None,
        scores: dict | None,
        elapsed: float,
    ) -> Iterator[Entry]:
        """Rank 0 (a generator: it runs where the recorder reads it, so the figures gathered on rank 0
        alone are there): round ``t``'s rows, and its metrics when it was evaluated (``scores``)."""
        assert client_bytes is not None and nonfinite is not None, "rank 0 holds the gathered figures"
        agg = result.aggregation
        self.bytes_sent_total += int(client_bytes.sum())
        rows = {
            **{f"{names.RING}/{name}": value for name, value in {**agg.rows, **agg.figures}.items()},
            names.BYTES_SENT: client_bytes,
            names.SERVER_BYTES_SENT: np.int64(server_bytes),
            names.NONFINITE: nonfinite,
            names.NONFINITE_UPDATE: np.uint8(not result.update_finite),
        }
        if agg.selected is not None:
            rows[names.SELECTED] = agg.selected
        epsilon = self.tr.privacy.epsilon(t + 1, self.sampling_rate)
        if epsilon is not None:
            rows[names.DP_EPSILON] = np.float64(epsilon)
        if self.sampled:
            rows[names.COHORT] = result.cohort.member.astype(np.uint8)
            rows[names.COHORT_BYZANTINE] = np.int64(result.cohort.byzantine)
            rows[names.UPDATED] = np.uint8(agg.updated)
        if scores is None:
            yield Entry(t + 1, {}, rows)
            return
        metrics = {
            "round": t + 1,
            **scores,
            "bytes_sent": int(client_bytes.sum()),
            "bytes_sent_total": self.bytes_sent_total,
            "server_bytes_sent": server_bytes,
            "wall_seconds": elapsed,
            "lr": self.tr.lr_at(t),
            "weight_mean_change": self.tr.replica.weight_mean_change(),
            **agg.figures,
            **({} if epsilon is None else {"dp_epsilon": epsilon}),
        }
        line = f"test_acc {scores['test_accuracy']:.4f}  bytes_sent_total {self.bytes_sent_total / 1e6:,.1f} MB"
        yield Entry(t + 1, metrics, rows, line)

    def finish(self, recorder: Recorder) -> None:
        replica = self.tr.replica.checkpoint()  # collective: BatchNorm statistics, shared or every client's
        recorder.write(names.MODEL_FINAL, replica["w"])
        if "buffers" in replica:
            recorder.write(names.MODEL_BUFFERS, replica["buffers"])
