"""The ``[prism]`` settings section of PRISM-FCP, Rob-FCP and FCP (:class:`PrismSettings`).

A setting left unset (None) takes its value from the data set (``participants``, ``dim``,
``shared``, ``profile``) or from the profile (``step``, ``byz_persist``, ``local_updates``,
the random attack's variance): the paper does not give the step size nor three mechanics of
its simulation, and each profile of :data:`PROFILES` is one consistent reading of them
(``docs/prism-fcp.md``). A calibration attack's parameters go in the section named after it
(``--set coverage.factor=5``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedring import validate
from fedring.config import section_settings
from fedring.conformal.split import check_alpha
from fedring.errors import ConfigError

from .attacks import CALIB_ATTACKS
from .calibration import FILTERS

METHODS = ("prism", "robfcp", "fcp")
DATASETS = ("synthetic", "uci")
COVERAGE_ON = ("benign", "all")
#: how a Byzantine client's corruption stays in its own model (:func:`.psofed.train_psofed`): not
#: at all, in the shared coordinates it sent, or the whole noise vector
PERSIST = ("none", "sent", "full")
#: the selection masks of :func:`.psofed.selection_masks`
MASK_SCHEMES = ("random", "roundrobin")

#: The settings the paper leaves open, as named profiles (``docs/prism-fcp.md``):
#:
#: - ``stable``: the cautious reading (mu = 0.01, only the transmitted copy is corrupted,
#:   every client learns from its stream in every iteration); stable down to M/D = 0.1, but
#:   Table I's full-sharing widths come out about twice the paper's.
#: - ``paper-match``: mu = 0.04 and the whole corrupted vector stays in the attacker's model;
#:   PRISM-FCP matches Table I, the full-sharing widths come out 15-25 % wide; diverges at
#:   mu >= 0.05 or M/D = 0.1.
#: - ``paper-fit``: fitted to Table I: mu = 0.06, only the sampled clients take an LMS step,
#:   the corrupted *shared* coordinates stay in the attacker's model, and sigma_C = 0.5 read
#:   as a standard deviation (variance 0.25). Every Table I number is reproduced closely.
#: - ``uci``: paper-fit's mechanics with mu = 0.01, for 81 standardized, correlated features.
PROFILES: dict[str, dict[str, Any]] = {
    "stable": {
        "step": 0.01,
        "byz_persist": "none",
        "local_updates": True,
        "calib_attacks": {"random": {"variance": 0.5}},
    },
    "paper-match": {
        "step": 0.04,
        "byz_persist": "full",
        "local_updates": True,
        "calib_attacks": {"random": {"variance": 0.5}},
    },
    "paper-fit": {
        "step": 0.06,
        "byz_persist": "sent",
        "local_updates": False,
        "calib_attacks": {"random": {"variance": 0.25}},
    },
    "uci": {
        "step": 0.01,
        "byz_persist": "sent",
        "local_updates": False,
        "calib_attacks": {"random": {"variance": 0.25}},
    },
}
#: a data set's values for the settings left unset (paper Sec. V-A and V-B)
DATASET_DEFAULTS = {
    "synthetic": {"participants": 10, "dim": 50, "shared": 15, "profile": "paper-fit"},
    "uci": {"participants": 20, "dim": 81, "shared": 20, "profile": "uci"},
}
UCI_DIM = 81
#: the calibration attacks of the paper's tables, in their order
TABLE_ATTACKS = ("efficiency", "coverage", "random")


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class PrismSettings:
    """The ``[prism]`` section (paper Sec. V defaults); :meth:`validate` fills what is left unset."""

    method: str = field(
        default="prism",
        metadata=_help("prism (partial sharing M < D, filter), robfcp (M = D, filter) or fcp (M = D, no filter)"),
    )
    calib_attack: str = field(
        default="none",
        metadata=_help(f"none, {', '.join(CALIB_ATTACKS)}; parameters as <attack>.KEY, e.g. --set coverage.factor=5"),
    )
    table: bool = field(
        default=False,
        metadata=_help(
            "every row of the paper's Table I (synthetic) or Table II (uci), printed beside the paper's numbers"
        ),
    )
    trials: int = field(default=1, metadata=_help("independent trials, one /calibration row each"))
    dataset: str = field(default="synthetic", metadata=_help(f"{', '.join(DATASETS)}"))
    data_dir: str | None = field(default=None, metadata=_help("uci: the folder holding the UCI train.csv"))
    standin: bool = field(
        default=False,
        metadata=_help("uci: a generated stand-in train.csv of the real file's shape instead of --data-dir"),
    )
    profile: str | None = field(
        default=None,
        metadata=_help(
            f"{', '.join(PROFILES)}: step size and mechanics the paper leaves open; unset: paper-fit (uci: uci)"
        ),
    )
    clients: int = field(default=100, metadata=_help("K, logical clients (>= MPI ranks)"))
    participants: int | None = field(
        default=None, metadata=_help("|S_n|, clients sampled per iteration; unset: 10 (uci: 20)")
    )
    dim: int | None = field(
        default=None, metadata=_help("D, the model dimension; unset: 50 (uci: 81, fixed by the file)")
    )
    shared: int | None = field(
        default=None,
        metadata=_help(
            "M, coordinates PRISM-FCP shares (Rob-FCP and FCP share all D); unset: 15 (uci: 20); "
            "a uci --table runs Table II's M = 20, 40, 60, 81 whatever this says"
        ),
    )
    step: float | None = field(default=None, metadata=_help("mu, the LMS step size; unset: the profile's"))
    iterations: int = field(default=1000, metadata=_help("training iterations"))
    byzantine: int = field(default=20, metadata=_help("|S_B|, Byzantine clients"))
    attack_prob: float = field(default=0.25, metadata=_help("p_a, probability that a Byzantine upload is corrupted"))
    attack_var: float = field(default=0.1, metadata=_help("sigma_B^2, variance of the training attack's noise"))
    byz_persist: str | None = field(
        default=None,
        metadata=_help(
            f"{' | '.join(PERSIST)}: the corruption a Byzantine client keeps in its own model; unset: the profile's"
        ),
    )
    local_updates: bool | None = field(
        default=None, metadata=_help("true: clients outside S_n take LMS steps too; unset: the profile's")
    )
    mask_scheme: str = field(default="random", metadata=_help(f"{' | '.join(MASK_SCHEMES)} selection masks"))
    calib_samples: int = field(default=1000, metadata=_help("N_k, calibration samples per client"))
    test_samples: int = field(default=1000, metadata=_help("test samples per client"))
    bins: int = field(default=100, metadata=_help("H, histogram bins of the characterization vectors"))
    alpha: float = field(default=0.1, metadata=_help("miscoverage level; target coverage 1 - alpha"))
    filter: str = field(
        default="known", metadata=_help("known (remove the |S_B| most malicious) or mad (Remark 3's MAD rule)")
    )
    r_max: float | None = field(default=None, metadata=_help("histogram normaliser; unset: the largest reported score"))
    mad_scale: float = field(default=1.4826, metadata=_help("the MAD rule's consistency constant"))
    mad_threshold: float = field(default=2.5, metadata=_help("the MAD rule's z threshold"))
    coverage_on: str = field(
        default="benign", metadata=_help(f"{' | '.join(COVERAGE_ON)}: whose test data measure the coverage")
    )
    input_var: list[float] = field(
        default_factory=lambda: [0.2, 1.2],
        metadata=_help("synthetic: low high of U(.) for the clients' input variances varsigma_k^2"),
    )
    noise_var: list[float] = field(
        default_factory=lambda: [0.005, 0.025],
        metadata=_help("synthetic: low high of U(.) for the clients' noise variances sigma_k^2"),
    )
    dirichlet: float = field(default=0.5, metadata=_help("uci: concentration of the clients' Dirichlet mixtures"))

    def validate(self) -> None:
        """Check every setting (raise ConfigError); fill the unset ones from the data set and the profile."""
        validate.choice("prism.method", self.method, METHODS)
        if self.calib_attack != "none":
            CALIB_ATTACKS.get(self.calib_attack, "prism.calib_attack", hint="or none; ")
        validate.integer("prism.trials", self.trials, lo=1)
        validate.choice("prism.dataset", self.dataset, DATASETS)
        defaults = DATASET_DEFAULTS[self.dataset]
        for name in ("participants", "dim", "shared", "profile"):
            if getattr(self, name) is None:
                setattr(self, name, defaults[name])
        profile: str = validate.choice("prism.profile", self.profile, PROFILES)
        for name in ("step", "byz_persist", "local_updates"):
            if getattr(self, name) is None:
                setattr(self, name, PROFILES[profile][name])
        validate.integer("prism.clients", self.clients, lo=1)
        validate.integer("prism.participants", self.participants, lo=1, hi=self.clients)
        validate.integer("prism.dim", self.dim, lo=1)
        if self.dataset == "uci":
            validate.choice("prism.dim", self.dim, (UCI_DIM,))
        validate.integer("prism.shared", self.shared, lo=1, hi=self.dim)
        validate.real("prism.step", self.step, lo=0, lo_open=True)
        validate.integer("prism.iterations", self.iterations, lo=0)
        validate.integer("prism.byzantine", self.byzantine, lo=0, hi=self.clients - 1)
        validate.real("prism.attack_prob", self.attack_prob, lo=0, hi=1)
        validate.real("prism.attack_var", self.attack_var, lo=0)
        validate.choice("prism.byz_persist", self.byz_persist, PERSIST)
        validate.choice("prism.mask_scheme", self.mask_scheme, MASK_SCHEMES)
        validate.integer("prism.calib_samples", self.calib_samples, lo=0)
        validate.integer("prism.test_samples", self.test_samples, lo=1)
        validate.integer("prism.bins", self.bins, lo=1)
        check_alpha(self.alpha, "prism.alpha")
        validate.choice("prism.filter", self.filter, FILTERS)
        if self.r_max is not None:
            validate.real("prism.r_max", self.r_max, lo=0, lo_open=True)
        validate.real("prism.mad_scale", self.mad_scale, lo=0, lo_open=True)
        validate.real("prism.mad_threshold", self.mad_threshold, lo=0, lo_open=True)
        validate.choice("prism.coverage_on", self.coverage_on, COVERAGE_ON)
        for name, lo_open in (("input_var", True), ("noise_var", False)):
            values = getattr(self, name)
            if len(values) != 2:
                raise ConfigError(f"prism.{name}", f"needs two numbers, low and high, got {values}")
            validate.real(f"prism.{name}", values[0], lo=0, lo_open=lo_open)
            validate.real(f"prism.{name}", values[1], lo=values[0])
        validate.real("prism.dirichlet", self.dirichlet, lo=0, lo_open=True)
        if self.dataset == "uci" and (self.data_dir is None) == (not self.standin):
            raise ConfigError(
                "prism.data_dir",
                "the uci data set needs either --data-dir (the folder holding the "
                "UCI train.csv) or --standin, and not both",
            )

    @property
    def attacks(self) -> list[str]:
        """The calibration attacks the run's cases use."""
        return list(TABLE_ATTACKS) if self.table else [self.calib_attack]


class ResolvedPrism(PrismSettings):
    """The ``[prism]`` settings as a run uses them: built by :func:`settings` (and the task),
    which run :meth:`PrismSettings.validate`, so the settings it fills are never None."""

    profile: str
    participants: int
    dim: int
    shared: int
    step: float
    byz_persist: str
    local_updates: bool

    def attack_params(self, name: str, given: dict | None = None) -> dict:
        """The parameters of calibration attack ``name``: the profile's, then ``given``."""
        return {**PROFILES[self.profile]["calib_attacks"].get(name, {}), **(given or {})}


def settings(**values) -> ResolvedPrism:
    """Checked settings from ``[prism]`` values, as a run reads them (tests and benchmarks).

    >>> s = settings(profile="stable")
    >>> s.step, s.shared, s.local_updates
    (0.01, 15, True)
    >>> settings(shared=60)
    Traceback (most recent call last):
    fedring.errors.ConfigError: prism.shared: must be in [1, 50], got 60
    """
    return section_settings(ResolvedPrism, "prism", values)
