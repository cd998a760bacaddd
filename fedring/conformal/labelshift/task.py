"""The ``labelshift`` task: DP-FedCP under label shift, ``python -m fedring conformal labelshift``.

Settings are the section ``[labelshift]`` (:class:`LabelShiftSettings`; ``--help`` lists them,
``--targets 2 4`` or ``--set labelshift.targets=[2,4]``); the seed and the results file are the
top-level ``seed`` and ``out``. Agents are hosted by the MPI ranks in contiguous blocks (at most
as many ranks as agents); the results are bit-identical on any number of ranks and for any
``trial_batch``.

Results: the ``/calibration`` layout of :mod:`fedring.conformal.trials` (``docs/hdf5.md``), one
row per trial. ``cases`` has one entry per method and target agent (target-major)::

    {"label": "unweighted-local/target 2", "method": "unweighted-local", "target": 2}
    {"label": "nonprivate/target 2", "method": "nonprivate", "target": 2, "sigma_g": 0.0}
    {"label": "dp-eps=1/target 2", "method": "dp", "target": 2, "epsilon": 1.0, "weights":
     "exact counts", "delta": 1e-05, "count_noise": 0.0, "count_noise_epsilon": 0.0}

(targets 1-based; a ``dp`` case has ``epsilon`` or ``sigma_g``, the setting that fixes its noise,
and its weights come from "exact counts" or "privatised counts"). ``size_kind`` is "set size".
Per trial and case: ``coverage`` and ``size`` (mean set size) on the target's test distribution,
``threshold`` (cases, C) the per-label thresholds; ``exact_threshold`` (the exact eq. (8)
threshold the federated one approximates), ``sigma_g``, ``epsilon`` and ``lambda_max`` (cases, C)
for the federated cases (``nonprivate``, ``dp``), NaN for the baselines.

Privacy of a ``dp`` case: ``epsilon[trial, case, y]`` is Theorem 4.4's epsilon of the run of
Algorithm 1 for query label ``y``, at the case's ``delta``. A trial runs one per label, so by
basic composition it is (sum over y of epsilon, C * delta)-DP; the privatised label counts add
the case's ``count_noise_epsilon`` (at ``delta``). :func:`privacy_summary` takes the worst over
the trials, and the table printed at the end shows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from fedring import validate
from fedring.comm import Layout, Network
from fedring.config import Config, section_settings
from fedring.conformal.trials import TrialJob
from fedring.errors import ConfigError
from fedring.job import Driver
from fedring.runtime import on_rank0
from fedring.tasks import TASKS, Task
from fedring.validate import choice, integer, real

from .experiments import (
    GaussianExperiment,
    LogitsExperiment,
    load_logits_npz,
    logits_from_run,
)
from .privacy import count_noise_epsilon, sigma_g_min
from .protocol import BASELINES, METHODS, Plan, Protocol, check_numbers, variants

EXPERIMENTS = ("gaussians", "logits")
DESCRIPTION = (
    "DP-FedCP: federated conformal prediction under label shift, with differential privacy (Plassier et "
    "al., ICML 2023). Runs the paper's Gaussian simulation or its CIFAR-10 protocol on a classifier's "
    "logits; results stream to an HDF5 file (/calibration). Every option is also a settings key "
    "labelshift.<name> (--set, or a [labelshift] section of a TOML file); docs/labelshift.md."
)
FIELDS = ("coverage", "size", "threshold", "exact_threshold", "sigma_g", "epsilon", "lambda_max")

# The paper gives no numbers (its results are plots); these are its claims about each curve.
PAPER_CLAIMS = {
    "gaussians": {
        "unweighted-local": "too little data: unstable sets (Fig. 1b)",
        "unweighted-global": "driven by agent 1's scores: miscalibrated (Fig. 1b)",
        "oracle": "reference, ~ DP-FedCP (Fig. 1b)",
        "nonprivate": "close to oracle weights (Fig. 1b)",
    },
    "logits": {
        "unweighted-local": "significantly worse than DP-FedCP (Fig. 2)",
        "unweighted-global": "significantly worse than DP-FedCP (Fig. 2)",
        "nonprivate": "valid coverage (Fig. 2)",
    },
}
PAPER_DP_CLAIM = "robustness decreases as sigma_g grows (Fig. 3b, ImageNet)"


@dataclass
class LabelShiftSettings:
    """The section ``[labelshift]``: what a ``conformal labelshift`` run computes."""

    experiment: str | None = field(
        default=None,
        metadata={
            "help": "gaussians (the paper's simulation) or logits (its CIFAR-10 protocol on a classifier's test logits); "
            "none: logits with --logits or --model-from, else gaussians"
        },
    )
    methods: list = field(default_factory=lambda: list(METHODS), metadata={"help": "methods to run, or all"})
    logits: str | None = field(
        default=None, metadata={"help": "F.npz with arrays logits (N, C) and labels (N,) of a labelled test set"}
    )
    model_from: str | None = field(
        default=None,
        metadata={"help": "RUN.h5 of a fedring training run: its /model/final model on its data set's test set"},
    )
    save_logits: str | None = field(
        default=None, metadata={"help": "with --model-from: also save the logits it computes (F.npz)"}
    )
    trials: int = field(default=100, metadata={"help": "independent trials (the paper: 1000)"})
    alpha: float = field(default=0.1, metadata={"help": "miscoverage level: target coverage 1 - alpha"})
    epsilon: list[float] = field(
        default_factory=list,
        metadata={"help": "dp: per-query epsilon values, one dp variant each, its sigma_g set by Theorem 4.4"},
    )
    sigma_g: list[float] = field(
        default_factory=list,
        metadata={
            "help": "dp: gradient-noise std values, one dp variant each; without epsilon and sigma_g, dp uses 10"
        },
    )
    delta: float = field(default=1e-5, metadata={"help": "dp: per-query delta"})
    count_noise: float = field(
        default=0.0, metadata={"help": "dp: discrete-Gaussian std on the released label counts (Algorithm 2)"}
    )
    rounds: int = field(default=1000, metadata={"help": "Algorithm 1: rounds T"})
    local_steps: int = field(default=10, metadata={"help": "Algorithm 1: local steps K"})
    gamma: float = field(default=0.01, metadata={"help": "Algorithm 1: Moreau parameter"})
    eta: float | None = field(
        default=None, metadata={"help": "Algorithm 1: step size; none: gamma/10, the largest Theorem 4.1 allows"}
    )
    q0: float | None = field(default=None, metadata={"help": "Algorithm 1: initial quantile; none: 1 - alpha"})
    participants: int | None = field(
        default=None, metadata={"help": "Algorithm 1: agents sampled per round, S; none: all"}
    )
    targets: list[int] | None = field(
        default=None,
        metadata={
            "help": "target agents, 1-based, or all (also spelt 0); none: the experiment's (agent 2 of gaussians, "
            "agent 4 of logits)"
        },
    )
    temperature: float = field(default=1.0, metadata={"help": "logits: softmax temperature"})
    test_size: int = field(default=1000, metadata={"help": "gaussians: test points per trial"})
    bayes_prior: str = field(
        default="pooled", metadata={"help": "gaussians: prior of the Bayes classifier: pooled, uniform or target"}
    )
    shared_subsample: bool = field(
        default=False, metadata={"help": "one multinomial subsample per trial instead of one per query label"}
    )
    trial_batch: int = field(
        default=20, metadata={"help": "trials solved together (speed and memory only: the results do not depend on it)"}
    )

    def validate(self) -> None:
        """Raise ConfigError for a value out of range or a bad combination (the checks that need the
        number of agents: :func:`check_agents`)."""
        key = "labelshift."
        methods = list(dict.fromkeys(self.methods))
        for m in methods:
            choice(key + "methods", m, (*METHODS, "all"))
        if not methods:
            raise ConfigError(key + "methods", f"name at least one: {', '.join(METHODS)}, or all")
        self.methods = list(METHODS) if "all" in methods else methods
        check_numbers(
            key,
            alpha=self.alpha,
            gamma=self.gamma,
            eta=self.eta,
            delta=self.delta,
            count_noise=self.count_noise,
            rounds=self.rounds,
            local_steps=self.local_steps,
            participants=self.participants,
            temperature=self.temperature,
        )
        for name in ("trials", "test_size", "trial_batch"):
            integer(key + name, getattr(self, name), lo=1)
        self.epsilon = list(dict.fromkeys(real(key + "epsilon", e, lo=0, lo_open=True) for e in self.epsilon))
        self.sigma_g = list(dict.fromkeys(real(key + "sigma_g", s, lo=0) for s in self.sigma_g))
        choice(key + "bayes_prior", self.bayes_prior, GaussianExperiment.BAYES_PRIORS)
        if self.logits and self.model_from:
            raise ConfigError(key + "logits", "give --logits or --model-from, not both")
        if self.experiment is None:
            self.experiment = "logits" if (self.logits or self.model_from) else "gaussians"
        choice(key + "experiment", self.experiment, EXPERIMENTS)
        if self.experiment == "logits" and not (self.logits or self.model_from):
            raise ConfigError(key + "experiment", "logits needs --logits F.npz or --model-from RUN.h5")
        if self.experiment == "gaussians" and (self.logits or self.model_from):
            raise ConfigError(
                key + "experiment", "gaussians is simulated: drop --logits/--model-from, or use --experiment logits"
            )
        if self.save_logits and not self.model_from:
            raise ConfigError(key + "save_logits", "only with --model-from (it saves the logits computed from the run)")
        if (self.epsilon or self.sigma_g or self.count_noise) and "dp" not in self.methods:
            raise ConfigError(key + "methods", "epsilon, sigma_g and count_noise configure the method dp: add dp")
        if self.targets is not None:
            self.targets = list(dict.fromkeys(integer(key + "targets", t, lo=0) for t in self.targets))
            if 0 in self.targets and len(self.targets) > 1:
                raise ConfigError(key + "targets", f"0 means every agent: give it alone, got {self.targets}")


def settings_of(cfg: Config) -> LabelShiftSettings:
    """The run's validated ``[labelshift]`` section (``targets = "all"`` is read as ``[0]``)."""
    values = cfg.section("labelshift")
    if values.get("targets") in ("all", ["all"]):
        values["targets"] = [0]
    return section_settings(LabelShiftSettings, "labelshift", values)


def check_agents(settings: LabelShiftSettings, experiment: str, n: int, world_size: int) -> list[int]:
    """The checks that need the number of agents ``n``; returns the target agents, 0-based."""
    if n < world_size:
        raise ConfigError(
            "ranks",
            f"the {experiment} experiment has {n} agents and each MPI rank hosts at least "
            f"one: run it on at most {n} ranks, got {world_size}",
        )
    if settings.participants is not None:
        integer("labelshift.participants", settings.participants, lo=1, hi=n)
    for e in settings.epsilon:  # Theorem 4.4's domain: a bad (epsilon, delta) fails here, before any work
        try:
            sigma_g_min(e, settings.delta, settings.rounds, settings.local_steps, settings.participants or n, n, 1.0)
        except ConfigError as err:
            raise ConfigError(f"labelshift.{err.key}", err.message) from None
    if settings.targets is None:
        return [GaussianExperiment.default_target if experiment == "gaussians" else LogitsExperiment.default_target]
    if settings.targets == [0]:
        return list(range(n))
    bad = [t for t in settings.targets if not 1 <= t <= n]
    if bad:
        raise ConfigError("labelshift.targets", f"agents are numbered 1..{n} (0: all), got {bad}")
    return [t - 1 for t in settings.targets]


def build_experiment(settings: LabelShiftSettings, seed: int, comm: MPI.Comm):
    """Collective: the experiment; rank 0 reads or computes the logits and broadcasts them."""
    if settings.experiment == "gaussians":
        return GaussianExperiment(seed, settings.test_size, settings.bayes_prior)

    def load():
        if settings.logits:
            return load_logits_npz(settings.logits)
        logits, labels = logits_from_run(settings.model_from)
        if settings.save_logits:
            np.savez(settings.save_logits, logits=logits.astype(np.float32), labels=labels)
        return logits, labels

    logits, labels = on_rank0(comm, load)
    return LogitsExperiment(logits, labels, seed, settings.temperature)


def privacy_summary(cases: list[dict], rows: dict[str, np.ndarray]) -> dict[str, dict]:
    """Per ``dp`` case (by label), the worst (epsilon, delta) over the stored trials: per query
    label (Theorem 4.4) and composed over the ``C`` labels of a trial (basic composition), and
    the label counts' epsilon (module docstring)."""
    eps = rows["epsilon"]  # (trials, cases, C)
    out = {}
    for j, case in enumerate(cases):
        if case["method"] == "dp":
            out[case["label"]] = {
                "epsilon_per_query": float(eps[:, j].max()),
                "epsilon_composed": float(eps[:, j].sum(axis=-1).max()),
                "delta_per_query": case["delta"],
                "delta_composed": case["delta"] * eps.shape[-1],
                "count_noise_epsilon": case["count_noise_epsilon"],
            }
    return out


def _stats(values: np.ndarray) -> tuple[float, float, float, float]:
    v = np.asarray(values, dtype=np.float64)
    sd = float(v.std(ddof=1)) if v.size > 1 else 0.0
    return float(v.mean()), sd, float(np.quantile(v, 0.05)), float(np.quantile(v, 0.95))


class LabelShiftJob(TrialJob):
    """The trials of one run: Algorithm 2 and the baselines per batch (:class:`.protocol.Protocol`)."""

    size_kind = "set size"
    settings: LabelShiftSettings

    def __init__(
        self, cfg: Config, comm: MPI.Comm, net: Network, settings: LabelShiftSettings, exp, targets: list[int]
    ):
        super().__init__(cfg, comm, net)
        s = self.settings = settings
        self.exp, self.targets = exp, targets
        self.alpha, self.trials, self.batch = s.alpha, s.trials, s.trial_batch
        self.variants = variants(s.methods, s.epsilon, s.sigma_g, s.count_noise)
        plan = Plan(
            seed=cfg.seed,
            targets=tuple(targets),
            baselines=tuple(m for m in BASELINES if m in s.methods),
            variants=tuple(self.variants),
            alpha=s.alpha,
            delta=s.delta,
            count_noise=s.count_noise,
            rounds=s.rounds,
            local_steps=s.local_steps,
            gamma=s.gamma,
            eta=s.eta,
            q0=s.q0,
            participants=s.participants,
            shared_subsample=s.shared_subsample,
        )
        self.protocol = Protocol(plan, exp.sizes, exp.n_classes, net)
        self.names = [*plan.baselines, *(v.name for v in self.variants)]
        self.cases = [self._case(name, t) for t in targets for name in self.names]

    def _case(self, name: str, target: int) -> dict:
        case = {"label": f"{name}/target {target + 1}", "method": name, "target": target + 1}
        for v in self.variants:
            if v.name == name and v.number == 0:
                case["sigma_g"] = 0.0
            elif v.name == name:
                noise = self.settings.count_noise if v.noisy_counts else 0.0
                case.update(
                    {
                        "method": "dp",
                        v.noise_set_by: v.value,
                        "weights": "privatised counts" if v.noisy_counts else "exact counts",
                        "delta": self.settings.delta,
                        "count_noise": noise,
                        "count_noise_epsilon": count_noise_epsilon(noise, self.settings.delta) if noise else 0.0,
                    }
                )
        return case

    def run_batch(self, trials: list[int]) -> list[dict] | None:
        res = self.protocol.run_batch(self.exp, trials)
        if res is None:
            return None
        nan = np.full(self.exp.n_classes, np.nan)
        rows = []
        for bi in range(len(trials)):
            row: dict[str, list] = {key: [] for key in FIELDS}
            for s in range(len(self.targets)):
                for name in self.names:
                    for key in FIELDS:
                        per_method = res[key]
                        row[key].append(per_method[name][bi, s] if name in per_method else nan)
            rows.append({key: np.asarray(v, dtype=np.float64) for key, v in row.items()})
        return rows

    def describe(self, row: dict) -> str:
        cov = row["coverage"].reshape(len(self.targets), len(self.names)).mean(axis=0)
        where = "" if len(self.targets) == 1 else f" (mean over {len(self.targets)} targets)"
        return f"coverage{where}: " + ", ".join(f"{name} {c:.3f}" for name, c in zip(self.names, cov))

    def summary(self, rows: dict[str, np.ndarray]) -> str:
        s, exp = self.settings, self.exp
        eta = s.eta if s.eta is not None else s.gamma / 10
        cov = rows["coverage"]
        lines = [
            f"DP-FedCP label shift, experiment={exp.name}, trials={cov.shape[0]}, alpha={s.alpha:g} (target "
            f"coverage {1 - s.alpha:g}); T={s.rounds} K={s.local_steps} gamma={s.gamma:g} eta={eta:g}",
            "The paper reports no numbers (Figs. 1-3 are plots): its claims are quoted.",
        ]
        claims = PAPER_CLAIMS.get(exp.name, {})
        privacy = privacy_summary(self.cases, rows)
        for ti, star in enumerate(self.targets):
            lines += [
                "",
                f"target agent {star + 1} (N={int(exp.sizes[star])})",
                f"  {'method':<20} {'coverage':>8} {'sd':>7} {'5%':>7} {'95%':>7} {'size':>7}  paper",
            ]
            for j, name in enumerate(self.names):
                col = ti * len(self.names) + j
                mean, sd, q05, q95 = _stats(cov[:, col])
                note = claims.get(name, "") if star == exp.default_target else ""
                if self.cases[col]["method"] == "dp":
                    p = privacy[self.cases[col]["label"]]
                    note = (
                        f"eps/query<={p['epsilon_per_query']:.3g}, eps/trial<={p['epsilon_composed']:.3g}; "
                        f"{PAPER_DP_CLAIM}"
                    )
                lines.append(
                    f"  {name:<20} {mean:8.4f} {sd:7.4f} {q05:7.4f} {q95:7.4f} "
                    f"{rows['size'][:, col].mean():7.3f}  {note}".rstrip()
                )
        if self.variants:
            lines.append("")
            gap = np.abs(rows["threshold"] - rows["exact_threshold"]).max(axis=-1)  # (trials, cases)
            for j, name in enumerate(self.names):
                if name in {v.name for v in self.variants}:
                    cols = [ti * len(self.names) + j for ti in range(len(self.targets))]
                    lines.append(f"  {name}: mean over runs of max_y |Qhat_y - Q(mu_y)| = {gap[:, cols].mean():.4f}")
        for label, p in privacy.items():
            counts = f"; label counts eps {p['count_noise_epsilon']:.3g}" if p["count_noise_epsilon"] else ""
            lines.append(
                f"  privacy {label}: (eps {p['epsilon_per_query']:.3g}, delta {p['delta_per_query']:.3g}) "
                f"per query label, (eps {p['epsilon_composed']:.3g}, delta {p['delta_composed']:.3g}) "
                f"per trial{counts}"
            )
        return "\n".join(lines)


@TASKS.register
class LabelShiftTask(Task):
    """DP-FedCP under label shift (:mod:`fedring.conformal.labelshift`)."""

    name = "labelshift"

    def __init__(self, cfg: Config, world_size: int):
        super().__init__(cfg, world_size)
        for section in cfg.sections:
            if section != "labelshift":
                raise validate.unknown(section, "settings section of task labelshift", section, ["labelshift"])
        self.settings = settings_of(cfg)
        if self.settings.experiment == "gaussians":  # the logits experiment's agents are known once its file is read
            check_agents(self.settings, "gaussians", GaussianExperiment.n_agents, world_size)

    def default_out(self) -> str:
        return f"results/labelshift-{self.settings.experiment}-s{self.cfg.seed}.h5"

    def steps(self) -> tuple[int, str]:
        return self.settings.trials, "trials"

    def banner(self, world_size: int) -> str:
        cfg, s = self.cfg, self.settings
        agents = f"{GaussianExperiment.n_agents} agents" if s.experiment == "gaussians" else "one agent per class"
        fed = variants(s.methods, s.epsilon, s.sigma_g)
        names = [*(m for m in BASELINES if m in s.methods), *(v.name for v in fed)]
        return (
            f"fedring: labelshift: {s.experiment} experiment, {agents} on {world_size} rank"
            f"{'s' if world_size > 1 else ''}; methods {', '.join(names)}; {s.trials} trials, seed {cfg.seed} "
            f"-> {cfg.out}"
        )

    def prepare(self, comm: MPI.Comm) -> Driver:
        cfg, settings = self.cfg, self.settings
        exp = build_experiment(settings, cfg.seed, comm)
        targets = check_agents(settings, exp.name, exp.n_agents, comm.size)
        settings.targets = [t + 1 for t in targets]  # stored resolved with the results
        return Driver(LabelShiftJob(cfg, comm, Network(Layout(exp.n_agents, comm)), settings, exp, targets), cfg, comm)


def main(argv: list[str]) -> int:
    """``python -m fedring conformal labelshift [options]``; returns the exit code.

    The CLI imports the task registry, which imports this module: it is imported only here."""
    from fedring.cli.run import run, section_parser

    return run(argv, section_parser("labelshift", LabelShiftSettings, DESCRIPTION), section="labelshift")
