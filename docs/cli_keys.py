"""Print the tables of settings keys of docs/cli.md from the code, so the page stays true.

    python docs/cli_keys.py                 every table, in the page's order (Markdown)
    python docs/cli_keys.py general prism   some of them (names: python docs/cli_keys.py --list)
    python docs/cli_keys.py --write         replace the generated blocks of docs/cli.md
    python docs/cli_keys.py --check         exit 1 if a generated block of docs/cli.md is stale, or if
                                            one of its example TOML files does not parse and validate

A generated block of docs/cli.md sits between ``<!-- BEGIN cli_keys.py NAME -->`` and
``<!-- END cli_keys.py NAME -->``. The tables are read from the settings dataclasses
(``fedring.config.Config``, ``PrismSettings``, ``LabelShiftSettings``, ``SweepSettings``), the
help texts of the command-line options and of the dataclass fields, and the component
registries (constructor signatures for the defaults). The only text kept here is the meaning
of the keys that have no help text anywhere else (the top-level keys without an option, the
ring rules' keys, the ``[sweep]`` keys); a key added to the code without one here makes this
script fail, which is the point. Imports torch (the attacks); starts no MPI.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path

import mpi4py

mpi4py.rc.initialize = mpi4py.rc.finalize = False  # read the code only: no MPI

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PAGE = ROOT / "docs" / "cli.md"

# ----------------------------------------------------------------------------------------------
# Meanings of keys that have no help text in the code
# ----------------------------------------------------------------------------------------------

#: top-level keys without a command-line option (so without a help text)
NO_OPTION_MEANING = {
    "task": "what runs: `train`, `prism` or `labelshift` (`python -m fedring conformal TASK` sets it)",
    "stop_grace": "seconds a stop signal waits for the current round or trial to end before the job "
    "is aborted (file marked `preempted`)",
    "tensorboard_dir": "with `log` naming `tensorboard`: the folder of the runs' event files, one subfolder per "
    "run named after its results file (`tensorboard --logdir runs`); docs/hdf5.md#experiment-trackers",
    "mlflow_uri": "with `log` naming `mlflow`: the tracking URI (a server's `http://...`, `sqlite:///FILE.db`); "
    "unset: `$MLFLOW_TRACKING_URI`, else MLflow's default (`sqlite:///mlflow.db` here); "
    "docs/hdf5.md#experiment-trackers",
    "threads": "torch CPU threads per rank (training only; a run is bit-identical only with the same value)",
    "device": "`cpu`, `cuda` (each rank on the GPU of its node-local rank modulo the visible GPUs; refused where none "
    "is visible) or `auto` (`cuda` where a GPU is visible); training only; docs/slurm.md#gpus",
    "batched_clients": "B in [1, clients]: compute B clients' local steps in one `vmap` call (chunks of client ids; the same file on "
    "any number of ranks for a given device and B; equal to the per-client loop up to float rounding); unset: one "
    "client at a time. Refused with BatchNorm or dropout models, `local_epochs`, shards smaller than `batch_size`; "
    "docs/training.md",
    "byzantine_select": "which clients are Byzantine: `random` (drawn from the seed) or `first` (ids 0 .. b-1)",
    "server_samples": "training samples drawn once for the server's clean gradient (`fltrust`, `zenopp`, `monna`, "
    '`hplus` with `mode = "clean"`)',
    "validation": "fraction in [0, 1) of every client's training samples held out (floor) and evaluated like the "
    "test set (`/metrics/validation_*`); drawn per client from the seed",
    "bn_stats": "BatchNorm running statistics: `aggregate` (the clients' mean after every round) or `local` "
    "(each client keeps its own; FedBN); docs/training.md",
    "local_epochs": "passes over the client's shard per round instead of `local_steps` (exclusive with it): "
    "ceil(samples / batch_size) steps per pass",
    "momentum": "client heavy-ball momentum beta in [0, 1): `m <- beta m + u`; the client uploads `m` "
    "(worker momentum); docs/training.md",
    "nesterov": "upload `u + beta m` instead of `m` (needs momentum > 0)",
    "dampening": "`m <- beta m + (1 - beta) u` (ByzFL's clients and the papers) instead of heavy ball "
    "`m <- beta m + u` (Karimireddy et al.'s code, torch's SGD); needs momentum > 0",
    "weight_decay": "`g <- g + weight_decay * w` on every local mini-batch gradient (after clipping)",
    "clip_norm": "clip every local mini-batch gradient to this L2 norm (unset: no clipping)",
    "dp": "client-level differential privacy, DP-FedAvg: `central` (a server averaging the uploads clipped to "
    "`dp.clip`, noise z C / m on the mean; `--topology server --aggregator mean`) or `local` (every honest "
    "client clips and noises its own upload); `dp.clip` (1), `dp.noise_multiplier` (1), `dp.delta` (1e-5); "
    "epsilon per round in `/dp/epsilon`; needs the `dp` extra; docs/training.md#client-level-differential-privacy",
    "server_optimizer": "what the replicas do with the aggregate: `sgd` (`w -= lr_t g`), `momentum`, `adam`, "
    "`yogi`, `adagrad`; parameters in the section named after it (table below)",
    "participation": "clients per round: a fraction in (0, 1] of all clients (max(1, round(p x clients))) or a "
    "whole count in [2, clients], drawn from the seed and the round among the available ones; 1.0: every client "
    "(the files of earlier releases); docs/training.md#client-sampling-and-availability",
    "availability": "probability in (0, 1] that a client is available in a round (drawn from the seed and the "
    "round); 1.0: always",
    "availability_file": "a `.npy` or `.csv` table of at least `rounds` rows of `clients` 0/1 entries: who is "
    "available in each round (instead of `availability`)",
    "cohort_f": "the f a server rule is told for a round's cohort of m clients: `scaled` (ceil(f x m / clients)) "
    "or `declared` (f itself)",
}

#: the ring rules' keys (fedring/comm/brace.py reads them with params.get, so no signature holds them)
RING_KEY_MEANING = {
    "lambda": "threshold of the consensus map: `+1 if S > lambda else -1` (the paper's eq. 1); any finite "
    "number; a round's cohort of m clients uses lambda x m / clients. The paper's value for 100 clients",
    "rule": "`paper` (eq. 1, two-valued) or `symmetric` (`+1 if S > lambda`, `-1 if S < -lambda`, else 0; "
    "not in the paper; needs lambda >= 0)",
    "theta": "integer >= 0: `rho * sign(S)` with `rho = +1 if abs(S) >= theta else -1`; default ceil(0.2 n); "
    "a round's cohort of m clients uses ceil(theta x m / clients) (default ceil(0.2 m))",
    "sign_zero": "the vote of a coordinate that is exactly 0 or not finite: 0 (abstain), 1 or -1",
    "check": "`on`/`off` (or true/false): the Share-Reduce integrity check (range and parity of the counts)",
    "relay_attack": "beyond the paper: `none`, `bias` (Byzantine relays add `relay_bias` to the counts they "
    "forward) or `flip` (they flip consensus signs in Share-Only)",
    "relay_bias": 'nonzero integer a Byzantine relay adds to each partial count (`relay_attack = "bias"`)',
    "relay_flip_prob": "probability in [0, 1] that a Byzantine relay flips each sign it forwards "
    '(`relay_attack = "flip"`)',
    "relay_clients": "the Byzantine relays (client ids), for the Python API; a training run refuses it: its relays are its "
    "Byzantine clients (`byzantine`, `byzantine_select`)",
}
#: ring-rule key -> attribute of the built rule holding its value (the defaults are read from there)
RING_KEY_ATTR = {
    "lambda": "lam",
    "rule": "brace_rule",
    "theta": "theta",
    "sign_zero": "sign_zero",
    "check": "check",
    "relay_attack": "relay_attack",
    "relay_bias": "relay_bias",
    "relay_flip_prob": "flip_prob",
    "relay_clients": None,
}

#: the [sweep] table of a grid file (fedring.sweep.SweepSettings)
SWEEP_MEANING = {
    "out_dir": "where the configs, results and logs go; default `results/<grid file name without .toml>`",
    "ranks": "MPI ranks per run (`sbatch --ntasks`, or `mpiexec -n` with `--local`)",
    "time": "`sbatch --time` of each array task",
    "max_parallel": "at most this many array tasks at once (`--array=0-N%M`); with `--local`, runs at once",
    "launcher": "`srun` (with `--mpi=pmi2`) or `mpiexec` inside the job",
    "sbatch": 'more `sbatch` options, e.g. `["--partition=cpu", "--account=me"]`',
}

# ----------------------------------------------------------------------------------------------
# Formatting
# ----------------------------------------------------------------------------------------------


def code(value) -> str:
    """A value as the TOML literal a user writes, in backticks."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{'true' if value else 'false'}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, (list, tuple)):
        return "`[" + ", ".join(code(v).strip("`") for v in value) + "]`"
    return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"


def cell(text: str) -> str:
    """Table-safe text: reST ``x`` -> Markdown `x`, no pipes or newlines."""
    text = re.sub(r":\w+:`([^`]*)`", r"\1", str(text))
    text = text.replace("``", "`").replace("|", "\\|").replace("\n", " ")
    return re.sub(r"\s+", " ", text).strip()


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def strip_default(help_text: str) -> str:
    """An option's help without the default it shows (the table has a column for it)."""
    text = re.sub(r"\s*\(default:? [^;()]*(\([^)]*\)[^;()]*)*\)", "", help_text)
    text = re.sub(r"\(default [^;]*; ", "(", text)
    text = re.sub(r";\s*default \S+$", "", text)
    return text.strip()


def signature_defaults(cls, names: list[str]) -> dict[str, object]:
    sig = inspect.signature(cls.__init__).parameters
    return {n: (sig[n].default if n in sig and sig[n].default is not inspect.Parameter.empty else ...) for n in names}


def params_cell(cls, context: tuple[str, ...]) -> str:
    from fedring.registry import Registry

    names = Registry.parameters(cls, context)
    if not names:
        return "—"
    defaults = signature_defaults(cls, names)
    shown = []
    for n in names:
        d = defaults[n]
        shown.append(
            f"`{n}`"
            if d is ...
            else f"`{n}` ({'auto' if d is None else code(list(d) if isinstance(d, tuple) else d).strip('`')})"
        )
    return ", ".join(shown)


def first_line(cls) -> str:
    doc = inspect.getdoc(cls) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


# ----------------------------------------------------------------------------------------------
# The tables
# ----------------------------------------------------------------------------------------------


def _options(parser) -> dict[str, tuple[str, str]]:
    """dest -> (option string, help) of a parser."""
    out = {}
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            out[action.dest] = (max(action.option_strings, key=len), action.help or "")
    return out


def _top_level_rows(keys) -> list[list[str]]:
    from fedring.cli.run import run_parser
    from fedring.config import FIELDS, Config

    options = _options(run_parser())
    defaults = Config()
    rows = []
    for key in keys:
        opt, help_text = options.get(key, ("", ""))
        meaning = strip_default(help_text) if help_text else NO_OPTION_MEANING.get(key)
        if meaning is None:
            raise SystemExit(f"cli_keys.py: setting {key!r} has no option help and no meaning in NO_OPTION_MEANING")
        default = getattr(defaults, key)
        shown = {
            "clients": "one per rank",
            "declared_f": "the actual count",
            "out": "`results/NAME.h5` (below)",
            "data_dir": "per data set",
        }.get(key, code(default))
        if key == "pre_aggregators":
            shown = "`[]`"
        rows.append([f"`{key}`", f"`{opt}`" if opt else "—", f"`{FIELDS[key].type}`", shown, meaning])
    return rows


def t_general() -> str:
    from fedring.config import GENERAL

    return table(["key", "option", "type", "default", "meaning"], _top_level_rows(GENERAL))


def t_train() -> str:
    from fedring.config import FIELDS, GENERAL

    return table(
        ["key", "option", "type", "default", "meaning"], _top_level_rows(k for k in FIELDS if k not in GENERAL)
    )


def t_server_rules() -> str:
    from fedring.aggregators import AGGREGATORS

    rows = [[f"`{name}`", params_cell(cls, ("f", "sections"))] for name, cls in AGGREGATORS.items()]
    return table(['`aggregator` (`topology = "server"`)', "section keys (default)"], rows)


def t_pre_aggregators() -> str:
    from fedring.aggregators import PRE_AGGREGATORS

    rows = [[f"`{name}`", params_cell(cls, ("f",))] for name, cls in PRE_AGGREGATORS.items()]
    return table(["`pre_aggregators` entry", "section keys (default)"], rows)


def t_ring_rules() -> str:
    from fedring.comm import RING_RULES
    from fedring.comm.brace import COMMON_KEYS, RULE_KEYS

    missing = [
        k for k in (*COMMON_KEYS, *(k for keys in RULE_KEYS.values() for k in keys)) if k not in RING_KEY_MEANING
    ]
    if missing:
        raise SystemExit(f"cli_keys.py: ring-rule keys without a meaning in RING_KEY_MEANING: {missing}")
    rules = {name: RING_RULES.build(name, {}, n_clients=100) for name, cls in RING_RULES.items() if name in RULE_KEYS}
    small = {name: RING_RULES.build(name, {}, n_clients=10) for name in rules}
    rows = [
        ["`mean`", "—", "—", "plain ring-all-reduce, no defence, no keys"],
        ["`crfl`", "—", "—", "CRFL's step on the ring's mean on every client: the server rule's `[crfl]` keys"],
    ]
    for key in (*(k for name in RULE_KEYS for k in RULE_KEYS[name]), *COMMON_KEYS):
        owners = [name for name in rules if key in RULE_KEYS[name] or key in COMMON_KEYS]
        attr = RING_KEY_ATTR.get(key)
        if attr is None:
            default = "the run's Byzantine clients"
        else:
            value = getattr(rules[owners[0]], attr)
            if attr == "check":
                value = "on" if value else "off"
            default = code(value)
            if getattr(small[owners[0]], attr) != getattr(rules[owners[0]], attr):
                default += " (n = 100)"
        which = "all three" if len(owners) == len(rules) else ", ".join(f"`{o}`" for o in owners)
        rows.append([f"`{key}`", which, default, RING_KEY_MEANING[key]])
    return table(["key", "rules", "default", "meaning"], rows)


def t_attacks() -> str:
    from fedring.attacks import ATTACKS, DataAttack

    rows = []
    for name, cls in ATTACKS.items():
        params = params_cell(cls, ("n_clients", "n_classes"))
        if "`target`" in params and name == "adaptive":
            params += " (defaults per target: docs/attacks.md)"
        kind = "data" if issubclass(cls, DataAttack) else "model"
        rows.append([f"`{name}`", kind, params])
    return table(["`attack`", "kind", "`attack.*` keys (default)"], rows)


def t_schedules() -> str:
    from fedring.train.schedules import SCHEDULES

    rows = [
        [
            f"`{name}`",
            f"`[{name}]`" if name != "constant" else "—",
            params_cell(cls, ()),
            first_line(cls) if name != "constant" else "`lr_t = lr`",
        ]
        for name, cls in SCHEDULES.items()
    ]
    return table(["`lr_schedule`", "section", "keys (default)", "step size of round t (0-based)"], rows)


def t_server_optimizers() -> str:
    from fedring.train.optim import SERVER_OPTIMIZERS

    rows = [
        [f"`{name}`", f"`[{name}]`", params_cell(cls, ()), first_line(cls)] for name, cls in SERVER_OPTIMIZERS.items()
    ]
    return table(["`server_optimizer`", "section", "keys (default; `lr` unset: the run's `lr`)", "update"], rows)


def _dataclass_rows(schema, extra=lambda f: "") -> list[list[str]]:
    rows = []
    for f in dataclasses.fields(schema):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        help_text = f.metadata.get("help")
        if not help_text:
            raise SystemExit(f"cli_keys.py: {schema.__name__}.{f.name} has no metadata['help']")
        opt = "--" + f.name.replace("_", "-")
        if f.type in ("bool", "bool | None"):
            opt += f" / --no-{f.name.replace('_', '-')}"
        rows.append([f"`{f.name}`", f"`{opt}`", f"`{f.type}`", code(default), help_text + extra(f)])
    return rows


def t_prism() -> str:
    from fedring.conformal.prism.settings import PrismSettings

    return table(["`[prism]` key", "option", "type", "default", "meaning"], _dataclass_rows(PrismSettings))


def t_prism_profiles() -> str:
    from fedring.conformal.prism.settings import DATASET_DEFAULTS, PROFILES

    rows = [
        [
            f"`{name}`",
            code(p["step"]),
            code(p["byz_persist"]),
            code(p["local_updates"]),
            ", ".join(
                f"`{a}.{k}` = {code(v).strip('`')}" for a, kv in p["calib_attacks"].items() for k, v in kv.items()
            ),
        ]
        for name, p in PROFILES.items()
    ]
    profiles = table(["`profile`", "`step`", "`byz_persist`", "`local_updates`", "calibration attack defaults"], rows)
    keys = list(next(iter(DATASET_DEFAULTS.values())))
    rows = [[f"`{name}`", *(code(d[k]) for k in keys)] for name, d in DATASET_DEFAULTS.items()]
    return profiles + "\n\n" + table(["`dataset`", *(f"`{k}` unset ->" for k in keys)], rows)


def t_calib_attacks() -> str:
    from fedring.conformal.prism.attacks import CALIB_ATTACKS
    from fedring.conformal.prism.settings import PROFILES

    rows = []
    for name, cls in CALIB_ATTACKS.items():
        keys = params_cell(cls, ())
        for k in sorted({k for p in PROFILES.values() for k in p["calib_attacks"].get(name, {})}):
            every = all(k in p["calib_attacks"].get(name, {}) for p in PROFILES.values())
            keys = (
                re.sub(rf"`{k}` \([^)]*\)", f"`{k}` (the profile's, below)", keys)
                if every
                else keys + f"; unset `{k}`: the profile's if it sets one (below)"
            )
        rows.append([f"`{name}`", f"`[{name}]`", keys, first_line(cls)])
    return table(["`calib_attack`", "section", "keys (default)", "what each Byzantine client reports"], rows)


def t_labelshift() -> str:
    from fedring.conformal.labelshift.task import LabelShiftSettings

    return table(["`[labelshift]` key", "option", "type", "default", "meaning"], _dataclass_rows(LabelShiftSettings))


def t_sweep() -> str:
    from fedring.sweep import SweepSettings

    rows = []
    for f in dataclasses.fields(SweepSettings):
        if f.name not in SWEEP_MEANING:
            raise SystemExit(f"cli_keys.py: [sweep] key {f.name!r} has no meaning in SWEEP_MEANING")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        opt = "--" + f.name.replace("_", "-")
        rows.append(
            [
                f"`{f.name}`",
                f"`{opt}`" if f.name != "sbatch" else "—",
                f"`{f.type}`",
                code(default),
                SWEEP_MEANING[f.name],
            ]
        )
    return table(["`[sweep]` key", "option", "type", "default", "meaning"], rows)


def t_headline() -> str:
    from fedring.cli import run as cli_run

    common = " ".join(cli_run.HEADLINE_COMMON)
    runs = cli_run.HEADLINE
    items = runs.items() if isinstance(runs, dict) else [(r[0], r) for r in runs]
    rows = []
    for name, entry in items:
        if isinstance(runs, dict):
            args, out, meaning = entry, entry[entry.index("--out") + 1], ""
        else:
            _, out, args, meaning = entry
        rows.append([name, f"`{' '.join(args)}`", f"`{out}`", meaning])
    window = getattr(cli_run, "HEADLINE_WINDOW", None)
    printed = f" The accuracy printed is the mean of the last {window} evaluations." if window else ""
    return (
        f"Every run: `{common} --clients max(ranks, 5)`; the BRACE runs add "
        f"`--set brace.lambda=0.05*clients`.{printed}\n\n"
        + table(["run", "options", "results file", "what it shows"], rows)
    )


TABLES = {
    "headline": t_headline,
    "general": t_general,
    "train": t_train,
    "server-rules": t_server_rules,
    "pre-aggregators": t_pre_aggregators,
    "ring-rules": t_ring_rules,
    "attacks": t_attacks,
    "schedules": t_schedules,
    "server-optimizers": t_server_optimizers,
    "prism": t_prism,
    "prism-profiles": t_prism_profiles,
    "calib-attacks": t_calib_attacks,
    "labelshift": t_labelshift,
    "sweep": t_sweep,
}

BLOCK = re.compile(
    r"(<!-- BEGIN cli_keys.py (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- END cli_keys.py (?P=name) -->)", re.DOTALL
)


def page_blocks(text: str) -> dict[str, str]:
    return {m["name"]: m["body"] for m in BLOCK.finditer(text)}


#: an example settings file of the page: a ```toml block whose first line is the command running it
EXAMPLE = re.compile(r"```toml\n(# python -m fedring[^\n]*\n.*?)```", re.DOTALL)


def check_example(toml_text: str) -> str | None:
    """None if the example resolves to a valid config (validation builds a run's components), else why."""
    import tempfile

    from fedring.cli.run import build_config
    from fedring.errors import ConfigError

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "example.toml"
        path.write_text(toml_text)
        try:
            build_config(["--config", str(path), "--out", str(Path(tmp) / "x.h5")], 1)  # builds its components
        except ConfigError as e:
            return str(e)
    return None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python docs/cli_keys.py", description=__doc__.split("\n\n")[0])
    p.add_argument("tables", nargs="*", metavar="TABLE", help="tables to print (default: all)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--list", action="store_true", help="the table names")
    mode.add_argument("--write", action="store_true", help="rewrite the generated blocks of docs/cli.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if a generated block of docs/cli.md is stale")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(TABLES))
        return 0
    unknown = [t for t in args.tables if t not in TABLES]
    if unknown:
        p.error(f"unknown table(s) {', '.join(unknown)}; --list names them")
    names = args.tables or list(TABLES)
    if args.write or args.check:
        text = PAGE.read_text()
        blocks = page_blocks(text)
        stale = [n for n in names if n in blocks and blocks[n] != TABLES[n]() + "\n"]
        absent = [n for n in names if n not in blocks]
        if args.check:
            for n in stale:
                print(f"docs/cli.md: table {n} is stale (python docs/cli_keys.py --write)")
            for n in absent:
                print(f"docs/cli.md: table {n} has no generated block")
            examples = EXAMPLE.findall(text)
            bad = [(ex.splitlines()[0], why) for ex in examples if (why := check_example(ex)) is not None]
            for first, why in bad:
                print(f"docs/cli.md: example {first!r}: {why}")
            print(f"docs/cli.md: {len(blocks)} generated tables, {len(examples)} example files checked")
            return 1 if stale or absent or bad else 0
        new = BLOCK.sub(
            lambda m: m.group(1) + (TABLES[m["name"]]() + "\n" if m["name"] in names else m["body"]) + m.group(4), text
        )
        PAGE.write_text(new)
        print(
            f"docs/cli.md: {len(stale)} table(s) rewritten" + (f"; no block for {', '.join(absent)}" if absent else "")
        )
        return 0
    for name in names:
        print(f"<!-- {name} -->\n{TABLES[name]()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
