"""Timing two workloads interleaved: warm-up, L2 flushes, time budgets and the stopping rule.

The quantity we report is the ratio of *paired* samples (kernel_i / baseline_i, measured back to back),
so drift in clocks or temperature hits both sides of every pair. Order alternates A B, B A, A B …
so a linear drift cancels within each two pairs instead of favouring whoever runs first.

Repetitions run in batches. The first batch fills `rep_ms` (at least `min_reps` pairs); after each batch
the 95 % confidence interval of the median paired ratio is computed, and sampling stops when its half-width
is at most `ci_half_width` (relative: 0.015 = ±1.5 %), when `max_reps` pairs were taken, or when the
measurement loop has used `max_ms` of wall time. Which of the three ended it is recorded: a point with
a large intrinsic spread (host launch jitter of short kernels) is *measured* to the asked precision, not
retried.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from attnbench.measure.stats import median_ci, median_ci_half_width, robust_cv, summary
from attnbench.measure.timer import Delay, Flusher, TimerError, make_timer
from attnbench.workload import Workload

STOP_REASONS = ("ci", "max_reps", "budget")


def is_oom(exc: BaseException) -> bool:
    import torch

    oom_type = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(exc, oom_type) or "out of memory" in str(exc).lower()


def _exc_text(exc: BaseException) -> str:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"


@dataclass
class SideResult:
    backend: str
    status: str = "ok"               # ok | oom | error | skipped
    message: str | None = None
    samples_ms: list[float] = field(default_factory=list)
    mem_mb: float | None = None
    flops: float | None = None
    first_call_ms: float | None = None   # wall time of the point's first call: compilation included, if it compiled
    delay_ms: float | None = None        # planted delay per call (--slowdown), None when none was asked
    host_samples_ms: list[float] = field(default_factory=list)  # the host's time inside each timed call (enqueue)

    def summary(self) -> dict:
        s = summary(self.samples_ms)
        tflops = None
        if self.flops and s["median"]:
            tflops = self.flops / (s["median"] * 1e-3) / 1e12
        out = {"backend": self.backend, "status": self.status, "message": self.message,
               "ms_median": s["median"], "ms_p10": s["p10"], "ms_p90": s["p90"], "ms_min": s["min"],
               "cv": s["cv"], "samples_ms": [round(x, 6) for x in self.samples_ms], "mem_mb": self.mem_mb,
               "tflops": tflops, "first_call_ms": self.first_call_ms}
        if self.delay_ms is not None:
            out["delay_ms"] = self.delay_ms
        if self.host_samples_ms:
            out["host_ms_median"] = summary(self.host_samples_ms)["median"]
            out["host_samples_ms"] = [round(x, 6) for x in self.host_samples_ms]
        return out

    def fail(self, exc: BaseException, where: str = "") -> None:
        self.status = "oom" if is_oom(exc) else "error"
        self.message = f"{where}{_exc_text(exc)}"[:300]


@dataclass
class PairResult:
    kernel: SideResult
    baseline: SideResult | None
    ratios: list[float]              # kernel_i / baseline_i of the paired samples ([] unless both sides ran)
    timing_mode: str = "eager"
    reps: int = 0                    # timed pairs (or calls, for one side alone)
    stop: str | None = None          # ci | max_reps | budget (None: nothing was timed)
    ci_half_width: float | None = None   # achieved: of the median paired ratio (one side alone: of its median time)
    loop_s: float | None = None      # wall time of the timed loop

    def ratio_summary(self) -> dict | None:
        """The paired ratios as stored with an attempt: median, p10, p90, spread (robust CV), the 95 % CI of the
        median, and the samples; None without ratios."""
        if not self.ratios:
            return None
        s = summary(self.ratios)
        ci = median_ci(self.ratios)
        return {"median": s["median"], "p10": s["p10"], "p90": s["p90"], "spread": robust_cv(self.ratios),
                "ci_low": ci[0] if ci else None, "ci_high": ci[1] if ci else None,
                "samples": [round(r, 6) for r in self.ratios]}

    def sampling_summary(self, target_ci_half_width: float) -> dict | None:
        """How the stopping rule ended (None when nothing was timed)."""
        if self.stop is None:
            return None
        return {"reps": self.reps, "stop": self.stop, "ci_half_width": self.ci_half_width,
                "target_ci_half_width": target_ci_half_width, "loop_s": self.loop_s}


def peak_memory_mb(workload: Workload, device: str) -> float | None:
    """Peak allocated memory of one call (prepare + run) above everything already resident (inputs included)."""
    if device != "cuda":
        return None
    import torch

    if "peak_mb" in workload.info:
        # a CUDA-graph replay allocates nothing: the builder measured one eager call's peak instead
        return workload.info["peak_mb"]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if workload.prepare:
        workload.prepare()
    result = workload.run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del result
    return (peak - base) / 2**20


class _Side:
    def __init__(self, workload: Workload, result: SideResult, factor: float):
        self.wl, self.res, self.factor = workload, result, factor
        self.call = None            # the armed, timed call
        self.estimate_ms = None      # the median of trial_ms (>= 1 us); with a planted slowdown, its target
        self.trial_ms: list = []
        self.tokens: list = []


def _timed(side: _Side, timer, flush, host: list | None = None):
    """One timed call; `host` gets the host's time inside it (ms by the CPU clock): on a GPU, what enqueueing the
    call cost the host, which becomes the call's time where the GPU waits for the host (a short eager call)."""
    if side.wl.prepare:
        side.wl.prepare()
    flush()
    t0 = timer.start()
    h0 = time.perf_counter()
    side.call()
    h1 = time.perf_counter()
    token = timer.stop(t0)
    if host is not None:
        host.append((h1 - h0) * 1e3)
    return token


def _body(wl: Workload, delay: Delay | None, delay_ms: float):
    if delay is None or delay_ms <= 0:
        return wl.run

    def slowed():
        out = wl.run()
        delay(delay_ms)
        return out
    return slowed


def measure_pair(kernel: Workload, baseline: Workload | None, *, kernel_name: str, baseline_name: str | None,
                 timing: dict, device: str, mode: str = "eager", monitor=None, slowdown: dict | None = None,
                 timer=None, clock=time.perf_counter) -> PairResult:
    """Warm up, size the first batch from the time budget, then time A/B interleaved until the stopping rule.

    `baseline` None times the kernel side alone. `slowdown` ({"kernel": 1.15}) plants a delay of
    (factor - 1) × the side's own median time after each of its calls. A side that runs out of memory,
    raises or cannot be graphed is recorded with status oom/error; the other side is still timed alone.
    """
    timer = timer or make_timer(device, mode)
    flush = Flusher(device, bool(timing.get("flush_l2", True)))
    slowdown = slowdown or {}
    sides = {"kernel": _Side(kernel, SideResult(kernel_name, flops=kernel.flops), slowdown.get("kernel", 1.0))}
    if baseline is not None:
        sides["baseline"] = _Side(baseline, SideResult(baseline_name, flops=baseline.flops),
                                  slowdown.get("baseline", 1.0))
    delay = Delay(device) if any(s.factor > 1 for s in sides.values()) else None
    n_trial = 11 if delay else 3        # the planted delay is sized from this median: take it from more calls

    try:
        for side in sides.values():
            _warm_up(side, timer, flush, device, n_trial)
        live = [k for k, s in sides.items() if s.res.status == "ok"]
        if delay is not None:
            delay.calibrate()
            for k in live:
                side = sides[k]
                if side.factor > 1:
                    try:
                        _plant_delay(side, delay, timer, flush, n_trial)
                    except Exception as exc:
                        side.res.fail(exc, "arming the slowed call: ")
            live = [k for k, s in sides.items() if s.res.status == "ok"]
        result = PairResult(sides["kernel"].res, sides["baseline"].res if baseline is not None else None, [],
                            timing_mode=timer.mode)
        if not live:
            return result
        _timed_loop([sides[k] for k in live], timer, flush, timing, monitor, clock, result)
        return result
    finally:
        timer.disarm()


def _trial_ms(side: _Side, timer, flush, n: int) -> list[float]:
    """n timed calls of the side's armed call, as the loop times them: their times in ms, sorted."""
    trial = [_timed(side, timer, flush) for _ in range(n)]
    timer.sync()
    return sorted(timer.elapsed_ms(t) for t in trial)


# The planted delay, measured where it runs and corrected: up to DELAY_ROUNDS armings, until the slowed call's
# median is within DELAY_TOLERANCE of factor x the side's own, or no further from it than their noise tells
DELAY_ROUNDS = 3
DELAY_TOLERANCE = 0.01


def _plant_delay(side: _Side, delay: Delay, timer, flush, n_trial: int) -> None:
    """Arm `side` slowed to `factor` x its estimated time: a delay of (factor - 1) x that time after each call,
    then the slowed call timed as the loop times it (n_trial calls) and the delay corrected by what its median
    missed, while the miss is larger than DELAY_TOLERANCE and than the noise (the 95 % intervals of the two medians
    apart: a noisy call's delay is not chased). The sleep kernel's cost behind a call is not its cost alone (its
    launch overlaps the call's end; the delay's calibration measures it alone): uncorrected, 1.15 landed at
    1.05-1.06 at 4K on the H200. In graph mode each correction captures the call again (the timer keeps every
    graph until it is disarmed)."""
    factor = side.factor
    target = factor * side.estimate_ms
    base_ci = median_ci(side.trial_ms)
    side.res.delay_ms = (factor - 1) * side.estimate_ms
    for attempt in range(DELAY_ROUNDS):
        side.call = timer.arm(_body(side.wl, delay, side.res.delay_ms))
        times = _trial_ms(side, timer, flush, n_trial)
        got, got_ci = times[len(times) // 2], median_ci(times)
        within_noise = base_ci is None or got_ci is None or (got_ci[0] <= factor * base_ci[1]
                                                             and got_ci[1] >= factor * base_ci[0])
        if abs(got / target - 1) <= DELAY_TOLERANCE or within_noise or attempt == DELAY_ROUNDS - 1:
            break
        side.res.delay_ms = max(side.res.delay_ms + target - got, 0.0)
    side.estimate_ms = target


def _warm_up(side: _Side, timer, flush, device: str, n_trial: int) -> None:
    """First call (host wall time: compilation shows here, outside every sample), peak memory, arming
    (graph capture), and a first time estimate from a few timed calls."""
    stage = ""
    try:
        t0 = time.perf_counter()
        if side.wl.prepare:
            side.wl.prepare()
        side.wl.run()
        timer.sync()
        side.res.first_call_ms = (time.perf_counter() - t0) * 1e3
        if side.wl.prepare:
            side.wl.prepare()
        side.wl.run()
        timer.sync()
        side.res.mem_mb = peak_memory_mb(side.wl, device)
        if timer.mode == "graph":
            if side.wl.prepare is not None:
                raise TimerError("timing mode graph cannot replay a call with an untimed step before it "
                                 "(mode bwd); time fwdbwd instead")
            stage = "graph capture: "
        side.call = timer.arm(side.wl.run)
        stage = ""
        side.trial_ms = _trial_ms(side, timer, flush, n_trial)
        side.estimate_ms = max(side.trial_ms[len(side.trial_ms) // 2], 1e-3)
    except Exception as exc:  # an OOM or a kernel error is a result for this side, not a crash
        side.res.fail(exc, stage)
        _free(device)


def _timed_loop(live: list[_Side], timer, flush, timing: dict, monitor, clock, result: PairResult) -> None:
    per_round = sum(s.estimate_ms for s in live)
    min_reps, max_reps = int(timing["min_reps"]), int(timing["max_reps"])
    target = float(timing["ci_half_width"])
    budget_s = float(timing["max_ms"]) / 1e3
    for _ in range(int(min(math.ceil(timing["warmup_ms"] / per_round), max_reps))):
        for s in live:
            _timed(s, timer, flush)
    timer.sync()

    batch = int(min(max(math.ceil(timing["rep_ms"] / per_round), min_reps), max_reps))
    samples = {id(s): [] for s in live}
    # the host's time inside each call, on a GPU (on the CPU it is the call's time itself: nothing to add)
    host = {id(s): [] if timer.device == "cuda" else None for s in live}
    done, t_start = 0, clock()
    try:
        while True:
            monitor_every = max(1, batch // 8)
            for i in range(batch):
                order = live if (done + i) % 2 == 0 else live[::-1]
                for s in order:
                    s.tokens.append(_timed(s, timer, flush, host[id(s)]))
                if monitor is not None and i % monitor_every == 0:
                    monitor.sample()   # host-side NVML read while the GPU works: clocks and throttle reasons
            timer.sync()
            for s in live:
                samples[id(s)].extend(timer.elapsed_ms(t) for t in s.tokens)
                s.tokens.clear()
            done += batch
            ratios = _ratios(live, samples)
            half = median_ci_half_width(ratios if len(live) == 2 else samples[id(live[0])])
            elapsed = clock() - t_start
            if half <= target:
                stop = "ci"
            elif done >= max_reps:
                stop = "max_reps"
            elif elapsed >= budget_s:
                stop = "budget"
            else:
                batch = _next_batch(done, half, target, elapsed, budget_s, max_reps)
                continue
            break
    except Exception as exc:
        for s in live:
            s.res.fail(exc, "during timing: ")
        _free(timer.device)
        return
    if monitor is not None:
        monitor.sample()
    for s in live:
        s.res.samples_ms = samples[id(s)]
        s.res.host_samples_ms = host[id(s)] or []
    result.ratios = ratios
    result.reps, result.stop, result.loop_s = done, stop, clock() - t_start
    result.ci_half_width = half if math.isfinite(half) else None


def _ratios(live: list[_Side], samples: dict) -> list[float]:
    if len(live) != 2:
        return []
    kernel, baseline = live     # the kernel side is always first in `sides`
    return [a / b for a, b in zip(samples[id(kernel)], samples[id(baseline)]) if b > 0]


def _next_batch(done: int, half: float, target: float, elapsed: float, budget_s: float, max_reps: int) -> int:
    """Pairs to add before the next check: the count the √n law says the target needs (20 % margin), at least
    an eighth of what was taken (a check costs a sync), at most what the budget and max_reps leave; even
    where possible, so the A B / B A orders stay balanced."""
    need = math.ceil(done * ((half / target) ** 2 * 1.2 - 1)) if math.isfinite(half) else done
    per_pair_s = elapsed / max(done, 1)
    left = int((budget_s - elapsed) / per_pair_s) if per_pair_s > 0 else max_reps
    batch = max(1, min(max(need, done // 8, 2), max(left, 2), max_reps - done))
    if batch % 2 and batch < max_reps - done:
        batch += 1
    return batch


def _free(device: str):
    import gc

    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()
