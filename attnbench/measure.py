"""Timing two workloads interleaved, with CUDA events, L2 flushes, time budgets and peak memory.

The quantity we report is the ratio of *paired* samples (kernel_i / baseline_i, measured back to back),
so drift in clocks or temperature hits both sides of every pair. Order alternates A B, B A, A B …
so a linear drift cancels within each two pairs instead of favouring whoever runs first.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from attnbench.workload import Workload

L2_FLUSH_BYTES = 256 * 2**20   # several times the H100's 50 MB L2: every timed call starts cold


def is_oom(exc: BaseException) -> bool:
    oom_type = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(exc, oom_type) or "out of memory" in str(exc).lower()


def stats(samples) -> dict:
    """median, p10, p90, min and CV of a sample list (empty → Nones)."""
    arr = np.asarray(samples, dtype=float)
    if arr.size == 0:
        return {"median": None, "p10": None, "p90": None, "min": None, "cv": None}
    mean = float(arr.mean())
    return {"median": float(np.median(arr)), "p10": float(np.percentile(arr, 10)),
            "p90": float(np.percentile(arr, 90)), "min": float(arr.min()),
            "cv": float(arr.std() / mean) if mean > 0 else None}


def robust_cv(samples) -> float | None:
    """Spread of the paired ratios as a normal-equivalent CV from p10..p90 (one preempted sample does not flag a point)."""
    s = stats(samples)
    if s["median"] is None or s["median"] <= 0:
        return None
    return (s["p90"] - s["p10"]) / (2 * 1.2816 * s["median"])


@dataclass
class SideResult:
    backend: str
    status: str = "ok"               # ok | oom | error | skipped
    message: str | None = None
    samples_ms: list[float] = field(default_factory=list)
    mem_mb: float | None = None
    flops: float | None = None
    first_call_ms: float | None = None   # wall time of the point's first call: compilation included, if it compiled

    def summary(self) -> dict:
        s = stats(self.samples_ms)
        tflops = None
        if self.flops and s["median"]:
            tflops = self.flops / (s["median"] * 1e-3) / 1e12
        return {"backend": self.backend, "status": self.status, "message": self.message,
                "ms_median": s["median"], "ms_p10": s["p10"], "ms_p90": s["p90"], "ms_min": s["min"],
                "cv": s["cv"], "samples_ms": [round(x, 6) for x in self.samples_ms], "mem_mb": self.mem_mb,
                "tflops": tflops, "first_call_ms": self.first_call_ms}


class _Clock:
    """Per-call timing: CUDA events on the GPU (device time), perf_counter on the CPU."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, start):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return (start, ev)
        return time.perf_counter() - start

    def elapsed_ms(self, token) -> float:
        if self.cuda:
            return token[0].elapsed_time(token[1])
        return token * 1e3

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


class _Flusher:
    def __init__(self, device: str, enabled: bool):
        self.buf = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") \
            if enabled and device == "cuda" else None

    def __call__(self):
        if self.buf is not None:
            self.buf.zero_()


def peak_memory_mb(workload: Workload, device: str) -> float | None:
    """Peak allocated memory of one call (prepare + run) above everything already resident (inputs included)."""
    if device != "cuda":
        return None
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


def _call(workload: Workload, flush, clock):
    if workload.prepare:
        workload.prepare()
    flush()
    t0 = clock.start()
    workload.run()
    return clock.stop(t0)


def measure_pair(kernel: Workload, baseline: Workload, *, kernel_name: str, baseline_name: str,
                 timing: dict, device: str, monitor=None) -> tuple[SideResult, SideResult, list[float]]:
    """Warm up, size the repetition count from the time budgets, then time A/B interleaved.

    Returns (kernel side, baseline side, paired ratio samples). A side that runs out of memory or raises
    is recorded with status oom/error; the other side is still timed alone.
    """
    clock = _Clock(device)
    flush = _Flusher(device, bool(timing.get("flush_l2", True)))
    sides = {"kernel": (kernel, SideResult(kernel_name, flops=kernel.flops)),
             "baseline": (baseline, SideResult(baseline_name, flops=baseline.flops))}

    # Warm-up (compilation, autotuning, allocator growth), memory, and a first time estimate per side.
    estimates = {}
    for key, (wl, res) in sides.items():
        try:
            t0 = time.perf_counter()                 # host wall time of the first call: JIT compilation (when
            token = _call(wl, flush, clock)          # this process has not compiled it yet) shows here, and
            clock.sync()                             # only here, outside every timed sample
            res.first_call_ms = (time.perf_counter() - t0) * 1e3
            token = _call(wl, flush, clock)
            clock.sync()
            res.mem_mb = peak_memory_mb(wl, device)
            trial = [_call(wl, flush, clock) for _ in range(3)]
            clock.sync()
            estimates[key] = max(float(np.median([clock.elapsed_ms(t) for t in trial])), 1e-3)
            del token
        except Exception as exc:  # an OOM or a kernel error is a result for this side, not a crash
            res.status = "oom" if is_oom(exc) else "error"
            res.message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            _free(device)
    live = [k for k in sides if k in estimates]
    if not live:
        return sides["kernel"][1], sides["baseline"][1], []

    per_round = sum(estimates[k] for k in live)
    extra_warmup = int(min(math.ceil(timing["warmup_ms"] / per_round), timing["max_reps"]))
    reps = int(min(max(math.ceil(timing["rep_ms"] / per_round), timing["min_reps"]), timing["max_reps"]))
    for _ in range(extra_warmup):
        for k in live:
            _call(sides[k][0], flush, clock)
    clock.sync()

    tokens = {k: [] for k in live}
    try:
        for i in range(reps):
            order = live if i % 2 == 0 else live[::-1]
            for k in order:
                tokens[k].append(_call(sides[k][0], flush, clock))
            if monitor is not None and i % max(1, reps // 8) == 0:
                monitor.sample()   # host-side NVML read while the GPU works: clocks and throttle reasons
        clock.sync()
    except Exception as exc:
        for k in live:
            res = sides[k][1]
            res.status = "oom" if is_oom(exc) else "error"
            res.message = f"during timing: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        _free(device)
        return sides["kernel"][1], sides["baseline"][1], []
    if monitor is not None:
        monitor.sample()
    for k in live:
        sides[k][1].samples_ms = [clock.elapsed_ms(t) for t in tokens[k]]
    ratios = []
    if len(live) == 2:
        ratios = [a / b for a, b in zip(sides["kernel"][1].samples_ms, sides["baseline"][1].samples_ms) if b > 0]
    return sides["kernel"][1], sides["baseline"][1], ratios


def _free(device: str):
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


class ClockMonitor:
    """Samples the chosen GPU's SM clock and clock-event reasons while a point is measured."""

    def __init__(self, reader, index: int):
        self.reader, self.index = reader, index
        self.clocks: list[float] = []
        self.max_clock: float | None = None
        self.reasons_mask = 0
        self.pids: set[int] = set()

    def sample(self):
        r = self.reader.read(self.index)
        if r["sm_clock_mhz"] is not None:
            self.clocks.append(r["sm_clock_mhz"])
        self.max_clock = r["sm_clock_max_mhz"]
        self.reasons_mask |= r["clock_event_mask"]
        self.pids.update(pid for pid, _ in r["processes"])

    def summary(self) -> dict:
        from attnbench.gpu import decode_reasons

        return {"sm_clock_min_mhz": min(self.clocks) if self.clocks else None,
                "sm_clock_median_mhz": float(np.median(self.clocks)) if self.clocks else None,
                "sm_clock_max_mhz": self.max_clock, "reasons": decode_reasons(self.reasons_mask),
                "pids": sorted(self.pids), "samples": len(self.clocks)}
