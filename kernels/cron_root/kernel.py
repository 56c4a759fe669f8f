"""Triton kernels for Cron Root attention (causal; local window + strided anchors + relay block means).

Index rules (see ``reference.py`` and the spec), with W = ceil(sqrt(N)) and i the query row:
  local   key j        visible iff  i - W < j <= i
  anchor  key s*W      visible iff  (s + 1) * W <= i          (strictly before the local window)
  relay   block mean r visible iff  (r + 2) * W <= i + 1      (the whole block before the local window)
All three kinds of slot take part in ONE online softmax per query row.

Grouped-query attention: q has H heads, k/v have H // G; query head h reads key/value head h // G in place.
The dK/dV kernels run one program per key/value head and loop over its G query heads, so the gradients of
a shared K/V row (its local, anchor and relay-mean parts) are summed in registers, never through a copy.

Kernels (one idea each):
  _fwd            query-tiled forward: O and the row log-sum-exp (base 2) for the backward.
  _bwd_dq         query-tiled dQ over all three phases; also writes Delta_i = sum_d O*dO and clears the
                  global-slot accumulator that the next launch adds into (no separate zero-fill launch).
  _bwd_global     dK/dV of the *global* slots (anchors, relay means): grid over (slot chunk, query segment,
                  key/value head), fp32 atomic_add into a small [B*Hkv, n_anchor + n_relay, D] buffer (few
                  segments per slot -> low contention).
  _bwd_local      key-block-major dK/dV of the local band (no atomics: each key block owns its rows), whose
                  epilogue adds the global-slot gradients: anchor s*W gets dG[s]; every token of relay block r
                  gets dG_relay[r] / W (the Jacobian of the block mean).

The backward's fp32 scratch is ONE buffer (one allocation per call): Delta [B*H, N] at offset 0, then the
global-slot accumulators dG_K and dG_V, each [B*Hkv, n_slots, D], at dg_off and dg_off + dg_size.

Every loop is split into chunks that need the per-element visibility mask (edges) and chunks every row of
the tile sees entirely (MASKED=False): the mask is pure overhead there, and at large N most chunks are such.
Rows past N are loaded as zeros (q, dO, LSE, Delta = 0), which makes their gradient contributions exactly 0,
so unmasked chunks may include them.

N, W, H, G and the slot counts are runtime ints (and not specialised), so a new length never recompiles; only
tile sizes, the head dim and its column tiles, the dot precision and GROUPED (G > 1: the dK/dV kernels loop over
query heads) are constexpr. The forward covers the head dim with one column tile or two (BLOCK_D2 > 0: D = 80 as
64 + 16 columns, see below); the backward kernels with one block_d(D)-wide tile masked at D.
"""
import triton
import triton.language as tl

_RUNTIME = ["H", "G", "N", "W", "n_anchor", "n_relay", "seg_len", "dg_off", "dg_size"]
_ZERO_BLOCK = tl.constexpr(1024)


# --- forward -------------------------------------------------------------------------------------------------
#
# The head dim is one column tile [0, BLOCK_D) masked at HEAD_DIM (BLOCK_D2 = 0), or two (configs.forward_tiles):
# a full power-of-two tile [0, BLOCK_D) inside D and a narrower one [BLOCK_D, BLOCK_D + BLOCK_D2) masked at
# HEAD_DIM, so D = 80 does 64 + 16 columns of MMA work instead of 128. SPLIT = BLOCK_D2 > 0 is a
# constexpr: with one tile the second tile's values (q2, k2, v2, acc2, offs_d2, d2_ok) are stand-ins that
# nothing reads, and the compiled one-tile kernel is the same as before the split existed.

@triton.jit
def _kv_chunk(row_ok, offs_r, k_base, v_base, k_step, v_step, offs_d, d_ok, offs_d2, d2_ok, MASKED: tl.constexpr,
              SPLIT: tl.constexpr):
    """One chunk of K and V rows (row r at k_base + r*k_step, masked at row_ok if MASKED): (k, v) over columns
    offs_d and, with SPLIT, (k2, v2) over offs_d2 (else k, v again). One tile: the columns are masked at d_ok;
    two: the first tile lies inside D (no column mask), the second is masked at d2_ok."""
    if SPLIT:
        if MASKED:
            ld = row_ok[:, None]
            ld2 = row_ok[:, None] & d2_ok[None, :]
            k = tl.load(k_base + offs_r[:, None] * k_step + offs_d[None, :], mask=ld, other=0.0)
            v = tl.load(v_base + offs_r[:, None] * v_step + offs_d[None, :], mask=ld, other=0.0)
        else:
            ld2 = d2_ok[None, :]
            k = tl.load(k_base + offs_r[:, None] * k_step + offs_d[None, :])
            v = tl.load(v_base + offs_r[:, None] * v_step + offs_d[None, :])
        k2 = tl.load(k_base + offs_r[:, None] * k_step + offs_d2[None, :], mask=ld2, other=0.0)
        v2 = tl.load(v_base + offs_r[:, None] * v_step + offs_d2[None, :], mask=ld2, other=0.0)
    else:
        if MASKED:
            ld = row_ok[:, None] & d_ok[None, :]
        else:
            ld = d_ok[None, :]
        k = tl.load(k_base + offs_r[:, None] * k_step + offs_d[None, :], mask=ld, other=0.0)
        v = tl.load(v_base + offs_r[:, None] * v_step + offs_d[None, :], mask=ld, other=0.0)
        k2 = k
        v2 = v
    return k, v, k2, v2


@triton.jit
def _scores(q, q2, k, k2, qk_scale, PREC: tl.constexpr, SPLIT: tl.constexpr):
    """Scores (log2 domain) of a query tile against a key chunk: q·kᵀ, plus q2·k2ᵀ accumulated into it with
    SPLIT (the second column tile's share of the dot product)."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    if SPLIT:
        s = tl.dot(q2, tl.trans(k2), s, input_precision=PREC)
    return s * qk_scale


@triton.jit
def _fwd_update(acc, acc2, m_i, l_i, s, v, v2, PREC: tl.constexpr, MASKED: tl.constexpr, SPLIT: tl.constexpr):
    """One online-softmax step for scores s (log2 domain, masked entries -inf); with SPLIT the second column
    tile's accumulator acc2 takes the same P and the same rescaling."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        # a row with no visible slot yet keeps m = -inf; shift by 0 then, so exp2 never sees (-inf) - (-inf)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new  # every row has a finite score in this chunk
    p = tl.exp2(s - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    # P is rounded to the value dtype before the PV product, as in FlashAttention
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    if SPLIT:
        acc2 = acc2 * alpha[:, None] + tl.dot(p.to(v2.dtype), v2, input_precision=PREC)
    return acc, acc2, m_new, l_i


@triton.jit
def _fwd_band(acc, acc2, m_i, l_i, q, q2, k_base, v_base, skn, svn, offs_m, offs_d, d_ok, offs_d2, d2_ok, c_lo, c_hi,
              i_last, W, qk_scale, BLOCK_N: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr,
              SPLIT: tl.constexpr):
    """Local keys c_lo .. c_hi-1 (contiguous rows of K/V)."""
    for start in range(c_lo, c_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k, v, k2, v2 = _kv_chunk(offs_n <= i_last, offs_n, k_base, v_base, skn, svn, offs_d, d_ok, offs_d2, d2_ok,
                                 MASKED, SPLIT)
        s = _scores(q, q2, k, k2, qk_scale, PREC, SPLIT)
        if MASKED:
            vis = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] + W > offs_m[:, None])
            s = tl.where(vis, s, float("-inf"))
        acc, acc2, m_i, l_i = _fwd_update(acc, acc2, m_i, l_i, s, v, v2, PREC, MASKED, SPLIT)
    return acc, acc2, m_i, l_i


@triton.jit
def _fwd_gather(acc, acc2, m_i, l_i, q, q2, k_base, v_base, k_step, v_step, c_lo, c_hi, n_valid, offs_m, offs_d, d_ok,
                offs_d2, d2_ok, W, qk_scale, A: tl.constexpr, B: tl.constexpr, BLOCK_S: tl.constexpr,
                PREC: tl.constexpr, MASKED: tl.constexpr, SPLIT: tl.constexpr):
    """Gathered slots s in [c_lo, c_hi): key row at k_base + s*k_step, visible iff (s + A) * W <= i + B
    (anchors: A=1, B=0, rows s*W of K; relay: A=2, B=1, rows s of the relay buffer)."""
    for start in range(c_lo, c_hi, BLOCK_S):
        offs_s = start + tl.arange(0, BLOCK_S)
        k, v, k2, v2 = _kv_chunk(offs_s < n_valid, offs_s, k_base, v_base, k_step, v_step, offs_d, d_ok, offs_d2,
                                 d2_ok, MASKED, SPLIT)
        s = _scores(q, q2, k, k2, qk_scale, PREC, SPLIT)
        if MASKED:
            vis = (offs_s[None, :] + A) * W <= offs_m[:, None] + B
            s = tl.where(vis, s, float("-inf"))
        acc, acc2, m_i, l_i = _fwd_update(acc, acc2, m_i, l_i, s, v, v2, PREC, MASKED, SPLIT)
    return acc, acc2, m_i, l_i


@triton.jit
def _band_split(i_first, i_last, W, BLOCK: tl.constexpr):
    """Local band of a query tile: keys lo..i_last on a chunk grid from lo; chunks [mid_lo, mid_hi) are seen
    entirely by every row (keys in [i_last - W + 1, i_first])."""
    lo = tl.maximum(i_first - W + 1, 0)
    full_lo = tl.maximum(i_last - W + 1, 0)
    k1 = tl.cdiv(full_lo - lo, BLOCK)
    k2 = tl.maximum((i_first - lo + 1) // BLOCK, k1)
    return lo, lo + k1 * BLOCK, lo + k2 * BLOCK


@triton.jit
def _kv_bases(bh, K, V, RK, RV, skb, skh, svb, svh, H, G, n_relay, HEAD_DIM: tl.constexpr):
    """Query (batch, head) bh -> b, h and the bases of its key/value head h // G in K, V and the relay
    buffers (ours: contiguous [B, H // G, n_relay, HEAD_DIM])."""
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = ((bh % H) // G).to(tl.int64)
    rel = (bh // G).to(tl.int64) * n_relay * HEAD_DIM        # bh // G = b * (H // G) + h // G
    return b, h, K + b * skb + hk * skh, V + b * svb + hk * svh, RK + rel, RV + rel


@triton.jit(do_not_specialize=_RUNTIME)
def _fwd(Q, K, V, RK, RV, O, LSE,
         sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
         H, G, N, W, n_relay, qk_scale,
         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_M: tl.constexpr,
         BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, PREC: tl.constexpr):
    SPLIT: tl.constexpr = BLOCK_D2 > 0
    # later query tiles see more anchors/relays: launch them first so the tail of the grid is short
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b, h, k_base, v_base, rk_base, rv_base = _kv_bases(bh, K, V, RK, RV, skb, skh, svb, svh, H, G, n_relay,
                                                       HEAD_DIM)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < N
    q_rows = Q + b * sqb + h * sqh + offs_m[:, None] * sqn
    if SPLIT:
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        d2_ok = offs_d2 < HEAD_DIM
        q = tl.load(q_rows + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        q2 = tl.load(q_rows + offs_d2[None, :], mask=row_ok[:, None] & d2_ok[None, :], other=0.0)
        acc2 = tl.zeros([BLOCK_M, BLOCK_D2], tl.float32)
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        offs_d2, d2_ok, q2 = offs_d, d_ok, q          # stand-ins, never read

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if not SPLIT:
        acc2 = acc                                    # a stand-in, never read
    i_first = pid_m * BLOCK_M
    i_last = tl.minimum(i_first + BLOCK_M, N) - 1

    # Phase 1, local band: keys ls(i_first) .. i_last, one contiguous run of <= W + BLOCK_M - 1 keys
    lo, mid_lo, mid_hi = _band_split(i_first, i_last, W, BLOCK_N)
    acc, acc2, m_i, l_i = _fwd_band(acc, acc2, m_i, l_i, q, q2, k_base, v_base, skn, svn, offs_m, offs_d, d_ok,
                                    offs_d2, d2_ok, lo, mid_lo, i_last, W, qk_scale, BLOCK_N, PREC, True, SPLIT)
    acc, acc2, m_i, l_i = _fwd_band(acc, acc2, m_i, l_i, q, q2, k_base, v_base, skn, svn, offs_m, offs_d, d_ok,
                                    offs_d2, d2_ok, mid_lo, mid_hi, i_last, W, qk_scale, BLOCK_N, PREC, False, SPLIT)
    acc, acc2, m_i, l_i = _fwd_band(acc, acc2, m_i, l_i, q, q2, k_base, v_base, skn, svn, offs_m, offs_d, d_ok,
                                    offs_d2, d2_ok, mid_hi, i_last + 1, i_last, W, qk_scale, BLOCK_N, PREC, True, SPLIT)

    # Phase 2, strided anchors s*W: the tile's LAST row bounds the count, its FIRST row the unmasked part
    n_anc = i_last // W
    n_full = (i_first // W) // BLOCK_S * BLOCK_S
    acc, acc2, m_i, l_i = _fwd_gather(acc, acc2, m_i, l_i, q, q2, k_base, v_base, W * skn, W * svn, 0, n_full, n_anc,
                                      offs_m, offs_d, d_ok, offs_d2, d2_ok, W, qk_scale, 1, 0, BLOCK_S, PREC, False,
                                      SPLIT)
    acc, acc2, m_i, l_i = _fwd_gather(acc, acc2, m_i, l_i, q, q2, k_base, v_base, W * skn, W * svn, n_full, n_anc,
                                      n_anc, offs_m, offs_d, d_ok, offs_d2, d2_ok, W, qk_scale, 1, 0, BLOCK_S, PREC,
                                      True, SPLIT)

    # Phase 3, relay block means (n_relay == 0 when relay is off: both loops are empty)
    n_rel = tl.minimum(tl.maximum((i_last + 1) // W - 1, 0), n_relay)
    n_full = tl.minimum(tl.maximum((i_first + 1) // W - 1, 0), n_relay) // BLOCK_S * BLOCK_S
    acc, acc2, m_i, l_i = _fwd_gather(acc, acc2, m_i, l_i, q, q2, rk_base, rv_base, HEAD_DIM, HEAD_DIM, 0, n_full,
                                      n_rel, offs_m, offs_d, d_ok, offs_d2, d2_ok, W, qk_scale, 2, 1, BLOCK_S, PREC,
                                      False, SPLIT)
    acc, acc2, m_i, l_i = _fwd_gather(acc, acc2, m_i, l_i, q, q2, rk_base, rv_base, HEAD_DIM, HEAD_DIM, n_full, n_rel,
                                      n_rel, offs_m, offs_d, d_ok, offs_d2, d2_ok, W, qk_scale, 2, 1, BLOCK_S, PREC,
                                      True, SPLIT)

    # every real row sees its own diagonal, so l >= 1 there; rows past N may have l == 0 and are not stored
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    o_rows = O + b * sob + h * soh + offs_m[:, None] * son
    if SPLIT:
        tl.store(o_rows + offs_d[None, :], o.to(O.dtype.element_ty), mask=row_ok[:, None])
        o2 = acc2 / l_safe[:, None]
        tl.store(o_rows + offs_d2[None, :], o2.to(O.dtype.element_ty), mask=row_ok[:, None] & d2_ok[None, :])
    else:
        tl.store(o_rows + offs_d[None, :], o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + bh.to(tl.int64) * N + offs_m, m_i + tl.log2(l_safe), mask=row_ok)


# --- backward: dQ (query-tiled, all phases) --------------------------------------------------------------------

@triton.jit
def _dq_band(dq, q, do, lse, delta, k_base, v_base, skn, svn, offs_m, offs_d, d_ok, c_lo, c_hi, i_last, W,
             qk_scale, BLOCK_N: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr):
    for start in range(c_lo, c_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        if MASKED:
            ld = (offs_n <= i_last)[:, None] & d_ok[None, :]
        else:
            ld = d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=ld, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=ld, other=0.0)
        p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale - lse[:, None])
        if MASKED:
            vis = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] + W > offs_m[:, None])
            p = tl.where(vis, p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PREC) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    return dq


@triton.jit
def _dq_gather(dq, q, do, lse, delta, k_base, v_base, k_step, v_step, c_lo, c_hi, n_valid, offs_m, offs_d, d_ok,
               W, qk_scale, A: tl.constexpr, B: tl.constexpr, BLOCK_S: tl.constexpr, PREC: tl.constexpr,
               MASKED: tl.constexpr):
    for start in range(c_lo, c_hi, BLOCK_S):
        offs_s = start + tl.arange(0, BLOCK_S)
        if MASKED:
            ld = (offs_s < n_valid)[:, None] & d_ok[None, :]
        else:
            ld = d_ok[None, :]
        k = tl.load(k_base + offs_s[:, None] * k_step + offs_d[None, :], mask=ld, other=0.0)
        v = tl.load(v_base + offs_s[:, None] * v_step + offs_d[None, :], mask=ld, other=0.0)
        p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale - lse[:, None])
        if MASKED:
            vis = (offs_s[None, :] + A) * W <= offs_m[:, None] + B
            p = tl.where(vis, p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PREC) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    return dq


@triton.jit(do_not_specialize=_RUNTIME)
def _bwd_dq(Q, K, V, RK, RV, O, DO, DQ, LSE, SCRATCH,
            sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sdob, sdoh, sdon, sdqb, sdqh, sdqn,
            H, G, N, W, n_relay, dg_off, dg_size, qk_scale, scale,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_S: tl.constexpr, PREC: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b, h, k_base, v_base, rk_base, rv_base = _kv_bases(bh, K, V, RK, RV, skb, skh, svb, svh, H, G, n_relay,
                                                       HEAD_DIM)
    DELTA = SCRATCH

    # clear this program's share of the global-slot accumulators (dG_K, dG_V: 2 * dg_size floats from
    # dg_off); _bwd_global, the next launch on the stream, adds into them
    n_prog = tl.num_programs(0) * tl.num_programs(1)
    per = tl.cdiv(2 * dg_size, n_prog)
    z_lo = (bh * tl.num_programs(0) + tl.program_id(0)) * per
    z_hi = tl.minimum(z_lo + per, 2 * dg_size)
    for z in range(z_lo, z_hi, _ZERO_BLOCK):
        offs_z = z + tl.arange(0, _ZERO_BLOCK)
        tl.store(SCRATCH + dg_off + offs_z.to(tl.int64), tl.zeros([_ZERO_BLOCK], tl.float32), mask=offs_z < z_hi)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < N
    tile_ok = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :], mask=tile_ok, other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdon + offs_d[None, :], mask=tile_ok, other=0.0)
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], mask=tile_ok, other=0.0)
    # Delta from the *stored* O (input dtype), as the FA2 backward expects; the dK/dV kernels read it back
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(LSE + bh.to(tl.int64) * N + offs_m, mask=row_ok, other=0.0)
    tl.store(DELTA + bh.to(tl.int64) * N + offs_m, delta, mask=row_ok)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    i_first = pid_m * BLOCK_M
    i_last = tl.minimum(i_first + BLOCK_M, N) - 1

    lo, mid_lo, mid_hi = _band_split(i_first, i_last, W, BLOCK_N)
    dq = _dq_band(dq, q, do, lse, delta, k_base, v_base, skn, svn, offs_m, offs_d, d_ok, lo, mid_lo, i_last, W,
                  qk_scale, BLOCK_N, PREC, True)
    dq = _dq_band(dq, q, do, lse, delta, k_base, v_base, skn, svn, offs_m, offs_d, d_ok, mid_lo, mid_hi, i_last,
                  W, qk_scale, BLOCK_N, PREC, False)
    dq = _dq_band(dq, q, do, lse, delta, k_base, v_base, skn, svn, offs_m, offs_d, d_ok, mid_hi, i_last + 1,
                  i_last, W, qk_scale, BLOCK_N, PREC, True)

    n_anc = i_last // W
    n_full = (i_first // W) // BLOCK_S * BLOCK_S
    dq = _dq_gather(dq, q, do, lse, delta, k_base, v_base, W * skn, W * svn, 0, n_full, n_anc, offs_m, offs_d,
                    d_ok, W, qk_scale, 1, 0, BLOCK_S, PREC, False)
    dq = _dq_gather(dq, q, do, lse, delta, k_base, v_base, W * skn, W * svn, n_full, n_anc, n_anc, offs_m, offs_d,
                    d_ok, W, qk_scale, 1, 0, BLOCK_S, PREC, True)

    n_rel = tl.minimum(tl.maximum((i_last + 1) // W - 1, 0), n_relay)
    n_full = tl.minimum(tl.maximum((i_first + 1) // W - 1, 0), n_relay) // BLOCK_S * BLOCK_S
    dq = _dq_gather(dq, q, do, lse, delta, rk_base, rv_base, HEAD_DIM, HEAD_DIM, 0, n_full, n_rel, offs_m, offs_d,
                    d_ok, W, qk_scale, 2, 1, BLOCK_S, PREC, False)
    dq = _dq_gather(dq, q, do, lse, delta, rk_base, rv_base, HEAD_DIM, HEAD_DIM, n_full, n_rel, n_rel, offs_m,
                    offs_d, d_ok, W, qk_scale, 2, 1, BLOCK_S, PREC, True)

    dq = dq * scale
    tl.store(DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqn + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=tile_ok)


# --- backward: dK/dV (key-major: global slots, then the local band with the scatter epilogue) -----------------

@triton.jit
def _dkv_chunk(dk, dv, k, v, q_head, do_head, lse_head, delta_head, sqn, sdon, offs_q, offs_k, offs_d, d_ok, q_end, W,
               thr, qk_scale, LOCAL: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr):
    """dK/dV of a key tile (rows = keys) from one chunk of query rows offs_q of one query head (loads masked
    at q_end). Visibility: LOCAL -> key j seen by i in [j, j+W); else slot seen by i >= thr[slot]."""
    q_ok = offs_q < q_end
    tq = q_ok[:, None] & d_ok[None, :]
    q = tl.load(q_head + offs_q[:, None] * sqn + offs_d[None, :], mask=tq, other=0.0)
    do = tl.load(do_head + offs_q[:, None] * sdon + offs_d[None, :], mask=tq, other=0.0)
    # zero LSE/Delta past the end: with q = dO = 0 there, those columns contribute exactly 0
    lse = tl.load(lse_head + offs_q, mask=q_ok, other=0.0)
    delta = tl.load(delta_head + offs_q, mask=q_ok, other=0.0)
    pT = tl.exp2(tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale - lse[None, :])
    if MASKED:
        if LOCAL:
            vis = (offs_q[None, :] >= offs_k[:, None]) & (offs_q[None, :] < offs_k[:, None] + W)
        else:
            vis = thr[:, None] <= offs_q[None, :]
        pT = tl.where(vis, pT, 0.0)
    dv += tl.dot(pT.to(do.dtype), do, input_precision=PREC)
    dsT = pT * (tl.dot(v, tl.trans(do), input_precision=PREC) - delta[None, :])
    dk += tl.dot(dsT.to(q.dtype), q, input_precision=PREC)
    return dk, dv


@triton.jit
def _dkv_queries(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqh, sdoh, sqn, sdon, G, N, offs_k, offs_d,
                 d_ok, c_lo, c_hi, q_end, W, thr, qk_scale, LOCAL: tl.constexpr, GROUPED: tl.constexpr,
                 BLOCK_Q: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr):
    """Accumulate dK/dV of a key tile over queries c_lo .. c_hi-1 of each of the G query heads that share its
    key/value head: head j's rows at q_base + j*sqh (dO likewise), its LSE/Delta at lse_base/delta_base + j*N.
    GROUPED (G > 1): one flat loop over (head, query chunk), since a nested head loop keeps more values live
    and spills on sm_90; otherwise the plain query loop."""
    if GROUPED:
        n_chunks = tl.cdiv(tl.maximum(c_hi - c_lo, 0), BLOCK_Q)
        for it in range(0, G * n_chunks):
            j = it // n_chunks
            offs_q = c_lo + (it - j * n_chunks) * BLOCK_Q + tl.arange(0, BLOCK_Q)
            j = j.to(tl.int64)
            dk, dv = _dkv_chunk(dk, dv, k, v, q_base + j * sqh, do_base + j * sdoh, lse_base + j * N,
                                delta_base + j * N, sqn, sdon, offs_q, offs_k, offs_d, d_ok, q_end, W, thr, qk_scale,
                                LOCAL, PREC, MASKED)
    else:
        for start in range(c_lo, c_hi, BLOCK_Q):
            dk, dv = _dkv_chunk(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqn, sdon,
                                start + tl.arange(0, BLOCK_Q), offs_k, offs_d, d_ok, q_end, W, thr, qk_scale, LOCAL,
                                PREC, MASKED)
    return dk, dv


@triton.jit(do_not_specialize=_RUNTIME)
def _bwd_global(Q, K, V, RK, RV, DO, LSE, SCRATCH,
                sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon,
                H, G, N, W, n_anchor, n_relay, seg_len, dg_off, dg_size, qk_scale, scale,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr,
                PREC: tl.constexpr, GROUPED: tl.constexpr):
    chunk = tl.program_id(0)
    seg = tl.program_id(1)
    bhk = tl.program_id(2)                  # (batch, key/value head)
    H_kv = H // G
    b = (bhk // H_kv).to(tl.int64)
    hk = (bhk % H_kv).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    n_anchor_chunks = tl.cdiv(n_anchor, BLOCK_G)
    # slot chunk -> key rows, first visible query of each slot (thresholds grow with the slot index), DG row
    if chunk < n_anchor_chunks:
        g = chunk * BLOCK_G + tl.arange(0, BLOCK_G)
        g_last = tl.minimum(chunk * BLOCK_G + BLOCK_G, n_anchor) - 1
        slot_ok = g < n_anchor
        ld = slot_ok[:, None] & d_ok[None, :]
        k = tl.load(K + b * skb + hk * skh + (g * W)[:, None] * skn + offs_d[None, :], mask=ld, other=0.0)
        v = tl.load(V + b * svb + hk * svh + (g * W)[:, None] * svn + offs_d[None, :], mask=ld, other=0.0)
        thr = (g + 1) * W
        first_q = (chunk * BLOCK_G + 1) * W
        all_q = (g_last + 1) * W
        out_row = g
    else:
        r0 = (chunk - n_anchor_chunks) * BLOCK_G
        g = r0 + tl.arange(0, BLOCK_G)
        g_last = tl.minimum(r0 + BLOCK_G, n_relay) - 1
        slot_ok = g < n_relay
        ld = slot_ok[:, None] & d_ok[None, :]
        rbase = bhk.to(tl.int64) * n_relay * HEAD_DIM
        k = tl.load(RK + rbase + g[:, None] * HEAD_DIM + offs_d[None, :], mask=ld, other=0.0)
        v = tl.load(RV + rbase + g[:, None] * HEAD_DIM + offs_d[None, :], mask=ld, other=0.0)
        thr = (g + 2) * W - 1
        first_q = (r0 + 2) * W - 1
        all_q = (g_last + 2) * W - 1
        out_row = n_anchor + g
    # queries before the chunk's first threshold see none of it; from all_q on they see every valid slot
    # (invalid slots are zero rows whose results are never stored)
    q_lo = tl.maximum(seg * seg_len, first_q)
    q_hi = tl.minimum((seg + 1) * seg_len, N)
    if q_lo < q_hi:
        dk = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        q_mid = tl.minimum(q_lo + tl.cdiv(tl.maximum(all_q - q_lo, 0), BLOCK_Q) * BLOCK_Q, q_hi)
        # the G query heads h = hk*G + j that share this key/value head: their gradients sum here
        h0 = hk * G
        q_base = Q + b * sqb + h0 * sqh
        do_base = DO + b * sdob + h0 * sdoh
        lse_base = LSE + (bhk * G).to(tl.int64) * N          # bhk * G = b * H + h0
        delta_base = SCRATCH + (bhk * G).to(tl.int64) * N
        dk, dv = _dkv_queries(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqh, sdoh, sqn, sdon, G, N, g,
                              offs_d, d_ok, q_lo, q_mid, q_hi, W, thr, qk_scale, False, GROUPED, BLOCK_Q, PREC, True)
        dk, dv = _dkv_queries(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqh, sdoh, sqn, sdon, G, N, g,
                              offs_d, d_ok, q_mid, q_hi, q_hi, W, thr, qk_scale, False, GROUPED, BLOCK_Q, PREC, False)
        dg_k = SCRATCH + dg_off + bhk.to(tl.int64) * (n_anchor + n_relay) * HEAD_DIM
        dst = out_row[:, None] * HEAD_DIM + offs_d[None, :]
        # few query segments per slot, so contention on these fp32 atomics is low
        tl.atomic_add(dg_k + dst, dk * scale, mask=ld)
        tl.atomic_add(dg_k + dg_size + dst, dv, mask=ld)


@triton.jit(do_not_specialize=_RUNTIME)
def _bwd_local(Q, K, V, DO, LSE, SCRATCH, DK, DV,
               sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon,
               sdkb, sdkh, sdkn, sdvb, sdvh, sdvn,
               H, G, N, W, n_anchor, n_relay, dg_off, dg_size, qk_scale, scale, inv_w,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
               PREC: tl.constexpr, GROUPED: tl.constexpr):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)                  # (batch, key/value head)
    H_kv = H // G
    b = (bhk // H_kv).to(tl.int64)
    hk = (bhk % H_kv).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    key_ok = offs_n < N
    tk = key_ok[:, None] & d_ok[None, :]
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :], mask=tk, other=0.0)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :], mask=tk, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    # key j is local to queries j .. j+W-1: the tile's queries form one run of <= BLOCK_N + W - 1 rows, of which
    # rows [j_first + BLOCK_N - 1, j_first + W) see every key of the tile
    j_first = pid_n * BLOCK_N
    q_hi = tl.minimum(j_first + BLOCK_N - 1 + W, N)
    k1 = tl.cdiv(BLOCK_N - 1, BLOCK_Q)
    k2 = tl.maximum(W // BLOCK_Q, k1)
    mid_lo = tl.minimum(j_first + k1 * BLOCK_Q, q_hi)
    mid_hi = tl.minimum(j_first + k2 * BLOCK_Q, q_hi)
    # the G query heads h = hk*G + j that share this key/value head: their gradients sum here
    h0 = hk * G
    q_base = Q + b * sqb + h0 * sqh
    do_base = DO + b * sdob + h0 * sdoh
    lse_base = LSE + (bhk * G).to(tl.int64) * N              # bhk * G = b * H + h0
    delta_base = SCRATCH + (bhk * G).to(tl.int64) * N
    dk, dv = _dkv_queries(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqh, sdoh, sqn, sdon, G, N, offs_n,
                          offs_d, d_ok, j_first, mid_lo, q_hi, W, offs_n, qk_scale, True, GROUPED, BLOCK_Q, PREC, True)
    dk, dv = _dkv_queries(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqh, sdoh, sqn, sdon, G, N, offs_n,
                          offs_d, d_ok, mid_lo, mid_hi, q_hi, W, offs_n, qk_scale, True, GROUPED, BLOCK_Q, PREC, False)
    dk, dv = _dkv_queries(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqh, sdoh, sqn, sdon, G, N, offs_n,
                          offs_d, d_ok, mid_hi, q_hi, q_hi, W, offs_n, qk_scale, True, GROUPED, BLOCK_Q, PREC, True)
    dk = dk * scale

    # epilogue: gradients of the global slots that are copies (anchors) or means (relay) of these rows,
    # already summed over the group by _bwd_global
    dg_k = SCRATCH + dg_off + bhk.to(tl.int64) * (n_anchor + n_relay) * HEAD_DIM
    blk = offs_n // W
    is_anchor = key_ok & (offs_n % W == 0) & (blk < n_anchor)
    src = blk[:, None] * HEAD_DIM + offs_d[None, :]
    m_a = is_anchor[:, None] & d_ok[None, :]
    dk += tl.load(dg_k + src, mask=m_a, other=0.0)
    dv += tl.load(dg_k + dg_size + src, mask=m_a, other=0.0)
    in_relay = key_ok & (blk < n_relay)
    src = (n_anchor + blk)[:, None] * HEAD_DIM + offs_d[None, :]
    m_r = in_relay[:, None] & d_ok[None, :]
    dk += tl.load(dg_k + src, mask=m_r, other=0.0) * inv_w
    dv += tl.load(dg_k + dg_size + src, mask=m_r, other=0.0) * inv_w

    tl.store(DK + b * sdkb + hk * sdkh + offs_n[:, None] * sdkn + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=tk)
    tl.store(DV + b * sdvb + hk * sdvh + offs_n[:, None] * sdvn + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=tk)
