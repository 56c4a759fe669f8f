"""Triton kernels: attention over CQS subsequences, forward and backward (spec §3, §4.2).

One program = one row block (an ``item`` of a Schedule) × one (batch, head). It walks the item's
key ranges; each range is split into a loop of full, unmasked tiles (the hot loop: no masks, so it
pipelines like a plain FlashAttention loop) and a short masked loop for the range's ragged end and,
when causal, the diagonal. Responsibility masking never appears here: the schedule already left out
every masked piece, and a row block never straddles two pieces.

Forward modes:
- MODE 0 (partial): write fp32 normalised out and natural-log lse for the rows (lse = -inf and
  out = 0 for a row without a kept key) — the per-task result that the streaming engine merges.
- MODE 1 (wave merge): fold the block's (m, l, acc) into shared fp32 state with the log-sum-exp
  rule (rescale both sides by exp2 of the max, never exponentiate an lse), finalising on the last
  wave. Race-free because a wave touches each token once.
Backward (§4.2 form): p = exp2(s·log2e·α − lse·log2e) with the *global* lse, ds = p ⊙ (dO vᵀ − δ);
dQ and dK/dV kernels are separate and deterministic (no atomics), accumulating across waves.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels._tuning import dim_key, read_configs

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, K, V, kbase, vbase, skn, svn, start, hi, offs_m, qk_scale,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
              CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows64 = offs_n.to(tl.int64)[:, None]
    kp = K + kbase + rows64 * skn + offs_d[None, :]
    vp = V + vbase + rows64 * svn + offs_d[None, :]
    if MASKED:
        col_ok = offs_n < hi
        k = tl.load(kp, mask=col_ok[:, None], other=0.0)
        v = tl.load(vp, mask=col_ok[:, None], other=0.0)
    else:
        k = tl.load(kp)
        v = tl.load(vp)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASKED:
        ok = col_ok[None, :]
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has seen no key yet keeps m = -inf; use 0 as its reference so exp2 gives 0, not NaN
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, l_i, m_new


# first/last (which wave) are runtime flags, kept out of specialisation: one compiled kernel serves
# every wave, instead of three variants compiled per configuration.
@triton.jit(do_not_specialize=["first", "last"])
def cqsa_fwd_kernel(Q, K, V, OUT, LSE, ACC, MST, LST, ITEMS, RANGES,
                    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, slb, slh,
                    H, qk_scale, first, last,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, MODE: tl.constexpr, PRECISION: tl.constexpr):
    item = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rs = tl.load(ITEMS + item * 5)
    re = tl.load(ITEMS + item * 5 + 1)
    roff = tl.load(ITEMS + item * 5 + 2)
    rcnt = tl.load(ITEMS + item * 5 + 3)
    shift = tl.load(ITEMS + item * 5 + 4)     # output row = input row - shift (global -> task-local)
    offs_m = rs + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < re
    qbase = b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    kbase = b.to(tl.int64) * skb + h.to(tl.int64) * skh
    vbase = b.to(tl.int64) * svb + h.to(tl.int64) * svh
    q = tl.load(Q + qbase + offs_m.to(tl.int64)[:, None] * sqn + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for r in range(rcnt):
        lo = tl.load(RANGES + 2 * (roff + r))
        hi = tl.load(RANGES + 2 * (roff + r) + 1)
        if CAUSAL:
            hi = tl.minimum(hi, re)          # no row of the block sees keys at or past re
            mid = tl.minimum(hi, rs + 1)     # keys <= rs are visible to every row: no causal test
        else:
            mid = hi
        n_full = tl.maximum(mid - lo, 0) // BLOCK_N
        for j in range(n_full):
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, K, V, kbase, vbase, skn, svn, lo + j * BLOCK_N, hi,
                                      offs_m, qk_scale, BLOCK_N, HEAD_DIM, False, CAUSAL, PRECISION)
        for start in range(lo + n_full * BLOCK_N, hi, BLOCK_N):
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, K, V, kbase, vbase, skn, svn, start, hi,
                                      offs_m, qk_scale, BLOCK_N, HEAD_DIM, True, CAUSAL, PRECISION)
    obase = b.to(tl.int64) * sob + h.to(tl.int64) * soh
    lbase = b.to(tl.int64) * slb + h.to(tl.int64) * slh
    orow = offs_m - shift
    o_ptrs = OUT + obase + orow.to(tl.int64)[:, None] * son + offs_d[None, :]
    if MODE == 0:
        has = l_i > 0
        l_safe = tl.where(has, l_i, 1.0)
        out = acc / l_safe[:, None]
        lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + lbase + orow, lse, mask=row_ok)
    else:
        # state buffers are contiguous fp32 [B, H, N, D] and [B, H, N]; N = slh
        sbase = bh.to(tl.int64) * slh
        a_ptrs = ACC + sbase * HEAD_DIM + orow.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
        if first != 0:
            m1 = m_i
            l1 = l_i
            a1 = acc
        else:
            m0 = tl.load(MST + sbase + orow, mask=row_ok, other=float("-inf"))
            l0 = tl.load(LST + sbase + orow, mask=row_ok, other=0.0)
            a0 = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            m1 = tl.maximum(m0, m_i)
            m_ref = tl.where(m1 == float("-inf"), 0.0, m1)
            c0 = tl.exp2(m0 - m_ref)
            c1 = tl.exp2(m_i - m_ref)
            l1 = l0 * c0 + l_i * c1
            a1 = a0 * c0[:, None] + acc * c1[:, None]
        if last != 0:
            has = l1 > 0
            l_safe = tl.where(has, l1, 1.0)
            tl.store(o_ptrs, (a1 / l_safe[:, None]).to(OUT.dtype.element_ty), mask=row_ok[:, None])
            lse = tl.where(has, (m1 + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
            tl.store(LSE + lbase + orow, lse, mask=row_ok)
        else:
            tl.store(MST + sbase + orow, m1, mask=row_ok)
            tl.store(LST + sbase + orow, l1, mask=row_ok)
            tl.store(a_ptrs, a1, mask=row_ok[:, None])


@triton.jit
def _dq_tile(dq, q, do, lse2, delta, K, V, kbase, vbase, skn, svn, start, hi, offs_m, qk_scale,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
             CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows64 = offs_n.to(tl.int64)[:, None]
    kp = K + kbase + rows64 * skn + offs_d[None, :]
    vp = V + vbase + rows64 * svn + offs_d[None, :]
    if MASKED:
        col_ok = offs_n < hi
        k = tl.load(kp, mask=col_ok[:, None], other=0.0)
        v = tl.load(vp, mask=col_ok[:, None], other=0.0)
    else:
        k = tl.load(kp)
        v = tl.load(vp)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    p = tl.exp2(s - lse2[:, None])
    if MASKED:
        ok = col_ok[None, :]
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(ok, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit(do_not_specialize=["first", "last"])
def cqsa_bwd_dq_kernel(Q, K, V, DO, LSE2, DELTA, DQ, DQACC, ITEMS, RANGES,
                       sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn, sgb, sgh, sgn,
                       slb, slh, H, qk_scale, sm_scale, first, last,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    item = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rs = tl.load(ITEMS + item * 5)
    re = tl.load(ITEMS + item * 5 + 1)
    roff = tl.load(ITEMS + item * 5 + 2)
    rcnt = tl.load(ITEMS + item * 5 + 3)
    shift = tl.load(ITEMS + item * 5 + 4)     # output row = input row - shift (global -> task-local)
    offs_m = rs + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < re
    rows64 = offs_m.to(tl.int64)[:, None]
    qbase = b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    kbase = b.to(tl.int64) * skb + h.to(tl.int64) * skh
    vbase = b.to(tl.int64) * svb + h.to(tl.int64) * svh
    dbase = b.to(tl.int64) * sdb + h.to(tl.int64) * sdh
    lbase = b.to(tl.int64) * slb + h.to(tl.int64) * slh
    q = tl.load(Q + qbase + rows64 * sqn + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + dbase + rows64 * sdn + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(LSE2 + lbase + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + lbase + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for r in range(rcnt):
        lo = tl.load(RANGES + 2 * (roff + r))
        hi = tl.load(RANGES + 2 * (roff + r) + 1)
        if CAUSAL:
            hi = tl.minimum(hi, re)
            mid = tl.minimum(hi, rs + 1)
        else:
            mid = hi
        n_full = tl.maximum(mid - lo, 0) // BLOCK_N
        for j in range(n_full):
            dq = _dq_tile(dq, q, do, lse2, delta, K, V, kbase, vbase, skn, svn, lo + j * BLOCK_N, hi, offs_m,
                          qk_scale, BLOCK_N, HEAD_DIM, False, CAUSAL, PRECISION)
        for start in range(lo + n_full * BLOCK_N, hi, BLOCK_N):
            dq = _dq_tile(dq, q, do, lse2, delta, K, V, kbase, vbase, skn, svn, start, hi, offs_m,
                          qk_scale, BLOCK_N, HEAD_DIM, True, CAUSAL, PRECISION)
    dq = dq * sm_scale
    gbase = b.to(tl.int64) * sgb + h.to(tl.int64) * sgh
    orow = (offs_m - shift).to(tl.int64)[:, None]
    g_ptrs = DQ + gbase + orow * sgn + offs_d[None, :]
    a_ptrs = DQACC + bh.to(tl.int64) * slh * HEAD_DIM + orow * HEAD_DIM + offs_d[None, :]
    if first == 0:
        dq += tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
    if last != 0:
        tl.store(g_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(a_ptrs, dq, mask=row_ok[:, None])


@triton.jit
def _dkdv_tile(dk, dv, k, v, Q, DO, LSE2, DELTA, qbase, dbase, lbase, sqn, sdn, start, hi, offs_n, qk_scale,
               BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
               CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    offs_m = start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    cols64 = offs_m.to(tl.int64)[:, None]
    qp = Q + qbase + cols64 * sqn + offs_d[None, :]
    dp_ = DO + dbase + cols64 * sdn + offs_d[None, :]
    if MASKED:
        col_ok = offs_m < hi
        q = tl.load(qp, mask=col_ok[:, None], other=0.0)
        do = tl.load(dp_, mask=col_ok[:, None], other=0.0)
        lse2 = tl.load(LSE2 + lbase + offs_m, mask=col_ok, other=float("inf"))
        delta = tl.load(DELTA + lbase + offs_m, mask=col_ok, other=0.0)
    else:
        q = tl.load(qp)
        do = tl.load(dp_)
        lse2 = tl.load(LSE2 + lbase + offs_m)
        delta = tl.load(DELTA + lbase + offs_m)
    st = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale      # [BLOCK_N keys, BLOCK_M queries]
    pt = tl.exp2(st - lse2[None, :])
    if MASKED:
        ok = col_ok[None, :]
        if CAUSAL:
            ok = ok & (offs_m[None, :] >= offs_n[:, None])
        pt = tl.where(ok, pt, 0.0)
    dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
    dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    dst = pt * (dpt - delta[None, :])
    dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["first", "last"])
def cqsa_bwd_dkdv_kernel(Q, K, V, DO, LSE2, DELTA, DK, DV, DKACC, DVACC, ITEMS, RANGES,
                         sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn,
                         skgb, skgh, skgn, svgb, svgh, svgn, slb, slh, H, qk_scale, sm_scale, first, last,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    # rows of this program are keys [rs, re); ranges list the query ranges that may attend them
    item = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rs = tl.load(ITEMS + item * 5)
    re = tl.load(ITEMS + item * 5 + 1)
    roff = tl.load(ITEMS + item * 5 + 2)
    rcnt = tl.load(ITEMS + item * 5 + 3)
    shift = tl.load(ITEMS + item * 5 + 4)     # output row = input row - shift (global -> task-local)
    offs_n = rs + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_n < re
    rows64 = offs_n.to(tl.int64)[:, None]
    qbase = b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    kbase = b.to(tl.int64) * skb + h.to(tl.int64) * skh
    vbase = b.to(tl.int64) * svb + h.to(tl.int64) * svh
    dbase = b.to(tl.int64) * sdb + h.to(tl.int64) * sdh
    lbase = b.to(tl.int64) * slb + h.to(tl.int64) * slh
    k = tl.load(K + kbase + rows64 * skn + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    v = tl.load(V + vbase + rows64 * svn + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for r in range(rcnt):
        lo = tl.load(RANGES + 2 * (roff + r))
        hi = tl.load(RANGES + 2 * (roff + r) + 1)
        if CAUSAL:
            lo = tl.maximum(lo, rs)                               # queries before the first key see none
            head_end = tl.minimum(tl.maximum(lo, re - 1), hi)     # queries >= re-1 see every key: no test
            n_head = tl.cdiv(tl.maximum(head_end - lo, 0), BLOCK_M)
        else:
            n_head = 0
        for start in range(lo, lo + n_head * BLOCK_M, BLOCK_M):
            dk, dv = _dkdv_tile(dk, dv, k, v, Q, DO, LSE2, DELTA, qbase, dbase, lbase, sqn, sdn, start, hi, offs_n,
                                qk_scale, BLOCK_M, HEAD_DIM, True, CAUSAL, PRECISION)
        u0 = lo + n_head * BLOCK_M
        n_full = tl.maximum(hi - u0, 0) // BLOCK_M
        for j in range(n_full):
            dk, dv = _dkdv_tile(dk, dv, k, v, Q, DO, LSE2, DELTA, qbase, dbase, lbase, sqn, sdn, u0 + j * BLOCK_M,
                                hi, offs_n, qk_scale, BLOCK_M, HEAD_DIM, False, CAUSAL, PRECISION)
        for start in range(u0 + n_full * BLOCK_M, hi, BLOCK_M):
            dk, dv = _dkdv_tile(dk, dv, k, v, Q, DO, LSE2, DELTA, qbase, dbase, lbase, sqn, sdn, start, hi, offs_n,
                                qk_scale, BLOCK_M, HEAD_DIM, True, CAUSAL, PRECISION)
    dk = dk * sm_scale
    sbase = bh.to(tl.int64) * slh * HEAD_DIM
    orow = (offs_n - shift).to(tl.int64)[:, None]
    ka = DKACC + sbase + orow * HEAD_DIM + offs_d[None, :]
    va = DVACC + sbase + orow * HEAD_DIM + offs_d[None, :]
    if first == 0:
        dk += tl.load(ka, mask=row_ok[:, None], other=0.0)
        dv += tl.load(va, mask=row_ok[:, None], other=0.0)
    if last != 0:
        kg = DK + b.to(tl.int64) * skgb + h.to(tl.int64) * skgh + orow * skgn + offs_d[None, :]
        vg = DV + b.to(tl.int64) * svgb + h.to(tl.int64) * svgh + orow * svgn + offs_d[None, :]
        tl.store(kg, dk.to(DK.dtype.element_ty), mask=row_ok[:, None])
        tl.store(vg, dv.to(DV.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(ka, dk, mask=row_ok[:, None])
        tl.store(va, dv, mask=row_ok[:, None])


# --- launch configuration --------------------------------------------------------------------------

_OVERRIDE: dict[str, tuple] = {}
# `scripts/tune.py --kernel cqsa` writes the tiles it chooses to tuning.json beside this file:
# {"fwd": {"16,128": [bm, bn, warps, stages]}, "bwd": {...}} (dtype class "16" or "32", head dim); an entry there
# replaces the built-in GPU choice below for that dtype class and head dim.
TUNING_FILE = Path(__file__).with_name("tuning.json")
_TUNED = read_configs(TUNING_FILE)


def set_config(kind: str, cfg: tuple | None):
    """Override (BLOCK_M, BLOCK_N, num_warps, num_stages) for kind "fwd" or "bwd" (tuning scripts)."""
    if cfg is None:
        _OVERRIDE.pop(kind, None)
    else:
        _OVERRIDE[kind] = tuple(cfg)


def config(kind: str, head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    if kind in _OVERRIDE:
        return _OVERRIDE[kind]
    env = os.environ.get(f"CQSA_{kind.upper()}_CONFIG")
    if env:
        return tuple(int(x) for x in env.split(","))
    if device.type != "cuda":
        return (32, 32, 4, 1)                    # the interpreter: small tiles exercise the tile logic
    if _TUNED:
        tuned = _TUNED.get(kind, {}).get(dim_key("32" if dtype == torch.float32 else "16", head_dim))
        if tuned:
            return tuple(tuned)
    # Checked for sm_90 with ptxas (no register spills for the half-precision configs below);
    # float32 with tf32x3 dots is register-bound whatever the tile and is not the speed target.
    if kind == "fwd":
        if dtype == torch.float32:
            return (64, 32, 4, 2)
        if head_dim == 128:
            return (128, 64, 8, 2)               # Hopper: 128-row blocks, 8 warps for D=128
        return (128, 64, 4, 2)
    # backward: 64x64 tiles keep dK, dV, K, V and the streamed Q/dO tiles within registers
    if dtype == torch.float32:
        return {32: (64, 64, 4, 1), 64: (64, 32, 4, 1)}.get(head_dim, (64, 32, 8, 1))
    return (64, 64, 8, 2) if head_dim == 128 else (64, 64, 4, 2)


def precision_for(dtype: torch.dtype, precision: str) -> str:
    if precision not in ("ieee", "tf32x3"):
        raise ValueError(f"cqsa: precision must be 'ieee' or 'tf32x3', got {precision!r}")
    return precision if dtype == torch.float32 else "ieee"


def _s(t: torch.Tensor, n: int):
    """Strides of dims (0, 1, ..., n-1)."""
    return [t.stride(i) for i in range(n)]


def launch_fwd(q, k, v, out, lse, items, ranges, *, causal, scale, block, precision,
               mode=0, first=True, last=True, acc=None, mst=None, lst=None):
    """q/k/v/out [B,H,L,D] (last dim contiguous), lse [B,H,L] fp32."""
    B, H, _, D = q.shape
    n_items = items.shape[0]
    if n_items == 0 or B * H == 0:
        return
    bm, bn, warps, stages = block
    dummy = lse
    cqsa_fwd_kernel[(n_items, B * H)](
        q, k, v, out, lse, acc if acc is not None else dummy, mst if mst is not None else dummy,
        lst if lst is not None else dummy, items, ranges,
        *_s(q, 3), *_s(k, 3), *_s(v, 3), *_s(out, 3), *_s(lse, 2),
        H, scale * LOG2E, int(first), int(last),
        HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, MODE=mode,
        PRECISION=precision, num_warps=warps, num_stages=stages)


def launch_bwd_dq(q, k, v, do, lse2, delta, dq, items, ranges, *, causal, scale, block, precision,
                  first=True, last=True, dqacc=None):
    B, H, _, D = q.shape
    n_items = items.shape[0]
    if n_items == 0 or B * H == 0:
        return
    bm, bn, warps, stages = block
    cqsa_bwd_dq_kernel[(n_items, B * H)](
        q, k, v, do, lse2, delta, dq, dqacc if dqacc is not None else dq, items, ranges,
        *_s(q, 3), *_s(k, 3), *_s(v, 3), *_s(do, 3), *_s(dq, 3), *_s(lse2, 2),
        H, scale * LOG2E, scale, int(first), int(last),
        HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, PRECISION=precision,
        num_warps=warps, num_stages=stages)


def launch_bwd_dkdv(q, k, v, do, lse2, delta, dk, dv, items, ranges, *, causal, scale, block, precision,
                    first=True, last=True, dkacc=None, dvacc=None):
    B, H, _, D = q.shape
    n_items = items.shape[0]
    if n_items == 0 or B * H == 0:
        return
    bm, bn, warps, stages = block
    cqsa_bwd_dkdv_kernel[(n_items, B * H)](
        q, k, v, do, lse2, delta, dk, dv, dkacc if dkacc is not None else dk, dvacc if dvacc is not None else dv,
        items, ranges,
        *_s(q, 3), *_s(k, 3), *_s(v, 3), *_s(do, 3), *_s(dk, 3), *_s(dv, 3), *_s(lse2, 2),
        H, scale * LOG2E, scale, int(first), int(last),
        HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, PRECISION=precision,
        num_warps=warps, num_stages=stages)


# --- streaming: the per-row-block finalisation ---------------------------------------------------------

@triton.jit
def cqsa_finalize_kernel(ACC, MST, SST, O, LSE, g0, n, N, H, sob, soh, son, slb, slh, mscale,
                         HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """Rows [g0, g0+n) of the accumulator -> O[.., r - g0, :] = acc / s (O's dtype) and the natural-log
    LSE = m·mscale + ln s (mscale = 1 for natural-log state, ln 2 for the kernel's log2 state);
    rows without a key get out = 0 and lse = -inf."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs < n
    grow = (g0 + offs).to(tl.int64)
    sb = bh.to(tl.int64) * N
    m = tl.load(MST + sb + grow, mask=ok, other=float("-inf"))
    s = tl.load(SST + sb + grow, mask=ok, other=0.0)
    acc = tl.load(ACC + sb * HEAD_DIM + grow[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0)
    has = s > 0
    s_safe = tl.where(has, s, 1.0)
    o = acc / s_safe[:, None]
    lse = tl.where(has, m * mscale + tl.log(s_safe), float("-inf"))
    orow = offs.to(tl.int64)
    tl.store(O + b.to(tl.int64) * sob + h.to(tl.int64) * soh + orow[:, None] * son + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=ok[:, None])
    tl.store(LSE + b.to(tl.int64) * slb + h.to(tl.int64) * slh + orow, lse, mask=ok)


FINAL_BLOCK = 32


def launch_finalize(acc, mst, sst, out, lse, g0: int, mscale: float, block: int = FINAL_BLOCK):
    """out [B,H,n,D] (last dim contiguous, any dtype), lse [B,H,n] fp32 <- accumulator rows [g0, g0+n)."""
    B, H, n, D = out.shape
    if n == 0 or B * H == 0:
        return
    assert out.stride(-1) == 1 and acc.is_contiguous() and mst.is_contiguous() and sst.is_contiguous()
    cqsa_finalize_kernel[(triton.cdiv(n, block), B * H)](
        acc, mst, sst, out, lse, g0, n, mst.shape[2], H, *_s(out, 3), *_s(lse, 2), float(mscale),
        HEAD_DIM=D, BLOCK=block, num_warps=4)
