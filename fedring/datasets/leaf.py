"""LEAF's federated data sets (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018):
FEMNIST and Shakespeare, from the JSON files that LEAF's ``preprocess.sh`` writes.

LEAF leaves ``data/<name>/data/train/*.json`` and ``data/<name>/data/test/*.json``; each file is
``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}``
(Shakespeare's also has ``"hierarchies"``, the plays). Samples are read file by file in sorted
file-name order, and within a file user by user in the order of ``users``. Every sample keeps
its user: :meth:`LeafDataset.train_users` (a writer of FEMNIST, a speaking role of
Shakespeare), for a natural partition with one user per client.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np

from fedring.errors import ConfigError

from . import DATASETS, Dataset

#: LEAF's 80 characters (``models/utils/language_utils.py``, ``ALL_LETTERS``): a character's
#: index here is its token (``word_to_indices``) and, for the next character, its class
#: (``letter_to_vec``)
SHAKESPEARE_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
_TOKEN = np.full(128, -1, np.int64)
_TOKEN[[ord(c) for c in SHAKESPEARE_LETTERS]] = np.arange(len(SHAKESPEARE_LETTERS))

#: ``float`` for JSON's numbers, one object per distinct text: FEMNIST's pixels are k / 255, 256
#: values, so a file's millions of pixels share them (8 bytes a pixel in their lists instead of 32)
_FLOAT = functools.lru_cache(maxsize=4096)(float)


def encode_text(strings: list, length: int, path: Path, user: str, key: str) -> np.ndarray:
    """Strings of ``length`` characters as int64 tokens ``(n, length)``; a string of another length
    or a character outside :data:`SHAKESPEARE_LETTERS` is a ConfigError naming the file and user."""
    for k, s in enumerate(strings):
        if not isinstance(s, str) or len(s) != length:
            raise ConfigError(
                "data_dir",
                f"{path}: user {user}'s {key}[{k}] is {s!r:.100}, expected a string of {length} characters",
            )
    try:
        raw = "".join(strings).encode("utf-32-le")
    except UnicodeEncodeError as e:
        raise ConfigError("data_dir", f"{path}: user {user}'s {key} hold an invalid character: {e}") from None
    codes = np.frombuffer(raw, dtype="<u4").astype(np.int64)
    tokens = np.where(codes < 128, _TOKEN[np.minimum(codes, 127)], -1)
    bad = np.flatnonzero(tokens < 0)
    if len(bad):
        k = int(bad[0])
        raise ConfigError(
            "data_dir",
            f"{path}: user {user}'s {key}[{k // length}] has {chr(codes[k])!r}, not one of LEAF's 80 characters",
        )
    return tokens.reshape(len(strings), length)


class _Dropped(int):
    """The length of a user's ``x`` or ``y`` list that the reader dropped as soon as it was parsed
    (JSON never yields this type: its integers are ``int``)."""


def _dropping(keys: tuple[str, ...]):
    """A ``json.load`` ``object_pairs_hook`` that replaces the lists under ``keys`` of each object (a
    user's ``x`` and ``y``) by their lengths as the parser closes the object, so a file's parse
    never holds more than one user's unwanted samples at once."""

    def hook(pairs: list[tuple[str, object]]) -> dict:
        obj = dict(pairs)
        for key in keys:
            value = obj.get(key)
            if isinstance(value, list):
                obj[key] = _Dropped(len(value))
        return obj

    return hook


def _length(value: object) -> int | None:
    """The number of samples in a user's ``x`` or ``y``: a list's or a dropped list's; None for anything else."""
    if isinstance(value, _Dropped):
        return int(value)
    return len(value) if isinstance(value, list) else None


class LeafDataset(Dataset):
    """A LEAF data set: the JSON files of ``train/`` and ``test/`` in ``--data-dir`` (LEAF's
    ``data/<name>/data``), else ``$ENV``, else ``DEFAULT_DIR``. A subclass encodes a user's
    ``x`` and ``y`` lists (:meth:`encode_x`, :meth:`encode_y`).

    The index of a part (its users and their sample counts, file by file; what a natural partition
    needs) parses every file of the part once, dropping each user's samples as soon as they are
    parsed; reading all labels (:meth:`train_labels`) keeps the ``y`` lists too. Reading samples
    (:meth:`train_rows`, :meth:`train_images`) then parses only the files that hold the rows asked
    for, and encodes only the users that hold them. Nothing parsed is kept beyond one file.
    """

    train_samples = None  # LEAF's preprocess.sh samples a fraction of the users (--sf, -k, -t)
    TITLE = ""
    ENV = ""
    DEFAULT_DIR = ""
    SAMPLE_DTYPE: type = np.float32  # what train_images returns

    def __init__(self, data_dir: str | None = None):
        super().__init__(data_dir)
        self.root = Path(data_dir or os.environ.get(self.ENV) or self.DEFAULT_DIR)
        self.files = {part: sorted((self.root / part).glob("*.json")) for part in ("train", "test")}
        missing = [part for part, files in self.files.items() if not files]
        if missing:
            raise ConfigError(
                "data_dir",
                f"no {self.TITLE} JSON files in {' or '.join(str(self.root / p) for p in missing)}: run LEAF's "
                f"data/{self.name}/preprocess.sh (https://github.com/TalwalkarLab/leaf) and pass its "
                f"data/{self.name}/data folder (which holds train/ and test/) as --data-dir (or set {self.ENV})",
            )
        self._user_ids: dict[str, int] = {}
        self._indexed: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._labels: dict[str, np.ndarray] = {}

    # -- a subclass's encoding of one user's samples ---------------------------------------------

    def encode_x(self, xs: list, path: Path, user: str) -> np.ndarray:
        raise NotImplementedError

    def encode_y(self, ys: list, path: Path, user: str) -> np.ndarray:
        raise NotImplementedError

    # -- reading ---------------------------------------------------------------------------------

    def _users_of(self, path: Path, drop: tuple[str, ...] = ()) -> list[tuple[str, int, dict]]:
        """``[(user, samples, {"x": [...], "y": [...]}), ...]`` of one file, its structure checked;
        the lists under ``drop`` are replaced by their lengths while the file is parsed."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f, parse_float=_FLOAT, object_pairs_hook=_dropping(drop) if drop else None)
        except (OSError, ValueError) as e:
            raise ConfigError("data_dir", f"{path} is not a JSON file: {type(e).__name__}: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("users"), list):
            raise ConfigError("data_dir", f"{path} has no list 'users': not a LEAF data file")
        user_data, counts = data.get("user_data"), data.get("num_samples")
        if not isinstance(user_data, dict):
            raise ConfigError("data_dir", f"{path} has no object 'user_data': not a LEAF data file")
        if counts is not None and (not isinstance(counts, list) or len(counts) != len(data["users"])):
            raise ConfigError("data_dir", f"{path}: 'num_samples' does not list one count per user")
        out = []
        for i, user in enumerate(data["users"]):
            samples = user_data.get(user) if isinstance(user, str) else None
            if not isinstance(samples, dict) or (n := _length(samples.get("x"))) is None:
                raise ConfigError("data_dir", f"{path}: user {user!r} has no samples in 'user_data' (x and y)")
            if _length(samples.get("y")) != n:
                raise ConfigError("data_dir", f"{path}: user {user}'s x and y are not two lists of one length")
            if counts is not None and counts[i] != n:
                raise ConfigError(
                    "data_dir", f"{path}: num_samples says user {user} has {counts[i]} samples, user_data has {n}"
                )
            out.append((user, n, samples))
        return out

    def _scan(self, part: str, labels: bool) -> None:
        """Parse every file of ``part`` once for its index (and all its labels when ``labels``); the
        training part's index first, so that a user has the same id in both parts."""
        if part == "test":
            self._index("train")
        uids, counts, per_file, ys = [], [], [], []
        for path in self.files[part]:
            users = self._users_of(path, drop=("x",) if labels else ("x", "y"))
            for user, n, samples in users:
                uids.append(self._user_ids.setdefault(user, len(self._user_ids)))
                counts.append(n)
                if labels:
                    ys.append(self.encode_y(samples["y"], path, user))
            per_file.append(sum(n for _, n, _ in users))
        self._indexed[part] = (np.array(uids, np.int64), np.array(counts, np.int64), np.array(per_file, np.int64))
        if labels:
            self._labels[part] = np.concatenate([np.empty(0, np.int64), *ys])

    def _index(self, part: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(user id, samples)`` of each entry of the files' ``users`` lists of ``part`` in file order,
        and the samples per file."""
        if part not in self._indexed:
            self._scan(part, labels=False)
        return self._indexed[part]

    def _all_labels(self, part: str) -> np.ndarray:
        if part not in self._labels:
            self._scan(part, labels=True)
        return self._labels[part]

    def _samples(self, part: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = np.asarray(rows, np.int64)
        per_file = self._index(part)[2]
        bounds = np.concatenate([[0], np.cumsum(per_file)])
        if len(rows) and not 0 <= rows[0] <= rows[-1] < bounds[-1]:
            raise IndexError(f"{part} rows must be sorted within 0..{bounds[-1] - 1}")
        out: np.ndarray = np.empty((len(rows), *self.shape), self.SAMPLE_DTYPE)  # filled in row order: no second copy
        labels = np.empty(len(rows), np.int64)
        for k, path in enumerate(self.files[part]):
            lo, hi = np.searchsorted(rows, bounds[k]), np.searchsorted(rows, bounds[k + 1])
            if hi == lo:
                continue  # this file holds none of the rows: not parsed
            start = int(bounds[k])
            for user, n, samples in self._users_of(path):  # encode only the users that hold rows
                stop = start + n
                a, b = np.searchsorted(rows, start), np.searchsorted(rows, stop)
                if b > a:
                    out[a:b] = self.encode_x(samples["x"], path, user)[rows[a:b] - start]
                    labels[a:b] = self.encode_y(samples["y"], path, user)[rows[a:b] - start]
                start = stop
            if start != bounds[k + 1]:
                raise ConfigError("data_dir", f"{path} changed while it was read")
        return out, labels

    def train_labels(self) -> np.ndarray:
        return self._all_labels("train")

    def train_images(self, rows: np.ndarray) -> np.ndarray:
        return self._samples("train", rows)[0]

    def train_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The samples and labels of the sorted training rows, from the files that hold them only."""
        return self._samples("train", rows)

    def test_labels(self) -> np.ndarray:
        return self._all_labels("test")

    def test_images(self, rows: np.ndarray) -> np.ndarray:
        return self._samples("test", rows)[0]

    def test_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The samples and labels of the sorted test rows, from the files that hold them only."""
        return self._samples("test", rows)

    def train_users(self) -> np.ndarray:
        """Each training sample's user, an id in ``0 .. len(user_names()) - 1``; read from the files'
        ``users`` and sample counts, without the labels."""
        uids, counts, _ = self._index("train")
        return np.repeat(uids, counts)

    def test_users(self) -> np.ndarray:
        """Each test sample's user: the id of the same user in :meth:`train_users`; a user with
        test samples only (LEAF's ``-t user`` split) gets an id after the training users'."""
        uids, counts, _ = self._index("test")
        return np.repeat(uids, counts)

    def user_names(self) -> list[str]:
        """LEAF's name of each user id (FEMNIST: the writer, ``f0000_14``; Shakespeare: play and role)."""
        self._index("test")
        return list(self._user_ids)


@DATASETS.register
class FEMNIST(LeafDataset):
    """LEAF's FEMNIST: handwritten digits and letters of 3,550 writers (EMNIST ByClass by writer),
    28x28 grey, 62 classes (0-9 digits, 10-35 upper-case A-Z, 36-61 lower-case a-z). ``x`` is a
    list of 784 floats in [0, 1] (the image row by row), read as is: LEAF scales the NIST scans
    without inverting them, so the background is 1.0 and the ink dark, unlike MNIST."""

    name = "femnist"
    classes = 62
    model = "femnist_cnn"
    TITLE = "FEMNIST"
    ENV = "FEDRING_FEMNIST"
    DEFAULT_DIR = "leaf/data/femnist/data"

    def encode_x(self, xs: list, path: Path, user: str) -> np.ndarray:
        if not xs:
            return np.empty((0, *self.shape), np.float32)
        try:
            x = np.asarray(xs, dtype=np.float32)
        except (TypeError, ValueError):
            x = np.empty(0, np.float32)
        if x.shape != (len(xs), 784):
            raise ConfigError("data_dir", f"{path}: user {user}'s x are not lists of 784 numbers (28x28 images)")
        if not (np.isfinite(x).all() and x.min() >= 0 and x.max() <= 1):
            raise ConfigError("data_dir", f"{path}: user {user}'s x have pixels outside [0, 1]")
        return x.reshape(-1, 1, 28, 28)

    def encode_y(self, ys: list, path: Path, user: str) -> np.ndarray:
        for v in ys:
            if type(v) is not int or not 0 <= v < self.classes:
                raise ConfigError(
                    "data_dir", f"{path}: user {user} has label {v!r:.40}; FEMNIST's are 0..{self.classes - 1}"
                )
        return np.array(ys, np.int64).reshape(len(ys))


@DATASETS.register
class Shakespeare(LeafDataset):
    """LEAF's Shakespeare: next-character prediction, one user per speaking role of each play.
    ``x`` is a string of 80 characters, ``y`` the character after it; both are encoded with LEAF's
    80-character alphabet (:data:`SHAKESPEARE_LETTERS`, ``word_to_indices``), so a sample is 80
    int64 tokens in 0..79 (``train_images`` returns ``(k, 80)`` int64, not images) and its label
    the next character's token, one of 80 classes."""

    name = "shakespeare"
    classes = 80
    shape = (80,)
    model = "shakespeare_lstm"
    TITLE = "Shakespeare"
    SAMPLE_DTYPE = np.int64
    ENV = "FEDRING_SHAKESPEARE"
    DEFAULT_DIR = "leaf/data/shakespeare/data"

    def encode_x(self, xs: list, path: Path, user: str) -> np.ndarray:
        return encode_text(xs, 80, path, user, "x")

    def encode_y(self, ys: list, path: Path, user: str) -> np.ndarray:
        return encode_text(ys, 1, path, user, "y").reshape(len(ys))
