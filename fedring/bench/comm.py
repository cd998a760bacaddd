"""``python -m fedring bench comm``: the ring all-reduce against MPI's native Allreduce.

All run in the same job, interleaved run by run, one client per rank: MPI's native
Allreduce, the float32 ring, and the sign-voting rings of :mod:`fedring.comm.brace` (``brace``,
``signsgd``, ``rlr``: quantization, int8 Share-Reduce, consensus, packed Share-Only) on the
same float32 vectors. Reports, per (implementation, size), the median time of the repeats
and nccl-tests' bandwidths: ``algbw = bytes / seconds`` and ``busbw = algbw * 2 (n - 1) / n``
(bytes = elements x 4), the bytes each rank sent as measured by the ledger (native: the
ring's minimum, which MPI does not report), and time and bytes relative to the float32 ring.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from mpi4py import MPI

from fedring.comm import Layout, Network, ring_allreduce
from fedring.comm.brace import SIGN_RULES, SignVote
from fedring.runtime import world

#: the sign rules ``bench comm`` times: name -> (rule, its settings)
SIGN_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {rule: (rule, {}) for rule in SIGN_RULES}


def _time(
    impls: dict[str, tuple[Callable, Callable, Callable]],
    repeats: int,
    comm: MPI.Comm,
    probe: Callable[[], np.ndarray] | None = None,
) -> dict[str, tuple]:
    """name -> (median seconds, what ``sent`` returned after the last run, summed change of ``probe``).

    The repeats are interleaved (one run of each implementation in turn), so a change in the
    machine's load hits every implementation alike. ``probe`` (this rank's counters, e.g. a
    link's bytes) is read around each timed run, barrier and timing included; None: 0.
    """
    samples: dict[str, list[float]] = {name: [] for name in impls}
    sent_bytes = {}
    probed: dict[str, np.ndarray | int] = dict.fromkeys(impls, 0)
    for _ in range(repeats):
        for name, (prepare, fn, sent) in impls.items():
            prepare()
            before = probe() if probe else 0
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            samples[name].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            probed[name] = probed[name] + (probe() - before if probe else 0)
            sent_bytes[name] = sent()
    return {name: (float(np.median(samples[name])), sent_bytes[name], probed[name]) for name in impls}


def server_exchange(net: Network, rows: np.ndarray) -> np.ndarray:
    """The server topology's round exchange without its rule: every client's row up to rank 0
    (``uplink``), one ``d``-vector back down to every client (``downlink``)."""
    stacked = net.gather_to_server(rows, "uplink")
    vec = None if stacked is None else stacked[0]
    return net.broadcast_from_server(vec, "downlink", rows.shape[1:], rows.dtype)


def comm_impls(
    net: Network, comm: MPI.Comm, d: int, variants: dict[str, tuple[str, dict]] = SIGN_VARIANTS, server: bool = False
) -> dict[str, tuple[Callable, Callable, Callable]]:
    """name -> (prepare, run, bytes sent by this rank in one run): MPI's Allreduce, the float32
    ring, the sign rules ``variants`` (name -> (rule, settings)) and, if asked, the server's
    exchange (:func:`server_exchange`)."""
    rng = np.random.default_rng([7, comm.rank])
    source = rng.standard_normal(d).astype(np.float32)
    rows = np.empty((1, d), np.float32)
    out = np.empty(d, np.float32)

    def prepare():
        rows[0] = source
        net.ledger.reset()

    def ring_bytes():
        return int(net.ledger.client_bytes().sum())

    impls = {
        "native": (prepare, lambda: comm.Allreduce(source, out, op=MPI.SUM), lambda: -1),
        "ring": (prepare, lambda: ring_allreduce(net, rows), ring_bytes),
    }
    for name, (rule, params) in variants.items():
        vote = SignVote(rule, net.n_clients, params)
        impls[name] = (prepare, partial(vote, net, rows), ring_bytes)
    if server:
        impls["server"] = (prepare, lambda: server_exchange(net, rows), ring_bytes)
    return impls


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m fedring bench comm")
    p.add_argument("--min-exp", type=int, default=10, help="smallest size 2^k elements (default 10)")
    p.add_argument("--max-exp", type=int, default=24, help="largest size 2^k elements (default 24)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", metavar="PATH", help="also write the records as JSON")
    args = p.parse_args(argv)
    comm = world()
    n = comm.size
    net = Network(Layout(n, comm))
    records = []
    for e in range(args.min_exp, args.max_exp + 1):
        d = 2**e
        impls = comm_impls(net, comm, d)
        repeats = args.repeats if d < 2**22 else max(3, args.repeats // 2)
        ring_sent = None
        for name, (seconds, sent, _) in _time(impls, repeats, comm).items():
            sent_bytes = comm.allreduce(sent, op=MPI.MAX)
            if name == "ring":
                ring_sent = sent_bytes
            algbw = d * 4 / seconds
            records.append(
                {
                    "impl": name,
                    "ranks": n,
                    "elements": d,
                    "seconds": seconds,
                    "algbw": algbw,
                    "busbw": algbw * 2 * (n - 1) / n,
                    "bytes_per_rank": sent_bytes,
                }
            )
        for r in records:
            if r["elements"] == d and r["impl"] == "native":
                r["bytes_per_rank"] = ring_sent
    if comm.rank == 0:
        base = {(r["elements"]): r for r in records if r["impl"] == "ring"}
        print(
            f"{'impl':<10}{'ranks':>6}{'elements':>11}{'seconds':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}"
            f"{'bytes/rank':>14}{'time/ring':>11}{'bytes/ring':>12}"
        )
        for r in records:
            ratio = r["seconds"] / base[r["elements"]]["seconds"]
            r["time_ratio_to_ring"] = ratio
            r["bytes_ratio_to_ring"] = r["bytes_per_rank"] / max(base[r["elements"]]["bytes_per_rank"], 1)
            print(
                f"{r['impl']:<10}{r['ranks']:>6}{r['elements']:>11}{r['seconds']:>12.6f}{r['algbw'] / 1e9:>12.3f}"
                f"{r['busbw'] / 1e9:>12.3f}{r['bytes_per_rank']:>14}{ratio:>11.2f}{r['bytes_ratio_to_ring']:>12.3f}"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)
    return 0
