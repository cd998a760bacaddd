"""Where the sorting network beats the transposed sort: the coordinate-wise rules' sorting pass.

    python benchmarks/sorted_columns.py [--clients 4,8,...] [--values 20971520] [--repeats 5] [--json PATH]

``_kernels.for_sorted_rows`` sorts the columns of up to ``NETWORK_MAX`` clients with Batcher's
network over whole rows (blocks of ``NETWORK_BYTES``), larger ones as transposed blocks sorted
with numpy (``for_sorted_columns``). For each number of clients n, on n x (values / n) float32
rows, this times one pass of each way (the network at 2, 4 and 8 MiB blocks), every thread busy,
the median of ``repeats`` calls, and prints the transposed sort's time over the network's: the
network pays where that ratio is above 1. The values sorted are the same either way.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from fedring.aggregators import _kernels as K

CLIENTS = (4, 8, 12, 16, 18, 20, 22, 24, 32, 48, 64)
BLOCKS = (2 << 20, 4 << 20, 8 << 20)


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default=",".join(map(str, CLIENTS)), help="comma-separated client counts")
    p.add_argument("--values", type=int, default=20 << 20, help="values per pass (default 20 x 2^20)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="also write the records as JSON")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    noop = lambda sl, S: None  # noqa: E731 (the pass alone)
    records = []
    network_max, network_bytes = K.NETWORK_MAX, K.NETWORK_BYTES
    clients = [int(c) for c in args.clients.split(",")]
    K.NETWORK_MAX = max(clients)  # the network at every n
    try:
        for n in clients:
            X = rng.standard_normal((n, args.values // n), dtype=np.float32)
            rec = {"clients": n, "comparators": len(K.sorting_network(n))}
            rec["transposed_sort_s"] = timed(lambda X=X: K.for_sorted_columns(X, noop), args.repeats)
            for block in BLOCKS:
                K.NETWORK_BYTES = block
                rec[f"network_{block >> 20}MiB_s"] = timed(lambda X=X: K.for_sorted_rows(X, noop), args.repeats)
            K.NETWORK_BYTES = network_bytes
            rec["sort_over_network"] = rec["transposed_sort_s"] / rec[f"network_{network_bytes >> 20}MiB_s"]
            records.append(rec)
            nets = "  ".join(f"{b >> 20} MiB {rec[f'network_{b >> 20}MiB_s'] * 1e3:6.1f}" for b in BLOCKS)
            print(
                f"n={n:3d} comparators {rec['comparators']:4d}  sort {rec['transposed_sort_s'] * 1e3:6.1f} ms"
                f"  network: {nets} ms  sort / network ({network_bytes >> 20} MiB) {rec['sort_over_network']:.2f}",
                flush=True,
            )
    finally:
        K.NETWORK_MAX, K.NETWORK_BYTES = network_max, network_bytes
    if args.json:
        meta = {"machine": platform.processor() or platform.machine(), "threads": K.n_workers(), "values": args.values}
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "records": records}, fh, indent=1)


if __name__ == "__main__":
    main()
