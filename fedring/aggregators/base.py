"""The aggregator contract, the registry and parameter validation shared by every rule."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import numpy as np

from fedring.arrays import array_namespace, device, host, is_torch_array, like, on_host
from fedring.registry import Registry
from fedring.validate import integer

from ._blocks import Gram
from ._kernels import all_finite, gram, mean, nonfinite_rows
from .probe import Probe

#: the server rules and the pre-aggregators, by name (``python -m fedring run --help`` lists them)
AGGREGATORS = Registry("aggregator")
PRE_AGGREGATORS = Registry("pre-aggregator")
register = AGGREGATORS.register
register_pre = PRE_AGGREGATORS.register


class AggregateResult(NamedTuple):
    """What one aggregation call returns.

    vector : (d,) array of the input's kind (numpy, or a tensor on the rows' device) in the input
        dtype, always finite for finite input; the loop applies ``w <- w - lr * vector``.
    selected : (n,) float weights in [0, 1] (1 = kept / fully trusted) for rules that select
        or weight clients (``selects``), else None.
    excluded : (n,) bool, the rows left out because they held NaN or an infinity (None when
        every row was finite).
    """

    vector: Any
    selected: np.ndarray | None = None
    excluded: np.ndarray | None = None


def as_matrix(X: Any) -> Any:
    """(n, d) float32/float64 view of the client rows; other numeric types become float64.

    A torch tensor stays a tensor on its device (an integer or boolean one becomes float64 there).
    """
    if is_torch_array(X):
        if X.ndim != 2 or X.shape[0] < 1 or X.shape[1] < 1:
            raise ValueError(f"expected an (n, d) matrix of client vectors with n, d >= 1, got shape {tuple(X.shape)}")
        if not X.dtype.is_floating_point or X.dtype.itemsize < 4:
            if X.dtype.is_complex:
                raise ValueError(f"client vectors must be real, got dtype {X.dtype}")
            X = array_namespace(X).astype(X, array_namespace(X).float64)
        return X
    X = np.asarray(X)
    if X.ndim != 2 or X.shape[0] < 1 or X.shape[1] < 1:
        raise ValueError(f"expected an (n, d) matrix of client vectors with n, d >= 1, got shape {X.shape}")
    if X.dtype not in (np.float32, np.float64):
        if not (np.issubdtype(X.dtype, np.integer) or np.issubdtype(X.dtype, np.floating) or X.dtype == bool):
            raise ValueError(f"client vectors must be numeric, got dtype {X.dtype}")
        X = X.astype(np.float64)
    return X


def nonfinite_from_norms(X: Any, sq: np.ndarray) -> np.ndarray:
    """``nonfinite_rows(X)`` from the rows' float64 squared norms ``sq``, a pass a rule makes anyway.

    A row's squared norm is NaN or infinite when the row holds NaN or an infinity, and finite
    otherwise unless the squares overflow (float64 rows of norm above 1e154; never for float32
    rows), so only the rows with a non-finite ``sq`` are checked value by value.

    >>> X = np.array([[1.0, 2.0], [np.nan, 0.0], [1e200, 0.0], [-np.inf, 1.0]])
    >>> nonfinite_from_norms(X, np.array([5.0, np.nan, np.inf, np.inf])).tolist()
    [False, True, False, True]
    """
    excluded = ~np.isfinite(sq)
    if excluded.any():
        suspect = np.flatnonzero(excluded)
        excluded[suspect] = nonfinite_rows(X[suspect])
    return excluded


def checked_mean(X: Any) -> tuple[Any, np.ndarray | None]:
    """The rows' mean (``_kernels.mean``: the bits of ``X.mean(axis=0)``) and the non-finite rows
    found from it: None when every row is finite. A column's mean is finite only if the column
    is, so a finite mean needs no second pass over the rows; otherwise (a non-finite row, or
    finite rows whose sum overflowed) the rows are checked, and None again if all are finite.

    >>> checked_mean(np.array([[1.0, 2.0], [3.0, np.nan]]))[1].tolist()
    [False, True]
    """
    avg = mean(X)
    if all_finite(avg):
        return avg, None
    excluded = nonfinite_rows(X)
    return avg, excluded if excluded.any() else None


@AGGREGATORS.base
class Aggregator:
    """Base class of every server-side rule.

    Subclasses set ``name``, validate their parameters in ``__init__`` (keyword-only, each
    with its default) and implement ``_aggregate`` (or ``_aggregate_checked``, which also finds
    the non-finite rows). ``aggregate`` validates the input and calls ``check`` so a
    misconfigured rule fails before doing any work.

    Randomised rules draw only from the ``rng`` passed to ``aggregate``; without one they
    use a private ``numpy.random.Generator`` seeded with 0 at construction, so a run is
    reproducible either way.

    Rows on a device (a torch tensor) stay there when the rule is ``on_device``: its kernels run
    on the rows' device and ``vector`` is a tensor there, in the rows' dtype. A rule that is not
    copies the rows to the host once, runs on numpy and returns its vector on the rows' device.
    ``selected`` and ``excluded`` are numpy either way; the state starts as numpy arrays
    (``init_state``), and a device rule may move one to the rows' device for good (cclip's
    center), which a checkpoint then stores as a host copy.

    Non-finite input (every rule, the same policy): a row holding NaN or an infinity was
    sent by a Byzantine client (an honest gradient is finite), so it is left out before the
    rule runs, as if that client had not taken part in the round. The rule then aggregates
    the ``n' = n - e`` finite rows with ``f' = max(f - e, 0)`` declared Byzantine clients,
    since at most ``f - e`` Byzantine ones remain; per-client state (``client_state``) of
    the absent clients is left as it was. If no row is finite, or ``check(n')`` fails for
    the rule told ``f'`` (too few rows remain), the result is the zero vector (the model does
    not move that round) with every ``selected`` weight 0. ``AggregateResult.excluded``
    names the rows left out. So the output never depends on where a non-finite row sits,
    and is finite whenever the finite rows are.
    """

    # class defaults that an instance may override (a Pipeline takes its rule's, a parameter may turn one on)
    name: str = ""
    needs_reference: bool = False
    #: the rule inspects the round's model through a :class:`~fedring.aggregators.probe.Probe`
    needs_probe: bool = False
    #: the probe a rule that needs one was bound to (:meth:`with_probe`)
    probe: Probe | None = None
    #: the rule returns per-client ``selected`` weights
    selects: bool = False
    #: state arrays kept per client: name -> the axis that indexes clients
    client_state: Mapping[str, int] = {}
    #: the rule runs on the rows' device (else on a host copy of a tensor's rows)
    on_device: bool = False

    def __init__(self, f: int = 0):
        self.f = integer("f", f, lo=0)
        self._rng = np.random.default_rng(0)

    # ---- contract ----------------------------------------------------------------------

    def check(self, n: int) -> str | None:
        """None if ``n`` clients with the declared ``f`` can work, else the reason in words."""
        if n < 1:
            return f"{self.name} needs at least one client, got n={n}"
        return None

    def init_state(self, n: int, d: int) -> dict[str, np.ndarray]:
        """Explicit state of stateful rules: numpy arrays, which a device rule may later keep on its
        rows' device (a checkpoint stores host copies)."""
        return {}

    def reads(self) -> tuple[str, ...]:
        """The settings sections this rule reads: its own, and those of the components it builds
        (H+'s base rule); a run refuses settings in any other section."""
        return (self.name,)

    def with_f(self, f: int) -> Aggregator:
        """This rule told ``f`` declared Byzantine clients (a shallow copy; ``self`` if unchanged)."""
        if f == self.f:
            return self
        other = copy.copy(self)
        other.f = f
        return other

    def with_probe(self, probe: Probe) -> Aggregator:
        """This rule bound to the round's model ``probe`` (a shallow copy), for a rule that ``needs_probe``."""
        other = copy.copy(self)
        other.probe = probe
        return other

    def aggregate(
        self,
        X: Any,
        state: dict | None = None,
        reference: Any = None,
        rng: np.random.Generator | None = None,
        probe: Probe | None = None,
    ) -> AggregateResult:
        """The rule on the ``(n, d)`` rows ``X`` (class docstring); ``probe``, the round's model, is
        read by a rule that ``needs_probe`` (and ignored by the others)."""
        if self.needs_probe and probe is not None:
            return self.with_probe(probe).aggregate(X, state, reference, rng)
        X = as_matrix(X)
        if not (on_host(X) or self.on_device):  # one copy to the host, the vector back to the rows' device
            result = self.aggregate(host(X), state, host(reference) if is_torch_array(reference) else reference, rng)
            return result._replace(vector=like(result.vector, X))
        n, d = X.shape
        reason = self.check(n)
        if reason is not None:
            raise ValueError(f"{self.name}: {reason}")
        if reference is not None:
            if on_host(X):
                reference = np.asarray(host(reference) if is_torch_array(reference) else reference)
            else:
                reference = array_namespace(X).asarray(reference, device=device(X))
            if tuple(reference.shape) != (d,):
                raise ValueError(f"{self.name}: reference must have shape ({d},), got {tuple(reference.shape)}")
        elif self.needs_reference:
            raise ValueError(f"{self.name} needs the server's reference gradient (reference=...)")
        if self.needs_probe and self.probe is None:
            raise ValueError(f"{self.name} inspects the model and needs the round's probe of it (probe=...)")
        if state is None:
            state = self.init_state(n, d)
        rng = rng if rng is not None else self._rng
        checked = self._aggregate_checked(X, state, reference, rng)
        if not isinstance(checked, AggregateResult):
            return self._aggregate_finite_rows(X, checked, state, reference, rng)
        if on_host(X):
            vector = np.asarray(checked.vector, dtype=X.dtype)
        else:
            vector = array_namespace(X).asarray(checked.vector, dtype=X.dtype, device=device(X))
        selected = None if checked.selected is None else np.asarray(checked.selected, dtype=np.float64)
        return AggregateResult(vector, selected)

    def _aggregate_checked(
        self, X: Any, state: dict, reference, rng: np.random.Generator
    ) -> AggregateResult | np.ndarray:
        """``_aggregate`` on X when every row is finite, else the (n,) bool of the rows holding NaN or
        an infinity (``nonfinite_rows``), found before anything is drawn from ``rng`` or written to
        ``state``. A rule whose own first pass over X shows that every row is finite (row norms:
        :func:`nonfinite_from_norms`; column sums) overrides this to spare the separate pass."""
        excluded = nonfinite_rows(X)
        if excluded.any():
            return excluded
        return self._aggregate(X, state, reference, rng)

    def _aggregate_finite_rows(self, X, excluded, state, reference, rng) -> AggregateResult:
        """The non-finite policy (class docstring): the rule on the finite rows, told ``f - e``."""
        n, d = X.shape
        keep = np.flatnonzero(~excluded)
        rule = self.with_f(max(self.f - (n - keep.size), 0))
        selected = np.zeros(n) if self.selects else None
        if keep.size == 0 or rule.check(keep.size) is not None:
            return AggregateResult(array_namespace(X).zeros(d, dtype=X.dtype, device=device(X)), selected, excluded)
        result = self.aggregate_part(rule, X[keep], keep, state, reference, rng)
        if selected is not None:
            selected[keep] = result.selected
        return AggregateResult(result.vector, selected, excluded)

    def aggregate_part(self, rule: Aggregator, rows, keep: np.ndarray, state: dict, reference, rng) -> AggregateResult:
        """``rule`` (this rule, maybe told another ``f``) on ``rows``, the rows of the clients ``keep``
        (sorted ids) only: per-client state (``client_state``) of the other clients is left as it was.
        The non-finite policy and client sampling (``docs/training.md``) aggregate this way."""
        if all(state[k].shape[axis] == len(keep) for k, axis in self.client_state.items()):
            return rule.aggregate(rows, state=state, reference=reference, rng=rng)  # every client: no copies
        part = {**state, **{k: np.take(state[k], keep, axis=axis) for k, axis in self.client_state.items()}}
        result = rule.aggregate(rows, state=part, reference=reference, rng=rng)
        for key, value in part.items():
            if key in self.client_state:
                index: list[slice | np.ndarray] = [slice(None)] * value.ndim
                index[self.client_state[key]] = keep
                state[key][tuple(index)] = value
            else:
                state[key] = value
        return result

    def __call__(self, X: Any, **kw) -> Any:
        return self.aggregate(X, **kw).vector

    def _aggregate(self, X: Any, state: dict, reference, rng: np.random.Generator) -> AggregateResult:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(
            f"{k}={getattr(self, k)!r}" for k in AGGREGATORS.parameters(type(self), ("f",)) if hasattr(self, k)
        )
        return f"{type(self).__name__}(f={self.f}{', ' if args else ''}{args})"


class GramRule(Aggregator):
    """A rule whose first pass over the rows is their Gram matrix (:func:`._kernels.gram`), which
    it takes in ``_aggregate_gram``; the pass also shows which rows are finite.

    Row i's squared distance to the pivot, ``G.C[i, i]``, is a sum of squares: NaN or infinite
    when the row or the pivot holds NaN or an infinity, finite otherwise unless the squares
    overflow (float32 rows' are taken again in float64 by the pass; float64 entries above about
    1e154). So only the rows with a non-finite one are checked value by value
    (:func:`nonfinite_from_norms`), and the separate pass over the rows of
    ``Aggregator._aggregate_checked`` is spared. With a non-finite row the rule runs on the
    finite rows as every rule does, with their own Gram pass (another pivot): the same bits.
    """

    def first_gram(self, X: Any, state: dict, reference: Any) -> Gram | None:
        """The Gram pass the rule starts with on these rows, or None where it starts otherwise
        (Krum's is ``gram(X)``; a rule that adds rows to it, such as a center, says so here)."""
        return gram(X)

    def _aggregate_checked(self, X, state, reference, rng):
        G = self.first_gram(X, state, reference)
        if G is None:
            return super()._aggregate_checked(X, state, reference, rng)
        excluded = nonfinite_from_norms(X, np.diag(G.C)[: X.shape[0]])
        if excluded.any():
            return excluded
        return self._aggregate_gram(X, G, state, reference, rng)

    def _aggregate(self, X, state, reference, rng):
        return self._aggregate_gram(X, self.first_gram(X, state, reference), state, reference, rng)

    def _aggregate_gram(self, X: Any, G: Gram | None, state: dict, reference, rng) -> AggregateResult:
        raise NotImplementedError


class SortedRule(Aggregator):
    """A coordinate-wise rule whose pass reads sorted columns (``_kernels.for_sorted_rows``): the
    median, the trimmed mean, Meamed.

    The check for non-finite rows rides on that pass (each block's row sums as the sort loads it),
    and the separate pass over the rows of ``Aggregator._aggregate_checked`` is spared. Where the
    rule sorts nothing at n (``sorts``: nothing trimmed), it is the plain mean, checked as
    :class:`.coordinatewise.Mean` checks it (:func:`checked_mean`).
    """

    def sorts(self, n: int) -> bool:
        """Whether the rule reads sorted columns at n clients (else it is the mean)."""
        return True

    def _aggregate_checked(self, X, state, reference, rng):
        if self.sorts(X.shape[0]):
            out, bad = self._sorted(X, check=True)
        else:
            out, bad = checked_mean(X)
        return bad if bad is not None and bad.any() else AggregateResult(out)

    def _aggregate(self, X, state, reference, rng):
        if not self.sorts(X.shape[0]):
            return AggregateResult(mean(X))
        return AggregateResult(self._sorted(X, check=False)[0])

    def _sorted(self, X: Any, check: bool) -> tuple[Any, np.ndarray | None]:
        """The aggregate, from ``for_sorted_rows(..., check=check)``, and what that returns: with
        ``check``, the (n,) bool of the rows holding NaN or an infinity (then the aggregate is void),
        else None."""
        raise NotImplementedError


@PRE_AGGREGATORS.base
class PreAggregator:
    """A map from n client rows to m rows that composes in front of any rule.

    ``transform`` returns the new rows and, for each client, the output row it fed
    (``owner``), so the rule's per-row ``selected`` weights can be mapped back to clients.
    """

    name: ClassVar[str] = ""
    #: the output has one row per input row (so per-client state behind it stays aligned)
    keeps_rows: ClassVar[bool] = True
    #: ``transform`` runs on the rows' device (a Pipeline is on the device when all its stages are)
    on_device: ClassVar[bool] = False

    def __init__(self, f: int = 0):
        self.f = integer("f", f, lo=0)

    with_f = Aggregator.with_f

    def check(self, n: int) -> str | None:
        return None if n >= 1 else f"{self.name} needs at least one client, got n={n}"

    def out_rows(self, n: int) -> int:
        return n

    def transform(self, X: Any, rng: np.random.Generator) -> tuple[Any, np.ndarray]:
        raise NotImplementedError

    def then_checked(
        self, rule: Aggregator, X: Any, state: dict, reference, rng
    ) -> AggregateResult | np.ndarray | None:
        """``rule`` on ``transform(X)`` with the non-finite check of ``Aggregator._aggregate_checked``
        on X read off a pass the stage makes anyway (or without materialising those rows), and
        ``selected`` per client; None where this stage has no such path for ``rule`` (a Pipeline
        of this stage and ``rule`` then runs both)."""
        return None
