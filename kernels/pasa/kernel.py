"""Triton kernels for PASA (online pseudo-average shifting attention) and its fa16 comparator.

Four kernels, one idea each:
- ``_to_float16_kernel`` bfloat16 inputs to float16 (the paper's first step for them), q, k and v in one launch,
  counting per tensor the finite values that float16 cannot hold (ops.py refuses them after the call).
- ``_to_bfloat16_kernel`` the float16 output of a bfloat16 call rounded to bfloat16.
- ``_shift_k_kernel``  the pre-pass: K̃_j = fp16(λM · K_j) for every KV window of every key/value head, one
  tensor-core matmul per window (paper steps ①②, ``_shift_window`` with the λM tile of ``_shift_tile``). It costs
  one pass over K and writes a K-sized fp16 buffer (Hkv heads: grouped query heads share it, spec pitfall 10).
- ``_pasa_fwd_kernel`` Algorithm 1 of the spec: the FA-2 loop on the shifted keys, in the paper's full
  low-precision allocation (fp16 score tile, fp16 softmax state, fp16 output accumulator), with the
  online recovery of the global pseudo-average and the corrected max/sum/output updates (③④).
  It reads K̃ from the pre-pass's buffer, or (constexpr SHIFT_INLINE, ops.py chooses it for short key lengths)
  reads K itself and computes each window's K̃ per KV step with the same two helpers as the pre-pass: one launch
  and no K̃ buffer, at the price of one n×n×D matmul per KV step, repeated by every query tile and query head.
  Two loop bodies (constexpr FUSED): ``_pasa_block`` is Algorithm 1 as written (the default: faster on
  the H100), ``_pasa_block_fused`` folds γ into the exponent and accumulates P·V in place (variant="fused").
- ``_fa16_fwd_kernel`` the comparator "FA16-FP32": the same tiling, the unscaled QKᵀ rounded to fp16
  (which is where partially-low-precision FlashAttention overflows), everything else in fp32.

Shapes (the kernel contract, kernels/_common.py): q [B, Hq, Nq, D] and k, v [B, Hkv, Nk, D] read in place
through their batch/head/row strides (unit feature stride); query head h reads key/value head h // (Hq / Hkv);
causal is aligned bottom-right (row i sees keys j <= i + Nk − Nq) and a row that sees no key gives 0; D is any
multiple of 8 up to 256, padded with masked zero columns to BLOCK_D (a power of two), which add nothing to the
products.

Precision model (shared with ``kernels.pasa.emulate``): a matmul accumulates in fp32 and its result is
rounded once; a row reduction (sum) accumulates in fp32 and is rounded once; every elementwise op
rounds to the state format; exp is evaluated in fp32 and rounded. The one place the kernel keeps more
than fp16 is the local pseudo-average ȳ: it is read from the fp32 accumulator and used only to update
the stored (fp16) global average G and the (fp16) correction δ_cur, never stored itself. The spec
allows this (pitfall 7): a ȳ rounded to fp16 is off by up to ulp(ȳ)/2, and the recovery multiplies
that error by c ≈ 63.5, which is enough to lose to fa16 on biased inputs.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels._common import LOG2E as _LOG2E, PASA_M_INIT as _M_INIT
from kernels._flash_core import load_tile

# constexprs: triton 3.6 refuses plain globals inside kernels
LOG2E = tl.constexpr(_LOG2E)
M_INIT = tl.constexpr(_M_INIT)


@triton.jit
def _to_float16_kernel(Q, K, V, Q16, K16, V16, OVERFLOWS, n_q, n_kv, BLOCK: tl.constexpr):
    """Program (i, t) rounds block i of tensor t (0 q, 1 k, 2 v) to float16, element for element over the tensor's
    storage span (ops.py passes dense tensors, whose copies have their strides), and adds to OVERFLOWS[t] its finite
    values that round to ±inf (|x| >= 65520: beyond float16's range). Every program reads the other two tensors'
    pointers under an all-false mask, which touches no memory: one launch instead of three."""
    t = tl.program_id(1)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_q = offs < tl.where(t == 0, n_q, 0)
    in_k = offs < tl.where(t == 1, n_kv, 0)
    in_v = offs < tl.where(t == 2, n_kv, 0)
    x = tl.where(in_q, tl.load(Q + offs, mask=in_q, other=0.0),
                 tl.where(in_k, tl.load(K + offs, mask=in_k, other=0.0), tl.load(V + offs, mask=in_v, other=0.0)))
    y = x.to(tl.float16)
    tl.store(Q16 + offs, y, mask=in_q)
    tl.store(K16 + offs, y, mask=in_k)
    tl.store(V16 + offs, y, mask=in_v)
    inf = float("inf")
    lost = (tl.abs(y.to(tl.float32)) == inf) & (tl.abs(x.to(tl.float32)) < inf)
    n_lost = tl.sum(lost.to(tl.int32), 0)
    if n_lost > 0:
        tl.atomic_add(OVERFLOWS + t, n_lost)


@triton.jit
def _to_bfloat16_kernel(SRC, DST, n, BLOCK: tl.constexpr):
    """Program i rounds block i of the contiguous float16 SRC to bfloat16 into the contiguous DST, given as its int16
    view: one vectorized pass where torch's casting copy between the two is not (47 us a call at 16K, D = 128, B = 1,
    H = 8 on the H200; results/dev/pasa/bfloat16_call_h200.json). The rounding (to nearest, ties to even, as
    torch's cast; NaN as 0x7FC0) is integer arithmetic on the float32 bits, which the CPU interpreter runs as the GPU
    does (its own conversion to bfloat16 truncates)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(SRC + offs, mask=mask, other=0.0).to(tl.float32)
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0, r)
    tl.store(DST + offs, r.to(tl.int16), mask=mask)


@triton.jit
def _shift_tile(diag, off, BLOCK_N: tl.constexpr):
    """λM as an fp16 [n, n] tile: diag on the diagonal, off elsewhere (both already fp16 values, so the cast is
    exact). Built once per program, by the pre-pass and by the inline main loop alike."""
    t = tl.arange(0, BLOCK_N)
    return tl.where(t[:, None] == t[None, :], diag, off).to(tl.float16)


@triton.jit
def _shift_window(K, k_base, stride_kn, shift, keys, N_K, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  MASKED: tl.constexpr):
    """K̃ of one KV window: fp16(λM · K[keys]), one tensor-core matmul accumulated in fp32 and rounded once.
    K is read in place (row stride stride_kn, unit feature stride); keys past N_K (only when MASKED) and columns
    past D load as zeros, so they add nothing and the padded columns of K̃ are zero."""
    cols = tl.arange(0, BLOCK_D)
    k = load_tile(K + k_base + keys[:, None] * stride_kn + cols[None, :], keys < N_K, cols, D, BLOCK_D, MASKED)
    return tl.dot(shift, k).to(tl.float16)


@triton.jit
def _window_start(j, N_K, BLOCK_N: tl.constexpr):
    """The first key of KV window j. The last, ragged block uses the window [N − n, N): n real keys, so its
    mean is not diluted by padding (spec §3); only N < n pads, with zeros (exact: those columns are masked
    after ȳ)."""
    return tl.minimum(j * BLOCK_N, tl.maximum(N_K - BLOCK_N, 0))


@triton.jit
def _shift_k_kernel(K, KS, stride_kb, stride_kh, stride_kn, H_KV, N_K, diag, off,
                    BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """KS[b, h, j·n + t] = fp16(Σ_s M[t, s] · K[b, h, start_j + s]): the KV window j of key/value head h shifted
    and scaled. K is read in place (any batch/head/row strides, unit feature stride); KS is contiguous
    [B, H_KV, T_c·n, BLOCK_D], its padded columns zero (so the main loop loads it without masks)."""
    j = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H_KV).to(tl.int64)
    h = (bh % H_KV).to(tl.int64)
    n_blocks = tl.cdiv(N_K, BLOCK_N)
    t = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    keys = _window_start(j, N_K, BLOCK_N) + t
    k_shift = _shift_window(K, b * stride_kb + h * stride_kh, stride_kn, _shift_tile(diag, off, BLOCK_N), keys, N_K,
                            D, BLOCK_D, True)
    tl.store(KS + bh.to(tl.int64) * n_blocks * BLOCK_N * BLOCK_D + (j * BLOCK_N + t)[:, None] * BLOCK_D
             + cols[None, :], k_shift)


@triton.jit
def _load_kv_block(KS, V, ks_base, v_base, stride_kn, stride_vn, shift, j, N_K, BLOCK_N: tl.constexpr,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, SHIFT_INLINE: tl.constexpr):
    """KV block j of both loops: its key positions, the shifted K̃ tile and the V tile. The ragged last block
    is the window [N − n, N) (README "Ragged last block"). K̃ comes from the pre-pass's buffer (padded to
    whole blocks and to BLOCK_D columns, so its loads never need a mask), or, with SHIFT_INLINE, KS is K itself
    (base ks_base, row stride stride_kn) and the window is shifted here exactly as the pre-pass does it."""
    t = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    keys = _window_start(j, N_K, BLOCK_N) + t
    if SHIFT_INLINE:
        k_shift = _shift_window(KS, ks_base, stride_kn, shift, keys, N_K, D, BLOCK_D, MASKED)
    else:
        k_shift = tl.load(KS + ks_base + (j * BLOCK_N + t)[:, None] * BLOCK_D + cols[None, :])
    v = load_tile(V + v_base + keys[:, None] * stride_vn + cols[None, :], keys < N_K, cols, D, BLOCK_D, MASKED)
    return keys, k_shift, v


@triton.jit
def _pasa_block(q, KS, V, ks_base, v_base, stride_kn, stride_vn, shift, last_key, m, ell, g, acc, c, j,
                N_K, BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                CAUSAL: tl.constexpr, MASKED: tl.constexpr, STATE: tl.constexpr, SHIFT_INLINE: tl.constexpr):
    """One step of Algorithm 1 for KV block j; returns the updated (m, ell, g, acc). `last_key`: per query row,
    the last key it may see when causal (row + N_K − N_Q, bottom-right aligned)."""
    keys, k_shift, v = _load_kv_block(KS, V, ks_base, v_base, stride_kn, stride_vn, shift, j, N_K, BLOCK_N, D,
                                    BLOCK_D, MASKED, SHIFT_INLINE)

    s32 = tl.dot(q, tl.trans(k_shift))                  # λ·(QKᵀ)·M₀ in fp32 registers
    ybar = tl.sum(s32, 1) / BLOCK_N                      # ③ local pseudo-average over all n columns, pre-mask
    s = s32.to(tl.float16).to(STATE)                     # the fp16 score tile of the paper
    if MASKED:
        visible = ((keys >= j * BLOCK_N) & (keys < N_K))[None, :]   # overlap / padding columns
        if CAUSAL:
            visible = visible & (keys[None, :] <= last_key[:, None])
        s = tl.where(visible, s, float("-inf"))
    # Uncorrected local softmax (eq 3). The clamp keeps a row that sees nothing in this block finite.
    mu = tl.maximum(tl.max(s, 1), M_INIT)
    p = tl.exp2((s - mu[:, None]).to(tl.float32) * LOG2E).to(STATE)
    s_sum = tl.sum(p.to(tl.float32), 1).to(STATE)
    pv = tl.dot(p.to(tl.float16), v).to(STATE)

    # ③ online recovery of the global pseudo-average G (eq 15) and the two frame corrections.
    # G is only a frame: rounding it is harmless because the same stored G feeds δ_cur now and δ_prev next.
    g_old = tl.where(j == 0, ybar.to(STATE), g)
    g_new = g_old + ((ybar - g_old.to(tl.float32)) / (j + 1.0)).to(STATE)
    d_cur = (ybar - g_new.to(tl.float32)).to(STATE) * c   # moves this block's statistics into frame G_j
    d_prev = (g_old - g_new) * c                          # moves the running state from G_{j-1} to G_j
    # ④ corrected eqs 4, 6, 7: the ordinary FA-2 merge of two partial softmaxes in one frame
    cand_new = mu + d_cur
    cand_old = m + d_prev
    m_new = tl.maximum(cand_new, cand_old)
    alpha = tl.exp2((cand_old - m_new).to(tl.float32) * LOG2E).to(STATE)
    gamma = tl.exp2((cand_new - m_new).to(tl.float32) * LOG2E).to(STATE)
    ell = alpha * ell + gamma * s_sum
    acc = alpha[:, None] * acc + gamma[:, None] * pv
    # explicit casts: the loop-carried types must match the STATE the loop started with (triton 3.6 checks)
    return m_new.to(STATE), ell.to(STATE), g_new.to(STATE), acc.to(STATE)


@triton.jit
def _pasa_block_fused(q, KS, V, ks_base, v_base, stride_kn, stride_vn, shift, last_key, m, ell, g, acc, c, j,
                      N_K, BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                      CAUSAL: tl.constexpr, MASKED: tl.constexpr, STATE: tl.constexpr, SHIFT_INLINE: tl.constexpr):
    """One step of Algorithm 1 in FlashAttention's in-place form; returns the updated (m, ell, g, acc).

    The frame bookkeeping (μ, G, δ_cur, δ_prev, m_new, α, all in the state format) comes first, then the
    correction γ = e^{μ + δ_cur − m_new} is folded into the exponent: P = fp16(e^{Ŝ − (m_new − δ_cur)}),
    which is γ·P̂ of eq 3 (≤ 1 as before). So ℓ ← fp16(α·ℓ + rowsum(P)) and A ← fp16(α·A + P·V), the
    latter one wgmma chain into the fp32 accumulator (``acc = dot(p, v, α·acc)``): `acc` holds α·A + P·V
    unrounded for one step and is rounded to the state format where it is next read (the α multiply, the
    division after the loop) — one rounding per block where Algorithm 1 as written has four. α·A and α·ℓ
    are exact in fp32 (two fp16 factors), so an FMA contraction on the GPU changes nothing.

    Every rounding is an explicit cast (tl.max promotes fp16 to fp32, and promotion rules differ between
    Triton versions); ``kernels.pasa.emulate`` (variant "fused") performs the same operations."""
    keys, k_shift, v = _load_kv_block(KS, V, ks_base, v_base, stride_kn, stride_vn, shift, j, N_K, BLOCK_N, D,
                                    BLOCK_D, MASKED, SHIFT_INLINE)

    s32 = tl.dot(q, tl.trans(k_shift))
    ybar = tl.sum(s32, 1) / BLOCK_N                      # ③ from the fp32 accumulator, pre-mask
    s = s32.to(tl.float16).to(tl.float32)                # the fp16 score tile Ŝ (its values, held in fp32)
    if MASKED:
        visible = ((keys >= j * BLOCK_N) & (keys < N_K))[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= last_key[:, None])
        s = tl.where(visible, s, float("-inf"))
    mu = tl.maximum(tl.max(s, 1), M_INIT).to(STATE)      # exact: a max of fp16 values

    # ③ the frame bookkeeping first (it needs only μ and ȳ), in the state format
    g_old = tl.where(j == 0, ybar.to(STATE), g)
    g_new = g_old + ((ybar - g_old.to(tl.float32)) / (j + 1.0)).to(STATE)
    d_cur = (ybar - g_new.to(tl.float32)).to(STATE) * c
    d_prev = (g_old - g_new) * c
    cand_old = m + d_prev
    m_new = tl.maximum(mu + d_cur, cand_old)
    alpha = tl.exp2((cand_old.to(tl.float32) - m_new.to(tl.float32)) * LOG2E).to(STATE)
    # P in frame G_j: the exponent Ŝ − (m_new − δ_cur) is ≤ 0 up to rounding. The clamp keeps a row that sees
    # no key in this block at a finite offset, so its −inf scores give P = 0, never −inf − (−inf).
    frame = tl.maximum(m_new.to(tl.float32) - d_cur.to(tl.float32), M_INIT)
    p = tl.exp2(tl.fma(s, LOG2E, -(frame * LOG2E)[:, None])).to(STATE)   # one FFMA + ex2 per score
    ell = (alpha.to(tl.float32) * ell.to(tl.float32) + tl.sum(p.to(tl.float32), 1)).to(STATE)
    acc = tl.dot(p.to(tl.float16), v, acc.to(STATE).to(tl.float32) * alpha.to(tl.float32)[:, None])
    return m_new.to(STATE), ell, g_new.to(STATE), acc


@triton.jit
def _pasa_step(q, KS, V, ks_base, v_base, stride_kn, stride_vn, shift, last_key, m, ell, g, acc, c, j, N_K,
               BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
               MASKED: tl.constexpr, STATE: tl.constexpr, FUSED: tl.constexpr, SHIFT_INLINE: tl.constexpr):
    """One KV block with the chosen main loop (attention.VARIANTS)."""
    if FUSED:
        m, ell, g, acc = _pasa_block_fused(q, KS, V, ks_base, v_base, stride_kn, stride_vn, shift, last_key, m, ell,
                                           g, acc, c, j, N_K, BLOCK_N, D, BLOCK_D, CAUSAL, MASKED, STATE,
                                           SHIFT_INLINE)
    else:
        m, ell, g, acc = _pasa_block(q, KS, V, ks_base, v_base, stride_kn, stride_vn, shift, last_key, m, ell, g,
                                     acc, c, j, N_K, BLOCK_N, D, BLOCK_D, CAUSAL, MASKED, STATE, SHIFT_INLINE)
    return m, ell, g, acc


@triton.jit
def _block_range(i, N_Q, N_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """The KV blocks query tile i visits: [0, hi_full) need no mask at all (the whole window new, inside N_K and,
    if causal, visible to every row of the tile); [hi_full, hi) are the ragged last block and the diagonal
    blocks. Causal is bottom-right aligned: row r sees keys up to r + N_K − N_Q (a row may see none)."""
    n_blocks = tl.cdiv(N_K, BLOCK_N)
    if CAUSAL:
        shift = N_K - N_Q
        hi = tl.minimum(n_blocks, tl.cdiv(tl.maximum(i * BLOCK_M + BLOCK_M + shift, 0), BLOCK_N))
        hi_full = tl.minimum(tl.maximum(i * BLOCK_M + shift + 1, 0) // BLOCK_N, N_K // BLOCK_N)
    else:
        hi = n_blocks
        hi_full = N_K // BLOCK_N
    return hi_full, hi


@triton.jit
def _query_tile(H_Q, H_KV, N_Q, N_K, BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's query tile: batch b, query head h and its key/value head hk (grouped-query attention: H_Q //
    H_KV query heads share one), its rows and head-dim columns, their in-bounds mask, and each row's last visible
    key under bottom-right causal masking. Indices only: the kernels load and store through them themselves."""
    i = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H_Q).to(tl.int64)
    h = bh % H_Q
    hk = (h // (H_Q // H_KV)).to(tl.int64)
    h = h.to(tl.int64)
    rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    io_mask = rows[:, None] < N_Q
    if D < BLOCK_D:
        io_mask = io_mask & (cols[None, :] < D)
    last_key = rows + (N_K - N_Q)
    return i, b, h, hk, rows, cols, io_mask, last_key


@triton.jit
def _pasa_fwd_kernel(Q, KS, V, O, stride_qb, stride_qh, stride_qn, stride_vb, stride_vh, stride_vn,
                     stride_ob, stride_oh, stride_on, H_Q, H_KV, N_Q, N_K, c_arg, stride_kb, stride_kh, stride_kn,
                     diag, off, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                     BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, STATE_FP32: tl.constexpr, FUSED: tl.constexpr,
                     SHIFT_INLINE: tl.constexpr):
    """Query tile i of query head h: Algorithm 1 over the KV blocks of key/value head h // (H_Q // H_KV)
    (grouped-query attention reads the shared K̃ and V in place). The softmax state is fp16 (the paper's
    allocation) or, with STATE_FP32, fp32 (its hybrid mode); a bool, not a dtype, so the launch key stays plain.

    KS is the pre-pass's K̃ buffer; with SHIFT_INLINE it is K itself (read through stride_kb/kh/kn) and each
    window's K̃ = fp16(λM·K_j) is computed here, per KV step, with the λM tile of diag/off built once per program
    (ops.py, "Host cost": one launch instead of two, for short key lengths). Without it the K strides and
    diag/off are unused."""
    STATE: tl.constexpr = tl.float32 if STATE_FP32 else tl.float16
    i, b, h, hk, rows, cols, io_mask, last_key = _query_tile(H_Q, H_KV, N_Q, N_K, BLOCK_M, D, BLOCK_D)
    if SHIFT_INLINE:
        ks_base = b * stride_kb + hk * stride_kh
    else:
        ks_base = (b * H_KV + hk) * tl.cdiv(N_K, BLOCK_N) * BLOCK_N * BLOCK_D
    shift = _shift_tile(diag, off, BLOCK_N)     # used only with SHIFT_INLINE (else the compiler drops it)
    v_base = b * stride_vb + hk * stride_vh
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qn + cols[None, :], mask=io_mask,
                other=0.0)

    # c as a row vector in the state format (a runtime scalar arg is fp32, or a Python float when interpreted)
    c = (tl.zeros([BLOCK_M], tl.float32) + c_arg).to(STATE)
    m = tl.full([BLOCK_M], M_INIT, STATE)
    ell = tl.zeros([BLOCK_M], STATE)
    g = tl.zeros([BLOCK_M], STATE)
    if FUSED:   # the wgmma accumulator itself (holds α·A + P·V until its next read rounds it)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_D], STATE)
    hi_full, hi = _block_range(i, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    for j in range(0, hi_full):
        m, ell, g, acc = _pasa_step(q, KS, V, ks_base, v_base, stride_kn, stride_vn, shift, last_key, m, ell, g,
                                    acc, c, j, N_K, BLOCK_N, D, BLOCK_D, CAUSAL, False, STATE, FUSED, SHIFT_INLINE)
    for j in range(hi_full, hi):
        m, ell, g, acc = _pasa_step(q, KS, V, ks_base, v_base, stride_kn, stride_vn, shift, last_key, m, ell, g,
                                    acc, c, j, N_K, BLOCK_N, D, BLOCK_D, CAUSAL, True, STATE, FUSED, SHIFT_INLINE)
    # eq 8, in the state format; a row that saw no key (bottom-right causal with N_Q > N_K) has ℓ = 0 and gives 0
    out = tl.where((ell == 0)[:, None], 0.0, acc.to(STATE) / ell[:, None])
    tl.store(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + cols[None, :],
             out.to(O.dtype.element_ty), mask=io_mask)


@triton.jit
def _fa16_block(q, K, V, k_base, v_base, stride_kn, stride_vn, last_key, m, ell, acc, qk_scale, j, N_K,
                BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                MASKED: tl.constexpr):
    keys = j * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    k_ptrs = K + k_base + keys[:, None] * stride_kn + cols[None, :]
    v_ptrs = V + v_base + keys[:, None] * stride_vn + cols[None, :]
    if MASKED:
        kv_mask = keys[:, None] < N_K
        if D < BLOCK_D:
            kv_mask = kv_mask & (cols[None, :] < D)
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif D < BLOCK_D:
        k = tl.load(k_ptrs, mask=cols[None, :] < D, other=0.0)
        v = tl.load(v_ptrs, mask=cols[None, :] < D, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    # The unscaled score leaves the matrix unit in fp16: > 65504 becomes inf (the overflow under test);
    # the static scale is applied afterwards, in fp32, together with log2(e) for exp2.
    s = tl.dot(q, tl.trans(k)).to(tl.float16).to(tl.float32) * qk_scale
    if MASKED:
        visible = (keys < N_K)[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= last_key[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    # a row with no visible key so far keeps m = −inf: offset by 0 so that −inf − (−inf) never happens; a +inf
    # score (fp16 overflow) keeps m_new = +inf and gives inf − inf = NaN, as on the NPU
    m_off = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_off)
    p = tl.exp2(s - m_off[:, None])
    ell = ell * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(tl.float16), v, acc * alpha[:, None])
    return m_new, ell, acc


@triton.jit
def _fa16_fwd_kernel(Q, K, V, O, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                     stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on, H_Q, H_KV, N_Q, N_K, qk_scale,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     CAUSAL: tl.constexpr):
    i, b, h, hk, rows, cols, io_mask, last_key = _query_tile(H_Q, H_KV, N_Q, N_K, BLOCK_M, D, BLOCK_D)
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qn + cols[None, :], mask=io_mask,
                other=0.0)
    k_base = b * stride_kb + hk * stride_kh
    v_base = b * stride_vb + hk * stride_vh
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    ell = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi_full, hi = _block_range(i, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    for j in range(0, hi_full):
        m, ell, acc = _fa16_block(q, K, V, k_base, v_base, stride_kn, stride_vn, last_key, m, ell, acc, qk_scale,
                                  j, N_K, BLOCK_N, D, BLOCK_D, CAUSAL, False)
    for j in range(hi_full, hi):
        m, ell, acc = _fa16_block(q, K, V, k_base, v_base, stride_kn, stride_vn, last_key, m, ell, acc, qk_scale,
                                  j, N_K, BLOCK_N, D, BLOCK_D, CAUSAL, True)
    # a row that saw no key gives 0; a NaN ℓ (overflow) stays NaN
    out = tl.where((ell == 0)[:, None], 0.0, acc / ell[:, None])
    tl.store(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + cols[None, :],
             out.to(O.dtype.element_ty), mask=io_mask)
