"""The user's own components, outside the package: ``--plugin MODULE``, import paths, entry points.

Three ways make a component that is not part of fedring selectable (``docs/tutorial.md``):

* ``--plugin MODULE`` (setting ``plugins``, a list): every rank imports the modules before the
  settings are validated, so the components they register (``@ATTACKS.register`` ...) are
  known by their names. The list is part of the run's config, stored in its results file, and
  ``--resume``, ``sweep --local``, ``sweep --submit`` and ``jobs/run.sbatch`` import the same
  modules.
* an import path ``package.module:Name`` as the value of a component setting (``model``,
  ``dataset``, ``attack``, ``aggregator``, ``pre_aggregators``, ``prism.calib_attack``): the
  class is imported, checked by its registry and selectable under that path; its parameters go
  in the section of the same name (``["mymod:Rule"]`` in TOML, ``--set mymod:Rule.alpha=1``).
* an installed distribution's entry points in the group ``fedring.plugins``: loaded by every
  fedring process before any settings are validated (not stored: they come with the environment).

A module must be importable on every rank, as the ranks' Python sees it: ``python -m fedring``
puts the working directory first on ``sys.path``, and ``PYTHONPATH`` or an installed package
reach compute nodes too. A module that cannot be imported or raises on import stops the run
before any work with a :class:`~fedring.errors.ConfigError` naming it and the reason.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
from types import ModuleType

from .errors import ConfigError

#: the entry point group fedring loads at start
ENTRY_POINT_GROUP = "fedring.plugins"

_entry_points_loaded = False


def import_module(module: str, key: str = "plugins") -> ModuleType:
    """Import ``module``; any failure is a ConfigError for ``key`` naming the module and the reason.

    >>> import_module("fedring_no_such_module")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    fedring.errors.ConfigError: plugins: plugin module 'fedring_no_such_module' not found on this rank's sys.path (install it, ...
    """
    if not isinstance(module, str) or not module or not all(part.isidentifier() for part in module.split(".")):
        raise ConfigError(key, f"{module!r} is not a module name (package.module)")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
            raise ConfigError(
                key,
                f"plugin module {module!r} not found on this rank's sys.path (install it, add its "
                "folder to PYTHONPATH, or run from the folder that holds it; docs/tutorial.md)",
            ) from None
        raise ConfigError(key, f"plugin module {module!r} raised on import: ModuleNotFoundError: {e}") from None
    except (Exception, SystemExit) as e:
        raise ConfigError(key, f"plugin module {module!r} raised on import: {type(e).__name__}: {e}") from None


def load(modules: list[str]) -> None:
    """Import the ``plugins`` setting's modules (those already imported cost nothing)."""
    for module in modules:
        import_module(module)


def load_entry_points() -> None:
    """Load every entry point of the group ``fedring.plugins``, once per process."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {ep.name} = {ep.value} of {ep.dist.name if ep.dist else 'an installed package'}"
        try:
            ep.load()
        except (Exception, SystemExit) as e:
            raise ConfigError(
                "plugins", f"{where} ({ENTRY_POINT_GROUP}) failed to load: {type(e).__name__}: {e}"
            ) from None
    _entry_points_loaded = True


def stored(path: str) -> list[str]:
    """The plugins stored in the config of results file ``path`` (none if it has no readable config)."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            return list(json.loads(f.attrs["config"]).get("plugins", []))
    except (OSError, KeyError, ValueError):
        return []
