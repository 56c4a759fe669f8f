"""attnbench.measure: the confidence interval of a median, the stopping rule, timing modes, planted slowdowns."""
from __future__ import annotations

import math
import random
import time

import numpy as np
import pytest

from attnbench.measure import TimerError, make_timer, measure_pair, median_ci, median_ci_half_width
from attnbench.measure.pair import _next_batch
from attnbench.measure.timer import CpuTimer, Delay
from attnbench.workload import Workload

TIMING = {"warmup_ms": 0, "rep_ms": 10, "max_ms": 60_000, "min_reps": 10, "max_reps": 100_000,
          "ci_half_width": 0.015, "flush_l2": False}


# --- stats ---------------------------------------------------------------------------------------------

def test_median_ci_covers_the_true_median_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(400):
        lo, hi = median_ci(rng.lognormal(0.0, 0.3, size=101))
        hits += lo <= 1.0 <= hi             # the lognormal(0, σ) median is exactly 1
    assert 0.92 <= hits / 400 <= 0.985


def test_median_ci_half_width_shrinks_as_one_over_sqrt_n():
    rng = np.random.default_rng(1)
    w = {n: np.median([median_ci_half_width(1 + 0.2 * rng.standard_normal(n)) for _ in range(30)])
         for n in (100, 1600)}
    # 1.96 · 1.2533 · σ / √n for a normal sample (the median's standard error), σ = 0.2
    for n, width in w.items():
        assert width == pytest.approx(1.96 * 1.2533 * 0.2 / math.sqrt(n), rel=0.15)
    assert median_ci(range(1, 6)) is None and median_ci_half_width([1.0] * 5) == math.inf


# --- a fake device: workloads draw their own durations, the timer reports them --------------------------

class FakeTimer(CpuTimer):
    """Reports the duration the timed workload drew (no real clock); counts graph captures in graph mode."""

    def __init__(self, mode="eager"):
        self.mode = mode
        self.last_ms = None
        self.armed = 0
        self.disarmed = 0

    def arm(self, body):
        self.armed += 1
        return body

    def disarm(self):
        self.disarmed += 1

    def start(self):
        return None

    def stop(self, start):
        return self.last_ms

    def elapsed_ms(self, token):
        return token


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def fake_workload(timer, clock, ms, spread, seed, prepare=None):
    rng = random.Random(seed)

    def run():
        timer.last_ms = ms * math.exp(rng.gauss(0, spread))
        clock.t += timer.last_ms / 1e3
    return Workload(run=run, prepare=prepare)


def pair(spread=0.2, timing=None, mode="eager", kernel_ms=1.15, **kw):
    timer, clock = FakeTimer(mode), FakeClock()
    k = fake_workload(timer, clock, kernel_ms, spread, 1)
    b = fake_workload(timer, clock, 1.0, spread, 2)
    res = measure_pair(k, b, kernel_name="k", baseline_name="b", timing={**TIMING, **(timing or {})},
                       device="cpu", mode=mode, timer=timer, clock=clock, **kw)
    return res, timer


@pytest.mark.parametrize("target", [0.03, 0.015, 0.008])
def test_stopping_rule_stops_at_the_asked_half_width(target):
    res, _ = pair(spread=0.2, timing={"ci_half_width": target})
    assert res.stop == "ci"
    assert res.ci_half_width == pytest.approx(median_ci_half_width(res.ratios))
    assert res.ci_half_width <= target
    # not by far: a normal-theory estimate of the pairs needed, ×2 for the batching margin
    sigma = 0.2 * math.sqrt(2)          # log-ratio of two independent draws
    needed = (1.96 * 1.2533 * sigma / target) ** 2
    assert res.reps <= 2 * needed + 40
    assert res.reps == len(res.ratios) == len(res.kernel.samples_ms) == len(res.baseline.samples_ms)
    assert np.median(res.ratios) == pytest.approx(1.15, rel=3 * target)


def test_a_tight_point_stops_after_the_first_batch():
    res, _ = pair(spread=0.001, timing={"rep_ms": 50})
    assert res.stop == "ci" and res.reps == 24        # ceil(50 ms / 2.15 ms per pair)
    assert res.ci_half_width < 0.002


def test_budget_and_max_reps_end_sampling_before_the_target():
    res, _ = pair(spread=0.5, timing={"max_ms": 100})           # 100 ms of (fake) wall time
    assert res.stop == "budget" and res.ci_half_width > 0.015 and res.loop_s >= 0.1
    assert res.loop_s < 0.16    # the last batch was sized to what the budget left
    res, _ = pair(spread=0.5, timing={"max_reps": 50})
    assert res.stop == "max_reps" and res.reps == 50


def test_next_batch_respects_budget_and_max_reps():
    assert _next_batch(100, 0.03, 0.015, 1.0, 100.0, 10_000) >= 100 * (4 * 1.2 - 1) - 1
    assert _next_batch(100, 0.03, 0.015, 1.0, 1.5, 10_000) <= 52       # 0.5 s left at 10 ms per pair
    assert _next_batch(100, 0.03, 0.015, 1.0, 100.0, 103) == 3
    assert _next_batch(100, math.inf, 0.015, 1.0, 100.0, 10_000) == 100


def test_each_timed_call_records_the_hosts_time_inside_it():
    """Beside each side's timed samples on a GPU, the host's time inside each timed call (what the gate's HOST verdict
    and the report's host-bound mark read): one per sample, in the side's summary with its median; a call that keeps
    the host 20 ms records >= 20 ms (and the other side's, a few microseconds, stays below that even when a loaded
    CI machine stalls it a while). On the CPU none (the host's time is the call's)."""
    res, _ = pair(spread=0.01, timing={"max_reps": 4})
    assert res.kernel.host_samples_ms == [] and "host_samples_ms" not in res.kernel.summary()
    timer, clock = FakeTimer(), FakeClock()
    timer.device = "cuda"                       # the fake device as a GPU: the loop records the host's time
    k, b = fake_workload(timer, clock, 1.0, 0.01, 1), fake_workload(timer, clock, 1.0, 0.01, 2)
    slow_host = Workload(run=lambda: (k.run(), time.sleep(0.020)))
    res = measure_pair(slow_host, b, kernel_name="k", baseline_name="b",
                       timing={**TIMING, "rep_ms": 8, "min_reps": 6, "max_reps": 6}, device="cpu", timer=timer,
                       clock=clock)
    assert len(res.kernel.host_samples_ms) == len(res.kernel.samples_ms) == res.reps == 6
    assert len(res.baseline.host_samples_ms) == 6
    assert min(res.kernel.host_samples_ms) >= 20.0 > max(res.baseline.host_samples_ms)
    summary = res.kernel.summary()
    assert summary["host_samples_ms"] == [round(x, 6) for x in res.kernel.host_samples_ms]
    assert summary["host_ms_median"] >= 20.0


def test_one_side_alone_is_timed_by_its_own_median():
    timer, clock = FakeTimer(), FakeClock()
    res = measure_pair(fake_workload(timer, clock, 1.0, 0.05, 3), None, kernel_name="k", baseline_name=None,
                       timing=TIMING, device="cpu", timer=timer, clock=clock)
    assert res.baseline is None and res.ratios == [] and res.stop == "ci"
    assert median_ci_half_width(res.kernel.samples_ms) <= 0.015


def test_a_failing_side_is_a_result_and_the_other_is_timed_alone():
    timer, clock = FakeTimer(), FakeClock()

    def boom():
        raise RuntimeError("kernel exploded")
    res = measure_pair(Workload(run=boom), fake_workload(timer, clock, 1.0, 0.01, 4), kernel_name="k",
                       baseline_name="b", timing=TIMING, device="cpu", timer=timer, clock=clock)
    assert res.kernel.status == "error" and "kernel exploded" in res.kernel.message
    assert res.baseline.status == "ok" and res.baseline.samples_ms and res.ratios == []


# --- timing modes ----------------------------------------------------------------------------------------

def test_graph_mode_arms_each_side_once_and_releases_the_graphs():
    res, timer = pair(spread=0.01, mode="graph")
    assert res.timing_mode == "graph" and res.stop == "ci"
    assert timer.armed == 2 and timer.disarmed == 1


def test_graph_mode_refuses_a_call_with_an_untimed_step_before_it():
    timer, clock = FakeTimer("graph"), FakeClock()
    k = fake_workload(timer, clock, 1.0, 0.01, 1, prepare=lambda: None)
    res = measure_pair(k, fake_workload(timer, clock, 1.0, 0.01, 2), kernel_name="k", baseline_name="b",
                       timing=TIMING, device="cpu", mode="graph", timer=timer, clock=clock)
    assert res.kernel.status == "error" and "mode bwd" in res.kernel.message


def test_timer_factory():
    assert make_timer("cpu").mode == "eager" and make_timer("cuda").mode == "eager"
    assert make_timer("cuda", "graph").mode == "graph"
    with pytest.raises(TimerError, match="needs CUDA graphs"):
        make_timer("cpu", "graph")
    with pytest.raises(TimerError, match="allowed eager, graph"):
        make_timer("cuda", "both")


# --- planted slowdown ------------------------------------------------------------------------------------

def test_cpu_delay_is_a_busy_wait_of_the_asked_length():
    t0 = time.perf_counter()
    Delay("cpu")(20.0)
    assert 0.020 <= time.perf_counter() - t0 < 0.5


class FakeDelay:
    """The planted delay on the fake device: it lengthens the duration the timed call drew."""
    timer = None

    def __init__(self, device):
        self.calibrated = False

    def calibrate(self):
        self.calibrated = True

    def __call__(self, ms):
        FakeDelay.timer.last_ms += ms


@pytest.mark.parametrize("factor", [1.15, 1.5])
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_planted_slowdown_scales_the_kernel_time_by_the_factor(monkeypatch, factor, mode):
    """The kernel side gets a delay of (factor − 1) × its own median time after each call, in both timing modes
    (in graph mode the delay is part of the captured call)."""
    from attnbench.measure import pair as pair_mod

    monkeypatch.setattr(pair_mod, "Delay", FakeDelay)
    timer, clock = FakeTimer(mode), FakeClock()
    FakeDelay.timer = timer
    k, b = fake_workload(timer, clock, 2.0, 0.05, 1), fake_workload(timer, clock, 2.0, 0.05, 2)
    res = measure_pair(k, b, kernel_name="k", baseline_name="b", timing=TIMING, device="cpu", mode=mode,
                       timer=timer, clock=clock, slowdown={"kernel": factor})
    assert res.kernel.delay_ms == pytest.approx(2.0 * (factor - 1), rel=0.1)
    assert res.baseline.delay_ms is None
    assert np.median(res.ratios) == pytest.approx(factor, rel=0.02)
    assert timer.armed == 3       # both sides once, the slowed kernel side again with its delay


class ShortDelay(FakeDelay):
    """A delay that lands 0.1 ms short of what it is asked: a sleep kernel whose fixed cost, calibrated alone,
    is not its cost behind the call."""

    def __call__(self, ms):
        FakeDelay.timer.last_ms += max(ms - 0.1, 0.0)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_planted_delay_that_lands_short_is_corrected(monkeypatch, mode):
    """The slowed call is timed where it runs and its delay corrected by what it missed: a delay landing 0.1 ms
    short of the asked 0.3 (2 ms x 0.15) is asked 0.4 and the paired ratio is the factor, not 1.10; each
    correction arms the call again (in graph mode: a new capture)."""
    from attnbench.measure import pair as pair_mod

    monkeypatch.setattr(pair_mod, "Delay", ShortDelay)
    timer, clock = FakeTimer(mode), FakeClock()
    FakeDelay.timer = timer
    k, b = fake_workload(timer, clock, 2.0, 0.01, 1), fake_workload(timer, clock, 2.0, 0.01, 2)
    res = measure_pair(k, b, kernel_name="k", baseline_name="b", timing=TIMING, device="cpu", mode=mode,
                       timer=timer, clock=clock, slowdown={"kernel": 1.15})
    assert res.kernel.delay_ms == pytest.approx(0.4, rel=0.1)
    assert np.median(res.ratios) == pytest.approx(1.15, rel=0.01)
    assert 4 <= timer.armed <= 2 + pair_mod.DELAY_ROUNDS
