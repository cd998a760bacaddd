"""Whether the blocked product gives the whole product's bits: NNM's mixing and bucketing's means.

    python benchmarks/blocked_products.py [--json PATH]

NNM's mixing and bucketing's bucket means for ``s >= 3`` multiply the rows by a 0/1 matrix. They
used one whole ``W @ X`` (OpenBLAS splits it over its own threads); they now use
``_kernels.combine``, BLAS on fixed column blocks in worker threads that run BLAS on one thread.
For each dtype and shape this counts the entries whose bits differ between the two, on rows of
mixed magnitudes and a W with n - 3 ones a row (NNM's at f = 3). The counts depend on the BLAS
build and the CPU; CHANGELOG quotes this machine's.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from fedring.aggregators import _kernels as K

ROWS = (3, 5, 12, 20, 33, 64, 100)
COLUMNS = (7, 300, 5000, 70_001, 300_001)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="also write the counts as JSON")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    records = []
    for dtype in (np.float32, np.float64):
        for n in ROWS:
            for d in COLUMNS:
                X = (rng.standard_normal((n, d)) * rng.choice([1e-3, 1.0, 1e3], size=(n, 1))).astype(dtype)
                W = np.zeros((n, n))
                for i in range(n):
                    W[i, rng.permutation(n)[: max(1, n - 3)]] = 1.0
                whole, blocked = W.astype(dtype) @ X, K.combine(W, X)
                word = np.dtype(f"u{whole.itemsize}")  # compare bits, the sign of a zero included
                differ = int(np.count_nonzero(whole.view(word) != blocked.view(word)))
                records.append({"dtype": np.dtype(dtype).name, "n": n, "d": d, "entries_that_differ": differ})
    for dtype in ("float32", "float64"):
        rows = [r for r in records if r["dtype"] == dtype]
        bad = [r for r in rows if r["entries_that_differ"]]
        print(f"{dtype}: {len(rows) - len(bad)} of {len(rows)} shapes with the same bits", flush=True)
        for r in bad:
            print(f"  n={r['n']} d={r['d']}: {r['entries_that_differ']} entries differ")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1)


if __name__ == "__main__":
    main()
