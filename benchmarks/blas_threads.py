"""Whether numpy's BLAS products run side by side in threads: the premise of the rules' host passes.

    python benchmarks/blas_threads.py [--rows 20,22,23,100] [--bytes 2097152] [--calls 200] [--json PATH]

The blocked passes of ``fedring.aggregators._kernels`` split the columns over worker threads,
each calling single-threaded BLAS on its block; they gain from the threads only where the call
releases the GIL. This times ``calls`` products of one form on one worker, then the same on every
worker at once (each on its own block of about ``bytes``), and prints the speed-up: about the
number of workers where the GIL is released, about 1 where it is held. The forms are the passes'
own: the Gram block ``B Bᵀ`` (syrk), a block times a vector, a vector times a block, each written
with ``@`` and with ``np.dot``; then an element-wise addition and ``np.vecdot`` of 256-value
segments as references; for each number of rows. With numpy 2.4 ``@`` holds the GIL when the
product has at most 500 entries: a Gram block of up to 22 rows, a block times a vector
(docs/figures.md, "The rules' products in threads").
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from fedring.aggregators import _kernels as K


def forms(B: np.ndarray, v: np.ndarray, u: np.ndarray, S: np.ndarray) -> dict:
    return {
        "B @ B.T": lambda: B @ B.T,
        "np.dot(B, B.T)": lambda: np.dot(B, B.T),
        "B @ v": lambda: B @ v,
        "np.dot(B, v)": lambda: np.dot(B, v),
        "u @ B": lambda: u @ B,
        "np.dot(u, B)": lambda: np.dot(u, B),
        "np.add(B, B)": lambda: np.add(B, B),
        "np.vecdot(S, S)": lambda: np.vecdot(S, S),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="20,22,23,100", help="comma-separated rows of a block")
    p.add_argument("--bytes", type=int, default=2 << 20, help="bytes of a block (the Gram pass's)")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5, help="median of this many timings of each")
    p.add_argument("--json", help="also write the records as JSON")
    args = p.parse_args()
    pool, workers = K._pool_executor(), K.n_workers()
    rng = np.random.default_rng(0)
    records = []
    print(f"{workers} workers, float32 blocks of {args.bytes} bytes, {args.calls} calls, numpy {np.__version__}")
    for rows in map(int, args.rows.split(",")):
        width = args.bytes // (4 * rows) // 256 * 256
        per_worker = []
        for _ in range(workers):
            B = rng.standard_normal((rows, width)).astype(np.float32)
            per_worker.append(forms(B, B[0].copy(), B[:, 0].copy(), B.reshape(-1, 256)))
        print(f"{rows} x {width}")
        for name in per_worker[0]:

            def run(i: int, name: str = name, per_worker: list = per_worker) -> None:
                fn = per_worker[i][name]
                for _ in range(args.calls):
                    fn()

            pool.submit(run, 0).result()  # warm up
            one, all_ = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                pool.submit(run, 0).result()
                one.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                list(pool.map(run, range(workers)))
                all_.append(time.perf_counter() - t0)
            t1, tn = float(np.median(one)), float(np.median(all_))
            speedup = workers * t1 / tn
            records.append(
                {
                    "rows": rows,
                    "width": width,
                    "form": name,
                    "one_worker_s": t1,
                    "all_workers_s": tn,
                    "speedup": speedup,
                }
            )
            print(
                f"  {name:18s} one worker {t1 * 1e3:8.2f} ms   {workers} workers {tn * 1e3:8.2f} ms   speed-up {speedup:.2f}"
            )
    if args.json:
        meta = {"workers": workers, "bytes": args.bytes, "calls": args.calls, "numpy": np.__version__}
        meta["machine"] = platform.processor() or platform.machine()
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
