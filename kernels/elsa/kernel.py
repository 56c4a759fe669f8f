"""ELSA Triton kernels: phase 1 (per-partition monoid summaries), phase 2 (merge + normalise), backward.

Notation (kernels/elsa/NOTES.md and shared/specs/elsa.md):
  x[i, j] = scale * log2(e) * q_i . k_j  (+ log2(e) * bias[i, j])      base-2 logits, exp2 everywhere
  summary of row i over a key set J = (m, z, s) = (max x, sum 2^(x-m), sum 2^(x-m) v_j), fp32;
  identity (empty / fully masked J) = (-inf, 0, 0).
  lse[i] = m + log2 z over all visible keys (+inf for a row that sees none): what the backward needs.

Shapes: q [B, H, NQ, D]; k, v [B, HKV, NK, D] with H = HKV * GROUP (grouped-query attention: query head h
reads key/value head h // GROUP in place). Causal is aligned bottom-right: query i sees keys j <= i + NK - NQ.
The head dim D (HEAD_DIM) is padded to the power-of-two tile width BLOCK_D: columns past D load as 0 and are
never stored, so every product and sum is the unpadded one.

Tensors q, k, v, out, dO are addressed through (batch, head, row) strides with a unit feature stride,
so timm's permuted q/k/v views need no copy. The (b, h) base offset is int64; within one head the
row offsets are int32 (the wrapper checks they fit). Lengths and q-chunk starts are runtime ints so a new
sequence length does not compile a new kernel; only tile sizes, D and feature flags are constexpr.
"""
import triton
import triton.language as tl

# the flash core's helpers by their own names, not as module attributes: torch.compile's inductor re-emits a
# user kernel's source with the helpers it calls by name, and cannot follow `module.helper` (kernels/_ops.py,
# decompose_when_traced)
from .._flash_core import fold_keys, head_base, init_state, load_rows, load_tile, normalize, row_source, store_rows

LOG2E = tl.constexpr(1.4426950408889634)   # constexpr: triton 3.6 refuses plain globals inside kernels
# _FP32_SCALARS: each kernel casts its float arguments to fp32 and uses tl.cast, not .to, on integer arguments.
# Triton's own launch passes a Python float as fp32; inductor, launching the kernel it was handed by a traced call
# (host.py, traced_forward), types it fp64 (torch 2.11), which a float32 dot refuses to mix with its fp32 operands;
# and inductor's analysis of which arguments a kernel writes (a compile of it to Triton IR) hands it integer
# arguments as Python ints, which have no .to (tl.cast takes either; both seen on the H200, torch 2.11).


@triton.jit
def _store_rows(ptrs, val, rows, n, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store the rows < n of a [R, BLOCK_D] tile, without its padding columns."""
    if BLOCK_D == HEAD_DIM:
        tl.store(ptrs, val, mask=rows[:, None] < n)
    else:
        tl.store(ptrs, val, mask=(rows[:, None] < n) & (offs_d[None, :] < HEAD_DIM))


# ------------------------------------------------------------------------------------------------
# Phase 1: one program per (query block, batch*head, key partition). Writes (m, z, s) to HBM, or, when
# the partition is the only one (FINAL), the output and lse directly.
# ------------------------------------------------------------------------------------------------

@triton.jit
def _key_tile(q, rows, offs_n, NQ, NK, off, qk_scale, k_base, v_base, skn, svn, b_base, sbi, sbj,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_KEYS: tl.constexpr, MASK_CAUSAL: tl.constexpr,
              HAS_BIAS: tl.constexpr, FOLD_Q: tl.constexpr, DOT_PREC: tl.constexpr):
    """Keys offs_n against the rows of q, for the forward's scan and the backward's dQ: their K and V rows and the
    scores x = q K^T with the bias added in log2 units, keys >= NK (MASK_KEYS) and future keys (MASK_CAUSAL) at
    -inf. The scale is in q with FOLD_Q (float32), applied here with a bias, else by the caller (the backward's
    exponent, SCALE_IN_EXP). The caller makes offs_n: torch's analysis of what a kernel handed to inductor writes
    counts a pointer built from a call's result as one into every tensor passed to the call: dS's store with
    offs_n from here would write Q, K, V and the bias there, and a compiled training step fails on that
    (scripts/compile_check.py --inductor-writes checks it)."""
    offs_d = tl.arange(0, BLOCK_D)
    k = load_tile(k_base + offs_n[:, None] * skn + offs_d[None, :],
                  offs_n < NK, offs_d, HEAD_DIM, BLOCK_D, MASK_KEYS)
    v = load_tile(v_base + offs_n[:, None] * svn + offs_d[None, :],
                  offs_n < NK, offs_d, HEAD_DIM, BLOCK_D, MASK_KEYS)
    x = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if HAS_BIAS:
        if not FOLD_Q:
            x = x * qk_scale
        b_mask = (rows[:, None] < NQ) & (offs_n[None, :] < NK)
        bias = tl.load(b_base + rows[:, None] * sbi + offs_n[None, :] * sbj, mask=b_mask, other=0.0)
        x = x + bias.to(tl.float32) * LOG2E
    if MASK_KEYS:
        x = tl.where(offs_n[None, :] < NK, x, float("-inf"))
    if MASK_CAUSAL:
        x = tl.where(offs_n[None, :] <= rows[:, None] + off, x, float("-inf"))
    return k, v, x


@triton.jit
def _scan_tile(m_i, z_i, s_i, q, rows, t0, NQ, NK, off, qk_scale,
               k_base, v_base, skn, svn, b_base, sbi, sbj,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
               MASK_KEYS: tl.constexpr, MASK_CAUSAL: tl.constexpr,
               HAS_BIAS: tl.constexpr, FOLD_Q: tl.constexpr, DOT_PREC: tl.constexpr):
    """merge(state, summary of keys [t0, t0+BLOCK_N)) for BLOCK_M rows, in registers (fp32 inputs, whose Q
    carries the scale (FOLD_Q), and every input with a bias; 16-bit without bias runs the flash core: _core_scan).

    The tile's summary is taken directly relative to the merged max m_new (the FlashAttention form of
    the symmetric merge): beta * sum 2^(x - m_t) == sum 2^(x - m_new), so no [BM, D] rescale of the
    tile's weighted sum is needed. m_ref guards the identity: if every key seen so far is masked,
    m_new = -inf and 2^(x - m_new) would be NaN; with m_ref = 0 it is 2^(-inf) = 0 and the state stays e.
    """
    offs_n = t0 + tl.arange(0, BLOCK_N)
    k, v, x = _key_tile(q, rows, offs_n, NQ, NK, off, qk_scale, k_base, v_base, skn, svn, b_base, sbi, sbj,
                        HEAD_DIM, BLOCK_D, MASK_KEYS, MASK_CAUSAL, HAS_BIAS, FOLD_Q, DOT_PREC)
    m_new = tl.maximum(m_i, tl.max(x, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)                 # 0 when the state is still the identity
    p = tl.exp2(x - m_ref[:, None])               # masked keys: 2^-inf = 0
    z_i = z_i * alpha + tl.sum(p, 1)
    s_i = s_i * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, z_i, s_i


@triton.jit
def _scan_partition(q_base, k_base, v_base, b_base, sqn, skn, svn, sbi, sbj, rows, lo, hi, r0,
                    NQ, NK, off, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, FOLD_Q: tl.constexpr, DOT_PREC: tl.constexpr):
    """The (m, z, s) summary of keys [lo, hi) for the BLOCK_M query rows `rows` (the identity if lo >= hi)."""
    offs_d = tl.arange(0, BLOCK_D)
    # rows >= NQ load Q = 0: their summaries are finite and are never written out
    q = load_tile(q_base + rows[:, None] * sqn + offs_d[None, :], rows < NQ, offs_d, HEAD_DIM, BLOCK_D, True)
    if FOLD_Q:
        # fp32: fold scale*log2(e) into Q once (one rounding of Q, ~6e-8 relative)
        q = q * qk_scale
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    z_i = tl.zeros([BLOCK_M], tl.float32)
    s_i = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # tiles entirely inside [0, NK) and (causal) visible to every row of the block need no mask
    safe_hi = hi
    if CAUSAL:
        safe_hi = tl.minimum(safe_hi, r0 + 1 + off)
    n_safe = tl.maximum(safe_hi - lo, 0) // BLOCK_N
    for t in range(0, n_safe):
        m_i, z_i, s_i = _scan_tile(m_i, z_i, s_i, q, rows, lo + t * BLOCK_N, NQ, NK, off, qk_scale,
                                   k_base, v_base, skn, svn, b_base, sbi, sbj,
                                   HEAD_DIM, BLOCK_D, BLOCK_N, False, False, HAS_BIAS, FOLD_Q, DOT_PREC)
    # the tail tile past NK and the tiles on the causal diagonal are masked (a fully masked
    # row of a tile contributes the identity)
    for t0 in range(lo + n_safe * BLOCK_N, hi, BLOCK_N):
        m_i, z_i, s_i = _scan_tile(m_i, z_i, s_i, q, rows, t0, NQ, NK, off, qk_scale,
                                   k_base, v_base, skn, svn, b_base, sbi, sbj,
                                   HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, HAS_BIAS, FOLD_Q, DOT_PREC)
    return m_i, z_i, s_i


@triton.jit
def _core_scan(q_base, k_base, v_base, sqn, skn, svn, lo, hi, r0, NQ, NK, off, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, KEYS_EVEN: tl.constexpr, USE_DESC: tl.constexpr,
               WARP_SPECIALIZE: tl.constexpr, DOT_PREC: tl.constexpr):
    """16-bit without bias: the (m, z, s) summary of keys [lo, hi) for rows r0 .. r0 + BLOCK_M - 1 through the
    shared flash core (kernels/_flash_core.py): the same state in the same base-2 domain (its (m, l, acc)), the scale
    applied inside exp2, tensor descriptors (TMA) and, where the plan says so, the warp-specialized loop -- which
    must be the kernel's only loop and whose rows must not be indexed by r0 itself (the core's row_index)."""
    q_src = row_source(q_base, NQ, sqn, HEAD_DIM, BLOCK_M, BLOCK_D, USE_DESC)
    k_src = row_source(k_base, NK, skn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_DESC)
    v_src = row_source(v_base, NK, svn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_DESC)
    # rows >= NQ load Q = 0: their summaries are finite and are never written out
    q = load_rows(q_src, r0, NQ, sqn, HEAD_DIM, BLOCK_M, BLOCK_D, USE_DESC, True)
    s_i, m_i, z_i = init_state(BLOCK_M, BLOCK_D)
    s_i, m_i, z_i = fold_keys(s_i, m_i, z_i, q, k_src, v_src, skn, svn, lo, hi, r0, NK, off, qk_scale,
                              BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, CAUSAL, KEYS_EVEN, USE_DESC,
                              WARP_SPECIALIZE, DOT_PREC)
    return m_i, z_i, s_i


@triton.jit
def _write_core_output(Out, Lse, m, z, s, bh, b, h, r0, sob, soh, son, NQ,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       USE_DESC: tl.constexpr, STORE_LSE: tl.constexpr):
    """_write_output for the core's path: out through the same descriptor / pointer helpers as its loads, lse
    through a pointer offset by r0 (never a vector built on r0: the core's row_index)."""
    o_base = Out + head_base(b, h, sob, soh)
    o_dst = row_source(o_base, NQ, son, HEAD_DIM, BLOCK_M, BLOCK_D, USE_DESC)
    store_rows(o_dst, r0, normalize(s, z).to(Out.dtype.element_ty), NQ, son, HEAD_DIM, BLOCK_M, BLOCK_D,
               USE_DESC)
    if STORE_LSE:
        lse = tl.where(z > 0, m + tl.log2(tl.where(z > 0, z, 1.0)), float("inf"))
        offs_m = tl.arange(0, BLOCK_M)
        tl.store(Lse + bh.to(tl.int64) * NQ + r0 + offs_m, lse, mask=offs_m < NQ - r0)


@triton.jit
def _write_output(Out, Lse, m, z, s, bh, b, h, rows, sob, soh, son, NQ,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, STORE_LSE: tl.constexpr):
    """out = s / z (0 for a row with no visible key) and lse = m + log2 z (+inf there) for rows < NQ."""
    offs_d = tl.arange(0, BLOCK_D)
    out = tl.where(z[:, None] > 0, s / tl.where(z > 0, z, 1.0)[:, None], 0.0)
    o_base = Out + head_base(b, h, sob, soh)
    _store_rows(o_base + rows[:, None] * son + offs_d[None, :], out.to(Out.dtype.element_ty), rows, NQ, offs_d,
                HEAD_DIM, BLOCK_D)
    if STORE_LSE:
        # +inf makes the backward's 2^(x - lse) = 0 for every key of a row that sees none
        lse = tl.where(z > 0, m + tl.log2(tl.where(z > 0, z, 1.0)), float("inf"))
        tl.store(Lse + bh.to(tl.int64) * NQ + rows, lse, mask=rows < NQ)


@triton.jit
def _partials(Sbuf, NROWS, Out):
    """Where slab S starts, after M and Z: fp32 partial sums for a float32 output, the normalised partial outputs
    in the output's dtype for a 16-bit one (one allocation, typed by this pointer)."""
    return (Sbuf + 2 * tl.cast(NROWS, tl.int64)).to(tl.pointer_type(Out.dtype.element_ty))


@triton.jit
def _store_summary(Sbuf, Out, m_i, z_i, s_i, part, qb, bh, b, h, r0, QB, BH, NROWS, NQ, sob, soh, son,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """(m, z) of one program to its slot of M and Z (fp32), and its part of the output: float32 output, s itself;
    16-bit output, the partition's normalised output s / z in the output's dtype (0 for a row that sees none of its
    keys: half the bytes of an fp32 s, and no overflow, it lies within the values' range). Partition 0 writes its
    part into the output rows themselves (phase 2 reads it back and merges in place: the same numbers, one
    [rows, D] slab less of summaries), the others to slots 0..P-2 of S. Pointers offset by the slots' scalar
    bases."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    base = ((part * QB + qb) * BH + bh).to(tl.int64) * BLOCK_M
    tl.store(Sbuf + base + offs_m, m_i)
    tl.store(Sbuf + tl.cast(NROWS, tl.int64) + base + offs_m, z_i)
    if Out.dtype.element_ty == tl.float32:
        part_out = s_i
    else:
        part_out = tl.where(z_i[:, None] > 0, s_i / tl.where(z_i > 0, z_i, 1.0)[:, None], 0.0)
        part_out = part_out.to(Out.dtype.element_ty)
    # one store whose destination is chosen by value, not a branch: a branch after the loop undoes the warp-
    # specialized core's partitions (sm_90 compile check: 4 warps instead of 12, 512 bytes spilled at D=128)
    first = part == 0
    o_base = Out + head_base(b, h, sob, soh) + r0 * son
    s_base = _partials(Sbuf, NROWS, Out) + (((part - 1) * QB + qb) * BH + bh).to(tl.int64) * BLOCK_M * HEAD_DIM
    dst = tl.where(first, o_base, s_base)
    row_stride = tl.where(first, son, HEAD_DIM).to(tl.int64)
    mask = offs_m[:, None] < NQ - r0                # rows past NQ: not in the output, never read from S
    if BLOCK_D != HEAD_DIM:
        mask = mask & (offs_d[None, :] < HEAD_DIM)
    tl.store(dst + offs_m[:, None] * row_stride + offs_d[None, :], part_out, mask=mask)


@triton.jit
def phase1_block(qb, bh, part, H, GROUP, NQ, NK, q0, W, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """Phase-1 program (qb, bh, part) of a q-chunk from row q0: (b, h, hk, off, r0, lo, hi), its batch, query head
    and key/value head, the bottom-right causal offset NK - NQ, its first row and its partition's keys [lo, hi).
    Causal, hi ends at the block's last row's last visible key: a partition that starts there does no work and
    stores nothing (phase 2 never reads it). Integer arithmetic only: gluon_phase1.py's kernel calls it too."""
    b = bh // H
    h = bh % H
    hk = h // GROUP
    off = NK - NQ
    r0 = q0 + qb * BLOCK_M
    lo = part * W
    hi = tl.minimum(lo + W, NK)
    if CAUSAL:
        hi = tl.minimum(hi, r0 + BLOCK_M + off)
    return b, h, hk, off, r0, lo, hi


@triton.jit(do_not_specialize=["H", "GROUP", "NQ", "NK", "q0", "QB", "BH", "W"])
def _elsa_phase1(Q, K, V, Bias, Sbuf, Out, Lse,
                 sqb, sqh, sqn, skb, skh, skn, svb, svh, svn,
                 sbb, sbh, sbi, sbj, sob, soh, son,
                 H, GROUP, NQ, NK, q0, QB, BH, W, NROWS, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, FOLD_Q: tl.constexpr,
                 SCALE_IN_EXP: tl.constexpr, DOT_PREC: tl.constexpr, FINAL: tl.constexpr,
                 STORE_LSE: tl.constexpr, KEYS_EVEN: tl.constexpr, USE_DESC: tl.constexpr,
                 WARP_SPECIALIZE: tl.constexpr):
    """Program (qb, bh, part): the summaries of BLOCK_M query rows over the keys [part*W, part*W + W).

    Summary buffer Sbuf (one allocation): M [NROWS] and Z [NROWS] in fp32, rows in the logical order [P, QB, BH,
    BLOCK_M] (NROWS = P * QB * BH * BLOCK_M for the largest chunk), then S [rows, HEAD_DIM] in the same order.
    S holds the parts of the output of the partitions 1..P-1 (float32 output: s in fp32; 16-bit: the normalised
    s / z in the output's dtype, _store_summary); partition 0 writes its part into the output rows it will finally
    hold (phase 2 reads it back and merges in place), one [rows, D] slab less per chunk. Phase 2's (qb, bh) reads
    one contiguous slab per partition.
    FINAL (a single partition holds every key): there is nothing to merge, so the program writes out and lse
    itself and phase 2 is not launched.
    SCALE_IN_EXP (16-bit, no bias) runs the shared flash core's loop (_core_scan): KEYS_EVEN (NK a multiple of
    BLOCK_N: no ragged tile), USE_DESC (tensor descriptors) and WARP_SPECIALIZE are its switches (the host's plan
    decides them); fp32 and the bias path keep this file's loop (_scan_partition), but for float32 on sm_90 at
    gluon_phase1.HEAD_DIMS, where the host launches gluon_phase1.py's wgmma kernel with these arguments instead.
    """
    qk_scale = tl.cast(qk_scale, tl.float32)     # _FP32_SCALARS
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    part = tl.program_id(2)
    b, h, hk, off, r0, lo, hi = phase1_block(qb, bh, part, H, GROUP, NQ, NK, q0, W, BLOCK_M, CAUSAL)
    q_base = Q + head_base(b, h, sqb, sqh)
    k_base = K + head_base(b, hk, skb, skh)
    v_base = V + head_base(b, hk, svb, svh)
    if SCALE_IN_EXP:
        if FINAL:
            m_i, z_i, s_i = _core_scan(q_base, k_base, v_base, sqn, skn, svn, lo, hi, r0, NQ, NK, off, qk_scale,
                                       HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, KEYS_EVEN, USE_DESC,
                                       WARP_SPECIALIZE, DOT_PREC)
            _write_core_output(Out, Lse, m_i, z_i, s_i, bh, b, h, r0, sob, soh, son, NQ, HEAD_DIM, BLOCK_D,
                               BLOCK_M, USE_DESC, STORE_LSE)
        elif CAUSAL:
            if lo < hi:
                m_i, z_i, s_i = _core_scan(q_base, k_base, v_base, sqn, skn, svn, lo, hi, r0, NQ, NK, off,
                                           qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, KEYS_EVEN,
                                           USE_DESC, WARP_SPECIALIZE, DOT_PREC)
                _store_summary(Sbuf, Out, m_i, z_i, s_i, part, qb, bh, b, h, r0, QB, BH, NROWS, NQ, sob, soh, son,
                               HEAD_DIM, BLOCK_D, BLOCK_M)
        else:
            # every partition holds keys (P = ceil(NK / W)): no branch around the (warp-specialized) loop
            m_i, z_i, s_i = _core_scan(q_base, k_base, v_base, sqn, skn, svn, lo, hi, r0, NQ, NK, off, qk_scale,
                                       HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, KEYS_EVEN, USE_DESC,
                                       WARP_SPECIALIZE, DOT_PREC)
            _store_summary(Sbuf, Out, m_i, z_i, s_i, part, qb, bh, b, h, r0, QB, BH, NROWS, NQ, sob, soh, son,
                           HEAD_DIM, BLOCK_D, BLOCK_M)
    else:
        rows = r0 + tl.arange(0, BLOCK_M)
        b_base = Bias + head_base(b, h, sbb, sbh)
        if FINAL:
            m_i, z_i, s_i = _scan_partition(q_base, k_base, v_base, b_base, sqn, skn, svn, sbi, sbj, rows, lo, hi,
                                            r0, NQ, NK, off, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                                            CAUSAL, HAS_BIAS, FOLD_Q, DOT_PREC)
            _write_output(Out, Lse, m_i, z_i, s_i, bh, b, h, rows, sob, soh, son, NQ, HEAD_DIM, BLOCK_D,
                          STORE_LSE)
        elif lo < hi:
            m_i, z_i, s_i = _scan_partition(q_base, k_base, v_base, b_base, sqn, skn, svn, sbi, sbj, rows, lo, hi,
                                            r0, NQ, NK, off, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                                            CAUSAL, HAS_BIAS, FOLD_Q, DOT_PREC)
            _store_summary(Sbuf, Out, m_i, z_i, s_i, part, qb, bh, b, h, r0, QB, BH, NROWS, NQ, sob, soh, son,
                           HEAD_DIM, BLOCK_D, BLOCK_M)


# ------------------------------------------------------------------------------------------------
# Phase 2: a separate launch. Reads only the summaries; merges the partitions of each row
# (non-causal: all P; causal: those at or before the block's diagonal) and writes out = s / z, lse.
# ------------------------------------------------------------------------------------------------

@triton.jit
def _slab(Sbuf, z_base, pk, p_end, qb, bh, i0, QB, BH, offs_r, BLOCK_M: tl.constexpr):
    """Partitions pk's m and z ([n, ROWS]; -inf and 0 from p_end on), their slot indices and which are valid."""
    valid = pk[:, None] < p_end
    idx = ((pk[:, None] * QB + qb) * BH + bh).to(tl.int64) * BLOCK_M + i0 + offs_r[None, :]
    mk = tl.load(Sbuf + idx, mask=valid, other=float("-inf"))
    zk = tl.load(z_base + idx, mask=valid, other=0.0)
    return mk, zk, idx, valid


@triton.jit
def _slab_parts(s_base, idx, valid, offs_d, QB, BH,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """The parts in S of partitions >= 1 at slot indices idx ([n, ROWS, BLOCK_D]; 0 where not valid): partition
    p's part is S's slab p - 1."""
    mask = valid[:, :, None]
    if BLOCK_D != HEAD_DIM:
        mask = mask & (offs_d[None, None, :] < HEAD_DIM)
    idx = idx - QB * BH * BLOCK_M
    return tl.load(s_base + idx[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=mask, other=0.0)


@triton.jit
def _weight(mk, zk, m_ref):
    """w_p = 2^(m_p - M*), 0 for identity summaries."""
    return tl.where(zk > 0, tl.exp2(mk - m_ref[None, :]), 0.0)


@triton.jit
def _part_weight(w, zk, FP32_PARTS: tl.constexpr):
    """The weight of partition p's part: w_p for a float32 output, whose part is s_p; w_p z_p for a 16-bit one, whose
    part is o_p = s_p / z_p (S = sum w s = sum (w z) o)."""
    if FP32_PARTS:
        return w
    return w * zk


@triton.jit(do_not_specialize=["H", "NQ", "NK", "q0", "QB", "BH", "P", "W"])
def _elsa_phase2(Sbuf, Out, Lse,
                 sob, soh, son,
                 H, NQ, NK, q0, QB, BH, P, W, NROWS,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                 KBT: tl.constexpr, CAUSAL: tl.constexpr, STORE_LSE: tl.constexpr, PDL: tl.constexpr):
    """PDL: launched as a programmatic dependent of phase 1 (sm_90, host.py): the program may start while phase 1
    still runs, so it waits for phase 1's completion and its stores (griddepcontrol.wait) before its first load."""
    rb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    qb = rb // (BLOCK_M // ROWS)
    i0 = (rb % (BLOCK_M // ROWS)) * ROWS
    p_end = P
    if CAUSAL:
        # the partitions phase 1 stored for this query block: those starting at or before the last visible key
        # of the block's last row (exactly as phase 1 decided); none when that row sees no key at all
        last = tl.minimum(q0 + (qb + 1) * BLOCK_M, NQ) - 1 + (NK - NQ)
        p_end = tl.where(last < 0, 0, tl.minimum(tl.maximum(last, 0) // W + 1, P))
    # slabs: KBT partitions' m and z, SBT partitions' parts in S (partitions 1.. : partition 0's part is in the
    # output rows, so half as many)
    SBT: tl.constexpr = (KBT + 1) // 2
    offs_k = tl.arange(0, KBT)
    offs_s = 1 + tl.arange(0, SBT)
    offs_r = tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    z_base = Sbuf + tl.cast(NROWS, tl.int64)
    s_base = _partials(Sbuf, NROWS, Out)
    rows = q0 + qb * BLOCK_M + i0 + offs_r
    o_ptrs = Out + head_base(b, h, sob, soh) + rows[:, None] * son + offs_d[None, :]
    o_mask = rows[:, None] < NQ
    if BLOCK_D != HEAD_DIM:
        o_mask = o_mask & (offs_d[None, :] < HEAD_DIM)
    if PDL:
        tl.extra.cuda.gdc_wait()
    # The first slabs' loads (every partition, usually: P <= KBT, P - 1 <= SBT) and partition 0's part in the output
    # rows are issued at once, before anything waits on one: one round trip to memory where a pass for the row max,
    # then one for the sums, then the output's read would make three. Slabs are reduced with tl.max / tl.sum over
    # axis 0 (a tree inside the program) and merged into running totals.
    mk0, zk0, idx0, valid0 = _slab(Sbuf, z_base, offs_k, p_end, qb, bh, i0, QB, BH, offs_r, BLOCK_M)
    ms0, zs0, sidx0, svalid0 = _slab(Sbuf, z_base, offs_s, p_end, qb, bh, i0, QB, BH, offs_r, BLOCK_M)
    ss0 = _slab_parts(s_base, sidx0, svalid0, offs_d, QB, BH, HEAD_DIM, BLOCK_D, BLOCK_M)
    o0 = tl.load(o_ptrs, mask=o_mask, other=0.0)
    # the row max M* over partitions
    m_star = tl.max(mk0, 0)
    for p0 in range(KBT, p_end, KBT):
        mk, zk, idx, valid = _slab(Sbuf, z_base, p0 + offs_k, p_end, qb, bh, i0, QB, BH, offs_r, BLOCK_M)
        m_star = tl.maximum(m_star, tl.max(mk, 0))
    m_ref = tl.where(m_star == float("-inf"), 0.0, m_star)
    FP32_PARTS: tl.constexpr = Out.dtype.element_ty == tl.float32
    # Z = sum w z over the partitions, and partition 0's part weight w0
    w = _weight(mk0, zk0, m_ref)
    z = tl.sum(w * zk0, 0)
    w0 = tl.sum(tl.where(offs_k[:, None] == 0, _part_weight(w, zk0, FP32_PARTS), 0.0), 0)
    for p0 in range(KBT, p_end, KBT):
        mk, zk, idx, valid = _slab(Sbuf, z_base, p0 + offs_k, p_end, qb, bh, i0, QB, BH, offs_r, BLOCK_M)
        z += tl.sum(_weight(mk, zk, m_ref) * zk, 0)
    # S: the parts of partitions >= 1 by their weights, then partition 0's (read before its weight was known: rows it
    # did not store, w0 = 0, may hold anything)
    s = tl.sum(_part_weight(_weight(ms0, zs0, m_ref), zs0, FP32_PARTS)[:, :, None] * ss0.to(tl.float32), 0)
    for p0 in range(1 + SBT, p_end, SBT):
        ms, zs, sidx, svalid = _slab(Sbuf, z_base, p0 + tl.arange(0, SBT), p_end, qb, bh, i0, QB, BH, offs_r, BLOCK_M)
        ss = _slab_parts(s_base, sidx, svalid, offs_d, QB, BH, HEAD_DIM, BLOCK_D, BLOCK_M)
        s += tl.sum(_part_weight(_weight(ms, zs, m_ref), zs, FP32_PARTS)[:, :, None] * ss.to(tl.float32), 0)
    s += w0[:, None] * tl.where(w0[:, None] > 0, o0.to(tl.float32), 0.0)
    _write_output(Out, Lse, m_star, z, s, bh, b, h, rows, sob, soh, son, NQ, HEAD_DIM, BLOCK_D, STORE_LSE)


# ------------------------------------------------------------------------------------------------
# Backward: exact recompute of every softmax weight from the saved lse. Two launches: dQ (which also
# computes Delta = rowsum(dO * O) for its rows) and then dK/dV (which reads Delta); or, for launch-bound calls,
# one launch whose programs do either job, the dK/dV ones computing Delta from O themselves.
# ------------------------------------------------------------------------------------------------

@triton.jit
def _dq_tile(acc, q, do, l2, delta, rows, t0, NQ, NK, off, qk_scale,
             k_base, v_base, skn, svn, b_base, sbi, sbj, ds_base,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
             MASK_KEYS: tl.constexpr, MASK_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
             BIAS_GRAD: tl.constexpr, FOLD_Q: tl.constexpr, SCALE_IN_EXP: tl.constexpr,
             DOT_PREC: tl.constexpr):
    offs_n = t0 + tl.arange(0, BLOCK_N)
    k, v, x = _key_tile(q, rows, offs_n, NQ, NK, off, qk_scale, k_base, v_base, skn, svn, b_base, sbi, sbj,
                        HEAD_DIM, BLOCK_D, MASK_KEYS, MASK_CAUSAL, HAS_BIAS, FOLD_Q, DOT_PREC)
    if SCALE_IN_EXP:
        p = tl.exp2(x * qk_scale - l2[:, None])       # exact softmax weights (one FMA)
    else:
        p = tl.exp2(x - l2[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])                    # dL/d(natural-log score)
    if BIAS_GRAD:
        ds_mask = (rows[:, None] < NQ) & (offs_n[None, :] < NK)
        tl.store(ds_base + rows[:, None] * NK + offs_n[None, :], ds, mask=ds_mask)
    acc += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
    return acc


@triton.jit
def _dq_rows(qb, bh, Q, K, V, Out, dOut, Lse, Delta, dQ, Bias, dS,
             sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sdb, sdh, sdn, sgb, sgh, sgn,
             sbb, sbh, sbi, sbj,
             H, GROUP, NQ, NK, qk_scale, sm_scale,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr,
             FOLD_Q: tl.constexpr, SCALE_IN_EXP: tl.constexpr, DOT_PREC: tl.constexpr, STORE_DELTA: tl.constexpr):
    """dQ of BLOCK_M query rows (block qb of query head bh) over all visible keys; with STORE_DELTA also
    Delta = rowsum(dO * O) of those rows, for the dK/dV launch that follows."""
    b = bh // H
    h = bh % H
    hk = h // GROUP
    off = NK - NQ
    r0 = qb * BLOCK_M
    rows = r0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = rows < NQ
    q = load_tile(Q + head_base(b, h, sqb, sqh) + rows[:, None] * sqn + offs_d[None, :],
                  ok, offs_d, HEAD_DIM, BLOCK_D, True)
    do = load_tile(dOut + head_base(b, h, sdb, sdh) + rows[:, None] * sdn + offs_d[None, :],
                   ok, offs_d, HEAD_DIM, BLOCK_D, True)
    o = load_tile(Out + head_base(b, h, sob, soh) + rows[:, None] * son + offs_d[None, :],
                  ok, offs_d, HEAD_DIM, BLOCK_D, True)
    st = bh.to(tl.int64) * NQ + rows
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if STORE_DELTA:
        tl.store(Delta + st, delta, mask=ok)
    l2 = tl.load(Lse + st, mask=ok, other=float("inf"))     # rows >= NQ: all weights 0
    qs = q
    if FOLD_Q:
        qs = q * qk_scale
    k_base = K + head_base(b, hk, skb, skh)
    v_base = V + head_base(b, hk, svb, svh)
    b_base = Bias + head_base(b, h, sbb, sbh)
    ds_base = dS + bh.to(tl.int64) * NQ * NK          # [B*H, NQ, NK], only when BIAS_GRAD
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = NK
    safe_hi = NK
    if CAUSAL:
        hi = tl.maximum(tl.minimum(NK, r0 + BLOCK_M + off), 0)
        safe_hi = tl.maximum(tl.minimum(hi, r0 + 1 + off), 0)
    n_safe = safe_hi // BLOCK_N
    for t in range(0, n_safe):
        acc = _dq_tile(acc, qs, do, l2, delta, rows, t * BLOCK_N, NQ, NK, off, qk_scale,
                       k_base, v_base, skn, svn, b_base, sbi, sbj, ds_base,
                       HEAD_DIM, BLOCK_D, BLOCK_N, False, False, HAS_BIAS, BIAS_GRAD, FOLD_Q, SCALE_IN_EXP, DOT_PREC)
    for t0 in range(n_safe * BLOCK_N, hi, BLOCK_N):
        acc = _dq_tile(acc, qs, do, l2, delta, rows, t0, NQ, NK, off, qk_scale,
                       k_base, v_base, skn, svn, b_base, sbi, sbj, ds_base,
                       HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, HAS_BIAS, BIAS_GRAD, FOLD_Q, SCALE_IN_EXP, DOT_PREC)
    dq = acc * sm_scale
    _store_rows(dQ + head_base(b, h, sgb, sgh) + rows[:, None] * sgn + offs_d[None, :],
                dq.to(dQ.dtype.element_ty), rows, NQ, offs_d, HEAD_DIM, BLOCK_D)


@triton.jit(do_not_specialize=["H", "GROUP", "NQ", "NK"])
def _elsa_bwd_dq(Q, K, V, Out, dOut, Lse, Delta, dQ, Bias, dS,
                 sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sdb, sdh, sdn, sgb, sgh, sgn,
                 sbb, sbh, sbi, sbj,
                 H, GROUP, NQ, NK, qk_scale, sm_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr,
                 FOLD_Q: tl.constexpr, SCALE_IN_EXP: tl.constexpr, DOT_PREC: tl.constexpr):
    """Program (qb, bh): dQ of BLOCK_M query rows over all visible keys, and Delta = rowsum(dO * O) of those rows."""
    _dq_rows(tl.program_id(0), tl.program_id(1), Q, K, V, Out, dOut, Lse, Delta, dQ, Bias, dS,
             sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sdb, sdh, sdn, sgb, sgh, sgn,
             sbb, sbh, sbi, sbj, H, GROUP, NQ, NK,
             tl.cast(qk_scale, tl.float32), tl.cast(sm_scale, tl.float32),     # _FP32_SCALARS
             HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, HAS_BIAS, BIAS_GRAD, FOLD_Q, SCALE_IN_EXP, DOT_PREC, True)


@triton.jit
def _dkdv_tile(dk, dv, k, v, cols, i0, NQ, NK, off, qk_scale,
               q_base, sqn, do_base, sdn, o_base, son, Lse, Delta, st0, b_base, sbi, sbj,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
               MASK_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, FOLD_Q: tl.constexpr,
               SCALE_IN_EXP: tl.constexpr, DOT_PREC: tl.constexpr, DELTA_FROM_O: tl.constexpr):
    rows = i0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = rows < NQ
    q = load_tile(q_base + rows[:, None] * sqn + offs_d[None, :], ok, offs_d, HEAD_DIM, BLOCK_D, True)
    do = load_tile(do_base + rows[:, None] * sdn + offs_d[None, :], ok, offs_d, HEAD_DIM, BLOCK_D, True)
    l2 = tl.load(Lse + st0 + rows, mask=ok, other=float("inf"))
    if DELTA_FROM_O:        # one-launch backward: no dQ program has stored Delta before this one runs
        o = load_tile(o_base + rows[:, None] * son + offs_d[None, :], ok, offs_d, HEAD_DIM, BLOCK_D, True)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    else:
        delta = tl.load(Delta + st0 + rows, mask=ok, other=0.0)
    # transposed scores x^T [BN, BM]; k already carries scale*log2e for fp32 (FOLD_Q), else scale here.
    # Keys >= NK need no -inf mask: their dK/dV rows are never stored and nothing else reads them.
    xt = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)
    if HAS_BIAS:
        if not FOLD_Q:
            xt = xt * qk_scale
        b_mask = (cols[:, None] < NK) & (rows[None, :] < NQ)
        bias = tl.load(b_base + rows[None, :] * sbi + cols[:, None] * sbj, mask=b_mask, other=0.0)
        xt = xt + bias.to(tl.float32) * LOG2E
    if MASK_CAUSAL:
        xt = tl.where(cols[:, None] <= rows[None, :] + off, xt, float("-inf"))
    if SCALE_IN_EXP:
        pt = tl.exp2(xt * qk_scale - l2[None, :])
    else:
        pt = tl.exp2(xt - l2[None, :])
    dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PREC)
    dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    dst = pt * (dpt - delta[None, :])
    dk += tl.dot(dst.to(q.dtype), q, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def _dkdv_head(dk, dv, ks, v, cols, lo, safe_lo, b, h, H, NQ, NK, off, qk_scale,
               Q, dOut, Out, Bias, Lse, Delta, sqb, sqh, sqn, sdb, sdh, sdn, sob, soh, son, sbb, sbh, sbi, sbj,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, FOLD_Q: tl.constexpr,
               SCALE_IN_EXP: tl.constexpr, DOT_PREC: tl.constexpr, DELTA_FROM_O: tl.constexpr):
    """dK, dV of one key block += the contributions of query head h (its masked diagonal tiles, then the rest)."""
    q_base = Q + head_base(b, h, sqb, sqh)
    do_base = dOut + head_base(b, h, sdb, sdh)
    o_base = Out + head_base(b, h, sob, soh)
    b_base = Bias + head_base(b, h, sbb, sbh)
    st0 = (b * H + h).to(tl.int64) * NQ
    if CAUSAL:
        for i0 in range(lo, safe_lo, BLOCK_M):
            dk, dv = _dkdv_tile(dk, dv, ks, v, cols, i0, NQ, NK, off, qk_scale, q_base, sqn, do_base, sdn,
                                o_base, son, Lse, Delta, st0, b_base, sbi, sbj, HEAD_DIM, BLOCK_D, BLOCK_M, True,
                                HAS_BIAS, FOLD_Q, SCALE_IN_EXP, DOT_PREC, DELTA_FROM_O)
    for i0 in range(safe_lo, NQ, BLOCK_M):
        dk, dv = _dkdv_tile(dk, dv, ks, v, cols, i0, NQ, NK, off, qk_scale, q_base, sqn, do_base, sdn,
                            o_base, son, Lse, Delta, st0, b_base, sbi, sbj, HEAD_DIM, BLOCK_D, BLOCK_M, False,
                            HAS_BIAS, FOLD_Q, SCALE_IN_EXP, DOT_PREC, DELTA_FROM_O)
    return dk, dv


@triton.jit
def _dkdv_keys(kb, bhk, Q, K, V, Out, dOut, Lse, Delta, dK, dV, Bias,
               sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sdb, sdh, sdn,
               skgb, skgh, skgn, svgb, svgh, svgn,
               sbb, sbh, sbi, sbj,
               HKV, GROUP, NQ, NK, qk_scale, sm_scale,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, FOLD_Q: tl.constexpr,
               SCALE_IN_EXP: tl.constexpr, DOT_PREC: tl.constexpr, GROUPED: tl.constexpr,
               DELTA_FROM_O: tl.constexpr):
    """dK, dV of BLOCK_N keys (block kb of key/value head bhk = b*HKV + hk), looping over the query tiles of every
    query head of its group: summed over the group in registers, without atomics or a per-query-head copy.
    GROUPED (GROUP > 1) adds the loop over the group's heads; without it the kernel is the plain multi-head one
    (the loop costs registers: the 16-bit D=64 tile spills more with it). Delta is read from the dQ launch's
    buffer, or with DELTA_FROM_O recomputed from O and dO per query tile (Out and its strides: used only then)."""
    b = bhk // HKV
    hk = bhk % HKV
    H = HKV * GROUP
    off = NK - NQ
    c0 = kb * BLOCK_N
    cols = c0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = load_tile(K + head_base(b, hk, skb, skh) + cols[:, None] * skn + offs_d[None, :],
                  cols < NK, offs_d, HEAD_DIM, BLOCK_D, True)
    v = load_tile(V + head_base(b, hk, svb, svh) + cols[:, None] * svn + offs_d[None, :],
                  cols < NK, offs_d, HEAD_DIM, BLOCK_D, True)
    ks = k
    if FOLD_Q:
        ks = k * qk_scale                              # fp32: fold scale*log2(e) into K once
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = 0
    safe_lo = 0
    if CAUSAL:
        # query rows i < c0 - off see none of these keys; rows i >= c0 + BLOCK_N - 1 - off see all of them
        lo = (tl.maximum(c0 - off, 0) // BLOCK_M) * BLOCK_M
        safe_lo = tl.cdiv(tl.maximum(c0 + BLOCK_N - 1 - off, 0), BLOCK_M) * BLOCK_M
        safe_lo = tl.maximum(tl.minimum(safe_lo, tl.cdiv(NQ, BLOCK_M) * BLOCK_M), lo)
    if GROUPED:
        for g in range(0, GROUP):
            dk, dv = _dkdv_head(dk, dv, ks, v, cols, lo, safe_lo, b, hk * GROUP + g, H, NQ, NK, off, qk_scale,
                                Q, dOut, Out, Bias, Lse, Delta, sqb, sqh, sqn, sdb, sdh, sdn, sob, soh, son,
                                sbb, sbh, sbi, sbj, HEAD_DIM, BLOCK_D, BLOCK_M, CAUSAL, HAS_BIAS, FOLD_Q,
                                SCALE_IN_EXP, DOT_PREC, DELTA_FROM_O)
    else:
        dk, dv = _dkdv_head(dk, dv, ks, v, cols, lo, safe_lo, b, hk, H, NQ, NK, off, qk_scale,
                            Q, dOut, Out, Bias, Lse, Delta, sqb, sqh, sqn, sdb, sdh, sdn, sob, soh, son,
                            sbb, sbh, sbi, sbj, HEAD_DIM, BLOCK_D, BLOCK_M, CAUSAL, HAS_BIAS, FOLD_Q,
                            SCALE_IN_EXP, DOT_PREC, DELTA_FROM_O)
    dk = dk * sm_scale
    _store_rows(dK + head_base(b, hk, skgb, skgh) + cols[:, None] * skgn + offs_d[None, :],
                dk.to(dK.dtype.element_ty), cols, NK, offs_d, HEAD_DIM, BLOCK_D)
    _store_rows(dV + head_base(b, hk, svgb, svgh) + cols[:, None] * svgn + offs_d[None, :],
                dv.to(dV.dtype.element_ty), cols, NK, offs_d, HEAD_DIM, BLOCK_D)


@triton.jit(do_not_specialize=["HKV", "GROUP", "NQ", "NK"])
def _elsa_bwd_dkdv(Q, K, V, dOut, Lse, Delta, dK, dV, Bias,
                   sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn,
                   skgb, skgh, skgn, svgb, svgh, svgn,
                   sbb, sbh, sbi, sbj,
                   HKV, GROUP, NQ, NK, qk_scale, sm_scale,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, FOLD_Q: tl.constexpr,
                   SCALE_IN_EXP: tl.constexpr, DOT_PREC: tl.constexpr, GROUPED: tl.constexpr):
    """Program (kb, b*HKV + hk): dK, dV of BLOCK_N keys of one key/value head (_dkdv_keys), after the dQ launch
    has stored Delta. Out is not read: Q stands in for it."""
    _dkdv_keys(tl.program_id(0), tl.program_id(1), Q, K, V, Q, dOut, Lse, Delta, dK, dV, Bias,
               sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, 0, 0, 0, sdb, sdh, sdn,
               skgb, skgh, skgn, svgb, svgh, svgn, sbb, sbh, sbi, sbj, HKV, GROUP, NQ, NK,
               tl.cast(qk_scale, tl.float32), tl.cast(sm_scale, tl.float32),     # _FP32_SCALARS
               HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, HAS_BIAS, FOLD_Q, SCALE_IN_EXP, DOT_PREC, GROUPED, False)


@triton.jit(do_not_specialize=["H", "GROUP", "NQ", "NK", "KV_BLOCKS", "Q_BLOCKS", "KV_PROGRAMS"])
def _elsa_bwd_one_launch(Q, K, V, Out, dOut, Lse, dQ, dK, dV, Bias, dS,
                         sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sdb, sdh, sdn,
                         sgb, sgh, sgn, skgb, skgh, skgn, svgb, svgh, svgn,
                         sbb, sbh, sbi, sbj,
                         H, GROUP, NQ, NK, KV_BLOCKS, Q_BLOCKS, KV_PROGRAMS, qk_scale, sm_scale,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         DQ_BLOCK_M: tl.constexpr, DQ_BLOCK_N: tl.constexpr,
                         KV_BLOCK_M: tl.constexpr, KV_BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr,
                         FOLD_Q: tl.constexpr, SCALE_IN_EXP: tl.constexpr, DOT_PREC: tl.constexpr,
                         GROUPED: tl.constexpr):
    """The whole backward in one launch, for calls whose time is the host's (kernels/elsa/config.py,
    backward_launches): programs [0, KV_PROGRAMS) are _elsa_bwd_dkdv's (kb, b*HKV + hk), computing Delta from O
    themselves; the rest are _elsa_bwd_dq's (qb, bh), which store no Delta. No program waits on another."""
    qk_scale = tl.cast(qk_scale, tl.float32)     # _FP32_SCALARS
    sm_scale = tl.cast(sm_scale, tl.float32)
    pid = tl.program_id(0)
    if pid < KV_PROGRAMS:
        _dkdv_keys(pid % KV_BLOCKS, pid // KV_BLOCKS, Q, K, V, Out, dOut, Lse, Lse, dK, dV, Bias,
                   sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sdb, sdh, sdn,
                   skgb, skgh, skgn, svgb, svgh, svgn, sbb, sbh, sbi, sbj, H // GROUP, GROUP, NQ, NK,
                   qk_scale, sm_scale, HEAD_DIM, BLOCK_D, KV_BLOCK_M, KV_BLOCK_N, CAUSAL, HAS_BIAS, FOLD_Q,
                   SCALE_IN_EXP, DOT_PREC, GROUPED, True)
    else:
        j = pid - KV_PROGRAMS
        _dq_rows(j % Q_BLOCKS, j // Q_BLOCKS, Q, K, V, Out, dOut, Lse, Lse, dQ, Bias, dS,
                 sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sdb, sdh, sdn, sgb, sgh, sgn,
                 sbb, sbh, sbi, sbj, H, GROUP, NQ, NK, qk_scale, sm_scale,
                 HEAD_DIM, BLOCK_D, DQ_BLOCK_M, DQ_BLOCK_N, CAUSAL, HAS_BIAS, BIAS_GRAD, FOLD_Q, SCALE_IN_EXP,
                 DOT_PREC, False)
