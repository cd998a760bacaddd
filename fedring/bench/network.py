"""``python -m fedring bench network``: the ring, BRACE and the server's exchange in wall time on
an emulated cluster (:mod:`fedring.bench.netem`: namespaces as nodes, ``tc tbf`` links).

Run as root, without ``mpiexec``: the command builds ``--nodes`` nodes with links of ``--rate``
each way, starts one MPI job of ``--ranks-per-node`` ranks per node across them (one client per
rank) and times, interleaved run by run as ``bench comm`` does (:mod:`fedring.bench.comm`):
MPI's Allreduce (``native``), the float32 ring (``ring``), the sign rules (``brace``,
``brace_symmetric``, ``signsgd``, ``rlr``) and the server topology's round exchange
(``server``: every client's float32 row up to rank 0, one vector back down to every client).

Each record: ``op``, ``elements``, ``nodes``, ``ranks_per_node``, ``rate_bps``, ``seconds``
(median of the repeats), ``bound_seconds``, ``link_bytes`` (what the nodes' links sent in one
run, from the kernel's counters of each node's interface: payload, TCP/IP and Ethernet headers,
acknowledgements, MPI's own headers, the timing's barrier), ``ledger_bytes`` (the payload bytes
fedring's ledger counted on messages between nodes; None for ``native``, whose messages MPI
does not report), ``busiest_link_bytes`` (the kernel's count on the busiest direction of any
node's link) and ``retransmitted_segments`` (TCP segments the nodes sent again in one run, each
at most one frame more on the links; a mean when there are several repeats).

``bound_seconds`` is the time the op's bytes need at the link rate: for each of its phases one
after the other (reduce-scatter then all-gather; the uplink then the downlink), the ledger's
bytes on the phase's busiest link direction, divided by the rate. The ring moves
``2 (n - 1) / n * 4 d`` bytes each way over every node's link (``n`` ranks in all), the server
``(n - p) 4 d`` into rank 0's node and as many out of it (``p`` ranks per node). ``native`` is
given the ring's bound (the least any all-reduce needs).

``--train``: fedring's own training rounds instead (:func:`train_worker`): the headline's
model and data (``python -m fedring``: the ``cnn`` on Fashion-MNIST, 20 % of the clients
sending Gaussian noise) for the ring's mean, BRACE and the server's median, ``--rounds``
rounds of :func:`fedring.train.loop.train_round` each, evaluation off. Each round's wall time
is split in two: communication, the time inside the :class:`fedring.comm.Network`'s exchanges
(its ``timer``: messages, waits for peers, and the arithmetic a ring step does while its
messages travel), and compute, the rest (the clients' gradient steps, the attack, the server
rule, applying the update). Each record: ``rule``, ``seconds``, ``compute_seconds`` and
``comm_seconds`` of the median round after the first (a warm-up) by wall time: the slowest
rank's wall time and the ranks' mean split, so compute + communication <= seconds;
``bytes_per_round``, the ledger's (clients' and server's) for every round; ``per_round``,
every rank's ``[seconds, comm_seconds]`` in every round; ``load_average``, the machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from fedring.cli.launcher import launched_ranks
from fedring.errors import ConfigError

from . import netem

OPS = ("native", "ring", "brace", "brace_symmetric", "signsgd", "rlr", "server")
RING_PHASES = ("reduce_scatter", "all_gather")
SIGN_PHASES = ("share_reduce", "share_only")
PHASES = {
    "ring": RING_PHASES,
    "server": ("uplink", "downlink"),
    **{op: SIGN_PHASES for op in ("brace", "brace_symmetric", "signsgd", "rlr")},
}


#: ``--train``'s rules: the headline's ring rules (fedring.cli.run.HEADLINE) and a server rule
TRAIN_RULES = {
    "mean": ["--aggregator", "mean", "--lr", "0.1"],
    "brace": ["--aggregator", "brace", "--lr", "0.003"],
    "median": ["--topology", "server", "--aggregator", "median", "--lr", "0.1"],
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fedring bench network",
        description="the ring, BRACE and the server's exchange on an emulated cluster (as root)",
    )
    p.add_argument("--nodes", type=int, default=4, help="emulated nodes (default 4)")
    p.add_argument("--ranks-per-node", type=int, default=1, help="MPI ranks (one client each) per node (default 1)")
    p.add_argument(
        "--rate", default="1gbit", help="rate of each node's link, each way, as tc writes it (default 1gbit)"
    )
    p.add_argument("--sizes", default="20,22,24", help="vector sizes as log2 element counts (default 20,22,24)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each op and size (default 3)")
    p.add_argument("--ops", default=",".join(OPS), help=f"which to time (default all: {','.join(OPS)})")
    p.add_argument("--wait", choices=("sleep", "spin"), help="fedring's wait policy (sets FEDRING_WAIT; default: spin)")
    p.add_argument("--timeout", type=float, help="seconds the MPI job may take (default: from the sizes and rate)")
    p.add_argument("--json", metavar="FILE", help="also write the records as a JSON list")
    p.add_argument("--train", action="store_true", help="time training rounds instead (--rounds, --clients, --rules)")
    p.add_argument(
        "--rounds", type=int, default=10, help="with --train: rounds per rule, the first a warm-up (default 10)"
    )
    p.add_argument("--clients", type=int, help="with --train: clients (default: one per rank)")
    p.add_argument(
        "--rules", default=",".join(TRAIN_RULES), help=f"with --train: which rules (default {','.join(TRAIN_RULES)})"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def settings(argv: list[str]) -> argparse.Namespace:
    """Parse and check every option before any work starts (ConfigError naming the bad one)."""
    args = parser().parse_args(argv)
    args.rate_bps = netem.parse_rate(args.rate)
    if not 2 <= args.nodes <= 64:
        raise ConfigError("nodes", f"must be from 2 to 64, got {args.nodes}")
    if not 1 <= args.ranks_per_node <= 16:
        raise ConfigError("ranks-per-node", f"must be from 1 to 16, got {args.ranks_per_node}")
    try:
        args.log2_sizes = [int(v) for v in args.sizes.split(",")]
    except ValueError:
        raise ConfigError(
            "sizes", f"must be comma-separated log2 element counts (e.g. 20,22,24), got {args.sizes!r}"
        ) from None
    if not all(4 <= v <= 26 for v in args.log2_sizes):
        raise ConfigError("sizes", f"log2 element counts must be from 4 to 26, got {args.sizes}")
    if args.repeats < 1:
        raise ConfigError("repeats", f"must be at least 1, got {args.repeats}")
    args.op_list = args.ops.split(",")
    unknown = [op for op in args.op_list if op not in OPS]
    if unknown or not args.op_list:
        raise ConfigError("ops", f"unknown {', '.join(unknown) or 'empty list'}: choose from {', '.join(OPS)}")
    args.rule_list = args.rules.split(",")
    if any(rule not in TRAIN_RULES for rule in args.rule_list):
        raise ConfigError("rules", f"choose from {', '.join(TRAIN_RULES)}, got {args.rules!r}")
    if args.rounds < 2:
        raise ConfigError("rounds", f"must be at least 2 (the first is a warm-up), got {args.rounds}")
    if args.clients is not None and args.clients < args.nodes * args.ranks_per_node:
        raise ConfigError(
            "clients", f"must be at least one per rank ({args.nodes * args.ranks_per_node}), got {args.clients}"
        )
    if args.json:
        args.json = os.path.abspath(args.json)
        if not os.path.isdir(os.path.dirname(args.json)):
            raise ConfigError("json", f"{os.path.dirname(args.json)} is not a folder")
    return args


def expected_seconds(args: argparse.Namespace) -> float:
    """A generous limit for the job: five times every op's bound, plus start-up."""
    n, p = args.nodes * args.ranks_per_node, args.ranks_per_node
    per_element = 4 * 8 / args.rate_bps * (2 * 2 + 4 * 0.5 + 2 * (n - p))  # native+ring, sign rules, server
    if args.train:
        return 120 + 30 * args.rounds * len(args.rule_list)
    return 120 + 5 * (args.repeats + 1) * sum(2**e for e in args.log2_sizes) * per_element


def main(argv: list[str]) -> int:
    args = settings(argv)
    if args.worker:
        return train_worker(args) if args.train else worker(args)
    if launched_ranks()[1] > 1:
        raise ConfigError(
            "bench network", "builds its own cluster and starts the MPI job itself: run it without mpiexec"
        )
    lacks = netem.missing()
    if lacks:
        print(
            f"fedring: error: bench network needs root and ip, tc, unshare, nsenter, mpiexec: missing {', '.join(lacks)}",
            file=sys.stderr,
        )
        return 2
    if args.wait:
        os.environ["FEDRING_WAIT"] = args.wait
    program = ["-m", "fedring.bench.network", "--worker", *argv]
    return netem.run(args.nodes, args.rate_bps, args.ranks_per_node, program, args.timeout or expected_seconds(args))


def ledger_links(ledger, phases: tuple[str, ...], node_of: np.ndarray) -> np.ndarray:
    """``(phases, nodes, 2)``: payload bytes this rank's ledger counted on every node's link,
    out of the node (``[..., 0]``) and into it (``[..., 1]``), per phase.

    ``node_of[i]`` is the node of client ``i``. A ring phase's message goes from client ``i`` to
    ``i + 1``; an uplink message to the server on client 0's rank; the downlink is counted on
    the server's side, one message to each client.
    """
    n, nodes = len(node_of), int(node_of.max()) + 1
    out = np.zeros((len(phases), nodes, 2), np.int64)
    for k, phase in enumerate(phases):
        if phase == "downlink":
            src, dst = np.full(n, node_of[0]), node_of
            sent = np.full(n, ledger.server.get(phase, 0) // n, np.int64)
        else:
            src, dst = node_of, (np.full(n, node_of[0]) if phase == "uplink" else np.roll(node_of, -1))
            sent = ledger.phase_bytes(phase)
        cross = src != dst
        np.add.at(out[k, :, 0], src[cross], sent[cross])
        np.add.at(out[k, :, 1], dst[cross], sent[cross])
    return out


def worker(args: argparse.Namespace) -> int:
    """The MPI job on the cluster: time every op at every size, report, write the records."""
    from mpi4py import MPI

    from fedring.comm import Layout, Network

    from .comm import SIGN_VARIANTS, _time, comm_impls

    comm = MPI.COMM_WORLD
    p, nodes = args.ranks_per_node, args.nodes
    node = comm.rank // p  # hydra's -ppn places ranks in blocks
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    placed = local.size == p and local.allreduce(comm.rank, op=MPI.MIN) == node * p
    if not comm.allreduce(placed, op=MPI.LAND) or comm.size != nodes * p:
        raise RuntimeError(f"the job's ranks are not {p} per node in blocks over {nodes} nodes")
    leader = local.rank == 0
    net = Network(Layout(comm.size, comm))
    node_of = net.layout.owner(np.arange(comm.size)) // p
    rate_bytes = args.rate_bps / 8

    def probe() -> np.ndarray:
        counters = np.zeros((nodes, 3), np.int64)  # bytes sent, received, TCP segments sent again
        if leader:
            counters[node] = (*netem.link_counters(), netem.tcp_retransmits())
        return counters

    variants = {**SIGN_VARIANTS, "brace_symmetric": ("brace", {"rule": "symmetric"})}
    records = []
    for e in args.log2_sizes:
        d = 2**e
        impls = comm_impls(net, comm, d, variants, server=True)
        chosen = {op: impls[op] for op in args.op_list}
        for op, (prepare, fn, _) in list(chosen.items()):
            if op != "native":
                chosen[op] = (prepare, fn, lambda op=op: ledger_links(net.ledger, PHASES[op], node_of))
        for prepare, fn, _ in chosen.values():  # a warm-up run: connections, buffers, page faults
            prepare()
            fn()
        ring_bound = 2 * (comm.size - 1) / comm.size * 4 * d / rate_bytes
        for op, (seconds, links, wire) in _time(chosen, args.repeats, comm, probe).items():
            wire = comm.allreduce(wire, op=MPI.SUM) / args.repeats
            ledger = None if op == "native" else comm.allreduce(links, op=MPI.SUM)
            records.append(
                {
                    "op": op,
                    "elements": d,
                    "nodes": nodes,
                    "ranks_per_node": p,
                    "rate_bps": args.rate_bps,
                    "seconds": seconds,
                    "bound_seconds": ring_bound
                    if ledger is None
                    else float(ledger.max(axis=(1, 2)).sum() / rate_bytes),
                    "link_bytes": int(wire[:, 0].sum()),
                    "ledger_bytes": None if ledger is None else int(ledger[:, :, 0].sum()),
                    "busiest_link_bytes": int(wire[:, :2].max()),
                    "retransmitted_segments": float(wire[:, 2].sum()),
                    "wait": net.wait,
                }
            )
            if comm.rank == 0:
                print_record(records[-1], header=len(records) == 1)
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


def train_argv(rule: str, clients: int, rounds: int) -> list[str]:
    """``python -m fedring run``'s options for ``--train``'s runs of ``rule``: the headline's
    settings, ``rounds`` rounds, evaluation at the end only (never reached: rounds are run bare)."""
    from fedring.cli.run import HEADLINE_COMMON

    lam = ["--set", f"brace.lambda={0.05 * clients:g}"] if rule == "brace" else []
    return [
        *HEADLINE_COMMON,
        *TRAIN_RULES[rule],
        *lam,
        "--clients",
        str(clients),
        "--rounds",
        str(rounds),
        "--eval-every",
        str(rounds),
        "--quiet",
    ]


def train_worker(args: argparse.Namespace) -> int:
    """The MPI job on the cluster: ``--rounds`` training rounds of every rule, split into compute
    and communication, reported and written."""
    import time

    from mpi4py import MPI

    from fedring.cli.run import build_task
    from fedring.train.loop import train_round
    from fedring.train.trainer import Trainer

    comm = MPI.COMM_WORLD
    clients = args.clients or comm.size
    records = []
    for rule in args.rule_list:
        tr = Trainer(build_task(train_argv(rule, clients, args.rounds), comm.size).cfg, comm)
        split, sent = [], []
        for t in range(args.rounds):
            comm.Barrier()  # every round starts together: its wall time is the round's alone
            tr.net.timer = 0.0
            start = time.perf_counter()
            train_round(tr, t)
            seconds = time.perf_counter() - start
            split.append(comm.gather([seconds, tr.net.timer]))
            tr.net.timer = None
            client_bytes, server_bytes = tr.net.gather_ledger()
            if client_bytes is not None:  # rank 0
                sent.append(int(client_bytes.sum()) + server_bytes)
        if comm.rank == 0:
            ranks = np.array(split[1:])  # (rounds - 1, ranks, 2): after the warm-up round
            wall = ranks[:, :, 0].max(axis=1)
            median = ranks[np.argsort(wall)[(len(wall) - 1) // 2]]  # the median round (the lower of two)
            records.append(
                {
                    "rule": rule,
                    "topology": tr.cfg.topology,
                    "model": tr.cfg.model,
                    "dataset": tr.cfg.dataset,
                    "clients": clients,
                    "byzantine": len(tr.byzantine),
                    "parameters": tr.d,
                    "nodes": args.nodes,
                    "ranks_per_node": args.ranks_per_node,
                    "rate_bps": args.rate_bps,
                    "rounds": args.rounds,
                    "seconds": float(median[:, 0].max()),
                    "compute_seconds": float((median[:, 0] - median[:, 1]).mean()),
                    "comm_seconds": float(median[:, 1].mean()),
                    "bytes_per_round": sent,
                    "per_round": split,
                    "wait": tr.net.wait,
                    "load_average": list(os.getloadavg()),
                }
            )
            print_train_record(records[-1], header=len(records) == 1)
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


def print_train_record(r: dict, header: bool) -> None:
    if header:
        print(
            f"# training rounds: {r['nodes']} nodes x {r['ranks_per_node']} ranks, {r['clients']} clients, "
            f"{r['model']} ({r['parameters']} parameters), {r['rate_bps'] / 1e9:g} Gbit/s per link each way; "
            "the median round after the first"
        )
        print(f"{'rule':<10}{'seconds':>10}{'compute s':>11}{'comm s':>10}{'comm %':>8}{'MB/round':>10}{'load':>7}")
    print(
        f"{r['rule']:<10}{r['seconds']:>10.3f}{r['compute_seconds']:>11.3f}{r['comm_seconds']:>10.3f}"
        f"{100 * r['comm_seconds'] / r['seconds']:>8.1f}{r['bytes_per_round'][-1] / 1e6:>10.2f}"
        f"{r['load_average'][0]:>7.2f}",
        flush=True,
    )


def print_record(r: dict, header: bool) -> None:
    if header:
        print(
            f"# {r['nodes']} nodes x {r['ranks_per_node']} ranks, {r['rate_bps'] / 1e9:g} Gbit/s per link each way; "
            "bound: the ledger's bytes on the busiest link / rate; link/ledger: the kernel's count / the ledger's"
        )
        print(
            f"{'op':<16}{'elements':>10}{'seconds':>10}{'bound s':>10}{'x bound':>9}{'link MB':>10}{'ledger MB':>11}"
            f"{'link/ledger':>12}"
        )
    ledger, link = r["ledger_bytes"], r["link_bytes"]
    print(
        f"{r['op']:<16}{r['elements']:>10}{r['seconds']:>10.4f}{r['bound_seconds']:>10.4f}"
        f"{r['seconds'] / r['bound_seconds']:>9.2f}{link / 1e6:>10.2f}"
        f"{'-' if ledger is None else f'{ledger / 1e6:.2f}':>11}"
        f"{'-' if not ledger else f'{link / ledger:.4f}':>12}",
        flush=True,
    )


def _abort_job(*exc_info) -> None:
    """Any exception on any rank of the job ends the whole job (no rank waits for a dead peer)."""
    import traceback

    from mpi4py import MPI

    traceback.print_exception(*exc_info)
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)


if __name__ == "__main__":
    sys.excepthook = _abort_job
    sys.exit(main(sys.argv[1:]))
