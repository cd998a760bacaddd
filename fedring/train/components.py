"""Every component of a training run, built once from its settings: validation builds them (without
torch) and the run uses these instances.

A component reads the settings section named after it (``[krum]``, ``[step]``, ``[adam]``; an
attack reads ``attack.*``), and a server rule says which other sections it reads
(:meth:`fedring.aggregators.Aggregator.reads`: a pre-aggregator's, H+'s base rule's). A setting a
component takes from Python but refuses in a run says why in its class's ``run_refuses``
(the sign rules' ``relay_clients``: a run's relays are its Byzantine clients). A section that no
component of the run reads is an error, so a typo never passes silently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedring import validate
from fedring.aggregators import AGGREGATORS, PRE_AGGREGATORS, Aggregator, make_aggregator
from fedring.attacks import ATTACKS, DataAttack, ModelAttack, make_attack
from fedring.comm import RING_RULES
from fedring.comm.ring import RingRule
from fedring.config import Config, byzantine_count, defence_f
from fedring.datasets import DATASETS
from fedring.errors import ConfigError

from .data import PARTITION_SETTINGS, partition_settings
from .optim import SERVER_OPTIMIZERS, ClientOptimizer, ServerSGD, make_server_optimizer
from .participation import cohort_f, cohort_size
from .privacy import Privacy, from_settings
from .schedules import SCHEDULES, Schedule, make_schedule


@dataclass(frozen=True)
class Components:
    """A run's components: its ``rule`` (a server rule with its pre-aggregators, or the ring rule for
    every client, with ``ring_rule(m)`` building it for a cohort of ``m``), its ``attack``, learning-rate
    ``schedule`` and optimizers; ``reads``: the settings sections they read."""

    rule: Aggregator | RingRule
    ring_rule: Callable[[int], RingRule] | None
    attack: ModelAttack | DataAttack | None
    schedule: Schedule
    client_optimizer: ClientOptimizer
    server_optimizer: ServerSGD
    #: client-level differential privacy (``dp``)
    privacy: Privacy
    reads: frozenset[str]
    #: the rule as the banner names it: ``bucketing+krum``, ``brace (paper rule)`` (a rule's ``summary``)
    label: str


def rule_class(cfg: Config) -> type[Any]:
    """The class of the run's rule, from the registry of its topology (the one place the name is
    resolved); a near miss, or a rule of the other topology, gets a hint."""
    rules = {"ring": RING_RULES, "server": AGGREGATORS}
    here = rules[cfg.topology]
    if ":" in cfg.aggregator or cfg.aggregator in here:  # an import path is imported and checked by get
        return here.get(cfg.aggregator, "aggregator")
    other = "server" if cfg.topology == "ring" else "ring"
    allowed, there = ", ".join(here), list(rules[other])
    move = f"a {other} rule: add --topology {other}"
    if cfg.aggregator in there:
        raise ConfigError("aggregator", f"{cfg.aggregator!r} is {move}; allowed on the {cfg.topology}: {allowed}")
    close = validate.closest(cfg.aggregator, [*here, *there])
    hint = "" if close is None else f"did you mean {close!r}{'' if close in here else f' ({move})'}? "
    raise ConfigError(
        "aggregator", f"unknown aggregator {cfg.aggregator!r}; {hint}allowed on the {cfg.topology}: {allowed}"
    )


def refused(name: str, cls: type, params: dict) -> None:
    """A setting ``cls`` takes from Python but refuses in a run (its ``run_refuses``: key -> why)."""
    for key, why in getattr(cls, "run_refuses", {}).items():
        if key in params:
            raise ConfigError(f"{name}.{key}", why)


def ring_rule_builder(cfg: Config, cls: type[RingRule]) -> Callable[[int], RingRule]:
    """The ring rule ``cls`` for a ring of ``m`` of the run's clients, its settings read relative to ``m``."""
    section, n = cfg.section(cfg.aggregator), cfg.n_clients
    refused(cfg.aggregator, cls, section)

    def build(m: int) -> RingRule:
        params = section if m == n else cls.cohort_params(section, m, n)
        return RING_RULES.build(cfg.aggregator, params, key="aggregator", n_clients=m, seed=cfg.seed)

    return build


def server_rule(cfg: Config, cls: type[Aggregator], privacy: Privacy) -> Aggregator:
    """The server rule ``cls`` with its pre-aggregators, told the declared ``f``, checked for every
    client and for the cohort the participation setting draws. Central DP clips every row first."""
    f = defence_f(cfg)
    refused(cfg.aggregator, cls, cfg.section(cfg.aggregator))
    pre, sections = cfg.pre_aggregators, cfg.sections
    if privacy.mode == "central":
        pre, sections = ["clipping"], {**sections, "clipping": {"c": privacy.clip}}
    rule = make_aggregator(cfg.aggregator, f, cfg.section(cfg.aggregator), pre, sections)
    reason = rule.check(cfg.n_clients)
    if reason is not None:
        raise ConfigError("aggregator", reason)
    m = cohort_size(cfg.participation, cfg.n_clients)
    reason = rule.with_f(cohort_f(cfg.cohort_f, f, m, cfg.n_clients)).check(m)
    if reason is not None:
        raise ConfigError("participation", f"a cohort of {m} per round: {reason}")
    return rule


def build(cfg: Config) -> Components:
    """Every component of the run, from its settings; a one-line :class:`ConfigError` naming the setting
    for anything wrong, before any work."""
    client_optimizer = ClientOptimizer(cfg.momentum, cfg.nesterov, cfg.weight_decay, cfg.clip_norm, cfg.dampening)
    server_optimizer = make_server_optimizer(cfg.server_optimizer, cfg.section(cfg.server_optimizer))
    for name in cfg.pre_aggregators:
        PRE_AGGREGATORS.get(name, "pre_aggregators")
        if cfg.topology != "server":
            raise ConfigError("pre_aggregators", f"{name!r} runs in front of a server rule: add --topology server")
    privacy = from_settings(cfg.dp, cfg.section("dp"), cfg.seed, cfg.topology, cfg.aggregator, cfg.pre_aggregators)
    cls, ring_rule = rule_class(cfg), None
    rule: Aggregator | RingRule
    if cfg.topology == "ring":
        ring_rule = ring_rule_builder(cfg, cls)
        rule = ring_rule(cfg.n_clients)
        reads = {cfg.aggregator}
    else:
        rule = server_rule(cfg, cls, privacy)
        reads = {cfg.aggregator, *rule.reads()}
    if cfg.attack != "none":
        ATTACKS.get(cfg.attack, "attack", hint="or none; ")
        if byzantine_count(cfg) == 0:
            raise ConfigError("byzantine", f"--attack {cfg.attack} needs Byzantine clients: set --byzantine")
    dataset = DATASETS.get(cfg.dataset, "dataset")
    attack = make_attack(cfg.attack, cfg.section("attack"), n_clients=cfg.n_clients, n_classes=dataset.classes)
    if isinstance(attack, ModelAttack):
        attack.require(cfg.n_clients, byzantine_count(cfg), defence_f(cfg))
    if isinstance(attack, DataAttack) and not attack.takes_text and len(dataset.shape) == 1:
        raise ConfigError(
            "attack",
            f"{cfg.attack} poisons images, and {cfg.dataset}'s samples are sequences of {dataset.shape[0]} tokens: "
            "use labelflip or a model attack",
        )
    schedule = make_schedule(cfg.lr_schedule, cfg.section(cfg.lr_schedule))
    partition_settings(cfg.partition, cfg.section(cfg.partition))
    reads |= {cfg.lr_schedule, "attack", cfg.server_optimizer, cfg.partition, "dp"}
    unread(cfg, reads)
    summary = getattr(rule, "summary", "")
    label = "+".join([*cfg.pre_aggregators, cfg.aggregator]) + (f" ({summary})" if summary else "")
    if privacy.mode != "none":
        label += f", {privacy.mode} DP (C {privacy.clip:g}, z {privacy.noise_multiplier:g})"
    return Components(
        rule, ring_rule, attack, schedule, client_optimizer, server_optimizer, privacy, frozenset(reads), label
    )


def unread(cfg: Config, reads: set[str]) -> None:
    """Every settings section names a component, and one this run reads when it holds settings."""
    known = sorted(
        {
            *AGGREGATORS,
            *PRE_AGGREGATORS,
            *RING_RULES,
            *(s for s in SCHEDULES if s != "constant"),
            "attack",
            *SERVER_OPTIMIZERS,
            *PARTITION_SETTINGS,
            "dp",
        }
    )
    for section in cfg.sections:
        if section not in known:
            raise ConfigError(  # the names are many: the kinds, and the closest name
                section,
                f"unknown settings section; {validate.suggestion(section, known)}a section is named after a "
                "component (an aggregator, pre-aggregator, lr_schedule, server_optimizer or partition), or is "
                "attack or dp (docs/cli.md lists them)",
            )
        if section not in reads and cfg.sections[section]:
            raise ConfigError(
                section,
                f"settings of {section}, which this run does not use (aggregator "
                f"{cfg.aggregator}, lr_schedule {cfg.lr_schedule}, server_optimizer "
                f"{cfg.server_optimizer}, partition {cfg.partition}): remove them, or select it",
            )
