"""Running one job on every rank: no exception, bad setting or signal may leave ``mpirun`` hanging.

- Configuration errors are found on every rank before any work; the ranks agree with one
  collective that somebody failed, and all exit with code 2 (rank 0 says why, once). A check
  only rank 0 can make (a file it reads) is made there and its verdict broadcast
  (:func:`on_rank0`).
- SIGTERM, SIGINT and SIGUSR1 (``scancel``, Ctrl-C, SLURM's ``--signal``) ask the job to stop
  after the current round or trial: it checkpoints, marks its file ``preempted`` and exits
  with code 75. If it has not stopped within ``stop_grace`` seconds (a rank stuck in MPI, a
  hung or stopped peer), or on a second signal, the :class:`Watchdog` marks the file
  ``preempted`` (every completed round is in it; ``--resume`` continues from the last
  checkpoint) and calls ``MPI_Abort``: the job ends. Python's C-level signal handler writes
  the signal number into a pipe even while the main thread is blocked in an MPI call, and a
  watchdog thread on every rank reads it.
- Any other exception ends the whole job within seconds: the rank prints its traceback;
  rank 0 marks the file ``failed`` and calls ``MPI_Abort``. Another rank first tells rank 0
  through a private communicator, which rank 0's watchdog thread polls, so the file is
  marked even while rank 0 is blocked in a message; if rank 0 does not act within a few
  seconds, the failing rank aborts the job itself.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator

from mpi4py import MPI

from .comm.network import first_problem
from .errors import ConfigError, ResultsError
from .results import FileStatus

EXIT_CONFIG = 2
#: exit code of a job stopped by a signal after checkpointing (EX_TEMPFAIL): requeue it
EXIT_PREEMPTED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_ERROR_TAG = 77
#: how much longer than rank 0 the other ranks wait before aborting, so rank 0 marks the file
_PEER_MARGIN = 10.0
#: how long marking the file may take before the abort goes ahead anyway (a hung file system)
_MARK_TIMEOUT = 10.0
#: how long an aborting rank waits after flushing its output, for the launcher to forward it
_FORWARD_SECONDS = 0.5


#: the communicators given to :func:`fedring.cli.main`, innermost last (none: ``MPI.COMM_WORLD``)
_WORLDS: list[MPI.Comm] = []


def world() -> MPI.Comm:
    """The communicator fedring's jobs run on: ``MPI.COMM_WORLD``, or the one given to
    :func:`fedring.cli.main` (a group of the job's ranks, so that several runs share one MPI job)."""
    return _WORLDS[-1] if _WORLDS else MPI.COMM_WORLD


@contextlib.contextmanager
def running_on(comm: MPI.Comm) -> Iterator[None]:
    """:func:`world` is ``comm`` inside the block; a :class:`Watchdog` started there ends with it
    (on every rank of ``comm`` alike, so the next block's ranks all start a new one)."""
    _WORLDS.append(comm)
    try:
        yield
    finally:
        _WORLDS.pop()
        Watchdog.release(comm)


def agree_on_config_error(comm: MPI.Comm, error: ConfigError | None) -> None:
    """Collective: if any rank hit a configuration error, every rank exits with code 2.

    Rank 0 prints the error of the lowest failing rank, once.
    """
    failed, _ = first_problem(comm, None if error is None else str(error))
    if failed is None:
        return
    if comm.rank == 0:
        rank, text = failed
        where = "" if rank == 0 else f" (on rank {rank})"
        print(f"fedring: error{where}: {text}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_CONFIG)


def on_rank0(comm: MPI.Comm, fn: Callable[[], object]):
    """Collective: ``fn()`` runs on rank 0 only; every rank returns its result or raises its ConfigError."""
    result = error = None
    if comm.rank == 0:
        try:
            result = fn()
        except ConfigError as e:
            error = (e.key, e.message)
    error, result = comm.bcast((error, result), root=0)
    if error is not None:
        raise ConfigError(*error)
    return result


class Watchdog:
    """One per process at a time (:meth:`start`, first thing): stop signals with a deadline, failures that abort.

    Jobs run through :meth:`run`; ``on_abort`` callbacks (rank 0, cleared after each job)
    get the status to leave in the results file (``failed`` or ``preempted``) just before
    the job is aborted. ``grace`` is the job's ``stop_grace`` setting.
    """

    _instance: Watchdog | None = None

    @classmethod
    def start(cls) -> Watchdog:
        """The process's watchdog over :func:`world`, installed on first use (signal handlers are
        per process); a process that then runs on another communicator gets a new one."""
        if cls._instance is not None and cls._instance.watched is not world():
            cls.release(cls._instance.watched)
        if cls._instance is None:
            cls._instance = cls(world())
        return cls._instance

    @classmethod
    def release(cls, comm: MPI.Comm) -> None:
        """Close the process's watchdog if it watches ``comm``."""
        if cls._instance is not None and cls._instance.watched is comm:
            cls._instance.close()
            cls._instance = None

    def __init__(self, comm: MPI.Comm | None = None, grace: float = 30.0, fail_grace: float = 5.0):
        self.watched = world() if comm is None else comm
        self.comm = self.watched.Dup()  # failure reports, polled by rank 0's thread
        self._stop_comm = self.watched.Dup()  # the per-round stop agreement, on the main thread
        self.grace, self.fail_grace = grace, fail_grace
        self.on_abort: list[Callable[[FileStatus], None]] = []
        self.signal: int | None = None
        self._deadline: float | None = None
        self._running = self._closed = False
        self._pipe, self._wakeup = os.pipe()
        os.set_blocking(self._wakeup, False)
        self._previous_wakeup = signal.set_wakeup_fd(self._wakeup, warn_on_full_buffer=False)
        self._previous_handlers = {sig: signal.signal(sig, self._note) for sig in STOP_SIGNALS}
        self._thread = threading.Thread(target=self._watch, name="fedring-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """End the thread, free the communicators and the pipe; the signals go back to the handlers
        they had before, unless another watchdog has taken them since."""
        current = signal.set_wakeup_fd(-1)
        if current == self._wakeup:
            signal.set_wakeup_fd(self._previous_wakeup, warn_on_full_buffer=False)
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, handler)
        else:
            signal.set_wakeup_fd(current, warn_on_full_buffer=False)
        self._closed = True
        os.write(self._wakeup, b"\0")  # wakes the thread's select at once
        self._thread.join()
        for fd in (self._pipe, self._wakeup):
            os.close(fd)
        self.comm.Free()
        self._stop_comm.Free()

    # ---- stop signals ----------------------------------------------------------------

    def _note(self, signum, frame) -> None:
        """Python-level handler (runs when the main thread runs Python); the thread does the rest."""
        if self.signal is None:
            self.signal = signum

    def stop_requested(self) -> bool:
        """Collective: did any rank get a stop signal? (One tiny all-reduce per round.)"""
        return self._stop_comm.allreduce(self.signal is not None, op=MPI.LOR)

    def _signalled(self, signum: int) -> None:
        now = time.monotonic()
        margin = 0.0 if self.comm.rank == 0 else _PEER_MARGIN
        if self._deadline is not None:  # a second signal: do not wait any longer
            self._deadline = min(self._deadline, now + margin)
            return
        self.signal = self.signal or signum
        self._deadline = now + self.grace + margin
        if self.comm.rank == 0:
            name = signal.Signals(signum).name
            print(
                f"fedring: {name}: stopping after the current round (aborting if that takes more than "
                f"{self.grace:g} s; a second signal aborts at once)",
                file=sys.stderr,
                flush=True,
            )

    # ---- the watchdog thread ---------------------------------------------------------

    def _watch(self) -> None:
        status = MPI.Status()
        polls_errors = self.comm.rank == 0 and self.comm.size > 1
        while not self._closed:
            if select.select([self._pipe], [], [], 0.1)[0]:
                for signum in os.read(self._pipe, 64):
                    if signum in STOP_SIGNALS:
                        self._signalled(signum)
            if polls_errors and self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_ERROR_TAG, status=status):
                self.comm.recv(source=status.Get_source(), tag=_ERROR_TAG)
                self._abort(FileStatus.FAILED, 1)
            if self._running and self._deadline is not None and time.monotonic() >= self._deadline:
                assert self.signal is not None, "only a signal sets the deadline"
                sys.stderr.write(
                    f"fedring: rank {self.comm.rank}: the job did not stop cleanly after "
                    f"{signal.Signals(self.signal).name}; aborting it (results file: preempted, "
                    "resume from its last checkpoint)\n"
                )
                sys.stderr.flush()  # before marking the file: the launcher forwards it while that runs
                self._abort(FileStatus.PREEMPTED, EXIT_PREEMPTED)

    def _abort(self, status: FileStatus, code: int) -> None:
        """Mark the file (rank 0; given up on after a while) and end the whole job."""
        if self.comm.rank == 0 and self.on_abort:

            def mark():
                for callback in self.on_abort:
                    try:
                        callback(status)
                    except Exception:  # the abort must happen whatever the callback does
                        traceback.print_exc()

            marker = threading.Thread(target=mark, daemon=True)
            marker.start()
            marker.join(_MARK_TIMEOUT)
        sys.stderr.flush()
        sys.stdout.flush()
        # MPI_Abort makes the launcher kill every rank and exit at once; output still in its
        # pipes (this traceback, the abort message) would be lost, so it gets a moment to read them.
        time.sleep(_FORWARD_SECONDS)
        MPI.COMM_WORLD.Abort(code)

    # ---- failures --------------------------------------------------------------------

    def fail(self, exc: BaseException) -> None:
        """Report ``exc`` and end the whole job; does not return.

        A :class:`ConfigError` that escapes the setup phase is reported as one line (exit 2),
        so is a :class:`ResultsError` (exit 1); anything else with its traceback (exit 1).
        """
        rank = self.comm.rank
        if isinstance(exc, (ConfigError, ResultsError)):
            sys.stderr.write(f"fedring: error (rank {rank}): {exc}\n")
            code = EXIT_CONFIG if isinstance(exc, ConfigError) else 1
        else:
            sys.stderr.write(f"fedring: rank {rank} failed:\n{''.join(traceback.format_exception(exc))}")
            code = 1
        sys.stderr.flush()
        if rank == 0 or self.comm.size == 1:
            self._abort(FileStatus.FAILED, code)
        # Tell rank 0 so it marks the results file; abort ourselves if it does not act.
        self.comm.isend(rank, dest=0, tag=_ERROR_TAG)
        time.sleep(self.fail_grace)
        MPI.COMM_WORLD.Abort(code)

    def run(self, fn: Callable[[], int]) -> int:
        """Run ``fn``; a ``SystemExit`` passes through, any other exception aborts the job."""
        self._running = True
        try:
            return fn()
        except SystemExit:
            raise
        except BaseException as exc:
            self.fail(exc)
            raise  # unreachable: fail() aborts
        finally:
            self._running = False
            self.on_abort.clear()


class Progress:
    """Rank 0's progress lines: ``round  50/300  <what>  elapsed 1m02s  ETA 5m10s``.

    On a terminal each line replaces the one before (cut to the terminal's width), so a long
    run keeps one line on screen; into a file or a pipe go the first line, every tenth and the
    last, so a 200-trial log has 21 lines, not 200.
    """

    #: when not on a terminal, one line in this many is written (the first and the last always)
    EVERY = 10

    def __init__(self, unit: str, total: int, quiet: bool, already: float = 0.0, first: int = 0):
        self.unit, self.total, self.quiet = unit, total, quiet
        self.start = time.perf_counter() - already
        self.first, self.first_time = first, time.perf_counter()
        self.lines = 0
        self.tty = not quiet and sys.stdout.isatty()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def line(self, done: int, what: str) -> None:
        if self.quiet:
            return
        self.lines += 1
        per_step = (time.perf_counter() - self.first_time) / max(done - self.first, 1)
        text = (
            f"{self.unit} {done:>{len(str(self.total))}}/{self.total}  {what}  elapsed {_hms(self.elapsed())}  "
            f"ETA {_hms(per_step * (self.total - done))}"
        )
        if self.tty:  # up to the previous progress line, clear it, write this one there
            width = shutil.get_terminal_size().columns - 1
            print(("\x1b[F\x1b[K" if self.lines > 1 else "") + text[:width], flush=True)
        elif self.lines == 1 or self.lines % self.EVERY == 0 or done >= self.total:
            print(text, flush=True)


def _hms(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
