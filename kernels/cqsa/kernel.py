"""Triton kernels: attention over CQS subsequences, forward and backward (spec §3, §4.2), and their tiles.

One program = one row block (an ``item`` of a Schedule) × one (batch, head). It walks the item's
column ranges; each range is split into a loop of full, unmasked tiles (the hot loop: no masks, so it
pipelines like a plain FlashAttention loop) and a short masked loop for the range's ragged end and,
when causal, the diagonal -- in the forward, the shared flash core's loop (kernels/_flash_core.py, fold_keys:
the same base-2 state the waves merge). Responsibility masking never appears here: the schedule already left out
every masked piece, and a row block never straddles two pieces.

Shapes the kernels take (the contract of kernels/_common.py):
- grouped-query K/V read in place: query head h reads key/value head h // GROUP; the dK/dV kernel runs per
  key/value head and sums the GROUP query heads that share it inside the program (no repeated K/V, no
  expanded dK/dV);
- Nq != Nk with causal aligned bottom-right: key n is visible from query m iff n <= m + delta + causal_off,
  causal_off = Nk - Nq and delta per range from the schedule (0 in global coordinates);
- any head dim D that is a multiple of 8 up to 256: tiles are BLOCK_D = block_d(D) wide and the columns
  past D are masked (loads give 0, stores skip them); fp32 state keeps D columns.
q, k, v, dO: any strides with a unit feature stride; every buffer the kernels allocate themselves
(outputs, lse, state) is contiguous, so only its row count is passed.

Forward modes:
- MODE 0 (partial): write fp32 normalised out and natural-log lse for the rows (lse = -inf and
  out = 0 for a row without a kept key) — the per-task result that the streaming engine merges.
- MODE 1 (wave merge): fold the block's (m, l, acc) into shared fp32 state with the log-sum-exp
  rule (rescale both sides by exp2 of the max, never exponentiate an lse), finalising on the last
  wave. Race-free because a wave touches each row once. A launch that is both first and last writes O and
  lse directly and never touches the state: the resident path's joined waves (``n_waves`` > 1, items
  [I, n_waves, 5]: a program folds its row block's item of every wave in turn, merging in registers).
Backward (§4.2 form): p = exp2(s·log2e·α − lse·log2e) with the *global* lse (natural log in memory,
converted here; rows without a key get +inf, so their p is 0), ds = p ⊙ (dO vᵀ − δ); dQ and dK/dV
kernels are separate and deterministic (no atomics), accumulating across launched waves in an fp32 workspace
(joined waves accumulate in registers).
The first dQ wave can compute δ = rowsum(dO ⊙ O) for its rows itself (DELTA_FROM_O), so the resident
backward needs no separate pass for it.
"""
from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl

from .. import _flash_core as core
from .._common import block_d, interpreted, launch, tile_config
from .._tuning import dim_key, read_configs


@triton.jit
def _load_tile(P, base, rows, stride, offs_d, ok, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               ROW_MASK: tl.constexpr):
    """[rows, BLOCK_D] tile of a row-major matrix; rows past `ok` and columns past HEAD_DIM read as 0."""
    ptrs = P + base + rows.to(tl.int64)[:, None] * stride + offs_d[None, :]
    return core.load_tile(ptrs, ok, offs_d, HEAD_DIM, BLOCK_D, ROW_MASK)


@triton.jit
def _store_tile(P, base, rows, stride, offs_d, ok, x, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    ptrs = P + base + rows.to(tl.int64)[:, None] * stride + offs_d[None, :]
    if HEAD_DIM == BLOCK_D:
        tl.store(ptrs, x.to(P.dtype.element_ty), mask=ok[:, None])
    else:
        tl.store(ptrs, x.to(P.dtype.element_ty), mask=ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _read_range(RANGES, idx, causal_off, CAUSAL: tl.constexpr):
    """Column range idx of the range table [*, 3]: its bounds [lo, hi) and, causal, its bottom-right shift dlt
    (key n visible from query m: n <= m + dlt; 0 when not causal)."""
    lo = tl.load(RANGES + 3 * idx)
    hi = tl.load(RANGES + 3 * idx + 1)
    dlt = 0
    if CAUSAL:
        dlt = tl.load(RANGES + 3 * idx + 2) + causal_off
    return lo, hi, dlt


@triton.jit
def _log2_lse(lse):
    """Natural-log lse -> log2 units; -inf (a row without a key) -> +inf, so exp2(s - lse2) is 0."""
    return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)


@triton.jit
def _item_rows(ITEMS, n_waves, BLOCK: tl.constexpr):
    """This program's item of the joined waves (ITEMS [I, n_waves, 5]: row start, row end, the wave's range offset
    and count, shift): its entry, its row bounds rs and re, shift (output row = input row - shift: global ->
    task-local), and its BLOCK rows from rs with their mask."""
    it = ITEMS + tl.program_id(0) * (n_waves * 5)
    rs = tl.load(it)
    re = tl.load(it + 1)
    shift = tl.load(it + 4)
    offs = rs + tl.arange(0, BLOCK)
    return it, rs, re, shift, offs, offs < re


@triton.jit
def _wave_out(x, WS, OUT, base, rows, offs_d, ok, first, last, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """A wave's fp32 output tile x plus what the waves before it left in the workspace WS (first == 0), stored to
    OUT on the last wave, else back to WS (first = last = 0: accumulate in WS, the streaming engine's merge)."""
    if first == 0:
        x += _load_tile(WS, base, rows, HEAD_DIM, offs_d, ok, HEAD_DIM, BLOCK_D, True)
    if last != 0:
        _store_tile(OUT, base, rows, HEAD_DIM, offs_d, ok, x, HEAD_DIM, BLOCK_D)
    else:
        _store_tile(WS, base, rows, HEAD_DIM, offs_d, ok, x, HEAD_DIM, BLOCK_D)


# first/last (which wave) are runtime flags, kept out of specialisation: one compiled kernel serves every
# wave, instead of three variants compiled per configuration; so are the offsets that vary with the shape.
@triton.jit(do_not_specialize=["first", "last", "off_m", "off_l", "causal_off"])
def cqsa_fwd_kernel(Q, K, V, OUT, LSE, STATE, ITEMS, RANGES,
                    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn,
                    H, GROUP, N_OUT, off_m, off_l, causal_off, qk_scale, n_waves, first, last,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, MODE: tl.constexpr, PRECISION: tl.constexpr, USE_DESC: tl.constexpr):
    """OUT [B,H,N_OUT,HEAD_DIM] and LSE [B,H,N_OUT] contiguous. MODE 1: STATE holds the fp32 wave state
    acc [B,H,N_OUT,HEAD_DIM] at 0, the running max m (log2 units) at off_m and the sum l at off_l.
    USE_DESC: K and V tiles through tensor descriptors (TMA on Hopper), one per column range, shaped [hi, HEAD_DIM]
    so that the range end bounds the rows a tile reads (zero past it, masked by fold_keys like the pointer path).
    ITEMS [I, n_waves, 5]: a program folds the column ranges of its row block's item in each of the n_waves
    joined waves (schedule.join_waves: the same rows in each) in turn, in registers."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    it, rs, re, shift, offs_m, row_ok = _item_rows(ITEMS, n_waves, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    qbase = core.head_base(b, h, sqb, sqh)
    kbase = core.head_base(b, hk, skb, skh)
    vbase = core.head_base(b, hk, svb, svh)
    q = _load_tile(Q, qbase, offs_m, sqn, offs_d, row_ok, HEAD_DIM, BLOCK_D, True)
    acc, m_i, l_i = core.init_state(BLOCK_M, BLOCK_D)
    for w in range(n_waves):
        roff = tl.load(it + w * 5 + 2)
        rcnt = tl.load(it + w * 5 + 3)
        for r in range(rcnt):
            lo, hi, dlt = _read_range(RANGES, roff + r, causal_off, CAUSAL)
            # the flash core's loop over the range [lo, hi): full unmasked tiles (up to the block's first row's
            # horizon, causal), then the masked ragged end and diagonal; the range end is its key bound (keys past
            # it belong to other ranges) and dlt its bottom-right causal shift. With descriptors, the range end is
            # also the descriptor's row count (the rows a tile may read lie below it either way).
            k_src = core.row_source(K + kbase, hi, skn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_DESC)
            v_src = core.row_source(V + vbase, hi, svn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_DESC)
            acc, m_i, l_i = core.fold_keys(acc, m_i, l_i, q, k_src, v_src, skn, svn, lo, hi, rs, hi, dlt,
                                           qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, CAUSAL, False, USE_DESC,
                                           False, PRECISION)
    orow = offs_m - shift
    obase = bh.to(tl.int64) * N_OUT * HEAD_DIM
    lbase = bh.to(tl.int64) * N_OUT
    if MODE == 0:
        has = l_i > 0
        l_safe = tl.where(has, l_i, 1.0)
        lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        _store_tile(OUT, obase, orow, HEAD_DIM, offs_d, row_ok, acc / l_safe[:, None], HEAD_DIM, BLOCK_D)
        tl.store(LSE + lbase + orow, lse, mask=row_ok)
    else:
        if first != 0:
            m1 = m_i
            l1 = l_i
            a1 = acc
        else:
            m0 = tl.load(STATE + off_m + lbase + orow, mask=row_ok, other=float("-inf"))
            l0 = tl.load(STATE + off_l + lbase + orow, mask=row_ok, other=0.0)
            a0 = _load_tile(STATE, obase, orow, HEAD_DIM, offs_d, row_ok, HEAD_DIM, BLOCK_D, True)
            m1 = tl.maximum(m0, m_i)
            m_ref = tl.where(m1 == float("-inf"), 0.0, m1)
            c0 = tl.exp2(m0 - m_ref)
            c1 = tl.exp2(m_i - m_ref)
            l1 = l0 * c0 + l_i * c1
            a1 = a0 * c0[:, None] + acc * c1[:, None]
        if last != 0:
            has = l1 > 0
            l_safe = tl.where(has, l1, 1.0)
            _store_tile(OUT, obase, orow, HEAD_DIM, offs_d, row_ok, a1 / l_safe[:, None], HEAD_DIM, BLOCK_D)
            lse = tl.where(has, (m1 + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
            tl.store(LSE + lbase + orow, lse, mask=row_ok)
        else:
            tl.store(STATE + off_m + lbase + orow, m1, mask=row_ok)
            tl.store(STATE + off_l + lbase + orow, l1, mask=row_ok)
            _store_tile(STATE, obase, orow, HEAD_DIM, offs_d, row_ok, a1, HEAD_DIM, BLOCK_D)


@triton.jit
def _dq_tile(dq, q, do, lse2, delta, K, V, kbase, vbase, skn, svn, start, hi, offs_m, dlt, qk_scale,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
             CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < hi
    rows64 = offs_n.to(tl.int64)[:, None]
    kp = K + kbase + rows64 * skn + offs_d[None, :]
    vp = V + vbase + rows64 * svn + offs_d[None, :]
    # the loads are written out here, not through _load_tile: the interpreter pays per device-function call
    if MASKED:
        mask = col_ok[:, None]
        if HEAD_DIM != BLOCK_D:
            mask = mask & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(kp, mask=mask, other=0.0)
        v = tl.load(vp, mask=mask, other=0.0)
    elif HEAD_DIM == BLOCK_D:
        k = tl.load(kp)
        v = tl.load(vp)
    else:
        k = tl.load(kp, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        v = tl.load(vp, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    p = tl.exp2(s - lse2[:, None])
    if MASKED:
        ok = col_ok[None, :]
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= offs_m[:, None] + dlt)
        p = tl.where(ok, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit(do_not_specialize=["first", "last", "off_delta", "causal_off"])
def cqsa_bwd_dq_kernel(Q, K, V, O, DO, LSE, WS, DQ, ITEMS, RANGES,
                       sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn,
                       H, GROUP, N_ROWS, N_OUT, off_delta, causal_off, qk_scale, sm_scale, n_waves, first, last,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       CAUSAL: tl.constexpr, PRECISION: tl.constexpr, DELTA_FROM_O: tl.constexpr):
    """Rows read at input rows (Q, dO strided; O [B,H,N_ROWS,HEAD_DIM], LSE and δ [B,H,N_ROWS] contiguous),
    written at output rows (DQ [B,H,N_OUT,HEAD_DIM] contiguous). WS: fp32 workspace with the dQ accumulator
    [B,H,N_OUT,HEAD_DIM] at 0 and δ at off_delta; DELTA_FROM_O: the first wave computes δ and stores it.
    ITEMS [I, n_waves, 5]: joined waves, as in the forward."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    it, rs, re, shift, offs_m, row_ok = _item_rows(ITEMS, n_waves, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    qbase = core.head_base(b, h, sqb, sqh)
    kbase = core.head_base(b, hk, skb, skh)
    vbase = core.head_base(b, hk, svb, svh)
    dbase = core.head_base(b, h, sdb, sdh)
    lbase = bh.to(tl.int64) * N_ROWS
    q = _load_tile(Q, qbase, offs_m, sqn, offs_d, row_ok, HEAD_DIM, BLOCK_D, True)
    do = _load_tile(DO, dbase, offs_m, sdn, offs_d, row_ok, HEAD_DIM, BLOCK_D, True)
    lse2 = _log2_lse(tl.load(LSE + lbase + offs_m, mask=row_ok, other=float("-inf")))
    d_ptrs = WS + off_delta + lbase + offs_m
    if DELTA_FROM_O:
        if first != 0:
            o = _load_tile(O, lbase * HEAD_DIM, offs_m, HEAD_DIM, offs_d, row_ok, HEAD_DIM, BLOCK_D, True)
            delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
            tl.store(d_ptrs, delta, mask=row_ok)
        else:
            delta = tl.load(d_ptrs, mask=row_ok, other=0.0)
    else:
        delta = tl.load(d_ptrs, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for w in range(n_waves):
        roff = tl.load(it + w * 5 + 2)
        rcnt = tl.load(it + w * 5 + 3)
        for r in range(rcnt):
            lo, hi, dlt = _read_range(RANGES, roff + r, causal_off, CAUSAL)
            if CAUSAL:
                hi = tl.minimum(hi, re + dlt)
                mid = tl.minimum(hi, rs + dlt + 1)
            else:
                mid = hi
            n_full = tl.maximum(mid - lo, 0) // BLOCK_N
            for j in range(n_full):
                dq = _dq_tile(dq, q, do, lse2, delta, K, V, kbase, vbase, skn, svn, lo + j * BLOCK_N, hi, offs_m,
                              dlt, qk_scale, BLOCK_N, HEAD_DIM, BLOCK_D, False, CAUSAL, PRECISION)
            for start in range(lo + n_full * BLOCK_N, hi, BLOCK_N):
                dq = _dq_tile(dq, q, do, lse2, delta, K, V, kbase, vbase, skn, svn, start, hi, offs_m, dlt,
                              qk_scale, BLOCK_N, HEAD_DIM, BLOCK_D, True, CAUSAL, PRECISION)
    dq = dq * sm_scale
    orow = offs_m - shift
    obase = bh.to(tl.int64) * N_OUT * HEAD_DIM
    _wave_out(dq, WS, DQ, obase, orow, offs_d, row_ok, first, last, HEAD_DIM, BLOCK_D)


@triton.jit
def _dkdv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, qbase, dbase, lbase, sqn, sdn, start, hi, offs_n, dlt, qk_scale,
               BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
               CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    offs_m = start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_m < hi
    cols64 = offs_m.to(tl.int64)[:, None]
    qp = Q + qbase + cols64 * sqn + offs_d[None, :]
    dp_ = DO + dbase + cols64 * sdn + offs_d[None, :]
    # loads written out (no _load_tile / _log2_lse calls): the interpreter pays per device-function call
    if MASKED:
        mask = col_ok[:, None]
        if HEAD_DIM != BLOCK_D:
            mask = mask & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(qp, mask=mask, other=0.0)
        do = tl.load(dp_, mask=mask, other=0.0)
        lse = tl.load(LSE + lbase + offs_m, mask=col_ok, other=float("-inf"))
        delta = tl.load(DELTA + lbase + offs_m, mask=col_ok, other=0.0)
    else:
        if HEAD_DIM == BLOCK_D:
            q = tl.load(qp)
            do = tl.load(dp_)
        else:
            q = tl.load(qp, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
            do = tl.load(dp_, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        lse = tl.load(LSE + lbase + offs_m)
        delta = tl.load(DELTA + lbase + offs_m)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)   # see _log2_lse
    st = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale      # [BLOCK_N keys, BLOCK_M queries]
    pt = tl.exp2(st - lse2[None, :])
    if MASKED:
        ok = col_ok[None, :]
        if CAUSAL:
            ok = ok & (offs_n[:, None] <= offs_m[None, :] + dlt)
        pt = tl.where(ok, pt, 0.0)
    dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
    dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    dst = pt * (dpt - delta[None, :])
    dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["first", "last", "off_delta", "off_dk", "off_dv", "causal_off"])
def cqsa_bwd_dkdv_kernel(Q, K, V, DO, LSE, WS, DK, DV, ITEMS, RANGES,
                         sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn,
                         HKV, GROUP, N_ROWS, N_OUT, off_delta, off_dk, off_dv, causal_off, qk_scale, sm_scale,
                         n_waves, first, last,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """One program per key row block × (batch, key/value head): the GROUP query heads that read this head are
    summed here. LSE and δ (at WS + off_delta) are [B,Hq,N_ROWS]; DK, DV [B,HKV,N_OUT,HEAD_DIM] contiguous;
    the fp32 accumulators across waves at WS + off_dk and WS + off_dv, same shape. ITEMS [I, n_waves, 5]: joined
    waves, as in the forward."""
    bhk = tl.program_id(1)
    b = bhk // HKV
    hk = bhk % HKV
    it, rs, re, shift, offs_n, row_ok = _item_rows(ITEMS, n_waves, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kbase = core.head_base(b, hk, skb, skh)
    vbase = core.head_base(b, hk, svb, svh)
    k = _load_tile(K, kbase, offs_n, skn, offs_d, row_ok, HEAD_DIM, BLOCK_D, True)
    v = _load_tile(V, vbase, offs_n, svn, offs_d, row_ok, HEAD_DIM, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        qbase = core.head_base(b, h, sqb, sqh)
        dbase = core.head_base(b, h, sdb, sdh)
        lbase = (b * HKV * GROUP + h).to(tl.int64) * N_ROWS
        for w in range(n_waves):
            roff = tl.load(it + w * 5 + 2)
            rcnt = tl.load(it + w * 5 + 3)
            for r in range(rcnt):
                lo, hi, dlt = _read_range(RANGES, roff + r, causal_off, CAUSAL)
                if CAUSAL:
                    lo = tl.maximum(lo, rs - dlt)                               # queries before that see no key here
                    head_end = tl.minimum(tl.maximum(lo, re - 1 - dlt), hi)    # queries >= re-1-dlt see every key
                    n_head = tl.cdiv(tl.maximum(head_end - lo, 0), BLOCK_M)
                else:
                    n_head = 0
                for start in range(lo, lo + n_head * BLOCK_M, BLOCK_M):
                    dk, dv = _dkdv_tile(dk, dv, k, v, Q, DO, LSE, WS + off_delta, qbase, dbase, lbase, sqn, sdn, start,
                                        hi, offs_n, dlt, qk_scale, BLOCK_M, HEAD_DIM, BLOCK_D, True, CAUSAL, PRECISION)
                u0 = lo + n_head * BLOCK_M
                n_full = tl.maximum(hi - u0, 0) // BLOCK_M
                for j in range(n_full):
                    dk, dv = _dkdv_tile(dk, dv, k, v, Q, DO, LSE, WS + off_delta, qbase, dbase, lbase, sqn, sdn,
                                        u0 + j * BLOCK_M, hi, offs_n, dlt, qk_scale, BLOCK_M, HEAD_DIM, BLOCK_D, False,
                                        CAUSAL, PRECISION)
                for start in range(u0 + n_full * BLOCK_M, hi, BLOCK_M):
                    dk, dv = _dkdv_tile(dk, dv, k, v, Q, DO, LSE, WS + off_delta, qbase, dbase, lbase, sqn, sdn, start,
                                        hi, offs_n, dlt, qk_scale, BLOCK_M, HEAD_DIM, BLOCK_D, True, CAUSAL, PRECISION)
    dk = dk * sm_scale
    orow = offs_n - shift
    obase = bhk.to(tl.int64) * N_OUT * HEAD_DIM
    _wave_out(dk, WS + off_dk, DK, obase, orow, offs_d, row_ok, first, last, HEAD_DIM, BLOCK_D)
    _wave_out(dv, WS + off_dv, DV, obase, orow, offs_d, row_ok, first, last, HEAD_DIM, BLOCK_D)


# --- tile configurations -----------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel ("fwd", "dq", "dkdv") and head-dim bucket (block_d:
# 16/32/64 -> 64, 128, 256). BLOCK_M always counts queries and BLOCK_N keys: the forward and dQ run BLOCK_M
# query rows over BLOCK_N key tiles, dK/dV runs BLOCK_N key rows over BLOCK_M query tiles.
# Checked for sm_90 with ptxas (scripts/compile_check.py --kernel cqsa): the 16-bit configs do not spill registers
# and fit shared memory, all but dK/dV at D > 128 on wgmma (there no wgmma tile fits the registers: dK, dV,
# K and V of 64 keys × 256 stay resident; it takes 32 keys on mma.sync). float32 with tf32x3 dots is
# register-bound whatever the tile (its backward spills from D = 16, its forward from D = 80) and is not the
# speed target; at D = 256 the smallest tiles keep the spills small.
_TILES_CUDA = {
    # (16-bit?, bucket): (fwd, dq, dkdv)
    (True, 64): ((128, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 2)),
    (True, 128): ((128, 64, 8, 2), (64, 64, 8, 2), (32, 64, 8, 2)),
    (True, 256): ((64, 32, 8, 2), (64, 32, 8, 2), (64, 32, 8, 2)),
    (False, 64): ((64, 32, 4, 2), (64, 32, 4, 1), (64, 32, 4, 1)),
    (False, 128): ((64, 32, 4, 2), (64, 32, 8, 1), (64, 32, 8, 1)),
    (False, 256): ((16, 32, 8, 1), (16, 16, 8, 1), (16, 16, 8, 1)),     # the least spilling (0 / 36 / 324 B)
}
_TILES_INTERPRETER = ((32, 32, 4, 1),) * 3     # small tiles exercise the tile logic at small N
PARTS = ("fwd", "dq", "dkdv")
_PARAMS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
_tiles_cache: dict = {}
# scripts/tune.py --kernel cqsa writes its choices here ({"fwd" | "dq" | "dkdv": {"16,128": [BLOCK_M, BLOCK_N,
# num_warps, num_stages]}}); an entry replaces the built-in GPU tiles above for that dtype class and tile width.
TUNING_FILE = Path(__file__).with_name("tuning.json")
_TUNED = read_configs(TUNING_FILE)


def default_tiles(head_dim: int, dtype: torch.dtype, device_type: str) -> tuple[int, ...]:
    """The 12 tile ints (BLOCK_M, BLOCK_N, warps, stages of "fwd", then "dq", then "dkdv") for this head dim,
    dtype and device."""
    key = (head_dim, dtype, device_type)
    t = _tiles_cache.get(key)
    if t is None:
        if device_type != "cuda" or interpreted():
            parts = _TILES_INTERPRETER
        else:
            bd = max(64, block_d(head_dim))
            parts = _TILES_CUDA[(dtype != torch.float32, bd)]
            cls = "32" if dtype == torch.float32 else "16"
            parts = tuple(tuple(_TUNED.get(part, {}).get(dim_key(cls, bd), tiles)) for part, tiles in zip(PARTS, parts))
        t = _tiles_cache[key] = sum(parts, ())
    return t


def resolve_tiles(head_dim: int, dtype: torch.dtype, device_type: str, config=None) -> tuple[int, ...]:
    """Default tiles, with ``config={"fwd" | "dq" | "dkdv": {BLOCK_M, BLOCK_N, num_warps, num_stages}}`` merged over
    them (kernels._common.tile_config: the one override). Block sizes must be powers of two >= 16 (tl.dot)."""
    t = default_tiles(head_dim, dtype, device_type)
    if not config:
        return t
    defaults = {part: dict(zip(_PARAMS, t[4 * i:4 * i + 4])) for i, part in enumerate(PARTS)}
    merged = tile_config("cqsa", defaults, config)
    for part, params in merged.items():
        for name in ("BLOCK_M", "BLOCK_N"):
            x = params[name]
            if x < 16 or x & (x - 1):
                raise ValueError(f"cqsa: config[{part!r}][{name!r}] must be a power of two >= 16, got {x}")
    return tuple(merged[part][p] for part in PARTS for p in _PARAMS)


def constexprs(kernel: str, head_dim: int, tiles, causal: bool, precision: str, **extra) -> dict:
    """The compile-time arguments and launch options of `kernel` ("fwd", "dq", "dkdv") for these tiles. The
    forward reads K and V by pointers unless `extra` says USE_DESC=True (the resident path's choice, attention.py;
    the streaming and distributed engines' gathered or sliced inputs keep pointers)."""
    i = 4 * PARTS.index(kernel)
    bm, bn, warps, stages = tiles[i:i + 4]
    if kernel == "fwd":
        extra.setdefault("USE_DESC", False)
    return dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal,
                PRECISION=precision, **extra, num_warps=warps, num_stages=stages)


# --- launches (shared by the resident path, the streaming engine and the tests) -------------------------

def launch_fwd(q, k, v, out, lse, state, items, ranges, *, n_out, causal_off, qk_scale, consts,
               first=True, last=True, off_m=0, off_l=0):
    """q [B,Hq,*,D], k, v [B,Hkv,*,D] (unit feature stride); out [B,Hq,n_out,D], lse [B,Hq,n_out] contiguous;
    state: the MODE 1 fp32 state (any tensor in MODE 0)."""
    B, H = q.shape[0], q.shape[1]
    n_items = items.shape[0]
    if n_items == 0 or B * H == 0:
        return
    sq, sk, sv = q.stride(), k.stride(), v.stride()
    launch(cqsa_fwd_kernel, (n_items, B * H),
           (q, k, v, out, lse, state, items, ranges, sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2],
            H, H // k.shape[1], n_out, off_m, off_l, causal_off, qk_scale, 1, int(first), int(last)), consts)


def launch_bwd_dq(q, k, v, o, do, lse, ws, dq, items, ranges, *, n_rows, n_out, causal_off, qk_scale, sm_scale,
                  consts, first=True, last=True, off_delta=0):
    B, H = q.shape[0], q.shape[1]
    n_items = items.shape[0]
    if n_items == 0 or B * H == 0:
        return
    sq, sk, sv, sd = q.stride(), k.stride(), v.stride(), do.stride()
    launch(cqsa_bwd_dq_kernel, (n_items, B * H),
           (q, k, v, o, do, lse, ws, dq, items, ranges, sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2],
            sd[0], sd[1], sd[2], H, H // k.shape[1], n_rows, n_out, off_delta, causal_off, qk_scale, sm_scale,
            1, int(first), int(last)), consts)


def launch_bwd_dkdv(q, k, v, do, lse, ws, dk, dv, items, ranges, *, n_rows, n_out, causal_off, qk_scale, sm_scale,
                    consts, first=True, last=True, off_delta=0, off_dk=0, off_dv=0):
    B, Hkv = k.shape[0], k.shape[1]
    n_items = items.shape[0]
    if n_items == 0 or B * Hkv == 0:
        return
    sq, sk, sv, sd = q.stride(), k.stride(), v.stride(), do.stride()
    launch(cqsa_bwd_dkdv_kernel, (n_items, B * Hkv),
           (q, k, v, do, lse, ws, dk, dv, items, ranges, sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1],
            sv[2], sd[0], sd[1], sd[2], Hkv, q.shape[1] // Hkv, n_rows, n_out, off_delta, off_dk, off_dv, causal_off,
            qk_scale, sm_scale, 1, int(first), int(last)), consts)


# --- streaming: the per-row-block finalisation ---------------------------------------------------------

@triton.jit
def cqsa_finalize_kernel(ACC, MST, SST, O, LSE, g0, n, N, H, sob, soh, son, slb, slh, mscale,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr):
    """Rows [g0, g0+n) of the accumulator (acc [B,H,N,HEAD_DIM], m and s [B,H,N], contiguous) ->
    O[.., r - g0, :] = acc / s (O's dtype) and the natural-log LSE = m·mscale + ln s (mscale = 1 for
    natural-log state, ln 2 for the kernel's log2 state); rows without a key get out = 0 and lse = -inf."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    ok = offs < n
    grow = g0 + offs
    sb = bh.to(tl.int64) * N
    m = tl.load(MST + sb + grow, mask=ok, other=float("-inf"))
    s = tl.load(SST + sb + grow, mask=ok, other=0.0)
    acc = _load_tile(ACC, sb * HEAD_DIM, grow, HEAD_DIM, offs_d, ok, HEAD_DIM, BLOCK_D, True)
    has = s > 0
    s_safe = tl.where(has, s, 1.0)
    lse = tl.where(has, m * mscale + tl.log(s_safe), float("-inf"))
    _store_tile(O, core.head_base(b, h, sob, soh), offs, son, offs_d, ok, acc / s_safe[:, None], HEAD_DIM, BLOCK_D)
    tl.store(LSE + core.head_base(b, h, slb, slh) + offs.to(tl.int64), lse, mask=ok)


FINAL_BLOCK = 32


def launch_finalize(acc, mst, sst, out, lse, g0: int, mscale: float, block: int = FINAL_BLOCK):
    """out [B,H,n,D] (unit feature stride, any dtype), lse [B,H,n] fp32 <- accumulator rows [g0, g0+n)."""
    B, H, n, D = out.shape
    if n == 0 or B * H == 0:
        return
    so, sl = out.stride(), lse.stride()
    launch(cqsa_finalize_kernel, (triton.cdiv(n, block), B * H),
           (acc, mst, sst, out, lse, g0, n, mst.shape[2], H, so[0], so[1], so[2], sl[0], sl[1], float(mscale)),
           dict(HEAD_DIM=D, BLOCK_D=block_d(D), BLOCK=block, num_warps=4))
