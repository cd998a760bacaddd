"""The ring all-reduce of ``n`` clients that all live on one rank, against a bare sum.

    python benchmarks/local_ring.py [--clients 100] [--sizes 100 10000 1000000] [--device cpu|cuda]
                                    [--repeats 21] [--paths] [--json PATH]

On one rank every hop of the ring is a memory operation, so its time is the hops' arithmetic
plus the Python that drives ``2 (n - 1)`` steps; the reference is what a bare loop does with
the same rows: ``rows.sum(0)`` written back into every row. Both run on numpy rows and on torch
tensors (``--device``; on ``cuda`` each run ends with a synchronize), interleaved run by run,
after one untimed run of each. Prints the median seconds and ``ratio ring/bare sum`` per row kind
and size (docs/figures.md, the ring on one rank). ``--paths`` also times the ring with each of
the reduce-scatter's two ways on one rank forced (``Network.reduce_owned``: a padded copy of the
rows, one addition a step, or the rows' own layout, a few additions a step), interleaved with the
others: what ``fedring.comm.network.PADDED_BYTES`` chooses between.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI

from fedring.comm import Layout, Network, network, ring_allreduce


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--sizes", type=int, nargs="+", default=[100, 10_000, 1_000_000])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--paths", action="store_true", help="also time reduce_owned's padded and planned paths")
    p.add_argument("--json", help="also write the records as JSON")
    args = p.parse_args()
    device = torch.device(args.device)
    n, records = args.clients, []

    def finish() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for d in args.sizes:
        X = np.random.default_rng([n, d]).standard_normal((n, d)).astype(np.float32)
        for kind in ("numpy", "torch"):
            source = X if kind == "numpy" else torch.from_numpy(X).to(device)
            rows = source.copy() if kind == "numpy" else source.clone()
            net = Network(Layout(n, MPI.COMM_SELF))

            def ring(rows=rows, source=source, net=net) -> None:
                rows[...] = source
                ring_allreduce(net, rows)

            def bare(rows=rows, source=source) -> None:
                rows[...] = source
                rows[...] = source.sum(0)

            def forced(limit: int, ring=ring) -> Callable[[], None]:
                def run() -> None:
                    chosen, network.PADDED_BYTES = network.PADDED_BYTES, {"host": limit, "device": limit}
                    try:
                        ring()
                    finally:
                        network.PADDED_BYTES = chosen

                return run

            runs = [("ring", ring), ("bare", bare)]
            if args.paths:
                runs += [("padded", forced(1 << 62)), ("planned", forced(-1))]
            times: dict[str, list[float]] = {name: [] for name, _ in runs}
            for repeat in range(args.repeats + 1):
                for name, fn in runs:
                    finish()
                    start = time.perf_counter()
                    fn()
                    finish()
                    if repeat:
                        times[name].append(time.perf_counter() - start)
            ring_s, bare_s = (float(np.median(times[k])) for k in ("ring", "bare"))
            record = {
                "clients": n,
                "d": d,
                "rows": kind,
                "device": str(device) if kind == "torch" else "cpu",
                "ring_s": ring_s,
                "bare_sum_s": bare_s,
                "ratio": ring_s / bare_s,
            }
            if args.paths:
                record |= {f"{k}_s": float(np.median(times[k])) for k in ("padded", "planned")}
            records.append(record)
            print(
                f"n={n} d={d} {kind} on {record['device']}: ring {ring_s * 1e3:.3f} ms, "
                f"bare sum {bare_s * 1e3:.3f} ms, ratio ring/bare sum: {record['ratio']:.2f}"
                + (
                    f"; padded {record['padded_s'] * 1e3:.3f} ms, planned {record['planned_s'] * 1e3:.3f} ms"
                    if args.paths
                    else ""
                ),
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "records": records},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
