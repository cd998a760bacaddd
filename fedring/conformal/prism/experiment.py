"""PRISM-FCP, Rob-FCP and FCP trials: one trial of every case with common random numbers, the
paper's tables, and the job that runs the trials (:class:`PrismJob`).

A trial builds one world (:mod:`.environment`), trains PSO-Fed once per distinct ``M``
(:mod:`.psofed`; every attack and method with that ``M`` shares the model), lets the
Byzantine clients report attacked scores once per attack (:mod:`.attacks`) and calibrates
each case over the network (:mod:`.calibration`). PRISM-FCP at ``M = D`` is therefore
Rob-FCP exactly, and the attacks of a row differ in the reported scores only. The model used
for calibration is the final global one, ``w_{N_iter}``. Coverage is measured by default on
the benign clients' test data (``coverage_on = "benign"``): their test points are drawn like
the benign calibration scores, so exchangeability holds up to the filter's choice of clients
and the per-client pooling, and the paper's trial-to-trial spread is reproduced; ``all``
evaluates every client's test data. ``docs/prism-fcp.md`` discusses both.
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from fedring.comm import Layout, Network
from fedring.config import Config
from fedring.conformal.split import split_conformal_quantile
from fedring.conformal.trials import TrialJob
from fedring.rng import Stream, generator

from .attacks import CalibrationAttack, RandomAttack, make_calib_attack
from .calibration import characterization_vectors, filter_clients
from .environment import Environment, environment
from .psofed import participants, sent_bytes, train_psofed
from .settings import TABLE_ATTACKS, ResolvedPrism

METHOD_LABEL = {"prism": "PRISM-FCP", "robfcp": "Rob-FCP", "fcp": "FCP"}

#: Table I of the paper (synthetic): (attack, method) -> (coverage %, std, width, std).
PAPER_TABLE_I = {
    ("efficiency", "prism"): (90.0, 0.1, 0.91, 0.13),
    ("efficiency", "robfcp"): (90.0, 0.1, 1.68, 0.28),
    ("efficiency", "fcp"): (87.5, 0.2, 1.58, 0.25),
    ("coverage", "prism"): (90.0, 0.1, 0.91, 0.13),
    ("coverage", "robfcp"): (90.0, 0.1, 1.68, 0.28),
    ("coverage", "fcp"): (100.0, 0.0, 7.67, 1.23),
    ("random", "prism"): (90.0, 0.1, 0.91, 0.13),
    ("random", "robfcp"): (90.0, 0.1, 1.68, 0.28),
    ("random", "fcp"): (91.9, 0.6, 1.87, 0.27),
}
PAPER_MSE_DB = {"prism": -26.4, "robfcp": -21.4}

#: Table II of the paper (UCI, widths in K): (attack, method, M) -> (coverage %, std, width, std).
PAPER_TABLE_II: dict[tuple[str, str, int], tuple[float, ...]] = {}
for _att, _rows in {
    "efficiency": [
        (20, 90.0, 0.1, 64.09, 1.25),
        (40, 90.0, 0.1, 66.43, 1.99),
        (60, 90.0, 0.2, 69.87, 2.81),
        (81, 90.0, 0.2, 74.33, 4.37),
        ("robfcp", 90.0, 0.2, 74.33, 4.37),
        ("fcp", 87.5, 0.2, 69.36, 4.10),
    ],
    "coverage": [
        (20, 90.0, 0.1, 64.09, 1.25),
        (40, 90.0, 0.1, 66.43, 1.99),
        (60, 90.0, 0.2, 69.87, 2.81),
        (81, 90.0, 0.2, 74.33, 4.37),
        ("robfcp", 90.0, 0.2, 74.33, 4.37),
        ("fcp", 100.0, 0.0, 364.98, 22.33),
    ],
    "random": [
        (20, 90.0, 0.1, 64.33, 1.28),
        (40, 90.0, 0.1, 66.66, 2.04),
        (60, 90.0, 0.2, 70.09, 2.86),
        (81, 90.0, 0.2, 74.52, 4.39),
        ("robfcp", 90.0, 0.2, 74.52, 4.39),
        ("fcp", 91.7, 0.3, 78.43, 4.17),
    ],
}.items():
    for _key, *_vals in _rows:
        _k = (_att, "prism", _key) if isinstance(_key, int) else (_att, str(_key), 81)
        PAPER_TABLE_II[_k] = tuple(_vals)


# ---- cases ------------------------------------------------------------------------------


def case(attack: str, method: str, shared: int, filter: str | None) -> dict:
    """One row of a table: calibration attack, method, ``M``, filter rule (None for FCP).

    >>> case("coverage", "prism", 15, "mad")["label"]
    'coverage/prism/mad/M=15'
    """
    rule = f"/{filter}" if filter and filter != "known" else ""
    return {
        "label": f"{attack}/{method}{rule}/M={shared}",
        "method": method,
        "attack": attack,
        "shared": shared,
        "filter": filter,
    }


def single_case(s: ResolvedPrism) -> dict:
    """The case of a run without ``--table``: its method, attack and filter; the baselines share fully."""
    shared = s.shared if s.method == "prism" else s.dim
    return case(s.calib_attack, s.method, shared, None if s.method == "fcp" else s.filter)


def table_cases(s: ResolvedPrism) -> list[dict]:
    """Table I (synthetic) or Table II (UCI) rows, plus PRISM-FCP with the MAD rule."""
    prism_ms = (s.shared,) if s.dataset == "synthetic" else (20, 40, 60, 81)
    cases = []
    for a in TABLE_ATTACKS:
        cases += [case(a, "prism", m, "known") for m in prism_ms]
        cases += [case(a, "robfcp", s.dim, "known"), case(a, "fcp", s.dim, None)]
        cases += [case(a, "prism", prism_ms[0], "mad")]
    return cases


# ---- one trial ----------------------------------------------------------------------------


def _scores(env: Environment, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eq. (7) on the hosted clients' calibration data, and the test residuals."""
    cal = np.abs(env.y_cal - np.einsum("kjd,d->kj", env.x_cal, w))
    test = np.abs(env.y_test - np.einsum("kjd,d->kj", env.x_test, w))
    return cal, test


def reported_scores(
    s: ResolvedPrism,
    env: Environment,
    cal: np.ndarray,
    attack: CalibrationAttack | None,
    seed: int,
    trial: int,
    net: Network,
) -> np.ndarray:
    """The scores the hosted clients report (Sec. II-E): the Byzantine ones' attacked.

    An omniscient attack learns the benign clients' mean score through the adversary's side
    channel (counted in the ledger, never in the protocol's bytes); the server adds the
    per-client sums in client order, so the mean does not depend on the number of ranks.
    """
    rep = cal.copy()
    if attack is None:
        return rep
    byz_local = env.is_byzantine[env.lo : env.hi]
    benign_mean = None
    if attack.knowledge == "omniscient":
        sums = np.zeros((2, s.clients))
        sums[0, env.lo : env.hi] = np.where(byz_local, 0.0, cal.sum(axis=1))
        sums[1, env.lo : env.hi] = np.where(byz_local, 0, cal.shape[1])
        total = net.sum_to_server(sums)
        mean = None if total is None else total[0].sum() / max(total[1].sum(), 1.0)
        benign_mean = float(net.broadcast_from_server(mean, "adversary", (1,), np.float64)[0])
    for j in np.flatnonzero(byz_local):
        rng = generator(seed, Stream.PRISM_CALIB_ATTACK, client=env.lo + int(j), step=trial)
        rep[j] = attack(rep[j : j + 1], rng, benign_mean)[0]
    return rep


def calibrate_case(
    s: ResolvedPrism, filter: str | None, env: Environment, rep: np.ndarray, net: Network
) -> tuple[float, np.ndarray]:
    """Server-side calibration of one case over the network: the threshold on every rank,
    the flagged clients (K,) on rank 0 (phases ``calib_up``, ``calib_down``)."""
    K = s.clients
    flagged = np.zeros(K, dtype=bool)
    if filter is not None:
        r_max = s.r_max
        if r_max is None:
            local_max = rep.max(axis=1, keepdims=True) if rep.shape[1] else np.zeros((rep.shape[0], 1))
            maxima = net.gather_to_server(local_max, "calib_up")
            top = None if maxima is None else maxima.max()  # maxima: on rank 0
            r_max = float(net.broadcast_from_server(top, "calib_down", (1,), np.float64)[0])
        v = net.gather_to_server(characterization_vectors(rep, r_max, s.bins), "calib_up")
        verdict = None
        if v is not None:  # rank 0
            flagged, _ = filter_clients(
                v, np.full(K, rep.shape[1] > 0), filter, s.byzantine, s.mad_scale, s.mad_threshold
            )
            verdict = flagged.astype(np.uint8)
        flagged = net.broadcast_from_server(verdict, "calib_down", (K,), np.uint8).astype(bool)
    kept = np.flatnonzero(~flagged)
    mine = kept[(kept >= env.lo) & (kept < env.hi)] - env.lo
    pool = net.gather_to_server(rep[mine], "calib_up", clients=kept)
    q = None if pool is None else split_conformal_quantile(pool, s.alpha)  # pool: on rank 0
    return float(net.broadcast_from_server(q, "calib_down", (1,), np.float64)[0]), flagged


def run_trial(
    s: ResolvedPrism,
    cases: list[dict],
    seed: int,
    trial: int,
    net: Network,
    data=None,
    attacks: dict[str, CalibrationAttack | None] | None = None,
) -> dict[str, np.ndarray] | None:
    """One trial of every case with common random numbers: one world; one training per
    distinct ``M``; per attack the reported scores; per case the calibration and metrics.

    ``attacks`` maps each case's attack name to the built attack (default: built from the
    settings' profile). Returns on rank 0 ``{field: (C,) array}`` with ``coverage``,
    ``size`` (the interval width, in Kelvin on UCI data), ``threshold``, ``mse_db``, ``tp``,
    ``fp``, the bytes of training and calibration, and ``flagged`` (C, K); None on the
    other ranks. The training "MSE" is the per-coordinate parameter error ``||w - w*||^2 /
    D`` on synthetic data (what matches the paper's reported widths), the test-set mean
    squared error in normalized units on UCI data (which has no ``w*``).
    """
    if attacks is None:
        attacks = {c["attack"]: make_calib_attack(c["attack"], s.attack_params(c["attack"])) for c in cases}
    lay = net.layout
    lo, hi, rank0 = lay.lo, lay.hi, lay.rank == 0
    env = environment(s, data, seed, trial, lo, hi)
    parts = participants(s, seed, trial)
    C, K = len(cases), s.clients
    evaluated = np.ones(hi - lo, dtype=bool) if s.coverage_on == "all" else ~env.is_byzantine[lo:hi]
    # per-client sums (each entry from one rank: the reduction is exact on any rank count)
    covered, sqerr, tested = np.zeros((C, K)), np.zeros((C, K)), np.zeros((1, K))
    tested[0, lo:hi] = evaluated * s.test_samples
    traffic = np.zeros((C, 4), np.int64)  # train up, train down, calibration up, down
    q = np.zeros(C)
    flags = np.zeros((C, K), dtype=bool)
    msd: dict[int, float] = {}
    for shared in sorted({c["shared"] for c in cases}):
        tr = train_psofed(s, env, shared, net, seed, trial, parts)
        if rank0 and env.w_star is not None:
            msd[shared] = float(((tr.w - env.w_star) ** 2).mean())
        before = sent_bytes(net)
        w = net.broadcast_from_server(tr.w, "calib_down", (s.dim,), np.float64)
        cal, test = _scores(env, w)
        model = np.subtract(sent_bytes(net), before)
        sq = np.where(evaluated, (test**2).sum(axis=1), 0.0)
        for attack_name in sorted({c["attack"] for c in cases if c["shared"] == shared}):
            rep = reported_scores(s, env, cal, attacks[attack_name], seed, trial, net)
            for ci, c in enumerate(cases):
                if c["shared"] != shared or c["attack"] != attack_name:
                    continue
                before = sent_bytes(net)
                q[ci], flags[ci] = calibrate_case(s, c["filter"], env, rep, net)
                calib = np.subtract(sent_bytes(net), before) + model
                covered[ci, lo:hi] = np.where(evaluated, (test <= q[ci]).sum(axis=1), 0)
                sqerr[ci, lo:hi] = sq
                traffic[ci] = (tr.bytes_up, tr.bytes_down, *calib)
    counts = net.sum_to_server(np.concatenate([covered, sqerr, tested]))
    traffic_sum = net.sum_to_server(traffic)
    if counts is None or traffic_sum is None:  # not rank 0
        return None
    covered, sqerr, n_tested = counts[:C].sum(axis=1), counts[C : 2 * C].sum(axis=1), counts[-1].sum()
    mse = np.array([msd[c["shared"]] for c in cases]) if env.w_star is not None else sqerr / n_tested
    with np.errstate(divide="ignore"):
        mse_db = 10 * np.log10(mse)
    byz = env.is_byzantine
    return {
        "coverage": covered / n_tested,
        "size": 2.0 * q * env.y_scale,
        "threshold": q,
        "mse_db": mse_db,
        "tp": (flags & byz).sum(axis=1),
        "fp": (flags & ~byz).sum(axis=1),
        "flagged": flags.astype(np.uint8),
        "bytes_train_up": traffic_sum[:, 0],
        "bytes_train_down": traffic_sum[:, 1],
        "bytes_calib_up": traffic_sum[:, 2],
        "bytes_calib_down": traffic_sum[:, 3],
    }


# ---- summaries ----------------------------------------------------------------------------


def _sd(x: np.ndarray) -> float:
    """The sample standard deviation over trials (ddof 1, as ``python -m analysis`` reports it)."""
    return float(np.std(x, ddof=1)) if len(x) > 1 else 0.0


def summarize(rows: dict[str, np.ndarray], cases: list[dict]) -> list[dict]:
    """Mean and sample standard deviation over trials per case (coverage in %; the MSE is
    averaged over trials, then put in dB)."""
    out = []
    for i, c in enumerate(cases):
        col = {k: np.asarray(v)[:, i] for k, v in rows.items() if k != "trial"}
        mse = float(np.mean(10.0 ** (col["mse_db"] / 10)))
        out.append(
            {
                "case": c,
                "trials": len(col["coverage"]),
                "coverage": 100 * col["coverage"].mean(),
                "coverage_std": 100 * _sd(col["coverage"]),
                "width": col["size"].mean(),
                "width_std": _sd(col["size"]),
                "mse_db": 10 * math.log10(mse) if mse > 0 else -math.inf,
                "tp": col["tp"].mean(),
                "fp": col["fp"].mean(),
                **{
                    k: col[k].mean()
                    for k in ("bytes_train_up", "bytes_train_down", "bytes_calib_up", "bytes_calib_down")
                },
            }
        )
    return out


def format_table(s: ResolvedPrism, summary: list[dict], seed: int, random_variance: float) -> str:
    """The paper's table layout, our numbers beside the paper's (``random_variance``: the
    random attack's sigma_C^2 the run used)."""
    synthetic = s.dataset == "synthetic"
    unit = "" if synthetic else " (K)"
    lines = []
    if synthetic:
        lines.append("TABLE I: Marginal coverage and average interval width under different Byzantine attacks")
        lines.append(f"(K={s.clients} clients, |S_B|={s.byzantine} Byzantine, D={s.dim}, alpha={s.alpha})")
    else:
        lines.append(
            f"TABLE II: Evaluation results on the UCI Superconductivity dataset with D={s.dim}"
            + ("  [STAND-IN data of the file's shape: compare structure, not values]" if s.standin else "")
        )
    trials = summary[0]["trials"] if summary else 0
    lines.append(
        f"profile {s.profile}: mu={s.step}, byz_persist={s.byz_persist}, local_updates={s.local_updates}, "
        f"sigma_C^2={random_variance:g}; {trials} trials, seed {seed}; "
        f"coverage on {s.coverage_on} clients' test data"
    )
    head = (
        f"{'Attack':<11}{'Method':<11}{'M/D':>5}  {'Coverage (%)':>13}  {'Interval Width' + unit:>18}"
        f"  | {'paper: Coverage':>15}  {'Width':>15}"
    )
    lines += [head, "-" * len(head)]
    last = None
    for row in summary:
        c = row["case"]
        if c["filter"] == "mad":
            continue
        paper = (
            PAPER_TABLE_I.get((c["attack"], c["method"]))
            if synthetic
            else PAPER_TABLE_II.get((c["attack"], c["method"], c["shared"]))
        )
        ptxt = f"{paper[0]:>9.1f} ± {paper[1]:.1f}  {paper[2]:>8.2f} ± {paper[3]:.2f}" if paper else ""
        lines.append(
            f"{(c['attack'].capitalize() if c['attack'] != last else ''):<11}{METHOD_LABEL[c['method']]:<11}"
            f"{c['shared'] / s.dim:>5.2f}  {row['coverage']:>7.1f} ± {row['coverage_std']:.1f}  "
            f"{row['width']:>10.2f} ± {row['width_std']:.2f}  | {ptxt}"
        )
        last = c["attack"]
    lines.append("")
    first = [r for r in summary if r["case"]["attack"] == summary[0]["case"]["attack"] and r["case"]["filter"] != "mad"]
    mse = ", ".join(
        f"{METHOD_LABEL[r['case']['method']]} M/D={r['case']['shared'] / s.dim:.2f}: {r['mse_db']:.1f} dB"
        for r in first
        if r["case"]["method"] != "fcp"
    )
    kind = "per-coordinate parameter MSE ||w-w*||^2/D" if synthetic else "test MSE (normalized target)"
    lines.append(
        f"Training {kind}: {mse}"
        + (
            f"   (paper: PRISM-FCP {PAPER_MSE_DB['prism']} dB, Rob-FCP {PAPER_MSE_DB['robfcp']} dB)"
            if synthetic
            else ""
        )
    )
    full = next((r for r in first if r["case"]["shared"] == s.dim), None)
    for r in first:
        if full and r["case"]["method"] == "prism" and full["bytes_train_up"] > 0:
            lines.append(
                f"Training traffic, measured: PRISM-FCP M/D={r['case']['shared'] / s.dim:.2f} "
                f"uplink {r['bytes_train_up'] / 1e6:.3f} MB, downlink {r['bytes_train_down'] / 1e6:.3f} MB "
                f"per trial = {r['bytes_train_up'] / full['bytes_train_up']:.3f} x full sharing"
            )
    smallest = min(r["case"]["shared"] for r in summary if r["case"]["method"] == "prism")
    det = [
        f"{r['case']['attack']}/{r['case']['filter']}: TP {r['tp']:.2f} FP {r['fp']:.2f} (cov {r['coverage']:.1f}%)"
        for r in summary
        if r["case"]["method"] == "prism" and r["case"]["shared"] == smallest
    ]
    lines.append(f"Detection of the {s.byzantine} Byzantine clients (PRISM-FCP, mean per trial): " + "; ".join(det))
    lines.append("(paper: known |S_B| 20/20 TP, 0 FP for all attacks; MAD 100% recall, ~1 FP, coverage 90%)")
    return "\n".join(lines)


def format_case(row: dict) -> str:
    """One case's mean over the trials, on one line."""
    return (
        f"mean over {row['trials']} trials: coverage {row['coverage']:.2f} ± {row['coverage_std']:.2f}%  "
        f"width {row['width']:.4g} ± {row['width_std']:.2g}  MSE {row['mse_db']:.1f} dB  "
        f"TP {row['tp']:.2f} FP {row['fp']:.2f}"
    )


# ---- the job ------------------------------------------------------------------------------


class PrismJob(TrialJob):
    """``task = "prism"``: ``trials`` independent trials of the run's case(s), one
    ``/calibration`` row each (:class:`fedring.conformal.trials.TrialJob`)."""

    size_kind = "interval width"
    settings: ResolvedPrism

    def __init__(self, cfg: Config, comm: MPI.Comm, s: ResolvedPrism):
        super().__init__(cfg, comm, Network(Layout(s.clients, comm)))
        self.settings, self.alpha, self.trials = s, s.alpha, s.trials
        self.cases = table_cases(s) if s.table else [single_case(s)]
        self.attacks = {
            name: make_calib_attack(name, s.attack_params(name, cfg.section(name)))
            for name in sorted({c["attack"] for c in self.cases})
        }
        self.data = _load_data(s, cfg.seed)

    def run_batch(self, trials: list[int]) -> list[dict] | None:
        rows = [
            run_trial(self.settings, self.cases, self.cfg.seed, t, self.net, self.data, self.attacks) for t in trials
        ]
        return [row for row in rows if row is not None] if self.net.layout.rank == 0 else None

    def describe(self, row: dict) -> str:
        if len(self.cases) > 1:
            cov = 100 * np.asarray(row["coverage"])
            return (
                f"{len(self.cases)} cases: coverage {cov.min():.1f}..{cov.max():.1f} %, "
                f"width {np.min(row['size']):.4g}..{np.max(row['size']):.4g}"
            )
        c = self.cases[0]
        return (
            f"{METHOD_LABEL[c['method']]} M/D={c['shared'] / self.settings.dim:.2f} attack={c['attack']}  "
            f"coverage {100 * row['coverage'][0]:.2f}%  width {row['size'][0]:.4g}  "
            f"MSE {row['mse_db'][0]:.1f} dB  flagged TP {row['tp'][0]} FP {row['fp'][0]}  "
            f"train bytes up {row['bytes_train_up'][0]} down {row['bytes_train_down'][0]}"
        )

    def summary(self, rows: dict[str, np.ndarray]) -> str:
        summary = summarize(rows, self.cases)
        if self.settings.table:
            random = self.attacks.get("random") or make_calib_attack("random", self.settings.attack_params("random"))
            assert isinstance(random, RandomAttack), "the attack named random"
            return format_table(self.settings, summary, self.cfg.seed, random.variance)
        return f"{self.cases[0]['label']}: {format_case(summary[0])}"


def _load_data(s: ResolvedPrism, seed: int):
    """The UCI data (None for synthetic runs). With ``standin``, each rank first writes the
    same stand-in file of the real one's shape (drawn from the run's seed) into a temporary
    folder of its own, read and removed at once: no rank depends on another's file system."""
    if s.dataset != "uci":
        return None
    from .uci import load_superconductivity, write_standin_csv

    if not s.standin:
        assert s.data_dir is not None, "validate() asks uci runs for data_dir or standin"
        return load_superconductivity(s.data_dir)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="fedring-uci-standin-") as folder:
        write_standin_csv(Path(folder) / "train.csv", generator(seed, Stream.PRISM_STANDIN))
        return load_superconductivity(folder)
