"""Client sampling and availability (``participation``, ``availability``, ``availability_file``,
``cohort_f``; docs/training.md): the draws, the settings' checks, the ring over a cohort, and
end-to-end runs on 1 and 3 ranks (one job per rank count) and their resume."""

import json

import h5py
import numpy as np
import pytest
from conftest import crash_at_round, fedring, fedring_many, file_datasets, run_mpi

from fedring.comm import Layout, Network, block_bounds
from fedring.comm.ring import RingAllReduce
from fedring.errors import ConfigError
from fedring.rng import Stream, generator
from fedring.train.participation import Participation, cohort_f, cohort_size, read_availability, validate_settings

D_MLP = 79_510  # the mlp's parameters: the end-to-end runs train it (cheaper than the cnn)


def ring_bytes(m: int, d: int, itemsize: int = 4) -> np.ndarray:
    """Per member of a ring of ``m``: the reduce-scatter and all-gather chunks it sends (test_ring.py)."""
    sizes = np.diff(block_bounds(d, m))
    i = np.arange(m)
    return itemsize * ((d - sizes[(i + 1) % m]) + (d - sizes[(i + 2) % m])) * (m > 1)


# ---------------------------------------------------------------------------------- the draws


def test_cohort_size_rounds_the_fraction_and_takes_counts():
    assert [cohort_size(p, 100) for p in (0.1, 0.07, 0.005, 1.0, 2, 37)] == [10, 7, 1, 100, 2, 37]
    assert cohort_size(0.5, 9) == 4  # round half to even: 4.5 -> 4


def test_cohorts_are_the_seeded_draws_of_the_round_alone():
    p = Participation(20, seed=5, participation=0.25)
    later_first = [p.cohort(t).tolist() for t in (4, 3, 2, 1, 0)][::-1]
    for t in range(5):
        expected = np.sort(generator(5, Stream.COHORT, step=t).choice(np.arange(20), 5, replace=False))
        assert p.cohort(t).tolist() == expected.tolist() == later_first[t]
    assert len({tuple(c) for c in later_first}) == 5
    assert Participation(20, seed=6, participation=0.25).cohort(0).tolist() != later_first[0]


def test_availability_probability_then_the_count():
    p = Participation(50, seed=1, participation=15, availability=0.3)
    for t in range(20):
        available = generator(1, Stream.AVAILABILITY, step=t).random(50) < 0.3
        np.testing.assert_array_equal(p.available(t), available)
        cohort = p.cohort(t)
        assert available[cohort].all()
        assert len(cohort) == min(15, available.sum())  # fewer available than the count: all of them
    assert {len(p.cohort(t)) for t in range(20)} != {15}  # some round had fewer than 15 available


def test_availability_table_empty_round_and_stale_members():
    table = np.array([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 1], [0, 1, 1, 1]], bool)
    p = Participation(4, seed=0, participation=1.0, table=table)
    assert not p.everyone
    assert [p.cohort(t).tolist() for t in range(4)] == [[0, 1, 2], [], [0, 3], [1, 2, 3]]
    byz = np.array([False, False, False, True])
    cohorts = [p.draw(t, byz, declared_f=1) for t in range(4)]
    assert [c.byzantine for c in cohorts] == [0, 0, 1, 1]
    assert [c.f for c in cohorts] == [1, 0, 1, 1]  # ceil(1 * m / 4)
    # round 0: everyone holds the initial model; round 2 follows the empty round 1: round 0's cohort
    # holds the model, so 3 catches up; round 3: 0 and 3 hold it
    assert [c.stale.tolist() for c in cohorts] == [[], [], [3], [1, 2]]


def test_cohort_f_policies():
    assert [cohort_f("scaled", 3, m, 10) for m in (0, 1, 3, 4, 10)] == [0, 1, 1, 2, 3]
    assert [cohort_f("declared", 3, m, 10) for m in (1, 10)] == [3, 3]


def test_full_participation_is_everyone():
    assert Participation(7, 0, 1.0).everyone and Participation(7, 0, 7).everyone
    assert not Participation(7, 0, 0.9).everyone and not Participation(7, 0, 1.0, availability=0.9).everyone


def test_availability_files(tmp_path):
    table = np.array([[1, 0, 1], [0, 1, 1], [1, 1, 1]])
    np.save(tmp_path / "a.npy", table.astype(np.uint8))
    (tmp_path / "a.csv").write_text("1,0,1\n0,1,1\n1,1,1\n")
    for name in ("a.npy", "a.csv"):
        np.testing.assert_array_equal(read_availability(str(tmp_path / name), 2, 3), table[:2].astype(bool))


@pytest.mark.parametrize(
    "content, message",
    [
        ("1,0\n0,1\n", "has shape (2, 2): needs at least 2 rows (rounds) of 3 columns"),
        ("1,0,1\n", "has shape (1, 3): needs at least 2 rows"),
        ("1,0,2\n0,1,1\n", "every entry must be 0 (unavailable) or 1 (available)"),
        ("1,0,x\n0,1,1\n", "cannot read"),
    ],
)
def test_bad_availability_files(tmp_path, content, message):
    path = tmp_path / "a.csv"
    path.write_text(content)
    with pytest.raises(ConfigError, match="availability_file") as e:
        read_availability(str(path), 2, 3)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "settings, message",
    [
        ((0, 1.0, None, "scaled"), "participation: must be > 0"),
        (
            (1.5, 1.0, None, "scaled"),
            "participation: a fraction in (0, 1] or a whole count of clients in [2, 9], got 1.5",
        ),
        (
            (10, 1.0, None, "scaled"),
            "participation: a fraction in (0, 1] or a whole count of clients in [2, 9], got 10",
        ),
        ((0.5, 0.0, None, "scaled"), "availability: must be in (0, 1]"),
        ((0.5, 0.5, "x.npy", "scaled"), "availability_file: give availability"),
        ((0.5, 1.0, "missing.npy", "scaled"), "availability_file: file missing.npy does not exist"),
        ((0.5, 1.0, None, "ceil"), "cohort_f: 'ceil' is not allowed"),
    ],
)
def test_settings_are_checked(settings, message):
    with pytest.raises(ConfigError) as e:
        validate_settings(*settings, rounds=3, n_clients=9)
    assert str(e.value).startswith(message)


def test_bad_settings_stop_the_run_before_any_work(tmp_path, fedring_cli):
    out = tmp_path / "r.h5"
    base = ["run", "--dataset", "synthetic", "--model", "mlp", "--clients", "9", "--rounds", "2", "--out", out]
    (tmp_path / "bad.npy").write_bytes(b"not a numpy file")
    for extra, message in [
        (["--set", "participation=0.1", "--topology", "server", "--aggregator", "krum", "--byzantine", "2"], "krum"),
        (["--set", f"availability_file={tmp_path / 'bad.npy'}"], "availability_file: cannot read"),
        (["--set", "participation=-1"], "participation: must be > 0"),
    ]:
        proc = fedring_cli(*base, *extra)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert not out.exists()
    proc = fedring_cli(*base, "--set", "participation=0.1", "--topology", "server", "--aggregator", "krum")
    assert "participation: a cohort of 1 per round" in proc.stderr  # krum needs n > 2f + 2 = 2


# --------------------------------------------------------------------------- the ring over a cohort


def test_network_over_a_cohort_on_one_rank():
    X = np.random.default_rng(0).integers(-100, 100, (7, 10)).astype(np.float32)
    net = Network(Layout(7))
    cohort = np.array([1, 2, 5])
    sub = net.over(cohort)
    rows = X[cohort].copy()
    mean = RingAllReduce(3)(sub, rows)
    np.testing.assert_array_equal(mean, X[cohort].mean(axis=0))
    expected = np.zeros(7, np.int64)
    expected[cohort] = ring_bytes(3, 10)
    np.testing.assert_array_equal(net.ledger.client_bytes(), expected)


OVER = """
import json, sys
import numpy as np
import fedring.comm.network
from fedring.comm import Layout, Network
from fedring.comm.ring import RingAllReduce
fedring.comm.network.MAX_SUBSETS = 1  # every new set of ranks drops the communicator of the last one
net = Network(Layout(7))
X = np.arange(70, dtype=np.float32).reshape(7, 10) ** 1.5 // 1
out = []
for cohort in ([1, 2], [1, 4, 6], [3, 6], [1, 2], [0, 1, 2, 3, 4, 5, 6]):
    cohort = np.array(cohort)
    net.ledger.reset()
    sub = net.over(cohort)
    lay = net.layout
    mine = cohort[(cohort >= lay.lo) & (cohort < lay.hi)]
    mean = None if sub is None else RingAllReduce(len(cohort))(sub, X[mine].copy()).tolist()
    out.append({"mean": mean, "bytes": net.sum_to_server(net.ledger.client_bytes())})
out = [{**o, "bytes": None if o["bytes"] is None else o["bytes"].tolist()} for o in out]
json.dump(out, open(sys.argv[1] + f".{net.layout.rank}", "w"))
"""


@pytest.mark.mpi
def test_ring_over_cohorts_on_three_ranks(tmp_path):
    """7 clients on 3 ranks (0-2, 3-4, 5-6): a cohort on one rank, on all, on two, on the first again
    (its communicator dropped and split anew); ranks without a member take no part; the mean is
    the centralised mean of the cohort's rows; bytes are booked on the members, exactly the ring's."""
    (tmp_path / "over.py").write_text(OVER)
    run_mpi(3, [str(tmp_path / "over.py"), str(tmp_path / "out")])
    results = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(3)]
    X = np.arange(70, dtype=np.float32).reshape(7, 10) ** 1.5 // 1
    hosts = [[0], [0, 1, 2], [1, 2], [0], [0, 1, 2]]
    for k, cohort in enumerate(([1, 2], [1, 4, 6], [3, 6], [1, 2], list(range(7)))):
        for r in range(3):
            got = results[r][k]["mean"]
            if r in hosts[k]:
                assert got == X[cohort].mean(axis=0).tolist()
            else:
                assert got is None
        expected = np.zeros(7, np.int64)
        expected[cohort] = ring_bytes(len(cohort), 10)
        assert results[0][k]["bytes"] == expected.tolist()


# -------------------------------------------------------------------------------- one rank, in process


def trainer(**settings):
    from mpi4py import MPI

    from fedring.config import Config
    from fedring.train.task import TrainTask
    from fedring.train.trainer import Trainer

    cfg = Config(**{"dataset": "synthetic", "clients": 6, "rounds": 3, "quiet": True, **settings})
    TrainTask(cfg, 1)
    return Trainer(cfg, MPI.COMM_WORLD)


@pytest.mark.parametrize("topology", ["ring", "server"])
def test_members_train_the_others_keep_their_rows(topology):
    """Momentum rows of non-members stay bit for bit, members' change; the update is the mean of the
    members' uploads (the ring sums in another order: within float rounding); BatchNorm statistics
    become the members' mean."""
    from fedring.train.loop import train_round

    tr = trainer(topology=topology, momentum=0.9, participation=0.5, model="cnn_bn")
    for t in range(3):
        before = tr.clients.state["m"].copy()
        result = train_round(tr, t)
        member = result.cohort.member
        assert member.sum() == 3 and result.aggregation.updated
        np.testing.assert_array_equal(tr.clients.state["m"][~member], before[~member])
        assert (tr.clients.state["m"][member] != before[member]).any(axis=1).all()
        mean = tr.clients.rows[member].mean(axis=0)
        np.testing.assert_allclose(result.aggregation.update, mean, rtol=0, atol=1e-6 * np.abs(mean).max())
        np.testing.assert_array_equal(tr.replica.buffers.shared, tr.replica.buffers.rows[member].sum(axis=0) / 3)


# ------------------------------------------------------------------------------ end-to-end runs

SMALL = ["--dataset", "synthetic", "--model", "mlp", "--clients", "9", "--rounds", "6", "--eval-every", "2", "--quiet"]
#: an availability table: round 2 nobody, round 4 only clients 7 and 8
TABLE = np.ones((6, 9), np.uint8)
TABLE[2] = 0
TABLE[4, :7] = 0
RUNS = {
    "server": "--topology server --aggregator cclip --byzantine 2 --attack alie"
    " --set momentum=0.9 --set participation=0.5",
    "server-table": "--topology server --aggregator krum --byzantine 2 --attack fang_krum"
    " --set participation=7 --set availability_file=TABLE",
    "ring": "--set participation=0.3 --byzantine 1 --attack gaussian",
    "ring-batched": "--set participation=0.3 --set batched_clients=2",
    "brace": "--aggregator brace --lr 0.01 --byzantine 2 --attack gaussian --set brace.relay_attack=flip"
    " --set brace.check=on --set participation=0.5 --set availability=0.7",
}


def fix_table(args: list[str], root) -> list[str]:
    return [f"availability_file={root / 'table.npy'}" if a == "availability_file=TABLE" else a for a in args]


def run_settings(name: str, root) -> list[str]:
    return fix_table([*SMALL, *RUNS[name].split()], root)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{ranks}/{name}.h5`` for every RUNS entry on 1 and 3 ranks."""
    root = tmp_path_factory.mktemp("participation")
    np.save(root / "table.npy", TABLE)
    for ranks in (1, 3):
        (root / str(ranks)).mkdir()
        out = {name: [*run_settings(name, root), "--out", str(root / str(ranks) / f"{name}.h5")] for name in RUNS}
        assert fedring_many(ranks, out, root / str(ranks))[0] == dict.fromkeys(RUNS, 0)
    return root


def contents(path) -> dict[str, bytes]:
    """Every dataset of a results file but the wall-clock ones and the checkpoints, as bytes."""
    return {k: v.tobytes() for k, v in file_datasets(path).items()}


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_same_file_on_1_and_3_ranks(runs, name):
    one, three = contents(runs / "1" / f"{name}.h5"), contents(runs / "3" / f"{name}.h5")
    assert "participation/cohort" in one and "model/final" in one
    assert one.keys() == three.keys()
    assert [k for k in one if one[k] != three[k]] == []


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_cohorts_recorded_and_non_participants_send_nothing(runs, name):
    table = TABLE if name == "server-table" else None
    participation = {"server": 0.5, "server-table": 7, "brace": 0.5}.get(name, 0.3)
    p = Participation(9, 0, participation, 0.7 if name == "brace" else 1.0, None if table is None else table)
    with h5py.File(runs / "1" / f"{name}.h5", "r") as f:
        cohort, sent = f["participation/cohort"][:], f["comm/bytes_sent"][:]
        byzantine, updated = f["participation/byzantine"][:], f["participation/updated"][:]
        is_byz = np.zeros(9, bool)
        is_byz[f["byzantine/clients"][:]] = True
    assert cohort.dtype == np.uint8 and cohort.shape == (6, 9)
    np.testing.assert_array_equal(cohort, [p.draw(t, is_byz, 2).member for t in range(6)])
    np.testing.assert_array_equal(byzantine, (cohort.astype(bool) & is_byz).sum(axis=1))
    assert (sent[cohort == 0] == 0).all()
    assert (sent[updated == 1][cohort[updated == 1] == 1] > 0).all()
    if name == "server-table":  # nobody in round 2; two clients in round 4, too few for krum (n > 2f + 2)
        assert updated.tolist() == [1, 1, 0, 1, 0, 1] and (sent[[2, 4]] == 0).all()


@pytest.mark.mpi
@pytest.mark.slow
def test_ring_bytes_are_the_cohort_ring_and_the_catch_up(runs):
    """A member sends the ring's chunks for a ring of m, and 4 d bytes more for each member after it
    on the ring that missed the last round (the ``catch_up`` download of the model)."""
    p = Participation(9, 0, 0.3)
    with h5py.File(runs / "1" / "ring.h5", "r") as f:
        sent = f["comm/bytes_sent"][:]
    # on 3 ranks (clients 0-2, 3-5, 6-8), some rounds have a rank that hosts no member, rank 0 among them
    sitting_out = {
        r for t in range(6) for r in range(3) if not p.draw(t, np.zeros(9, bool), 0).member[3 * r : 3 * r + 3].any()
    }
    assert 0 in sitting_out
    for t in range(6):
        members = p.cohort(t)
        expected = np.zeros(9, np.int64)
        expected[members] = ring_bytes(len(members), D_MLP)
        for client in p.draw(t, np.zeros(9, bool), 0).stale:
            expected[members[np.searchsorted(members, client) - 1]] += 4 * D_MLP
        np.testing.assert_array_equal(sent[t], expected)


@pytest.mark.mpi
@pytest.mark.slow
def test_server_bytes_are_the_cohort_uploads_downloads_and_catch_up(runs):
    p = Participation(9, 0, 0.5)
    with h5py.File(runs / "1" / "server.h5", "r") as f:
        sent, server = f["comm/bytes_sent"][:], f["comm/server_bytes_sent"][:]
    for t in range(6):
        cohort = p.draw(t, np.zeros(9, bool), 0)
        np.testing.assert_array_equal(sent[t], 4 * D_MLP * cohort.member)
        assert server[t] == 4 * D_MLP * (cohort.size + len(cohort.stale))


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("name", ["server", "brace"])
def test_resume_is_bit_exact(runs, tmp_path, name):
    """Crash in round 3 on 2 ranks, resume on 2: the file of the uninterrupted run (on 1 rank)."""
    out = tmp_path / "run.h5"
    args = [*run_settings(name, runs), "--checkpoint-every", "2", "--out", str(out)]
    crash_at_round(tmp_path, 2, 3, args)
    fedring(2, *args, "--resume")
    resumed, reference = contents(out), contents(runs / "1" / f"{name}.h5")
    assert [k for k in reference if resumed.get(k) != reference[k]] == []
