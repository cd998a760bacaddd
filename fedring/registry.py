"""One way to register and build a component: server rules, pre-aggregators, attacks, ring
rules, calibration attacks, learning-rate schedules and tasks.

A component is a class with a ``name``. Its parameters are its constructor's keyword
parameters (or, for a class that takes ``**params``, the names in its ``params`` tuple), set in
the settings section named after it (``[krum]``, ``[brace]``) or, for attacks, as
``attack.*``. Registering is the :meth:`Registry.register` decorator, and a package calls
:meth:`Registry.discover` so that every module in it is imported: adding a component is one
new file (and its test). ``docs/contributing.md`` walks through it.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from typing import Any, TypeVar

from .validate import known_keys, unknown

C = TypeVar("C", bound=type)


class Registry:
    """The components of one ``kind`` ("aggregator", "attack", ...), by name.

    >>> shapes = Registry("shape")
    >>> @shapes.register
    ... class Square:
    ...     name = "square"
    ...     def __init__(self, *, side: float = 1.0, scale: float = 1.0):
    ...         self.area = (side * scale) ** 2
    >>> shapes.build("square", {"side": 3.0}).area
    9.0
    >>> shapes.build("square", {"sides": 3.0})
    Traceback (most recent call last):
    fedring.errors.ConfigError: square.sides: unknown parameter of shape square; did you mean 'side'? allowed: side, scale
    >>> shapes.get("squar")
    Traceback (most recent call last):
    fedring.errors.ConfigError: shape: unknown shape 'squar'; did you mean 'square'? allowed: square
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._classes: dict[str, type] = {}

    def register(self, cls: C) -> C:
        """Class decorator: make ``cls`` selectable by its ``name``."""
        component: Any = cls  # a component class declares ``name``; ``type`` in general does not
        name: str = component.name
        if name in self._classes and self._classes[name] is not cls:
            raise ValueError(f"two {self.kind}s are named {name!r}: {self._classes[name]} and {cls}")
        self._classes[name] = cls
        return cls

    def discover(self, package: str, path) -> None:
        """Import every module of ``package`` (its ``__path__``), which registers what they define."""
        for module in pkgutil.iter_modules(path):
            importlib.import_module(f"{package}.{module.name}")

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __iter__(self) -> Iterator[str]:
        """Names in alphabetical order (whatever order the modules were imported in)."""
        return iter(sorted(self._classes))

    def __len__(self) -> int:
        return len(self._classes)

    def __getitem__(self, name: str) -> type:
        return self._classes[name]

    def items(self):
        return [(name, self._classes[name]) for name in self]

    def get(self, name: Any, key: str | None = None, hint: str = "") -> type:
        """The class registered as ``name``; an unknown name raises ConfigError (with a suggestion)."""
        if name not in self._classes:
            raise unknown(key or self.kind, self.kind, name, self, hint)
        return self._classes[name]

    @staticmethod
    def parameters(cls: type, context: tuple[str, ...] = ()) -> list[str]:
        """The settings a component takes: its ``params`` tuple, else its keyword parameters
        other than the ``context`` that fedring passes itself (``f``, ``n_clients``, ``seed`` ...)."""
        declared = getattr(cls, "params", None)
        if isinstance(declared, tuple):
            return list(declared)
        signature = inspect.signature(cls).parameters
        return [name for name, param in signature.items()
                if name not in context and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)]

    def build(self, name: Any, params: dict | None = None, *, key: str | None = None, prefix: str | None = None,
              **context):
        """``cls(**context, **params)`` for the class named ``name``.

        ``params`` are the user's settings of the component; an unknown one raises ConfigError
        named ``<prefix>.<key>`` (prefix: the component's name, or e.g. ``attack``). ``context``
        are values fedring supplies (the declared ``f``, the number of clients ...); a class
        receives those its constructor names.
        """
        cls = self.get(name, key)
        params = dict(params or {})
        known_keys(prefix or str(name), f"{self.kind} {name}", params, self.parameters(cls, tuple(context)))
        signature = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in context.items() if k in signature}, **params)
