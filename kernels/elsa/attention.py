"""ELSA host code: validation, the two-pass forward (phase 1 -> HBM summaries -> phase 2), the backward.

Forward, per q-chunk of rows [q0, q0 + q_chunk):
  phase 1  grid (QB, B*H, P): program (qb, bh, p) folds the keys of partition p for BLOCK_M query rows
           into one monoid summary per row, (m, z, s) in fp32, and stores it to global memory;
  phase 2  grid (QB*BLOCK_M/ROWS, B*H), a separate launch: reads only those summaries, merges the
           partitions of each row (causal: only partitions at or before the block's diagonal) and
           writes out = s / z (0 for a row with no visible key), plus the row stats (m, z) for training.
Backward: Delta = rowsum(dO * O) and L2 = m + log2 z, then a dQ kernel and a dK/dV kernel that rebuild
every softmax weight as 2^(x - L2). Extra memory: the summary buffer of one q-chunk plus O(B*H*N) stats.
"""
from __future__ import annotations

import contextlib
import math
import os

import torch

from .._launch import launch
from . import trace
from .kernel import _elsa_bwd_dkdv, _elsa_bwd_dq, _elsa_bwd_pre, _elsa_phase1, _elsa_phase2
from .config import plan_backward, plan_forward

LOG2E = 1.4426950408889634
PRECISIONS = ("tf32x3", "ieee", "tf32")
HEAD_DIMS = (32, 64, 128)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FWD_KNOBS = ("block_m", "block_n", "num_warps", "num_stages", "partition_width", "q_chunk")
_BWD_KNOBS = ("dq_config", "dkdv_config")
_INT32_MAX = 2**31 - 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _validate(q, k, v, causal, scale, precision, attn_bias, knobs):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"elsa: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"elsa: {name} must be [B, H, N, D], got shape {tuple(t.shape)}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"elsa: q, k, v must have the same shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"elsa: q, k, v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"elsa: dtype {q.dtype} unsupported (float32, float16, bfloat16)")
    if not (q.device == k.device == v.device):
        raise ValueError(f"elsa: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"elsa: head dim {q.shape[-1]} unsupported (supports 32, 64, 128)")
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("elsa: CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 set before triton is imported)")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"elsa: device {q.device} unsupported (cuda, or cpu through the Triton interpreter)")
    if not isinstance(causal, bool):
        raise ValueError(f"elsa: causal must be a bool, got {causal!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"elsa: scale must be a positive finite float or None, got {scale!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"elsa: precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    unknown = set(knobs) - set(_FWD_KNOBS) - set(_BWD_KNOBS)
    if unknown:
        raise ValueError(f"elsa: unknown option(s) {', '.join(sorted(unknown))}")
    if attn_bias is not None:
        if not isinstance(attn_bias, torch.Tensor):
            raise ValueError(f"elsa: attn_bias must be a tensor, got {type(attn_bias).__name__}")
        if not attn_bias.is_floating_point():
            raise ValueError(f"elsa: attn_bias must be a float tensor (additive bias), got {attn_bias.dtype}")
        if attn_bias.device != q.device:
            raise ValueError(f"elsa: attn_bias is on {attn_bias.device}, q on {q.device}")
        B, H, N, _ = q.shape
        if attn_bias.dim() > 4:
            raise ValueError(f"elsa: attn_bias must broadcast to [B, H, N, N] = {[B, H, N, N]}, got {tuple(attn_bias.shape)}")
        try:
            fits = torch.broadcast_shapes(attn_bias.shape, (B, H, N, N)) == (B, H, N, N)
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"elsa: attn_bias must broadcast to [B, H, N, N] = {[B, H, N, N]}, got {tuple(attn_bias.shape)}")


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """Kernels address rows through strides but need a unit feature stride and int32 in-head offsets."""
    _, _, n, d = t.shape
    st = t.stride()
    if st[3] != 1 or (n - 1) * st[2] + d > _INT32_MAX:
        t = t.contiguous()
        if (n - 1) * t.stride(2) + d > _INT32_MAX:
            raise ValueError(f"elsa: one head of {tuple(t.shape)} exceeds 2^31 elements (int32 in-head offsets)")
    return t


def _head_strides(q, k, v) -> tuple:
    """The batch, head and row strides of q, k, v (one stride() call each: host time counts at short N)."""
    return (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])


def _on_device(t: torch.Tensor):
    """Make t's CUDA device current for the launches (Triton launches on the current device); a no-op
    context when it already is, which is the common case and saves the device switch's host time."""
    if t.device.type != "cuda" or t.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


def _bias_view(attn_bias, B, H, N):
    """The bias as a stride-0-broadcast [B, H, N, N] view (never a copy) and its four strides."""
    if attn_bias is None:
        return None, (0, 0, 0, 0)
    view = attn_bias.expand(B, H, N, N)
    if (N - 1) * (abs(view.stride(2)) + abs(view.stride(3))) > _INT32_MAX:
        raise ValueError("elsa: attn_bias of one head exceeds 2^31 elements (int32 in-head offsets)")
    return view, tuple(view.stride())


def _dot_precision(dtype, precision):
    # input_precision only applies to float32 x float32 dots. 16-bit operands always take the
    # tensor-core MMA with fp32 accumulation; "tf32" is Triton's own default there and changes nothing.
    return precision if dtype == torch.float32 else "tf32"


def _forward(q, k, v, bias, causal, scale, precision, need_stats, knobs):
    B, H, N, D = q.shape
    BH = B * H
    dev = q.device
    out = torch.empty((B, H, N, D), dtype=q.dtype, device=dev)
    mrow = zrow = None
    if need_stats:
        mrow = torch.empty((BH, N), dtype=torch.float32, device=dev)
        zrow = torch.empty((BH, N), dtype=torch.float32, device=dev)
    if N == 0 or BH == 0:
        return out, mrow, zrow
    if BH > 65535:
        raise ValueError(f"elsa: B*H = {BH} exceeds the 65535 grid limit")
    plan = plan_forward(N, BH, D, q.dtype, dev, **{kk: knobs[kk] for kk in _FWD_KNOBS if kk in knobs})
    bm, W, P, qc = plan.block_m, plan.width, plan.parts, plan.q_chunk
    bias_v, (sbb, sbh, sbi, sbj) = _bias_view(bias, B, H, N)
    bias_arg = bias_v if bias_v is not None else q
    qk_scale = scale * LOG2E
    fold_q = q.dtype == torch.float32
    scale_in_exp = not fold_q and bias_v is None
    prec = _dot_precision(q.dtype, precision)
    qb_max = _cdiv(min(qc, N), bm)
    nrows = P * qb_max * BH * bm
    # separate allocations on purpose: carving them out of one buffer cost more host time in views than it
    # saved in allocations (measured on the CPU with launches stubbed; NOTES.md, host cost)
    msum = torch.empty(nrows, dtype=torch.float32, device=dev)
    zsum = torch.empty(nrows, dtype=torch.float32, device=dev)
    ssum = torch.empty((nrows, D), dtype=torch.float32, device=dev)
    stats_m = mrow if need_stats else msum
    stats_z = zrow if need_stats else zsum
    tracing = trace.active()
    qkv_strides = _head_strides(q, k, v)
    out_strides = out.stride()[:3]
    for q0 in range(0, N, qc):
        qlen = min(qc, N - q0)
        QB = _cdiv(qlen, bm)
        grid1 = (QB, BH, P)
        ev = trace.start_event(dev) if tracing else None
        k1 = launch(_elsa_phase1, grid1, (
            q, k, v, bias_arg, msum, zsum, ssum, *qkv_strides, sbb, sbh, sbi, sbj,
            H, N, q0, QB, BH, W, qk_scale), dict(
            HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=plan.block_n, CAUSAL=causal, HAS_BIAS=bias_v is not None,
            FOLD_Q=fold_q, SCALE_IN_EXP=scale_in_exp, DOT_PREC=prec, num_warps=plan.num_warps, num_stages=plan.num_stages))
        if tracing:
            trace.record(start=ev, phase=1, kernel=_elsa_phase1.__name__, grid=grid1, programs=QB * BH * P,
                         partitions=P, partition_width=W, q_chunk=(q0, qlen), block_m=bm,
                         summary_shape=(P, QB, BH, bm, D), summary_buffer=tuple(ssum.shape),
                         summary_device=str(ssum.device), summary_dtype=str(ssum.dtype).replace("torch.", ""),
                         summary_ptr=ssum.data_ptr(), args=trace.kernel_arg_names(_elsa_phase1), compiled=k1)
        grid2 = (QB * (bm // plan.p2_rows), BH)
        ev = trace.start_event(dev) if tracing else None
        k2 = launch(_elsa_phase2, grid2, (
            msum, zsum, ssum, out, stats_m, stats_z, *out_strides,
            H, N, q0, QB, BH, P, W), dict(
            HEAD_DIM=D, BLOCK_M=bm, ROWS=plan.p2_rows, KBT=plan.p2_kbt, CAUSAL=causal,
            STORE_STATS=need_stats, num_warps=4, num_stages=2))
        if tracing:
            trace.record(start=ev, phase=2, kernel=_elsa_phase2.__name__, grid=grid2, programs=grid2[0] * BH,
                         partitions=P, q_chunk=(q0, qlen), summary_shape=(P, QB, BH, bm, D),
                         summary_buffer=tuple(ssum.shape), summary_device=str(ssum.device),
                         summary_dtype=str(ssum.dtype).replace("torch.", ""), summary_ptr=ssum.data_ptr(),
                         args=trace.kernel_arg_names(_elsa_phase2), compiled=k2)
    return out, mrow, zrow


def _backward(do, q, k, v, out, mrow, zrow, bias, bias_grad, causal, scale, precision, knobs):
    B, H, N, D = q.shape
    BH = B * H
    dev = q.device
    dq = torch.empty((B, H, N, D), dtype=q.dtype, device=dev)
    dk = torch.empty((B, H, N, D), dtype=q.dtype, device=dev)
    dv = torch.empty((B, H, N, D), dtype=q.dtype, device=dev)
    dbias_full = torch.zeros((BH, N, N), dtype=torch.float32, device=dev) if bias_grad else None
    if N == 0 or BH == 0:
        return dq, dk, dv, dbias_full
    plan = plan_backward(D, q.dtype, **{kk: knobs[kk] for kk in _BWD_KNOBS if kk in knobs})
    do = _unit_last(do)
    delta = torch.empty((BH, N), dtype=torch.float32, device=dev)
    l2 = torch.empty((BH, N), dtype=torch.float32, device=dev)
    out_strides, do_strides = out.stride()[:3], do.stride()[:3]
    bm_pre = plan.pre_block_m
    grid = (_cdiv(N, bm_pre), BH)
    ev = trace.start_event(dev) if trace.active() else None
    kp = launch(_elsa_bwd_pre, grid, (out, do, mrow, zrow, delta, l2, *out_strides, *do_strides, H, N),
                dict(HEAD_DIM=D, BLOCK_M=bm_pre, num_warps=4))
    if trace.active():
        trace.record(start=ev, phase="bwd_pre", kernel=_elsa_bwd_pre.__name__, grid=grid, programs=grid[0] * BH, compiled=kp)
    bias_v, (sbb, sbh, sbi, sbj) = _bias_view(bias, B, H, N)
    bias_arg = bias_v if bias_v is not None else q
    qk_scale = scale * LOG2E
    fold_q = q.dtype == torch.float32
    scale_in_exp = not fold_q and bias_v is None
    prec = _dot_precision(q.dtype, precision)
    strides = (*_head_strides(q, k, v), *do_strides)
    bm, bn, warps, stages = plan.dq
    grid = (_cdiv(N, bm), BH)
    ev = trace.start_event(dev) if trace.active() else None
    kq = launch(_elsa_bwd_dq, grid, (q, k, v, do, l2, delta, dq, bias_arg, dbias_full if bias_grad else delta,
                *strides, *dq.stride()[:3], sbb, sbh, sbi, sbj,
                H, N, qk_scale, scale), dict(
                HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, HAS_BIAS=bias_v is not None,
                BIAS_GRAD=bias_grad, FOLD_Q=fold_q, SCALE_IN_EXP=scale_in_exp, DOT_PREC=prec, num_warps=warps, num_stages=stages))
    if trace.active():
        trace.record(start=ev, phase="bwd_dq", kernel=_elsa_bwd_dq.__name__, grid=grid, programs=grid[0] * BH, compiled=kq)
    bm, bn, warps, stages = plan.dkdv
    grid = (_cdiv(N, bn), BH)
    ev = trace.start_event(dev) if trace.active() else None
    kdkdv = launch(_elsa_bwd_dkdv, grid, (q, k, v, do, l2, delta, dk, dv, bias_arg,
                   *strides, *dk.stride()[:3], *dv.stride()[:3],
                   sbb, sbh, sbi, sbj, H, N, qk_scale, scale), dict(
                   HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, HAS_BIAS=bias_v is not None,
                   FOLD_Q=fold_q, SCALE_IN_EXP=scale_in_exp, DOT_PREC=prec, num_warps=warps, num_stages=stages))
    if trace.active():
        trace.record(start=ev, phase="bwd_dkdv", kernel=_elsa_bwd_dkdv.__name__, grid=grid, programs=grid[0] * BH, compiled=kdkdv)
    return dq, dk, dv, dbias_full


class _ElsaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_bias, causal, scale, precision, knobs):
        out, mrow, zrow = _forward(q, k, v, attn_bias, causal, scale, precision, True, knobs)
        ctx.save_for_backward(q, k, v, out, mrow, zrow, attn_bias)
        ctx.causal, ctx.scale, ctx.precision, ctx.knobs = causal, scale, precision, knobs
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        q, k, v, out, mrow, zrow, attn_bias = ctx.saved_tensors
        bias_grad = attn_bias is not None and ctx.needs_input_grad[3]
        with _on_device(q):
            dq, dk, dv, dbias_full = _backward(d_out, q, k, v, out, mrow, zrow, attn_bias, bias_grad,
                                               ctx.causal, ctx.scale, ctx.precision, ctx.knobs)
        dbias = None
        if bias_grad:
            B, H, N, _ = q.shape
            dbias = dbias_full.view(B, H, N, N).sum_to_size(attn_bias.shape).to(attn_bias.dtype)
        return dq, dk, dv, dbias, None, None, None, None


def elsa_attention(q, k, v, causal=False, scale=None, precision="tf32x3", attn_bias=None, **knobs):
    """Exact softmax attention as a two-pass parallel scan over key partitions (ELSA).

    q, k, v: [B, H, N, D] of one dtype (float32, float16, bfloat16) on one device, D in {32, 64, 128}.
    causal: row i attends to keys j <= i. scale: defaults to 1/sqrt(D).
    precision: float32 dot products, "tf32x3" (default, ~fp32 accuracy on tensor cores), "ieee"
      (strict FP32 FMA, slower) or "tf32" (only when asked: ~1e-3 error, not exact). 16-bit inputs
      always use fp16/bf16 tensor-core products with fp32 accumulation.
    attn_bias: optional additive bias on the natural-log scores, broadcastable to [B, H, N, N]
      (read through stride-0 broadcast, never copied); its gradient is computed if it requires grad
      (that materialises an fp32 [B*H, N, N] dS buffer, fine for window attention, not for long N).
    knobs (tests/tuning): block_m, block_n, num_warps, num_stages, partition_width, q_chunk,
      dq_config, dkdv_config (tuples (BLOCK_M, BLOCK_N, num_warps, num_stages)).
    Rows with no visible key (all -inf bias) give 0.
    """
    _validate(q, k, v, causal, scale, precision, attn_bias, knobs)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                               or (attn_bias is not None and attn_bias.requires_grad))
    with _on_device(q):
        if needs_grad:
            return _ElsaFunction.apply(q, k, v, attn_bias, causal, scale, precision, dict(knobs))
        out, _, _ = _forward(q, k, v, attn_bias, causal, scale, precision, False, knobs)
        return out
