"""β for PASA from the paper's optimal-accuracy condition (paper eq 16, eqs 20–22; spec §5).

The shifting matrix M = λ·(I − (β/n)·J) is stored in the input's low-precision format, so the matrix
the kernel really applies is a rounded one, M̂₀ = a·I − b·J with

    b = R(β/n),   a = R(1 − β/n) + b                                     (eq 21)

whose inverse undoes the shift with the *realised* invariance

    f(β) = b·n / (a·(a − b·n))                                           (eq 20)

while the kernel's recovery uses the *ideal* invariance c = β/(1 − β).  The optimal-accuracy condition
(eq 16) asks for β/(1 − β) = f(β); it is solved by the fixed-point iteration (eq 22)

    β_{k+1} = f(β_k) / (1 + f(β_k)),

stopped when the relative change is below 1e-8.  Everything here is Python float64 arithmetic, and the
rounding R is exact round-to-nearest-even to fp16 / bf16 done on float64 values (no numpy or torch
conversions, which could round twice).

Two refinements the spec documents are options, because the published numbers use both:
- ``scale``: the kernel stores λ·M, not M, so the entries are rounded as R(λ·x)/λ.  For d = 64
  (λ = 2⁻³) this changes nothing; for d = 128 (λ = 2^−3.5) it moves the fixed points.
- ``mean_term``: the released solver adds (1 − a)/a to f (the 1/a factor taken at the level of the
  mean); the paper calls it negligible.
"""
from __future__ import annotations

import math
from functools import lru_cache

# significand bits (with the implicit one) and the smallest normal exponent of each format
_FORMATS = {"fp16": (11, -14), "float16": (11, -14), "bf16": (8, -126), "bfloat16": (8, -126)}

# the paper's three starting points: values exactly representable in fp16 (spec §5)
PAPER_BETA0 = (1 - 2.0 ** -4, 1 - 2.0 ** -5, 1 - 2.0 ** -6)


def round_to_format(x: float, fmt: str = "fp16") -> float:
    """Round a float64 to the nearest fp16/bf16 value (ties to even), returned as a float64.

    Exact: x / quantum is a power-of-two scaling (exact in float64) and Python's round() is
    round-half-even on the exact value. Subnormals use the fixed quantum; overflow is not modelled
    (the entries of M are far from it).
    """
    if fmt not in _FORMATS:
        raise ValueError(f"unknown format {fmt!r} (use fp16 or bf16)")
    if x == 0.0 or not math.isfinite(x):
        return x
    mbits, emin = _FORMATS[fmt]
    _, e = math.frexp(x)                    # x = m·2^e with 0.5 ≤ |m| < 1
    quantum = 2.0 ** (max(e, emin + 1) - mbits)
    return round(x / quantum) * quantum


def shift_entries(beta: float, n: int, scale: float = 1.0, fmt: str = "fp16") -> tuple[float, float]:
    """The two distinct entries of the stored λ·M: (diagonal, off-diagonal), rounded to `fmt`."""
    return round_to_format(scale * (1.0 - beta / n), fmt), round_to_format(-scale * beta / n, fmt)


def realised_invariance(beta: float, n: int, fmt: str = "fp16", scale: float | None = None,
                        mean_term: bool = False) -> float:
    """f(β) of eq 20: the invariance the rounded shifting matrix actually applies."""
    lam = 1.0 if scale is None else float(scale)
    diag, off = shift_entries(beta, n, lam, fmt)
    b = -off / lam
    a = diag / lam + b
    f = b * n / (a * (a - b * n))
    if mean_term:
        f += (1.0 - a) / a
    return f


def ideal_invariance(beta: float) -> float:
    """c = β/(1 − β): the invariance the recovery step uses (eqs 13–15)."""
    if beta == 1.0:
        raise ValueError("beta = 1 makes the shifting matrix singular (Theorem 2.1)")
    return beta / (1.0 - beta)


def solve_beta(beta0: float, n: int, fmt: str = "fp16", scale: float | None = None, mean_term: bool = False,
               rtol: float = 1e-8, max_iter: int = 200) -> float:
    """Fixed point of eq 22 from `beta0`: the β whose ideal invariance equals the realised one."""
    if not 0.0 <= beta0 < 1.0:
        raise ValueError(f"beta0 must be in [0, 1), got {beta0}")
    beta = float(beta0)
    for _ in range(max_iter):
        f = realised_invariance(beta, n, fmt, scale, mean_term)
        new = f / (1.0 + f)
        if abs(new - beta) <= rtol * abs(beta):
            return new
        beta = new
    raise RuntimeError(f"beta fixed-point iteration did not converge from {beta0} (n={n}, fmt={fmt})")


@lru_cache(maxsize=None)
def default_beta(n: int, scale: float, fmt: str = "fp16") -> float:
    """The β the kernel uses when none is given: the paper's choice (start 1 − 2⁻⁶, the most mean removed)
    solved for the kernel's real block length n and scale λ, so that c = β/(1−β) matches what the
    stored λ·M applies (the spec's λ caveat: the paper's 0.984497 is off by 1.4% at d = 128)."""
    return solve_beta(PAPER_BETA0[2], n, fmt, scale=scale, mean_term=False)
