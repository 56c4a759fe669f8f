"""The attention backward written in Gluon for sm_90 (16-bit, D = 64 and 128): FA2/FA3's five GEMMs per tile.

ELSA's Triton backward (kernels/elsa/kernel.py) runs two kernels: the dQ kernel recomputes every score tile for its
query rows and the dK/dV kernel recomputes them again for its keys, seven GEMMs per (query tile, key tile) where the
gradients need five. On the H100 its fwd+bwd took 1.29x / 1.68x cuDNN's time at D = 64 / 128 (16K, results/README.md,
"Hopper speed"): the target (issue 18) is 1.1. Here one program owns a block of keys of one key/value head and walks
the query tiles of every query head of its group, as FA2 and FA3 do:

    S^T = K Q^T,  P^T = exp2(S^T * qk_scale - lse2),  dP^T = V dO^T,  dS^T = P^T * (dP^T - Delta)
    dV += P^T dO,  dK += dS^T Q,  dQ += dS K  (fp32 atomics into a [B, Hq, Nq, D] buffer, scaled by sm_scale)

with K and V of the block in shared memory for the whole walk, Q and dO streamed by TMA through a two-slot ring
(the next tile's copy in flight while this one computes), P^T and dS^T as the register A operands of their wgmmas,
dS^T staged in shared memory once for dQ's (its transpose is dQ's A operand). lse2 is the base-2 row statistic
ELSA's forward stores (p = exp2(x * qk_scale - lse2), +inf for a row that sees no key), Delta = rowsum(dO * O) in
fp32, made by the host before the launch; dQ's buffer is cast to the inputs' dtype after it.

This is the first step, before the structure FA3 adds (a producer warp, two consumer warpgroups, the MMAs left in
flight across the softmax): one warpgroup issues everything and waits for each GEMM. Written and compiled for sm_90
with triton 3.6 (scripts/compile_check.py --kernel gluon_core), not yet run on a GPU: tests/test_gluon_core.py's
GPU tests check it against float64 the first time a GPU runs them; nothing calls it but them, until it is measured
against the Triton backward.

Masks: a key past NK (a tile running past its head's keys reads the next head's rows, or TMA's zeros at the end) has
its P^T row set to 0, so it adds nothing to dQ, and its dK/dV rows are not stored; a query row past NQ has lse2 = +inf
(P^T = 0) and Delta = 0; causal (bottom-right, key n visible from query m iff n <= m + NK - NQ) zeroes P^T above the
diagonal and skips the query tiles that see none of the block's keys.
"""
from __future__ import annotations

import torch
import triton

from ._common import LOG2E, check_inputs, default_scale, on_device
from ._gluon_core import GLUON_VERSION, HAS_GLUON, available, tile_descriptor
from ._launch import launch as _launch

NAME = "gluon_bwd"
HEAD_DIMS = (64, 128)
BLOCK_N = 64          # keys per program: one warpgroup's wgmma M for S^T, dP^T, dK and dV
BLOCK_M = 64          # query rows per tile of the walk
NUM_WARPS = 4
DQ_COLS = 64          # dQ's part is made and added this many columns at a time

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)

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
    def _gluon_bwd_kernel(q_desc, k_desc, v_desc, do_desc, Lse, Delta, DQ, DK, DV, heads, group, n_q, n_k,
                          causal_shift, qk_scale, sm_scale, CAUSAL: gl.constexpr, DQ_COLS: gl.constexpr):
        """Program (key block kb, b * Hkv + hk): dK, dV of keys [kb * BLOCK_N, + BLOCK_N) of kv head hk, summed over
        the group's query heads, and their part of dQ (atomics into DQ, fp32 [B, Hq, Nq, D])."""
        BN: gl.constexpr = k_desc.block_type.shape[0]
        D: gl.constexpr = k_desc.block_type.shape[1]
        BM: gl.constexpr = q_desc.block_type.shape[0]
        dtype: gl.constexpr = k_desc.dtype
        # S^T, dP^T [BN, BM]; dK, dV [BN, D]; dQ's part [BM, D]: one warpgroup's wgmma tiles
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BM, 16])
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, D, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
        key_l: gl.constexpr = gl.SliceLayout(1, st_layout)
        qrow_l: gl.constexpr = gl.SliceLayout(0, st_layout)
        ds_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BM], dtype)

        kb = gl.program_id(0)
        bhk = gl.program_id(1)
        kv_heads = heads // group
        b = bhk // kv_heads
        hk = bhk % kv_heads
        c0 = kb * BN
        k_row = bhk * n_k + c0
        q_head0 = b * heads + hk * group          # the group's first query head, as a row of [B * Hq]
        # causal: query rows below c0 - shift see none of these keys
        i_lo = 0
        if CAUSAL:
            i_lo = (gl.maximum(c0 - causal_shift, 0) // BM) * BM
        n_tiles = gl.maximum(gl.cdiv(n_q - i_lo, BM), 0)
        total = group * n_tiles

        k_smem = gl.allocate_shared_memory(dtype, [BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BN, D], v_desc.layout)
        q_bufs = gl.allocate_shared_memory(dtype, [2, BM, D], q_desc.layout)
        do_bufs = gl.allocate_shared_memory(dtype, [2, BM, D], do_desc.layout)
        ds_smem = gl.allocate_shared_memory(dtype, [BN, BM], ds_smem_layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(2):
            mbarrier.init(ready.index(i), count=1)
        fence_async_shared()

        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row, 0], kv_bar, k_smem)
        tma.async_copy_global_to_shared(v_desc, [k_row, 0], kv_bar, v_smem)
        for it in gl.static_range(2):
            if it < total:
                i0, row = _tile_row(it, n_tiles, i_lo, q_head0, n_q, BM)
                _load_q_do(q_desc, do_desc, q_bufs, do_bufs, ready, it, row)

        keys = c0 + gl.arange(0, BN, layout=key_l)
        key_ok = keys < n_k
        dk = gl.zeros([BN, D], gl.float32, kv_layout)
        dv = gl.zeros([BN, D], gl.float32, kv_layout)
        zero_st = gl.zeros([BN, BM], gl.float32, st_layout)
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, DQ_COLS, 16])
        dq_rows_l: gl.constexpr = gl.SliceLayout(1, dq_layout)
        dq_cols = gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, dq_layout))
        mbarrier.wait(kv_bar, 0)

        for it in range(total):
            s = it % 2
            i0, row = _tile_row(it, n_tiles, i_lo, q_head0, n_q, BM)
            q_smem = q_bufs.index(s)
            do_smem = do_bufs.index(s)
            mbarrier.wait(ready.index(s), (it // 2) & 1)
            # S^T = K Q^T and dP^T = V dO^T, both [BN, BM]
            st = warpgroup_mma(k_smem, q_smem.permute((1, 0)), zero_st, use_acc=False, is_async=True)
            dpt = warpgroup_mma(v_smem, do_smem.permute((1, 0)), zero_st, use_acc=False, is_async=True)
            qrows = i0 + gl.arange(0, BM, layout=qrow_l)
            q_ok = qrows < n_q
            stat = row - i0 + qrows                 # the rows' index in [B * Hq * Nq]
            lse2 = gl.load(Lse + stat, mask=q_ok, other=float("inf"))
            delta = gl.load(Delta + stat, mask=q_ok, other=0.0)
            st, dpt = warpgroup_mma_wait(0, deps=[st, dpt])
            keep = key_ok[:, None] & q_ok[None, :]
            if CAUSAL:
                keep = keep & (keys[:, None] <= qrows[None, :] + causal_shift)
            pt = gl.where(keep, gl.exp2(st * qk_scale - lse2[None, :]), 0.0)
            dst = pt * (dpt - delta[None, :])
            pt_op = gl.convert_layout(pt.to(dtype), a_layout)
            dst16 = dst.to(dtype)
            dst_op = gl.convert_layout(dst16, a_layout)
            ds_smem.store(dst16)
            fence_async_shared()
            # dV += P^T dO, dK += dS^T Q ([BN, D]); dQ's part = dS K = (dS^T)^T K ([BM, D]), DQ_COLS columns at a
            # time (at D = 128 a whole [BM, D] fp32 part beside dK and dV spilled 184-200 bytes)
            dv = warpgroup_mma(pt_op, do_smem, dv, is_async=True)
            dk = warpgroup_mma(dst_op, q_smem, dk, is_async=True)
            dq_rows = i0 + gl.arange(0, BM, layout=dq_rows_l)
            dq_base = DQ + (row - i0 + dq_rows).to(gl.int64)[:, None] * D
            for j in gl.static_range(D // DQ_COLS):
                dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem.slice(j * DQ_COLS, DQ_COLS, dim=1),
                                   gl.zeros([BM, DQ_COLS], gl.float32, dq_layout), use_acc=False, is_async=True)
                dq = warpgroup_mma_wait(0, deps=[dq])
                gl.atomic_add(dq_base + (j * DQ_COLS + dq_cols)[None, :], dq * sm_scale,
                              mask=(dq_rows < n_q)[:, None], sem="relaxed")
            dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])
            # the slot's Q and dO are read: the tile two steps on may load into it
            if it + 2 < total:
                _, next_row = _tile_row(it + 2, n_tiles, i_lo, q_head0, n_q, BM)
                _load_q_do(q_desc, do_desc, q_bufs, do_bufs, ready, s, next_row)

        rows = c0 + gl.arange(0, BN, layout=gl.SliceLayout(1, kv_layout))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, kv_layout))
        offs = (bhk * n_k + rows).to(gl.int64)[:, None] * D + cols[None, :]
        store_ok = (rows < n_k)[:, None]
        gl.store(DK + offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=store_ok)
        gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=store_ok)


def gluon_bwd(grad_out, q, k, v, out, lse2, causal: bool = False, scale=None):
    """(dq, dk, dv) of softmax attention on sm_90 (no autograd): q, out, grad_out [B, Hq, Nq, D], k, v [B, Hkv, Nk,
    D], contiguous, float16 / bfloat16, D in HEAD_DIMS; lse2 [B, Hq, Nq] fp32, the base-2 row statistic
    (p = exp2(q.k * scale * log2(e) - lse2); ELSA's forward stores it, +inf for a row that sees no key). Causal is
    bottom-right aligned. dk, dv are summed over each key/value head's query group."""
    shape = check_inputs(NAME, q, k, v, causal=causal, scale=scale)
    if not (available(q, k, v) and q.shape[-1] in HEAD_DIMS and all(t.is_contiguous() for t in (grad_out, out))):
        raise ValueError(f"{NAME}: needs triton {GLUON_VERSION}'s Gluon, an sm_90 GPU, float16/bfloat16, head dim in "
                         f"{HEAD_DIMS} and contiguous, 16-byte aligned inputs (got {q.dtype}, D={shape.head_dim}, "
                         f"{q.device}, triton {triton.__version__})")
    scale = default_scale(scale, shape.head_dim)
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0 or n_k == 0:
        return torch.zeros_like(q), dk.zero_(), dv.zero_()
    delta = (grad_out.float() * out.float()).sum(-1)
    dq32 = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    with on_device(q):
        _launch(_gluon_bwd_kernel, (triton.cdiv(n_k, BLOCK_N), b * hkv), (
            tile_descriptor(q.view(-1, d), BLOCK_M, d), tile_descriptor(k.view(-1, d), BLOCK_N, d),
            tile_descriptor(v.view(-1, d), BLOCK_N, d), tile_descriptor(grad_out.view(-1, d), BLOCK_M, d),
            lse2.contiguous(), delta, dq32, dk, dv, hq, hq // hkv, n_q, n_k, n_k - n_q, scale * LOG2E, scale),
            dict(CAUSAL=causal, DQ_COLS=DQ_COLS, num_warps=NUM_WARPS))
    return dq32.to(q.dtype), dk, dv
