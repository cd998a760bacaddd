"""Byzantine attacks: model poisoning (replace the Byzantine clients' gradients) and data
poisoning (change their training batches), one module per attack family (discovered on import).

``make_attack(name, params)`` builds one from the run's ``--attack NAME`` and its ``attack.*``
settings; ``ATTACKS`` lists them. Each attack states what it knows (``knowledge``): ``own``,
``collusion`` or ``omniscient``; see :mod:`fedring.attacks.base`. A new attack is one new
module here with an ``@ATTACKS.register`` class.
"""

from __future__ import annotations

from typing import Any

from fedring.validate import known_keys, unknown

from .adaptive import Adaptive
from .alie import ALIE, alie_z
from .backdoor import Backdoor, attack_success_rate
from .base import ATTACKS, AttackContext, DataAttack, ModelAttack
from .fang import FangKrum, FangTrim
from .flipping import Scaling, SignFlip
from .gaussian import Gaussian
from .hplus import HPlusAttack
from .ipm import IPM, FoE
from .labelflip import LabelFlip
from .mimic import Mimic
from .minmax import MinMax, MinSum
from .nonfinite import NonFinite

ATTACKS.discover(__name__, __path__)  # an attack in a new module registers itself


def make_attack(
    name: str, params: dict[str, Any] | None = None, *, n_clients: int | None = None, n_classes: int | None = None
) -> ModelAttack | DataAttack | None:
    """Build attack ``name`` from its ``attack.*`` settings; ``"none"`` gives None.

    ``n_clients`` (the run's number of clients) and ``n_classes`` (its data set's classes) supply
    defaults that depend on them: the backdoor's gradient scale, label flipping's number of
    classes. Unknown names or settings raise :class:`ConfigError` naming the key and what is
    allowed.
    """
    if name == "none":
        known_keys("attack", "attack none (no attack)", params or {}, ())
        return None
    if name not in ATTACKS:
        raise unknown("attack", "attack", name, ["none", *ATTACKS])
    return ATTACKS.build(name, params, prefix="attack", n_clients=n_clients, n_classes=n_classes)


__all__ = [
    "ATTACKS",
    "make_attack",
    "AttackContext",
    "ModelAttack",
    "DataAttack",
    "attack_success_rate",
    "alie_z",
    "Adaptive",
    "ALIE",
    "Backdoor",
    "FangKrum",
    "FangTrim",
    "Scaling",
    "SignFlip",
    "Gaussian",
    "HPlusAttack",
    "IPM",
    "FoE",
    "LabelFlip",
    "Mimic",
    "MinMax",
    "MinSum",
    "NonFinite",
]
