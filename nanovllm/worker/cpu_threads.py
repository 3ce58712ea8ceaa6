"""Torch's intra-op threads on a CPU, kept to the cores that other processes leave free.

torch's OpenMP threads spin at the end of every parallel region until the whole team is
there, so one thread the OS has descheduled stalls all of them. On the 2-core VM the
default model decoded at 181 tok/s with 2 threads on an idle machine, but at 50 with 2
threads and 148 with 1 while another process kept one core busy. A laptop is rarely idle.

`CpuThreads.update` runs once a step. About once a second it reads how much CPU time
other processes took on this process's CPUs (/proc/stat, less this process's own time)
and sets torch's thread count to what they leave free: at most torch's default, at least
one. Linux only; elsewhere, and when `num_threads` is set, torch's setting stands.
"""

import logging
import os
import time

import torch

log = logging.getLogger("nanovllm")

PROC_STAT = "/proc/stat"
INTERVAL = 1.0  # seconds between looks
# others' use of a core, in cores, that still leaves a thread its core: a process waking
# now and then costs less than giving up a whole thread
MARGIN = 0.3


class CpuThreads:
    """Adjusts torch.set_num_threads to the cores free of other processes (see module)."""

    def __init__(self, max_threads: int, cpus: list[int]) -> None:
        self.max_threads = max_threads
        self.cpus = cpus
        self._tick = os.sysconf("SC_CLK_TCK")
        self._last = self._sample()
        self.others = 0.0  # cores other processes took over the last look

    @classmethod
    def create(cls) -> "CpuThreads | None":
        """An adjuster over this process's CPUs, capped at torch's current thread count;
        None where /proc/stat or CPU affinity is not there to read."""
        if not hasattr(os, "sched_getaffinity"):
            return None
        try:
            return cls(torch.get_num_threads(), sorted(os.sched_getaffinity(0)))
        except (OSError, ValueError, IndexError):  # no /proc/stat, or not in its format
            return None

    def _sample(self) -> tuple[float, float, float]:
        """(now, CPU seconds busy on our CPUs since boot, this process's CPU seconds)."""
        wanted = {f"cpu{i}" for i in self.cpus}
        busy = 0
        with open(PROC_STAT) as f:
            for line in f:
                if not line.startswith("cpu"):
                    break  # the cpu lines come first
                name, *fields = line.split()
                if name in wanted:
                    # user nice system idle iowait irq softirq steal ...: all but idle and
                    # iowait are busy (steal: the hypervisor ran another machine there)
                    ticks = [int(x) for x in fields[:8]]
                    busy += sum(ticks) - ticks[3] - ticks[4]
        own = os.times()
        return time.monotonic(), busy / self._tick, own.user + own.system

    def update(self) -> None:
        """Once INTERVAL has passed: the thread count for the cores others left free."""
        if self._last is None or time.monotonic() - self._last[0] < INTERVAL:
            return
        try:
            now = self._sample()
        except (OSError, ValueError, IndexError) as e:  # a step never fails for this
            log.warning("CPU threads stay at %d: cannot read %s (%s)",
                        torch.get_num_threads(), PROC_STAT, e)
            self._last = None
            return
        (t0, busy0, own0), (t1, busy1, own1) = self._last, now
        self._last = now
        self.others = others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)
        target = min(self.max_threads, max(1, int(len(self.cpus) - others + MARGIN)))
        if target != torch.get_num_threads():
            log.debug("CPU threads %d -> %d (other processes took %.1f of %d cores)",
                      torch.get_num_threads(), target, others, len(self.cpus))
            torch.set_num_threads(target)
