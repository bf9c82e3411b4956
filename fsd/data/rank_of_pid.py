"""Which rank sent a request: the caller's pid, from the FUSE request, to the rank its environment names.

The kernel names the calling thread in every FUSE request (its id in the daemon's pid namespace,
0 if the caller is outside it). A rank's environment, which its DataLoader workers inherit (fork,
spawn and forkserver alike), names its rank; the first of :data:`RANK_VARS` that holds a
non-negative integer wins:

* ``RANK``: torchrun (also under srun, where ``SLURM_PROCID`` counts nodes, not ranks);
* ``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``, ``PMIX_RANK``: Open MPI, MPICH/Intel MPI (and srun's PMI2),
  PMIx launchers;
* ``SLURM_PROCID``: srun (last: inside an allocation the batch step's value would mislead ``mpirun``).

``/proc/PID/environ`` is the environment the process was started (exec'd) with: a rank that sets
``os.environ["RANK"]`` itself (``mp.spawn`` without a launcher) names none, and its reads fall back
to the tracker's inference. So does any process that names no rank (a tool outside the job).

:class:`Callers` caches the answer per pid and is read on the trio loop without I/O;
:func:`resolve` reads ``/proc`` on a worker thread. Both files are read through one descriptor of
``/proc/PID``, which stays bound to the process it was opened for, so the start time
(``/proc/PID/stat`` field 22) and the environment are of one process. An entry older than
``RECHECK_S`` is resolved again at its next request: a pid reused by a new process (another
start time) or an ``exec`` with another environment is noticed then.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from fsd.data import tuning

log = logging.getLogger(__name__)

RANK_VARS: tuple[str, ...] = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
RECHECK_S = tuning.RANK_RECHECK_S
MAX_PIDS = tuning.RANK_MAX_PIDS


@dataclass(frozen=True)
class Caller:
    """What a pid's environment says: its rank (None: none named) and the variable that named it;
    ``start`` is the process's start time (clock ticks since boot, -1: not readable)."""

    rank: int | None
    var: str | None
    start: int


NO_RANK = Caller(None, None, -1)


def _start_time(stat: bytes) -> int:
    """Field 22 of ``/proc/PID/stat`` (the command name in field 2 may hold spaces and parentheses)."""
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def rank_in(environ: bytes, names: tuple[str, ...] = RANK_VARS) -> tuple[int | None, str | None]:
    """The rank a NUL-separated environment names, and the variable: the first of *names* holding a
    non-negative integer; ``(None, None)`` if none does."""
    env: dict[bytes, bytes] = {}
    for kv in environ.split(b"\0"):
        k, sep, v = kv.partition(b"=")
        if sep:
            env.setdefault(k, v)
    for name in names:
        v = env.get(name.encode())
        if v is not None and v.strip().isdigit():
            return int(v), name
    return None, None


def resolve(pid: int, proc: str = "/proc") -> Caller:
    """What *pid*'s environment says (blocking: worker threads only). A process gone, or whose
    environment this daemon may not read (another user's, without root), names no rank."""
    try:
        d = os.open(f"{proc}/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return NO_RANK
    try:
        with open(os.open("stat", os.O_RDONLY | os.O_CLOEXEC, dir_fd=d), "rb") as f:
            start = _start_time(f.read())
        with open(os.open("environ", os.O_RDONLY | os.O_CLOEXEC, dir_fd=d), "rb") as f:
            environ = f.read()
    except (OSError, ValueError, IndexError) as e:
        log.debug("pid %d: environment not readable: %s", pid, e)
        return NO_RANK
    finally:
        os.close(d)
    rank, var = rank_in(environ)
    return Caller(rank, var, start)


class Callers:
    """pid -> :class:`Caller`, cached; the trio loop asks :meth:`cached` (no I/O), and on a miss runs
    :meth:`resolve` on a worker thread and hands the answer to :meth:`learn`. Only the loop changes
    the cache."""

    def __init__(self, proc: str = "/proc", clock: Callable[[], float] | None = None,
                 recheck_s: float = RECHECK_S, max_pids: int = MAX_PIDS) -> None:
        self.proc = proc
        self.clock = clock or time.monotonic
        self.recheck_s = recheck_s
        self.max_pids = max_pids
        self._cache: dict[int, tuple[Caller, float]] = {}  # pid -> (caller, when resolved); insertion = age
        self.resolves = 0
        self.reused = 0  # pids seen again as another process (another start time)
        self.requests_named = 0  # requests whose caller named a rank
        self.requests_unnamed = 0  # ... named none (or had no pid)

    def cached(self, pid: int) -> Caller | None:
        """The caller of a request from *pid* if known and fresh, else None (resolve it then)."""
        if pid <= 0:
            return NO_RANK
        got = self._cache.get(pid)
        if got is None or self.clock() - got[1] >= self.recheck_s:
            return None
        return got[0]

    def resolve(self, pid: int) -> Caller:
        """Read *pid*'s ``/proc`` entries (worker thread)."""
        return resolve(pid, self.proc)

    def learn(self, pid: int, caller: Caller) -> Caller:
        """Cache what :meth:`resolve` found for *pid* (the loop); returns it."""
        self.resolves += 1
        old = self._cache.pop(pid, None)
        if old is not None and old[0].start >= 0 and caller.start >= 0 and old[0].start != caller.start:
            self.reused += 1
            log.debug("pid %d is another process now (rank %s, was %s)", pid, caller.rank, old[0].rank)
        self._cache[pid] = (caller, self.clock())
        while len(self._cache) > self.max_pids:
            del self._cache[next(iter(self._cache))]
        return caller

    def rank(self, caller: Caller) -> int | None:
        """Count a request of *caller*; its rank."""
        if caller.rank is None:
            self.requests_unnamed += 1
        else:
            self.requests_named += 1
        return caller.rank

    def status(self) -> dict:
        """For ``.fsd/status`` (``rank_attribution``)."""
        by_var = Counter(c.var or "none" for c, _ in list(self._cache.values()))  # one copy: the loop adds
        return {"processes": len(self._cache), "by_variable": dict(sorted(by_var.items())),
                "requests_named": self.requests_named, "requests_unnamed": self.requests_unnamed,
                "resolves": self.resolves, "reused_pids": self.reused}
