"""``python -m fedring [run] [options]`` (one run) and ``python -m fedring`` (the headline experiment).

Works under ``mpiexec -n N`` and without it (one rank). Every rank parses the same
arguments and validates the same settings, so bad input stops every rank alike with exit
code 2 before any work starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import TYPE_CHECKING

from mpi4py import MPI

from fedring import validate
from fedring.config import (
    GENERAL,
    RUN_CONTROL,
    TRACKING,
    Config,
    config_differences,
    load_toml,
    merge,
    parse_setting,
    parse_value,
)
from fedring.errors import ConfigError
from fedring.names import CHECKPOINT, METRICS
from fedring.runtime import Watchdog, agree_on_config_error, world
from fedring.tasks import Task, make_task

from .launcher import launched_ranks

if TYPE_CHECKING:
    from fedring.job import Driver


class ArgumentParser(argparse.ArgumentParser):
    """Reports usage errors as :class:`ConfigError` (so only rank 0 prints them); ``--help``
    is printed by rank 0 only; options must be spelt out (no abbreviations)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):
        if message.startswith("unrecognized arguments:"):  # the first misspelt option gets a suggestion
            for arg in message.split(":", 1)[1].split():
                name = arg.split("=", 1)[0]
                if name.startswith("--"):
                    close = validate.closest(name, [o for o in self._option_string_actions if o.startswith("--")])
                    if close:
                        raise ConfigError(
                            "arguments", f"unknown option {name}; did you mean {close}? (see {self.prog} --help)"
                        )
        raise ConfigError("arguments", f"{message} (see {self.prog} --help)")

    def print_help(self, file=None):
        if (world().rank if MPI.Is_initialized() else launched_ranks()[0]) == 0:
            super().print_help(file)


def general_options(p: argparse.ArgumentParser) -> None:
    """The options of every task: settings files, --set, seed, output, resume."""
    add = p.add_argument
    add("--config", metavar="FILE.toml", help="settings file (keys as below, sections as [name]); applied first")
    add(
        "--plugin",
        dest="plugins",
        action="append",
        metavar="MODULE",
        help="import the user's MODULE on every rank first, so that its components register (repeatable; "
        "docs/tutorial.md)",
    )
    add(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any setting, as KEY=VALUE or SECTION.KEY=VALUE (after --config, before the options here)",
    )
    add("--seed", type=int, metavar="S", help="every random draw derives from it (default 0)")
    add("--out", metavar="PATH.h5", help="results file (default: results/<a name made of the settings>.h5)")
    add("--overwrite", action="store_const", const=True, help="replace an existing results file")
    add("--resume", action="store_const", const=True, help="continue the run stored in --out from its checkpoint")
    add("--quiet", action="store_const", const=True, help="no banner and no progress lines")
    add(
        "--log",
        metavar="T,T",
        help="rank 0 also logs every step's scalars to these experiment trackers: tensorboard, mlflow "
        "(extras of the same names; docs/hdf5.md#experiment-trackers); --resume goes on with the file's",
    )


def run_parser() -> ArgumentParser:
    from fedring.aggregators import AGGREGATORS, PRE_AGGREGATORS
    from fedring.attacks import ATTACKS
    from fedring.comm import RING_RULES
    from fedring.datasets import DATASETS
    from fedring.train.schedules import SCHEDULES
    from fedring.train.task import PARTITIONS

    d = Config()
    p = ArgumentParser(
        prog="python -m fedring run",
        description="Federated training over MPI (task train); results stream to an HDF5 file. Every option is "
        "also a settings key (--set key=value, or a TOML file); a component's parameters go in a "
        "section named after it (--set krum.variant=byzfl, --set attack.sigma=50). docs/cli.md lists "
        "every key of every task.",
    )
    general_options(p)
    add = p.add_argument
    add("--topology", help=f"ring (the logical ring of clients) or server (rank 0 aggregates); default {d.topology}")
    add(
        "--aggregator",
        metavar="RULE",
        help=f"on the ring: {', '.join(RING_RULES)}; on a server: {', '.join(AGGREGATORS)} (default {d.aggregator})",
    )
    add(
        "--pre-aggregators",
        dest="pre_aggregators",
        metavar="A,B",
        help=f"in front of a server rule, in order: {', '.join(PRE_AGGREGATORS)} (default none)",
    )
    add(
        "--clients",
        type=int,
        metavar="K",
        help="logical clients, K >= ranks; rank r hosts a contiguous block (default: one per rank)",
    )
    add(
        "--byzantine",
        type=float,
        metavar="X",
        help="Byzantine clients: a fraction (< 1, rounded) or a count (default 0)",
    )
    add(
        "--declared-f",
        dest="declared_f",
        type=int,
        metavar="F",
        help="the Byzantine count the defence is told (default: the actual count)",
    )
    add("--attack", metavar="NAME", help=f"none, {', '.join(ATTACKS)} (default none); parameters as attack.KEY")
    add("--dataset", help=f"{', '.join(DATASETS)} (default {d.dataset}); its default model fits its images")
    add(
        "--data-dir",
        dest="data_dir",
        metavar="DIR",
        help="the data set's files (Fashion-MNIST: default $FEDRING_DATA, else Debian's "
        "/usr/share/datasets/fashion-mnist; CIFAR-10: the cifar-10-batches-py folder; the others: "
        "docs/datasets.md)",
    )
    add(
        "--model",
        metavar="NAME",
        help="the network: for 28x28 grey images cnn (default), cnn_bn (cnn with BatchNorm), mlp or lenet5; for 32x32 colour "
        "(cifar10) cnn_cifar, resnet18 (BatchNorm) or resnet18_gn; or package.module:Name (docs/tutorial.md)",
    )
    add("--partition", help=f"{', '.join(PARTITIONS)} (default {d.partition})")
    add("--noniid", type=float, metavar="X", help=f"Fang's degree q, or the Dirichlet alpha (default {d.noniid})")
    add(
        "--rounds",
        type=int,
        metavar="R",
        help=f"communication rounds (default {d.rounds}: a quick look; the papers' runs name theirs, 300 to 2000)",
    )
    add(
        "--lr",
        type=float,
        help=f"w <- w - lr * aggregate; the sign rules move each coordinate by lr (default {d.lr}; use ~3e-3 for them)",
    )
    add(
        "--lr-schedule",
        dest="lr_schedule",
        metavar="NAME",
        help=f"{', '.join(SCHEDULES)} (default constant); parameters as step.KEY ...",
    )
    add(
        "--batch-size",
        dest="batch_size",
        type=int,
        metavar="B",
        help=f"mini-batch per client and local step (default {d.batch_size})",
    )
    add(
        "--local-steps",
        dest="local_steps",
        type=int,
        metavar="S",
        help=f"1: FedSGD; k > 1: (w - w_local)/lr after k SGD steps (default {d.local_steps})",
    )
    add(
        "--eval-every",
        dest="eval_every",
        type=int,
        metavar="E",
        help=f"evaluate (and print a line) every E rounds and at the last (default {d.eval_every})",
    )
    add(
        "--checkpoint-every",
        dest="checkpoint_every",
        type=int,
        metavar="C",
        help=f"checkpoint into the results file every C rounds (default {d.checkpoint_every})",
    )
    return p


def section_parser(task: str, schema: type, description: str) -> ArgumentParser:
    """``python -m fedring conformal <task>``: the general options and one option per field of
    the task's settings dataclass ``schema`` (``--calib-attack`` sets ``<task>.calib_attack``);
    each field's ``metadata["help"]`` is its help text, shown with its default."""
    p = ArgumentParser(prog=f"python -m fedring conformal {task}", description=description)
    general_options(p)
    for f in dataclasses.fields(schema):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if default is None:
            shown = "unset"
        elif isinstance(default, bool):
            shown = str(default).lower()
        elif isinstance(default, list):
            shown = ", ".join(map(str, default)) or "none"
        else:
            shown = str(default)
        help_text = f"{f.metadata.get('help', '')} (default {shown})".strip()
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", "bool | None"):
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif f.type.startswith("list"):
            p.add_argument(flag, dest=f.name, nargs="+", type=parse_value, metavar="V", help=help_text)
        else:
            p.add_argument(flag, dest=f.name, type=parse_value, metavar=f.name.upper(), help=help_text)
    return p


def build_config(
    argv: list[str], world_size: int, parser: ArgumentParser | None = None, section: str | None = None
) -> Config:
    """The validated config of a command line (:func:`build_task`'s)."""
    return build_task(argv, world_size, parser, section).cfg


def build_task(
    argv: list[str], world_size: int, parser: ArgumentParser | None = None, section: str | None = None
) -> Task:
    """The task of a command line, its config validated: ``--config``, then ``--set``, then the named options.

    With ``section``, the named options other than the general ones are that task's settings
    (``python -m fedring conformal prism --trials 5`` sets ``prism.trials``). With ``--resume``
    the settings stored in the ``--out`` file come first: the file alone is enough, and a
    setting given here must agree with it.
    """
    args = (parser or run_parser()).parse_args(argv)
    layers = [(load_toml(args.config), args.config)] if args.config else []
    layers += [(parse_setting(item), "--set") for item in args.set]
    named = {k: v for k, v in vars(args).items() if k not in ("config", "set") and v is not None}
    if section is not None:
        layers.append(({"task": section}, "command line"))
        named = {k if k in GENERAL else f"{section}.{k}": v for k, v in named.items()}
    layers.append((named, "command line"))
    cfg = Config()
    for items, origin in layers:
        merge(cfg, items, origin)
    if cfg.resume and not cfg.overwrite and cfg.out is not None and os.path.exists(cfg.out):
        cfg = resumed_config(cfg.out, layers)
    return make_task(cfg, world_size)


def resumed_config(path: str, layers: list[tuple[dict, str]]) -> Config:
    """The settings stored in the results file ``path`` with ``layers`` applied over them; a
    result-changing setting given that differs from the stored one is an error naming it. The
    run-control settings are not taken from the file: they are this command's own, but for the
    experiment trackers' (``log`` ...), which are the file's unless given."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            stored = json.loads(f.attrs["config"])
    except (OSError, KeyError, ValueError) as e:
        raise ConfigError(
            "resume",
            f"{path} is not a readable fedring results file ({type(e).__name__}: {e}); "
            "it is left as it is: remove it, or start afresh with --overwrite",
        ) from None
    # the run-control settings (--quiet, --checkpoint-every ...) steer this invocation, not the results;
    # the trackers' come along, so that a resumed run goes on logging to the run it logged to
    kept = {k: v for k, v in stored.items() if k != "sections" and (k not in RUN_CONTROL or k in TRACKING)}
    cfg = merge(Config(), kept, path)
    cfg.sections = {name: dict(values) for name, values in stored.get("sections", {}).items()}
    for items, origin in layers:
        merge(cfg, items, origin)
    diff = config_differences(stored, json.loads(cfg.to_json()))
    if diff:
        raise ConfigError(
            "resume",
            f"{path} was written with other settings (file -> given): {'; '.join(diff)}; "
            "leave them out: --resume takes the file's own",
        )
    cfg.resume, cfg.overwrite = True, False
    return cfg


def resume_line(task: Task) -> str:
    """``resuming FILE from round R of T`` (rank 0, after the job read the checkpoint)."""
    import h5py

    with h5py.File(task.cfg.out, "r") as f:
        root = f[CHECKPOINT]
        done = int(root[root.attrs["current"]].attrs["round"])
    total, unit = task.steps()
    return f"fedring: resuming {task.cfg.out} from {unit.removesuffix('s')} {done} of {total}"


def run(argv: list[str], parser: ArgumentParser | None = None, section: str | None = None) -> int:
    """One run of any task, on every rank: settings agreed, a banner, then the job under the watchdog."""
    watchdog = Watchdog.start()  # first: a signal from now on asks for a clean stop
    comm = world()

    def job() -> int:
        error: ConfigError | None = None
        task: Task | None = None
        work: Driver | None = None
        try:
            task = build_task(argv, comm.size, parser, section)
            watchdog.grace = task.cfg.stop_grace
        except ConfigError as e:
            error = e
        agree_on_config_error(comm, error)  # before prepare's collectives: a plugin may fail on one rank only
        assert task is not None, "every rank exited if any failed"
        try:
            work = task.prepare(comm)
        except ConfigError as e:
            error = e
        agree_on_config_error(comm, error)
        assert work is not None, "every rank exited if any failed"
        if comm.rank == 0 and not task.cfg.quiet:
            print(task.banner(comm.size), flush=True)
            if task.cfg.resume:
                print(resume_line(task), flush=True)
        return work.run(watchdog)

    return watchdog.run(job)


#: ``python -m fedring``: the BRACE paper's headline case at a size this machine runs in a few
#: minutes. The same 20 % of the clients send Gaussian noise to three ring rules; every run uses
#: the step schedule (lr x 0.1 after 60 % of the rounds), under which BRACE settles
#: (docs/brace.md). BRACE's threshold keeps the paper's ratio, lambda = 5 per 100 clients.
HEADLINE = [
    (
        "ring-all-reduce",
        "results/headline-ring-all-reduce.h5",
        ["--aggregator", "mean", "--lr", "0.1"],
        "plain ring-all-reduce (mean): the noisy clients destroy it (0.10 is chance)",
    ),
    (
        "BRACE, paper rule",
        "results/headline-brace.h5",
        ["--aggregator", "brace", "--lr", "0.003"],
        "BRACE as printed (eq. 1): S <= lambda gives -1, so weakly agreed weights drift up",
    ),
    (
        "BRACE, symmetric",
        "results/headline-brace-symmetric.h5",
        ["--aggregator", "brace", "--lr", "0.003", "--set", "brace.rule=symmetric"],
        "not in the paper: 0 between -lambda and lambda, so weak agreement moves nothing",
    ),
]
HEADLINE_COMMON = [
    "--attack",
    "gaussian",
    "--byzantine",
    "0.2",
    "--rounds",
    "600",
    "--eval-every",
    "40",
    "--lr-schedule",
    "step",
]
#: the accuracy printed is the mean of the last evaluations (one evaluation fluctuates by ~0.05)
HEADLINE_WINDOW = 5


def headline(overwrite: bool = False, quiet: bool = False) -> int:
    """The headline job: the runs of :data:`HEADLINE` one after the other, then their final-window accuracies."""
    import h5py
    import numpy as np

    comm = world()
    existing = [out for _, out, _, _ in HEADLINE if os.path.exists(out)]
    clash = f"{', '.join(existing)} exist(s) from an earlier run: pass --overwrite to run the headline again"
    agree_on_config_error(comm, ConfigError("out", clash) if existing and not overwrite else None)
    clients = max(comm.size, 5)  # one Byzantine client at least, also on one or two ranks
    for _, out, args, _ in HEADLINE:
        lam = ["--set", f"brace.lambda={0.05 * clients:g}"] if "brace" in args else []
        code = run(
            [
                *HEADLINE_COMMON,
                *args,
                *lam,
                "--clients",
                str(clients),
                "--out",
                out,
                *(["--overwrite"] if overwrite else []),
                *(["--quiet"] if quiet else []),
            ]
        )
        if code != 0:
            return code
    if comm.rank == 0:
        print(f"\ntest accuracy under the attack, mean of the last {HEADLINE_WINDOW} evaluations:")
        for name, out, _, meaning in HEADLINE:
            with h5py.File(out, "r") as f:
                metrics = f[METRICS]
                rounds, acc = metrics["round"][-HEADLINE_WINDOW:], metrics["test_accuracy"][-HEADLINE_WINDOW:]
            print(f"  {name:<18} {np.mean(acc):.4f}  (rounds {rounds[0]}-{rounds[-1]})  {meaning}")
        print(
            "results: "
            + ", ".join(out for _, out, _, _ in HEADLINE)
            + "; python -m analysis plot-drift results/headline-brace*.h5 --out drift.png draws the drift"
        )
    return 0
