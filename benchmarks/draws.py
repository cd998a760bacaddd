"""The host's time to draw a round's mini-batch indices: per client, its generator
(``fedring.rng.generator``, against ``numpy.random.default_rng`` of the same key, the form before),
the round's generators made together (``fedring.rng.client_generators``, as ``Clients.batch_draws``
makes them), and its batch's sorted indices (``rng.choice`` without replacement, then ``np.sort``),
as ``Clients.batch_indices`` draws them. A round of 100 clients makes 100 of each: on a GPU the
device waits for them at the start of the round (docs/figures.md).

    python benchmarks/draws.py [--clients 100] [--shard 600] [--batch 32] [--repeats 41] [--few] [--json PATH]

Prints the medians over ``--repeats`` rounds of each, in µs per client, and the ratios of the
generators' times, measured in the same run, interleaved. ``--few`` also times, for rounds of 1 to
32 clients, ``client_generators`` made together against each client's own, interleaved, and prints
the fewest clients from which together is faster at every size timed (``fedring.rng.TOGETHER_FROM``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np

from fedring.rng import TOGETHER_FROM, Stream, client_generators, generator

FEW = (1, 2, 4, 6, 8, 10, 12, 16, 24, 32)


def medians(ways: dict[str, Callable[[int], object]], repeats: int, per: int) -> dict[str, float]:
    """Each way's median µs per ``per`` over ``repeats`` rounds, the ways interleaved, after one round
    of each to warm up."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for t in range(repeats + 1):
        for name, way in ways.items():
            start = time.perf_counter()
            way(t)
            if t:
                times[name].append((time.perf_counter() - start) / per * 1e6)
    return {name: float(np.median(ts)) for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--shard", type=int, default=600, help="samples per client (Fashion-MNIST's 60,000 over 100)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=41)
    p.add_argument("--few", action="store_true", help="also time rounds of 1 to 32 clients, together or each")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    seed, clients = 0, range(args.clients)

    def fedring(t: int) -> None:
        for c in clients:
            generator(seed, Stream.BATCH, client=c, step=t)

    def default_rng(t: int) -> None:
        for c in clients:
            np.random.default_rng([seed, c, t, int(Stream.BATCH)])

    def together(t: int) -> None:
        client_generators(seed, Stream.BATCH, list(clients), t, together=True)

    def batches(t: int) -> None:
        for c in clients:
            np.sort(generator(seed, Stream.BATCH, client=c, step=t).choice(args.shard, args.batch, replace=False))

    def round_batches(t: int) -> None:
        for rng in client_generators(seed, Stream.BATCH, list(clients), t, together=True):
            np.sort(rng.choice(args.shard, args.batch, replace=False))

    ways = {
        "generator": fedring,
        "default_rng(key)": default_rng,
        "client_generators": together,
        "generator, choice and sort": batches,
        "client_generators, choice and sort": round_batches,
    }
    us_per_client = medians(ways, args.repeats, args.clients)
    for name, us in us_per_client.items():
        print(f"{name:<36}{us:8.2f} µs per client")
    ratios = {
        "default_rng(key) / generator": us_per_client["default_rng(key)"] / us_per_client["generator"],
        "generator / client_generators": us_per_client["generator"] / us_per_client["client_generators"],
        "whole draw, generator / client_generators": us_per_client["generator, choice and sort"]
        / us_per_client["client_generators, choice and sort"],
    }
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}")
    record = {**vars(args), "us_per_client": us_per_client, "ratios": ratios}
    if args.few:
        few = {}
        print(f"clients  together  each  (µs per round; fedring.rng.TOGETHER_FROM = {TOGETHER_FROM})")
        for m in FEW:
            some = list(range(m))
            ways = {
                "together": lambda t, some=some: client_generators(seed, Stream.BATCH, some, t, together=True),
                "each": lambda t, some=some: client_generators(seed, Stream.BATCH, some, t, together=False),
            }
            few[m] = medians(ways, args.repeats, 1)
            print(f"{m:7d}  {few[m]['together']:8.1f}  {few[m]['each']:6.1f}")
        faster = [m for m in FEW if all(few[k]["together"] < few[k]["each"] for k in FEW if k >= m)]
        record["few"], record["together_from"] = few, faster[0] if faster else None
        print(f"together is faster from {record['together_from']} clients on")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
