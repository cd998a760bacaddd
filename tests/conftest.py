"""Shared helpers: run fedring (or a script) under ``mpiexec -n N`` with a hard timeout, or a
command in this process (:func:`fedring_cli`, :func:`analysis_cli`: no interpreter to start)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import ClassVar

import pytest

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = shutil.which("mpiexec")
#: the one-node test cluster of the workspace beside the repository, where there is one
SLURM_START = ROOT.parent / "shared" / "tools" / "local-slurm" / "start.sh"


def slurm_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    return proc.returncode == 0 and any(s in proc.stdout for s in ("idle", "mixed", "allocated"))


@pytest.fixture(scope="session")
def slurm_cluster():
    """None when a SLURM cluster takes jobs, else the reason there is none (for a skip).

    The one-node cluster of ``SLURM_START`` is started here (as root) and, if this fixture started
    it, stopped after the last test of :data:`SLURM_FILES` (:func:`pytest_runtest_teardown`), while
    the other worker still computes, or at the end of the session; an existing cluster is used only
    with FEDRING_TEST_SLURM=1. Shared by every test that submits (test_slurm, the tutorial), so a
    cluster stopped by one of them cannot leave ``sbatch`` on the path without a controller.
    """
    started = False
    if SLURM_START.is_file() and os.geteuid() == 0:
        started = not slurm_up()
        proc = subprocess.run(["bash", str(SLURM_START)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{SLURM_START} failed:\n{proc.stdout}\n{proc.stderr}"
        SLURM_STARTED[0] = started
    elif shutil.which("sbatch") is None:
        yield f"no sbatch here and no {SLURM_START} to start a local SLURM (or not root)"
        return
    elif os.environ.get("FEDRING_TEST_SLURM") != "1":
        yield "sbatch found but no local test cluster: set FEDRING_TEST_SLURM=1 to submit test jobs to this one"
        return
    if not slurm_up():
        pytest.fail("SLURM does not answer: sinfo shows no usable node")
    yield None
    stop_slurm()


#: whether :func:`slurm_cluster` started the cluster and has not stopped it yet
SLURM_STARTED = [False]
#: the cluster's ``stop.sh`` while it runs (its daemons take seconds to go: the worker goes on meanwhile)
SLURM_STOPPING: list[subprocess.Popen] = []


def stop_slurm() -> None:
    """Start stopping the cluster, if :func:`slurm_cluster` started it; :func:`pytest_sessionfinish` waits."""
    if SLURM_STARTED[0]:
        SLURM_STARTED[0] = False
        stop = ["bash", str(SLURM_START.with_name("stop.sh"))]
        SLURM_STOPPING.append(subprocess.Popen(stop, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


def pytest_runtest_teardown(item, nextitem):
    """The cluster goes once the tests that use it are done (they run first, on one worker)."""
    if file_of(item.nodeid) in SLURM_FILES and (nextitem is None or file_of(nextitem.nodeid) not in SLURM_FILES):
        stop_slurm()


def file_of(nodeid: str) -> str:
    """The file of a test (its node id up to ``::``)."""
    return nodeid.split("::")[0]


def wait_for(what: str, predicate, timeout: float, interval: float = 0.5):
    """``predicate()``'s first true value, polled every ``interval`` seconds; fails the test past ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


#: processes the tests started themselves, per test file: ``mpiexec`` jobs and other programs (interpreters,
#: bash, sbatch); not those these start (a local sweep's runs). Outside tests: pytest plugins' own commands.
LAUNCHES: Counter = Counter()
_popen_init = subprocess.Popen.__init__


#: the test being run (None between tests)
CURRENT: list[pytest.Item | None] = [None]


def _counting_popen_init(self, args, *a, **kw):
    program = Path(str(args[0]) if isinstance(args, (list, tuple)) else str(args).split()[0]).name
    test = file_of(os.environ.get("PYTEST_CURRENT_TEST", "(outside tests)"))
    LAUNCHES[(test, "mpiexec" if program == "mpiexec" else "other")] += 1
    item = CURRENT[0]
    if program == "mpiexec" and item is not None and item.get_closest_marker("mpi") is None:
        pytest.fail(f"{item.nodeid} launches mpiexec: mark it @pytest.mark.mpi (-m 'not mpi' must start no MPI job)")
    _popen_init(self, args, *a, **kw)


#: CPU seconds (user + system) per test file, of this process and of the processes it waited for:
#: unlike wall time, hardly changed by other work on the machine
CPU: Counter = Counter()


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start, CURRENT[0] = cpu_seconds(), item
    yield
    CPU[file_of(item.nodeid)] += cpu_seconds() - start
    CURRENT[0] = None


def pytest_configure(config):
    subprocess.Popen.__init__ = _counting_popen_init
    if not hasattr(config, "workerinput"):  # once, in the process that starts the session
        write_bytecode()


def write_bytecode() -> None:
    """Cache the bytecode of what the tests' processes import from the repository (fedring, analysis,
    the helpers in tests/) where it is missing or stale. An editable install leaves it to the first
    import to write, and not even that where ``PYTHONDONTWRITEBYTECODE`` is set: then each of the
    suite's 230 Python processes compiled fedring again, 0.1 CPU s each (docs/figures.md, "The test suite")."""
    import compileall

    for package in ("fedring", "analysis"):
        compileall.compile_dir(ROOT / package, quiet=2)
    for helper in (ROOT / "tests").glob("*.py"):
        if not helper.name.startswith("test_"):  # pytest compiles the test files itself
            compileall.compile_file(helper, quiet=2)


#: test files that share one SLURM cluster (the ``slurm_cluster`` fixture): one xdist worker runs them
SLURM_FILES = ("tests/test_slurm.py", "tests/test_tutorial.py")


def pytest_collection_modifyitems(config, items):
    """The SLURM files first (mostly waiting for the cluster, while another worker computes), then the
    files with the most slow tests, then those with the most MPI jobs, each file's tests in their
    order: under ``-n`` a worker takes a whole file at a time, and a long file started last would
    leave the other worker idle at the end."""
    weight: Counter = Counter()
    for item in items:
        weight[file_of(item.nodeid)] += 1000 * bool(item.get_closest_marker("slow")) + bool(
            item.get_closest_marker("mpi")
        )
    order = {item.nodeid: i for i, item in enumerate(items)}
    items.sort(
        key=lambda item: (
            file_of(item.nodeid) not in SLURM_FILES,
            -weight[file_of(item.nodeid)],
            order[item.nodeid],
        )
    )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n N``: each worker takes whole files (module fixtures, such as shared reference runs, are
    made once), in the order above; the files that use the SLURM cluster go to one worker together."""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = file_of(nodeid)
            return "slurm" if path in SLURM_FILES else path

    config.option.loadscopereorder = False
    return FileScheduling(config, log)


def pytest_sessionfinish(session):
    """An xdist worker hands its launch and CPU counts to the controller, which prints the summary."""
    for pool in Pool.warm.values():
        pool.close()
    for stopping in SLURM_STOPPING:
        stopping.wait(timeout=120)
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["launches"] = [[test, kind, n] for (test, kind), n in LAUNCHES.items()]
        output["cpu"] = dict(CPU)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    output = getattr(node, "workeroutput", {})
    for test, kind, n in output.get("launches", []):
        LAUNCHES[test, kind] += n
    CPU.update(output.get("cpu", {}))


def pytest_terminal_summary(terminalreporter):
    """Print how many processes each test file launched (the suite's time goes mostly to launches:
    about 2 CPU seconds a rank that imports torch), how many of its jobs ran in the warm ranks of
    :func:`pooled`'s warm pool, and the CPU time each file took (setup, call and teardown, the pool's share
    included); files that launched nothing and took less than half a second are left out."""
    if not LAUNCHES:
        return
    terminalreporter.section("process launches and CPU seconds")
    shown = {t for t, _ in LAUNCHES} | {t for t, seconds in CPU.items() if seconds >= 0.5}
    for test in sorted(shown):
        terminalreporter.write_line(
            f"{LAUNCHES[test, 'mpiexec']:4d} mpiexec {LAUNCHES[test, 'pooled']:4d} pooled "
            f"{LAUNCHES[test, 'other']:4d} other {CPU[test]:7.1f} s  {test}"
        )
    total = {kind: sum(n for (_, k), n in LAUNCHES.items() if k == kind) for kind in ("mpiexec", "pooled", "other")}
    terminalreporter.write_line(
        f"{total['mpiexec']:4d} mpiexec {total['pooled']:4d} pooled {total['other']:4d} other "
        f"{sum(CPU.values()):7.1f} s  in all"
    )


def mpi_env() -> dict:
    """The environment of the tests' jobs: the repository and tests/ on PYTHONPATH, and MPICH told to
    let a rank that waits for another sleep instead of spin (``MPIR_CVAR_ENABLE_HEAVY_YIELD``): the
    suite runs more ranks than there are cores, and a spinning rank takes the core of one that
    computes (docs/figures.md, "The test suite")."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    return env


def run_mpi(
    n: int, args: list[str], timeout: float = 180, check: bool = True, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    """``mpiexec -n n python <args>`` in ``cwd``; fails the test (not hangs) past ``timeout`` seconds."""
    if n > 1 and MPIEXEC is None:
        pytest.skip("mpiexec not found (pip install mpich)")
    cmd = ([MPIEXEC, "-n", str(n)] if n > 1 else []) + [sys.executable, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=mpi_env(), cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


#: ``python paths.py DIR``: each config of ``CONFIGS`` (with ``COMMON``) on each ``(path, ranks)`` of
#: ``LAYOUTS``: the device path (``Trainer(host_path=False)``: torch tensors on the CPU) or the host
#: path, on the job's first ``ranks`` ranks, into ``DIR/{config}-{path}{ranks}.h5``
PATHS_SCRIPT = """
import sys
from mpi4py import MPI
import fedring.train.trainer as trainer
from fedring.cli import main

CONFIGS, COMMON, LAYOUTS = {configs!r}, {common!r}, {layouts!r}
HOST_PATH = [None]
build = trainer.Trainer.__init__

def init(self, cfg, comm, host_path=None, parts=None):
    build(self, cfg, comm, HOST_PATH[0], parts)

trainer.Trainer.__init__ = init
world = MPI.COMM_WORLD
for path, ranks in LAYOUTS:
    HOST_PATH[0] = path == "host"
    comm = world.Split(0 if world.rank < ranks else MPI.UNDEFINED, world.rank)
    if comm == MPI.COMM_NULL:
        continue
    for name, args in CONFIGS.items():
        code = main(["run", *COMMON, *args, "--out", f"{{sys.argv[1]}}/{{name}}-{{path}}{{ranks}}.h5"], comm=comm)
        assert code == 0, (name, path, ranks)
    comm.Free()
"""


def path_runs(out: Path, configs: dict, common: list[str], layouts: list[tuple[str, int]]) -> Path:
    """:data:`PATHS_SCRIPT`'s runs into ``out`` (one MPI job of as many ranks as the largest layout)."""
    script = out / "paths.py"
    script.write_text(PATHS_SCRIPT.format(configs=configs, common=common, layouts=layouts))
    run_mpi(max(r for _, r in layouts), [str(script), str(out)], timeout=600)
    return out


def file_datasets(path) -> dict:
    """Every dataset of a results file but the wall-clock ones and the checkpoints, as arrays."""
    import h5py

    out = {}
    with h5py.File(path, "r") as f:

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset) and not name.startswith("checkpoint") and "wall_seconds" not in name:
                out[name] = obj[()]

        f.visititems(visit)
    return out


#: ``python pool.py DIR PID``: the ranks of a :class:`Pool`, for test process PID (they end when it is
#: gone). Request ``K`` is the file ``DIR/req-K.json`` (``{"cwd": ..., "ranks": n, "runs": {name: argv}}``,
#: or null to stop); the first ``n`` ranks run those command lines one after the other, as ``python -m
#: fedring ARGV`` from ``cwd`` would on ``n`` ranks (:func:`run_cli`; fedring's ``main`` on a communicator
#: of those ranks, split from the pool's once per ``n``), and rank 0 answers in ``DIR/res-K.json``: per rank,
#: per run, [exit code, stdout, stderr]. An idle rank polls the folder: a rank waiting in MPI would spin
#: (MPICH polls) and take a core from the tests. It polls every 5 ms for a second after a request, then
#: every 50 ms, so the session's idle pools cost next to nothing.
POOL = """
import contextlib, functools, io, itertools, json, os, sys, time, warnings
from pathlib import Path
from mpi4py import MPI
from conftest import run_cli
from fedring.cli import main
folder, world, groups = Path(sys.argv[1]), MPI.COMM_WORLD, {}
(folder / f"pid.{world.rank}.part").write_text(str(os.getpid()))
(folder / f"pid.{world.rank}.part").rename(folder / f"pid.{world.rank}")
home, path = os.getcwd(), list(sys.path)
for k in itertools.count():
    request_file, idle_since = folder / f"req-{k}.json", time.monotonic()
    while not request_file.exists():
        time.sleep(0.005 if time.monotonic() - idle_since < 1 else 0.05)
        if not os.path.exists(f"/proc/{sys.argv[2]}"):  # the test process is gone: so is the pool
            sys.exit(0)
    request = json.loads(request_file.read_text())
    if request is None:
        break
    n = request["ranks"]
    if n not in groups:  # collective: every rank reads every request
        groups[n] = world.Split(0 if world.rank < n else MPI.UNDEFINED, world.rank)
    comm = groups[n]
    if comm == MPI.COMM_NULL:
        continue
    os.chdir(request["cwd"])
    sys.path[:] = [request["cwd"], *path]  # as python -m puts the working directory first
    answer = {}
    for name, argv in request["runs"].items():
        out, err = io.StringIO(), io.StringIO()
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.simplefilter("default", append=True)  # a change of filters: each run warns afresh
            code = run_cli(functools.partial(main, comm=comm), argv)
        answer[name] = [code, out.getvalue(), err.getvalue()]
    os.chdir(home)
    sys.path[:] = path
    answers = comm.gather(answer, root=0)
    if comm.rank == 0:
        (folder / f"res-{k}.json.part").write_text(json.dumps(answers))
        (folder / f"res-{k}.json.part").rename(folder / f"res-{k}.json")
MPI.Finalize()
sys.stdout.flush(), sys.stderr.flush()
os._exit(0)  # no interpreter teardown: unloading torch and the rest takes 0.3 CPU s a rank
"""


class Pool:
    """Ranks that run fedring command lines on request (:data:`POOL`): ``mpiexec -n ranks`` of them,
    or one process for one rank. :func:`pooled` keeps a warm pool of :data:`SIZE` ranks per test
    process, started at its first request and kept for the session; a request on fewer ranks runs
    on the first of them (fedring on a communicator of those), so the runs meant to succeed
    (:func:`fedring`, :func:`fedring_many`) import torch and start MPI once per rank and process
    instead of once per job. The 1-rank runs of a test not marked ``mpi`` go to a warm pool of one
    process instead: such a test starts no ``mpiexec``. More ranks than :data:`SIZE` get a pool for
    one request. A run that checks how a process ends (an exit code expected not to be 0, a signal,
    a crash) starts its own job. A pool whose run fails or hangs ends, and fails its test."""

    #: the warm pool's ranks: the most the tests' pooled runs use (one without mpiexec)
    SIZE = 4 if MPIEXEC else 1
    #: the warm pools by size: :data:`SIZE`, and 1
    warm: ClassVar[dict[int, Pool]] = {}

    def __init__(self, ranks: int):
        self.ranks, self.requests = ranks, 0
        self.folder = Path(tempfile.mkdtemp(prefix="fedring-pool-"))
        (self.folder / "pool.py").write_text(POOL)
        self.env = self.environment()
        launcher = [MPIEXEC, "-n", str(ranks)] if ranks > 1 else []
        with open(self.folder / "job.log", "w") as log:
            cmd = [*launcher, sys.executable, str(self.folder / "pool.py"), str(self.folder), str(os.getpid())]
            self.job = subprocess.Popen(
                cmd, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    #: set in the test process by pytest (the running test) and by torch (its compile cache, once a
    #: test has used torch.func): no reason to start another pool
    OWN_VARIABLES = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")

    @classmethod
    def environment(cls) -> dict:
        """The ranks' environment, but for :data:`OWN_VARIABLES`."""
        return {k: v for k, v in mpi_env().items() if k not in cls.OWN_VARIABLES}

    @classmethod
    def warm_size(cls, ranks: int) -> int | None:
        """The size of the warm pool that runs a job of ``ranks`` ranks for the running test, if one does
        (the tests' environment unchanged since it started)."""
        item = CURRENT[0]
        size = 1 if ranks == 1 and (item is None or item.get_closest_marker("mpi") is None) else cls.SIZE
        pool = cls.warm.get(size)
        return size if ranks <= size and (pool is None or pool.env == cls.environment()) else None

    def cpu(self) -> float:
        """CPU seconds (user + system) the pool's ranks have used so far."""
        ticks = 0
        for rank in range(self.ranks):
            pid = self.folder / f"pid.{rank}"
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{pid.read_text()}/stat").read_text().rsplit(")", 1)[1].split()
                ticks += int(fields[11]) + int(fields[12])
        return ticks / os.sysconf("SC_CLK_TCK")

    def run(self, ranks: int, runs: dict[str, list[str]], cwd: Path, timeout: float) -> list[dict]:
        """The answer of each of the first ``ranks`` ranks to one request: per run name, [exit code, stdout, stderr]."""
        k, self.requests = self.requests, self.requests + 1
        (self.folder / "req.part").write_text(json.dumps({"cwd": str(cwd), "ranks": ranks, "runs": runs}))
        (self.folder / "req.part").rename(self.folder / f"req-{k}.json")
        answer, deadline = self.folder / f"res-{k}.json", time.monotonic() + timeout
        while not answer.exists():
            if self.job.poll() is not None or time.monotonic() > deadline:
                ended = self.job.poll() is not None
                log = (self.folder / "job.log").read_text()[-5000:]
                self.close(kill=True)
                raise AssertionError(
                    f"the pool's ranks {'ended' if ended else f'hung past {timeout:.0f} s'} in {runs}:\n{log}"
                )
            time.sleep(0.005)
        return json.loads(answer.read_text())

    def close(self, kill: bool = False) -> None:
        """End the pool with a stop request, or with SIGKILL to its processes (``kill``, or no end
        within 10 s), and remove its folder."""
        if not kill and self.job.poll() is None:
            (self.folder / "req.part").write_text("null")
            (self.folder / "req.part").rename(self.folder / f"req-{self.requests}.json")
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.job.wait(timeout=10)
        if self.job.poll() is None:  # hung: the job's processes, its ranks with it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.job.pid, signal.SIGKILL)
            self.job.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def pooled(ranks: int, runs: dict[str, list[str]], cwd: Path, timeout: float) -> list[dict]:
    """Every rank's answer to running ``runs`` (:meth:`Pool.run`): in the warm pool where it serves
    ``ranks`` (a pooled job; the pool's CPU time goes to the test), else in a pool started for
    them alone (a job like any other, its CPU time counted when it ends)."""
    size = Pool.warm_size(ranks)
    if size is None:
        if ranks > 1 and MPIEXEC is None:
            pytest.skip("mpiexec not found (pip install mpich)")
        pool = Pool(ranks)
        try:
            return pool.run(ranks, runs, cwd, timeout)
        finally:
            pool.close()
    item = CURRENT[0]
    if ranks > 1 and item is not None and item.get_closest_marker("mpi") is None:
        pytest.fail(f"{item.nodeid} runs MPI jobs: mark it @pytest.mark.mpi")
    if size not in Pool.warm:
        Pool.warm[size] = Pool(size)
    warm, test = Pool.warm[size], file_of(os.environ.get("PYTEST_CURRENT_TEST", "(outside tests)"))
    LAUNCHES[test, "pooled"] += 1
    before = warm.cpu()
    try:
        answers = warm.run(ranks, runs, cwd, timeout)
    except Exception:  # it ended, or its folder went: only this test fails, the next request starts a pool
        warm.close(kill=True)
        del Pool.warm[size]
        raise
    CPU[test] += warm.cpu() - before
    return answers


def fedring(n: int, *args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """``mpiexec -n n python -m fedring ARGS``; a run meant to succeed on up to :data:`Pool.SIZE`
    ranks runs in the warm pool (its exit code, and what every rank printed, come
    back the same way)."""
    if check and Pool.warm_size(n) is not None:
        argv = [str(a) for a in args]
        answers = pooled(n, {"run": argv}, kw.get("cwd", ROOT), kw.get("timeout", 180))
        code = next((a["run"][0] for a in answers if a["run"][0]), 0)
        cmd = [*([MPIEXEC, "-n", str(n)] if n > 1 else []), sys.executable, "-m", "fedring", *argv]
        proc = subprocess.CompletedProcess(
            cmd, code, "".join(a["run"][1] for a in answers), "".join(a["run"][2] for a in answers)
        )
        if code != 0:
            raise AssertionError(f"{' '.join(cmd)} (pooled) exited {code}\n{proc.stdout}\n{proc.stderr}")
        return proc
    return run_mpi(n, ["-m", "fedring", *args], check=check, **kw)


def fedring_many(
    ranks: int, runs: dict[str, list[str]], workdir: Path, timeout: float = 600, cwd: Path = ROOT
) -> tuple[dict[str, int], subprocess.CompletedProcess]:
    """Run several fedring command lines one after the other on ``ranks`` ranks, from ``cwd``, in one
    job (:func:`pooled`: its start-up paid once, or not at all in the warm pool): each one's exit code
    by name (the first rank's that is not 0), and the job's output, every rank's in turn; what each
    run printed on each rank is in :func:`many_printed`."""
    argvs = {name: [str(a) for a in args] for name, args in runs.items()}
    answers = pooled(ranks, argvs, cwd, timeout)
    for rank, answer in enumerate(answers):
        printed = {name: out for name, (_, out, _) in answer.items()}
        (workdir / f"printed.{rank}.json").write_text(json.dumps(printed))
    codes = {name: next((a[name][0] for a in answers if a[name][0]), 0) for name in argvs}
    stdout = "".join(out for a in answers for _, out, _ in a.values())
    stderr = "".join(err for a in answers for _, _, err in a.values())
    return codes, subprocess.CompletedProcess(["fedring_many", *argvs], 0, stdout, stderr)


def same_on_one_and_two_ranks(argv: list[str], workdir: Path) -> dict:
    """Run the fedring command line ``argv`` (without ``--out``) on one rank and on two; assert both
    succeed and write the same datasets (:func:`file_datasets`); return those of the one-rank file."""
    outs = {ranks: workdir / f"r{ranks}.h5" for ranks in (1, 2)}
    for ranks, out in outs.items():
        assert fedring_many(ranks, {"r": [*argv, "--out", str(out)]}, workdir)[0] == {"r": 0}
    one, two = file_datasets(outs[1]), file_datasets(outs[2])
    assert one.keys() == two.keys() and all(one[k].tobytes() == two[k].tobytes() for k in one)
    return one


def many_printed(workdir: Path, rank: int = 0) -> dict[str, str]:
    """What each run of the last :func:`fedring_many` job in ``workdir`` printed on ``rank`` (stdout), by name."""
    return json.loads((workdir / f"printed.{rank}.json").read_text())


#: ``python at_round.py ROUND ACTION ARGS...``: fedring run ARGS, every rank doing ACTION at the start of
#: round ROUND (0-based): ``raise`` (an exception) or ``sleep:S`` (a pause of S seconds, so that a signal or
#: a kill sent once an earlier round is reported lands mid-run however fast the rounds are).
AT_ROUND = """
import sys, time
import fedring.train.loop as training
original = training.train_round
round_, action = int(sys.argv[1]), sys.argv[2]
def train_round(tr, t):
    if t == round_:
        if action == "raise":
            raise RuntimeError("injected failure on purpose")
        time.sleep(float(action.removeprefix("sleep:")))
    return original(tr, t)
training.train_round = train_round
from fedring.cli import main
sys.exit(main(sys.argv[3:]))
"""


def at_round_command(tmp_path: Path, round_: int, action: str, args: list[str]) -> list[str]:
    """``python at_round.py ROUND ACTION ARGS`` (:data:`AT_ROUND`, written into ``tmp_path``)."""
    script = tmp_path / "at_round.py"
    script.write_text(AT_ROUND)
    return [str(script), str(round_), action, *args]


def paused_at_round(
    tmp_path: Path, ranks: int, round_: int, seconds: float, args: list[str], **popen
) -> subprocess.Popen:
    """Start fedring ARGS under ``ranks`` ranks (not waiting), every rank pausing ``seconds`` before
    round ``round_``; ``popen`` goes to :class:`subprocess.Popen`."""
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, *at_round_command(tmp_path, round_, f"sleep:{seconds}", args)]
    return subprocess.Popen(cmd, env=mpi_env(), cwd=ROOT, text=True, **popen)


#: the signals a run handles (a stop after the current round, docs/reliability.md)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def run_cli(main, argv: list[str]) -> int:
    """:func:`exit_code` of a run in a process that goes on: the signal handlers the run installs,
    and its wakeup descriptor, are put back afterwards."""
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        return exit_code(main, argv)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(-1)


def exit_code(main, argv: list[str]) -> int:
    """``sys.exit(main(argv))``'s exit status, a SystemExit reported as the interpreter would."""
    try:
        return main(argv)
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            return e.code or 0
        print(e.code, file=sys.stderr)  # sys.exit("message")
        return 1


@pytest.fixture
def fedring_cli(capsys, monkeypatch):
    """``python -m fedring ARGS`` on one rank in this process, for runs that end at a settings error
    (exit 2 before any work): a CompletedProcess with the exit code and what was printed. Runs
    from ``cwd`` when given. The signal handlers a run installs are put back afterwards."""
    from fedring.cli import main

    def call(*args, cwd: Path | None = None) -> subprocess.CompletedProcess:
        argv = [str(a) for a in args]
        if cwd is not None:
            monkeypatch.chdir(cwd)
        capsys.readouterr()
        code = run_cli(main, argv)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["python", "-m", "fedring", *argv], code, out, err)

    return call


@pytest.fixture
def analysis_cli(capsys, monkeypatch):
    """``python -m analysis ARGS`` in this process, from directory ``cwd`` (not the repository):
    a CompletedProcess with the exit code and what was printed."""
    from mpi4py import MPI  # noqa: F401 -- initialised here, as fedring's tests do: analysis would import it uninitialised

    from analysis.__main__ import main

    def call(*args, cwd: Path) -> subprocess.CompletedProcess:
        argv = [str(a) for a in args]
        monkeypatch.chdir(cwd)
        capsys.readouterr()
        code = exit_code(main, argv)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["python", "-m", "analysis", *argv], code, out, err)

    return call


def crash_at_round(tmp_path: Path, ranks: int, round_: int, args: list[str]) -> subprocess.CompletedProcess:
    """Run fedring ARGS under ``ranks`` ranks with an exception injected in round ``round_``."""
    proc = run_mpi(ranks, at_round_command(tmp_path, round_, "raise", args), check=False)
    assert proc.returncode != 0 and "injected failure on purpose" in proc.stderr
    return proc


def wait_for_unlock(path: Path, seconds: float = 30) -> None:
    """Wait until no process holds the HDF5 file lock of ``path`` (a killed rank's lock goes
    with its last file descriptor, which may outlive the launcher by a moment)."""
    import h5py

    deadline = time.time() + seconds
    while True:
        try:
            h5py.File(path, "r").close()
            return
        except BlockingIOError:
            assert time.time() < deadline, f"{path} is still locked: a rank survived"
            time.sleep(0.2)
