"""One round of federated training (:func:`train_round`) and a whole run (:func:`train`).

Rank 0 streams the results into the run's HDF5 file (:mod:`fedring.results`): one row per
round, metrics at every evaluation, a checkpoint every ``checkpoint_every`` rounds; a stop
signal ends the run after the current round with a checkpoint (exit code 75).
"""

from __future__ import annotations

import sys

import numpy as np

from fedring.aggregators import nonfinite_rows
from fedring.results import ResultsFile
from fedring.runtime import EXIT_PREEMPTED, Progress, Watchdog

from .trainer import Trainer


def train_round(tr: Trainer, t: int) -> None:
    """Round ``t``: clients compute updates, Byzantine ones attack, the topology aggregates, all apply."""
    tr.net.ledger.reset()
    tr.batch_loss[:] = 0.0
    for k, client in enumerate(tr.layout.local_clients):
        tr.batch_loss[client] = tr.client_gradient(k, t, tr.grads[k])
    reference = tr.reference_gradient()  # the server's clean-data gradient, for the rules that need one
    tr.adversary.attack_model(tr.grads, t, reference)
    tr.nonfinite[:] = 0  # measured, not sent: which uploads hold NaN or an infinity
    tr.nonfinite[tr.layout.lo : tr.layout.hi] = nonfinite_rows(tr.grads)
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite uploads are recorded instead
        update = tr.topology.aggregate(tr.grads, t, reference)
    tr.update_finite = bool(np.isfinite(update).all())
    tr.apply(update, t)


def open_results(tr: Trainer, first_checkpoint: dict | None) -> ResultsFile:
    cfg = tr.cfg
    if cfg.resume:
        return ResultsFile.reopen(cfg.out, tr.start_round)
    results = ResultsFile.create(cfg, tr.comm.size, {"n_clients": cfg.clients, "n_parameters": tr.d})
    results.write("byzantine/clients", tr.byzantine)
    # round 0 checkpoint: a run that dies before its first checkpoint still resumes
    results.write_checkpoint(first_checkpoint, {"round": 0, "bytes_sent_total": 0, "wall_seconds": 0.0})
    return results


def train(tr: Trainer, watchdog: Watchdog) -> int:
    """Run (or resume) a whole training job; rank 0 streams results into ``cfg.out``."""
    cfg, comm, rank0 = tr.cfg, tr.comm, tr.comm.rank == 0
    first_checkpoint = None if cfg.resume else tr.checkpoint_arrays()  # collective
    results = open_results(tr, first_checkpoint) if rank0 else None
    if rank0:
        results.h5.attrs["world_size"] = comm.size
        watchdog.on_abort.append(results.close)
    progress = Progress("round", cfg.rounds, cfg.quiet or not rank0, tr.resumed.get("wall_seconds", 0.0), tr.start_round)
    total_bytes = int(tr.resumed.get("bytes_sent_total", 0))
    for t in range(tr.start_round, cfg.rounds):
        train_round(tr, t)
        rnd = t + 1
        client_bytes, server_bytes = tr.net.gather_ledger()
        nonfinite = tr.net.sum_to_server(tr.nonfinite)
        extra_metrics = tr.topology.round_metrics()
        rows = tr.topology.round_rows()
        rows.update({f"brace/{name}": value for name, value in extra_metrics.items()})  # every round
        evaluated = rnd % cfg.eval_every == 0 or rnd == cfg.rounds
        scores = tr.evaluate() if evaluated else {}
        train_loss = tr.mean_batch_loss() if evaluated else None
        if rank0:
            total_bytes += int(client_bytes.sum())
            rows = {**rows, "comm/bytes_sent": client_bytes, "comm/server_bytes_sent": np.int64(server_bytes),
                    "aggregation/nonfinite": nonfinite, "aggregation/nonfinite_update": np.uint8(not tr.update_finite)}
            if tr.topology.selected is not None:
                rows["aggregation/selected"] = tr.topology.selected
            metrics = {}
            if evaluated:
                metrics = {
                    "round": rnd, **scores, "train_loss": train_loss,
                    "bytes_sent": int(client_bytes.sum()), "bytes_sent_total": total_bytes,
                    "server_bytes_sent": server_bytes, "wall_seconds": progress.elapsed(),
                    "lr": tr.lr_at(t), "weight_mean_change": tr.weight_mean_change(), **extra_metrics,
                }
            results.append_round(metrics, rows, rounds_completed=rnd)
            if evaluated:
                progress.line(rnd, f"test_acc {scores['test_accuracy']:.4f}  bytes_sent {total_bytes / 1e6:,.1f} MB")
        stopping = watchdog.stop_requested() and rnd < cfg.rounds
        if rnd % cfg.checkpoint_every == 0 or stopping:
            arrays = tr.checkpoint_arrays()  # collective: the clients' rows are gathered to rank 0
            if rank0:
                results.write_checkpoint(
                    arrays, {"round": rnd, "bytes_sent_total": total_bytes, "wall_seconds": progress.elapsed()})
        if stopping:
            if rank0:
                results.close("preempted")
                print(f"stopped by signal after round {rnd}; resume with --resume (results: {cfg.out})", flush=True)
            return EXIT_PREEMPTED
    buffers = tr.buffers.checkpoint()  # collective: BatchNorm statistics, shared or every client's
    if rank0:
        results.write("model/final", tr.w)
        if buffers:
            results.write("model/buffers", buffers["buffers"])
        results.close("complete")
        if not cfg.quiet:
            print(f"results: {cfg.out}", file=sys.stdout, flush=True)
    return 0
