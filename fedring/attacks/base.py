"""The attack interface: the context an attack sees, the two attack kinds, parameter checks.

An attack is a small stateless callable, as in ByzFL. A *model* attack replaces the gradients
of the Byzantine clients after they computed them honestly on their own data; a *data* attack
changes the training batch of each Byzantine client before it computes its gradient.

What an attack may know is part of its definition (``knowledge``):

* ``"own"``: each attacker its own data and gradient only;
* ``"collusion"``: every Byzantine client's pre-attack gradient;
* ``"omniscient"``: the honest clients' gradients of the round too.

The caller passes honest gradients only to omniscient attacks, and :meth:`ModelAttack.__call__`
drops them otherwise, so an attack cannot use more than it declares.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fedring.errors import ConfigError
from fedring.registry import Registry

#: the attacks, by name (``--attack NAME``; parameters ``attack.*``)
ATTACKS = Registry("attack")


@dataclass
class AttackContext:
    """What the attackers know about the round besides the gradients.

    Attributes
    ----------
    rng : numpy.random.Generator
        Seeded per (run seed, round); every random draw of an attack comes from it.
    n : int
        Total number of clients.
    f : int
        Declared number of Byzantine clients (what the defence is told); the actual number is
        the number of rows of ``byz``.
    lr : float
        Learning rate of the run (the update is ``w <- w - lr * aggregate``).
    round : int
        Round index.
    aggregator : callable or None
        The defence's rule ``(n, d) -> (d,)``, for aggregator-aware attacks.
    aggregator_name : str
        Its name, for messages.
    """

    rng: np.random.Generator
    n: int
    f: int
    lr: float
    round: int
    aggregator: Callable[[np.ndarray], np.ndarray] | None
    aggregator_name: str = ""


@ATTACKS.base
class ModelAttack:
    """Base of the model-poisoning attacks.

    Subclasses implement :meth:`craft` on float64 arrays; :meth:`__call__` checks the inputs,
    hides the honest gradients from non-omniscient attacks and returns the rows in the dtype of
    ``byz``. ``knowledge`` is a class default that an instance may narrow or widen when a
    parameter changes what the attack uses (e.g. Fang's full vs partial knowledge).

    An attack with ``blockwise = True`` (every omniscient or colluding attack of fedring)
    receives the rows as the clients sent them (float32) instead, and does its float64
    arithmetic one column block at a time (:func:`columns`, :func:`by_columns`), with the same
    float64 values as on float64 copies of the rows: rank 0 then holds no float64 copy of every
    honest row (docs/figures.md, "Memory at ResNet-18 size"); Gram matrices and products with a
    d-vector are summed over column blocks too (:func:`row_products`).
    """

    name: ClassVar[str]
    knowledge: str = "own"
    blockwise: ClassVar[bool] = False

    def __call__(self, byz: np.ndarray, honest: np.ndarray | None, ctx: AttackContext) -> np.ndarray:
        """Malicious gradients.

        Parameters
        ----------
        byz : ndarray, shape (b, d)
            Gradients the Byzantine clients computed honestly on their own data.
        honest : ndarray, shape (h, d), or None
            Honest gradients of the round; used only when ``knowledge == "omniscient"``.
        ctx : AttackContext

        Returns
        -------
        ndarray, shape (b, d), dtype of ``byz``
        """
        byz = np.asarray(byz)
        if byz.ndim != 2 or byz.shape[0] < 1 or not np.issubdtype(byz.dtype, np.floating):
            raise ValueError(
                f"attack {self.name}: byz must be a float (b, d) array with b >= 1, got {byz.dtype} {byz.shape}"
            )
        if self.knowledge == "omniscient":
            if honest is None:
                raise ValueError(f"attack {self.name} is omniscient: it needs the honest gradients")
            honest = np.asarray(honest)
            if honest.ndim != 2 or honest.shape[1] != byz.shape[1] or honest.shape[0] < 1:
                raise ValueError(
                    f"attack {self.name}: honest must be (h, {byz.shape[1]}) with h >= 1, got {honest.shape}"
                )
            if not self.blockwise:
                honest = honest.astype(np.float64, copy=False)
        else:
            honest = None
        self.require(ctx.n, byz.shape[0], ctx.f)
        out = self.craft(byz if self.blockwise else byz.astype(np.float64, copy=False), honest, ctx)
        if isinstance(out, np.ndarray) and out.dtype == byz.dtype and out.base is None and out is not byz:
            return out  # crafted into a fresh array of its own (:func:`by_columns`): no second copy
        return np.array(out, dtype=byz.dtype)  # a fresh writable (b, d) array, never a view

    def check(self, n: int, b: int, f: int | None = None) -> ConfigError | None:
        """Why the attack is undefined for n clients, b of them Byzantine, f declared to the defence
        (default b): the :class:`ConfigError` naming the setting to change (not raised), or None.

        A :class:`ConfigError` rather than a bare reason (as :meth:`fedring.aggregators.Aggregator.check`
        returns) since the reasons name different settings (``attack.variant``, ``attack.z`` ...).
        """
        return None

    def require(self, n: int, b: int, f: int | None = None) -> None:
        """Raise :meth:`check`'s error, if any. Called by :meth:`__call__`; the caller may call it
        once before training starts so a bad setting fails before any work."""
        error = self.check(n, b, f)
        if error is not None:
            raise error

    def craft(self, byz: np.ndarray, honest: np.ndarray | None, ctx: AttackContext) -> np.ndarray:
        raise NotImplementedError


@ATTACKS.base
class DataAttack:
    """Base of the data-poisoning attacks: they change the Byzantine clients' batches.

    ``scale`` multiplies the gradient the client then computes (1 unless the attack replaces
    the model, as the backdoor does). ``takes_text``: whether it applies to a text data set's
    samples (int64 token sequences, ``Dataset.shape`` of one entry); a run refuses an attack that
    does not before any work.
    """

    name: ClassVar[str]
    knowledge: ClassVar[str] = "own"
    takes_text: ClassVar[bool] = True
    scale: float = 1.0

    def poison(self, x: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    #: whether each Byzantine client keeps a row across rounds (the ``memory`` of :meth:`release`,
    #: NaN until first written), checkpointed with the clients' optimizer rows so it survives --resume
    remembers: ClassVar[bool] = False

    def attacker(self, index: int) -> DataAttack:
        """The attack as the ``index``-th Byzantine client (0, 1, ... in the order of client ids)
        runs it: the attack itself, unless each attacker has a variant of its own (DBA)."""
        return self

    def release(
        self, upload: np.ndarray, lr: float, w: np.ndarray | None = None, memory: np.ndarray | None = None
    ) -> None:
        """Change a Byzantine client's float32 upload in place before it is multiplied by ``scale``
        (nothing by default). ``lr``: the round's learning rate; for an attack that ``remembers``,
        ``w`` is the global model the client trained from (host float32) and ``memory`` its row."""


def known(honest: np.ndarray | None) -> np.ndarray:
    """The honest gradients in :meth:`ModelAttack.craft` of an attack that is omniscient (as
    configured): :meth:`ModelAttack.__call__` has checked that they are there."""
    if honest is None:
        raise ValueError("an omniscient attack was called without the honest gradients")
    return honest


#: columns per block of the attacks' float64 arithmetic: 100 rows of 4,096 float64 are 3.2 MiB
BLOCK = 1 << 12


def column_blocks(d: int, block: int | None = None) -> list[slice]:
    """Slices of ``block`` (default :data:`BLOCK`) columns that cover ``range(d)``.

    numpy reduces every column of a C-contiguous (h, w) array along axis 0 one row after
    another whatever w >= 2, so a column's sum, mean, standard deviation ... is the same bit for
    bit in a block as in the whole array. A single column (w = 1) is summed pairwise instead, in
    another order, so a last block of one column joins the one before.
    """
    block = block or BLOCK
    starts = list(range(0, d, block))
    if len(starts) > 1 and d - starts[-1] == 1:
        starts.pop()
    return [slice(lo, hi) for lo, hi in zip(starts, [*starts[1:], d])]


def columns(fn: Callable[[np.ndarray], np.ndarray], *rows: np.ndarray, block: int | None = None) -> np.ndarray:
    """``fn`` of the float64 rows, computed one column block at a time.

    ``fn`` maps an (m, w) float64 block (the blocks of ``rows`` stacked in the given order, cast
    to float64) to its w per-column values, reducing along axis 0; the values are those of ``fn``
    on the whole float64 array (:func:`column_blocks`), and no more than one block is ever in
    float64.

    Examples
    --------
    >>> import numpy as np
    >>> columns(lambda x: x.sum(axis=0), np.ones((2, 5), np.float32), np.eye(5)[:1], block=2)
    array([3., 2., 2., 2., 2.])
    """
    return np.concatenate(
        [fn(np.concatenate([r[:, c] for r in rows], dtype=np.float64)) for c in column_blocks(rows[0].shape[1], block)]
    )


def mean(rows: np.ndarray) -> np.ndarray:
    """Coordinate-wise float64 mean, ``rows.astype(np.float64).mean(axis=0)`` bit for bit, in blocks."""
    return columns(lambda x: x.mean(axis=0), rows)


def column_sum(rows: np.ndarray) -> np.ndarray:
    """Coordinate-wise float64 sum, ``rows.astype(np.float64).sum(axis=0)`` bit for bit, in blocks."""
    return columns(lambda x: x.sum(axis=0), rows)


#: columns per block of the sums over every column (Gram matrices, products with a d-vector):
#: 100 float64 rows of 2^18 columns are 200 MiB. Up to this many columns there is one block.
GRAM_BLOCK = 1 << 18


def row_products(
    rows: np.ndarray, fn: Callable[[slice, np.ndarray], tuple[np.ndarray, ...]], block: int | None = None
) -> tuple[np.ndarray, ...]:
    """The sums over all columns that ``fn`` takes of one block, added up block by block.

    ``fn(c, x)`` gets the columns ``c`` of ``rows`` as a fresh C-contiguous float64 array ``x``
    (its own, to centre in place) and returns arrays that sum over those columns: x xᵀ, x v[c],
    row norms ... The result is their sum over the blocks of :data:`GRAM_BLOCK` columns, in
    column order, with never more than one block in float64. Up to ``GRAM_BLOCK`` columns that
    is ``fn`` of the whole float64 array, bit for bit; above, the blocks' partial sums are added
    in another order than one product over all d columns would take, so the sums may differ in
    their last bits (docs/attacks.md, "Memory: float64 arithmetic in column blocks").

    Examples
    --------
    >>> import numpy as np
    >>> x = np.arange(6, dtype=np.float32).reshape(2, 3)
    >>> row_products(x, lambda c, b: (b @ b.T, b.sum(axis=1)), block=2)
    (array([[ 5., 14.],
           [14., 50.]]), array([ 3., 12.]))
    """
    total: tuple[np.ndarray, ...] = ()
    for c in column_blocks(rows.shape[1], block or GRAM_BLOCK):
        part = fn(c, np.array(rows[:, c], dtype=np.float64, order="C"))
        total = part if not total else tuple(t + p for t, p in zip(total, part))
    return total


def squared_distances(gram: np.ndarray) -> np.ndarray:
    """Squared distances between rows from their Gram matrix (ties and round-off clipped at 0)."""
    sq = np.diag(gram)
    return np.maximum(sq[:, None] + sq[None, :] - 2.0 * gram, 0.0)


def by_columns(shape: tuple[int, int], dtype, fill: Callable[[slice], np.ndarray]) -> np.ndarray:
    """Rows crafted one column block at a time: ``out[:, c] = fill(c)`` for each block ``c``.

    A coordinate-wise formula evaluated in float64 on one block and stored in ``dtype`` (the
    dtype of the Byzantine rows) gives the values the whole (b, d) float64 result would once
    cast, without that float64 result.
    """
    out = np.empty(shape, dtype)
    for c in column_blocks(shape[1]):
        out[:, c] = fill(c)
    return out


def need_rows(rows: np.ndarray, ddof: int, who: str) -> None:
    """Raise unless ``rows`` has more rows than ``ddof`` (a standard deviation is defined)."""
    if rows.shape[0] <= ddof:
        raise ValueError(
            f"{who}: a standard deviation with ddof={ddof} needs at least {ddof + 1} rows, got {rows.shape[0]}"
        )


def std(rows: np.ndarray, ddof: int, who: str, block: int | None = None) -> np.ndarray:
    """Coordinate-wise float64 standard deviation; needs more rows than ``ddof``.

    ``rows.astype(np.float64).std(axis=0, ddof=ddof)`` bit for bit, computed one column block at
    a time (:func:`columns`), so numpy's ``rows - mean`` temporary is (h, block), not another
    (h, d) array.
    """
    need_rows(rows, ddof, who)
    return columns(lambda x: x.std(axis=0, ddof=ddof), rows, block=block)
