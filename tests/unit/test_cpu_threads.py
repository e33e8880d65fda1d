"""The CPU thread governor: follows other processes' load, with a one-sample hysteresis."""

from __future__ import annotations

import os

from platforms.cpu.threads import ThreadGovernor, read_cpu_busy, read_self_ticks

HZ = os.sysconf("SC_CLK_TCK")


class FakeMachine:
    """Clock, /proc counters and torch.set_num_threads of a 2-CPU machine, advanced by hand."""

    def __init__(self):
        self.now, self.busy, self.own, self.calls = 0.0, 0, 0, []

    def run(self, seconds: float, others: float, ours: float) -> None:
        """``seconds`` pass with ``others`` and ``ours`` cores busy."""
        self.now += seconds
        self.own += round(ours * seconds * HZ)
        self.busy += round((ours + others) * seconds * HZ)

    def governor(self, ceiling: int = 2) -> ThreadGovernor:
        return ThreadGovernor(ceiling, frozenset({0, 1}), interval=1.0, clock=lambda: self.now,
                              read_busy=lambda cpus: self.busy, read_self=lambda: self.own,
                              set_threads=self.calls.append)


def test_drops_to_free_cores_under_load_and_returns_when_quiet() -> None:
    m = FakeMachine()
    g = m.governor()
    g.tick()  # first sample
    for _ in range(2):
        m.run(1.0, others=1.0, ours=1.0)
        g.tick()
    assert g.threads == 1 and m.calls == [1]
    for _ in range(2):
        m.run(1.0, others=0.1, ours=1.0)
        g.tick()
    assert g.threads == 2 and m.calls == [1, 2]


def test_one_busy_sample_does_not_change_the_count() -> None:
    m = FakeMachine()
    g = m.governor()
    g.tick()
    m.run(1.0, others=1.5, ours=0.5)
    g.tick()
    m.run(1.0, others=0.0, ours=2.0)
    g.tick()
    m.run(1.0, others=0.0, ours=2.0)
    g.tick()
    assert g.threads == 2 and m.calls == []


def test_samples_only_once_per_interval_and_respects_the_ceiling() -> None:
    m = FakeMachine()
    g = m.governor(ceiling=1)
    g.tick()
    for _ in range(3):
        m.run(0.2, others=0.0, ours=1.0)
        g.tick()  # within the interval: no sample taken
    assert g.threads == 1
    for _ in range(3):
        m.run(1.0, others=0.0, ours=1.0)
        g.tick()
    assert g.threads == 1 and m.calls == []  # two free cores, but the ceiling is one


def test_proc_readers_parse_the_kernel_formats(tmp_path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  100 0 50 900 5 0 0 0 0 0\n"
        "cpu0 10 1 5 400 3 2 1 7 0 0\n"
        "cpu1 20 0 10 500 2 0 0 0 0 0\n"
        "cpu2 1000 0 0 0 0 0 0 0 0 0\n"
        "intr 12345\n"
    )
    # cpu0: user 10 + nice 1 + system 5 + irq 2 + softirq 1 + steal 7 = 26; cpu1: 30
    assert read_cpu_busy(frozenset({0, 1}), str(stat)) == 56
    me = tmp_path / "self"
    me.write_text("4242 (python (my engine)) R 1 2 3 4 5 6 7 8 9 10 311 27 0 0 20 0 3 0 100\n")
    assert read_self_ticks(str(me)) == 338
