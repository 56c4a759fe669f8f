"""Statistics of timing samples: medians and percentiles, the confidence interval of a median, the bootstrap.

One home for every number the harness derives from samples: the runner's stopping rule asks
``median_ci_half_width`` of the paired ratios, the points table stores ``summary`` and ``median_ci``,
and the regression gate judges a change with ``bootstrap_change``. Pure functions of their inputs.
"""
from __future__ import annotations

import math
import zlib

import numpy as np

Z95 = 1.959963984540054          # two-sided 95 % normal quantile
P10_P90_SIGMAS = 2 * 1.2815515655446004   # width of p10..p90 in standard deviations of a normal


def _finite_positive(samples) -> np.ndarray:
    arr = np.asarray([x for x in samples if x is not None], dtype=float)
    return arr[np.isfinite(arr) & (arr > 0)]


def summary(samples) -> dict:
    """median, p10, p90, min and CV of a sample list (empty → Nones)."""
    arr = np.asarray(samples, dtype=float)
    if arr.size == 0:
        return {"median": None, "p10": None, "p90": None, "min": None, "cv": None}
    mean = float(arr.mean())
    return {"median": float(np.median(arr)), "p10": float(np.percentile(arr, 10)),
            "p90": float(np.percentile(arr, 90)), "min": float(arr.min()),
            "cv": float(arr.std() / mean) if mean > 0 else None}


def robust_cv(samples) -> float | None:
    """The spread of the samples as a normal-equivalent CV from p10..p90 (one preempted sample does not move it)."""
    s = summary(samples)
    if s["median"] is None or s["median"] <= 0:
        return None
    return (s["p90"] - s["p10"]) / (P10_P90_SIGMAS * s["median"])


def median_ci(samples, z: float = Z95) -> tuple[float, float] | None:
    """Distribution-free confidence interval of the median: the order statistics at ranks n/2 ∓ z·√n/2
    (the normal approximation of the binomial count of samples below the median). None below 6 samples,
    where no such pair of ranks exists at 95 %."""
    arr = np.sort(_finite_positive(samples))
    n = arr.size
    if n < 6:
        return None
    half = z * math.sqrt(n) / 2
    lo = int(math.floor(n / 2 - half))          # 0-based: the (lo+1)-th smallest
    hi = int(math.ceil(n / 2 + half)) - 1
    lo, hi = max(lo, 0), min(hi, n - 1)
    return float(arr[lo]), float(arr[hi])


def median_ci_half_width(samples, z: float = Z95) -> float:
    """Half the width of ``median_ci`` relative to the median (0.015 = ±1.5 %); inf when it is undefined."""
    ci = median_ci(samples, z)
    if ci is None:
        return math.inf
    med = float(np.median(_finite_positive(samples)))
    return (ci[1] - ci[0]) / 2 / med if med > 0 else math.inf


def bootstrap_change(baseline_samples, current_samples, n_boot: int = 2000, seed: int = 0,
                     key: str = "") -> tuple[float, float, float]:
    """change = median(current) / median(baseline), with the 2.5 % and 97.5 % quantiles of the same statistic
    over `n_boot` resamples (each side resampled independently). Deterministic per (seed, key)."""
    b = _finite_positive(baseline_samples)
    c = _finite_positive(current_samples)
    if b.size == 0 or c.size == 0:
        raise ValueError("bootstrap_change needs samples on both sides")
    # one generator per point, seeded by its id, so a verdict does not depend on which other points exist
    rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
    bb = np.median(b[rng.integers(0, b.size, size=(n_boot, b.size))], axis=1)
    cc = np.median(c[rng.integers(0, c.size, size=(n_boot, c.size))], axis=1)
    lo, hi = np.quantile(cc / bb, [0.025, 0.975])
    return float(np.median(c) / np.median(b)), float(lo), float(hi)
