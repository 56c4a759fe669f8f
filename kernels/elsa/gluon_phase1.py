"""ELSA's float32 phase 1 on sm_90's tensor cores: tf32x3 products by warpgroup MMA (wgmma), written in Gluon.

Triton's tf32x3 dots keep hi/lo copies of every operand in registers, so its float32 phase 1 at D = 128 runs on
32 x 32 mma.sync tiles (every 64-row tile spills: kernels/elsa/NOTES.md) at ~40 TFLOP/s, 1.09x efficient
attention's time at 16K on the H200. Here the operands live in shared memory, where wgmma reads them:

- Q (the scale folded in, as the Triton kernel folds it) is split once into hi and lo; K and V tiles are loaded,
  and the tensor core reads a float32 operand as tf32 by dropping its low 13 bits, so a raw tile is its own hi
  part (measured: the same products as an explicit x & ~0x1fff, results/dev/elsa/fp32_on_wgmma_h200.json); only
  lo = x - hi is computed and stored beside it. V's tiles are stored keys-contiguous (tf32 wgmma takes its B
  operand K-major only), P's hi and lo come from registers.
- S = Qh Kh^T + Qh Kl^T + Ql Kh^T and P V the same way: three wgmmas each (lo x lo is below float32's rounding).
- The tensor core's float32 accumulation truncates: chained over a whole row of tiles it biases the sum (relative
  error 3e-5 at 4K keys, 1.2e-4 at 16K in the probe), and over all of D = 128 it put S's at 2e-6. So each tile's
  P V, and S by D-chunks of CHUNK columns, go to fresh accumulators (12 chained products each) that the CUDA cores
  add, rounding to nearest.
- Two warpgroups, 128 query rows a CTA, share every K and V tile; S's chunks run at once while the warps split and
  store V, and load the next K tile and split and store it into K's other buffer: no tile waits on K's global loads,
  and the next tile's registers are free again before the softmax (no spill). Measured against the alternatives
  (results/dev/elsa/fp32_phase1_prefetch_h200.json): K loaded and stored between the tiles' GEMMs was 7-11 % slower;
  the next K held in registers until this tile's P V, into one buffer, spilled 64 bytes at D = 128 and was 3-7 %
  slower there (1.5-2.3 % faster at D = 64); loading the next V early too lost 1-13 %.
  With Q's hi and lo resident a CTA holds a SM alone (shared memory and registers), so ELSA's plan fits its q-chunks
  to whole waves of one program a SM (config._partitions' one_cta_per_sm).

It writes exactly what the Triton phase 1 (kernel.py's _elsa_phase1) writes for a float32 output: (m, z) to the
summary slots and the partition's sum s to the output rows (partition 0) or to slot part - 1 of S, or with one
partition (FINAL) the output and lse; its arguments are _elsa_phase1's, so the host swaps the kernel only.
"""
from __future__ import annotations

import torch

from .._gluon_core import GLUON_VERSION, HAS_GLUON, gluon_on
from .kernel import phase1_block

# what the kernel takes, and where ELSA's plan takes it (from MIN_WORK). Against the Triton phase 1 at B = 1, H = 8
# (CUDA-graph time over efficient's, results/dev/elsa/fp32_phase1_prefetch_h200.json, with the plan's q-chunks filling
# whole waves): D = 128 0.95 / 0.91 against 1.25 / 1.10 at 4K / 16K, causal 16K 1.05 against 1.17; D = 64 0.50 / 0.53
# against 1.01 / 0.79, causal 16K 0.59 against 0.78 (and, with the next K held in registers until P V, which differs
# from this by the percent or two above: D = 128 0.90 / 0.96 against 1.13 / 1.18 at 2K / 8K, causal 1.19 / 1.15
# against 1.25 / 1.25 at 4K / 8K; D = 64 0.47 / 0.52 against 0.67 / 0.82 at 2K / 8K)
HEAD_DIMS = (64, 128)
BLOCK_M = 128               # two warpgroups of 64 rows
NUM_WARPS = 8
# BLOCK_N per head dim: Q's hi and lo, K's two tiles and V's with their lo parts, in shared memory (<= 227 KB: 224 at
# D = 128)
TILES = {64: 64, 128: 32}
# S = Q K^T's products by D-chunks of this many columns, each into a fresh accumulator added by the CUDA cores:
# the tensor core's float32 accumulation truncates, and over all of D = 128 (16 wgmma K steps, three products each)
# the scores came out with a relative error of 2e-6 against Triton's tf32x3 dots' 1e-7 (the probe)
CHUNK = 32
# ELSA takes this kernel from this much work (B*Hq * Nq * Nk * D): the smallest measured (D = 64 at 2K, B = 1, H = 8,
# 0.47 against the Triton phase 1's 0.67 of efficient's time, above)
MIN_WORK = 2**31


def eligible(q) -> bool:
    """Whether this kernel can run a call with this q: float32, a head dim of HEAD_DIMS, on a device the Gluon core's
    code runs on (gluon_core.gluon_on; its loads take any strides but the last, which ELSA's host makes 1)."""
    return q.dtype == torch.float32 and q.shape[-1] in HEAD_DIMS and gluon_on(q.device)


if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    _CHUNK = gl.constexpr(CHUNK)          # (a Gluon kernel reads globals only as constexprs)

    @gluon.jit
    def _lo(x):
        """x minus its tf32 part (the low 13 bits of the mantissa cleared): exact in float32."""
        return x - (x.to(gl.int32, bitcast=True) & -8192).to(gl.float32, bitcast=True)

    @gluon.jit
    def _k_chunk(k_base, t, keys_c, offs_c, skn, NK, c: gl.constexpr):
        """D-chunk c of the K tile from key t, in registers (keys >= NK load 0)."""
        return gl.load(k_base + (t + keys_c)[:, None] * skn + c * _CHUNK + offs_c[None, :],
                       mask=(t + keys_c < NK)[:, None], other=0.0)

    @gluon.jit
    def _k_tile(k_base, t, keys_c, offs_c, skn, NK, CH: gl.constexpr):
        """The K tile from key t in registers, as a tuple of its CH D-chunks (_k_chunk's)."""
        if CH == 4:
            return (_k_chunk(k_base, t, keys_c, offs_c, skn, NK, 0), _k_chunk(k_base, t, keys_c, offs_c, skn, NK, 1),
                    _k_chunk(k_base, t, keys_c, offs_c, skn, NK, 2), _k_chunk(k_base, t, keys_c, offs_c, skn, NK, 3))
        else:
            return _k_chunk(k_base, t, keys_c, offs_c, skn, NK, 0), _k_chunk(k_base, t, keys_c, offs_c, skn, NK, 1)

    @gluon.jit
    def _put(kh_s, kl_s, c, kc):
        """K's D-chunk into shared memory slot c: raw (the tensor core's tf32 hi part) and its lo part."""
        kh_s.index(c).store(kc)
        kl_s.index(c).store(_lo(kc))

    @gluon.jit
    def _put_tile(kh_s, kl_s, slot, kn, CH: gl.constexpr):
        """A K tile's CH D-chunks (_k_tile's) into shared memory slots slot .. slot + CH - 1 (_put)."""
        for c in gl.static_range(CH):
            _put(kh_s, kl_s, slot + c, kn[c])

    @gluon.jit
    def _scores_issue(qh_s, ql_s, kh_s, kl_s, c: gl.constexpr, kb, zero_s):
        """The three tf32 products of D-chunk c of S = Q K^T (K from buffer slot kb + c) into a fresh accumulator."""
        s = warpgroup_mma(qh_s.index(c), kh_s.index(kb + c).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma(qh_s.index(c), kl_s.index(kb + c).permute((1, 0)), s, is_async=True)
        return warpgroup_mma(ql_s.index(c), kh_s.index(kb + c).permute((1, 0)), s, is_async=True)

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
        _elsa_phase1 (float32, no bias; the flags it does not use are accepted and ignored)."""
        gl.static_assert(BLOCK_D == HEAD_DIM)
        WARPS: gl.constexpr = BLOCK_M // 16                  # a warpgroup per 64 rows
        CH: gl.constexpr = HEAD_DIM // _CHUNK                 # S's products by D-chunks (CHUNK's comment)
        gl.static_assert(CH == 2 or CH == 4)
        blk: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (HEAD_DIM // 4), HEAD_DIM // 4], [WARPS, 1], [1, 0])
        blk_c: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (_CHUNK // 4), _CHUNK // 4], [WARPS, 1], [1, 0])
        q_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, _CHUNK], gl.float32)
        k_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, _CHUNK], gl.float32)
        v_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.float32, transposed=True)
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, BLOCK_N, 8])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, HEAD_DIM, 8])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=1)
        row_s: gl.constexpr = gl.SliceLayout(1, s_l)
        row_o: gl.constexpr = gl.SliceLayout(1, o_l)

        qk_scale = qk_scale.to(gl.float32)
        qb = gl.program_id(0)
        if CAUSAL:
            # the longest row blocks first: a causal block's keys grow with qb, and the SMs that take the last
            # programs should get short ones (2-4 % of the time at 4K-16K: fp32_phase1_prefetch_h200.json)
            qb = gl.num_programs(0) - 1 - qb
        bh = gl.program_id(1)
        part = gl.program_id(2)
        b, h, hk, off, r0, lo, hi = phase1_block(qb, bh, part, H, GROUP, NQ, NK, q0, W, BLOCK_M, CAUSAL)
        # a causal partition past the block's horizon stores nothing (phase 2 never reads it), as _elsa_phase1
        if FINAL or lo < hi:
            q_base = Q + b.to(gl.int64) * sqb + h.to(gl.int64) * sqh
            k_base = K + b.to(gl.int64) * skb + hk.to(gl.int64) * skh
            v_base = V + b.to(gl.int64) * svb + hk.to(gl.int64) * svh
            offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, blk))
            offs_c = gl.arange(0, _CHUNK, layout=gl.SliceLayout(0, blk_c))
            rows_c = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk_c))
            keys_c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, blk_c))
            keys_b = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, blk))
            qh_s = gl.allocate_shared_memory(gl.float32, [CH, BLOCK_M, _CHUNK], q_l)
            ql_s = gl.allocate_shared_memory(gl.float32, [CH, BLOCK_M, _CHUNK], q_l)
            kh_s = gl.allocate_shared_memory(gl.float32, [2 * CH, BLOCK_N, _CHUNK], k_l)   # two buffers of CH
            kl_s = gl.allocate_shared_memory(gl.float32, [2 * CH, BLOCK_N, _CHUNK], k_l)
            vh_s = gl.allocate_shared_memory(gl.float32, [BLOCK_N, HEAD_DIM], v_l)
            vl_s = gl.allocate_shared_memory(gl.float32, [BLOCK_N, HEAD_DIM], v_l)
            for c in gl.static_range(CH):
                # rows >= NQ load Q = 0: their summaries are finite and never written out
                qc = gl.load(q_base + rows_c[:, None] * sqn + c * _CHUNK + offs_c[None, :],
                             mask=(rows_c < NQ)[:, None], other=0.0) * qk_scale
                qh_s.index(c).store(qc)
                ql_s.index(c).store(_lo(qc))
            rows = r0 + gl.arange(0, BLOCK_M, layout=row_s)
            cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
            z_i = gl.zeros([BLOCK_M], gl.float32, row_s)
            acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_l)
            # K's first tile into buffer 0; each next one goes to the other buffer while this tile's S products run
            # by pairs of D-chunks, each pair's loads before its stores: the order of the sm_90 code the GPU ran
            for c in gl.static_range(0, CH, 2):
                _put_tile(kh_s, kl_s, c, (_k_chunk(k_base, lo, keys_c, offs_c, skn, NK, c),
                                          _k_chunk(k_base, lo, keys_c, offs_c, skn, NK, c + 1)), 2)
            fence_async_shared()
            gl.thread_barrier()
            for t0 in range(lo, hi, BLOCK_N):
                kb = (((t0 - lo) // BLOCK_N) % 2) * CH           # this tile's K buffer; the next tile's: CH - kb
                zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_l)
                # every chunk's products in flight at once, each into its own accumulator, while V is split and the
                # next K tile loaded and split into the other buffer (its registers free again before the softmax)
                s0 = _scores_issue(qh_s, ql_s, kh_s, kl_s, 0, kb, zero_s)
                s1 = _scores_issue(qh_s, ql_s, kh_s, kl_s, 1, kb, zero_s)
                if CH == 4:
                    s2 = _scores_issue(qh_s, ql_s, kh_s, kl_s, 2, kb, zero_s)
                    s3 = _scores_issue(qh_s, ql_s, kh_s, kl_s, 3, kb, zero_s)
                v = gl.load(v_base + (t0 + keys_b)[:, None] * svn + offs_d[None, :],
                            mask=(t0 + keys_b < NK)[:, None], other=0.0)
                t1 = t0 + BLOCK_N                             # the next tile (past hi on the last: not used)
                kn = _k_tile(k_base, t1, keys_c, offs_c, skn, NK, CH)
                vh_s.store(v)
                vl_s.store(_lo(v))
                _put_tile(kh_s, kl_s, CH - kb, kn, CH)
                if CH == 4:
                    s0, s1, s2, s3 = warpgroup_mma_wait(0, deps=[s0, s1, s2, s3])
                    s = (s0 + s1) + (s2 + s3)
                else:
                    s0, s1 = warpgroup_mma_wait(0, deps=[s0, s1])
                    s = s0 + s1
                cols = t0 + cols0
                if t0 + BLOCK_N > NK:
                    s = gl.where((cols < NK)[None, :], s, float("-inf"))
                if CAUSAL:
                    if t0 + BLOCK_N - 1 > r0 + off:           # a tile on the diagonal: future keys masked
                        s = gl.where(cols[None, :] <= rows[:, None] + off, s, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, 1))
                m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = gl.exp2(m_i - m_ref)                  # 0 while the state is the identity
                p = gl.exp2(s - m_ref[:, None])               # masked keys: 0
                z_i = z_i * alpha + gl.sum(p, 1)
                m_i = m_new
                p_lo = gl.convert_layout(_lo(p), p_l)
                p_hi = gl.convert_layout(p, p_l)
                fence_async_shared()
                gl.thread_barrier()           # V's stores seen by every warp; every warpgroup's S products done with K
                zero_o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_l)
                pv = warpgroup_mma(p_hi, vh_s, zero_o, use_acc=False, is_async=True)
                pv = warpgroup_mma(p_hi, vl_s, pv, is_async=True)
                pv = warpgroup_mma(p_lo, vh_s, pv, is_async=True)
                pv, p_hi, p_lo = warpgroup_mma_wait(0, deps=[pv, p_hi, p_lo])
                acc = acc * gl.convert_layout(alpha, row_o)[:, None] + pv
                fence_async_shared()
                gl.thread_barrier()           # the next K's stores seen; every warpgroup's P V done with V
            # the epilogue: _write_output (FINAL) or _store_summary's float32 case
            offs_m = gl.arange(0, BLOCK_M, layout=row_o)
            offs_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_l))
            z_o = gl.convert_layout(z_i, row_o)
            row_ok = (offs_m < NQ - r0)[:, None]
            if FINAL:
                out = gl.where(z_o[:, None] > 0, acc / gl.where(z_o > 0, z_o, 1.0)[:, None], 0.0)
                o_base = Out + b.to(gl.int64) * sob + h.to(gl.int64) * soh + r0.to(gl.int64) * son
                gl.store(o_base + offs_m[:, None] * son + offs_o[None, :], out, mask=row_ok)
                if STORE_LSE:
                    # +inf makes the backward's 2^(x - lse) = 0 for every key of a row that sees none
                    lse = gl.where(z_i > 0, m_i + gl.log2(gl.where(z_i > 0, z_i, 1.0)), float("inf"))
                    gl.store(Lse + bh.to(gl.int64) * NQ + rows, lse, mask=rows < NQ)
            else:
                base = ((part * QB + qb) * BH + bh).to(gl.int64) * BLOCK_M
                offs_r = gl.arange(0, BLOCK_M, layout=row_s)
                gl.store(Sbuf + base + offs_r, m_i)
                gl.store(Sbuf + NROWS.to(gl.int64) + base + offs_r, z_i)
                if part == 0:                                 # partition 0's sum in the output rows
                    dst = Out + b.to(gl.int64) * sob + h.to(gl.int64) * soh + r0.to(gl.int64) * son
                    gl.store(dst + offs_m[:, None] * son + offs_o[None, :], acc, mask=row_ok)
                else:                                         # the others' in slot part - 1 of S
                    s_slot = (((part - 1) * QB + qb) * BH + bh).to(gl.int64) * BLOCK_M * HEAD_DIM
                    dst = Sbuf + 2 * NROWS.to(gl.int64) + s_slot
                    gl.store(dst + offs_m[:, None] * HEAD_DIM + offs_o[None, :], acc, mask=row_ok)
