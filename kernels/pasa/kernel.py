"""Triton kernels for PASA (online pseudo-average shifting attention) and its fa16 comparator.

Three kernels, one idea each:
- ``_shift_k_kernel``  the pre-pass: K̃_j = fp16(λM · K_j) for every KV window, one tensor-core matmul
  per window (paper steps ①②). It costs one pass over K and writes a K-sized fp16 buffer.
- ``_pasa_fwd_kernel`` Algorithm 1 of the spec: the FA-2 loop on the shifted keys, in the paper's full
  low-precision allocation (fp16 score tile, fp16 softmax state, fp16 output accumulator), with the
  online recovery of the global pseudo-average and the corrected max/sum/output updates (③④).
  Two loop bodies (constexpr FUSED): ``_pasa_block`` is Algorithm 1 as written (the default: faster on
  the H100), ``_pasa_block_fused`` folds γ into the exponent and accumulates P·V in place (variant="fused").
- ``_fa16_fwd_kernel`` the comparator "FA16-FP32": the same tiling, the unscaled QKᵀ rounded to fp16
  (which is where partially-low-precision FlashAttention overflows), everything else in fp32.

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

LOG2E = tl.constexpr(1.4426950408889634)   # constexpr: triton 3.6 refuses plain globals inside kernels
M_INIT = tl.constexpr(-60000.0)   # (constexpr: triton 3.6 refuses plain globals in kernels) initial running max: finite in fp16, so inf − inf can never happen (spec pitfall 3)


@triton.jit
def _shift_k_kernel(K, KS, N, diag, off, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """KS[bh, j·n + t] = fp16(Σ_s M[t, s] · K[bh, start_j + s]): the KV window j shifted and scaled."""
    j = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    n_blocks = tl.cdiv(N, BLOCK_N)
    # The last, ragged block uses the window [N − n, N): n real keys, so its mean is not diluted by
    # padding (spec §3). Only N < n pads, with zeros (exact: those columns are masked after ȳ).
    start = tl.minimum(j * BLOCK_N, tl.maximum(N - BLOCK_N, 0))
    t = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, HEAD_DIM)
    keys = start + t
    k = tl.load(K + bh * N * HEAD_DIM + keys[:, None] * HEAD_DIM + cols[None, :],
                mask=keys[:, None] < N, other=0.0)
    # λM = diag on the diagonal, off elsewhere; both already fp16 values, so the cast is exact.
    shift = tl.where(t[:, None] == t[None, :], diag, off).to(tl.float16)
    k_shift = tl.dot(shift, k)
    tl.store(KS + bh * n_blocks * BLOCK_N * HEAD_DIM + (j * BLOCK_N + t)[:, None] * HEAD_DIM + cols[None, :],
             k_shift.to(tl.float16))


@triton.jit
def _load_kv_block(KS, V, ks_base, v_base, j, N, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                   MASKED: tl.constexpr):
    """KV block j of both loops: its key positions, the shifted K̃ tile and the V tile. The ragged last block
    is the window [N − n, N) (README "Ragged last block"); the K̃ buffer is padded to whole blocks, so its
    loads never need a mask."""
    t = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, HEAD_DIM)
    start = tl.minimum(j * BLOCK_N, tl.maximum(N - BLOCK_N, 0))
    keys = start + t
    k_shift = tl.load(KS + ks_base + (j * BLOCK_N + t)[:, None] * HEAD_DIM + cols[None, :])
    if MASKED:
        v = tl.load(V + v_base + keys[:, None] * HEAD_DIM + cols[None, :], mask=keys[:, None] < N, other=0.0)
    else:
        v = tl.load(V + v_base + keys[:, None] * HEAD_DIM + cols[None, :])
    return keys, k_shift, v


@triton.jit
def _pasa_block(q, KS, V, ks_base, v_base, rows, m, ell, g, acc, c, j, N,
                BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                STATE: tl.constexpr):
    """One step of Algorithm 1 for KV block j; returns the updated (m, ell, g, acc)."""
    keys, k_shift, v = _load_kv_block(KS, V, ks_base, v_base, j, N, BLOCK_N, HEAD_DIM, MASKED)

    s32 = tl.dot(q, tl.trans(k_shift))                  # λ·(QKᵀ)·M₀ in fp32 registers
    ybar = tl.sum(s32, 1) / BLOCK_N                      # ③ local pseudo-average over all n columns, pre-mask
    s = s32.to(tl.float16).to(STATE)                     # the fp16 score tile of the paper
    if MASKED:
        visible = ((keys >= j * BLOCK_N) & (keys < N))[None, :]   # overlap / padding columns
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None])
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
def _pasa_block_fused(q, KS, V, ks_base, v_base, rows, m, ell, g, acc, c, j, N,
                      BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                      STATE: tl.constexpr):
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
    keys, k_shift, v = _load_kv_block(KS, V, ks_base, v_base, j, N, BLOCK_N, HEAD_DIM, MASKED)

    s32 = tl.dot(q, tl.trans(k_shift))
    ybar = tl.sum(s32, 1) / BLOCK_N                      # ③ from the fp32 accumulator, pre-mask
    s = s32.to(tl.float16).to(tl.float32)                # the fp16 score tile Ŝ (its values, held in fp32)
    if MASKED:
        visible = ((keys >= j * BLOCK_N) & (keys < N))[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None])
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
def _pasa_step(q, KS, V, ks_base, v_base, rows, m, ell, g, acc, c, j, N,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
               STATE: tl.constexpr, FUSED: tl.constexpr):
    """One KV block with the chosen main loop (attention.VARIANTS)."""
    if FUSED:
        m, ell, g, acc = _pasa_block_fused(q, KS, V, ks_base, v_base, rows, m, ell, g, acc, c, j, N,
                                           BLOCK_N, HEAD_DIM, CAUSAL, MASKED, STATE)
    else:
        m, ell, g, acc = _pasa_block(q, KS, V, ks_base, v_base, rows, m, ell, g, acc, c, j, N,
                                     BLOCK_N, HEAD_DIM, CAUSAL, MASKED, STATE)
    return m, ell, g, acc


@triton.jit
def _pasa_fwd_kernel(Q, KS, V, O, N, c_arg,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                     CAUSAL: tl.constexpr, STATE: tl.constexpr, FUSED: tl.constexpr):
    i = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    n_blocks = tl.cdiv(N, BLOCK_N)
    base = bh * N * HEAD_DIM
    ks_base = bh * n_blocks * BLOCK_N * HEAD_DIM
    rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + base + rows[:, None] * HEAD_DIM + cols[None, :], mask=rows[:, None] < N, other=0.0)

    # c as a row vector in the state format (a runtime scalar arg is fp32, or a Python float when interpreted)
    c = (tl.zeros([BLOCK_M], tl.float32) + c_arg).to(STATE)
    m = tl.full([BLOCK_M], M_INIT, STATE)
    ell = tl.zeros([BLOCK_M], STATE)
    g = tl.zeros([BLOCK_M], STATE)
    if FUSED:   # the wgmma accumulator itself (holds α·A + P·V until its next read rounds it)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, HEAD_DIM], STATE)
    # Blocks [0, hi_full) need no mask at all (whole window new, inside N, below the diagonal);
    # [hi_full, hi) are the ragged last block and, if causal, the diagonal blocks.
    if CAUSAL:
        hi = tl.minimum(n_blocks, tl.cdiv((i + 1) * BLOCK_M, BLOCK_N))
        hi_full = tl.minimum((i * BLOCK_M) // BLOCK_N, N // BLOCK_N)
    else:
        hi = n_blocks
        hi_full = N // BLOCK_N
    for j in range(0, hi_full):
        m, ell, g, acc = _pasa_step(q, KS, V, ks_base, base, rows, m, ell, g, acc, c, j, N,
                                    BLOCK_N, HEAD_DIM, CAUSAL, False, STATE, FUSED)
    for j in range(hi_full, hi):
        m, ell, g, acc = _pasa_step(q, KS, V, ks_base, base, rows, m, ell, g, acc, c, j, N,
                                    BLOCK_N, HEAD_DIM, CAUSAL, True, STATE, FUSED)
    out = acc.to(STATE) / ell[:, None]                   # eq 8, in the state format
    tl.store(O + base + rows[:, None] * HEAD_DIM + cols[None, :], out.to(O.dtype.element_ty),
             mask=rows[:, None] < N)


@triton.jit
def _fa16_block(q, K, V, base, rows, m, ell, acc, qk_scale, j, N,
                BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr):
    keys = j * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, HEAD_DIM)
    if MASKED:
        k = tl.load(K + base + keys[:, None] * HEAD_DIM + cols[None, :], mask=keys[:, None] < N, other=0.0)
        v = tl.load(V + base + keys[:, None] * HEAD_DIM + cols[None, :], mask=keys[:, None] < N, other=0.0)
    else:
        k = tl.load(K + base + keys[:, None] * HEAD_DIM + cols[None, :])
        v = tl.load(V + base + keys[:, None] * HEAD_DIM + cols[None, :])
    # The unscaled score leaves the matrix unit in fp16: > 65504 becomes inf (the overflow under test);
    # the static scale is applied afterwards, in fp32, together with log2(e) for exp2.
    s = tl.dot(q, tl.trans(k)).to(tl.float16).to(tl.float32) * qk_scale
    if MASKED:
        visible = (keys < N)[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])                      # +inf score: inf − inf = NaN, as on the NPU
    ell = ell * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(tl.float16), v, acc * alpha[:, None])
    return m_new, ell, acc


@triton.jit
def _fa16_fwd_kernel(Q, K, V, O, N, qk_scale,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr):
    i = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    n_blocks = tl.cdiv(N, BLOCK_N)
    base = bh * N * HEAD_DIM
    rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + base + rows[:, None] * HEAD_DIM + cols[None, :], mask=rows[:, None] < N, other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    ell = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if CAUSAL:
        hi = tl.minimum(n_blocks, tl.cdiv((i + 1) * BLOCK_M, BLOCK_N))
        hi_full = tl.minimum((i * BLOCK_M) // BLOCK_N, N // BLOCK_N)
    else:
        hi = n_blocks
        hi_full = N // BLOCK_N
    for j in range(0, hi_full):
        m, ell, acc = _fa16_block(q, K, V, base, rows, m, ell, acc, qk_scale, j, N,
                                  BLOCK_N, HEAD_DIM, CAUSAL, False)
    for j in range(hi_full, hi):
        m, ell, acc = _fa16_block(q, K, V, base, rows, m, ell, acc, qk_scale, j, N,
                                  BLOCK_N, HEAD_DIM, CAUSAL, True)
    out = acc / ell[:, None]
    tl.store(O + base + rows[:, None] * HEAD_DIM + cols[None, :], out.to(O.dtype.element_ty),
             mask=rows[:, None] < N)
