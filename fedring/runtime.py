"""Failure handling across ranks: no exception on any rank may leave ``mpirun`` hanging.

- Configuration errors are found on every rank before any work; the ranks agree with one
  collective that somebody failed, and all exit with code 2 (the failing rank says why).
- Any other exception ends the whole job within seconds: the rank prints its traceback;
  rank 0 marks the results file ``failed`` and calls ``MPI_Abort``. Another rank first tells
  rank 0 through a private communicator, on which a watchdog thread of rank 0 listens, so
  the file is marked even while rank 0 is blocked in a message; if rank 0 does not act
  within a few seconds, the failing rank aborts the job itself.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

from mpi4py import MPI

from .errors import ConfigError

_ERROR_TAG = 77
EXIT_CONFIG = 2


def agree_on_config_error(comm: MPI.Comm, error: ConfigError | None) -> None:
    """Collective: if any rank hit a configuration error, every rank exits with code 2.

    Rank 0 prints the error of the lowest failing rank, once.
    """
    errors = comm.allgather(None if error is None else str(error))
    failed = [(rank, text) for rank, text in enumerate(errors) if text is not None]
    if not failed:
        return
    if comm.rank == 0:
        rank, text = failed[0]
        where = "" if rank == 0 else f" (on rank {rank})"
        print(f"fedring: error{where}: {text}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_CONFIG)


class Guard:
    """Turns an exception on any rank into a prompt, clean abort of the whole job."""

    def __init__(self, comm: MPI.Comm | None = None, grace_seconds: float = 5.0):
        self.comm = (MPI.COMM_WORLD if comm is None else comm).Dup()
        self.grace = grace_seconds
        self.on_failure: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self._thread = None
        if self.comm.rank == 0 and self.comm.size > 1:
            self._thread = threading.Thread(target=self._watch, name="fedring-watchdog", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        status = MPI.Status()
        while not self._stop.wait(0.1):
            if self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_ERROR_TAG, status=status):
                self.comm.recv(source=status.Get_source(), tag=_ERROR_TAG)
                self._fail_and_abort()

    def _fail_and_abort(self) -> None:
        for callback in self.on_failure:
            try:
                callback()
            except Exception:  # the abort must happen whatever the callback does
                traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)

    def fail(self, exc: BaseException) -> None:
        """Report ``exc`` with its traceback and end the whole job; does not return."""
        rank = self.comm.rank
        text = "".join(traceback.format_exception(exc))
        sys.stderr.write(f"fedring: rank {rank} failed:\n{text}")
        sys.stderr.flush()
        if rank == 0:
            self._fail_and_abort()
        # Tell rank 0 so it marks the results file; abort ourselves if it does not act.
        self.comm.isend(rank, dest=0, tag=_ERROR_TAG)
        time.sleep(self.grace)
        MPI.COMM_WORLD.Abort(1)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def run(self, fn: Callable[[], int]) -> int:
        """Run ``fn``; a ``SystemExit`` passes through, any other exception aborts the job."""
        try:
            return fn()
        except SystemExit:
            raise
        except BaseException as exc:  # noqa: BLE001 - includes KeyboardInterrupt on purpose
            self.fail(exc)
            raise  # unreachable: fail() aborts
        finally:
            self.close()


class StopRequest:
    """SIGTERM / SIGUSR1 (SLURM's warning before a time limit or preemption) ask the run to
    stop after the current round. Installed first thing, so an early signal is not fatal;
    the ranks agree on it with one tiny collective per round."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def agreed(self, comm: MPI.Comm) -> bool:
        return comm.allreduce(self.requested, op=MPI.LOR)
