"""The clock's CPU bench (bench/clock.py) and a busy machine (planning/clock/contention.py,
cpu_measured.py): what is measured while other work holds the CPUs is said, and measured again
once they are quiet."""

from __future__ import annotations

import json

import pytest

from scaletrain.errors import UserError

pytestmark = pytest.mark.unit


# -- the bench --------------------------------------------------------------------------------


def test_an_unknown_suite_configuration_is_one_line():
    from scaletrain.bench.clock import run_suite

    with pytest.raises(UserError, match="--only nope: no such configuration; accepted: tiny ddp mb16 s128"):
        run_suite(1, 4, __import__("pathlib").Path("/nonexistent"), ["nope"], None, print)


def test_a_bench_into_an_earlier_ones_folder_runs_each_configuration_afresh(monkeypatch, tmp_path):
    """bench/clock.py measure: an earlier bench's run of the same configuration and round (its
    final checkpoint, which train.resume=never refuses) is gone before the run starts."""
    from scaletrain.bench import clock

    run_dir = tmp_path / "runs" / "tiny-ddp-mb1-s64-w1-0"
    (run_dir / "checkpoints" / "step_13").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"event": "interval", "step_s": 9.0, "phases": {}}\n')

    def run(cmd, log, what):
        assert not run_dir.exists(), "the earlier run is still there"
        run_dir.mkdir()
        rows = [{"event": "interval", "step_s": s, "phases": {"forward_s": s / 2}} for s in (1.0, 0.2, 0.4)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    monkeypatch.setattr(clock, "run_logged", run)
    step, phases = clock.measure(clock.CASES[1], 13, 3, run_dir)
    assert step == pytest.approx(0.3) and phases == {"forward_s": pytest.approx(0.15)}  # the first interval left out


def test_the_bench_predicts_again_once_quiet_where_a_prediction_used_busy_times(monkeypatch):
    """bench/clock.py: a prediction priced with times taken on a busy machine is made again
    after waiting for quiet; a machine still busy after the wait is not waited on again.
    Planted: the second prediction left out fails the first assertion (1 call, not 2)."""
    from scaletrain.bench import clock
    from scaletrain.planning.clock import cpu_measured

    calls, waits, quiet = [], [], {"after_wait": True, "busy": True}

    def predict(case):
        calls.append(case)
        if quiet["busy"]:
            cpu_measured.BUSY_MEASURED["x"] = 1.0
        return len(calls)

    def wait(say):
        waits.append(1)
        quiet["busy"] = False
        return quiet["after_wait"]

    monkeypatch.setattr(cpu_measured, "BUSY_MEASURED", {})
    monkeypatch.setattr(clock, "predict", predict)
    monkeypatch.setattr(clock, "wait_for_quiet", wait)
    said: list[str] = []
    case = clock.CASES[0]
    assert clock._predicted_quietly(case, said.append, True) == (2, True) and len(waits) == 1
    assert "busy machine" in said[0]
    calls.clear()  # quiet, no busy times: predicted once
    assert clock._predicted_quietly(case, said.append, True) == (1, True) and len(waits) == 1
    quiet.update(busy=True, after_wait=False)  # busy past the wait: not patient after it
    calls.clear()
    assert clock._predicted_quietly(case, said.append, True) == (2, False) and len(waits) == 2
    calls.clear()
    quiet["busy"] = True
    assert clock._predicted_quietly(case, said.append, False) == (1, False) and len(waits) == 2


# -- a busy machine (clock/contention.py) ---------------------------------------------------


def test_other_processes_spinning_on_every_core_read_as_busy():
    import subprocess
    import sys

    from scaletrain.planning.clock import contention

    if contention.others_cores() is None and contention._machine_seconds() is None:
        pytest.skip("this machine's CPU counters are not readable: every measurement counts as quiet, as documented")
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(contention.cores())]
    try:
        import time

        time.sleep(0.3)  # the spinners started
        contention._LAST = (-1e9, None)  # a fresh probe, not the one kept from before
        # Each spinner keeps a core busy whatever else runs: together at least all but a
        # fraction of the machine, far past the threshold of a quarter of it.
        others = contention.busy(1)
        assert others is not None and others >= 0.5 * contention.cores(), others
        # The clock's bench waits for a quiet machine before it calibrates, and says when it
        # gave up (bench/clock.py): the spinners never stop, so it waits its whole limit.
        waited, still = contention.wait_quiet(1, 3.0)
        assert 3.0 <= waited < 6.0 and still is not None and still >= 0.5 * contention.cores(), (waited, still)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
        contention._LAST = (-1e9, None)


def test_a_time_measured_on_a_busy_machine_is_measured_again_once_it_is_quiet(tmp_path, monkeypatch):
    """The tiny preset's step priced at 0.30 s against 0.05 s measured: the cache had kept
    replays timed while a test suite filled both cores. Planted: `usable` accepting a busy
    entry whatever the machine is doing now fails the second measurement's count."""
    from scaletrain.planning.clock import contention, cpu_measured

    monkeypatch.setenv("SCALETRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_measured, "BUSY_MEASURED", {})
    now = {"busy": 1.9}
    monkeypatch.setattr(contention, "busy", lambda threads: now["busy"])
    times = iter([0.5, 0.001, 0.002])
    measured = []

    def measure() -> float:
        measured.append(1)
        return next(times)

    key = ("test-call", 2, "mm", "[]")
    assert cpu_measured._kept(2, measure, *key) == 0.5  # busy: measured and kept, marked
    assert cpu_measured.busy_note() and "busy" in cpu_measured.busy_note()[0] and "1.9 of" in cpu_measured.busy_note()[0]
    assert cpu_measured._kept(2, measure, *key) == 0.5 and len(measured) == 1  # still busy: the busy entry serves
    now["busy"] = None
    assert cpu_measured._kept(2, measure, *key) == 0.001 and len(measured) == 2  # quiet: measured again
    now["busy"] = 1.9
    assert cpu_measured._kept(2, measure, *key) == 0.001 and len(measured) == 2  # a quiet entry serves a busy process
    # An older file's bare number (busy or not, nobody knows) is measured again.
    digest = __import__("hashlib").sha256(json.dumps(cpu_measured.cpu_key(*key)).encode()).hexdigest()
    (tmp_path / cpu_measured.CALLS_FILE / f"{digest}.json").write_text(json.dumps(0.7))
    now["busy"] = None
    assert cpu_measured._kept(2, measure, *key) == 0.002 and len(measured) == 3


def test_a_replay_timed_on_a_busy_machine_is_timed_again_by_the_process_once_quiet(tmp_path, monkeypatch):
    """CI's clock test (2026-12-01): its world-1 configurations predicted 2-5x their steps in
    both rounds, the second reusing this process's memory of the first's slow replays. A replay
    timed busy serves while the machine stays busy and is timed again once it is quiet; one
    timed quiet is kept. Planted: the process's cache keeping busy values as quiet ones fails
    the third call (0.5, not 0.001)."""
    from scaletrain.planning.clock import contention, cpu_measured, replay

    monkeypatch.setenv("SCALETRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_measured, "BUSY_MEASURED", {})
    now = {"busy": 1.4}
    monkeypatch.setattr(contention, "busy", lambda threads: now["busy"])
    times = iter([0.5, 0.001])
    timed = []

    def seconds(op: str, args: str) -> float:
        timed.append(op)
        return next(times)

    monkeypatch.setattr(replay, "seconds", seconds)
    cpu_measured._replayed.cache_clear()
    try:
        call = ("aten.mm.default", "[[], {}]", 2)
        assert cpu_measured._replayed(*call) == 0.5 and cpu_measured.busy_note()
        assert cpu_measured._replayed(*call) == 0.5 and len(timed) == 1  # still busy: served, not timed again
        now["busy"] = None
        assert cpu_measured._replayed(*call) == 0.001 and len(timed) == 2  # timed again, quiet
        assert not cpu_measured.busy_note()  # what this process now prices with was timed quiet
        now["busy"] = 1.4
        assert cpu_measured._replayed(*call) == 0.001 and len(timed) == 2  # kept: not timed a third time
    finally:
        cpu_measured._replayed.cache_clear()


_STAT = """cpu  300 0 100 1000 10 0 5 40 0 0
cpu0 100 0 50 500 5 0 0 30 0 0
cpu1 200 0 50 500 5 0 5 10 0 0
intr 12345
"""


def test_the_busy_probe_counts_everything_on_this_processes_cpus(monkeypatch):
    """What kept the CPUs this process runs on from it: every process on them, the kernel's
    threads and a virtual machine's steal, which a container's cgroup counter does not see; a
    cgroup's own counter where a CPU quota makes the container a slice of a shared host."""
    from scaletrain.planning.clock import contention

    tick = __import__("os").sysconf("SC_CLK_TCK")
    # user + nice + system + irq + softirq + steal; idle and iowait not
    assert contention._stat_seconds(_STAT, {0}) == pytest.approx((100 + 50 + 30) / tick)
    assert contention._stat_seconds(_STAT, {0, 1}) == pytest.approx((180 + 265) / tick)
    assert contention._stat_seconds(_STAT, {0, 7}) == pytest.approx(445 / tick)  # no line for cpu7: the total's
    assert contention._stat_seconds(_STAT, None) == pytest.approx(445 / tick)
    assert contention._stat_seconds("cpu  x y\n", {0}) is None
    assert not contention._has_quota("max 100000\n") and not contention._has_quota(None)
    assert contention._has_quota("150000 100000\n")
    files = {"/proc/stat": _STAT, "/sys/fs/cgroup/cpu.stat": "usage_usec 2500000\nuser_usec 2000000\n"}
    monkeypatch.setattr(contention, "_read", files.get)
    monkeypatch.setattr(contention, "_affinity", lambda: {1})
    assert contention._machine_seconds() == pytest.approx(265 / tick)  # no quota: this CPU's line
    files["/sys/fs/cgroup/cpu.max"] = "150000 100000"
    assert contention._machine_seconds() == pytest.approx(2.5)  # a quota: the cgroup's own usage
    del files["/proc/stat"], files["/sys/fs/cgroup/cpu.max"]
    assert contention._machine_seconds() == pytest.approx(2.5)  # no /proc/stat: the cgroup's
    del files["/sys/fs/cgroup/cpu.stat"]
    assert contention._machine_seconds() is None


def test_a_calibration_on_a_busy_machine_says_so():
    from scaletrain.planning.clock.calibrate import busy

    assert busy(1e9, 1e9) == ""
    line = busy(1e9, 1e9, others=1.8)
    assert "busy" in line and "1.8" in line and "calibrate again" in line and "\n" not in line
    assert "busy" in busy(1e9, 0.5e9)  # the matmul before and after, as before
