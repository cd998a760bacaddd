"""UCI Superconductivity data (Hamidieh 2018) and PRISM-FCP's non-IID client split (paper Sec. V-B).

The UCI distribution's ``train.csv`` has 21,263 rows and 82 columns: 81 numeric features
derived from the chemical formula (``number_of_elements`` and ten statistics of eight
elemental properties) and the target ``critical_temp`` in Kelvin, last.
:func:`load_superconductivity` reads a local copy (``--data-dir``); :func:`write_standin_csv`
writes a synthetic file of the same shape and header for tests and demonstrations
(``--standin``: its numbers are not the real data, so results on it show the pipeline, not
the paper's values).

Split (paper Sec. V-B, footnote 3): features standardized, target z-normalized (statistics
of the whole file, kept to report widths in Kelvin); the target is cut into 10
equal-frequency bins; client ``k`` draws mixing proportions ``pi_k ~ Dir(0.5 * 1_10)`` and
receives 3,000 samples, ``Multinomial(3000, pi_k)`` per bin, each drawn uniformly with
replacement from its bin (overlap across clients is permitted; with replacement because a
client may need more than one bin's ~2,126 rows), then split at random into 1,000 train /
1,000 calibration / 1,000 test. The paper names the ingredients but not the mechanics: the
multinomial counts, the draws with replacement, the whole-file statistics and the rank-based
deciles (equal counts even where ``critical_temp`` has ties) are this module's reading
(``docs/prism-fcp.md``).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedring.errors import ConfigError

N_ROWS = 21263
N_FEATURES = 81
TARGET = "critical_temp"
#: the setting that names the file, in error messages
DATA_DIR = "prism.data_dir"
_PROPERTIES = (
    "atomic_mass",
    "fie",
    "atomic_radius",
    "Density",
    "ElectronAffinity",
    "FusionHeat",
    "ThermalConductivity",
    "Valence",
)
_STATISTICS = (
    "mean",
    "wtd_mean",
    "gmean",
    "wtd_gmean",
    "entropy",
    "wtd_entropy",
    "range",
    "wtd_range",
    "std",
    "wtd_std",
)
COLUMNS = ("number_of_elements", *(f"{s}_{p}" for p in _PROPERTIES for s in _STATISTICS), TARGET)


@dataclass(frozen=True)
class Superconductivity:
    """Standardized features ``x`` (n, 81), z-normalized target ``y`` (n,), and the
    target's mean and standard deviation in Kelvin (``width_K = width * y_std``)."""

    x: np.ndarray
    y: np.ndarray
    y_mean: float
    y_std: float
    feature_names: tuple[str, ...]


def superconductivity_file(path: str | Path) -> Path:
    """The ``train.csv`` at ``path`` (a file or the folder holding it), after checking that
    it exists and has the UCI header shape; raises ``ConfigError('prism.data_dir', ...)``."""
    p = Path(path)
    if p.is_dir():
        p = p / "train.csv"
    if not p.is_file():
        raise ConfigError(DATA_DIR, f"no UCI Superconductivity train.csv at {p}")
    with p.open(newline="") as fh:
        header = [h.strip() for h in next(csv.reader(fh), [])]
    if len(header) != N_FEATURES + 1 or header[-1] != TARGET:
        raise ConfigError(
            DATA_DIR,
            f"{p} is not the UCI Superconductivity train.csv: expected "
            f"{N_FEATURES + 1} columns ending in {TARGET!r}, got {len(header)}",
        )
    return p


def load_superconductivity(path: str | Path) -> Superconductivity:
    """Read the UCI ``train.csv`` (header row, 81 feature columns, ``critical_temp`` last).

    Raises ``ConfigError('prism.data_dir', ...)`` if the file is missing or has the wrong shape.
    """
    p = superconductivity_file(path)
    with p.open(newline="") as fh:
        header = [h.strip() for h in next(csv.reader(fh))]
    raw = np.loadtxt(p, delimiter=",", skiprows=1, dtype=np.float64, ndmin=2)
    if raw.shape[1] != N_FEATURES + 1 or raw.shape[0] < 10:
        raise ConfigError(DATA_DIR, f"{p}: expected >= 10 rows of {N_FEATURES + 1} numbers, got shape {raw.shape}")
    x, t = raw[:, :-1], raw[:, -1]
    sd = x.std(axis=0)
    x = (x - x.mean(axis=0)) / np.where(sd > 0, sd, 1.0)
    y_mean, y_std = float(t.mean()), float(t.std())
    return Superconductivity(x=x, y=(t - y_mean) / y_std, y_mean=y_mean, y_std=y_std, feature_names=tuple(header[:-1]))


def decile_bins(y: np.ndarray, n_bins: int = 10) -> list[np.ndarray]:
    """Row indices of ``n_bins`` equal-frequency target bins (sizes differ by at most 1)."""
    return np.array_split(np.argsort(y, kind="stable"), n_bins)


def client_indices(
    bins: list[np.ndarray], rng: np.random.Generator, n_samples: int = 3000, concentration: float = 0.5
) -> np.ndarray:
    """Row indices of one client's ``n_samples`` samples, in random order.

    ``pi ~ Dir(concentration * 1)`` over the bins, counts ``~ Multinomial(n_samples, pi)``,
    each count drawn uniformly with replacement from its bin.
    """
    pi = rng.dirichlet(np.full(len(bins), concentration))
    counts = rng.multinomial(n_samples, pi)
    picks = [b[rng.integers(0, b.size, size=c)] for b, c in zip(bins, counts) if c]
    idx = np.concatenate(picks) if picks else np.empty(0, dtype=np.int64)
    return rng.permutation(idx)


def write_standin_csv(path: str | Path, rng: np.random.Generator, n_rows: int = N_ROWS) -> Path:
    """Write a synthetic file with ``train.csv``'s header and shape (not the real data).

    Features are correlated, positive and skewed like the real ones; ``critical_temp`` is a
    nonlinear function of a few of them plus noise, clipped to [0, 185] K with mean ~ 35 K.
    """
    latent = rng.standard_normal((n_rows, 6))
    mix = rng.standard_normal((6, N_FEATURES)) / np.sqrt(6)
    x = latent @ mix + 0.3 * rng.standard_normal((n_rows, N_FEATURES))
    x = np.exp(0.5 * x) * rng.uniform(1, 100, N_FEATURES)
    x[:, 0] = np.clip(np.round(3 + 1.5 * latent[:, 0]), 1, 9)
    z = latent[:, 0] + 0.5 * np.tanh(latent[:, 1]) - 0.4 * latent[:, 2] ** 2 / 2
    t = np.clip(35 + 30 * z + 8 * rng.standard_normal(n_rows), 0.0, 185.0)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    data = np.column_stack([x, t])
    np.savetxt(p, data, delimiter=",", header=",".join(COLUMNS), comments="", fmt="%.6g")
    return p
