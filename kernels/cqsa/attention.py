"""Public entry point: validation, resident mode and the autograd Function.

Resident mode (inputs on the compute device, no budget): every task of a head runs, but instead of
one launch per task the tasks are batched into slot waves (see schedule.py): one launch covers all
c**itr tasks' row blocks of one slot × all (batch, head) pairs, and folds its partials into fp32
(m, l, acc) state with the log-sum-exp rule. l**itr launches per forward (3 at c = 7, itr = 1),
independent of the number of tasks; the last one writes O and the global lse.
Streaming mode (a memory budget, or inputs on the host while a GPU exists) is in stream.py.
"""
from __future__ import annotations

import math

import torch

from .divide import INTEREST_SETS, MAX_BITS, interest_set
from .kernel import LOG2E, config, launch_bwd_dkdv, launch_bwd_dq, launch_fwd, precision_for
from .schedule import resident_schedule

HEAD_DIMS = (32, 64, 128)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def validate(q, k, v, causal, scale, c, itr, precision) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"cqsa: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"cqsa: {name} must be [B, H, N, D], got shape {tuple(t.shape)}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"cqsa: q, k, v shapes differ: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"cqsa: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"cqsa: q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"cqsa: dtype {q.dtype} unsupported (float32, float16, bfloat16)")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"cqsa: head_dim {q.shape[-1]} unsupported (supports {HEAD_DIMS})")
    if not isinstance(causal, bool):
        raise ValueError(f"cqsa: causal must be a bool, got {causal!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"cqsa: scale must be a finite float or None, got {scale!r}")
    if c not in INTEREST_SETS:
        raise ValueError(f"cqsa: no interest set for c={c} (supported: {sorted(INTEREST_SETS)})")
    if not isinstance(itr, int) or isinstance(itr, bool) or itr < 1:
        raise ValueError(f"cqsa: itr must be an int >= 1, got {itr!r}")
    if itr * (len(interest_set(c)) - 1) > MAX_BITS:
        raise ValueError(f"cqsa: itr={itr} with c={c} exceeds the {MAX_BITS}-bit responsibility budget")
    precision_for(q.dtype, precision)


def check_bf16_device(dtype, device) -> None:
    if dtype == torch.bfloat16 and device.type != "cuda":
        raise ValueError("cqsa: bfloat16 needs a CUDA device (the Triton CPU interpreter computes bf16 wrongly)")


def _lastdim_contig(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def resident_forward(q, k, v, causal, scale, c, itr, precision):
    """O and the global natural-log lse [B,H,N] (fp32) with everything on q's device."""
    B, H, N, D = q.shape
    check_bf16_device(q.dtype, q.device)
    q, k, v = _lastdim_contig(q), _lastdim_contig(k), _lastdim_contig(v)
    out = torch.empty((B, H, N, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    if N == 0 or B * H == 0:
        return out, lse
    block = config("fwd", D, q.dtype, q.device)
    sched = resident_schedule(N, c, itr, block[0], causal)
    ranges, waves = sched.on(q.device)
    acc = torch.empty((B, H, N, D), dtype=torch.float32, device=q.device)
    mst = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    lst = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    prec = precision_for(q.dtype, precision)
    for i, items in enumerate(waves):
        launch_fwd(q, k, v, out, lse, items, ranges, causal=causal, scale=scale, block=block, precision=prec,
                   mode=1, first=(i == 0), last=(i == len(waves) - 1), acc=acc, mst=mst, lst=lst)
    return out, lse


def lse_log2(lse: torch.Tensor) -> torch.Tensor:
    """lse in log2 units for the backward kernels; +inf for rows with no key, so their p is 0."""
    return torch.where(torch.isfinite(lse), lse * LOG2E, torch.full_like(lse, float("inf")))


def row_delta(do: torch.Tensor, out: torch.Tensor, chunk: int = 1 << 16) -> torch.Tensor:
    """δ = rowsum(dO ⊙ O) in fp32, chunked along N so no full fp32 copy of O is made."""
    B, H, N, _ = out.shape
    delta = torch.empty((B, H, N), dtype=torch.float32, device=out.device)
    for s in range(0, N, chunk):
        delta[:, :, s:s + chunk] = (do[:, :, s:s + chunk].float() * out[:, :, s:s + chunk].float()).sum(-1)
    return delta


def resident_backward(q, k, v, out, lse, do, causal, scale, c, itr, precision):
    B, H, N, D = q.shape
    q, k, v, do = (_lastdim_contig(t) for t in (q, k, v, do))
    dq = torch.empty((B, H, N, D), dtype=q.dtype, device=q.device)
    dk = torch.empty_like(dq)
    dv = torch.empty_like(dq)
    if N == 0 or B * H == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = row_delta(do, out)
    lse2 = lse_log2(lse).contiguous()
    bm, bn, warps, stages = config("bwd", D, q.dtype, q.device)
    prec = precision_for(q.dtype, precision)
    f32 = dict(dtype=torch.float32, device=q.device)
    # dQ: row blocks of BLOCK_M queries, key tiles of BLOCK_N
    ranges, waves = resident_schedule(N, c, itr, bm, causal).on(q.device)
    acc = torch.empty((B, H, N, D), **f32)
    for i, items in enumerate(waves):
        launch_bwd_dq(q, k, v, do, lse2, delta, dq, items, ranges, causal=causal, scale=scale,
                      block=(bm, bn, warps, stages), precision=prec, first=(i == 0), last=(i == len(waves) - 1),
                      dqacc=acc)
    # dK, dV: row blocks of BLOCK_N keys, query tiles of BLOCK_M (the responsibility test is symmetric)
    ranges, waves = resident_schedule(N, c, itr, bn, causal).on(q.device)
    acc_v = torch.empty((B, H, N, D), **f32)
    for i, items in enumerate(waves):
        launch_bwd_dkdv(q, k, v, do, lse2, delta, dk, dv, items, ranges, causal=causal, scale=scale,
                        block=(bm, bn, warps, stages), precision=prec, first=(i == 0),
                        last=(i == len(waves) - 1), dkacc=acc, dvacc=acc_v)
    return dq, dk, dv


class _CQSAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, c, itr, precision, stream_opts):
        if stream_opts is None:
            out, lse = resident_forward(q, k, v, causal, scale, c, itr, precision)
            ctx.stats = None
        else:
            from .stream import stream_forward
            out, lse, stats = stream_forward(q, k, v, causal=causal, scale=scale, c=c, itr=itr,
                                             precision=precision, **stream_opts)
            ctx.stats = stats
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (causal, scale, c, itr, precision, stream_opts)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, c, itr, precision, stream_opts = ctx.cfg
        do = do.to(q.dtype)
        if stream_opts is None:
            dq, dk, dv = resident_backward(q, k, v, out, lse, do, causal, scale, c, itr, precision)
        else:
            from .stream import stream_backward
            dq, dk, dv, _ = stream_backward(q, k, v, out, lse, do, causal=causal, scale=scale, c=c, itr=itr,
                                            precision=precision, **stream_opts)
        return dq, dk, dv, None, None, None, None, None, None


_last_stats = [None]


def last_stats():
    """Stats of the last streamed forward run through cqsa_attention (None for resident runs)."""
    return _last_stats[0]


def cqsa_attention(q, k, v, causal=False, scale=None, c=7, itr=1, mem_budget=None, *,
                   precision="tf32x3", stream=None, device=None, return_stats=False, **stream_opts):
    """Exact softmax attention computed as independent CQS subsequence tasks.

    q, k, v: [B, H, N, D] (same dtype/device; float32, float16, bfloat16; D in 32/64/128).
    c: chunk count (a key of INTEREST_SETS); itr: divide granularity (depth) >= 1.
    mem_budget: bytes the computation may hold on the compute device. Given, the streaming engine
    runs (itr then is the smallest depth it starts from; the planner and the OOM guardrail may go
    deeper). Inputs on the host with a GPU present are streamed to the GPU too (``stream`` forces
    either mode). ``precision`` applies to float32 ("tf32x3" or "ieee").
    Returns [B, H, N, D] on the inputs' device; with return_stats=True, (out, stats).
    """
    validate(q, k, v, causal, scale, c, itr, precision)
    scale = float(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if stream is None:
        stream = mem_budget is not None or (q.device.type == "cpu" and torch.cuda.is_available())
    if stream:
        opts = dict(stream_opts, mem_budget=mem_budget)
        if device is not None:
            opts["device"] = device
    else:
        if mem_budget is not None or stream_opts or device is not None:
            raise ValueError("cqsa: mem_budget/device/engine options need stream mode")
        opts = None
    out = _CQSAFunction.apply(q, k, v, causal, scale, c, itr, precision, opts)
    stats = None
    if opts is not None:
        from .stream import last_run_stats
        stats = _last_stats[0] = last_run_stats()
    return (out, stats) if return_stats else out
