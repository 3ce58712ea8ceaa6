"""CpuThreads: torch's intra-op threads follow the cores other processes leave free, read
from /proc/stat (a written one, then the machine's own with a busy process beside us)."""

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from nanovllm.worker import cpu_threads
from nanovllm.worker.cpu_threads import CpuThreads


@pytest.fixture
def threads():
    """torch's thread count, put back after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class FakeMachine:
    """A /proc/stat of 3 CPUs in ticks of 1/100 s, this process's CPU time and a clock."""

    def __init__(self, tmp_path, monkeypatch) -> None:
        self.path = tmp_path / "stat"
        self.now, self.own = 1000.0, 0.0
        self.busy, self.idle = [0, 0, 0], [0, 0, 0]
        monkeypatch.setattr(cpu_threads, "PROC_STAT", str(self.path))
        monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(cpu_threads.os, "times", lambda: SimpleNamespace(
            user=0.75 * self.own, system=0.25 * self.own))
        monkeypatch.setattr(cpu_threads.os, "sysconf", lambda name: 100)
        self.write()

    def write(self) -> None:
        # user nice system idle iowait irq softirq steal guest guest_nice; busy time spread
        # over user, system and irq, idle time over idle and iowait (not busy); guest time is
        # part of user already (the kernel counts it in both)
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
        for i, (b, d) in enumerate(zip(self.busy, self.idle)):
            user, system = b // 2, b // 4
            lines.append(f"cpu{i} {user} 0 {system} {d - d // 3} {d // 3} {b - user - system}"
                         f" 0 0 {user // 2} 0")
        lines.append("intr 12345 0 0")
        self.path.write_text("\n".join(lines) + "\n")

    def run(self, seconds: float, own_cores: float, busy_cores: list[float]) -> None:
        """`seconds` pass: this process used `own_cores`, on top of which each CPU was busy
        `busy_cores[i]` of the time (ours counted in, spread over the CPUs we use)."""
        self.now += seconds
        self.own += own_cores * seconds
        self.busy = [b + round(c * seconds * 100) for b, c in zip(self.busy, busy_cores)]
        self.idle = [d + round((1 - c) * seconds * 100) for d, c in zip(self.idle, busy_cores)]
        self.write()


def test_threads_follow_the_cores_others_leave(tmp_path, monkeypatch, threads):
    m = FakeMachine(tmp_path, monkeypatch)
    torch.set_num_threads(2)
    ct = CpuThreads(max_threads=2, cpus=[0, 1])  # CPU 2 is not ours: its load never counts
    m.run(0.5, 0.0, [1.0, 0.0, 1.0])
    ct.update()
    assert torch.get_num_threads() == 2  # under INTERVAL since the last look: no change
    m.run(0.5, 1.0, [1.0, 1.0, 1.0])  # a second: we used 1 core, another process 1 core
    ct.update()
    assert torch.get_num_threads() == 1 and ct.others == pytest.approx(1.0, abs=0.02)
    m.run(1.0, 1.0, [1.0, 0.2, 1.0])  # the other process only wakes now and then (0.2)
    ct.update()
    assert torch.get_num_threads() == 2 and ct.others == pytest.approx(0.2, abs=0.02)
    m.run(1.0, 2.0, [1.0, 1.0, 0.0])  # ours alone on both cores
    ct.update()
    assert torch.get_num_threads() == 2
    m.run(4.0, 1.0, [0.5, 0.6, 0.0])  # a longer look: others took 0.1 core on average
    ct.update()
    assert torch.get_num_threads() == 2
    capped = CpuThreads(max_threads=1, cpus=[0, 1])  # never beyond torch's default
    m.run(1.0, 0.0, [0.0, 0.0, 0.0])
    capped.update()
    assert torch.get_num_threads() == 1
    m.run(1.0, 0.0, [1.0, 1.0, 1.0])  # others on every core: still one thread
    ct.update()
    assert torch.get_num_threads() == 1


@pytest.mark.skipif(not os.path.exists("/proc/stat") or not hasattr(os, "sched_getaffinity")
                    or len(os.sched_getaffinity(0)) < 2, reason="Linux with 2+ CPUs")
def test_a_busy_process_on_one_of_our_cpus_takes_a_thread(threads):
    cpus = sorted(os.sched_getaffinity(0))[:2]
    torch.set_num_threads(2)
    ct = CpuThreads(max_threads=2, cpus=cpus)
    spin = (f"import os, time; os.sched_setaffinity(0, {{{cpus[0]}}}); "
            "end = time.time() + 30\nwhile time.time() < end: pass")
    hog = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)  # it starts spinning
        ct.update()  # a first look, to start the window while it spins
        time.sleep(cpu_threads.INTERVAL + 0.1)
        ct.update()
        assert torch.get_num_threads() == 1
    finally:
        hog.kill()
        hog.wait()


def test_an_engine_on_a_cpu_adapts_unless_num_threads_is_set(tiny_llama, threads):
    from nanovllm import LLM

    before = torch.get_num_threads()
    adapting = LLM(str(tiny_llama), device="cpu", kv_cache_gib=0.01).engine.runner
    assert (adapting.cpu_threads is not None) == os.path.exists("/proc/stat")
    if adapting.cpu_threads is not None:  # never more than torch's own default
        assert adapting.cpu_threads.max_threads == before
    fixed = LLM(str(tiny_llama), device="cpu", kv_cache_gib=0.01, num_threads=1).engine.runner
    assert fixed.cpu_threads is None and torch.get_num_threads() == 1


def test_an_unreadable_proc_stat_leaves_the_threads_and_the_step_alone(
        tmp_path, monkeypatch, threads, caplog):
    m = FakeMachine(tmp_path, monkeypatch)
    torch.set_num_threads(2)
    ct = CpuThreads(max_threads=2, cpus=[0, 1])
    m.path.write_text("cpu0 garbage\n")  # not /proc/stat's format any more
    m.run(1.0, 0.0, [1.0, 1.0, 1.0])
    m.path.write_text("cpu0 garbage\n")
    ct.update()  # logs, does not raise
    assert torch.get_num_threads() == 2 and "cannot read" in caplog.text
    m.now += 5.0
    ct.update()  # and stops looking
    monkeypatch.setattr(cpu_threads, "PROC_STAT", str(tmp_path / "missing"))
    assert CpuThreads.create() is None
