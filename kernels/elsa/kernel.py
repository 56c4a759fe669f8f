"""ELSA Triton kernels: phase 1 (per-partition monoid summaries), phase 2 (merge + normalise), backward.

Notation (kernels/elsa/NOTES.md and shared/specs/elsa.md):
  x[i, j] = scale * log2(e) * q_i . k_j  (+ log2(e) * bias[i, j])      base-2 logits, exp2 everywhere
  summary of row i over a key set J = (m, z, s) = (max x, sum 2^(x-m), sum 2^(x-m) v_j), fp32;
  identity (empty / fully masked J) = (-inf, 0, 0).

Tensors q, k, v, out, dO are addressed through (batch, head, row) strides with a unit feature stride,
so timm's permuted q/k/v views need no copy. The (b, h) base offset is int64; within one head the
row offsets are int32 (the wrapper checks they fit). N and every offset are runtime ints so a new
sequence length or q-chunk start does not compile a new kernel; only tile sizes, D and feature flags
are constexpr.
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)   # constexpr: triton 3.6 refuses plain globals inside kernels


# ------------------------------------------------------------------------------------------------
# Phase 1: one program per (query block, batch*head, key partition). Writes (m, z, s) to HBM.
# ------------------------------------------------------------------------------------------------

@triton.jit
def _fold_tile(m_i, z_i, s_i, q, rows, t0, N, qk_scale,
               k_base, v_base, skn, svn, b_base, sbi, sbj,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
               MASK_KEYS: tl.constexpr, MASK_CAUSAL: tl.constexpr,
               HAS_BIAS: tl.constexpr, FOLD_Q: tl.constexpr, SCALE_IN_EXP: tl.constexpr,
               DOT_PREC: tl.constexpr):
    """merge(state, summary of keys [t0, t0+BLOCK_N)) for BLOCK_M rows, in registers.

    The tile's summary is taken directly relative to the merged max m_new (the FlashAttention form of
    the symmetric merge): beta * sum 2^(x - m_t) == sum 2^(x - m_new), so no [BM, D] rescale of the
    tile's weighted sum is needed. m_ref guards the identity: if every key seen so far is masked,
    m_new = -inf and 2^(x - m_new) would be NaN; with m_ref = 0 it is 2^(-inf) = 0 and the state stays e.
    """
    offs_n = t0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k_ptrs = k_base + offs_n[:, None] * skn + offs_d[None, :]
    v_ptrs = v_base + offs_n[:, None] * svn + offs_d[None, :]
    if MASK_KEYS:
        kv_mask = offs_n[:, None] < N
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    x = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    # SCALE_IN_EXP (16-bit, no bias): keep the raw product and apply scale*log2(e) inside exp2 as one
    # FMA (max(raw)*c == max(raw*c) because c > 0 and rounding is monotone). Otherwise x is scaled here.
    if HAS_BIAS:
        if not FOLD_Q:
            x = x * qk_scale
        b_mask = (rows[:, None] < N) & (offs_n[None, :] < N)
        bias = tl.load(b_base + rows[:, None] * sbi + offs_n[None, :] * sbj, mask=b_mask, other=0.0)
        x = x + bias.to(tl.float32) * LOG2E
    if MASK_KEYS:
        x = tl.where(offs_n[None, :] < N, x, float("-inf"))
    if MASK_CAUSAL:
        x = tl.where(rows[:, None] >= offs_n[None, :], x, float("-inf"))
    m_t = tl.max(x, 1)
    if SCALE_IN_EXP:
        m_t = m_t * qk_scale
    m_new = tl.maximum(m_i, m_t)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)                 # 0 when the state is still the identity
    if SCALE_IN_EXP:
        p = tl.exp2(x * qk_scale - m_ref[:, None])
    else:
        p = tl.exp2(x - m_ref[:, None])           # masked keys: 2^-inf = 0
    z_i = z_i * alpha + tl.sum(p, 1)
    s_i = s_i * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, z_i, s_i


@triton.jit(do_not_specialize=["H", "N", "q0", "QB", "BH", "W"])
def _elsa_phase1(Q, K, V, Bias, Msum, Zsum, Ssum,
                 sqb, sqh, sqn, skb, skh, skn, svb, svh, svn,
                 sbb, sbh, sbi, sbj,
                 H, N, q0, QB, BH, W, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, FOLD_Q: tl.constexpr,
                 SCALE_IN_EXP: tl.constexpr, DOT_PREC: tl.constexpr):
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    part = tl.program_id(2)
    b = bh // H
    h = bh % H
    r0 = q0 + qb * BLOCK_M
    lo = part * W                                 # this partition's keys: [lo, lo + W) ∩ [0, N)
    hi = tl.minimum(lo + W, N)
    if CAUSAL:
        # keys after the block's last row are future for every row of the block; a partition that
        # starts there (p > p_diag) does no work and stores nothing: phase 2 never reads it.
        hi = tl.minimum(hi, r0 + BLOCK_M)
    if lo < hi:
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        rows = r0 + offs_m
        q_base = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        k_base = K + b.to(tl.int64) * skb + h.to(tl.int64) * skh
        v_base = V + b.to(tl.int64) * svb + h.to(tl.int64) * svh
        b_base = Bias + b.to(tl.int64) * sbb + h.to(tl.int64) * sbh
        # rows >= N load Q = 0: their summaries are finite and phase 2 never writes them out
        q = tl.load(q_base + rows[:, None] * sqn + offs_d[None, :], mask=rows[:, None] < N, other=0.0)
        if FOLD_Q:
            # fp32: fold scale*log2(e) into Q once (one rounding of Q, ~6e-8 relative)
            q = q * qk_scale
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        z_i = tl.zeros([BLOCK_M], tl.float32)
        s_i = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        # tiles entirely inside [0, N) and (causal) entirely at or before row r0 need no mask
        safe_hi = hi
        if CAUSAL:
            safe_hi = tl.minimum(safe_hi, r0 + 1)
        n_safe = tl.maximum(safe_hi - lo, 0) // BLOCK_N
        for t in range(0, n_safe):
            m_i, z_i, s_i = _fold_tile(m_i, z_i, s_i, q, rows, lo + t * BLOCK_N, N, qk_scale,
                                       k_base, v_base, skn, svn, b_base, sbi, sbj,
                                       HEAD_DIM, BLOCK_N, False, False, HAS_BIAS, FOLD_Q, SCALE_IN_EXP, DOT_PREC)
        # the tail tile past N and the tiles on the causal diagonal are masked (a fully masked
        # row of a tile contributes the identity)
        for t0 in range(lo + n_safe * BLOCK_N, hi, BLOCK_N):
            m_i, z_i, s_i = _fold_tile(m_i, z_i, s_i, q, rows, t0, N, qk_scale,
                                       k_base, v_base, skn, svn, b_base, sbi, sbj,
                                       HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_BIAS, FOLD_Q, SCALE_IN_EXP, DOT_PREC)
        # summary layout [P, QB, BH, BM(, D)]: phase 2's (qb, bh) reads one contiguous slab per partition
        base = ((part * QB + qb) * BH + bh).to(tl.int64) * BLOCK_M
        tl.store(Msum + base + offs_m, m_i)
        tl.store(Zsum + base + offs_m, z_i)
        tl.store(Ssum + (base + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], s_i)


# ------------------------------------------------------------------------------------------------
# Phase 2: a separate launch. Reads only the summaries; merges the partitions of each row
# (non-causal: all P; causal: those at or before the block's diagonal) and writes out = s / z.
# ------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["H", "N", "q0", "QB", "BH", "P", "W"])
def _elsa_phase2(Msum, Zsum, Ssum, Out, Mrow, Zrow,
                 sob, soh, son,
                 H, N, q0, QB, BH, P, W,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, KBT: tl.constexpr,
                 CAUSAL: tl.constexpr, STORE_STATS: tl.constexpr):
    rb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    qb = rb // (BLOCK_M // ROWS)
    i0 = (rb % (BLOCK_M // ROWS)) * ROWS
    p_end = P
    if CAUSAL:
        # p_diag(qb) = (last row of the query block) // W, exactly as phase 1 decided what to store
        last = tl.minimum(q0 + (qb + 1) * BLOCK_M, N) - 1
        p_end = tl.minimum(last // W + 1, P)
    offs_k = tl.arange(0, KBT)
    offs_r = tl.arange(0, ROWS)
    offs_d = tl.arange(0, HEAD_DIM)
    # Slabs of KBT partitions are reduced with tl.max / tl.sum over axis 0 (a tree inside the
    # program); slabs are merged into a running total. Pass 1: the row max M* over partitions.
    m_star = tl.full([ROWS], float("-inf"), tl.float32)
    for p0 in range(0, p_end, KBT):
        pk = p0 + offs_k
        idx = ((pk[:, None] * QB + qb) * BH + bh).to(tl.int64) * BLOCK_M + i0 + offs_r[None, :]
        mk = tl.load(Msum + idx, mask=pk[:, None] < p_end, other=float("-inf"))
        m_star = tl.maximum(m_star, tl.max(mk, 0))
    m_ref = tl.where(m_star == float("-inf"), 0.0, m_star)
    # Pass 2: weights w_p = 2^(m_p - M*) (0 for identity summaries), Z = sum w z, S = sum w s.
    z = tl.zeros([ROWS], tl.float32)
    s = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for p0 in range(0, p_end, KBT):
        pk = p0 + offs_k
        valid = pk[:, None] < p_end
        idx = ((pk[:, None] * QB + qb) * BH + bh).to(tl.int64) * BLOCK_M + i0 + offs_r[None, :]
        mk = tl.load(Msum + idx, mask=valid, other=float("-inf"))
        zk = tl.load(Zsum + idx, mask=valid, other=0.0)
        w = tl.where(zk > 0, tl.exp2(mk - m_ref[None, :]), 0.0)
        z += tl.sum(w * zk, 0)
        sk = tl.load(Ssum + idx[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=valid[:, :, None], other=0.0)
        s += tl.sum(w[:, :, None] * sk, 0)
    out = tl.where(z[:, None] > 0, s / tl.where(z > 0, z, 1.0)[:, None], 0.0)   # zero-guarded s / z
    rows = q0 + qb * BLOCK_M + i0 + offs_r
    row_ok = rows < N
    o_base = Out + b.to(tl.int64) * sob + h.to(tl.int64) * soh
    tl.store(o_base + rows[:, None] * son + offs_d[None, :], out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    if STORE_STATS:
        st = bh.to(tl.int64) * N + rows
        tl.store(Mrow + st, tl.where(z > 0, m_star, float("-inf")), mask=row_ok)
        tl.store(Zrow + st, z, mask=row_ok)


# ------------------------------------------------------------------------------------------------
# Backward: exact recompute of every softmax weight from the saved row stats (m, z).
# ------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["H", "N"])
def _elsa_bwd_pre(Out, dOut, Mrow, Zrow, Delta, L2,
                  sob, soh, son, sdb, sdh, sdn,
                  H, N,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """Delta_i = sum_d dO[i,d] O[i,d];  L2_i = m_i + log2(z_i) (+inf for a row with no visible key)."""
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows < N
    o = tl.load(Out + b.to(tl.int64) * sob + h.to(tl.int64) * soh + rows[:, None] * son + offs_d[None, :],
                mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(dOut + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + rows[:, None] * sdn + offs_d[None, :],
                 mask=ok[:, None], other=0.0).to(tl.float32)
    st = bh.to(tl.int64) * N + rows
    m = tl.load(Mrow + st, mask=ok, other=0.0)
    z = tl.load(Zrow + st, mask=ok, other=0.0)
    # +inf makes 2^(x - L2) = 0 for every key of an all-masked row, so its gradients are exactly 0
    l2 = tl.where(z > 0, m + tl.log2(tl.where(z > 0, z, 1.0)), float("inf"))
    tl.store(Delta + st, tl.sum(o * do, 1), mask=ok)
    tl.store(L2 + st, l2, mask=ok)


@triton.jit
def _dq_tile(acc, q, do, l2, delta, rows, t0, N, qk_scale,
             k_base, v_base, skn, svn, b_base, sbi, sbj, db_base, sdbi,
             HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
             MASK_KEYS: tl.constexpr, MASK_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
             BIAS_GRAD: tl.constexpr, FOLD_Q: tl.constexpr, SCALE_IN_EXP: tl.constexpr,
             DOT_PREC: tl.constexpr):
    offs_n = t0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k_ptrs = k_base + offs_n[:, None] * skn + offs_d[None, :]
    v_ptrs = v_base + offs_n[:, None] * svn + offs_d[None, :]
    if MASK_KEYS:
        kv_mask = offs_n[:, None] < N
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    x = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if HAS_BIAS:
        if not FOLD_Q:
            x = x * qk_scale
        b_mask = (rows[:, None] < N) & (offs_n[None, :] < N)
        bias = tl.load(b_base + rows[:, None] * sbi + offs_n[None, :] * sbj, mask=b_mask, other=0.0)
        x = x + bias.to(tl.float32) * LOG2E
    if MASK_KEYS:
        x = tl.where(offs_n[None, :] < N, x, float("-inf"))
    if MASK_CAUSAL:
        x = tl.where(rows[:, None] >= offs_n[None, :], x, float("-inf"))
    if SCALE_IN_EXP:
        p = tl.exp2(x * qk_scale - l2[:, None])       # exact softmax weights (one FMA)
    else:
        p = tl.exp2(x - l2[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])                    # dL/d(natural-log score)
    if BIAS_GRAD:
        ds_mask = (rows[:, None] < N) & (offs_n[None, :] < N)
        tl.store(db_base + rows[:, None] * sdbi + offs_n[None, :], ds, mask=ds_mask)
    acc += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
    return acc


@triton.jit(do_not_specialize=["H", "N"])
def _elsa_bwd_dq(Q, K, V, dOut, L2, Delta, dQ, Bias, dBias,
                 sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn, sgb, sgh, sgn,
                 sbb, sbh, sbi, sbj,
                 H, N, qk_scale, sm_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr,
                 FOLD_Q: tl.constexpr, SCALE_IN_EXP: tl.constexpr, DOT_PREC: tl.constexpr):
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    r0 = qb * BLOCK_M
    rows = r0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows < N
    q = tl.load(Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + rows[:, None] * sqn + offs_d[None, :],
                mask=ok[:, None], other=0.0)
    do = tl.load(dOut + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + rows[:, None] * sdn + offs_d[None, :],
                 mask=ok[:, None], other=0.0)
    st = bh.to(tl.int64) * N + rows
    l2 = tl.load(L2 + st, mask=ok, other=float("inf"))     # rows >= N: all weights 0
    delta = tl.load(Delta + st, mask=ok, other=0.0)
    qs = q
    if FOLD_Q:
        qs = q * qk_scale
    k_base = K + b.to(tl.int64) * skb + h.to(tl.int64) * skh
    v_base = V + b.to(tl.int64) * svb + h.to(tl.int64) * svh
    b_base = Bias + b.to(tl.int64) * sbb + h.to(tl.int64) * sbh
    db_base = dBias + bh.to(tl.int64) * N * N          # zero-filled fp32 [BH, N, N], only when BIAS_GRAD
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    hi = N
    if CAUSAL:
        hi = tl.minimum(N, r0 + BLOCK_M)
    safe_hi = hi
    if CAUSAL:
        safe_hi = tl.minimum(safe_hi, r0 + 1)
    n_safe = safe_hi // BLOCK_N
    for t in range(0, n_safe):
        acc = _dq_tile(acc, qs, do, l2, delta, rows, t * BLOCK_N, N, qk_scale,
                       k_base, v_base, skn, svn, b_base, sbi, sbj, db_base, N,
                       HEAD_DIM, BLOCK_N, False, False, HAS_BIAS, BIAS_GRAD, FOLD_Q, SCALE_IN_EXP, DOT_PREC)
    for t0 in range(n_safe * BLOCK_N, hi, BLOCK_N):
        acc = _dq_tile(acc, qs, do, l2, delta, rows, t0, N, qk_scale,
                       k_base, v_base, skn, svn, b_base, sbi, sbj, db_base, N,
                       HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_BIAS, BIAS_GRAD, FOLD_Q, SCALE_IN_EXP, DOT_PREC)
    dq = acc * sm_scale
    tl.store(dQ + b.to(tl.int64) * sgb + h.to(tl.int64) * sgh + rows[:, None] * sgn + offs_d[None, :],
             dq.to(dQ.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _dkdv_tile(dk, dv, k, v, cols, i0, N, qk_scale,
               q_base, sqn, do_base, sdn, L2, Delta, st0, b_base, sbi, sbj,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
               MASK_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, FOLD_Q: tl.constexpr,
               SCALE_IN_EXP: tl.constexpr, DOT_PREC: tl.constexpr):
    rows = i0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows < N
    q = tl.load(q_base + rows[:, None] * sqn + offs_d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(do_base + rows[:, None] * sdn + offs_d[None, :], mask=ok[:, None], other=0.0)
    l2 = tl.load(L2 + st0 + rows, mask=ok, other=float("inf"))
    delta = tl.load(Delta + st0 + rows, mask=ok, other=0.0)
    # transposed scores x^T [BN, BM]; k already carries scale*log2e for fp32 (FOLD_Q), else scale here.
    # Keys >= N need no -inf mask: their dK/dV rows are never stored and nothing else reads them.
    xt = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)
    if HAS_BIAS:
        if not FOLD_Q:
            xt = xt * qk_scale
        b_mask = (cols[:, None] < N) & (rows[None, :] < N)
        bias = tl.load(b_base + rows[None, :] * sbi + cols[:, None] * sbj, mask=b_mask, other=0.0)
        xt = xt + bias.to(tl.float32) * LOG2E
    if MASK_CAUSAL:
        xt = tl.where(rows[None, :] >= cols[:, None], xt, float("-inf"))
    if SCALE_IN_EXP:
        pt = tl.exp2(xt * qk_scale - l2[None, :])
    else:
        pt = tl.exp2(xt - l2[None, :])
    dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PREC)
    dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    dst = pt * (dpt - delta[None, :])
    dk += tl.dot(dst.to(q.dtype), q, input_precision=DOT_PREC)
    return dk, dv


@triton.jit(do_not_specialize=["H", "N"])
def _elsa_bwd_dkdv(Q, K, V, dOut, L2, Delta, dK, dV, Bias,
                   sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn,
                   skgb, skgh, skgn, svgb, svgh, svgn,
                   sbb, sbh, sbi, sbj,
                   H, N, qk_scale, sm_scale,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, FOLD_Q: tl.constexpr,
                   SCALE_IN_EXP: tl.constexpr, DOT_PREC: tl.constexpr):
    """One program owns BLOCK_N keys and loops over query tiles: dK, dV without atomics."""
    kb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    c0 = kb * BLOCK_N
    cols = c0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    cok = cols < N
    k = tl.load(K + b.to(tl.int64) * skb + h.to(tl.int64) * skh + cols[:, None] * skn + offs_d[None, :],
                mask=cok[:, None], other=0.0)
    v = tl.load(V + b.to(tl.int64) * svb + h.to(tl.int64) * svh + cols[:, None] * svn + offs_d[None, :],
                mask=cok[:, None], other=0.0)
    ks = k
    if FOLD_Q:
        ks = k * qk_scale                              # fp32: fold scale*log2(e) into K once
    q_base = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    do_base = dOut + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh
    b_base = Bias + b.to(tl.int64) * sbb + h.to(tl.int64) * sbh
    st0 = bh.to(tl.int64) * N
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    lo = 0
    if CAUSAL:
        lo = (c0 // BLOCK_M) * BLOCK_M                # earlier query tiles see none of these keys
        # query tiles starting at or after the block's last key see all of them: no mask
        safe_lo = tl.minimum(tl.cdiv(c0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M, tl.cdiv(N, BLOCK_M) * BLOCK_M)
        for i0 in range(lo, safe_lo, BLOCK_M):
            dk, dv = _dkdv_tile(dk, dv, ks, v, cols, i0, N, qk_scale, q_base, sqn, do_base, sdn,
                                L2, Delta, st0, b_base, sbi, sbj, HEAD_DIM, BLOCK_M, True, HAS_BIAS, FOLD_Q, SCALE_IN_EXP, DOT_PREC)
        lo = safe_lo
    for i0 in range(lo, N, BLOCK_M):
        dk, dv = _dkdv_tile(dk, dv, ks, v, cols, i0, N, qk_scale, q_base, sqn, do_base, sdn,
                            L2, Delta, st0, b_base, sbi, sbj, HEAD_DIM, BLOCK_M, False, HAS_BIAS, FOLD_Q, SCALE_IN_EXP, DOT_PREC)
    dk = dk * sm_scale
    tl.store(dK + b.to(tl.int64) * skgb + h.to(tl.int64) * skgh + cols[:, None] * skgn + offs_d[None, :],
             dk.to(dK.dtype.element_ty), mask=cok[:, None])
    tl.store(dV + b.to(tl.int64) * svgb + h.to(tl.int64) * svgh + cols[:, None] * svgn + offs_d[None, :],
             dv.to(dV.dtype.element_ty), mask=cok[:, None])
