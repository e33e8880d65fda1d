"""Keeping torch's intra-op thread count at the cores other processes leave free.

Every torch op that runs in parallel ends in a barrier of all its OpenMP threads. When
another process occupies one of the cores, the thread on it runs only when the scheduler
gives it a slice, and each of the hundreds of ops in a decode step waits for that: measured
on a 2-core machine under another process's load, a 2-thread engine decoded at 14 tokens/s
where a 1-thread one made 85 (docs/benchmarks/cpu.md). On a quiet machine the second
thread is worth ~1.4x. So the count follows the load: once per interval the governor reads
how much CPU time the allowed cores spent on other processes (/proc/stat minus this
process's own time from /proc/self/stat) and sets ``round(cores - busy elsewhere)`` threads,
between 1 and the count the engine started with (CORE_NUM_THREADS or torch's default).
A new count applies after two consecutive samples agree, so one burst does not flap it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""/proc/stat cpu columns counted as busy: user, nice, system, irq, softirq, steal."""


def read_cpu_busy(cpus: frozenset[int], path: str = "/proc/stat") -> int:
    """Busy clock ticks of the given CPUs since boot."""
    total = 0
    with open(path) as f:
        for line in f:
            head, _, rest = line.partition(" ")
            if not head.startswith("cpu") or head == "cpu" or int(head[3:]) not in cpus:
                continue
            values = rest.split()
            total += sum(int(values[i]) for i in _BUSY_FIELDS if i < len(values))
    return total


def read_self_ticks(path: str = "/proc/self/stat") -> int:
    """This process's user + system clock ticks since it started."""
    with open(path) as f:
        fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of the line)


class ThreadGovernor:
    """Adjusts ``torch.set_num_threads`` to the load; call :meth:`tick` once per engine step.

    :param ceiling: most threads to use (the count the engine was started with).
    :param cpus: the CPUs this process may run on.
    :param interval: seconds between load samples.
    """

    def __init__(
        self,
        ceiling: int,
        cpus: frozenset[int],
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        read_busy: Callable[[frozenset[int]], int] = read_cpu_busy,
        read_self: Callable[[], int] = read_self_ticks,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ):
        self.ceiling = max(1, ceiling)
        self.cpus = cpus
        self.interval = interval
        self._clock, self._read_busy, self._read_self, self._set = clock, read_busy, read_self, set_threads
        self._ticks_per_s = os.sysconf("SC_CLK_TCK")
        self.threads = self.ceiling
        self._pending: int | None = None
        self._last: tuple[float, int, int] | None = None

    def tick(self) -> None:
        now = self._clock()
        if self._last is not None and now - self._last[0] < self.interval:
            return
        try:
            busy, own = self._read_busy(self.cpus), self._read_self()
        except (OSError, ValueError, IndexError):  # no /proc (not Linux): keep the count
            self.ceiling = self.threads
            return
        if self._last is not None:
            self._decide(now - self._last[0], busy - self._last[1], own - self._last[2])
        self._last = (now, busy, own)

    def _decide(self, seconds: float, busy: int, own: int) -> None:
        elsewhere = max(0.0, (busy - own) / (seconds * self._ticks_per_s))  # cores used by others
        want = min(self.ceiling, max(1, round(len(self.cpus) - elsewhere)))
        if want == self.threads:
            self._pending = None
        elif want == self._pending:
            self.threads, self._pending = want, None
            self._set(want)
        else:
            self._pending = want
