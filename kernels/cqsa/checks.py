"""The input checks of CQSA's two entries (the resident ops behind cqsa_attention, and the streaming engine):
the kernel contract's checks (kernels/_common.check_inputs) plus CQSA's own options, each a one-line error."""
from __future__ import annotations

import math

import torch

from .._common import Shape, check_inputs, check_precision
from .divide import INTEREST_SETS, MAX_BITS


def check_call(q, k, v, *, causal, scale, c, itr, precision, device: torch.device | None = None) -> Shape:
    """Validate one call; return its Shape. ``device``: where the kernels run when it is not q's device (the
    streaming engine copies host inputs to the GPU itself, so CPU inputs are fine there without the Triton
    interpreter)."""
    if (device is not None and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and isinstance(v, torch.Tensor) and q.device.type != device.type and q.device == k.device == v.device):
        # the shared checks (bf16 on the CPU among them) see stand-ins on the compute device: zero-stride views of
        # one element, same shapes and dtypes, no memory
        q, k, v = (torch.empty((), dtype=t.dtype, device=device).expand(t.shape) for t in (q, k, v))
    shape = check_inputs("cqsa", q, k, v, causal=causal, scale=scale)
    check_options(c, itr, precision)
    return shape


def check_options(c, itr, precision="tf32x3", mem_budget=None) -> None:
    """CQSA's own options, checked without a tensor (the harness checks a matrix's cells with it at load time)."""
    if isinstance(c, bool) or not isinstance(c, int) or c not in INTEREST_SETS:
        raise ValueError(f"cqsa: no interest set for c={c!r} (supported: {sorted(INTEREST_SETS)})")
    if not isinstance(itr, int) or isinstance(itr, bool) or itr < 1:
        raise ValueError(f"cqsa: itr must be an int >= 1, got {itr!r}")
    if itr * (len(INTEREST_SETS[c]) - 1) > MAX_BITS:
        raise ValueError(f"cqsa: itr={itr} with c={c} exceeds the {MAX_BITS}-bit responsibility budget")
    check_precision("cqsa", precision)
    check_mem_budget(mem_budget)


def check_mem_budget(mem_budget) -> None:
    if mem_budget is not None and (isinstance(mem_budget, bool) or not isinstance(mem_budget, (int, float))
                                   or not math.isfinite(mem_budget) or mem_budget <= 0):
        raise ValueError(f"cqsa: mem_budget must be a positive number of bytes, got {mem_budget!r}")
