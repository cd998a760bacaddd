"""One way to register and build a component: server rules, pre-aggregators, attacks, ring
rules, calibration attacks, learning-rate schedules and tasks.

A component is a class with a ``name``. Its parameters are its constructor's keyword
parameters (or, for a class that takes ``**params``, the names in its ``params`` tuple), set in
the settings section named after it (``[krum]``, ``[brace]``) or, for attacks, as
``attack.*``. Registering is the :meth:`Registry.register` decorator, and a package calls
:meth:`Registry.discover` so that every module in it is imported: adding a component is one
new file (and its test). ``docs/contributing.md`` walks through it.

A registry may also name modules elsewhere that define components of its kind (CRFL's ring
rule, beside its server rule), imported when it is first read.

Components outside the package register the same way from the user's own module
(``--plugin MODULE``), or are named by an import path ``package.module:Name``, which
:meth:`Registry.get` imports and checks (:mod:`fedring.plugins`, ``docs/tutorial.md``).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from typing import Any, TypeVar

from .errors import ConfigError
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

    def __init__(
        self, kind: str, bases: tuple[type, ...] = (), requires: tuple[str, ...] = (), modules: tuple[str, ...] = ()
    ):
        self.kind = kind
        self.bases = bases
        self.requires = requires
        self._classes: dict[str, type[Any]] = {}  # any class: `requires` is checked at run time
        # modules elsewhere that define components of this kind, imported when it is first read
        self._modules = list(modules)

    def _load(self) -> None:
        while self._modules:
            importlib.import_module(self._modules.pop(0))

    def base(self, cls: type) -> type:
        """Class decorator: every component of this kind must subclass ``cls`` (or another base)."""
        self.bases = (*self.bases, cls)
        return cls

    def validate(self, cls: Any) -> str:
        """Raise TypeError unless ``cls`` can be a component: a class, a subclass of a base of
        this kind, with a ``name`` (a non-empty string without ``:``, which marks import paths)
        and the class attributes this kind ``requires``. Returns the name."""
        if not inspect.isclass(cls):
            raise TypeError(f"a {type(cls).__name__}, not a class")
        if self.bases and not issubclass(cls, self.bases):
            names = " or ".join(f"{b.__module__}.{b.__qualname__}" for b in self.bases)
            raise TypeError(f"{cls.__qualname__} is not one of fedring's {self.kind}s: it must subclass {names}")
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name or ":" in name:
            raise TypeError(
                f"{cls.__qualname__} needs a class attribute name, a non-empty string without ':' (got {name!r})"
            )
        missing = [attr for attr in self.requires if not hasattr(cls, attr)]
        if missing:
            raise TypeError(f"{cls.__qualname__} needs the class attribute(s) {', '.join(missing)} of a {self.kind}")
        return name

    def register(self, cls: C) -> C:
        """Class decorator: make ``cls`` selectable by its ``name``."""
        name = self.validate(cls)
        if name in self._classes and self._classes[name] is not cls:
            raise ValueError(f"two {self.kind}s are named {name!r}: {self._classes[name]} and {cls}")
        self._classes[name] = cls
        return cls

    def _import(self, path: str, key: str) -> type[Any]:
        """The class an import path ``package.module:Name`` names, checked as a component."""
        from . import plugins

        module, _, attr = path.partition(":")
        obj: Any = plugins.import_module(module, key)
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise ConfigError(key, f"{path}: module {module} has no {attr!r}")
            obj = getattr(obj, part)
        try:
            self.validate(obj)
        except TypeError as e:
            raise ConfigError(key, f"{path}: {e}") from None
        return obj

    def discover(self, package: str, path) -> None:
        """Import every module of ``package`` (its ``__path__``), which registers what they define."""
        for module in pkgutil.iter_modules(path):
            importlib.import_module(f"{package}.{module.name}")

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._classes

    def __iter__(self) -> Iterator[str]:
        """Names in alphabetical order (whatever order the modules were imported in)."""
        self._load()
        return iter(sorted(self._classes))

    def __len__(self) -> int:
        self._load()
        return len(self._classes)

    def __getitem__(self, name: str) -> type[Any]:
        self._load()
        return self._classes[name]

    def items(self):
        return [(name, self._classes[name]) for name in self]

    def get(self, name: Any, key: str | None = None, hint: str = "") -> type[Any]:
        """The class registered as ``name``, or imported from the path ``package.module:Name`` (and
        registered under it); an unknown name raises ConfigError (with a suggestion)."""
        self._load()
        if isinstance(name, str) and ":" in name and name not in self._classes:
            self._classes[name] = self._import(name, key or self.kind)
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
        return [
            name
            for name, param in signature.items()
            if name not in context and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
        ]

    def build(
        self, name: Any, params: dict | None = None, *, key: str | None = None, prefix: str | None = None, **context
    ):
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
