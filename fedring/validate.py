"""Checks of settings: every configuration error message of fedring comes from here.

Each check takes the setting's name as the user writes it (``rounds``, ``krum.variant``,
``attack.sigma``, ``prism.alpha``) and raises :class:`~fedring.errors.ConfigError` with one
phrasing for each kind of mistake:

>>> integer("rounds", 0, lo=1)
Traceback (most recent call last):
fedring.errors.ConfigError: rounds: must be >= 1, got 0
>>> real("prism.alpha", 1.5, lo=0, hi=1, lo_open=True, hi_open=True)
Traceback (most recent call last):
fedring.errors.ConfigError: prism.alpha: must be in (0, 1), got 1.5
>>> choice("krum.variant", "papr", ("paper", "byzfl"))
Traceback (most recent call last):
fedring.errors.ConfigError: krum.variant: 'papr' is not allowed; did you mean 'paper'? allowed: paper, byzfl
"""

from __future__ import annotations

import difflib
import importlib.util
import math
from collections.abc import Iterable
from numbers import Integral, Real
from typing import Any

from .errors import ConfigError


def installed(key: str, modules: Iterable[str], why: str, extra: str) -> None:
    """An optional package the setting ``key`` needs: raise, saying ``why`` and which extra of fedring
    brings it, unless every one of ``modules`` (top-level names) is found. Nothing is imported, so
    validation stays cheap on ranks that never use it.

    >>> installed("log", ["not_a_module_anywhere"], "x needs the x extra", "x")
    Traceback (most recent call last):
    fedring.errors.ConfigError: log: x needs the x extra: pip install 'fedring[x]'
    """
    if any(importlib.util.find_spec(module) is None for module in modules):
        raise ConfigError(key, f"{why}: pip install 'fedring[{extra}]'")


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters: an error message stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def closest(name: Any, allowed: Iterable[str]) -> str | None:
    """The allowed name closest to a misspelt one, if any is close."""
    close = difflib.get_close_matches(str(name), [str(a) for a in allowed], n=1, cutoff=0.6)
    return close[0] if close else None


def suggestion(name: Any, allowed: Iterable[str]) -> str:
    """``"did you mean 'x'? "`` for the closest allowed name, or ``""``."""
    close = closest(name, allowed)
    return f"did you mean {close!r}? " if close else ""


def _bounds(lo, hi, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"{'<' if hi_open else '<='} {hi}"


def _within(key: str, value, lo, hi, lo_open: bool, hi_open: bool):
    below = lo is not None and (value < lo or (lo_open and value == lo))
    above = hi is not None and (value > hi or (hi_open and value == hi))
    if below or above:
        raise ConfigError(key, f"must be {_bounds(lo, hi, lo_open, hi_open)}, got {shown(value)}")
    return value


#: every integer setting fits a 64-bit signed integer (HDF5 attributes, torch's seed)
INT_MAX = 2**63 - 1


def integer(key: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """A whole number (``3`` or ``3.0``; not ``True``) within ``[lo, hi]`` and below 2^63."""
    whole = isinstance(value, Integral) or (isinstance(value, Real) and float(value).is_integer())
    if isinstance(value, bool) or not whole:
        raise ConfigError(key, f"must be an integer, got {shown(value)}")
    if abs(int(value)) > INT_MAX:
        raise ConfigError(key, f"must be below 2^63, got {shown(value)}")
    return _within(key, int(value), lo, hi, False, False)


def real(
    key: str, value: Any, lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False
) -> float:
    """A finite number within the bounds (open where asked)."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise ConfigError(key, f"must be a finite number, got {shown(value)}")
    return _within(key, float(value), lo, hi, lo_open, hi_open)


def choice(key: str, value: Any, allowed: Iterable) -> Any:
    """One of ``allowed``; a near miss gets a suggestion."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(
            key, f"{shown(value)} is not allowed; {suggestion(value, allowed)}allowed: {', '.join(map(str, allowed))}"
        )
    return value


def boolean(key: str, value: Any) -> bool:
    """``true``/``false`` (or 1/0)."""
    if isinstance(value, bool) or (isinstance(value, Integral) and value in (0, 1)):
        return bool(value)
    raise ConfigError(key, f"must be true or false, got {shown(value)}")


def text(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(key, f"must be a string, got {shown(value)}")
    return value


def names(key: str, value: Any) -> list[str]:
    """A list of names, as a list or as one comma-separated string."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise ConfigError(key, f"must be a list of names, got {shown(value)}")
    return [v.strip() for v in items if v.strip()]


def unknown(key: str, what: str, name: Any, allowed: Iterable[str], hint: str = "") -> ConfigError:
    """The error for a name that is not registered: ``unknown aggregator 'krumm'; did you mean 'krum'...``."""
    allowed = list(allowed)
    return ConfigError(
        key, f"unknown {what} {shown(name)}; {suggestion(name, allowed)}{hint}allowed: {', '.join(allowed) or '(none)'}"
    )


#: The top-level settings (filled by :mod:`fedring.config`, which imports this module): a
#: section key that is one of them gets a hint about TOML's sections.
TOP_LEVEL_KEYS: set[str] = set()


def known_keys(prefix: str, what: str, params: dict, allowed: Iterable[str]) -> None:
    """Raise for the first key of ``params`` not in ``allowed``, as ``prefix.key``."""
    allowed = list(allowed)
    for key in params:
        if key not in allowed:
            toml = (
                (
                    f"{key} is a top-level setting: in a TOML file, put it above the first [section] (TOML reads "
                    f"every key after [{prefix}] into that section); "
                )
                if key in TOP_LEVEL_KEYS
                else ""
            )
            raise ConfigError(
                f"{prefix}.{key}",
                f"unknown parameter of {what}; {toml}{suggestion(key, allowed)}"
                f"allowed: {', '.join(allowed) or '(none)'}",
            )


def fills_ranks(key: str, clients: int, ranks: int) -> None:
    """Every MPI rank hosts a block of at least one client: ``clients >= ranks`` (K >= N).

    >>> fills_ranks("clients", 2, 4)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    fedring.errors.ConfigError: clients: 2 clients on 4 MPI ranks: need clients >= ranks (K >= N), each rank hosts ...
    """
    if clients < ranks:
        raise ConfigError(
            key,
            f"{clients} clients on {ranks} MPI ranks: need clients >= ranks (K >= N), each rank "
            "hosts a block of at least one client",
        )
