"""Timing one call: CUDA events around an eager call or a CUDA-graph replay, or the CPU clock.

A timer turns a zero-argument *body* (the workload's call, plus a planted delay when a slowdown is asked)
into the call that is timed (``arm``), and times it with ``start``/``stop``/``elapsed_ms``:

- ``eager`` (CUDA events): the body as an eager loop runs it, host launch gaps included: what an eager
  PyTorch program pays;
- ``graph`` (CUDA events around ``CUDAGraph.replay``): the body captured once in a CUDA graph, so host
  launch cost is excluded: device time, what a graphed or compiled model pays;
- the CPU clock (``time.perf_counter``) for ``--device cpu``, eager only (there are no graphs there).

L2 is flushed before every timed call by zeroing a buffer several times the L2's size, outside the
timed region, in both CUDA modes (``Flusher``).
"""
from __future__ import annotations

import time
from typing import Callable

TIMING_MODES = ("eager", "graph")          # what a point is timed in; a cell's `timing.mode: both` runs each
L2_FLUSH_BYTES = 256 * 2**20               # several times the H100's 50 MB L2: every timed call starts cold


class TimerError(RuntimeError):
    """A timing mode this device cannot do, or a body that cannot be armed (one line)."""


class _Eager:
    """Times the body as it is: nothing to arm or release."""

    mode = "eager"

    def arm(self, body: Callable[[], object]) -> Callable[[], object]:
        return body

    def disarm(self) -> None:
        pass


class CpuTimer(_Eager):
    """perf_counter around the call; ``--device cpu`` only (the numbers exercise the pipeline, nothing more)."""

    device = "cpu"

    def start(self):
        return time.perf_counter()

    def stop(self, start):
        return time.perf_counter() - start

    def elapsed_ms(self, token) -> float:
        return token * 1e3

    def sync(self) -> None:
        pass


class EventTimer(_Eager):
    """CUDA events recorded on the current stream before and after an eager call. Both events are made before
    the first is recorded: in eager mode the host time between the call's launches and the end record counts
    (the GPU may idle there), so ``stop`` does nothing but record."""

    device = "cuda"

    def start(self):
        import torch

        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        return begin, end

    def stop(self, start):
        start[1].record()
        return start

    def elapsed_ms(self, token) -> float:
        return token[0].elapsed_time(token[1])

    def sync(self) -> None:
        import torch

        torch.cuda.synchronize()


class GraphTimer(EventTimer):
    """CUDA events around the replay of a graph holding one call of the body.

    The body is run twice on a side stream first (lazy initialisation, allocator growth, cuDNN plans must
    not happen inside the capture), then captured. Each side of a pair gets its own graph and memory pool;
    ``disarm`` releases them.
    """

    mode = "graph"

    def __init__(self):
        self._graphs: list = []

    def arm(self, body: Callable[[], object]) -> Callable[[], object]:
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        torch.cuda.synchronize()
        self._graphs.append(graph)
        return graph.replay

    def disarm(self) -> None:
        for graph in self._graphs:
            graph.reset()
        self._graphs.clear()


def make_timer(device: str, mode: str = "eager"):
    """The timer for a device ("cuda" | "cpu") and a timing mode ("eager" | "graph")."""
    if mode not in TIMING_MODES:
        raise TimerError(f"timing mode {mode!r}: allowed {', '.join(TIMING_MODES)}")
    if device == "cpu":
        if mode == "graph":
            raise TimerError("timing mode graph needs CUDA graphs (--device cuda)")
        return CpuTimer()
    return GraphTimer() if mode == "graph" else EventTimer()


class Flusher:
    """Zeroes a buffer larger than L2 before every timed call (outside the timed region); CUDA only."""

    def __init__(self, device: str, enabled: bool):
        self.buf = None
        if enabled and device == "cuda":
            import torch

            self.buf = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")

    def __call__(self) -> None:
        if self.buf is not None:
            self.buf.zero_()


class Delay:
    """A planted delay after a call (``--slowdown``): ``torch.cuda._sleep`` spinning for a calibrated number of
    SM clock cycles on the GPU, so it lands in the device time of eager calls and inside graph captures alike;
    a busy wait on the CPU. ``calibrate`` measures, right where it will be used (a warm GPU), the sleep kernel's
    fixed cost and its cycles per ms: a short call's delay is a few µs, where the fixed cost alone would
    overshoot the factor (1.31 instead of 1.15 at N=1K on the H100 with a cycles-per-ms scale alone). Behind a
    call the kernel costs less than alone, so measure_pair corrects the asked delay in place (pair._plant_delay)."""

    def __init__(self, device: str):
        self.device = device
        self.cycles_per_ms: float | None = None
        self.fixed_ms = 0.0

    def calibrate(self) -> None:
        if self.device != "cuda":
            return
        import torch

        def median_ms(cycles: int) -> float:
            times = []
            for _ in range(7):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(cycles)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            return sorted(times)[len(times) // 2]

        torch.cuda._sleep(1000)         # first launch outside the samples
        short, long_ = 100_000, 1_000_000
        t_short, t_long = median_ms(short), median_ms(long_)
        self.cycles_per_ms = (long_ - short) / max(t_long - t_short, 1e-6)
        self.fixed_ms = max(t_short - short / self.cycles_per_ms, 0.0)

    def __call__(self, ms: float) -> None:
        if ms <= 0:
            return
        if self.device == "cuda":
            import torch

            if self.cycles_per_ms is None:
                self.calibrate()
            torch.cuda._sleep(max(int((ms - self.fixed_ms) * self.cycles_per_ms), 0))
        else:
            end = time.perf_counter() + ms / 1e3
            while time.perf_counter() < end:
                pass
