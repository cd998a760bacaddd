"""``python -m fedring bench aggregators``: one aggregation call per rule, against the FedSECA paper.

The FedSECA paper (Supp. Table C.2) timed one aggregation call on the 11.2 M-parameter
ResNet-18 vector on an 8-vCPU CPU. This benchmark times every fedring rule on random
float32 input of the same shape (seeded ``numpy.random.Generator``), reports the median
wall time of the repeats and the process CPU time over all threads (which other
processes' load does not inflate), with the ``mean`` rule as the yardstick of the same
run, the paper's figure
for the same client count where it has one, and the peak extra memory of one call as
tracked by ``tracemalloc`` (numpy reports its allocations to it), as a multiple of the
(n, d) input. Stateful rules run with a filled state (FL-Detector: a full history window,
so the L-BFGS prediction and the gap statistic run); the state's own size is reported
separately. A rule that reads the round's model (DeepSight) gets the probe of a one-hidden-layer
MLP on 1 x 28 x 28 images holding ``probe_dim(d)`` parameters (:func:`probe_for`): ``d`` rounded
down to ``795 h + 10`` for h hidden units, and the rule is timed on the rows' first that many
columns (its record's ``dim``).

Targets (issue 4): for the paper's client counts, at least 10x faster than the paper for
every rule it timed above 10 s, at least 2x for the others, and never more than 3 input
copies of extra memory.

``--device DEV`` (``cpu``, ``cuda``, ``cuda:1`` ...) times each rule on the same rows as a torch
tensor on that device instead (docs/arrays.md, "Measuring on a GPU"): the call includes the
rule's own copies to the host if it runs there (``on_device`` false), a CUDA device is
synchronised before and after it, and the memory is the peak of
``torch.cuda.max_memory_allocated`` above what was allocated before the call (on the CPU device
only numpy's allocations are traced, so none is reported). With ``--device cpu`` the numpy
figure of the same rule is measured beside it. Targets are not checked on a device.
``--byzfl`` also times ByzFL 0.0.11's torch implementation of the rules it has, on the same
tensor on the same device and with the same f and parameters (:data:`BYZFL`), and prints the
ratio ByzFL / fedring of each and their geometric mean; ByzFL is an optional import (its
aggregator modules alone, without the package's training framework).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import sys
import time
import tracemalloc
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from fedring.aggregators import make_aggregator
from fedring.errors import ConfigError

# FedSECA paper, Supp. Table C.2 (seconds, mean of 5): clients -> time
PAPER = {
    "FedAvg": {4: 0.20, 8: 0.35, 16: 0.50, 32: 1.37, 64: 2.69, 128: 5.69, 256: 11.52},
    "Krum": {4: 0.59, 8: 1.79, 16: 6.28, 32: 24.49, 64: 95.84, 128: 383.56, 256: 1606.68},
    "RFA": {4: 0.86, 8: 1.48, 16: 2.61, 32: 5.69, 64: 11.54, 128: 23.80, 256: 48.55},
    "CWTM": {4: 1.62, 8: 3.46, 16: 8.20, 32: 19.76, 64: 44.42, 128: 99.80, 256: 219.33},
    "HuberLoss": {4: 1.47, 8: 2.04, 16: 2.73, 32: 5.81, 64: 11.50, 128: 23.60, 256: 35.64},
    "CClipping": {4: 1.21, 8: 2.20, 16: 4.04, 32: 8.49, 64: 16.92, 128: 35.09, 256: 70.87},
    "CC-RandBucket": {4: 0.97, 8: 1.77, 16: 2.63, 32: 6.51, 64: 12.58, 128: 26.87, 256: 53.06},
    "CC-SeqBucket": {4: 1.11, 8: 2.14, 16: 2.91, 32: 8.39, 64: 16.97, 128: 34.84, 256: 70.39},
    "COPOD-DOS": {4: 2.66, 8: 8.70, 16: 32.68, 32: 127.52, 64: 503.49, 128: 2036.33, 256: 8663.10},
    "FL-Detector": {4: 1.55, 8: 2.81, 16: 5.89, 32: 12.51, 64: 23.49, 128: 46.40, 256: 94.14},
    "TIES-Merging": {4: 1.89, 8: 3.36, 16: 6.25, 32: 12.40, 64: 24.71, 128: 51.46, 256: 107.06},
    "FedSECA": {4: 4.87, 8: 12.30, 16: 37.79, 32: 125.27, 64: 456.32, 128: 1791.72, 256: 8073.35},
}

# benchmark entry -> (rule, params, pre-aggregators, paper row); the paper's settings where it has them
ENTRIES: dict[str, tuple[str, dict, tuple, str | None]] = {
    "mean": ("mean", {}, (), "FedAvg"),
    "krum": ("krum", {}, (), "Krum"),
    "multikrum": ("multikrum", {}, (), None),
    "median": ("median", {}, (), None),
    "trimmed_mean": ("trimmed_mean", {"fraction": 0.2}, (), "CWTM"),
    "geomed": ("geomed", {}, (), "RFA"),
    "huber": ("huber", {}, (), "HuberLoss"),
    "cclip": ("cclip", {}, (), "CClipping"),
    "cclip-random": ("cclip", {"bucketing": "random"}, (), "CC-RandBucket"),
    "cclip-sequential": ("cclip", {"bucketing": "sequential"}, (), "CC-SeqBucket"),
    "copod": ("copod", {}, (), "COPOD-DOS"),
    "fldetector": ("fldetector", {}, (), "FL-Detector"),
    "ties": ("ties", {}, (), "TIES-Merging"),
    "fedseca": ("fedseca", {}, (), "FedSECA"),
    "bulyan": ("bulyan", {}, (), None),
    "mca": ("mca", {}, (), None),
    "signsgd": ("signsgd", {}, (), None),
    "rlr": ("rlr", {}, (), None),
    "fltrust": ("fltrust", {}, (), None),
    "zenopp": ("zenopp", {}, (), None),
    "hplus": ("hplus", {}, (), None),
    "hplus-krum": ("hplus", {"base": "krum"}, (), None),
    "hplus-clean": ("hplus", {"mode": "clean"}, (), None),
    "nnm+mean": ("mean", {}, ("nnm",), None),
    "bucketing+mean": ("mean", {}, ("bucketing",), None),
    "clipping+mean": ("mean", {}, ("clipping",), None),
    # ByzFL's rules (its defaults; MoNNA's reference row is client 0's, as ByzFL's idx=0)
    "mda": ("mda", {}, (), None),
    "monna-0": ("monna", {"idx": 0}, (), None),
    "meamed": ("meamed", {}, (), None),
    "caf": ("caf", {}, (), None),
    "caf-byzfl": ("caf", {"variant": "byzfl"}, (), None),
    "smea": ("smea", {}, (), None),
    "arc+mean": ("mean", {}, ("arc",), None),
    # FLPoison's rules (its defaults)
    "dnc": ("dnc", {}, (), None),
    "signguard": ("signguard", {}, (), None),
    "flame": ("flame", {}, (), None),
    "foolsgold": ("foolsgold", {}, (), None),
    "normclipping": ("normclipping", {}, (), None),
    "simpleclustering": ("simpleclustering", {}, (), None),
    "auror": ("auror", {}, (), None),
    "auror-ol": ("auror", {"output": 1010}, (), None),  # a 10 x 100 output layer and its bias, as the race's model
    "crfl": ("crfl", {}, (), None),
    "lasa": ("lasa", {}, (), None),
    # its defaults but num_samples (the rule's 2000, FLPoison's 20000): the call runs 3 x num_samples inputs through
    # each client's model of d parameters, 4.3e12 multiply-adds at 2000, n = 64 and the default --dim; the model
    # is probe_for's, on the rows' first probe_dim(d) columns
    "deepsight": ("deepsight", {"num_samples": 100}, (), None),
    # Blades' rule
    "clippedclustering": ("clippedclustering", {}, (), None),
}


#: one step of a ByzFL pipeline: a class of ``byzfl.aggregators`` and its constructor's arguments
Step = tuple[str, dict[str, Any]]

#: entry -> ByzFL 0.0.11's pipeline of the same rule with the same f and parameters
#: (``byzfl/aggregators/aggregators.py``, ``preaggregators.py``): pre-aggregators, then the rule
BYZFL: dict[str, Callable[[int, int], list[Step]]] = {
    "mean": lambda f, n: [("Average", {})],
    "median": lambda f, n: [("Median", {})],
    "trimmed_mean": lambda f, n: [("TrMean", {"f": math.floor(0.2 * n + 1e-12)})],  # fedring's fraction 0.2
    "krum": lambda f, n: [("Krum", {"f": f})],
    "multikrum": lambda f, n: [("MultiKrum", {"f": f})],
    "geomed": lambda f, n: [("GeometricMedian", {"nu": 1e-6, "T": 100})],  # fedring's nu and iteration cap
    "cclip": lambda f, n: [("CenteredClipping", {"L": 3, "tau": 100.0})],  # fedring's 3 iterations, tau 100
    "cclip-random": lambda f, n: [("Bucketing", {"s": 2}), ("CenteredClipping", {"L": 1, "tau": 100.0})],
    "mda": lambda f, n: [("MDA", {"f": f})],
    "monna-0": lambda f, n: [("MoNNA", {"f": f, "idx": 0})],
    "meamed": lambda f, n: [("Meamed", {"f": f})],
    "caf-byzfl": lambda f, n: [("CAF", {"f": f})],
    "smea": lambda f, n: [("SMEA", {"f": f})],
    "nnm+mean": lambda f, n: [("NNM", {"f": f}), ("Average", {})],
    "bucketing+mean": lambda f, n: [("Bucketing", {"s": 2}), ("Average", {})],
    "clipping+mean": lambda f, n: [("Clipping", {"c": 2.0}), ("Average", {})],
    "arc+mean": lambda f, n: [("ARC", {"f": f}), ("Average", {})],
}

#: ByzFL's MDA and SMEA try every subset of n - f rows; above this many the call is not timed
BYZFL_SUBSETS = 100_000


def byzfl_module() -> types.ModuleType | None:
    """ByzFL's ``byzfl.aggregators`` (rules and pre-aggregators), or None if ByzFL is not installed.

    The package's ``__init__`` imports its training framework too (torchvision, matplotlib ...);
    the aggregators need only torch, numpy and scipy, so the package is entered without it.
    """
    spec = importlib.util.find_spec("byzfl")
    if spec is None or not spec.submodule_search_locations:
        return None
    if "byzfl" not in sys.modules:
        package = types.ModuleType("byzfl")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["byzfl"] = package
    try:
        return importlib.import_module("byzfl.aggregators")
    except ImportError as e:  # its aggregators import scipy (for numpy input)
        print(f"--byzfl: ByzFL's aggregators cannot be imported ({e}); its rules are not timed")
        return None


def byzfl_pipeline(module: types.ModuleType, name: str, f: int, n: int) -> tuple[str, Callable[[Any], Any]] | str:
    """ByzFL's pipeline for entry ``name`` as (its description, the call), or why it is not timed."""
    spec = BYZFL[name](f, n)
    text = " -> ".join(f"{cls}({', '.join(f'{k}={v!r}' for k, v in kw.items())})" for cls, kw in spec)
    if name in ("mda", "smea") and math.comb(n, f) > BYZFL_SUBSETS:
        return f"ByzFL's {text} tries C({n}, {f}) = {math.comb(n, f):.2e} subsets"
    steps = [getattr(module, cls)(**kw) for cls, kw in spec]

    def call(x: Any) -> Any:
        for step in steps:
            x = step(x)
        return x

    return text, call


def declared_f(n: int) -> int:
    """The largest f every rule accepts (Bulyan's n >= 4f + 3)."""
    return max(0, (n - 3) // 4)


#: DeepSight's probe model: an MLP on 1 x 28 x 28 images (Fashion-MNIST's), one hidden ReLU layer, 10 classes
PROBE_SHAPE = (1, 28, 28)
PROBE_CLASSES = 10
#: the parameters of one hidden unit: its 784 weights and bias, and its 10 weights in the output layer
PROBE_UNIT = math.prod(PROBE_SHAPE) + 1 + PROBE_CLASSES
#: the probe's learning rate (client i's model is w - lr x_i): the rows' standard normal entries then move the
#: weights (torch's default, uniform within 1 / sqrt(784) = 0.036 in the hidden layer) by 0.01 in standard
#: deviation, the scaled-up rows by 0.1
PROBE_LR = 0.01


def probe_dim(d: int) -> int:
    """The parameters of the widest probe MLP (:data:`PROBE_SHAPE`) that fit in ``d``; 0 if none does.

    ``h`` hidden units hold ``795 h`` parameters (:data:`PROBE_UNIT`) and the output layer's 10 biases
    come on top, so ``d`` is rounded down to ``795 h + 10``:

    >>> probe_dim(65536), probe_dim(11_200_000), probe_dim(804)
    (65200, 11199970, 0)
    """
    hidden = (d - PROBE_CLASSES) // PROBE_UNIT
    return hidden * PROBE_UNIT + PROBE_CLASSES if hidden >= 1 else 0


def probe_for(d: int, seed: int) -> tuple[Any, Any]:
    """The probe MLP of ``probe_dim(d)`` parameters, initialised as torch does from ``seed`` (torch's global
    generator is left as it was), and its :class:`fedring.train.probe.ModelProbe` bound to those weights and
    :data:`PROBE_LR`."""
    import torch
    from mpi4py import MPI

    from fedring.comm import Layout
    from fedring.train.probe import ModelProbe, output_layer
    from fedring.train.state import ModelBuffers

    fan_in = math.prod(PROBE_SHAPE)
    hidden = (probe_dim(d) - PROBE_CLASSES) // PROBE_UNIT
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(fan_in, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, PROBE_CLASSES),
        )
    w = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
    buffers = ModelBuffers(model, "aggregate", Layout(1, MPI.COMM_SELF))
    probe = ModelProbe(model, output_layer(model, PROBE_CLASSES, PROBE_SHAPE), PROBE_SHAPE, buffers)
    return model, probe.at(w, PROBE_LR)


def prepared_state(agg, n: int, d: int, rng: np.random.Generator) -> dict:
    """A state as after many rounds (so every branch of the rule runs)."""
    state = agg.init_state(n, d)
    if "center" in state:
        state["center"][:] = rng.standard_normal(d, dtype=np.float32)
    if "aggs" in state:  # FL-Detector: a full window of history
        N = state["scores"].shape[0]
        state["aggs"][:] = rng.standard_normal(state["aggs"].shape, dtype=np.float32)
        state["prev"][:] = rng.standard_normal((n, d), dtype=np.float32)
        state["scores"][:] = rng.uniform(size=state["scores"].shape)
        state["round"][...] = N + 1
        state["nscores"][...] = N
    return state


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Inside the block, the objects that exist at its start (torch's, a peer's, the inputs) are out of
    every garbage collection (``gc.freeze``): the collection before each timed call then walks the
    calls' own garbage only, instead of every object torch made, which evicts the caches before
    each call."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def measure(agg, X: np.ndarray, ref: np.ndarray, state: dict, repeats: int, seed: int) -> dict:
    """Median wall time of ``repeats`` calls, then peak extra memory of one more call.

    The calls share one state, as successive rounds do (it stays filled).
    """
    times, cpu = [], []
    for r in range(repeats):
        gc.collect()
        c0, t0 = time.process_time(), time.perf_counter()
        agg.aggregate(X, state=state, reference=ref, rng=np.random.default_rng([seed, r]))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    gc.collect()
    tracemalloc.start()
    agg.aggregate(X, state=state, reference=ref, rng=np.random.default_rng([seed, repeats]))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        "seconds": float(np.median(times)),
        "times": times,
        "cpu_seconds": float(np.median(cpu)),
        "peak_bytes": int(peak),
    }


class Device:
    """Timing on a torch device: the rows there, a clock that waits for the device, its memory peak."""

    def __init__(self, name: str):
        import torch

        self.torch = torch
        try:
            self.device = torch.device(name)
        except RuntimeError:
            raise ConfigError("--device", f"not a torch device: {name!r}") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device", f"{name!r} but no GPU is visible to this process")
        self.cuda = self.device.type == "cuda"
        self.out_of_memory = (torch.cuda.OutOfMemoryError, MemoryError)
        self.name = torch.cuda.get_device_name(self.device) if self.cuda else platform.processor() or "cpu"

    def put(self, a: np.ndarray) -> Any:
        return self.torch.from_numpy(a).to(self.device)

    def release(self) -> None:
        """Give the memory of a call that failed back to the device."""
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[int], Any], repeats: int) -> dict:
        """Median wall time of ``repeats`` calls ``fn(r)`` after an untimed one (the device's first
        calls load kernels and fill its allocator's cache), then the device memory peak of one more
        above what was allocated before it (None off CUDA)."""
        fn(-1)
        times = []
        for r in range(repeats):
            gc.collect()
            self.sync()
            t0 = time.perf_counter()
            fn(r)
            self.sync()
            times.append(time.perf_counter() - t0)
        peak = None
        if self.cuda:
            gc.collect()
            before = self.torch.cuda.memory_allocated(self.device)
            self.torch.cuda.reset_peak_memory_stats(self.device)
            fn(repeats)
            self.sync()
            peak = self.torch.cuda.max_memory_allocated(self.device) - before
        return {"seconds": float(np.median(times)), "times": times, "peak_bytes": peak}

    def measure(self, agg, X: Any, ref: Any, state: dict, repeats: int, seed: int) -> dict:
        """:func:`measure` on the device: the rule's calls on the tensors ``X`` and ``ref``."""
        return self.time(
            lambda r: agg.aggregate(
                X, state=state, reference=ref, rng=np.random.default_rng([seed, r % (repeats + 1)])
            ),
            repeats,
        )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m fedring bench aggregators", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="16,64", help="comma-separated client counts (default 16,64)")
    p.add_argument("--dim", type=int, default=11_200_000, help="vector length (default 11200000, ResNet-18)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per rule (default 3; median reported)")
    p.add_argument("--rules", help=f"comma-separated entries (default all): {','.join(ENTRIES)}")
    p.add_argument("--json", metavar="PATH", help="also write the records as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device", help="time the rules on the rows as a torch tensor on this device (cpu, cuda ...) instead"
    )
    p.add_argument("--byzfl", action="store_true", help="with --device: also time ByzFL's rules (where installed)")
    args = p.parse_args(argv)
    try:
        clients = [int(c) for c in args.clients.split(",") if c]
    except ValueError:
        raise ConfigError("--clients", f"expected comma-separated integers, got {args.clients!r}") from None
    if not clients or min(clients) < 1:
        raise ConfigError("--clients", "client counts must be >= 1")
    if args.dim < 1 or args.repeats < 1:
        raise ConfigError("--dim" if args.dim < 1 else "--repeats", "must be >= 1")
    names = list(ENTRIES) if not args.rules else [r for r in args.rules.split(",") if r]
    unknown = [r for r in names if r not in ENTRIES]
    if unknown:
        raise ConfigError("--rules", f"unknown {', '.join(unknown)}; allowed: {', '.join(ENTRIES)}")
    if "mean" not in names:
        names.insert(0, "mean")  # the yardstick
    if args.byzfl and args.device is None:
        raise ConfigError("--byzfl", "times ByzFL's torch rules on a device: give --device too")
    dev = None if args.device is None else Device(args.device)
    if args.byzfl and "byzfl" not in sys.modules and importlib.util.find_spec("byzfl") is None:
        print("--byzfl: ByzFL is not installed (pip install --no-deps byzfl==0.0.11); its rules are not timed")
    byzfl = byzfl_module() if args.byzfl else None

    records = []
    for n in clients:
        rng = np.random.default_rng([args.seed, n])
        X = rng.standard_normal((n, args.dim), dtype=np.float32)
        X[: max(1, n // 8)] *= 10.0  # a few large rows, so clipping and outlier rules have work to do
        ref = rng.standard_normal(args.dim, dtype=np.float32)
        f = declared_f(n)
        on_dev = None if dev is None else (dev.put(X), dev.put(ref))
        with frozen_heap():
            yardstick = None
            for name in names:
                rule, params, pre, paper_row = ENTRIES[name]
                agg = make_aggregator(rule, f, params, pre)
                reason = agg.check(n)
                if reason is not None:
                    print(f"skip {name} at n={n}: {reason}", flush=True)
                    continue
                rows, rows_ref, rows_dev = X, ref, on_dev
                if agg.needs_probe:  # it reads the round's model, of probe_dim(d) parameters
                    d = probe_dim(args.dim)
                    if d == 0:
                        print(
                            f"skip {name} at n={n}: its probe model needs --dim >= {PROBE_UNIT + PROBE_CLASSES}",
                            flush=True,
                        )
                        continue
                    if d < args.dim:
                        print(
                            f"{name}: the rows' first {d} of {args.dim} columns, its probe model's parameters",
                            flush=True,
                        )
                        rows, rows_ref = np.ascontiguousarray(X[:, :d]), ref[:d].copy()
                        rows_dev = None if dev is None else (dev.put(rows), dev.put(rows_ref))
                    agg = agg.with_probe(probe_for(d, args.seed)[1])
                state = prepared_state(agg, n, rows.shape[1], rng)
                if dev is None or rows_dev is None:
                    m = measure(agg, rows, rows_ref, state, args.repeats, args.seed)
                else:
                    try:
                        m = dev.measure(agg, *rows_dev, state, args.repeats, args.seed)
                    except dev.out_of_memory as e:
                        print(
                            f"skip {name} at n={n}: out of memory on {dev.device}: {str(e).splitlines()[0]}", flush=True
                        )
                        dev.release()
                        continue
                paper = PAPER[paper_row].get(n) if paper_row else None
                need = None if paper is None else (10.0 if paper > 10 else 2.0)
                speedup = None if paper is None else paper / m["seconds"]
                rec = {
                    "rule": name,
                    "paper_row": paper_row,
                    "clients": n,
                    "dim": rows.shape[1],
                    "f": f,
                    "seconds": m["seconds"],
                    "times": m["times"],
                    "cpu_seconds": m.get("cpu_seconds"),
                    "paper_seconds": paper,
                    "speedup": speedup,
                    "target_speedup": need,
                    "peak_extra_bytes": m["peak_bytes"],
                    "peak_extra_copies": None if m["peak_bytes"] is None else m["peak_bytes"] / rows.nbytes,
                    "state_copies": sum(v.nbytes for v in state.values()) / rows.nbytes,
                }
                if dev is None:
                    rec["meets_target"] = (need is None or speedup is None or speedup >= need) and rec[
                        "peak_extra_copies"
                    ] <= 3.0
                else:
                    rec.update(on_device_record(dev, agg, m, rows.nbytes))
                    if args.device == "cpu":  # the numpy figure beside the tensor's
                        rec["numpy_seconds"] = measure(agg, rows, rows_ref, state, args.repeats, args.seed)["seconds"]
                    if byzfl is not None and rows_dev is not None and name in BYZFL:
                        rec.update(byzfl_record(byzfl, dev, name, f, n, rows_dev[0], rows, m["seconds"], args.repeats))
                if name == "mean":
                    yardstick = m["seconds"]
                rec["x_mean"] = m["seconds"] / yardstick if yardstick else None
                records.append(rec)
                print(row(rec) if dev is None else device_row(rec), flush=True)
                if args.json and dev is not None:  # a long device run keeps what it measured if it is stopped
                    write_json(args.json, records, args.seed, dev, byzfl)
        del X, on_dev, rows, rows_ref, rows_dev
        gc.collect()

    print()
    print(table(records) if dev is None else device_table(records))
    if args.json:
        write_json(args.json, records, args.seed, dev, byzfl)
    return 0 if dev is not None or all(r["meets_target"] for r in records) else 1


def write_json(path: str, records: list[dict], seed: int, dev: Device | None, byzfl) -> None:
    meta = {
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "numpy": np.__version__,
        },
        "dtype": "float32",
        "seed": seed,
        "paper": "FedSECA Supp. Table C.2 (8 vCPU, ResNet-18 11.2M parameters)",
    }
    if dev is not None:
        meta["device"] = str(dev.device)
        meta["device_name"] = dev.name
        meta["torch"] = dev.torch.__version__
        meta["byzfl"] = None if byzfl is None else importlib.metadata.version("byzfl")
    with open(path, "w") as fh:
        json.dump({"meta": meta, "records": records}, fh, indent=1)


def on_device_record(dev: Device, agg, m: dict, input_bytes: int) -> dict:
    """The device figures of one rule's record (memory on CUDA only)."""
    peak = m["peak_bytes"]
    return {
        "device": str(dev.device),
        "device_name": dev.name,
        "rule_on_device": bool(getattr(agg, "on_device", False)),
        "peak_extra_bytes": peak,
        "peak_extra_copies": None if peak is None else peak / input_bytes,
        "cpu_seconds": None,
        "meets_target": None,
    }


def byzfl_record(
    module, dev: Device, name: str, f: int, n: int, X, X_host: np.ndarray, seconds: float, repeats: int
) -> dict:
    """ByzFL's pipeline of entry ``name`` timed on the same tensor ``X`` (rows ``X_host``): its
    figures and the ratio to fedring's, or why it was not timed."""
    pipeline = byzfl_pipeline(module, name, f, n)
    if isinstance(pipeline, str):
        return {"byzfl": None, "byzfl_skipped": pipeline}
    call_name, call = pipeline
    dev.torch.manual_seed(0)  # ByzFL's Bucketing permutes with torch's generator
    try:
        b = dev.time(lambda r: call(X), repeats)
    except dev.out_of_memory as e:
        dev.release()
        return {"byzfl": None, "byzfl_skipped": f"{call_name}: out of memory: {str(e).splitlines()[0]}"}
    finally:
        if call_name.startswith("ARC"):  # ByzFL's ARC clips the rows it is given in place
            X.copy_(dev.torch.from_numpy(X_host))
    return {
        "byzfl": call_name,
        "byzfl_seconds": b["seconds"],
        "byzfl_times": b["times"],
        "byzfl_peak_extra_bytes": b["peak_bytes"],
        "byzfl_over_fedring": b["seconds"] / seconds,
    }


def geometric_mean(values: list[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def times_mean(r: dict) -> str:
    """The record's time as a multiple of the mean rule's ('-' if the mean rule did not run)."""
    return "-" if r["x_mean"] is None else f"{r['x_mean']:.1f}"


def device_row(r: dict) -> str:
    mem = "-" if r["peak_extra_copies"] is None else f"{r['peak_extra_copies']:.2f}x"
    text = (
        f"{r['rule']:<17} n={r['clients']:<4} {r['device']:<7} {r['seconds']:8.4f} s  {times_mean(r):>6}x mean  "
        f"mem {mem:<6} {'on device' if r['rule_on_device'] else 'host copy'}"
    )
    if "numpy_seconds" in r:
        text += f"  numpy {r['numpy_seconds']:.4f} s"
    if r.get("byzfl"):
        text += f"  ByzFL {r['byzfl_seconds']:.4f} s ({r['byzfl_over_fedring']:.2f}x"
        if "numpy_seconds" in r:
            text += f"; {r['byzfl_seconds'] / r['numpy_seconds']:.2f}x numpy's"
        text += ")"
    elif r.get("byzfl_skipped"):
        text += f"  ByzFL not timed: {r['byzfl_skipped']}"
    return text


def device_table(records: list[dict]) -> str:
    numpy_col = any("numpy_seconds" in r for r in records)
    head = "| rule | clients | device | runs | fedring (s) | x mean | peak extra memory (x input) |"
    head += " numpy (s) |" * numpy_col + " ByzFL (s) | ByzFL / fedring |" + " ByzFL / numpy |" * numpy_col
    lines = [head, "|---" * head.count(" |") + "|"]
    for r in records:
        mem = "—" if r["peak_extra_copies"] is None else f"{r['peak_extra_copies']:.2f}"
        line = (
            f"| {r['rule']} | {r['clients']} | {r['device']} | {'device' if r['rule_on_device'] else 'host copy'} "
            f"| {r['seconds']:.4f} | {times_mean(r)} | {mem} |"
        )
        if numpy_col:
            line += f" {r['numpy_seconds']:.4f} |"
        if r.get("byzfl"):
            line += f" {r['byzfl_seconds']:.4f} | {r['byzfl_over_fedring']:.2f} |"
            if numpy_col:
                line += f" {r['byzfl_seconds'] / r['numpy_seconds']:.2f} |"
        else:
            line += " — | — |" + " — |" * numpy_col
        lines.append(line)
    for n in sorted({r["clients"] for r in records}):
        timed = [r for r in records if r["clients"] == n and r.get("byzfl")]
        gm = geometric_mean([r["byzfl_over_fedring"] for r in timed])
        if gm is not None:
            lines.append(f"\nByzFL / fedring at n={n}, geometric mean over {len(timed)} rules: {gm:.2f}")
        if gm is not None and numpy_col:  # on a CPU a run takes the numpy path: the race that matters there
            gm_numpy = geometric_mean([r["byzfl_seconds"] / r["numpy_seconds"] for r in timed])
            lines.append(
                f"ByzFL / fedring's numpy path at n={n}, geometric mean over {len(timed)} rules: {gm_numpy:.2f}"
            )
    return "\n".join(lines)


def row(r: dict) -> str:
    paper = "-" if r["paper_seconds"] is None else f"{r['paper_seconds']:.2f}"
    speed = "-" if r["speedup"] is None else f"{r['speedup']:.1f}x (>= {r['target_speedup']:.0f}x)"
    return (
        f"{r['rule']:<17} n={r['clients']:<4} {r['seconds']:8.3f} s (cpu {r['cpu_seconds']:7.3f})  {r['x_mean']:6.1f}x mean  "
        f"paper {paper:>7}  speedup {speed:<16} mem {r['peak_extra_copies']:.2f}x  {'ok' if r['meets_target'] else 'MISSED'}"
    )


def table(records: list[dict]) -> str:
    head = (
        "| rule | paper row | clients | ours (s) | CPU (s) | x mean | paper (s) | speedup (target) "
        "| peak extra memory (x input) | state (x input) |"
    )
    lines = [head, "|---" * 10 + "|"]
    for r in records:
        paper = "—" if r["paper_seconds"] is None else f"{r['paper_seconds']:.2f}"
        speed = "—" if r["speedup"] is None else f"{r['speedup']:.0f}x (≥{r['target_speedup']:.0f}x)"
        lines.append(
            f"| {r['rule']} | {r['paper_row'] or '—'} | {r['clients']} | {r['seconds']:.2f} | {r['cpu_seconds']:.2f} "
            f"| {r['x_mean']:.1f} | {paper} | {speed} | {r['peak_extra_copies']:.2f} | {r['state_copies']:.2f} |"
        )
    return "\n".join(lines)
