"""Algorithm 2 of Plassier et al. (ICML 2023), DP-FedCP, over a fedring Network; the baselines.

One batch of trials runs the protocol once, every trial, target agent, query label and DP
variant a column of the same messages. The calibration scores never leave their agent: the box
of Algorithm 2 says agents "compute & send" them, which would make the federated quantile
pointless and contradict the paper's promise that calibration data stay local, so only these
messages do (ledger phase in brackets; ``docs/labelshift.md``)::

    agents -> server   label counts of their calibration points, exact and/or
                       privatised (Algorithm 2)                              [labelshift/counts]
    server -> agents   the weights of eq. (10), per target                   [labelshift/weights]
    server -> agents   multinomial subsample sizes, per query label (eq. 5)  [labelshift/subsample]
    agents -> server   weight sums D_i of their subsets; the server forms
                       lambda (eq. 14)                                        [labelshift/weight-sums]
    server -> agents   sigma_g of every run of Algorithm 1                   [labelshift/noise-scale]
    Algorithm 1        q_t down, (Delta q, Delta qbar) up, T rounds           [labelshift/fedavgqe]
    server -> agents   the federated quantile Qhat of every run                [labelshift/fedavgqe-result]

The calibration sizes ``N^i`` are public (the server needs them for the multinomial).

The baselines need every score in one place (that is what makes them baselines):
unweighted-local (the target's scores only), unweighted-global (eq. 2, all scores pooled),
oracle (the exact ratios ``w*`` over all points; the paper's eq. (86) for it is in a missing
appendix) and weighted (the exact eq. (8) threshold with the protocol's own weights and
subsample). The scores reach the server by :meth:`~fedring.comm.Network.sum_to_server`, a
measurement outside the protocol that the ledger does not count.

Random draws (:func:`fedring.rng.generator`, ``step`` = the trial): an agent's count noise
(``LS_COUNT_NOISE``), subsets (``LS_SUBSET``) and gradient noise (``LS_GRAD_NOISE``, ``extra =
(target, variant number)``) are keyed by the agent; the server's subsample sizes
(``LS_MULTINOMIAL``) and sampled agents (``LS_PARTICIPATION``, ``extra = (target, variant
number)``) are run-wide. Every row of :class:`.quantiles.AtomRows` depends on its own atoms
only, so the results are bit-identical on any number of ranks and for any batch size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from fedring.comm import Layout, Network
from fedring.conformal.split import check_alpha
from fedring.errors import ConfigError
from fedring.rng import Stream, generator
from fedring.validate import integer, real

from .experiments import sorted_agent
from .fedavgqe import dp_fedavgqe
from .privacy import epsilon_for_sigma, sigma_g_min
from .quantiles import AtomRows, label_shift_thresholds, unweighted_threshold
from .weights import (
    label_counts,
    local_measure,
    mle_weights,
    oracle_weights,
    privatise_counts,
    query_decomposition,
    select_subset,
    subsample_sizes,
)

METHODS = ("unweighted-local", "unweighted-global", "oracle", "weighted", "nonprivate", "dp")
BASELINES = METHODS[:4]
#: without --epsilon or --sigma-g, dp runs with the smallest noise of the paper's DP experiment (Fig. 3b)
DEFAULT_SIGMA_G = 10.0


@dataclass(frozen=True)
class Variant:
    """One federated variant: Algorithm 1 for every trial, target and query label.

    ``number`` keys its random draws: 0 for ``nonprivate``, ``1, 2, ...`` for the ``dp`` settings
    in order (so adding or dropping ``nonprivate`` leaves the ``dp`` results alone).
    """

    name: str  # "nonprivate", "dp-eps=1", "dp-sigma=10"
    number: int
    noisy_counts: bool  # weights from the privatised label counts
    noise_set_by: str  # "sigma_g" (value is sigma_g) or "epsilon" (Theorem 4.4 sets sigma_g)
    value: float


def variants(
    methods: Sequence[str], epsilon: Sequence[float] = (), sigma_g: Sequence[float] = (), count_noise: float = 0.0
) -> list[Variant]:
    """The federated variants the methods ask for: ``nonprivate``, then one ``dp`` variant per
    epsilon and per sigma_g value (``sigma_g = 10`` when neither is given).

    >>> [v.name for v in variants(["weighted", "nonprivate", "dp"], epsilon=[1.0], sigma_g=[0.5])]
    ['nonprivate', 'dp-eps=1', 'dp-sigma=0.5']
    """
    out = [Variant("nonprivate", 0, False, "sigma_g", 0.0)] if "nonprivate" in methods else []
    if "dp" in methods:
        dp = [("epsilon", float(e)) for e in epsilon] + [("sigma_g", float(s)) for s in sigma_g]
        for j, (kind, value) in enumerate(dp or [("sigma_g", DEFAULT_SIGMA_G)]):
            label = f"dp-{'eps' if kind == 'epsilon' else 'sigma'}={value:g}"
            out.append(Variant(label, j + 1, count_noise > 0, kind, value))
    return out


def check_numbers(prefix: str = "", **values) -> None:
    """Range checks of the protocol's numbers (those given), named ``prefix + name`` in errors."""
    for name, value in values.items():
        key = prefix + name
        if value is None:
            continue
        if name == "alpha":
            check_alpha(value, key)
        elif name == "gamma":
            real(key, value, lo=0, hi=1, lo_open=True)  # Theorem 4.1 assumes gamma <= 1
        elif name in ("eta", "temperature"):
            real(key, value, lo=0, lo_open=True)
        elif name == "delta":
            real(key, value, lo=0, hi=1, lo_open=True, hi_open=True)
        elif name == "count_noise":
            real(key, value, lo=0)
        elif name in ("rounds", "local_steps", "participants"):
            integer(key, value, lo=1)
        else:
            raise TypeError(f"no range check for {name}")


@dataclass(frozen=True)
class Plan:
    """What one protocol run computes: targets (0-based), baselines, variants and the numbers of
    Algorithms 1 and 2 (the task's settings of the same names; ``eta`` defaults to ``gamma / 10``,
    the largest step Theorem 4.1 allows, ``q0`` to ``1 - alpha``, ``participants`` to all)."""

    seed: int
    targets: tuple[int, ...]
    baselines: tuple[str, ...] = ()
    variants: tuple[Variant, ...] = ()
    alpha: float = 0.1
    delta: float = 1e-5
    count_noise: float = 0.0
    rounds: int = 1000
    local_steps: int = 10
    gamma: float = 0.01
    eta: float | None = None
    q0: float | None = None
    participants: int | None = None
    shared_subsample: bool = False

    def validate(self) -> Plan:
        """The plan itself, once its numbers are in range (else ConfigError)."""
        check_numbers(
            alpha=self.alpha,
            delta=self.delta,
            count_noise=self.count_noise,
            rounds=self.rounds,
            local_steps=self.local_steps,
            gamma=self.gamma,
            eta=self.eta,
            participants=self.participants,
        )
        return self


class Protocol:
    """One rank's share of Algorithm 2 (with Algorithm 1) and of the centralised baselines."""

    def __init__(self, plan: Plan, sizes: np.ndarray, n_classes: int, net: Network):
        self.plan, self.net, self.lay = plan, net, net.layout
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.n, self.c = self.sizes.size, n_classes
        self.n_total = int(self.sizes.sum())
        self.targets = list(plan.targets)
        self.server = self.lay.rank == 0
        self.local_clients = list(self.lay.local_clients)
        self.variants = list(plan.variants)
        # weight sources: 0 = exact label counts, 1 = privatised counts
        self.sources = sorted(
            {int(v.noisy_counts) for v in self.variants} | ({0} if "weighted" in plan.baselines else set())
        )
        self.participants = plan.participants or self.n
        self.eta = plan.eta if plan.eta is not None else plan.gamma / 10
        self.q0 = plan.q0 if plan.q0 is not None else 1 - plan.alpha

    # -- Algorithm 2 ---------------------------------------------------------------------------
    def calibrate(self, trials: list[int], local: dict) -> dict:
        """Weights, subsets and federated thresholds for ``trials``; ``local[i][b]`` is agent ``i``'s data.

        Every rank gets ``w_hat`` ({source: (B, targets, C)}) and its agents' ``selected`` masks;
        the server also ``lam`` ({source: (n, B, targets, C)}) and, per variant, ``fed_q``,
        ``fed_sigma``, ``fed_eps``, ``fed_lam_max`` (each ``(V, B, targets, C)``).
        """
        out: dict = {"w_hat": {}, "selected": None, "lam": {}}
        if not self.sources:
            return out
        out["w_hat"] = self._weights(trials, local)
        out["selected"] = self._subsets(trials, local)
        out["lam"] = self._mixture_weights(trials, local, out["w_hat"], out["selected"])
        if self.variants:
            out.update(self._federated_quantiles(trials, local, out["w_hat"], out["selected"], out["lam"]))
        return out

    def _weights(self, trials, local) -> dict:
        """Agents release their calibration label counts; the server applies eq. (10).

        Algorithm 2 counts training labels, which the paper's experiments do not have per
        agent; counting the calibration labels also makes eq. (10)'s mixture ``pi_i = N^i / N``,
        the one the theorems assume.
        """
        plan, c, b = self.plan, self.c, len(trials)
        counts = np.zeros((len(self.local_clients), len(self.sources), b, c), dtype=np.int64)
        for a, i in enumerate(self.local_clients):
            for bi, t in enumerate(trials):
                exact = label_counts(local[i][bi].labels, c)
                rng = generator(plan.seed, Stream.LS_COUNT_NOISE, client=i, step=t)
                noisy = privatise_counts(exact, plan.count_noise, rng)
                counts[a, :, bi] = [noisy if src else exact for src in self.sources]
        gathered = self.net.gather_to_server(counts.reshape(counts.shape[0], -1), "labelshift/counts")
        w = None
        if gathered is not None:  # on the server
            g = gathered.reshape(self.n, len(self.sources), b, c)
            w = np.array(
                [
                    [[mle_weights(g[:, si, bi], star) for star in self.targets] for bi in range(b)]
                    for si in range(len(self.sources))
                ]
            )
        shape = (len(self.sources), b, len(self.targets), c)
        w = self.net.broadcast_from_server(w, "labelshift/weights", shape, np.float64)
        return {src: w[si] for si, src in enumerate(self.sources)}

    def _subsets(self, trials, local) -> dict:
        """The server draws ``Nbar^i`` per trial and query label (eq. 5); agents pick ``J_i``.

        Algorithm 2 draws a fresh subsample for every query label (literally even for every
        test point); one draw per query label and trial, shared by the trial's test points, is
        the default, ``shared_subsample`` one draw per trial.
        """
        plan, c, b = self.plan, self.c, len(trials)
        nbar = None
        if self.server:
            per_trial = 1 if plan.shared_subsample else c
            draws = [
                subsample_sizes(self.sizes, generator(plan.seed, Stream.LS_MULTINOMIAL, step=t), per_trial)
                for t in trials
            ]
            nbar = np.array([np.repeat(d, c, axis=0) if plan.shared_subsample else d for d in draws])
        nbar = self.net.broadcast_from_server(nbar, "labelshift/subsample", (b, c, self.n), np.int64)
        selected: dict[int, list] = {}
        for i in self.local_clients:
            selected[i] = []
            for bi, t in enumerate(trials):
                rng = generator(plan.seed, Stream.LS_SUBSET, client=i, step=t)
                ni = local[i][bi].scores.size
                if plan.shared_subsample:
                    masks = np.repeat(select_subset(ni, nbar[bi, 0, i], rng)[None], c, axis=0)
                else:
                    masks = np.array([select_subset(ni, nbar[bi, y, i], rng) for y in range(c)]).reshape(c, ni)
                selected[i].append(masks)
        return selected

    def _mixture_weights(self, trials, local, w_hat, selected) -> dict:
        """Agents send ``D_i = sum_{k in J_i} w_hat[Y_k]``; the server forms ``lambda`` (eq. 14)."""
        b, n_tg = len(trials), len(self.targets)
        sums = np.zeros((len(self.local_clients), len(self.sources), b, n_tg, self.c))
        for a, i in enumerate(self.local_clients):
            for bi in range(b):
                lab, sel = local[i][bi].labels, selected[i][bi].astype(np.float64)
                for si, src in enumerate(self.sources):
                    sums[a, si, bi] = w_hat[src][bi][:, lab] @ sel.T  # (targets, query labels)
        gathered = self.net.gather_to_server(sums.reshape(sums.shape[0], -1), "labelshift/weight-sums")
        if gathered is None:  # not the server
            return {}
        g = gathered.reshape(self.n, len(self.sources), b, n_tg, self.c)
        return {src: query_decomposition(w_hat[src], self.sizes, g[:, si])[2] for si, src in enumerate(self.sources)}

    def _noise_scales(self, lam_all: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per instance: ``sigma_g`` and the epsilon Theorem 4.4 certifies (server side)."""
        plan = self.plan
        lam_max = lam_all.max(axis=0)
        sigma, eps = np.zeros(lam_max.shape), np.zeros(lam_max.shape)
        args = (plan.delta, plan.rounds, plan.local_steps, self.participants, self.n)
        for vi, v in enumerate(self.variants):
            for idx in np.ndindex(*lam_max.shape[1:]):
                lm = float(lam_max[(vi, *idx)])
                if v.noise_set_by == "epsilon":
                    sigma[(vi, *idx)] = sigma_g_min(v.value, *args, lm) if lm > 0 else 0.0
                    eps[(vi, *idx)] = v.value if lm > 0 else 0.0
                else:
                    sigma[(vi, *idx)] = v.value
                    eps[(vi, *idx)] = epsilon_for_sigma(v.value, *args, lm)
        return sigma, eps

    def _federated_quantiles(self, trials, local, w_hat, selected, lam) -> dict:
        """Algorithm 1 for every variant, trial, target and query label in one lock-step run."""
        plan, net = self.plan, self.net
        c, n_tg, b, n_v = self.c, len(self.targets), len(trials), len(self.variants)
        shape = (n_v, b, n_tg, c)
        n_q = int(np.prod(shape))
        lam_all: np.ndarray | None = None
        sigma: np.ndarray | None = None
        eps: np.ndarray | None = None
        if self.server:
            lam_all = np.stack([lam[int(v.noisy_counts)] for v in self.variants], axis=1)  # (n, V, B, targets, C)
            sigma, eps = self._noise_scales(lam_all)
        sigma = net.broadcast_from_server(sigma, "labelshift/noise-scale", shape, np.float64)

        values, weights = [], []
        for i in self.local_clients:
            for v in self.variants:
                src = int(v.noisy_counts)
                for bi in range(b):
                    d = local[i][bi]
                    for s in range(n_tg):
                        for y in range(c):
                            vals, wts, mass = local_measure(
                                d.scores,
                                d.labels,
                                selected[i][bi][y],
                                w_hat[src][bi, s],
                                y,
                                int(self.sizes[i]),
                                self.n_total,
                            )
                            values.append(vals)
                            weights.append(wts / mass if mass > 0 else np.zeros_like(wts))
        rows = AtomRows(values, weights, plan.alpha, plan.gamma)
        noise = self._noise(trials, sigma) if np.any(sigma > 0) else None
        participation = self._participation(trials) if self.participants < self.n and self.server else None
        q_hat = dp_fedavgqe(
            rows,
            None if lam_all is None else lam_all.reshape(self.n, n_q),
            q0=np.full(n_q, self.q0),
            rounds=plan.rounds,
            local_steps=plan.local_steps,
            eta=self.eta,
            noise=noise,
            participation=participation,
            net=net,
        )
        res: dict[str, np.ndarray | None] = {"fed_q": q_hat.reshape(shape)}
        if lam_all is not None:  # on the server
            res.update(fed_sigma=sigma, fed_eps=eps, fed_lam_max=lam_all.max(axis=0))
        return res

    def _noise(self, trials: list[int], sigma: np.ndarray):
        """``t -> (K, A, columns)``: this rank's agents' gradient noise in round ``t``, times ``sigma``.

        One generator per agent, variant, trial and target draws the noise of all ``C`` query
        labels, round after round; a variant without any noise in this batch draws nothing
        (its noise would be multiplied by 0), which changes no result.
        """
        plan, c, k = self.plan, self.c, self.plan.local_steps
        jobs = [
            (v, t, star) if np.any(sigma[vi] > 0) else None
            for vi, v in enumerate(self.variants)
            for t in trials
            for star in self.targets
        ]
        gens = [
            [
                None
                if job is None
                else generator(plan.seed, Stream.LS_GRAD_NOISE, client=i, step=job[1], extra=(job[2], job[0].number))
                for job in jobs
            ]
            for i in self.local_clients
        ]
        sig = sigma.reshape(-1)
        chunk, buf = 50, dict[int, np.ndarray]()

        def noise(t: int) -> np.ndarray:
            start = t - t % chunk
            if start not in buf:
                buf.clear()
                m = min(chunk, plan.rounds - start)
                buf[start] = np.array(
                    [[np.zeros((m, k, c)) if g is None else g.standard_normal((m, k, c)) for g in row] for row in gens]
                )
            z = buf[start][:, :, t - start]  # (A, jobs, K, C)
            return z.transpose(2, 0, 1, 3).reshape(k, len(gens), len(jobs) * c) * sig

        return noise

    def _participation(self, trials: list[int]):
        """``t -> (n, columns) bool``: the agents the server samples in round ``t``, per column."""
        plan, n, s = self.plan, self.n, self.participants
        gens = [
            generator(plan.seed, Stream.LS_PARTICIPATION, step=t, extra=(star, v.number))
            for v in self.variants
            for t in trials
            for star in self.targets
        ]

        def participation(t: int) -> np.ndarray:
            mask = np.zeros((n, len(gens)), dtype=bool)
            for j, g in enumerate(gens):
                mask[g.choice(n, size=s, replace=False), j] = True
            return np.repeat(mask, self.c, axis=1)

        return participation

    # -- centralised baselines -----------------------------------------------------------------
    def centralised(self, trials: list[int], local: dict, cal: dict, priors: np.ndarray | None) -> dict | None:
        """Thresholds that need every score on the server: the baselines, by their definition.

        Returns on the server ``{"thresholds": {method: (B, targets, C)}, "exact": {variant:
        (B, targets, C)}}``: the baselines asked for (oracle only with ``priors``) and, per
        variant, the exact ``Q_{1-alpha}(mu_y)`` of eq. (8) with its weights and subsample.
        """
        plan, c, b = self.plan, self.c, len(trials)
        width = max(int(self.sizes.max()), 1)
        sc = np.zeros((self.n, b, width))
        lb = np.zeros((self.n, b, width), dtype=np.int64)
        sel = np.zeros((self.n, b, c, width), dtype=np.uint8)
        for i in self.local_clients:  # each rank fills its agents' rows, zeros elsewhere: the sum is exact
            lb[i] = -1
            for bi in range(b):
                d = local[i][bi]
                sc[i, bi, : d.scores.size] = d.scores
                lb[i, bi, : d.scores.size] = d.labels
                if cal["selected"] is not None:
                    sel[i, bi, :, : d.scores.size] = cal["selected"][i][bi]
        g_sc, g_lb, g_sel = (self.net.sum_to_server(x) for x in (sc, lb, sel))
        if g_sc is None or g_lb is None or g_sel is None:  # not the server
            return None
        g_sel = g_sel.astype(bool)
        n_tg = len(self.targets)
        wanted = [m for m in BASELINES if m in plan.baselines and (m != "oracle" or priors is not None)]
        out = {m: np.zeros((b, n_tg, c)) for m in wanted}
        exact_by_src = {src: np.zeros((b, n_tg, c)) for src in self.sources}
        for bi in range(b):
            ok = g_lb[:, bi] >= 0
            all_sc, all_lb = g_sc[:, bi][ok], g_lb[:, bi][ok]
            for s, star in enumerate(self.targets):
                if "unweighted-local" in out:
                    out["unweighted-local"][bi, s] = unweighted_threshold(g_sc[star, bi][ok[star]], plan.alpha)
                if "unweighted-global" in out:
                    out["unweighted-global"][bi, s] = unweighted_threshold(all_sc, plan.alpha)
                if "oracle" in out:
                    assert priors is not None  # "oracle" is wanted only with priors
                    w_star = oracle_weights(priors, self.sizes, star)
                    out["oracle"][bi, s] = label_shift_thresholds(all_sc, all_lb, w_star, plan.alpha)
                for src in self.sources:
                    for y in range(c):
                        pick = ok & g_sel[:, bi, y]
                        exact_by_src[src][bi, s, y] = label_shift_thresholds(
                            g_sc[:, bi][pick], g_lb[:, bi][pick], cal["w_hat"][src][bi, s], plan.alpha
                        )[y]
        if "weighted" in out:
            out["weighted"] = exact_by_src[0]
        return {"thresholds": out, "exact": {v.name: exact_by_src[int(v.noisy_counts)] for v in self.variants}}

    # -- a batch of trials ---------------------------------------------------------------------
    def run_batch(self, exp, trials: list[int]) -> dict | None:
        """Collective: the agents' data drawn on their ranks, Algorithm 2, the baselines, and the
        evaluation on the server. Returns on the server, per method name (baselines, then the
        variants): ``threshold`` (B, targets, C), ``coverage`` and ``size`` (B, targets); per
        variant: ``exact_threshold``, ``sigma_g``, ``epsilon``, ``lambda_max`` (B, targets, C)."""
        local = {i: [exp.agent_data(t, i) for t in trials] for i in self.local_clients}
        cal = self.calibrate(trials, local)
        base = self.centralised(trials, local, cal, exp.priors)
        if base is None:  # not the server
            return None
        thresholds = dict(base["thresholds"])
        for vi, v in enumerate(self.variants):
            thresholds[v.name] = cal["fed_q"][vi]
        coverage, size = evaluate(exp, trials, self.targets, thresholds)
        out = {"threshold": thresholds, "coverage": coverage, "size": size, "exact_threshold": base["exact"]}
        for key, name in (("sigma_g", "fed_sigma"), ("epsilon", "fed_eps"), ("lambda_max", "fed_lam_max")):
            out[key] = {v.name: cal[name][vi] for vi, v in enumerate(self.variants)}
        return out


def evaluate(exp, trials: list[int], targets: list[int], thresholds: dict) -> tuple[dict, dict]:
    """Coverage and mean set size of each method on the target's test distribution (server).

    ``thresholds[method]`` is (B, targets, C); returns two ``{method: (B, targets)}``.
    """
    cov = {m: np.zeros((len(trials), len(targets))) for m in thresholds}
    size = {m: np.zeros((len(trials), len(targets))) for m in thresholds}
    for bi, t in enumerate(trials):
        for s, star in enumerate(targets):
            td = exp.test_data(t, star)
            for m, q in thresholds.items():
                inside = predict_sets(td.scores, q[bi, s])
                cov[m][bi, s] = float(td.weights @ inside[np.arange(td.labels.size), td.labels])
                size[m][bi, s] = float(td.weights @ inside.sum(axis=1))
    return cov, size


def predict_sets(scores: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Prediction sets ``{y : V(x, y) <= Q_y}`` as a boolean ``(m, C)`` mask (eq. 8 / Algorithm 2 output).

    >>> predict_sets(np.array([[0.1, 0.95], [0.5, 0.2]]), np.array([0.4, 0.9])).tolist()
    [[True, False], [False, True]]
    """
    return np.asarray(scores) <= np.asarray(thresholds)[None, :]


def dp_fedcp_thresholds(
    scores: Sequence[np.ndarray],
    labels: Sequence[np.ndarray],
    star: int,
    n_classes: int,
    *,
    alpha: float = 0.1,
    sigma_g: float = 0.0,
    epsilon: float | None = None,
    delta: float = 1e-5,
    count_noise: float = 0.0,
    rounds: int = 1000,
    local_steps: int = 10,
    gamma: float = 0.01,
    eta: float | None = None,
    q0: float | None = None,
    participants: int | None = None,
    shared_subsample: bool = False,
    seed: int = 0,
) -> dict:
    """DP-FedCP (Algorithm 2) on given calibration scores, all agents in this process.

    Parameters
    ----------
    scores, labels : one array per agent
        Agent ``i``'s calibration scores in [0, 1] (e.g. :func:`.scores.aps_scores`) and labels
        in ``[0, n_classes)``. Agents may be empty, except the target.
    star : int
        Target agent (0-based).
    sigma_g / epsilon
        Gradient noise of Algorithm 1, or the per-query epsilon from which Theorem 4.4 sets it.
    count_noise : float
        Discrete-Gaussian std on the released label counts (Algorithm 2).
    rounds, local_steps, gamma, eta, q0, participants, shared_subsample, seed
        As the ``conformal labelshift`` settings of the same names (trial 0 of seed ``seed``).

    Returns
    -------
    dict with ``threshold`` (C,): ``Qhat^gamma_{1-alpha,T}(mu_y)`` (predict with
    :func:`predict_sets`); ``exact_threshold`` (C,): ``Q_{1-alpha}(mu_y)`` of eq. (8) with the same
    weights and subsample; ``weights`` (C,): ``w_hat`` of eq. (10); ``lam`` (n, C); ``sigma_g`` (C,)
    and ``epsilon`` (C,): noise used and the epsilon per query Theorem 4.4 gives for ``delta``.
    """
    n = len(scores)
    if len(labels) != n or n == 0:
        raise ConfigError("scores", "need one scores array and one labels array per agent, at least one agent")
    if not 0 <= star < n:
        raise ConfigError("star", f"must be an agent index in [0, {n}), got {star}")
    local = {}
    for i in range(n):
        s, lab = np.asarray(scores[i], np.float64).reshape(-1), np.asarray(labels[i]).reshape(-1)
        if s.shape != lab.shape:
            raise ConfigError("labels", f"agent {i}: {s.size} scores but {lab.size} labels")
        if s.size and (np.isnan(s).any() or s.min() < 0 or s.max() > 1):
            raise ConfigError("scores", f"agent {i}: scores must lie in [0, 1] (the test atom sits at 1)")
        if lab.size and (lab.dtype.kind not in "iu" or lab.min() < 0 or lab.max() >= n_classes):
            raise ConfigError("labels", f"agent {i}: labels must be integers in [0, {n_classes})")
        local[i] = [sorted_agent(s, lab.astype(np.int64))]
    if local[star][0].scores.size == 0:
        raise ConfigError("star", f"target agent {star} has no calibration data: its label prior cannot be estimated")
    if epsilon is not None:
        real("epsilon", epsilon, lo=0, lo_open=True)
    else:
        real("sigma_g", sigma_g, lo=0)
    chosen = variants(
        ["dp"], [epsilon] if epsilon is not None else [], [] if epsilon is not None else [sigma_g], count_noise
    )
    plan = Plan(
        seed=seed,
        targets=(star,),
        variants=tuple(chosen),
        alpha=alpha,
        delta=delta,
        count_noise=count_noise,
        rounds=rounds,
        local_steps=local_steps,
        gamma=gamma,
        eta=eta,
        q0=q0,
        participants=participants,
        shared_subsample=shared_subsample,
    ).validate()
    sizes = np.array([local[i][0].scores.size for i in range(n)])
    net = Network(Layout(n, MPI.COMM_SELF))
    try:
        job = Protocol(plan, sizes, n_classes, net)
        cal = job.calibrate([0], local)
        base = job.centralised([0], local, cal, None)
    finally:
        net.comm.Free()
    assert base is not None  # one rank, the server
    v = chosen[0]
    src = int(v.noisy_counts)
    return {
        "threshold": cal["fed_q"][0, 0, 0],
        "exact_threshold": base["exact"][v.name][0, 0],
        "weights": cal["w_hat"][src][0, 0],
        "lam": cal["lam"][src][:, 0, 0],
        "sigma_g": cal["fed_sigma"][0, 0, 0],
        "epsilon": cal["fed_eps"][0, 0, 0],
    }
