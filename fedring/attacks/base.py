"""The attack interface: the context an attack sees, the two attack kinds, parameter checks.

An attack is a small callable, as in ByzFL, stateless but for Neurotoxin's and 3DFed's memory
(checkpointed). A *model* attack replaces the gradients of the Byzantine clients after they
computed them honestly on their own data; a *data* attack changes the training batch of each
Byzantine client before it computes its gradient.

What an attack may know is part of its definition (``knowledge``):

* ``"own"``: each attacker its own data and gradient only;
* ``"collusion"``: every Byzantine client's pre-attack gradient;
* ``"omniscient"``: the honest clients' gradients of the round too.

The caller passes honest gradients only to omniscient attacks, and :meth:`ModelAttack.__call__`
drops them otherwise, so an attack cannot use more than it declares.

Rows may be numpy arrays (the host) or torch tensors (a device, docs/arrays.md): an attack with
``on_device = True`` computes through the array's namespace, the others run on a host copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from fedring.aggregators.probe import OutputLayer
from fedring.arrays import Array, array_namespace, device, host, like, on_host
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
        The defence's rule ``(n, d) -> (d,)``, for aggregator-aware attacks; it receives rows of
        the kind the attack was given (a tensor on a device) and returns a vector of that kind.
    aggregator_name : str
        Its name, for messages.
    model : ModelAccess or None
        For an attack that trains models itself (``needs_model``): the attacker's copy of the
        model and its data, on rank 0; None for the others.
    """

    rng: np.random.Generator
    n: int
    f: int
    lr: float
    round: int
    aggregator: Callable[[Array], Array] | None
    aggregator_name: str = ""
    model: ModelAccess | None = None


@dataclass
class ModelAccess:
    r"""What an attack that trains models itself (a :class:`ModelAttack` with ``needs_model``) gets on
    rank 0 each round: its own copy of the run's model, the first Byzantine client's shard, and the
    places of the layers it reads in the flat weights (``fedring.train.attacker`` builds it; nothing
    here imports torch). Every vector is a host float32 array.

    Attributes
    ----------
    w : ndarray, shape (d,)
        The round's global weights (read only).
    lr : float
        The round's learning rate, rounded to float32.
    steps : int
        The run's local steps per client.
    batches : iterator of (x, y)
        The attacker's clean mini-batches of the round, endless (further passes over its shard).
    shard_batches : callable ``() -> iterator of (x, y)``
        One pass over the whole shard in mini-batches, in order.
    gradient : callable ``(w, x, y) -> (g, loss)``
        The mean cross-entropy's gradient on ``(x, y)`` at ``w`` (no clipping or weight decay): a
        fresh array, and the loss.
    curvature : callable ``(w, x, y) -> h``
        :math:`h_j = \partial_{w_j} \sum_{i \in I} \partial_{w_i} L` for the positions ``j`` of
        ``indicator_layer`` (``I`` the same positions): a float64 array of that layer's size.
    indicator_layer, decoy_layer : slice
        The last convolution's weight (else the first weight matrix), and the weight matrix before
        the output layer (else the output layer's weight).
    output_layer : fedring.aggregators.probe.OutputLayer
    """

    w: np.ndarray
    lr: float
    steps: int
    batches: Iterator[tuple[np.ndarray, np.ndarray]]
    shard_batches: Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]]
    gradient: Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, float]]
    curvature: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
    indicator_layer: slice
    decoy_layer: slice
    output_layer: OutputLayer


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

    An attack with ``on_device = True`` writes :meth:`craft` through the namespace of its rows
    (``array_namespace``; numpy's own functions on numpy rows, so the host path keeps its bits)
    and receives torch tensors as they are; the helpers here take either kind. Its random
    draws stay numpy ``Generator`` draws (the same numbers on both paths), moved to the rows'
    device with :func:`fedring.arrays.like`; the small h x h problems (Gram matrices, searches
    over a scalar) run on the host.
    """

    name: ClassVar[str]
    knowledge: str = "own"
    blockwise: ClassVar[bool] = False
    #: whether :meth:`craft` trains models itself: it then gets ``ctx.model`` (:class:`ModelAccess`)
    needs_model: ClassVar[bool] = False
    #: whether :meth:`craft` computes on torch tensors through their namespace (docs/arrays.md); an
    #: attack without it gets a host copy of tensor rows and its rows go back to their device
    on_device: ClassVar[bool] = False

    def __call__(self, byz: Array, honest: Array | None, ctx: AttackContext) -> Array:
        """Malicious gradients.

        Parameters
        ----------
        byz : ndarray or tensor, shape (b, d)
            Gradients the Byzantine clients computed honestly on their own data.
        honest : ndarray or tensor, shape (h, d), or None
            Honest gradients of the round (the kind of ``byz``); used only when
            ``knowledge == "omniscient"``.
        ctx : AttackContext

        Returns
        -------
        ndarray or tensor, shape (b, d): the kind, device and dtype of ``byz``
        """
        if not on_host(byz):
            return self._on_tensors(byz, honest, ctx)
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

    def _on_tensors(self, byz: Array, honest: Array | None, ctx: AttackContext) -> Array:
        """:meth:`__call__` on tensors: the same checks, then :meth:`craft` on the tensors
        (``on_device``) or on one host copy, whose rows go back to the device of ``byz``."""
        xp = array_namespace(byz)
        if byz.ndim != 2 or byz.shape[0] < 1 or not xp.isdtype(byz.dtype, "real floating"):
            raise ValueError(
                f"attack {self.name}: byz must be a float (b, d) array with b >= 1, got {byz.dtype} {tuple(byz.shape)}"
            )
        if self.knowledge != "omniscient":
            honest = None
        elif honest is None:
            raise ValueError(f"attack {self.name} is omniscient: it needs the honest gradients")
        elif honest.ndim != 2 or honest.shape[1] != byz.shape[1] or honest.shape[0] < 1:
            raise ValueError(
                f"attack {self.name}: honest must be (h, {byz.shape[1]}) with h >= 1, got {tuple(honest.shape)}"
            )
        if not self.on_device:
            return like(self(host(byz), None if honest is None else host(honest), ctx), byz)
        if not self.blockwise and honest is not None:
            honest = xp.astype(honest, xp.float64, copy=False)
        self.require(ctx.n, byz.shape[0], ctx.f)
        out = self.craft(byz if self.blockwise else xp.astype(byz, xp.float64, copy=False), honest, ctx)
        if out.dtype == byz.dtype and out is not byz and out._base is None and out.is_contiguous():
            return out  # a fresh tensor of its own (:func:`by_columns`), as on the host
        rows = xp.empty(byz.shape, dtype=byz.dtype, device=device(byz))
        rows[...] = out  # broadcast and cast into a fresh (b, d) tensor, never a view
        return rows

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

    def craft(self, byz: Array, honest: Array | None, ctx: AttackContext) -> Array:
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

    #: whether the attack runs a poisoned client's local steps itself (:meth:`local_steps`) instead of
    #: the client's loop over poisoned batches (:meth:`poison` is then not called on its batches)
    owns_steps: ClassVar[bool] = False

    def local_steps(self, run: LocalRun) -> np.ndarray:
        """A poisoned client's local training of one round, for an attack that ``owns_steps``: its final
        local weights (host float32, length d), from which the client uploads ``(run.w - w) / run.lr``
        (then :meth:`release` and ``scale`` as for any data attack)."""
        raise NotImplementedError(f"attack {self.name} does not run the local steps")


@dataclass(frozen=True)
class LocalRun:
    """What a data attack that runs a poisoned client's local steps (:meth:`DataAttack.local_steps`)
    gets: that one client's round, every vector a host float32 array.

    Attributes
    ----------
    w : ndarray, shape (d,)
        The global weights the round starts from (read only).
    batches : iterator of (x, y)
        The client's clean mini-batches of the round, endless: the first ``steps`` are those it
        would train on as an honest client, and later ones continue the same draws (further
        passes over its shard).
    samples : (ndarray, ndarray)
        The client's training samples and labels (its whole shard, read only).
    gradient : callable ``(w, x, y) -> (g, loss)``
        The mean cross-entropy's gradient on the batch ``(x, y)`` at the weights ``w``, clipped and
        decayed as an honest client's (``clip_norm``, ``weight_decay``): a fresh array, and the loss.
    lr : float
        The round's learning rate, rounded to float32 (an SGD step is ``w - lr * g``).
    steps : int
        The run's local steps per client (``local_steps``, or ``local_epochs`` passes).
    """

    w: np.ndarray
    batches: Iterator[tuple[np.ndarray, np.ndarray]]
    samples: tuple[np.ndarray, np.ndarray]
    gradient: Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, float]]
    lr: float
    steps: int


def known(honest: Array | None) -> Array:
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


def float64_rows(*rows: Array, c: slice = slice(None)) -> Array:
    """The columns ``c`` of ``rows`` stacked in the given order, as a fresh float64 array of their kind."""
    if on_host(rows[0]):
        return np.concatenate([r[:, c] for r in rows], dtype=np.float64)
    xp = array_namespace(rows[0])
    return xp.concat([xp.astype(r[:, c], xp.float64) for r in rows], axis=0)


def columns(fn: Callable[[Array], Array], *rows: Array, block: int | None = None) -> Array:
    """``fn`` of the float64 rows, computed one column block at a time.

    ``fn`` maps an (m, w) float64 block (the blocks of ``rows`` stacked in the given order, cast
    to float64) to its w per-column values, reducing along axis 0; the values are those of ``fn``
    on the whole float64 array (:func:`column_blocks`), and no more than one block is ever in
    float64. Tensors give a tensor on their device.

    Examples
    --------
    >>> import numpy as np
    >>> columns(lambda x: x.sum(axis=0), np.ones((2, 5), np.float32), np.eye(5)[:1], block=2)
    array([3., 2., 2., 2., 2.])
    """
    parts = [fn(float64_rows(*rows, c=c)) for c in column_blocks(rows[0].shape[1], block)]
    return np.concatenate(parts) if on_host(rows[0]) else array_namespace(rows[0]).concat(parts)


def mean(rows: Array) -> Array:
    """Coordinate-wise float64 mean, ``rows.astype(np.float64).mean(axis=0)`` bit for bit, in blocks."""
    xp = array_namespace(rows)
    return columns(lambda x: xp.mean(x, axis=0), rows)


def column_sum(rows: Array) -> Array:
    """Coordinate-wise float64 sum, ``rows.astype(np.float64).sum(axis=0)`` bit for bit, in blocks."""
    xp = array_namespace(rows)
    return columns(lambda x: xp.sum(x, axis=0), rows)


#: columns per block of the sums over every column (Gram matrices, products with a d-vector):
#: 100 float64 rows of 2^18 columns are 200 MiB. Up to this many columns there is one block.
GRAM_BLOCK = 1 << 18


def row_products(
    rows: Array, fn: Callable[[slice, Array], tuple[Array, ...]], block: int | None = None
) -> tuple[np.ndarray, ...]:
    """The sums over all columns that ``fn`` takes of one block, added up block by block.

    ``fn(c, x)`` gets the columns ``c`` of ``rows`` as a fresh C-contiguous float64 array ``x``
    (its own, to centre in place) and returns arrays that sum over those columns: x xᵀ, x v[c],
    row norms ... The result is their sum over the blocks of :data:`GRAM_BLOCK` columns, in
    column order, with never more than one block in float64. Up to ``GRAM_BLOCK`` columns that
    is ``fn`` of the whole float64 array, bit for bit; above, the blocks' partial sums are added
    in another order than one product over all d columns would take, so the sums may differ in
    their last bits (docs/attacks.md, "Memory: float64 arithmetic in column blocks"). Tensor
    rows are multiplied on their device; the sums, a few numbers per row, come back as numpy
    arrays either way.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.arange(6, dtype=np.float32).reshape(2, 3)
    >>> row_products(x, lambda c, b: (b @ b.T, b.sum(axis=1)), block=2)
    (array([[ 5., 14.],
           [14., 50.]]), array([ 3., 12.]))
    """
    total: tuple[Array, ...] = ()
    for c in column_blocks(rows.shape[1], block or GRAM_BLOCK):
        x = np.array(rows[:, c], dtype=np.float64, order="C") if on_host(rows) else float64_rows(rows, c=c)
        part = fn(c, x)
        total = part if not total else tuple(t + p for t, p in zip(total, part))
    return tuple(host(t) for t in total)


def squared_distances(gram: np.ndarray) -> np.ndarray:
    """Squared distances between rows from their Gram matrix (ties and round-off clipped at 0)."""
    sq = np.diag(gram)
    return np.maximum(sq[:, None] + sq[None, :] - 2.0 * gram, 0.0)


def by_columns(like_rows: Array, fill: Callable[[slice], Array]) -> Array:
    """Rows of the shape, dtype, kind and device of ``like_rows`` (the Byzantine rows), crafted
    one column block at a time: ``out[:, c] = fill(c)`` for each block ``c``.

    A coordinate-wise formula evaluated in float64 on one block and stored in the rows' dtype
    gives the values the whole (b, d) float64 result would once cast, without that float64 result.
    """
    out = empty(like_rows)
    for c in column_blocks(like_rows.shape[1]):
        out[:, c] = fill(c)
    return out


def empty(like_rows: Array, shape: tuple[int, ...] | None = None, dtype: Any = None) -> Array:
    """An uninitialised array of the kind and device of ``like_rows``, by default its shape and dtype."""
    shape = like_rows.shape if shape is None else shape
    if on_host(like_rows):
        return np.empty(shape, like_rows.dtype if dtype is None else dtype)
    xp = array_namespace(like_rows)
    return xp.empty(shape, dtype=like_rows.dtype if dtype is None else dtype, device=device(like_rows))


def norm(v: Array) -> float:
    """The Euclidean norm of a vector of either kind (numpy's ``linalg.norm`` on the host)."""
    if on_host(v):
        return float(np.linalg.norm(v))
    return float(array_namespace(v).linalg.vector_norm(v))


def need_rows(rows: Array, ddof: int, who: str) -> None:
    """Raise unless ``rows`` has more rows than ``ddof`` (a standard deviation is defined)."""
    if rows.shape[0] <= ddof:
        raise ValueError(
            f"{who}: a standard deviation with ddof={ddof} needs at least {ddof + 1} rows, got {rows.shape[0]}"
        )


def std(rows: Array, ddof: int, who: str, block: int | None = None) -> Array:
    """Coordinate-wise float64 standard deviation; needs more rows than ``ddof``.

    ``rows.astype(np.float64).std(axis=0, ddof=ddof)`` bit for bit, computed one column block at
    a time (:func:`columns`), so numpy's ``rows - mean`` temporary is (h, block), not another
    (h, d) array.
    """
    need_rows(rows, ddof, who)
    xp = array_namespace(rows)
    return columns(lambda x: xp.std(x, axis=0, correction=ddof), rows, block=block)
