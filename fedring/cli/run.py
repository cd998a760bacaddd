"""``python -m fedring [run] [options]`` (one run) and ``python -m fedring`` (the headline experiment).

Works under ``mpiexec -n N`` and without it (one rank). Every rank parses the same
arguments and validates the same settings, so bad input stops every rank alike with exit
code 2 before any work starts.
"""

from __future__ import annotations

import argparse
import os

from mpi4py import MPI

from fedring.config import Config, load_toml, merge, parse_value, validate
from fedring.errors import ConfigError
from fedring.runtime import Watchdog, agree_on_config_error

class ArgumentParser(argparse.ArgumentParser):
    """Reports usage errors as :class:`ConfigError`, so only rank 0 prints them."""

    def error(self, message):
        raise ConfigError("arguments", f"{message} (see python -m fedring --help)")


def run_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="python -m fedring [run]",
        description="Federated training over MPI; results stream to an HDF5 file.",
    )
    add = p.add_argument
    add("--config", metavar="FILE.toml", help="settings file (keys as below, sections as [name])")
    add("--set", action="append", default=[], metavar="KEY=VALUE", help="any setting, e.g. rounds=5 or krum.variant=byzfl")
    add("--topology", help="ring | server (default ring)")
    add("--aggregator", help="aggregation rule (default mean)")
    add("--pre-aggregators", dest="pre_aggregators", metavar="A,B", help="pre-aggregators in front of a server rule: nnm, bucketing, clipping")
    add("--byzantine", type=float, metavar="X", help="Byzantine clients: a fraction (< 1) or a count (default 0)")
    add("--declared-f", dest="declared_f", type=int, metavar="F", help="Byzantine count the defence is told (default: actual)")
    add("--attack", help="attack of the Byzantine clients (default none); parameters as attack.KEY")
    add("--clients", type=int, metavar="K", help="logical clients (default: number of ranks)")
    add("--dataset", help="fashion-mnist | synthetic (default fashion-mnist)")
    add("--data-dir", dest="data_dir", metavar="DIR", help="Fashion-MNIST IDX files (default $FEDRING_DATA or Debian's)")
    add("--partition", help="iid | fang | dirichlet (default fang)")
    add("--noniid", type=float, metavar="X", help="Fang's degree q (default 0.5) or Dirichlet alpha")
    add("--rounds", type=int, metavar="R")
    add("--lr", type=float)
    add("--lr-schedule", dest="lr_schedule", help="constant | step | invsqrt | cosine (default constant); parameters as step.KEY ...")
    add("--batch-size", dest="batch_size", type=int)
    add("--local-steps", dest="local_steps", type=int)
    add("--seed", type=int, metavar="S")
    add("--eval-every", dest="eval_every", type=int, metavar="E")
    add("--out", metavar="PATH.h5")
    add("--checkpoint-every", dest="checkpoint_every", type=int, metavar="C", help="checkpoint into the results file every C rounds (default 10)")
    add("--overwrite", action="store_const", const=True)
    add("--resume", action="store_const", const=True, help="continue the run stored in --out from its checkpoint")
    add("--quiet", action="store_const", const=True)
    return p


def build_config(argv: list[str], world_size: int) -> Config:
    args = run_parser().parse_args(argv)
    cfg = Config()
    if args.config:
        merge(cfg, load_toml(args.config), args.config)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError("set", f"expected KEY=VALUE, got {item!r}")
        merge(cfg, {key.strip(): parse_value(value.strip())}, "--set")
    named = {k: v for k, v in vars(args).items() if k not in ("config", "set") and v is not None}
    merge(cfg, named, "command line")
    return validate(cfg, world_size)


def run(argv: list[str]) -> int:
    watchdog = Watchdog.start()  # first: a signal from now on asks for a clean stop
    from fedring.train.loop import train  # torch is imported only for training
    from fedring.train.trainer import Trainer

    comm = MPI.COMM_WORLD

    def job() -> int:
        error, trainer = None, None
        try:
            cfg = build_config(argv, comm.size)
            watchdog.grace = cfg.stop_grace
            trainer = Trainer(cfg, comm)
        except ConfigError as e:
            error = e
        agree_on_config_error(comm, error)
        return train(trainer, watchdog)

    return watchdog.run(job)


#: ``python -m fedring`` with no options: the BRACE paper's headline case, BRACE against an
#: attack next to plain ring-all-reduce, 20% Byzantine clients sending Gaussian noise. BRACE's
#: threshold keeps the paper's ratio, lambda = 5 per 100 clients (set per run below).
HEADLINE = {
    "ring-all-reduce": ["--aggregator", "mean", "--lr", "0.1", "--out", "results/headline-ring-all-reduce.h5"],
    "BRACE": ["--aggregator", "brace", "--lr", "0.003", "--out", "results/headline-brace.h5"],
}
HEADLINE_COMMON = ["--attack", "gaussian", "--byzantine", "0.2", "--rounds", "2500", "--eval-every", "250"]


def headline() -> int:
    """Run the headline experiment (two runs in one job) and set their final accuracies side by side."""
    import h5py

    comm = MPI.COMM_WORLD
    existing = [args[-1] for args in HEADLINE.values() if os.path.exists(args[-1])]
    clash = f"{', '.join(existing)} exist(s) from an earlier run: delete them to run the headline again"
    agree_on_config_error(comm, ConfigError("out", clash) if existing else None)
    clients = max(comm.size, 5)  # one Byzantine client at least, also on one or two ranks
    for name, args in HEADLINE.items():
        if comm.rank == 0:
            print(f"== {name}: 20% of the clients are Byzantine and send Gaussian noise (sigma 200)", flush=True)
        lam = ["--set", f"brace.lambda={0.05 * clients:g}"] if "brace" in args else []
        code = run([*HEADLINE_COMMON, *args, *lam, "--clients", str(clients)])
        if code != 0:
            return code
    if comm.rank == 0:
        print("\nfinal test accuracy under the attack:")
        for name, args in HEADLINE.items():
            with h5py.File(args[-1], "r") as f:
                print(f"  {name:<16} {f['metrics/test_accuracy'][-1]:.4f}   ({args[-1]})")
    return 0
