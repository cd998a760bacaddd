"""The ring all-reduce of ``n`` clients that all live on one rank, against a bare sum.

    python benchmarks/local_ring.py [--clients 100] [--sizes 100 10000 1000000] [--device cpu|cuda]
                                    [--repeats 21] [--json PATH]

On one rank every hop of the ring is a memory operation, so its time is the hops' arithmetic
plus the Python that drives ``2 (n - 1)`` steps; the reference is what a bare loop does with
the same rows: ``rows.sum(0)`` written back into every row. Both run on numpy rows and on torch
tensors (``--device``; on ``cuda`` each run ends with a synchronize), interleaved run by run,
after one untimed run of each. Prints the median seconds and ``ratio ring/bare sum`` per row kind
and size (docs/figures.md, the ring on one rank).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from mpi4py import MPI

from fedring.comm import Layout, Network, ring_allreduce


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--sizes", type=int, nargs="+", default=[100, 10_000, 1_000_000])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=21)
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

            times: dict[str, list[float]] = {"ring": [], "bare": []}
            for repeat in range(args.repeats + 1):
                for name, fn in (("ring", ring), ("bare", bare)):
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
            records.append(record)
            print(
                f"n={n} d={d} {kind} on {record['device']}: ring {ring_s * 1e3:.3f} ms, "
                f"bare sum {bare_s * 1e3:.3f} ms, ratio ring/bare sum: {record['ratio']:.2f}",
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
