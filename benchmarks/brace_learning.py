"""Does BRACE learn? Fashion-MNIST, ring mean (RAR) against BRACE, and optionally the relay attacks.

Runs fedring's own training (``python -m fedring``) once per method in one MPI job and prints
each method's test error. Default setting (BRACE paper §5, scaled to 20 clients): 20 clients,
20 % Byzantine clients that behave honestly (no attack), Fang non-IID degree q = 0.5, batch 32,
the paper's CNN. BRACE's threshold defaults to lambda = 1, the paper's lambda / n = 5 / 100
scaled to n = 20; sign methods move every coordinate by lr per round, so they get a much
smaller lr than the mean (the paper gives neither).

    mpiexec -n 4 python benchmarks/brace_learning.py --clients 20 --rounds 300
    mpiexec -n 4 python benchmarks/brace_learning.py --clients 20 --rounds 300 --methods brace \\
        --relay-attack bias --relay-bias 1 --sign-zero 1 --check both

The second form measures how much Byzantine relays that tamper with the ring itself move the
test error of BRACE, with and without the integrity check (the Byzantine clients' gradients
stay honest; only their forwarding misbehaves).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import h5py
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from fedring.cli import main as fedring_main


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--byzantine", type=float, default=0.2)
    p.add_argument("--noniid", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--methods", default="mean,brace", help="comma list of ring rules: mean, brace, signsgd, rlr")
    p.add_argument("--lr-mean", type=float, default=0.1)
    p.add_argument("--lr-sign", type=float, default=1e-3)
    p.add_argument("--lam", type=float, default=1.0, help="BRACE lambda (default 1 = 5/100 of 20 clients)")
    p.add_argument("--sign-zero", type=int, default=0)
    p.add_argument("--relay-attack", default="none", choices=("none", "bias", "flip"))
    p.add_argument("--relay-bias", type=int, default=1)
    p.add_argument("--relay-flip-prob", type=float, default=1.0)
    p.add_argument("--check", default="off", choices=("off", "on", "both"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None, help="keep the HDF5 results here (default: a temporary directory)")
    return p.parse_args(argv)


def runs(args):
    """(label, extra CLI arguments) of every training run."""
    checks = ("off", "on") if args.check == "both" else (args.check,)
    for method in args.methods.split(","):
        if method == "mean":
            yield "ring mean (RAR)", ["--aggregator", "mean", "--lr", str(args.lr_mean)]
            continue
        sets = [f"{method}.sign_zero={args.sign_zero}"]
        if method == "brace":
            sets.append(f"brace.lambda={args.lam}")
        if args.relay_attack != "none":
            sets += [
                f"{method}.relay_attack={args.relay_attack}",
                f"{method}.relay_bias={args.relay_bias}",
                f"{method}.relay_flip_prob={args.relay_flip_prob}",
            ]
        for check in checks if method != "mean" else ("off",):
            label = method + (f" relay={args.relay_attack}" if args.relay_attack != "none" else "") + f" check={check}"
            extra = ["--aggregator", method, "--lr", str(args.lr_sign)]
            for s in [*sets, f"{method}.check={check}"]:
                extra += ["--set", s]
            yield label, extra


def summary(path: str) -> dict:
    with h5py.File(path, "r") as f:
        m = {k: f["metrics"][k][...] for k in f["metrics"]}
        sent = f["comm/bytes_sent"][...]
        detections = int(f["ring/detections"][...].sum()) if "ring/detections" in f else None
    out = {
        "rounds": int(m["round"][-1]),
        "final_error": 1 - float(m["test_accuracy"][-1]),
        "best_error": 1 - float(m["test_accuracy"].max()),
        "curve": [(int(r), 1 - float(a)) for r, a in zip(m["round"], m["test_accuracy"])],
        "bytes_per_client_round": float(sent.mean()),
    }
    for key in ("paper_formula_bytes", "relay_tampered_hops", "relay_flipped_signs"):
        if key in m:
            out[key] = float(m[key][-1])  # per round (the last evaluated one)
    if detections is not None:
        out["detections_all_rounds"] = detections
    return out


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    comm = MPI.COMM_WORLD
    out_dir = args.out_dir or (tempfile.mkdtemp(prefix="brace_learning_") if comm.rank == 0 else None)
    out_dir = comm.bcast(out_dir)
    common = [
        "--topology",
        "ring",
        "--dataset",
        "fashion-mnist",
        "--clients",
        str(args.clients),
        "--byzantine",
        str(args.byzantine),
        "--partition",
        "fang",
        "--noniid",
        str(args.noniid),
        "--rounds",
        str(args.rounds),
        "--eval-every",
        str(args.eval_every),
        "--batch-size",
        "32",
        "--seed",
        str(args.seed),
        "--overwrite",
        "--quiet",
    ]
    results = []
    for i, (label, extra) in enumerate(runs(args)):
        path = os.path.join(out_dir, f"run{i}.h5")
        t0 = time.perf_counter()
        code = fedring_main(common + extra + ["--out", path])
        seconds = time.perf_counter() - t0
        if code != 0:
            return code
        if comm.rank == 0:
            s = summary(path)
            s.update(label=label, seconds=seconds, lr=extra[extra.index("--lr") + 1])
            results.append(s)
            curve = "  ".join(f"{r}:{e:.3f}" for r, e in s["curve"])
            print(f"{label:<32} lr {s['lr']:<7} test error by round  {curve}", flush=True)
    if comm.rank == 0:
        print(
            f"\nFashion-MNIST, {args.clients} clients on {comm.size} ranks, {args.byzantine:.0%} Byzantine "
            f"(honest gradients), Fang q = {args.noniid}, {args.rounds} rounds, batch 32, seed {args.seed}"
        )
        print(
            f"{'method':<32}{'lr':>8}{'final err':>11}{'best err':>10}{'bytes/client/round':>20}{'seconds':>9}  extra"
        )
        for s in results:
            extra = {
                k: s[k]
                for k in ("paper_formula_bytes", "relay_tampered_hops", "relay_flipped_signs", "detections_all_rounds")
                if k in s
            }
            print(
                f"{s['label']:<32}{s['lr']:>8}{s['final_error']:>11.4f}{s['best_error']:>10.4f}"
                f"{s['bytes_per_client_round']:>20,.0f}{s['seconds']:>9.1f}  {extra}"
            )
        print(f"results: {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
