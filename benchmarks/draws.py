"""The host's time to draw a round's mini-batch indices: per client, its generator
(``fedring.rng.generator``, against ``numpy.random.default_rng`` of the same key, the form before),
the round's generators made together (``fedring.rng.client_generators``, as ``Clients.batch_draws``
makes them), and its batch's sorted indices (``rng.choice`` without replacement, then ``np.sort``),
as ``Clients.batch_indices`` draws them. A round of 100 clients makes 100 of each: on a GPU the
device waits for them at the start of the round (docs/figures.md).

    python benchmarks/draws.py [--clients 100] [--shard 600] [--batch 32] [--repeats 41] [--json PATH]

Prints the medians over ``--repeats`` rounds of each, in µs per client, and the ratios of the
generators' times, measured in the same run, interleaved.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from fedring.rng import Stream, client_generators, generator


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--shard", type=int, default=600, help="samples per client (Fashion-MNIST's 60,000 over 100)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=41)
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
        client_generators(seed, Stream.BATCH, list(clients), t)

    def batches(t: int) -> None:
        for c in clients:
            np.sort(generator(seed, Stream.BATCH, client=c, step=t).choice(args.shard, args.batch, replace=False))

    def round_batches(t: int) -> None:
        for rng in client_generators(seed, Stream.BATCH, list(clients), t):
            np.sort(rng.choice(args.shard, args.batch, replace=False))

    ways = {
        "generator": fedring,
        "default_rng(key)": default_rng,
        "client_generators": together,
        "generator, choice and sort": batches,
        "client_generators, choice and sort": round_batches,
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for t in range(args.repeats + 1):
        for name, way in ways.items():
            start = time.perf_counter()
            way(t)
            if t:  # the first round warms up
                times[name].append((time.perf_counter() - start) / args.clients * 1e6)
    medians = {name: float(np.median(ts)) for name, ts in times.items()}
    for name, us in medians.items():
        print(f"{name:<36}{us:8.2f} µs per client")
    ratios = {
        "default_rng(key) / generator": medians["default_rng(key)"] / medians["generator"],
        "generator / client_generators": medians["generator"] / medians["client_generators"],
        "whole draw, generator / client_generators": medians["generator, choice and sort"]
        / medians["client_generators, choice and sort"],
    }
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**vars(args), "us_per_client": medians, "ratios": ratios}, f, indent=1)


if __name__ == "__main__":
    main()
