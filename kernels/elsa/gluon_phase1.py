"""ELSA's float32 phase 1 on sm_90's tensor cores: tf32x3 products by warpgroup MMA (wgmma), written in Gluon.

Triton's tf32x3 dots keep hi/lo copies of every operand in registers, so its float32 phase 1 at D = 128 runs on
32 x 32 mma.sync tiles (every 64-row tile spills: kernels/elsa/NOTES.md) at ~40 TFLOP/s, 1.09x efficient
attention's time at 16K on the H200. Here the operands live in shared memory, where wgmma reads them:

- Q (the scale folded in, as the Triton kernel folds it) is split once into hi and lo; K and V tiles are loaded,
  and the tensor core reads a float32 operand as tf32 by dropping its low 13 bits, so a raw tile is its own hi
  part (measured: the same products as an explicit x & ~0x1fff, results/dev/elsa/fp32_on_wgmma_h200.json); only
  lo = x - hi is computed and stored beside it. V's tiles are stored keys-contiguous (tf32 wgmma takes its B
  operand K-major only), P's hi and lo come from registers. V's rows are stored in the order of P's columns as
  the S accumulator leaves them in a thread's registers (_pv_order), so P is the A operand as it lies; the plain
  conversion to the operand's layout took ~100 shuffles and selects a tile (0.97-0.98x the time at D = 128,
  0.88-0.94x at D = 64: results/dev/elsa/fp32_pv_order_h200.json). The producer loads V in that order, a thread
  holding 8 consecutive positions of one head-dim column, so its stores into the keys-contiguous buffer are 16 bytes
  and free of bank conflicts; loaded as K is (4 columns of one key a thread) they were 4-byte stores,
  bank-conflicted (15.3 wavefronts a store instruction, 5.8 now), and held the kernel at 0.80 of efficient's time at
  D = 128 (now 0.43; the tensor pipe 37 -> 69 % busy at 16K: results/dev/elsa/fp32_v_stores_h200.json).
- S = Qh Kh^T + Qh Kl^T + Ql Kh^T and P V the same way (lo x lo is below float32's rounding). K's raw rows and
  its lo rows lie in one buffer, so the first two are one wgmma a K step, Qh [Kh; Kl]^T (N = 2 x BLOCK_N: Q's
  operand read from shared memory once for both), and Ql Kh^T another on the raw rows; P V is three.
- The tensor core's float32 accumulation truncates: chained over a whole row of tiles it biases the sum (relative
  error 3e-5 at 4K keys, 1.2e-4 at 16K in the probe), and all three products chained over D = 128 put S's at 2e-6.
  So each tile's P V goes to a fresh accumulator, and each of S's products to its own (Qh Kh^T and Qh Kl^T the two
  column halves of one), chained over D only; the CUDA cores add them, rounding to nearest, so the small lo
  products never add into a large truncating sum. Against S by 32-column D-chunks of all three products (12
  chained each, four accumulators), which this replaced: relative RMS error 1.0-1.5e-6 against 1.1-1.8e-6 at
  D = 128 and 1.6-1.7e-6 against 2.1-2.2e-6 at D = 64; 0.95-0.96x the time at D = 128 (a third fewer wgmmas, a
  fifth less of S's operand traffic), 0.98-1.01x at D = 64 (results/dev/elsa/fp32_producer_warpgroup_h200.json).
- Three warpgroups a CTA (gl.warp_specialize): a producer loads each K tile, splits it and stores its raw and lo
  parts into K's ring (two buffers), then V's into V's (one buffer at D = 128, where shared memory is full; two at
  D = 64), each slot's ready / empty mbarriers handing it over; two consumers of 64 query rows each (128 a CTA)
  share every tile and only issue the wgmmas, wait and run the softmax. Before, the same two warpgroups loaded and
  stored the tiles themselves between their GEMMs (the next K during S's products), meeting at two thread barriers
  a tile: their warps waited most on the shared-memory store queue and on the loads (Nsight Compute, kernels/elsa/
  NOTES.md). Moved to a producer, 0.85-0.88x that kernel's time at D = 64 and 0.96-0.98x at D = 128
  (results/dev/elsa/fp32_producer_warpgroup_h200.json); FA3's ping-pong of the consumers' GEMMs on top lost 6-7 %
  at D = 128, K in one buffer and V in two 1-3 %.
  The consumers index Q's and V's buffers by a zero the compiler cannot fold (_zero_of), so the wgmmas' shared-
  memory descriptors are rebuilt every tile instead of hoisted out of the loop, where at D = 128 they overflowed
  the consumers' registers (30 spilled, ~10 local loads a tile in front of the wgmmas; Nsight Compute had those
  loads as the consumers' top stall): 0.93-0.94x the time at D = 128, nothing spills in the consumers.
  With Q's hi and lo resident a CTA holds a SM alone (shared memory and registers), so ELSA's plan fits its q-chunks
  to whole waves of one program a SM (config._partitions' one_cta_per_sm).

It writes exactly what the Triton phase 1 (kernel.py's _elsa_phase1) writes for a float32 output: (m, z) to the
summary slots and the partition's sum s to the output rows (partition 0) or to slot part - 1 of S, or with one
partition (FINAL) the output and lse; its arguments are _elsa_phase1's, so the host swaps the kernel only.
"""
from __future__ import annotations

import torch

from .._gluon_core import GLUON_VERSION, HAS_GLUON, gluon_on  # noqa: F401 (GLUON_VERSION: compile_check reads it here)
from .kernel import phase1_block

# what the kernel takes, and where ELSA's plan takes it (from MIN_WORK). CUDA-graph time over efficient's at B = 1,
# H = 8 (results/dev/elsa/fp32_v_stores_h200.json): D = 128 0.43 / 0.43 at 4K / 16K, causal 16K 0.48; D = 64
# 0.30 / 0.34 (the Triton phase 1, fp32_phase1_prefetch_h200.json: D = 128 1.25 / 1.10, causal 1.17; D = 64 1.01 / 0.79)
HEAD_DIMS = (64, 128)
BLOCK_M = 128               # two consumer warpgroups of 64 rows
NUM_WARPS = 4               # the launch's: the default partition (consumer 0); consumer 1 and the producer are workers
K_STAGES = 2                # K's ring: the next tile stored while this one's S products run
V_STAGES = {64: 2, 128: 1}  # V's: one at D = 128 (224 KB of shared memory with Q's hi and lo and K's two buffers)
# (consumer 1, producer) registers a thread; consumer 0, the default partition, gets what the launch's 168 x 384 leave,
# 208. At D = 128 nothing spills; at D = 64 the producer reloads one value once a tile (8 bytes of stack). (224, 64)
# ran 1-4 % slower at D = 128 (fp32_v_stores_h200.json), (216, 72) within 1 % before V's stores changed
# (fp32_pv_order_h200.json); with ping-pong this split ran 0.95-0.98x the time of (208, 96)
# (fp32_producer_warpgroup_h200.json)
REGS = (216, 80)
# BLOCK_N per head dim: Q's hi and lo, K's and V's rings with their lo parts, in shared memory (<= 227 KB: 224 at
# D = 128)
TILES = {64: 64, 128: 32}
# ELSA takes this kernel from this much work (B*Hq * Nq * Nk * D): below the smallest call measured, ViT-T's layer at
# 224 pixels (batch 8, 3 heads, 197 tokens, D = 64: 2^25.8), where it ran 0.49 of efficient's time in CUDA graphs
# against the Triton phase 1's 0.72 (eager, host-bound, 0.56-0.61 against 0.53-0.67); at 2^29-2^30.6 0.29-0.39
# against 0.64-0.69 at D = 64 and 0.83 against 1.18 at D = 128 (results/dev/elsa/fp32_min_work_h200.json)
MIN_WORK = 2**25


def eligible(q) -> bool:
    """Whether this kernel can run a call with this q: float32, a head dim of HEAD_DIMS, on a device the Gluon core's
    code runs on (gluon_core.gluon_on; its loads take any strides but the last, which ELSA's host makes 1)."""
    return q.dtype == torch.float32 and q.shape[-1] in HEAD_DIMS and gluon_on(q.device)


if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from .._gluon_core import released

    _K_STAGES = gl.constexpr(K_STAGES)      # (a Gluon kernel reads globals only as constexprs)
    _V_STAGES_64 = gl.constexpr(V_STAGES[64])
    _V_STAGES_128 = gl.constexpr(V_STAGES[128])
    _CONSUMER_REGS = gl.constexpr(REGS[0])
    _PRODUCER_REGS = gl.constexpr(REGS[1])

    @gluon.jit
    def _lo(x):
        """x minus its tf32 part (the low 13 bits of the mantissa cleared): exact in float32."""
        return x - (x.to(gl.int32, bitcast=True) & -8192).to(gl.float32, bitcast=True)

    @gluon.jit
    def _rows(base, rows, cols, row_stride, n_rows):
        """The [rows, cols] block at base (columns contiguous), rows >= n_rows read as 0."""
        return gl.load(base + rows[:, None] * row_stride + cols[None, :], mask=(rows < n_rows)[:, None], other=0.0)

    @gluon.jit
    def _pv_order(x):
        """x [R, N] with its columns (keys) reordered in each 8 as 0 2 4 6 1 3 5 7, in registers only (a reshape
        and a permute move nothing). A thread's accumulator registers hold S's columns 2t and 2t + 1 of every 8,
        the tf32 A operand's its columns t and t + 4: P in this order is the A operand as it lies, where the plain
        conversion took ~100 shuffles and selects a tile. The producer loads V's rows in the same order (its keys_v)."""
        R: gl.constexpr = x.shape[0]
        N: gl.constexpr = x.shape[1]
        return gl.reshape(gl.permute(gl.reshape(x, [R, N // 8, 4, 2]), (0, 1, 3, 2)), [R, N])

    @gluon.jit
    def _zero_of(i):
        """0 for any tile index i (< 2^30), as a value the compiler cannot prove constant. Added to the index of a
        shared-memory buffer the loop reads every tile, it keeps LLVM from hoisting the wgmmas' descriptors of that
        buffer (one a K step) out of the loop: hoisted, at D = 128 they overflowed the consumers' registers, and
        ~10 local loads a tile stood in front of the wgmmas; rebuilt each tile, they are a few uniform adds."""
        return i >> 30

    @gluon.jit
    def _producer(K, V, k_s, vh_s, vl_s, k_ready, k_empty, v_ready, v_empty, skb, skh, skn, svb, svh, svn,
                  b, hk, NK, lo, hi, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr):
        """The producer warpgroup: every K tile of [lo, hi) into K's ring, its raw rows then its lo rows in one
        buffer, every V tile's raw and lo parts into V's (keys-contiguous, its rows in _pv_order), each slot refilled
        once both consumers released it. Each tile's global loads are issued before the wait for its slot."""
        K_STAGES: gl.constexpr = k_s.shape[0]
        V_STAGES: gl.constexpr = vh_s.shape[0]
        blk: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (HEAD_DIM // 4), HEAD_DIM // 4], [4, 1], [1, 0])
        # V: a thread holds 8 consecutive positions of V's buffer (keys-contiguous) in one column d, the lanes
        # consecutive columns, so its stores are 16 bytes and a warp's cover all 32 banks; loaded as K is (blk),
        # they were 4-byte stores, 64 a thread a tile at D = 128, bank-conflicted (now 16), and the kernel took
        # 1.8x its time at D = 128. The warps split the keys, so a thread's 8 rows are its only row addresses.
        blk_v: gl.constexpr = gl.BlockedLayout([8, 1], [32 // (HEAD_DIM // 4), HEAD_DIM // 4], [4, 1], [0, 1])
        k_base = K + b.to(gl.int64) * skb + hk.to(gl.int64) * skh
        v_base = V + b.to(gl.int64) * svb + hk.to(gl.int64) * svh
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, blk))
        keys_b = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, blk))
        offs_dv = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, blk_v))
        pos = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, blk_v))
        keys_v = (pos // 8) * 8 + (pos % 4) * 2 + (pos % 8) // 4   # the key at each position (_pv_order)
        for i in range(gl.cdiv(hi - lo, BLOCK_N)):
            t0 = lo + i * BLOCK_N
            kn = _rows(k_base, t0 + keys_b, offs_d, skn, NK)
            s = i % K_STAGES
            mbarrier.wait(k_empty.index(s), ((i // K_STAGES) & 1) ^ 1)     # a slot starts empty: phase 1 passes
            k_s.index(s).slice(0, BLOCK_N, dim=0).store(kn)
            k_s.index(s).slice(BLOCK_N, BLOCK_N, dim=0).store(_lo(kn))
            released(k_ready.index(s))
            vn = _rows(v_base, t0 + keys_v, offs_dv, svn, NK)
            sv = i % V_STAGES
            mbarrier.wait(v_empty.index(sv), ((i // V_STAGES) & 1) ^ 1)
            vh_s.index(sv).store(vn)
            vl_s.index(sv).store(_lo(vn))
            released(v_ready.index(sv))

    @gluon.jit
    def _consumer(Q, Sbuf, Out, Lse, qh_s, ql_s, k_s, vh_s, vl_s, k_ready, k_empty, v_ready, v_empty,
                  sqb, sqh, sqn, sob, soh, son, NQ, NK, QB, BH, NROWS, qk_scale, b, h, bh, qb, part, off, r0, lo, hi,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                  FINAL: gl.constexpr, STORE_LSE: gl.constexpr, WG: gl.constexpr):
        """Consumer warpgroup WG: query rows r0 + WG * 64 + [0, 64) of the CTA's BLOCK_M against every tile of the
        rings, then their summaries (or, FINAL, their output and lse)."""
        ROWS: gl.constexpr = 64
        K_STAGES: gl.constexpr = k_s.shape[0]
        V_STAGES: gl.constexpr = vh_s.shape[0]
        blk_q: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (HEAD_DIM // 4), HEAD_DIM // 4], [4, 1], [1, 0])
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 8])
        w_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, 2 * BLOCK_N, 8])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HEAD_DIM, 8])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=1)
        row_s: gl.constexpr = gl.SliceLayout(1, s_l)
        row_o: gl.constexpr = gl.SliceLayout(1, o_l)
        qk_scale = qk_scale.to(gl.float32)
        rw = r0 + WG * ROWS                               # this warpgroup's first row
        q_base = Q + b.to(gl.int64) * sqb + h.to(gl.int64) * sqh
        offs_q = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, blk_q))
        rows_q = rw + gl.arange(0, ROWS, layout=gl.SliceLayout(1, blk_q))
        # rows >= NQ load Q = 0: their summaries are finite and never written out
        q = _rows(q_base, rows_q, offs_q, sqn, NQ) * qk_scale
        qh_s.index(WG).store(q)
        ql_s.index(WG).store(_lo(q))
        fence_async_shared()
        gl.thread_barrier()                               # every thread's Q stored before the warpgroup's wgmmas
        rows = rw + gl.arange(0, ROWS, layout=row_s)
        cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
        m_i = gl.full([ROWS], float("-inf"), gl.float32, row_s)
        z_i = gl.zeros([ROWS], gl.float32, row_s)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_l)
        for i in range(gl.cdiv(hi - lo, BLOCK_N)):
            t0 = lo + i * BLOCK_N
            zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_l)
            zero_w = gl.zeros([ROWS, 2 * BLOCK_N], gl.float32, w_l)
            s = i % K_STAGES
            wq = WG + _zero_of(i)                          # Q's buffers, their descriptors not hoisted (_zero_of)
            mbarrier.wait(k_ready.index(s), (i // K_STAGES) & 1)
            # Qh [Kh; Kl]^T: both products in one wgmma a K step, Q's operand read once; Ql Kh^T on the raw rows
            qk2 = warpgroup_mma(qh_s.index(wq), k_s.index(s).permute((1, 0)), zero_w, use_acc=False, is_async=True)
            qlk = warpgroup_mma(ql_s.index(wq), k_s.index(s).slice(0, BLOCK_N, dim=0).permute((1, 0)), zero_s,
                                use_acc=False, is_async=True)
            qk2, qlk = warpgroup_mma_wait(0, deps=[qk2, qlk])
            mbarrier.arrive(k_empty.index(s), count=1)
            # qk2's two column halves (Qh Kh^T, Qh Kl^T) lie in each thread's registers: split without data movement
            qhk, qhkl = gl.split(gl.permute(gl.reshape(qk2, [ROWS, 2, BLOCK_N]), (0, 2, 1)))
            x = (gl.convert_layout(qhk, s_l) + gl.convert_layout(qhkl, s_l)) + qlk
            cols = t0 + cols0
            if t0 + BLOCK_N > NK:
                x = gl.where((cols < NK)[None, :], x, float("-inf"))
            if CAUSAL:
                if t0 + BLOCK_N - 1 > rw + off:           # a tile on the diagonal: future keys masked
                    x = gl.where(cols[None, :] <= rows[:, None] + off, x, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(x, 1))
            m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_ref)                  # 0 while the state is the identity
            p = gl.exp2(x - m_ref[:, None])               # masked keys: 0
            z_i = z_i * alpha + gl.sum(p, 1)
            m_i = m_new
            p = _pv_order(p)                              # V's row order: the conversions below move nothing
            p_lo = gl.convert_layout(_lo(p), p_l)
            p_hi = gl.convert_layout(p, p_l)
            sv = i % V_STAGES + _zero_of(i)               # V's buffers, their descriptors not hoisted
            mbarrier.wait(v_ready.index(sv), (i // V_STAGES) & 1)
            zero_o = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_l)
            pv = warpgroup_mma(p_hi, vh_s.index(sv), zero_o, use_acc=False, is_async=True)
            pv = warpgroup_mma(p_hi, vl_s.index(sv), pv, is_async=True)
            pv = warpgroup_mma(p_lo, vh_s.index(sv), pv, is_async=True)
            pv, p_hi, p_lo = warpgroup_mma_wait(0, deps=[pv, p_hi, p_lo])
            mbarrier.arrive(v_empty.index(sv), count=1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None] + pv
        # a causal partition past the block's horizon stores nothing (phase 2 never reads it), as _elsa_phase1
        if FINAL or lo < hi:
            # the epilogue: _write_output (FINAL) or _store_summary's float32 case
            offs_m = gl.arange(0, ROWS, layout=row_o)
            offs_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_l))
            z_o = gl.convert_layout(z_i, row_o)
            row_ok = (offs_m < NQ - rw)[:, None]
            if FINAL:
                out = gl.where(z_o[:, None] > 0, acc / gl.where(z_o > 0, z_o, 1.0)[:, None], 0.0)
                o_base = Out + b.to(gl.int64) * sob + h.to(gl.int64) * soh + rw.to(gl.int64) * son
                gl.store(o_base + offs_m[:, None] * son + offs_o[None, :], out, mask=row_ok)
                if STORE_LSE:
                    # +inf makes the backward's 2^(x - lse) = 0 for every key of a row that sees none
                    lse = gl.where(z_i > 0, m_i + gl.log2(gl.where(z_i > 0, z_i, 1.0)), float("inf"))
                    gl.store(Lse + bh.to(gl.int64) * NQ + rows, lse, mask=rows < NQ)
            else:
                base = ((part * QB + qb) * BH + bh).to(gl.int64) * BLOCK_M + WG * ROWS
                offs_r = gl.arange(0, ROWS, layout=row_s)
                gl.store(Sbuf + base + offs_r, m_i)
                gl.store(Sbuf + NROWS.to(gl.int64) + base + offs_r, z_i)
                if part == 0:                                 # partition 0's sum in the output rows
                    dst = Out + b.to(gl.int64) * sob + h.to(gl.int64) * soh + rw.to(gl.int64) * son
                    gl.store(dst + offs_m[:, None] * son + offs_o[None, :], acc, mask=row_ok)
                else:                                         # the others' in slot part - 1 of S
                    s_slot = (((part - 1) * QB + qb) * BH + bh).to(gl.int64) * BLOCK_M * HEAD_DIM
                    dst = Sbuf + 2 * NROWS.to(gl.int64) + s_slot + WG * ROWS * HEAD_DIM
                    gl.store(dst + offs_m[:, None] * HEAD_DIM + offs_o[None, :], acc, mask=row_ok)

    @gluon.jit
    def _elsa_phase1_tf32(Q, K, V, Bias, Sbuf, Out, Lse,
                          sqb, sqh, sqn, skb, skh, skn, svb, svh, svn,
                          sbb, sbh, sbi, sbj, sob, soh, son,
                          H, GROUP, NQ, NK, q0, QB, BH, W, NROWS, qk_scale,
                          HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_M: gl.constexpr,
                          BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, HAS_BIAS: gl.constexpr,
                          FOLD_Q: gl.constexpr, SCALE_IN_EXP: gl.constexpr, DOT_PREC: gl.constexpr,
                          FINAL: gl.constexpr, STORE_LSE: gl.constexpr, KEYS_EVEN: gl.constexpr,
                          USE_DESC: gl.constexpr, WARP_SPECIALIZE: gl.constexpr):
        """Program (qb, bh, part): the summaries of BLOCK_M query rows over keys [part*W, part*W + W), as
        _elsa_phase1 (float32, no bias; the flags it does not use are accepted and ignored): a producer warpgroup
        and two consumer warpgroups of 64 rows (_producer, _consumer)."""
        gl.static_assert(BLOCK_D == HEAD_DIM)
        gl.static_assert(BLOCK_M == 128)
        V_ST: gl.constexpr = _V_STAGES_128 if HEAD_DIM == 128 else _V_STAGES_64
        q_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], gl.float32)
        k_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_N, HEAD_DIM], gl.float32)
        v_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.float32, transposed=True)
        qb = gl.program_id(0)
        if CAUSAL:
            # the longest row blocks first: a causal block's keys grow with qb, and the SMs that take the last
            # programs should get short ones (2-4 % of the time at 4K-16K: fp32_phase1_prefetch_h200.json)
            qb = gl.num_programs(0) - 1 - qb
        bh = gl.program_id(1)
        part = gl.program_id(2)
        b, h, hk, off, r0, lo, hi = phase1_block(qb, bh, part, H, GROUP, NQ, NK, q0, W, BLOCK_M, CAUSAL)
        qh_s = gl.allocate_shared_memory(gl.float32, [2, 64, HEAD_DIM], q_l)
        ql_s = gl.allocate_shared_memory(gl.float32, [2, 64, HEAD_DIM], q_l)
        k_s = gl.allocate_shared_memory(gl.float32, [_K_STAGES, 2 * BLOCK_N, HEAD_DIM], k_l)    # raw rows, lo rows
        vh_s = gl.allocate_shared_memory(gl.float32, [V_ST, BLOCK_N, HEAD_DIM], v_l)
        vl_s = gl.allocate_shared_memory(gl.float32, [V_ST, BLOCK_N, HEAD_DIM], v_l)
        k_ready = gl.allocate_shared_memory(gl.int64, [_K_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [_K_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [V_ST, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [V_ST, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(_K_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)              # both consumers release every slot
        for i in gl.static_range(V_ST):
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=2)
        fence_async_shared()
        WG0: gl.constexpr = 0       # the warpgroups' indices as constexprs (a literal reaches _consumer as a value)
        WG1: gl.constexpr = 1
        gl.warp_specialize([
            (_consumer, (Q, Sbuf, Out, Lse, qh_s, ql_s, k_s, vh_s, vl_s, k_ready, k_empty, v_ready, v_empty,
                         sqb, sqh, sqn, sob, soh, son, NQ, NK, QB, BH, NROWS, qk_scale, b, h, bh, qb, part, off, r0,
                         lo, hi, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, FINAL, STORE_LSE, WG0)),
            (_consumer, (Q, Sbuf, Out, Lse, qh_s, ql_s, k_s, vh_s, vl_s, k_ready, k_empty, v_ready, v_empty,
                         sqb, sqh, sqn, sob, soh, son, NQ, NK, QB, BH, NROWS, qk_scale, b, h, bh, qb, part, off, r0,
                         lo, hi, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, FINAL, STORE_LSE, WG1)),
            (_producer, (K, V, k_s, vh_s, vl_s, k_ready, k_empty, v_ready, v_empty, skb, skh, skn, svb, svh,
                         svn, b, hk, NK, lo, hi, HEAD_DIM, BLOCK_N)),
        ], [4, 4], [_CONSUMER_REGS, _PRODUCER_REGS])
