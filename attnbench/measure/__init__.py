"""Measurement policy, in one package: how a call is timed, how two are paired, what the samples say, and
what counts as noise.

- ``timer``  CUDA events around eager calls or CUDA-graph replays, the CPU clock; L2 flush; planted delays
- ``pair``   kernel ⇄ baseline interleaved (A B / B A), warm-up and time budgets, the stopping rule
- ``stats``  medians, percentiles, the confidence interval of a median, the bootstrap (the gate uses it)
- ``noise``  the one policy object: disturbed windows, retries and back-off, steady-state clock reasons

The runner (``attnbench.runner``) is the loop over points that calls these.
"""
from attnbench.measure.noise import ClockMonitor, NoisePolicy, window_disturbed
from attnbench.measure.pair import PairResult, SideResult, is_oom, measure_pair, peak_memory_mb
from attnbench.measure.stats import bootstrap_change, median_ci, median_ci_half_width, robust_cv, summary
from attnbench.measure.timer import TIMING_MODES, TimerError, make_timer

__all__ = ["ClockMonitor", "NoisePolicy", "window_disturbed", "PairResult", "SideResult", "is_oom", "measure_pair",
           "peak_memory_mb", "bootstrap_change", "median_ci", "median_ci_half_width", "robust_cv", "summary",
           "TIMING_MODES", "TimerError", "make_timer"]
