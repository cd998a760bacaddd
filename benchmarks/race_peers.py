"""Race fedring's ports of the peers' rules against the peers' own code, on the same CPU input.

    python benchmarks/race_peers.py --byzfl /tmp/byzfl --flpoison /tmp/flp --blades /tmp/blades \
        --path /tmp/hdb --clients 20 --dim 1048576 --json docs/measured/race_peers.json

No peer code is kept in this repository: each peer is imported from the directory given on the
command line, and a peer that is missing is skipped with a message.

- ``--byzfl DIR``: the ``byzfl`` package (``pip install --no-deps --target DIR byzfl==0.0.11``);
  loaded without its ``__init__`` (which pulls torchvision). Its rules get torch tensors, as
  ByzFL's own server passes them.
- ``--flpoison DIR``: a checkout of github.com/vio1etus/FLPoison (``aggregators/``, ``fl/``);
  each defence module is loaded on its own (the package ``__init__`` imports every defence),
  with ``args.algorithm = "FedSGD"`` (the rows are the uploads) and numpy input, as FLPoison
  passes them. FLAME needs ``hdbscan`` (``pip install --no-deps --target DIR2 hdbscan``;
  ``--path DIR2``). LASA's line ``update[key].data *= mask[key]`` raises on numpy arrays; it
  runs as ``update[key] *= mask[key]``, its evident intent (the tests' references did the same).
  SignGuard and SimpleClustering call ``int()`` on the 1-element rows of ``np.argwhere``, which
  numpy 2.2 (FLPoison's pin) allows with a warning and the numpy here refuses; they run with
  ``int(idx[0])``, the same value.
- ``--blades DIR``: ``DIR/blades/aggregators/`` of github.com/lishenghui/blades at
  d3d8c7f647359deb1c44060a1140a0cf21beed0f and ``DIR/fedlib/utils/torch_utils.py`` of
  github.com/fedlib/fedlib, which imports ``ray`` (``pip install --target DIR3 "ray[rllib]"``;
  ``--path DIR3``); ``Clippedclustering`` gets a list of torch tensors.

Input: n x d float32 rows ``standard_normal`` from a seeded generator, the first n // 8 rows
scaled by 10 (so filters have work), converted to the peer's type outside the timed region,
afresh before each call for a peer that writes into its input (ByzFL's ARC clips the rows of its
tensor in place, which would otherwise change both sides' input for the later calls, since
``torch.from_numpy`` shares X's memory).
FLPoison's rules that read a model get a torch module of zeros holding d parameters, with a
last layer ``fc`` of 10 x 100 weights and 10 biases (FLAME then clusters the uploads
themselves; Auror's output block is those 1010 values, fedring's ``auror.output = 1010``;
LASA's layers are the module's, fedring's ``lasa.layers`` the same shapes). FLPoison's
FoolsGold runs with its indicative mask set to every coordinate, as fedring's rule (the mask
otherwise keeps ``topk_ratio`` of the output layer only).

f is ``declared_f(n)`` of ``python -m fedring bench aggregators`` (the largest f Bulyan
accepts), except for the subset searches MDA and SMEA, whose peers enumerate all
C(n, f) subsets: there f = ``--subset-f`` (default 2). Parameters are the peers' defaults; the
fedring rule is the ``ENTRIES`` row of ``fedring.bench.aggregators`` named below.

Timing: wall time (``time.perf_counter``) of one call, ``--repeats`` times, the two sides
interleaved (the order alternates each repeat), median reported. Before each timed call the
harness waits ``SETTLE`` = 0.05 s: torch's OpenMP threads spin for 10 to 20 ms after a peer's
call and would take a core from whichever call came next (measured: fedring's row norms 45%
slower right after ByzFL's ARC, the same after 20 ms). Stateless rules reuse the
object. Stateful rules (FoolsGold's history, Auror's rounds, Clipped Clustering's norm history)
get a fresh object on both sides each repeat, ``--warmup`` untimed calls on the same input
(default 1), then one timed call: both sides time the same round. The machine's load average is
recorded before and after.

SimpleClustering's DBSCAN radius (FLPoison's fixed 0.05) is in the units of the uploads: on the
raw input every client is noise and FLPoison's rule raises (``argmax`` of an empty sequence).
Both sides get the input times ``SIMPLE_SCALE`` = 1e-5 instead (the normal rows, about
sqrt(2 d) 1e-5 = 0.014 apart at d = 2^20, form one cluster; the scaled-up rows are noise).

DeepSight reads the round's model. Made equal: the model, the bench's probe MLP
(``fedring.bench.aggregators.probe_for``: 1 x 28 x 28 images, one hidden ReLU layer, 10
classes, torch's initialisation from ``--seed``) with ``probe_dim(d)`` parameters, so both sides
get the rows' first that many columns (``d`` rounded down to ``795 h + 10``; the record's
``dim``); the client models ``w - PROBE_LR x_i``: fedring's probe at ``PROBE_LR``, FLPoison's
FedSGD ``w + u_i`` with the uploads ``u_i = -PROBE_LR x_i`` (converted outside the timed region);
the random inputs: ``num_samples`` (the bench's 100 on both sides, not FLPoison's 20,000) per set
for each of the 3 seeds, fedring's ``default_rng(s)`` draws written into FLPoison's
``RandDataset`` objects once its constructor has drawn its own (``torch.manual_seed(s); torch.rand``,
outside the timed region, as fedring's are drawn before its first timed call); the divided
outputs: FLPoison's own models return logits, which it divides; its model here is the MLP
followed by a softmax, so both divide probabilities (the paper's DDifs) and reach the same
clusters. The record's ``peer_relative_difference`` is the largest difference of FLPoison's
update from ``-PROBE_LR`` times fedring's, relative to its largest entry (float32 rounding when
both keep the same clients). Not equal: FLPoison runs the inputs in batches of its configs' 64
(fedring's probe: 500), through n deep copies of the model (fedring loads each client's weights
into one), recomputes the global model's outputs for every client, sums the DDifs in float32
(fedring: float64) and clusters with the ``hdbscan`` package (``--path``), ``min_samples=3``;
fedring with scikit-learn's ``HDBSCAN``, ``min_samples=4`` (the same neighbourhood). Its
``aggregate`` turns every later RuntimeWarning into an error; each call runs inside
``warnings.catch_warnings()``, which restores the filters.

``--append`` keeps the records of an existing ``--json`` file that this run does not replace
(same rule and client count), so one file can collect several runs.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib
import json
import math
import os
import platform
import sys
import time
import types
import warnings
from types import SimpleNamespace

import numpy as np

from fedring.aggregators import make_aggregator
from fedring.bench.aggregators import (
    ENTRIES,
    PROBE_CLASSES,
    PROBE_LR,
    PROBE_SHAPE,
    declared_f,
    frozen_heap,
    probe_dim,
    probe_for,
)

OUT = (10, 100)  # the model's last layer: weights (10, 100), bias (10,)

# race row -> (ENTRIES key, peer, stateful)
RACES: dict[str, tuple[str, str, bool]] = {
    "mda": ("mda", "byzfl", False),
    "monna": ("monna-0", "byzfl", False),
    "meamed": ("meamed", "byzfl", False),
    "caf": ("caf-byzfl", "byzfl", False),
    "smea": ("smea", "byzfl", False),
    "arc+mean": ("arc+mean", "byzfl", False),
    "dnc": ("dnc", "flpoison", False),
    "signguard": ("signguard", "flpoison", False),
    "flame": ("flame", "flpoison", False),
    "foolsgold": ("foolsgold", "flpoison", True),
    "normclipping": ("normclipping", "flpoison", False),
    "simpleclustering": ("simpleclustering", "flpoison", False),
    "auror": ("auror-ol", "flpoison", True),
    "crfl": ("crfl", "flpoison", False),
    "lasa": ("lasa", "flpoison", False),
    "deepsight": ("deepsight", "flpoison", False),
    "clippedclustering": ("clippedclustering", "blades", True),
}
SUBSET_RULES = {"mda", "smea"}
# peers that write into their input: ByzFL's ARC clips the rows of the tensor it is given in place
IN_PLACE = {"arc+mean"}
SIMPLE_SCALE = 1e-5  # SimpleClustering's input scale (see the module docstring)
SETTLE = 0.05  # seconds before each timed call, for the other side's spinning threads to stop
FLPOISON_BATCH = 64  # FLPoison's batch_size in every configs/*.yaml: DeepSight's random inputs go through in batches

# one-line fixes applied to FLPoison's source as it is loaded (see the module docstring)
_INT_IDX = ("[int(idx) for idx in np.argwhere(", "[int(idx[0]) for idx in np.argwhere(")
PATCHES = {
    "lasa": [("update[key].data *= mask[key]", "update[key] *= mask[key]")],
    "signguard": [_INT_IDX],
    "simpleclustering": [_INT_IDX],
}


def layer_shapes(d: int) -> list[tuple[int, ...]]:
    """The model's parameter shapes, holding d values: body weight (rows, 1024), body bias, fc."""
    rest = d - OUT[0] * OUT[1] - OUT[0]
    rows, extra = divmod(rest, 1024)
    shapes: list[tuple[int, ...]] = [(rows, 1024)]
    if extra:
        shapes.append((extra,))
    return [*shapes, OUT, (OUT[0],)]


def stub_package(name: str, path: str, **attrs) -> None:
    mod = types.ModuleType(name)
    mod.__path__ = [path]
    for k, v in attrs.items():
        setattr(mod, k, v)
    sys.modules[name] = mod


def load_byzfl(root: str):
    stub_package("byzfl", os.path.join(root, "byzfl"))
    agg = importlib.import_module("byzfl.aggregators")
    return agg


def load_flpoison(root: str):
    stub_package("aggregators", os.path.join(root, "aggregators"), aggregator_registry=lambda cls: cls)
    stub_package("fl", os.path.join(root, "fl"))
    stub_package("fl.models", os.path.join(root, "fl", "models"))
    mods = {}
    for name in [
        "dnc",
        "signguard",
        "foolsgold",
        "normclipping",
        "simpleclustering",
        "auror",
        "crfl",
        "lasa",
        "flame",
        "deepsight",
    ]:
        try:
            if name in PATCHES:
                path = os.path.join(root, "aggregators", f"{name}.py")
                with open(path) as fh:
                    src = fh.read()
                for old, new in PATCHES[name]:
                    src = src.replace(old, new)
                mod = types.ModuleType(f"aggregators.{name}")
                mod.__file__ = path
                sys.modules[mod.__name__] = mod
                exec(compile(src, path, "exec"), mod.__dict__)
            else:
                mod = importlib.import_module(f"aggregators.{name}")
            mods[name] = mod
        except ImportError as e:
            print(f"skip FLPoison {name}: {e}", flush=True)
    return mods


def load_blades(root: str):
    stub_package("blades", os.path.join(root, "blades"))
    stub_package("blades.aggregators", os.path.join(root, "blades", "aggregators"))
    stub_package("fedlib", os.path.join(root, "fedlib"))
    stub_package("fedlib.utils", os.path.join(root, "fedlib", "utils"))
    return importlib.import_module("blades.aggregators.clippedclustering")


def zero_model(d: int):
    import torch

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            shapes = layer_shapes(d)
            body = torch.nn.Module()
            body.weight = torch.nn.Parameter(torch.zeros(shapes[0]))
            if len(shapes) == 4:
                body.bias = torch.nn.Parameter(torch.zeros(shapes[1]))
            self.body = body
            self.fc = torch.nn.Linear(OUT[1], OUT[0])
            torch.nn.init.zeros_(self.fc.weight)
            torch.nn.init.zeros_(self.fc.bias)

    return Model()


def flpoison_deepsight(mod, agg, model, n: int, f: int):
    """(build, convert) of FLPoison's DeepSight on the model and the random inputs of fedring's rule ``agg``
    (module docstring): its model is ``model`` followed by a softmax, its uploads ``-PROBE_LR * X``."""
    import torch

    class Probabilities(torch.nn.Module):  # not a Sequential: FLPoison's np.array of the client models would iterate it
        def __init__(self):
            super().__init__()
            self.model = copy.deepcopy(model)

        def forward(self, x):
            return torch.softmax(self.model(x), dim=-1)

    probabilities = Probabilities().eval()
    channels, height, _ = PROBE_SHAPE
    args = SimpleNamespace(
        defense_params={"num_samples": agg.num_samples},
        algorithm="FedSGD",
        num_clients=n,
        num_adv=f,
        num_classes=PROBE_CLASSES,
        num_channels=channels,
        num_dims=height,
        batch_size=FLPOISON_BATCH,
        num_workers=0,
        device="cpu",
    )
    inputs = agg.random_inputs(PROBE_SHAPE)  # drawn here, outside the timed calls, as FLPoison's constructor draws

    def build():
        peer = mod.DeepSight(args)
        for dataset, x in zip(peer.rand_datasets, inputs, strict=True):
            dataset.dataset = torch.from_numpy(x)

        def call(U):
            with warnings.catch_warnings():  # its aggregate turns every later RuntimeWarning into an error
                return peer.aggregate(U, last_global_model=probabilities)

        return call

    return build, (lambda X: np.float32(-PROBE_LR) * X)


def peer_factory(race: str, peers: dict, n: int, f: int, d: int, agg=None, model=None):
    """(build, convert): build() -> a callable on the converted input. DeepSight's peer reads fedring's rule
    ``agg`` and its probe ``model``."""
    import torch

    if race in ("mda", "monna", "meamed", "caf", "smea", "arc+mean"):
        A = peers["byzfl"]
        to = torch.from_numpy
        if race == "arc+mean":
            arc, avg = A.ARC(f=f), A.Average()
            return (lambda: lambda X: avg(arc(X))), to
        cls = {"mda": A.MDA, "monna": A.MoNNA, "meamed": A.Meamed, "caf": A.CAF, "smea": A.SMEA}[race]
        kw = {"idx": 0} if race == "monna" else {}
        return (lambda: cls(f=f, **kw)), to
    if race == "clippedclustering":
        mod = peers["blades"]
        return (lambda: mod.Clippedclustering()), (lambda X: [torch.from_numpy(r) for r in X])
    mods = peers["flpoison"]
    if race not in mods:
        raise KeyError(f"FLPoison's {race} was not loaded (see above)")
    mod = mods[race]
    if race == "deepsight":
        return flpoison_deepsight(mod, agg, model, n, f)
    cls = {
        "dnc": "DnC",
        "signguard": "SignGuard",
        "flame": "FLAME",
        "foolsgold": "FoolsGold",
        "normclipping": "NormClipping",
        "simpleclustering": "SimpleClustering",
        "auror": "Auror",
        "crfl": "CRFL",
        "lasa": "LASA",
    }[race]
    model = zero_model(d)
    args = SimpleNamespace(defense_params=None, algorithm="FedSGD", num_clients=n, num_adv=f)

    def build():
        agg = getattr(mod, cls)(args)
        if race == "foolsgold":
            agg.get_indicative_mask = lambda ol_vec, feature_dim: np.ones(feature_dim, np.int64)
        return lambda X: agg.aggregate(X.copy() if race == "foolsgold" else X, last_global_model=model)

    return build, (lambda X: X)


def race_one(race: str, peers: dict, X: np.ndarray, ref: np.ndarray, f: int, repeats: int, warmup: int, seed: int):
    key, _, stateful = RACES[race]
    rule, params, pre, _ = ENTRIES[key]
    n, d = X.shape
    if race == "simpleclustering":  # into the reach of DBSCAN's eps = 0.05: the large rows stay out
        X = X * np.float32(SIMPLE_SCALE)
    if race == "lasa":  # the model's layers, as FLPoison's LASA reads them
        params = {**params, "layers": [list(s) for s in layer_shapes(d)]}
    model = probe = None
    if race == "deepsight":  # the bench's probe MLP, on the rows' first probe_dim(d) columns
        d = probe_dim(d)
        X, ref = np.ascontiguousarray(X[:, :d]), ref[:d].copy()
        model, probe = probe_for(d, seed)

    def make():
        agg = make_aggregator(rule, f, params, pre)
        return agg if probe is None else agg.with_probe(probe)

    agg = make()
    build, convert = peer_factory(race, peers, n, f, d, agg, model)
    Xp = convert(X)

    def fed_round(agg, state, r):
        return agg.aggregate(X, state=state, reference=ref, rng=np.random.default_rng([seed, r]))

    ours: list[float] = []
    theirs: list[float] = []
    out: list = [None, None]  # the last result of each side
    reason = agg.check(n)
    if reason is not None:
        raise ValueError(reason)
    state = agg.init_state(n, d)
    peer = build()
    with frozen_heap():  # the collection before each timed call walks the calls' own garbage only
        for r in range(repeats):
            if stateful:
                agg, peer = make(), build()
                state = agg.init_state(n, d)
                for w in range(warmup):
                    fed_round(agg, state, 1000 + w)
                    peer(Xp)
            for side in (0, 1) if r % 2 == 0 else (1, 0):
                if side == 1 and race in IN_PLACE:  # a fresh copy of the input, made outside the timed region
                    Xp = convert(X.copy())
                gc.collect()
                time.sleep(SETTLE)
                t0 = time.perf_counter()
                if side == 0:
                    out[0] = fed_round(agg, state, r).vector
                else:
                    out[1] = peer(Xp)
                (ours if side == 0 else theirs).append(time.perf_counter() - t0)
    record = {"entry": key, "dim": d}
    if race == "deepsight":  # the same model and inputs: the same clusters, so the peer's update is -lr times ours
        record["peer_relative_difference"] = float(
            np.abs(np.float32(-PROBE_LR) * out[0] - out[1]).max() / np.abs(out[1]).max()
        )
    return ours, theirs, record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--byzfl", help="directory holding the byzfl package")
    p.add_argument("--flpoison", help="FLPoison checkout (aggregators/, fl/)")
    p.add_argument("--blades", help="directory holding blades/aggregators/ and fedlib/utils/")
    p.add_argument("--path", action="append", default=[], help="extra import path for the peers' dependencies")
    p.add_argument("--clients", default="20", help="comma-separated client counts (default 20)")
    p.add_argument("--dim", type=int, default=2**20, help="vector length (default 2^20)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per side (default 3; median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds before a stateful rule's call")
    p.add_argument("--subset-f", type=int, default=2, help="f of MDA and SMEA (default 2)")
    p.add_argument("--rules", help=f"comma-separated (default all): {','.join(RACES)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--append", action="store_true", help="keep the other records of an existing --json file")
    args = p.parse_args(argv)
    sys.path.extend(args.path)
    peers: dict = {}
    for name, loader in (("byzfl", load_byzfl), ("flpoison", load_flpoison), ("blades", load_blades)):
        root = getattr(args, name)
        if not root or not os.path.isdir(root):
            print(f"skip {name}: no directory given or found ({root!r})", flush=True)
            continue
        try:
            peers[name] = loader(root)
        except Exception as e:  # a broken copy: skip the peer, say why
            print(f"skip {name}: {type(e).__name__}: {e}", flush=True)
    races = list(RACES) if not args.rules else [r for r in args.rules.split(",") if r]
    load_before = os.getloadavg()
    records: list[dict] = []
    skipped: list[str] = []
    for n in [int(c) for c in args.clients.split(",") if c]:
        rng = np.random.default_rng([args.seed, n])
        X = rng.standard_normal((n, args.dim), dtype=np.float32)
        X[: max(1, n // 8)] *= 10.0
        ref = rng.standard_normal(args.dim, dtype=np.float32)
        for race in races:
            peer = RACES[race][1]
            if peer not in peers:
                print(f"skip {race}: peer {peer} not loaded", flush=True)
                skipped.append(f"{race} n={n}: peer {peer} not loaded")
                continue
            f = min(declared_f(n), args.subset_f) if race in SUBSET_RULES else declared_f(n)
            try:
                ours, theirs, extra = race_one(race, peers, X, ref, f, args.repeats, args.warmup, args.seed)
            except Exception as e:  # a peer that fails on this input: skip it, say why
                print(f"skip {race} at n={n}: {type(e).__name__}: {e}", flush=True)
                skipped.append(f"{race} n={n}: {type(e).__name__}: {e}")
                continue
            rec = {
                "rule": race,
                "entry": extra["entry"],
                "peer": peer,
                "clients": n,
                "dim": extra["dim"],
                "f": f,
                "fedring_seconds": float(np.median(ours)),
                "peer_seconds": float(np.median(theirs)),
                "fedring_times": ours,
                "peer_times": theirs,
            }
            rec["speedup"] = rec["peer_seconds"] / rec["fedring_seconds"]
            rec.update(extra)
            records.append(rec)
            print(
                f"{race:<18} n={n:<3} f={f:<2} fedring {rec['fedring_seconds']:8.4f} s  {peer} "
                f"{rec['peer_seconds']:8.4f} s  {rec['speedup']:7.1f}x",
                flush=True,
            )
    load_after = os.getloadavg()
    command = "python benchmarks/race_peers.py " + " ".join(sys.argv[1:] if argv is None else argv)
    runs = [
        {"command": command, "load_average_before": load_before, "load_average_after": load_after, "skipped": skipped}
    ]
    if args.append and args.json and os.path.exists(args.json):
        with open(args.json) as fh:
            old = json.load(fh)
        done = {(r["rule"], r["clients"]) for r in records}
        records = [r for r in old["records"] if (r["rule"], r["clients"]) not in done] + records
        runs = old["meta"]["runs"] + runs
    geo = math.exp(sum(math.log(r["speedup"]) for r in records) / len(records)) if records else None
    print()
    print(table(records, geo))
    print(f"\nload average before {load_before}, after {load_after}")
    if args.json:
        meta = {
            "runs": runs,  # each run's command, load averages (1, 5, 15 min) and skipped races
            "input": f"n x {args.dim} float32, standard normal, first n // 8 rows x 10, seed {args.seed}",
            "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
            "numpy": np.__version__,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "geometric_mean_speedup": geo,
        }
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "records": records}, fh, indent=1)
    return 0


def table(records: list[dict], geo: float | None) -> str:
    lines = ["| rule | peer | clients | f | fedring s | peer s | speed-up |", "|---" * 7 + "|"]
    for r in records:
        lines.append(
            f"| {r['rule']} | {r['peer']} | {r['clients']} | {r['f']} | {r['fedring_seconds']:.4f} "
            f"| {r['peer_seconds']:.4f} | {r['speedup']:.1f}x |"
        )
    if geo is not None:
        lines.append(f"\ngeometric mean of the speed-ups: {geo:.1f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
