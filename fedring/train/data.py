"""Data sets and their partition over clients.

Every rank computes the same partition from the labels alone (small; the natural partition from
each sample's user instead, and no labels), then loads only the samples of the clients it hosts
(with their labels, for the natural partition), so no rank ever holds the whole training set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedring import validate
from fedring.comm import block_bounds
from fedring.datasets import DATASETS
from fedring.errors import ConfigError
from fedring.rng import Stream, generator

#: the values of ``partition`` (docs/training.md)
PARTITIONS = ("iid", "fang", "dirichlet", "shards", "lognormal", "gamma_similarity_niid", "extreme_niid", "natural")


@dataclass
class Shard:
    """Samples of one client (or one evaluation slice) and their int64 labels: float32 images in
    [0, 1], or a text data set's int64 token sequences."""

    x: np.ndarray
    y: np.ndarray


# ---------------------------------------------------------------------------------------
# Partitions: lists of sample indices per client, computed from the labels and the seed.


def partition_iid(n_samples: int, n_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [np.sort(part) for part in np.array_split(rng.permutation(n_samples), n_clients)]


def partition_fang(labels: np.ndarray, n_clients: int, q: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Fang et al. (2020) non-IID partition of degree ``q``, the one the BRACE paper uses (q = 0.5).

    Clients form ``C`` label groups; a sample of label ``l`` goes to group ``l`` with
    probability ``q`` and to each other group with probability ``(1 - q)/(C - 1)``, then to a
    uniformly random client of that group; finally client ids are permuted. ``q = 1/C`` is
    IID. The group width is ``n/C`` as a float when ``C`` does not divide ``n``, as in the
    reference loop (FLDetector's ``train_mnist.py``), which this vectorises: the same
    distribution, drawn from ``rng`` in another order (docs/brace.md).
    """
    num_classes = int(labels.max()) + 1
    other = (1.0 - q) / (num_classes - 1)
    width = n_clients / num_classes
    rd = rng.random(len(labels))
    upper, lower = labels * other + q, labels * other
    group = np.where(
        rd > upper,
        np.floor((rd - upper) / other) + labels + 1,
        np.where(rd < lower, np.floor(rd / other), labels),
    )
    group = np.minimum(group, num_classes - 1)
    client = (group * width + np.floor(rng.random(len(labels)) * width)).astype(np.int64)
    client = np.minimum(client, n_clients - 1)
    perm = rng.permutation(n_clients)
    order = np.argsort(client, kind="stable")
    per_client = np.split(order, np.searchsorted(client[order], np.arange(1, n_clients)))
    return [per_client[p] for p in perm]


#: Dirichlet draws before ``dirichlet.min_size`` gives up: flwr-datasets' first draw and its 10 more
DIRICHLET_DRAWS = 11


def dirichlet_draw(
    labels: np.ndarray, n_clients: int, alpha: float, rng: np.random.Generator
) -> tuple[list[np.ndarray], np.ndarray]:
    """The random part of the Dirichlet partition: per class ``c`` (0 .. max label), its samples in a
    random order and its proportions over the clients ~ Dirichlet(alpha), drawn in that order
    class after class. Returns ``(orders, proportions)``, ``proportions`` of shape (classes, clients)."""
    orders, proportions = [], []
    for c in range(int(labels.max()) + 1):
        orders.append(rng.permutation(np.flatnonzero(labels == c)))
        proportions.append(rng.dirichlet(np.full(n_clients, alpha)))
    return orders, np.array(proportions).reshape(len(orders), n_clients)


def dirichlet_assign(orders: list[np.ndarray], proportions: np.ndarray) -> list[np.ndarray]:
    """The pure part: class ``c``'s samples ``orders[c]`` cut at ``floor(cumsum(p_c) * n_c)``, client
    ``k`` taking the ``k``-th piece (the cut of flwr-datasets' ``DirichletPartitioner`` and of
    FedLab's ``hetero_dir_partition``); each client's indices sorted.

    >>> [p.tolist() for p in dirichlet_assign([np.array([4, 0, 2]), np.array([1, 3])], np.array([[0.5, 0.5], [0.2, 0.8]]))]
    [[4], [0, 1, 2, 3]]
    """
    parts: list[list[np.ndarray]] = [[] for _ in range(proportions.shape[1])]
    for idx, p in zip(orders, proportions):
        cuts = (np.cumsum(p)[:-1] * len(idx)).astype(np.int64)
        for k, piece in enumerate(np.split(idx, cuts)):
            parts[k].append(piece)
    return [np.sort(np.concatenate(p)) for p in parts]


def partition_dirichlet(
    labels: np.ndarray, n_clients: int, alpha: float, rng: np.random.Generator, min_size: int | None = None
) -> list[np.ndarray]:
    """Per class, split its samples over clients with proportions ~ Dirichlet(alpha) (Hsu, Qi and
    Brown, "Measuring the effects of non-identical data distribution", 2019).

    ``min_size`` (``dirichlet.min_size``): draw again, from the same generator, until every client
    holds at least that many samples, at most :data:`DIRICHLET_DRAWS` draws in all, as
    flwr-datasets' ``DirichletPartitioner(min_partition_size=...)`` (without its self-balancing);
    None (the default): one draw, as every earlier release (an empty client is then refused).
    """
    if min_size is not None and min_size * n_clients > len(labels):
        raise ConfigError(
            "dirichlet.min_size",
            f"{n_clients} clients x {min_size} samples is more than the {len(labels)} training samples",
        )
    for _ in range(1 if min_size is None else DIRICHLET_DRAWS):
        parts = dirichlet_assign(*dirichlet_draw(labels, n_clients, alpha, rng))
        if min_size is None or min(len(p) for p in parts) >= min_size:
            return parts
    raise ConfigError(
        "dirichlet.min_size",
        f"{DIRICHLET_DRAWS} Dirichlet draws (alpha {alpha:g}) each left a client with fewer than {min_size} "
        "samples: a larger --noniid (alpha), a smaller min_size or fewer clients",
    )


def lognormal_draw(
    n_samples: int, n_clients: int, sigma: float, rng: np.random.Generator
) -> tuple[np.ndarray | None, np.ndarray]:
    """The random part of the quantity-skew partition: ``n_clients`` log-normal sizes (mean of the log
    ``log(floor(n / K))``, FedLab's; none with ``sigma = 0``), then a permutation of the samples."""
    if n_samples < n_clients:
        raise ConfigError("clients", f"{n_clients} clients but {n_samples} training samples: every client needs one")
    raw = rng.lognormal(np.log(n_samples // n_clients), sigma, n_clients) if sigma > 0 else None
    return raw, rng.permutation(n_samples)


def lognormal_assign(raw: np.ndarray | None, perm: np.ndarray, n_clients: int) -> list[np.ndarray]:
    r"""The pure part of FedLab's quantity skew (``lognormal_unbalance_split`` and ``homo_partition``
    of ``fedlab/utils/dataset/functional.py``): client ``k`` holds :math:`s_k` samples,

    .. math:: s_k = \lfloor n\, r_k / \textstyle\sum_j r_j \rfloor, \qquad s_0 \mathrel{+}= n - \textstyle\sum_j s_j,

    the ``raw`` log-normal draws :math:`r` scaled to the ``n`` samples, floored, and the samples
    the floors leave over given to client 0; then the permutation ``perm`` is cut into pieces of
    those sizes in client order. Without draws (``sigma = 0``, FedLab's ``balance_split``) every
    client holds :math:`\lfloor n / K \rfloor` and the last :math:`n \bmod K` samples of the
    permutation go to nobody, as in FedLab. Each client's indices sorted.

    >>> [p.tolist() for p in lognormal_assign(np.array([1.0, 3.0, 1.5]), np.array([5, 2, 0, 6, 1, 3, 4]), 3)]
    [[0, 2, 5], [1, 3, 6], [4]]
    """
    n = len(perm)
    if raw is None:
        sizes = np.full(n_clients, n // n_clients)
    else:
        sizes = (raw / np.sum(raw) * n).astype(np.int64)
        sizes[0] += n - sizes.sum()
    return [np.sort(p) for p in np.split(perm, np.cumsum(sizes))[:n_clients]]


def extreme_assign(labels: np.ndarray, idx: np.ndarray, n_clients: int) -> list[np.ndarray]:
    """ByzFL's ``extreme_niid_idx``: the samples ``idx`` sorted by label, then by index, and cut into
    ``n_clients`` contiguous pieces (``array_split``: sizes differ by at most one), in client order."""
    return np.array_split(idx[np.lexsort((idx, labels[idx]))], n_clients)


def gamma_assign(labels: np.ndarray, perm: np.ndarray, gamma: float, n_clients: int) -> list[np.ndarray]:
    """ByzFL's ``gamma_niid_idx`` on the samples in the order ``perm``: the first ``floor(gamma n)`` of
    them cut into ``n_clients`` pieces as they come (the IID part), the others as
    :func:`extreme_assign` cuts them; client ``k`` holds its piece of each, indices sorted.

    >>> labels = np.array([1, 0, 1, 0, 2, 2])
    >>> [p.tolist() for p in gamma_assign(labels, np.array([4, 1, 5, 0, 3, 2]), 0.5, 2)]
    [[0, 1, 3, 4], [2, 5]]
    """
    k = int(len(perm) * gamma)
    iid, niid = np.array_split(perm[:k], n_clients), extreme_assign(labels, perm[k:], n_clients)
    return [np.sort(np.concatenate([a, b])) for a, b in zip(iid, niid)]


def natural_draw(users: np.ndarray, n_clients: int, rng: np.random.Generator, dataset: str) -> np.ndarray:
    """The users of a natural partition: every user that has a training sample when there are as many
    as clients, else ``n_clients`` of them drawn uniformly without replacement; in id order."""
    ids = np.unique(users)
    if n_clients > len(ids):
        raise ConfigError(
            "clients",
            f"{n_clients} clients but {dataset} has {len(ids)} users with training samples: "
            "partition natural gives each client one user",
        )
    return ids[np.sort(rng.choice(len(ids), n_clients, replace=False))]


def samples_of(users: np.ndarray, chosen: np.ndarray) -> list[np.ndarray]:
    """The sorted sample indices of each of the ``chosen`` users (``users``: a user per sample)."""
    order = np.argsort(users, kind="stable")
    lo, hi = np.searchsorted(users[order], chosen), np.searchsorted(users[order], chosen, side="right")
    return [order[a:b] for a, b in zip(lo, hi)]


def partition_shards(labels: np.ndarray, n_clients: int, per_client: int, rng: np.random.Generator) -> list[np.ndarray]:
    """McMahan et al. (2017), §3 ("pathological non-IID"): sort the samples by label, cut them into
    ``n_clients * per_client`` shards of equal size (sizes differ by at most one: ``array_split``),
    and give each client ``per_client`` shards drawn at random without replacement.

    >>> parts = partition_shards(np.array([1, 0, 1, 0, 2, 2, 1, 0]), 2, 2, np.random.default_rng(0))
    >>> # shards [1 3 | 7 0 | 2 6 | 4 5] (stable sort); the permutation gives client 0 shards 2, 0, client 1 shards 1, 3
    >>> [p.tolist() for p in parts]
    [[1, 2, 3, 6], [0, 4, 5, 7]]
    """
    count = n_clients * per_client
    if count > len(labels):
        raise ConfigError(
            "shards.per_client",
            f"{n_clients} clients x {per_client} shards = {count} shards of "
            f"{len(labels)} samples: fewer shards per client, or fewer clients",
        )
    shards = np.array_split(np.argsort(labels, kind="stable"), count)
    order = rng.permutation(count)
    return [
        np.sort(np.concatenate([shards[s] for s in order[c * per_client : (c + 1) * per_client]]))
        for c in range(n_clients)
    ]


#: each partition's settings (section ``[NAME]``) and their defaults (docs/training.md)
PARTITION_SETTINGS: dict[str, dict] = {
    "shards": {"per_client": 2},
    "dirichlet": {"min_size": None},
    "lognormal": {"sigma": 0.3},
    "gamma_similarity_niid": {"gamma": 0.5},
}


def partition_settings(kind: str, section: dict) -> dict:
    """The settings of partition ``kind`` from its section, defaults filled in; a one-line ConfigError
    naming ``kind.key`` for an unknown key or a value out of range."""
    defaults = PARTITION_SETTINGS.get(kind, {})
    validate.known_keys(kind, f"partition {kind}", section, list(defaults))
    out = {**defaults, **section}
    if kind == "shards":
        out["per_client"] = validate.integer("shards.per_client", out["per_client"], lo=1)
    elif kind == "dirichlet" and out["min_size"] is not None:
        out["min_size"] = validate.integer("dirichlet.min_size", out["min_size"], lo=1)
    elif kind == "lognormal":
        out["sigma"] = validate.real("lognormal.sigma", out["sigma"], lo=0)
    elif kind == "gamma_similarity_niid":
        out["gamma"] = validate.real("gamma_similarity_niid.gamma", out["gamma"], lo=0, hi=1)
    return out


def partition(
    labels: np.ndarray | None,
    n_clients: int,
    kind: str,
    noniid: float,
    seed: int,
    shards_per_client: int = 2,
    settings: dict | None = None,
    users: np.ndarray | None = None,
    dataset: str = "the data set",
) -> list[np.ndarray]:
    """Sample indices per client; the same on every rank for the same seed. ``settings``: the
    partition's section (``shards`` takes ``shards_per_client`` instead); ``users``: the user of
    each sample (``Dataset.train_users``), for ``natural``, which alone needs no ``labels`` (None);
    ``dataset``: its name, for messages."""
    rng = generator(seed, Stream.PARTITION)
    s = partition_settings(kind, settings or {})
    if kind == "natural":
        if users is None:
            raise ConfigError("partition", f"natural gives each client one user, and {dataset} records none")
        chosen = natural_draw(users, n_clients, generator(seed, Stream.NATURAL_USERS), dataset)
        return samples_of(users, chosen)
    if labels is None:
        raise ValueError(f"partition {kind!r} is computed from the labels, and none were given")
    if kind == "iid":
        return partition_iid(len(labels), n_clients, rng)
    if kind == "fang":
        return partition_fang(labels, n_clients, noniid, rng)
    if kind == "dirichlet":
        return partition_dirichlet(labels, n_clients, noniid, rng, s["min_size"])
    if kind == "shards":
        return partition_shards(labels, n_clients, shards_per_client, rng)
    if kind == "lognormal":
        return lognormal_assign(*lognormal_draw(len(labels), n_clients, s["sigma"], rng), n_clients)
    if kind == "gamma_similarity_niid":
        return gamma_assign(labels, rng.permutation(len(labels)), s["gamma"], n_clients)
    if kind == "extreme_niid":
        return [np.sort(p) for p in extreme_assign(labels, np.arange(len(labels)), n_clients)]
    raise ConfigError("partition", f"unknown partition {kind!r}; allowed: {', '.join(PARTITIONS)}")


def hold_out(parts: list[np.ndarray], fraction: float, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Split every client's samples into (training, validation): ``floor(fraction * |part|)`` samples
    drawn from the client's own stream, so the split depends on the seed and the client only.

    >>> train, val = hold_out([np.arange(10), np.arange(10, 13)], 0.3, seed=0)
    >>> [len(v) for v in val], sorted(np.concatenate([train[0], val[0]]).tolist()) == list(range(10))
    ([3, 0], True)
    """
    train, val = [], []
    for c, part in enumerate(parts):
        held = generator(seed, Stream.VALIDATION, client=c, step=0).permutation(len(part))[: int(fraction * len(part))]
        mask = np.zeros(len(part), bool)
        mask[held] = True
        train.append(part[~mask])
        val.append(part[mask])
    if fraction and not sum(len(v) for v in val):
        raise ConfigError("validation", f"{fraction:g} of every client's samples holds out none: use a larger fraction")
    return train, val


def _checked(parts: list[np.ndarray]) -> list[np.ndarray]:
    # Checked on the whole partition, which every rank computes, so all ranks fail alike.
    empty = [c for c, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise ConfigError(
            "partition",
            f"client(s) {empty[:5]} received no training samples; use fewer clients, "
            "a larger --noniid (Dirichlet alpha) or another partition",
        )
    return parts


def take(array: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """``array[pos]``: a view when ``pos`` is a run of consecutive rows (a natural partition's user, in
    file order), so that a rank holds its samples once; else a copy."""
    if len(pos) and pos[-1] - pos[0] == len(pos) - 1 and np.all(np.diff(pos) == 1):
        return array[pos[0] : pos[-1] + 1]
    return array[pos]


class FederatedData:
    """The shards of the clients hosted on one rank, and its slice of the test set.

    The test set is cut into ``n_clients`` contiguous slices; each rank evaluates the
    slices of its clients, so evaluation is split across ranks the same way whatever their
    number. With ``partition = natural`` on a data set with test users, a client's slice is its
    own user's test samples instead.
    """

    def __init__(
        self,
        dataset: str,
        data_dir: str | None,
        n_clients: int,
        clients: range,
        kind: str,
        noniid: float,
        seed: int,
        server_samples: int = 0,
        shards_per_client: int = 2,
        validation: float = 0.0,
        settings: dict | None = None,
    ):
        self.n_clients = n_clients
        self.clients = clients
        self.server = None  # the server's small clean set (FLTrust, Zeno++), when asked for

        data = DATASETS.build(dataset, {}, key="dataset", data_dir=data_dir)
        # The natural partition is drawn from the users alone, so every rank reads every sample's
        # user but only its own rows' labels, with their samples (Dataset.train_rows).
        users = data.train_users() if kind == "natural" else None
        labels: np.ndarray | None = None
        if users is None:
            labels = data.train_labels()
            n_train = len(labels)
        else:
            n_train = len(users)
        whole = partition(labels, n_clients, kind, noniid, seed, shards_per_client, settings, users, dataset)
        parts, held = hold_out(_checked(whole), validation, seed)

        def rows_of(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """The samples and labels of the sorted training ``rows``."""
            return (data.train_images(rows), labels[rows]) if labels is not None else data.train_rows(rows)

        mine = np.sort(np.concatenate([parts[c] for c in clients] + [held[c] for c in clients]))
        images, mine_labels = rows_of(mine)

        def shard(indices: np.ndarray) -> Shard:
            pos = np.searchsorted(mine, indices)
            return Shard(take(images, pos), mine_labels[pos])

        self.shards = [shard(parts[c]) for c in clients]
        self.validation = [shard(held[c]) for c in clients]  # empty without a validation split
        if server_samples:
            rows = np.sort(generator(seed, Stream.SERVER_DATA).permutation(n_train)[:server_samples])
            self.server = Shard(*rows_of(rows))
        test_users = data.test_users() if kind == "natural" else None
        if test_users is None:
            test_labels = data.test_labels()
            bounds = block_bounds(len(test_labels), n_clients)
            lo, hi = int(bounds[clients.start]), int(bounds[clients.stop])
            self.test_bounds = bounds[clients.start : clients.stop + 1] - lo
            self.test = Shard(data.test_images(np.arange(lo, hi)), test_labels[lo:hi])
        else:
            assert users is not None, "a natural partition reads the training users"
            own = samples_of(test_users, np.array([users[p[0]] for p in whole]))  # each client's one user
            if not any(len(t) for t in own):
                raise ConfigError(
                    "partition", f"none of the {n_clients} users of the natural partition has test samples"
                )
            local = [own[c] for c in clients]
            rows = np.sort(np.concatenate(local))
            self.test_bounds = np.concatenate([[0], np.cumsum([len(t) for t in local])])
            pos = np.searchsorted(rows, np.concatenate(local))
            test_x, test_y = data.test_rows(rows)
            self.test = Shard(take(test_x, pos), test_y[pos])
        self.shape = data.shape

    def test_slice(self, k: int) -> Shard:
        """Test samples evaluated for the k-th local client."""
        a, b = self.test_bounds[k], self.test_bounds[k + 1]
        return Shard(self.test.x[a:b], self.test.y[a:b])
