"""The attention backward written in Gluon for sm_90 (16-bit, D = 64 and 128): FA2/FA3's five GEMMs per tile.

ELSA's Triton backward (kernels/elsa/kernel.py) runs two kernels: the dQ kernel recomputes every score tile for its
query rows and the dK/dV kernel recomputes them again for its keys, seven GEMMs per (query tile, key tile) where the
gradients need five. Here one program owns a block of 2 x BLOCK_N keys of one key/value head and walks the query
tiles of every query head of its group, as FA2 and FA3 do:

    S^T = K Q^T,  P^T = exp2(S^T * qk_scale - lse2),  dP^T = V dO^T,  dS^T = P^T * (dP^T - Delta)
    dV += P^T dO,  dK += dS^T Q,  dQ += dS K  (TMA reduce-add into an fp32 [B, Hq, Nq, D] buffer, scaled by sm_scale)

Its warps, FA3's structure (gl.warp_specialize, triton 3.6's signature):
- a loader warp puts K and V of the block in shared memory once, then streams every tile's Q and dO by TMA through
  a ring of STAGES slots (ready / empty mbarriers; a slot is refilled once both consumers released it), and with
  them the tile's lse2 and Delta, by its own loads (each consumer loading them from global memory every tile had
  it wait on them: 0.84-0.97x the time without those waits on the H200 from 4K, results/dev/gluon_bwd/
  stats_in_ring_h200.json);
- two consumer warpgroups, each owning BLOCK_N of the block's keys (its dK, dV in registers) and sharing every
  Q / dO tile: P^T and dS^T are the register A operands of dV's and dK's wgmmas, dS^T is staged in shared memory for
  dQ's (its transpose is dQ's A operand), and each warpgroup adds its part of dQ, DQ_COLS columns at a time, by a
  bulk TMA reduction (cp.reduce.async.bulk.tensor) from a staging buffer, without waiting for it.
Its part of dQ is half the columns over both warpgroups' keys (dS_0 K_0[:, cols] + dS_1 K_1[:, cols], as FA3 splits
it): a 64-row tile's dQ reduced once, not twice, for a wait per tile on the other warpgroup's dS^T (two mbarriers per
double-buffered dS^T slot: full, free), with dV's GEMM in flight during it. At that wait's barrier a warpgroup also
releases the previous tile's ring slot. The other way, each warpgroup reducing its own keys' part of every column
(dS_w K_w, the warpgroups meeting only at the ring), was slower at every head dim and mask: 7-13 % at D = 128 and
for causal D = 64 (results/dev/gluon_bwd/tiles_h200.json), 6-10 % for D = 64 without a mask once the slot release
came (dq_split_d64_h200.json); it was taken out.
With one warpgroup waiting on each GEMM and per-element fp32 atomics for dQ, the first version of this kernel took
1.5-2.2x cuDNN's backward on the H200, the atomics alone 38-57 % of it at D = 128.

lse2 is the base-2 row statistic ELSA's forward stores (p = exp2(x * qk_scale - lse2), +inf for a row that sees no
key); the loader scales what it reads by lse_scale (1, or log2 e for CQSA's natural-log lse: no scaled copy a call).
Before the launch one Triton kernel (_prologue) writes Delta = rowsum(dO * O) in fp32 and zeroes dQ's fp32 buffer:
in torch that was five launches and three fp32 tensors of O's size (at D = 128, 16K, H = 8 three times the buffer's
67 MB at once). Both launches are prepared once per layout (Launch): the prologue through the keyed launch() took
17.8 us of host time a call, prepared 9.0 (results/dev/gluon_bwd/prologue_prepared_h200.json). dQ's buffer is cast to
the inputs' dtype after it.

Masks: a key past NK (a tile running past its head's keys reads the next head's rows, or TMA's zeros at the end) adds
nothing to dQ, and its dK/dV rows are not stored: causal, it lies above every real row's diagonal, whose mask sets its
P^T row to 0; not causal, its warpgroup zeroes its K row in shared memory once (dS K then gets nothing from it), and
the scores take no mask (0.99x the time of masking every tile on the H200 at H = 8, 0.96-0.97x at Llama-3's 32 / 8
heads: results/dev/gluon_bwd/zeroed_k_h200.json); a query row past NQ has lse2 = +inf (P^T = 0) and Delta = 0, so its
dQ part is 0: the reduction adds zeros to the rows past the head's end (the next head's first rows, or nothing: TMA
clips the box at the tensor's end). Causal (bottom-right, key n visible from query m iff n <= m + NK - NQ) zeroes P^T
above the diagonal and skips the query tiles that see none of the block's keys; the diagonal is its whole mask, applied
at D = 64 to every tile and at D = 128 only to the tiles that cross it (each measured the faster there).
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ._common import LOG2E, check_inputs, default_scale, on_device, sm_count
from ._flash_core import _tma_layout_ok
from ._gluon_core import GLUON_VERSION, HAS_GLUON, available, busiest_sm, described_rows
from ._gluon_core import eligible as core_eligible
from ._launch import Prepared

NAME = "gluon_bwd"
HEAD_DIMS = (64, 128)
# (head dim, causal) -> (BLOCK_M query rows per tile, BLOCK_N keys per consumer warpgroup, STAGES of the Q / dO ring,
# DQ_COLS: the columns of a warpgroup's half of dQ per GEMM). Timed on the H200 (B=1, H=8, 4K and 16K;
# results/dev/gluon_bwd/tiles_h200.json): DQ_COLS narrower than the warpgroup's columns and three stages were no
# faster; 128-row tiles do not fit in shared memory.
TILES = {(64, False): (64, 64, 2, 32), (64, True): (64, 64, 2, 32), (128, False): (64, 64, 2, 64),
         (128, True): (64, 64, 2, 64)}
CONSUMER_REGS = 240     # per consumer thread (setmaxnreg): two consumer warpgroups and the loader's in 64K
LOADER_REGS = 24
# The launch order. Causal, a key block's program walks the query tiles from its block's diagonal on, block 0 the
# most. With key blocks fastest each head's blocks go longest first, but the last heads' longest start at the end of
# the launch, which short grids (few waves) cannot absorb; heads fastest (every head's block 0, then every head's
# block 1: longest first across the grid) spreads a wave over every head's Q and dO instead. Each forced, the backward
# alone (results/dev/gluon_bwd/launch_order_h200.json, B=1, CUDA-graph time, heads fastest over blocks fastest): causal
# H = 8 4K 0.69 / 0.73 (D = 64 / 128), 8K 0.88 / 0.90, Llama-3's 32 / 8 heads 4K 0.77, 8K 0.92; where either order
# fills the SMs evenly 1-3 % slower (causal 16K-32K, 32 kv heads of 4K 0.99, not causal 8K-16K 1.00-1.03). So heads
# fastest where the blocks-fastest order's busiest SM (gluon_core.busiest_sm of the programs' query tiles, plus one
# for K and V) has at least HEADS_FASTEST_MIN_GAIN times heads fastest's work: 1.23 at every shape that gained, 1.13
# at 32 kv heads of 4K (even), under 1.01 where heads fastest lost.
HEADS_FASTEST_MIN_GAIN = 1.2

if HAS_GLUON:
    from triton._C.libtriton import ir
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)

    from ._gluon_core import released

    @builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """global[the descriptor's box at coord] += shared `src`, by one TMA bulk reduction (cp.reduce.async.bulk
        .tensor, add), completing as a TMA store does (tma.store_wait). triton 3.6's Gluon has the builder's op
        (create_async_tma_reduce) but no function for it."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

    @gluon.jit
    def _load_q_do(q_desc, do_desc, q_bufs, do_bufs, ready, slot, row):
        """Query rows [row, row + BLOCK_M) of Q and dO into ring slot `slot`, both onto its ready barrier."""
        mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row, 0], ready.index(slot), q_bufs.index(slot))
        tma.async_copy_global_to_shared(do_desc, [row, 0], ready.index(slot), do_bufs.index(slot))

    @gluon.jit
    def _tile_row(it, n_tiles, i_lo, q_head0, n_q, BM: gl.constexpr):
        """The walk's step `it`: (the first query row of its tile within its head, its row in the flattened Q)."""
        g = it // n_tiles
        i0 = i_lo + (it % n_tiles) * BM
        return i0, (q_head0 + g) * n_q + i0

    @gluon.jit
    def _loader(q_desc, k_desc, v_desc, do_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, Lse, Delta, k_smem, v_smem,
                kv_bar, ready, empty, k_row, total, n_tiles, i_lo, q_head0, n_q, lse_scale, STAGES: gl.constexpr):
        """The producer warp: both consumers' K and V once, then every tile's Q and dO into the ring, and its rows'
        lse2 (Lse * lse_scale) and Delta (+inf and 0 past NQ) beside them."""
        BN: gl.constexpr = k_desc.block_type.shape[0]
        BM: gl.constexpr = q_desc.block_type.shape[0]
        stat_layout: gl.constexpr = gl.BlockedLayout([BM // 32], [32], [1], [0])
        offs = gl.arange(0, BM, layout=stat_layout)
        mbarrier.expect(kv_bar, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
        for w in gl.static_range(2):
            tma.async_copy_global_to_shared(k_desc, [k_row + w * BN, 0], kv_bar, k_smem.index(w))
            tma.async_copy_global_to_shared(v_desc, [k_row + w * BN, 0], kv_bar, v_smem.index(w))
        for it in range(total):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)     # a slot starts empty: phase 1 passes
            i0, row = _tile_row(it, n_tiles, i_lo, q_head0, n_q, BM)
            _load_q_do(q_desc, do_desc, q_bufs, do_bufs, ready, s, row)
            # the statistics by this warp's loads, behind the TMA copies (a consumer's own loads of them waited on
            # global memory every tile)
            q_ok = i0 + offs < n_q
            lse_bufs.index(s).store(gl.load(Lse + row + offs, mask=q_ok, other=float("inf")) * lse_scale)
            delta_bufs.index(s).store(gl.load(Delta + row + offs, mask=q_ok, other=0.0))
            gl.thread_barrier()                           # the warp's stores before its arrive (release)
            mbarrier.arrive(ready.index(s), count=1)

    @gluon.jit
    def _consumer(q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, kv_bar, ready, empty, ds_bufs, ds_full,
                  ds_free, dq_bufs, dq_desc, DK, DV, bhk, c0, n_q, n_k, total, n_tiles, i_lo, q_head0, causal_shift,
                  qk_scale, sm_scale, WG: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
        """One warpgroup: keys [c0 + WG * BN, + BN): its dK, dV, and every tile's dQ columns [WG * D / 2, + D / 2)
        over both warpgroups' keys (TMA reduce-add)."""
        BN: gl.constexpr = k_smem.shape[1]
        D: gl.constexpr = k_smem.shape[2]
        BM: gl.constexpr = q_bufs.shape[1]
        DQ_COLS: gl.constexpr = dq_bufs.shape[2]
        COL0: gl.constexpr = WG * (D // 2)            # the first of this warpgroup's columns of dQ
        CHUNKS: gl.constexpr = (D // 2) // DQ_COLS
        dtype: gl.constexpr = k_smem.dtype
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BM, 16])
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, D, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, DQ_COLS, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
        rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [4, 1], [1, 0])
        k_mine = k_smem.index(WG)
        v_mine = v_smem.index(WG)
        kc0 = c0 + WG * BN
        keys = kc0 + gl.arange(0, BN, layout=gl.SliceLayout(1, st_layout))
        dk = gl.zeros([BN, D], gl.float32, kv_layout)
        dv = gl.zeros([BN, D], gl.float32, kv_layout)
        zero_st = gl.zeros([BN, BM], gl.float32, st_layout)
        zero_dq = gl.zeros([BM, DQ_COLS], gl.float32, dq_layout)
        mbarrier.wait(kv_bar, 0)
        if not CAUSAL:
            if kc0 + BN > n_k:
                # not causal, the scores need no mask: this warpgroup's K rows past NK are zeroed once, so those
                # keys add nothing to dQ (dS K), and their dK, dV rows are not stored; both warpgroups' dQ GEMMs
                # read them after the first tile's dS^T barrier (released: fence and arrive)
                k_rows = k_mine.load(rows_layout)
                k_ok = kc0 + gl.arange(0, BN, layout=gl.SliceLayout(1, rows_layout)) < n_k
                k_mine.store(gl.where(k_ok[:, None], k_rows, gl.zeros_like(k_rows)))
                fence_async_shared()
                gl.thread_barrier()                  # every thread's rows before this warpgroup's first wgmma
        for it in range(total):
            s = it % STAGES
            b = it % 2                                    # the tile's dS^T buffers
            ds_phase = (it // 2) & 1
            i0, row = _tile_row(it, n_tiles, i_lo, q_head0, n_q, BM)
            q_smem = q_bufs.index(s)
            do_smem = do_bufs.index(s)
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            st = warpgroup_mma(k_mine, q_smem.permute((1, 0)), zero_st, use_acc=False, is_async=True)
            dpt = warpgroup_mma(v_mine, do_smem.permute((1, 0)), zero_st, use_acc=False, is_async=True)
            qrows = i0 + gl.arange(0, BM, layout=gl.SliceLayout(0, st_layout))
            st, dpt = warpgroup_mma_wait(0, deps=[st, dpt])
            lse2 = lse_bufs.index(s).load(gl.SliceLayout(0, st_layout))
            delta = delta_bufs.index(s).load(gl.SliceLayout(0, st_layout))
            if CAUSAL and D == 128:
                # the mask only on the tiles that cross this warpgroup's keys' diagonal (a key past NK lies above
                # every real row's diagonal, n >= NK > m + NK - NQ for m < NQ; a query row past NQ has lse2 = +inf,
                # P^T = 0): 0.94-0.96x the time of masking every tile on the H200 (4K-32K, 8 heads; Llama-3's 32 / 8
                # at 4K). At causal D = 64 the same branch took 1.02x, so that masks every tile
                # (results/dev/gluon_bwd/mask_per_tile_h200.json)
                pt = gl.exp2(st * qk_scale - lse2[None, :])
                if kc0 + BN - 1 > i0 + causal_shift:
                    pt = gl.where(keys[:, None] <= qrows[None, :] + causal_shift, pt, 0.0)
            elif CAUSAL:
                # the diagonal alone (as above) on every tile: 0.91-0.96x the full mask's time on the H200 at D = 64
                # (results/dev/gluon_bwd/mask_h200.json)
                pt = gl.where(keys[:, None] <= qrows[None, :] + causal_shift,
                              gl.exp2(st * qk_scale - lse2[None, :]), 0.0)
            else:
                # no mask (K's rows past NK zeroed above; a query row past NQ has lse2 = +inf, P^T = 0)
                pt = gl.exp2(st * qk_scale - lse2[None, :])
            dst = pt * (dpt - delta[None, :])
            pt_op = gl.convert_layout(pt.to(dtype), a_layout)
            dst16 = dst.to(dtype)
            dst_op = gl.convert_layout(dst16, a_layout)
            # dS^T of this warpgroup's keys into the tile's buffer, once both warpgroups' dQ GEMMs of the tile that
            # used it last are done; dV's GEMM runs while this one waits for the other's dS^T
            mbarrier.wait(ds_free.index(b), ds_phase ^ 1)
            ds_bufs.index(b * 2 + WG).store(dst16)
            released(ds_full.index(b))
            # the previous tile's ring slot released here, on this barrier, rather than on one of its own at that
            # tile's end (where the compiler also put one before the next ready wait): 0.97-0.98x the time at
            # D = 128 (results/dev/gluon_bwd/slot_release_h200.json)
            if it > 0:
                mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
            dv = warpgroup_mma(pt_op, do_smem, dv, is_async=True)
            mbarrier.wait(ds_full.index(b), ds_phase)
            # dQ's first DQ_COLS columns over both warpgroups' keys, then dK += dS^T Q behind them: the part is
            # stored and its reduction issued while it runs
            for j in gl.static_range(CHUNKS):
                dq = warpgroup_mma(ds_bufs.index(b * 2).permute((1, 0)),
                                   k_smem.index(0).slice(COL0 + j * DQ_COLS, DQ_COLS, dim=1), zero_dq,
                                   use_acc=False, is_async=True)
                dq = warpgroup_mma(ds_bufs.index(b * 2 + 1).permute((1, 0)),
                                   k_smem.index(1).slice(COL0 + j * DQ_COLS, DQ_COLS, dim=1), dq, is_async=True)
                if j == 0:
                    dk = warpgroup_mma(dst_op, q_smem, dk, is_async=True)
                    dq = warpgroup_mma_wait(1, deps=[dq])
                else:
                    dq = warpgroup_mma_wait(0, deps=[dq])
                if j == CHUNKS - 1:
                    mbarrier.arrive(ds_free.index(b), count=1)
                buf = dq_bufs.index(WG * 2 + (it * CHUNKS + j) % 2)
                tma.store_wait(1)
                buf.store(dq * sm_scale)
                fence_async_shared()
                _tma_reduce_add(dq_desc, [row, COL0 + j * DQ_COLS], buf)
            dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])
        rows = kc0 + gl.arange(0, BN, layout=gl.SliceLayout(1, kv_layout))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, kv_layout))
        offs = (bhk * n_k + rows).to(gl.int64)[:, None] * D + cols[None, :]
        store_ok = (rows < n_k)[:, None]
        gl.store(DK + offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=store_ok)
        gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=store_ok)
        tma.store_wait(0)

    @gluon.jit
    def _gluon_bwd_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, Lse, Delta, DK, DV, heads, group, n_q, n_k,
                             causal_shift, qk_scale, sm_scale, lse_scale, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                             CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, HEADS_FASTEST: gl.constexpr):
        """Program (key block kb of 2 * BN keys, b * Hkv + hk), or (b * Hkv + hk, kb) with HEADS_FASTEST: a loader
        warp and two consumer warpgroups, each owning BN of the block's keys; both read every Q / dO tile of the ring
        (its empty barrier counts both)."""
        BN: gl.constexpr = k_desc.block_type.shape[0]
        D: gl.constexpr = k_desc.block_type.shape[1]
        BM: gl.constexpr = q_desc.block_type.shape[0]
        DQ_COLS: gl.constexpr = dq_desc.block_type.shape[1]
        dtype: gl.constexpr = k_desc.dtype
        if HEADS_FASTEST:
            kb = gl.program_id(1)
            bhk = gl.program_id(0)
        else:
            kb = gl.program_id(0)
            bhk = gl.program_id(1)
        kv_heads = heads // group
        b = bhk // kv_heads
        hk = bhk % kv_heads
        c0 = kb * 2 * BN
        q_head0 = b * heads + hk * group
        i_lo = 0
        if CAUSAL:
            i_lo = (gl.maximum(c0 - causal_shift, 0) // BM) * BM
        n_tiles = gl.maximum(gl.cdiv(n_q - i_lo, BM), 0)
        total = group * n_tiles

        k_smem = gl.allocate_shared_memory(dtype, [2, BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, BN, D], v_desc.layout)
        q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, D], q_desc.layout)
        do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, D], do_desc.layout)
        stat_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BM], stat_smem)
        delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BM], stat_smem)
        ds_bufs = gl.allocate_shared_memory(dtype, [4, BN, BM], gl.NVMMASharedLayout.get_default_for([BN, BM], dtype))
        dq_bufs = gl.allocate_shared_memory(gl.float32, [4, BM, DQ_COLS], dq_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=2)        # the TMA copies' expect, the statistics' arrive
            mbarrier.init(empty.index(i), count=2)        # both consumers release every slot
        for i in gl.static_range(2):
            mbarrier.init(ds_full.index(i), count=2)      # both consumers' dS^T stored
            mbarrier.init(ds_free.index(i), count=2)      # both consumers' dQ GEMMs done with it
        fence_async_shared()
        k_row = bhk * n_k + c0
        WG0: gl.constexpr = 0       # the warpgroups' indices as constexprs (a literal reaches _consumer as a value)
        WG1: gl.constexpr = 1
        gl.warp_specialize([
            (_consumer, (q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, kv_bar, ready, empty, ds_bufs,
                         ds_full, ds_free, dq_bufs, dq_desc, DK, DV, bhk, c0, n_q, n_k, total, n_tiles, i_lo, q_head0,
                         causal_shift, qk_scale, sm_scale, WG0, STAGES, CAUSAL)),
            (_consumer, (q_bufs, do_bufs, lse_bufs, delta_bufs, k_smem, v_smem, kv_bar, ready, empty, ds_bufs,
                         ds_full, ds_free, dq_bufs, dq_desc, DK, DV, bhk, c0, n_q, n_k, total, n_tiles, i_lo, q_head0,
                         causal_shift, qk_scale, sm_scale, WG1, STAGES, CAUSAL)),
            (_loader, (q_desc, k_desc, v_desc, do_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, Lse, Delta, k_smem,
                       v_smem, kv_bar, ready, empty, k_row, total, n_tiles, i_lo, q_head0, n_q, lse_scale, STAGES)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


@triton.jit
def _prologue(DO, O, Delta, DQ, heads, n_q, so_b, so_h, so_n, D: tl.constexpr, ROWS: tl.constexpr):
    """Program (row block, b * H + h): Delta = rowsum(dO * O) in fp32 for ROWS query rows of one head, and those
    rows of dQ's fp32 buffer zeroed (dO, Delta, DQ contiguous; O any strides with a unit last one)."""
    bh = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    ok = (rows < n_q)[:, None]
    flat = (bh * n_q + rows).to(tl.int64)
    o_rows = (bh // heads).to(tl.int64) * so_b + (bh % heads).to(tl.int64) * so_h + rows.to(tl.int64) * so_n
    do = tl.load(DO + flat[:, None] * D + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    o = tl.load(O + o_rows[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(Delta + flat, tl.sum(do * o, axis=1), mask=rows < n_q)
    tl.store(DQ + flat[:, None] * D + cols[None, :], tl.zeros([ROWS, D], tl.float32), mask=ok)


PROLOGUE_ROWS = 32


def gluon_bwd(grad_out, q, k, v, out, lse2, causal: bool = False, scale=None, tiles=None, lse_scale: float = 1.0,
              heads_fastest: bool | None = None):
    """(dq, dk, dv) of softmax attention on sm_90 (no autograd): q [B, Hq, Nq, D] and k, v [B, Hkv, Nk, D]
    contiguous, float16 / bfloat16, D in HEAD_DIMS; out, grad_out [B, Hq, Nq, D] (any strides; grad_out is copied
    when not contiguous); lse2 [B, Hq, Nq] fp32, the base-2 row statistic (p = exp2(q.k * scale * log2(e) - lse2);
    ELSA's forward stores it, +inf for a row that sees no key), or any row statistic that lse_scale times makes it
    (log2 e for a natural-log lse). Causal is bottom-right aligned. dk, dv are summed over each key/value head's query
    group. tiles: (BLOCK_M, BLOCK_N, STAGES, DQ_COLS) instead of TILES'; heads_fastest: the launch order (None:
    heads_fastest_pays')."""
    shape = check_inputs(NAME, q, k, v, causal=causal, scale=scale)
    if not usable(q, k, v, grad_out):         # a grad_out that is not contiguous: Launch copies it
        raise ValueError(f"{NAME}: needs triton {GLUON_VERSION}'s Gluon, an sm_90 GPU, float16/bfloat16, head dim in "
                         f"{HEAD_DIMS} and contiguous, 16-byte aligned inputs (got {q.dtype}, D={shape.head_dim}, "
                         f"{q.device}, triton {triton.__version__})")
    tiles = tiles or TILES[(shape.head_dim, causal)]
    if (shape.head_dim // 2) % tiles[3]:
        raise ValueError(f"{NAME}: DQ_COLS {tiles[3]} does not divide a warpgroup's {shape.head_dim // 2} columns of "
                         f"dQ (head dim {shape.head_dim})")
    if out.stride(-1) != 1:
        out = out.contiguous()
    return Launch(q, k, out.stride()[:3], causal, default_scale(scale, shape.head_dim), tiles, lse_scale,
                  heads_fastest)(grad_out, q, k, v, out, lse2)


def heads_fastest_pays(batch: int, kv_heads: int, group: int, n_q: int, n_k: int, tiles, causal: bool,
                       sms: int) -> bool:
    """Whether the launch takes heads fastest (HEADS_FASTEST_MIN_GAIN): causal, where the blocks-fastest order's
    busiest SM has that much more work."""
    if not causal:
        return False
    block_m, block_n = tiles[0], tiles[1]
    c0 = np.arange(triton.cdiv(n_k, 2 * block_n)) * 2 * block_n
    i_lo = np.maximum(c0 - (n_k - n_q), 0) // block_m * block_m
    costs = group * np.maximum(-(-(n_q - i_lo) // block_m), 0) + 1          # per key block of one kv head
    heads = batch * kv_heads
    blocks_first = busiest_sm(np.tile(costs, heads), sms)
    return blocks_first >= HEADS_FASTEST_MIN_GAIN * busiest_sm(np.repeat(costs, heads), sms)


def grid(batch: int, kv_heads: int, n_k: int, tiles, heads_fastest: bool = False) -> tuple:
    """The launch grid: (blocks of 2 x BLOCK_N keys, batch x key/value heads), the other way round with
    heads_fastest."""
    blocks = triton.cdiv(n_k, 2 * tiles[1])
    return (batch * kv_heads, blocks) if heads_fastest else (blocks, batch * kv_heads)


class Launch:
    """gluon_bwd's launches for q, k, v laid out as those it is made with and an out of the strides o_strides (its
    batch, head and row strides; the last is 1), in the launch order heads_fastest_pays picks unless heads_fastest
    says: a caller that checked them once (ELSA's and CQSA's backward plans), called as
    ``go(grad_out, q, k, v, out, lse)`` -> (dq, dk, dv), lse * lse_scale the base-2 row statistic. Two
    Prepared launches: the prologue (_prologue: Delta and the zeroed fp32 dQ buffer) and the kernel, whose five TMA maps
    (q, k, v, dO, the fp32 dQ) are re-encoded at each call's tensors (kernels/_launch.py); then dQ cast to the inputs'
    dtype."""

    __slots__ = ("prologue", "kernel", "empty")

    def __init__(self, q, k, o_strides, causal: bool, scale: float, tiles, lse_scale: float = 1.0,
                 heads_fastest: bool | None = None):
        b, hq, n_q, d = q.shape
        hkv, n_k = k.shape[1], k.shape[2]
        block_m, block_n, stages, dq_cols = tiles
        if heads_fastest is None:
            heads_fastest = heads_fastest_pays(b, hkv, hq // hkv, n_q, n_k, tiles, causal, sm_count(q.device, 1))
        self.empty = q.numel() == 0 or n_k == 0
        # the call's tensors: dO, O, Delta, the fp32 dQ
        self.prologue = Prepared(_prologue, (triton.cdiv(n_q, PROLOGUE_ROWS), b * hq), (hq, n_q, *o_strides),
                                 dict(D=d, ROWS=PROLOGUE_ROWS, num_warps=4))
        # the call's tensors: q, k, v, dO, dQ (described), then lse2, Delta, dK, dV
        self.kernel = Prepared(_gluon_bwd_kernel, grid(b, hkv, n_k, tiles, heads_fastest), (
            hq, hq // hkv, n_q, n_k, n_k - n_q, scale * LOG2E, scale, lse_scale),
            dict(CAUSAL=causal, STAGES=stages, CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS,
                 HEADS_FASTEST=heads_fastest, num_warps=4),
            describe=tuple(described_rows(i, d, rows, cols) for i, (rows, cols) in enumerate(
                ((block_m, d), (block_n, d), (block_n, d), (block_m, d), (block_m, dq_cols)))))

    def __call__(self, grad_out, q, k, v, out, lse2):
        grad_out = grad_out.contiguous()
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        if self.empty:
            return torch.zeros_like(q), dk.zero_(), dv.zero_()
        delta = q.new_empty(q.shape[:3], dtype=torch.float32)
        dq32 = q.new_empty(q.shape, dtype=torch.float32)
        with on_device(q):
            self.prologue(grad_out, out, delta, dq32)
            self.kernel(q, k, v, grad_out, dq32, lse2.contiguous(), delta, dk, dv)
        return dq32.to(q.dtype), dk, dv


def usable(q, k, v, grad_out) -> bool:
    """Whether gluon_bwd can run these inputs: the Gluon core's conditions on q, k, v (gluon_core.available: sm_90,
    16-bit, contiguous, TMA-aligned), a head dim of HEAD_DIMS, and grad_out TMA-aligned or to be copied."""
    return (available(q, k, v) and q.shape[-1] in HEAD_DIMS
            and (not grad_out.is_contiguous() or _tma_layout_ok(grad_out)))


def eligible(q, k, v) -> bool:
    """``usable`` short of what a traced call's fake tensors cannot answer (their data pointers)."""
    return (core_eligible(q) and q.shape[-1] in HEAD_DIMS
            and all(t.is_contiguous() and t.dtype == q.dtype for t in (q, k, v)))
