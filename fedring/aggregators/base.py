"""The aggregator contract, the registry and parameter validation shared by every rule."""

from __future__ import annotations

import inspect
import math
from numbers import Integral, Real
from typing import Any, ClassVar, NamedTuple

import numpy as np

from fedring.errors import ConfigError

AGGREGATORS: dict[str, type] = {}
PRE_AGGREGATORS: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator: make a rule selectable by its ``name``."""
    AGGREGATORS[cls.name] = cls
    return cls


def register_pre(cls: type) -> type:
    """Class decorator: make a pre-aggregator selectable by its ``name``."""
    PRE_AGGREGATORS[cls.name] = cls
    return cls


class AggregateResult(NamedTuple):
    """What one aggregation call returns.

    vector : (d,) array in the input dtype; the loop applies ``w <- w - lr * vector``.
    selected : (n,) float weights in [0, 1] (1 = kept / fully trusted) for rules that select
        or weight clients, else None.
    """

    vector: np.ndarray
    selected: np.ndarray | None = None


# --------------------------------------------------------------------------------------
# parameter validation: every failure names the setting as the user writes it
# --------------------------------------------------------------------------------------


def check_int(key: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        if isinstance(value, Real) and float(value).is_integer():
            value = int(value)
        else:
            raise ConfigError(key, f"must be an integer, got {value!r}")
    value = int(value)
    if lo is not None and value < lo:
        raise ConfigError(key, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ConfigError(key, f"must be <= {hi}, got {value}")
    return value


def check_float(
    key: str,
    value: Any,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise ConfigError(key, f"must be a finite number, got {value!r}")
    value = float(value)
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise ConfigError(key, f"must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and (value > hi or (hi_open and value == hi)):
        raise ConfigError(key, f"must be {'<' if hi_open else '<='} {hi}, got {value}")
    return value


def check_choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(key, f"got {value!r}; allowed: {', '.join(choices)}")
    return value


def check_bool(key: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if value in (0, 1):
        return bool(value)
    raise ConfigError(key, f"must be true or false, got {value!r}")


def as_matrix(X: Any) -> np.ndarray:
    """(n, d) float32/float64 view of the client rows; other numeric types become float64."""
    X = np.asarray(X)
    if X.ndim != 2 or X.shape[0] < 1 or X.shape[1] < 1:
        raise ValueError(f"expected an (n, d) matrix of client vectors with n, d >= 1, got shape {X.shape}")
    if X.dtype not in (np.float32, np.float64):
        if not (np.issubdtype(X.dtype, np.integer) or np.issubdtype(X.dtype, np.floating) or X.dtype == bool):
            raise ValueError(f"client vectors must be numeric, got dtype {X.dtype}")
        X = X.astype(np.float64)
    return X


class Aggregator:
    """Base class of every server-side rule.

    Subclasses set ``name``, validate their parameters in ``__init__`` (keyword-only, each
    with its default) and implement ``_aggregate``. ``aggregate`` validates the input and
    calls ``check`` so a misconfigured rule fails before doing any work.

    Randomised rules (``needs_rng = True``) draw only from the ``rng`` passed to
    ``aggregate``; without one they use a private ``numpy.random.Generator`` seeded with 0
    at construction, so a run is reproducible either way.
    """

    name: ClassVar[str] = ""
    needs_reference: ClassVar[bool] = False
    needs_rng: ClassVar[bool] = False
    stateful: ClassVar[bool] = False

    def __init__(self, f: int = 0):
        self.f = check_int("f", f, lo=0)
        self._rng = np.random.default_rng(0)

    # ---- construction from configuration -------------------------------------------------

    @classmethod
    def param_names(cls) -> list[str]:
        sig = inspect.signature(cls.__init__)
        return [p for p in sig.parameters if p not in ("self", "f")]

    @classmethod
    def check_keys(cls, params: dict, key: str | None = None) -> None:
        """ConfigError for a parameter the class does not have, listing the allowed ones."""
        allowed = cls.param_names()
        for k in params:
            if k not in allowed:
                allowed_text = ", ".join(allowed) or "(none)"
                raise ConfigError(f"{key or cls.name}.{k}", f"unknown parameter of {cls.name}; allowed: {allowed_text}")

    @classmethod
    def from_params(cls, f: int, params: dict | None, key: str | None = None) -> "Aggregator":
        """Build from a config section; unknown keys raise ConfigError listing the allowed ones."""
        params = dict(params or {})
        cls.check_keys(params, key)
        return cls(f, **params)

    # ---- contract ----------------------------------------------------------------------

    def check(self, n: int) -> str | None:
        """None if ``n`` clients with the declared ``f`` can work, else the reason in words."""
        if n < 1:
            return f"{self.name} needs at least one client, got n={n}"
        return None

    def init_state(self, n: int, d: int) -> dict[str, np.ndarray]:
        """Explicit state of stateful rules (numpy arrays only, so a checkpoint can save it)."""
        return {}

    def aggregate(
        self,
        X: Any,
        state: dict | None = None,
        reference: np.ndarray | None = None,
        rng: np.random.Generator | None = None,
    ) -> AggregateResult:
        X = as_matrix(X)
        n, d = X.shape
        reason = self.check(n)
        if reason is not None:
            raise ValueError(f"{self.name}: {reason}")
        if reference is not None:
            reference = np.asarray(reference)
            if reference.shape != (d,):
                raise ValueError(f"{self.name}: reference must have shape ({d},), got {reference.shape}")
        elif self.needs_reference:
            raise ValueError(f"{self.name} needs the server's reference gradient (reference=...)")
        if state is None:
            state = self.init_state(n, d)
        result = self._aggregate(X, state, reference, rng if rng is not None else self._rng)
        vector = np.asarray(result.vector, dtype=X.dtype)
        selected = None if result.selected is None else np.asarray(result.selected, dtype=np.float64)
        return AggregateResult(vector, selected)

    def __call__(self, X: Any, **kw) -> np.ndarray:
        return self.aggregate(X, **kw).vector

    def _aggregate(self, X: np.ndarray, state: dict, reference, rng: np.random.Generator) -> AggregateResult:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.param_names() if hasattr(self, k))
        return f"{type(self).__name__}(f={self.f}{', ' if args else ''}{args})"


class PreAggregator:
    """A map from n client rows to m rows that composes in front of any rule.

    ``transform`` returns the new rows and, for each client, the output row it fed
    (``owner``), so the rule's per-row ``selected`` weights can be mapped back to clients.
    """

    name: ClassVar[str] = ""

    def __init__(self, f: int = 0):
        self.f = check_int("f", f, lo=0)

    param_names = classmethod(Aggregator.param_names.__func__)
    check_keys = classmethod(Aggregator.check_keys.__func__)
    from_params = classmethod(Aggregator.from_params.__func__)

    def check(self, n: int) -> str | None:
        return None if n >= 1 else f"{self.name} needs at least one client, got n={n}"

    def out_rows(self, n: int) -> int:
        return n

    def transform(self, X: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError
