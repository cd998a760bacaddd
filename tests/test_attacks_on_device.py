"""The model attacks on torch tensors (docs/arrays.md, "Attacks on the device"): the same inputs as
numpy arrays and as CPU tensors give rows of the kind, dtype and device of the Byzantine rows,
equal to the numpy path's exactly where the arithmetic is the same elementwise operations in the
same order, and within one float32 rounding where it goes through float64 reductions, whose
summation order differs between numpy and torch. Every registered model attack is covered, a new
one included (with its default settings unless a variant is listed here)."""

from __future__ import annotations

import subprocess
import sys
from typing import ClassVar

import numpy as np
import pytest
import torch

from fedring.arrays import array_namespace
from fedring.attacks import ATTACKS, AttackContext, ModelAttack, make_attack
from fedring.attacks.base import BLOCK

#: settings that change which code an attack runs; an attack not listed runs with its defaults
VARIANTS: dict[str, list[dict]] = {
    "alie": [{}, {"stats": "byzantine"}, {"jitter": 0.1}, {"ddof": 0, "z": -1.5}],
    "ipm": [{}, {"jitter": 0.05}],
    "signflip": [{}, {"source": "mean"}, {"source": "sum", "scale": 3.0}],
    "scaling": [{}, {"source": "own"}],
    "nonfinite": [{}, {"value": "mixed", "fraction": 0.3}, {"value": "-inf", "fraction": 0.5}],
    "mimic": [{}, {"worker": 2}],
    "minmax": [{}, {"perturbation": "unit_vec"}, {"perturbation": "sign"}],
    "minsum": [{}, {"bound": "min"}],
    "fang_krum": [{}, {"variant": "partial"}],
    "fang_trim": [{}, {"variant": "partial"}],
    "adaptive": [
        {},
        {"target": "brace", "mode": "margin", "lam": 0.0, "budget": 0.5},
        {"target": "generic"},
        {"target": "generic", "perturbation": "std"},
    ],
}

#: (attack, settings) whose device rows equal the host rows bit for bit: elementwise operations in
#: the same order on the same numbers (the random draws are the host generator's, moved), or a
#: choice among the inputs' own rows, or a search whose steps are exact powers of two from 1
EXACT = {
    ("gaussian", ()),
    ("nonfinite", ()),
    ("nonfinite", (("fraction", 0.3), ("value", "mixed"))),
    ("nonfinite", (("fraction", 0.5), ("value", "-inf"))),
    ("signflip", ()),
    ("scaling", (("source", "own"),)),
    ("mimic", ()),
    ("mimic", (("worker", 2),)),
    ("fang_krum", (("variant", "partial"),)),
    ("fang_trim", ()),
    ("signguard_attack", ()),
}

#: the rest reduce in float64 (means, deviations, Gram matrices) before the rows are cast to
#: float32; numpy and torch sum in different orders, so the float64 values differ by a few units
#: of 2^-53 relative, which moves the float32 result by at most one rounding step (2^-23
#: relative; rtol 2^-22 leaves a factor 2), and by an absolute 1e-12 where a mean of O(1) inputs
#: cancels to nearly 0
RTOL, ATOL = 2.0**-22, 1e-12

H, B, N = 12, 4, 16
D = BLOCK + 5  # two column blocks, the second of 5 columns


def cases() -> list[tuple[str, dict]]:
    # an attack that trains models needs their ModelAccess, and runs on the host (tests/test_threedfed.py)
    names = [name for name in ATTACKS if issubclass(ATTACKS[name], ModelAttack) and not ATTACKS[name].needs_model]
    return [(name, params) for name in names for params in VARIANTS.get(name, [{}])]


def median(X):
    """A coordinate-wise median for either kind of array (the defence of the aggregator-aware attacks)."""
    xp = array_namespace(X)
    s = xp.sort(X, axis=0)
    m = X.shape[0]
    return (s[(m - 1) // 2, ...] + s[m // 2, ...]) / 2


def context(seed: int = 5) -> AttackContext:
    return AttackContext(np.random.default_rng(seed), n=N, f=B, lr=0.1, round=3, aggregator=median)


def inputs(dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    honest = (rng.standard_normal((H, D)) + 0.3).astype(dtype)
    byz = (rng.standard_normal((B, D)) - 0.2).astype(dtype)
    return byz, honest


def build(name: str, params: dict) -> ModelAttack:
    if name == "clippedclustering_attack":
        pytest.importorskip("sklearn")
    attack = make_attack(name, dict(params), n_clients=N, n_classes=10)
    assert isinstance(attack, ModelAttack)
    return attack


@pytest.mark.parametrize(("name", "params"), cases(), ids=lambda v: v if isinstance(v, str) else str(v or ""))
def test_attack_on_tensors_matches_numpy(name, params):
    attack = build(name, params)
    byz, honest = inputs()
    expected = attack(byz.copy(), honest.copy(), context())
    got = attack(torch.from_numpy(byz.copy()), torch.from_numpy(honest.copy()), context())
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.device.type == "cpu"
    assert tuple(got.shape) == byz.shape and got.is_contiguous()
    rows = got.numpy()
    if (name, tuple(sorted(params.items()))) in EXACT:
        np.testing.assert_array_equal(rows, expected)
    else:
        np.testing.assert_allclose(rows, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["alie", "gaussian", "fang_trim", "minmax"])
def test_float64_rows_stay_float64(name):
    attack = build(name, {})
    byz, honest = inputs(np.float64)
    got = attack(torch.from_numpy(byz), torch.from_numpy(honest), context())
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), attack(byz, honest, context()), rtol=1e-13, atol=1e-13)


def test_the_rows_given_are_left_alone():
    byz, honest = inputs()
    b, h = torch.from_numpy(byz.copy()), torch.from_numpy(honest.copy())
    for name in ["nonfinite", "adaptive", "signflip"]:
        params = {"target": "brace", "mode": "margin", "lam": 0.0} if name == "adaptive" else {}
        out = build(name, params)(b, h, context())
        assert out.data_ptr() != b.data_ptr()
    assert np.array_equal(b.numpy(), byz) and np.array_equal(h.numpy(), honest)


class HostOnly(ModelAttack):
    """Runs on the host: a test attack written with numpy alone."""

    name: ClassVar[str] = "host_only"
    knowledge = "omniscient"

    def craft(self, byz, honest, ctx):
        assert isinstance(byz, np.ndarray) and isinstance(honest, np.ndarray) and byz.dtype == np.float64
        return np.broadcast_to(np.median(honest, axis=0) + ctx.rng.standard_normal(byz.shape[1]), byz.shape)


def test_a_host_attack_gets_one_host_copy_and_returns_a_tensor():
    byz, honest = inputs()
    got = HostOnly()(torch.from_numpy(byz), torch.from_numpy(honest), context())
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), HostOnly()(byz, honest, context()))


@pytest.mark.parametrize("name", [n for n in ATTACKS if issubclass(ATTACKS[n], ModelAttack)])
def test_each_attack_says_where_it_runs(name):
    cls = ATTACKS[name]
    assert cls.on_device or "Runs on the host: " in (cls.__doc__ or "")


def test_bad_tensor_rows_are_refused():
    attack = build("alie", {})
    byz, honest = inputs()
    with pytest.raises(ValueError, match="byz must be a float"):
        attack(torch.zeros((2, 3), dtype=torch.int64), torch.from_numpy(honest), context())
    with pytest.raises(ValueError, match="honest must be"):
        attack(torch.from_numpy(byz), torch.zeros((3, 5)), context())
    with pytest.raises(ValueError, match="needs the honest gradients"):
        attack(torch.from_numpy(byz), None, context())


def test_importing_the_attacks_does_not_import_torch():
    code = "import sys, fedring.attacks; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
