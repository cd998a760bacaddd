"""Time one call of every model attack at the BRACE paper's size (FMNIST CNN d = 139,960,
n = 100 clients, 20 Byzantine), float32 inputs, median as the defence for the generic adaptive."""

import time

import numpy as np

from fedring.attacks import ATTACKS, AttackContext, make_attack

rng = np.random.default_rng(0)
d, n, b = 139_960, 100, 20
honest = rng.normal(0.001, 0.01, (n - b, d)).astype(np.float32)
byz = rng.normal(0.001, 0.01, (b, d)).astype(np.float32)


def med(G):
    return np.median(G, axis=0)


cases = [(name, {}) for name in ATTACKS if name not in ("labelflip", "backdoor")]
cases += [
    ("fang_krum", {"variant": "partial"}),
    ("fang_trim", {"variant": "partial"}),
    ("adaptive", {"mode": "margin"}),
    ("adaptive", {"target": "generic"}),
]
for name, params in cases:
    a = make_attack(name, params, n_clients=n)
    ctx = AttackContext(np.random.default_rng(1), n, b, 0.01, 0, med)
    t = time.perf_counter()
    a(byz, honest, ctx)
    dt = time.perf_counter() - t
    print(f"| {name} {' '.join(f'{k}={v}' for k, v in params.items())} | {dt:.2f} |")
