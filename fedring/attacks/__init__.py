"""Byzantine attacks: model poisoning (replace the Byzantine clients' gradients) and data
poisoning (change their training batches).

``make_attack(name, params)`` builds one from the run's ``--attack NAME`` and its ``attack.*``
settings; ``ATTACKS`` lists them. Each attack states what it knows (``knowledge``): ``own``,
``collusion`` or ``omniscient``; see :mod:`fedring.attacks.base`.
"""

from __future__ import annotations

import inspect
from typing import Any

from ..errors import ConfigError
from .adaptive import Adaptive
from .alie import ALIE, alie_z
from .backdoor import Backdoor, attack_success_rate
from .base import AttackContext, DataAttack, ModelAttack
from .fang import FangKrum, FangTrim
from .flipping import Scaling, SignFlip
from .gaussian import Gaussian
from .hplus import HPlusAttack
from .ipm import IPM, FoE
from .labelflip import LabelFlip
from .mimic import Mimic
from .nonfinite import NonFinite
from .minmax import MinMax, MinSum

ATTACKS: dict[str, type] = {
    cls.name: cls
    for cls in (Gaussian, SignFlip, Scaling, ALIE, IPM, FoE, FangKrum, FangTrim, MinMax, MinSum, Mimic,
                HPlusAttack, Adaptive, NonFinite, LabelFlip, Backdoor)
}


def make_attack(name: str, params: dict[str, Any] | None = None, *,
                n_clients: int | None = None) -> ModelAttack | DataAttack | None:
    """Build attack ``name`` from its ``attack.*`` settings; ``"none"`` gives None.

    ``n_clients`` (the run's number of clients) supplies defaults that depend on it: the
    backdoor's gradient scale. Unknown names or settings raise :class:`ConfigError` naming the
    key and what is allowed.
    """
    if name == "none":
        if params:
            raise ConfigError(f"attack.{next(iter(params))}", "attack settings given but --attack is none")
        return None
    if name not in ATTACKS:
        raise ConfigError("attack", f"unknown attack {name!r}; allowed: none, {', '.join(ATTACKS)}")
    cls, params = ATTACKS[name], dict(params or {})
    signature = inspect.signature(cls).parameters
    keyword_only = {k for k, p in signature.items() if p.kind is p.KEYWORD_ONLY}
    if not any(p.kind is p.VAR_KEYWORD for p in signature.values()):
        allowed = [k for k in signature if k not in keyword_only]
        for key in params:
            if key not in allowed:
                raise ConfigError(f"attack.{key}", f"not a parameter of attack {name}; allowed: "
                                  f"{', '.join(allowed) or 'none'}")
    if "n_clients" in keyword_only:
        params["n_clients"] = n_clients
    return cls(**params)


__all__ = [
    "ATTACKS", "make_attack", "AttackContext", "ModelAttack", "DataAttack", "attack_success_rate", "alie_z",
    *(cls.__name__ for cls in ATTACKS.values()),
]
