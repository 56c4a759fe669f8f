"""The noise policy: what makes a measurement window *disturbed*, and what the runner does about it.

Two kinds of noise are told apart:

- a **disturbed window** — the clean-GPU check failed before the point, a foreign process appeared,
  a clock-event (throttle) reason other than the card's steady state showed up, or the SM clock sagged
  below `min_clock_frac` of its maximum — makes the attempt incomparable: it is stored as `disturbed`
  and retried after a back-off (`backoff_s × attempt`), up to `max_attempts`;
- **intrinsic spread** of the paired ratios in a clean window (host launch jitter of short kernels) is a
  property of the point: it is measured (the stopping rule samples until the confidence interval of the
  median is tight, see ``attnbench.measure.pair``), stored, and judged by that interval — never retried.

A third property of a point is not noise but worth knowing: it is **host-bound** when its kernel's host time inside
a timed call (the enqueue, recorded per call) is at least HOST_BOUND_SHARE of the call's eager time (``host_bound``;
a graph-timed point never is). Its eager
time then follows the speed of the lent machine's host, not the kernel's: the report marks it, and the gate does not
fail it for a move its host time ratio does not share (``attnbench.gate``, HOST).

Steady-state reasons: on the H100 every long tensor-core kernel runs into the 700 W software power cap
(``sw_power_cap``, measured 2026-11-22); it is recorded with every attempt but counts only when the SM
clock actually sagged. There the driver sets the clock from the power drawn, and the paired calls share it: a
ratio compares the two sides at one clock. A kernel that draws less power per clock than its baseline runs at a
higher clock alone, so faster than its paired ratio says (PASA against cuDNN on the H200: 0.05-0.09 of cuDNN's time;
``scripts/clock_pairing.py`` measures a kernel both ways, with the clock and power of each).

Run directories written before this policy have the status ``noisy``, which mixed both kinds: a legacy
point whose only reasons were the ratio spread was an undisturbed window (``window_disturbed``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

BENIGN_REASONS = frozenset({"gpu_idle"})
STEADY_STATE_REASONS = frozenset({"sw_power_cap"})
MEASURED_STATUSES = ("clean", "disturbed", "noisy")     # statuses that carry a ratio ("noisy": legacy runs)
LEGACY_SPREAD_PREFIX = "ratio spread"                   # how legacy runs worded a spread-only reason
# The L2 flush before each timed call gives the host a head start, so a host-bound call can take less time than its
# host time (Cron Root's 4K forward on the H200: 0.047 ms of host time in a 0.024 ms call, 0.051 ms on a slower
# host); a GPU-bound call's host time is a small share (ELSA's 16K forward 0.12, its 4K one 0.79)
HOST_BOUND_SHARE = 0.8


def host_bound(host_ms, call_ms, timing="eager") -> bool:
    """A call whose host time is at least HOST_BOUND_SHARE of its time (False where either is unknown). Never a
    graph-timed call: its time is the device's, and the replay's enqueue is not part of it."""
    if str(timing) == "graph":
        return False
    try:
        host_ms, call_ms = float(host_ms), float(call_ms)
    except (TypeError, ValueError):
        return False
    return bool(np.isfinite(host_ms) and np.isfinite(call_ms) and call_ms > 0
                and host_ms >= HOST_BOUND_SHARE * call_ms)


@dataclass(frozen=True)
class NoisePolicy:
    max_attempts: int = 4
    backoff_s: float = 3.0
    min_clock_frac: float = 0.90
    benign_reasons: frozenset = field(default=BENIGN_REASONS)
    steady_state_reasons: frozenset = field(default=STEADY_STATE_REASONS)

    @classmethod
    def for_cell(cls, cell, max_attempts: int | None = None) -> "NoisePolicy":
        """The policy of a matrix cell (its `retry` mapping); `max_attempts` overrides the cell's (CLI)."""
        retry = cell.retry
        return cls(max_attempts=int(max_attempts or retry["max_attempts"]), backoff_s=float(retry["backoff_s"]),
                   min_clock_frac=float(retry["min_clock_frac"]))

    # -- one attempt -------------------------------------------------------------------------------------
    def disturbances(self, before: dict, after: dict, monitor_summary: dict | None, clean_check, own_pid: int,
                     device: str) -> list[str]:
        """Why the window of one attempt was disturbed (empty: it was clean)."""
        from attnbench import gpu as gpumod

        reasons = []
        if device == "cuda" and before.get("gpu"):
            status = gpumod.GpuStatus(**before["gpu"])
            reasons += [f"not clean before: {r}" for r in clean_check.failures(status, {own_pid})]
            foreign = [p for p in (after.get("gpu") or {}).get("processes", []) if p["pid"] != own_pid]
            if foreign:
                reasons.append("foreign process after: " + ", ".join(f"{p['pid']} ({p['name']})" for p in foreign))
            if monitor_summary:
                reasons += self._clock_reasons(monitor_summary, own_pid)
        elif device == "cpu":
            reasons += [f"not clean before: {r}" for r in gpumod.cpu_load_failures(clean_check, before)]
        return reasons

    def _clock_reasons(self, monitor_summary: dict, own_pid: int) -> list[str]:
        lo, hi = monitor_summary["sm_clock_min_mhz"], monitor_summary["sm_clock_max_mhz"]
        sagged = lo is not None and bool(hi) and lo < self.min_clock_frac * hi
        out = []
        bad = [r for r in monitor_summary["reasons"] if r not in self.benign_reasons
               and (sagged or r not in self.steady_state_reasons)]
        if bad:
            out.append("clock-event reasons during run: " + ", ".join(bad))
        foreign = [p for p in monitor_summary["pids"] if p != own_pid]
        if foreign:
            out.append("foreign process during run: " + ", ".join(map(str, foreign)))
        if sagged:
            out.append(f"SM clock sagged to {lo:.0f} MHz (< {self.min_clock_frac:.0%} of {hi:.0f})")
        return out

    def verdict(self, result, before: dict, after: dict, monitor_summary: dict | None, clean_check, own_pid: int,
                device: str) -> tuple[str, list[str], str | None]:
        """(status, disturbance reasons, message) of one attempt; status is one of oom, error, skipped,
        disturbed, clean. `result` is a PairResult (baseline None: not run)."""
        sides = [s for s in (result.kernel, result.baseline) if s is not None]
        for side in sides:
            if side.status == "oom":
                return "oom", [], f"{side.backend} OOM" + (f" ({side.message})" if side.message else "")
        for side in sides:
            if side.status == "error":
                return "error", [], f"{side.backend}: {side.message}"
        reasons = self.disturbances(before, after, monitor_summary, clean_check, own_pid, device)
        if result.baseline is not None and result.baseline.status == "skipped":
            return "skipped", [], result.baseline.message
        return ("disturbed" if reasons else "clean"), reasons, None

    # -- retries -----------------------------------------------------------------------------------------
    def retry(self, status: str, attempt: int) -> bool:
        """Another attempt after this one? Only a disturbed window is retried."""
        return status == "disturbed" and attempt < self.max_attempts

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before attempt `attempt + 1`."""
        return self.backoff_s * attempt


def window_disturbed(status: str, reasons) -> bool:
    """Was a measured point's window disturbed? `disturbed` is; `clean` is not; a legacy `noisy` point is,
    unless every reason it recorded was the ratio spread (an undisturbed window with intrinsic spread)."""
    if status == "clean":
        return False
    if status == "noisy":
        reasons = [r for r in (reasons or []) if isinstance(r, str) and r.strip()]
        return not reasons or not all(r.strip().startswith(LEGACY_SPREAD_PREFIX) for r in reasons)
    return True


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
