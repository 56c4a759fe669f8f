"""The flash-style forward core the 16-bit kernels share: online softmax over a range of key tiles for one block
of query rows, built for Hopper (TMA tensor descriptors, warp specialization, deep pipelining) with a plain
pointer path for the Triton CPU interpreter and wherever descriptors cannot be used.

Triton helpers (call them from a kernel; every tile size and switch is a constexpr):

    base = Q + head_base(b, h, sqb, sqh)                           # a head's place, in 64 bits
    acc, m, l = init_state(BLOCK_M, BLOCK_D)                      # the identity: m = -inf, l = 0, acc = 0
    src = row_source(base, n_rows, row_stride, HEAD_DIM, BLOCK, BLOCK_D, USE_DESC)   # one head's rows
    q = load_rows(src, r0, n_rows, row_stride, ...)                # [BLOCK, BLOCK_D], zero outside
    acc, m, l = fold_keys(acc, m, l, q, k_src, v_src, skn, svn, lo, hi, r0, n_k, causal_shift, qk_scale, ...)
    out = normalize(acc, l)                                        # acc / l, 0 for a row with no visible key
    store_rows(dst, r0, out.to(dtype), n_rows, row_stride, ...)
    rows = row_index(r0 + c, BLOCK_M)                              # a per-row vector: never on r0 itself (ws)

The state (m, l, acc) is fp32 and unnormalised, in the base-2 domain: for the keys J folded so far,
m = max_j x_j, l = sum_j 2^(x_j - m), acc = sum_j 2^(x_j - m) v_j with x_j = scale * log2(e) * q . k_j.
That is exactly ELSA's per-partition summary (m, z, s) and CQSA's cross-wave state, so phase 1 of ELSA stores
it as is, CQSA loads it, folds more key ranges and stores it back, and a plain forward normalises it.
The scale is applied once per score, inside exp2, as one FMA: p = 2^(raw * qk_scale - m) with
qk_scale = scale * log2(e) (max(raw) * c == max(raw * c) since c > 0 and rounding is monotone).

fold_keys splits [lo, hi) into a hot loop of full tiles that need no mask (every key < n_k and, causal, at or
before the block's first row's horizon) and a short masked loop (the ragged end past n_k, the causal diagonal
band); warp-specialized, it is one loop (all triton 3.6's Hopper pass accepts: fold_keys' docstring). Causal is bottom-right aligned: query row i sees key j iff j <= i + causal_shift (causal_shift =
Nk - Nq for the contract's alignment, 0 for self-attention). GQA: the caller passes the kv head's base.
Head dims that are not a power of two are padded to BLOCK_D (a power of two >= 16): Triton block shapes must
be powers of two (tensor descriptors included: triton 3.6's and 3.9's interpreters reject a [8, 40] block), and
the padded columns read as zero,
so they add nothing to q . k and give zero output columns that are never stored.

Host decisions, one place each: `use_descriptors` (TMA descriptors or pointers), `warp_specialize_ok`,
`ensure_allocator` (device-side descriptors need a global scratch allocator, per thread). The standalone
forward `flash_core_fwd(q, k, v, causal, scale)` is built on the helpers; it tests and times the core alone
(kernels/FLASH_CORE.md: the floors and the predictions to check), and is not a public backend.
"""
from __future__ import annotations

import functools
import inspect
import threading

import torch
import triton
import triton.language as tl

from ._common import (LOG2E, block_d, check_inputs, check_precision, default_scale, dot_precision, interpreted,
                      launch, on_device, tile_config, unit_last)

NAME = "flash_core"

# -------------------------------------------------------------------------------------------------------------
# Triton helpers
# -------------------------------------------------------------------------------------------------------------


@triton.jit
def init_state(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The empty summary (m, l, acc) = (-inf, 0, 0) for BLOCK_M rows, fp32. Returned as acc, m, l."""
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    return acc, m_i, l_i


@triton.jit
def row_source(base, n_rows, row_stride, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
               USE_DESC: tl.constexpr):
    """What one head's [n_rows, HEAD_DIM] rows (row stride row_stride, unit feature stride) are read and written
    through: a tensor descriptor of [BLOCK, BLOCK_D] tiles (TMA on Hopper; zero outside the rows and past
    HEAD_DIM, stores clipped), or without descriptors the base pointer itself."""
    if USE_DESC:
        return tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[row_stride, 1],
                                         block_shape=[BLOCK, BLOCK_D])
    else:
        return base


@triton.jit
def head_base(b, h, s_b, s_h):
    """Offset of (batch b, head h) in a strided [B, H, N, D] tensor, in 64 bits: a tensor may hold 2**31 elements."""
    return b.to(tl.int64) * s_b + h.to(tl.int64) * s_h


@triton.jit
def load_tile(ptrs, row_ok, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_ROWS: tl.constexpr):
    """A [R, BLOCK_D] tile at ptrs (every kernel's pointer loads of Q, K, V and dO rows): zero in the padding
    columns >= HEAD_DIM and, when MASK_ROWS, in the rows where row_ok is False. The compile-time cases keep the
    mask to what can be out of range (MASK_ROWS=False promises every row is in range)."""
    if MASK_ROWS:
        if BLOCK_D != HEAD_DIM:
            return tl.load(ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        else:
            return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        if BLOCK_D != HEAD_DIM:
            return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def load_rows(src, start, n_rows, row_stride, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
              USE_DESC: tl.constexpr, MASK_ROWS: tl.constexpr):
    """Rows [start, start + BLOCK) x columns [0, BLOCK_D) of src; zero past HEAD_DIM and, when MASK_ROWS (the
    descriptor path always), at rows >= n_rows. MASK_ROWS=False promises every row is < n_rows (hot loop)."""
    if USE_DESC:
        return src.load([start, 0])
    else:
        offs_r = start + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, BLOCK_D)
        # int64 row offsets: a head's rows may span more than 2^31 elements (CQSA's long sequences)
        ptrs = src + offs_r.to(tl.int64)[:, None] * row_stride + offs_d[None, :]
        return load_tile(ptrs, offs_r < n_rows, offs_d, HEAD_DIM, BLOCK_D, MASK_ROWS)


@triton.jit
def store_rows(dst, start, value, n_rows, row_stride, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
               BLOCK_D: tl.constexpr, USE_DESC: tl.constexpr):
    """Write value [BLOCK, BLOCK_D] to rows [start, start + BLOCK) of dst, only rows < n_rows and columns <
    HEAD_DIM (a descriptor clips both itself)."""
    if USE_DESC:
        dst.store([start, 0], value)
    else:
        offs_r = start + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, BLOCK_D)
        tl.store(dst + offs_r.to(tl.int64)[:, None] * row_stride + offs_d[None, :], value,
                 mask=(offs_r[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def row_index(base, BLOCK: tl.constexpr):
    """base + [0, BLOCK): a per-row index vector (row ids, slot offsets, causal limits) for a block of rows.

    Warp specialization hazard (triton 3.6 and 3.9, sm_90): the pass splits the block's rows between two consumer
    warpgroups and, for the second, adds 64 to the row coordinate of every descriptor load/store of a row-split tile
    (Q, O) -- by remapping that SSA value for every op it then clones -- and also starts the split tl.arange at 64.
    A vector `r0 + tl.arange(..)` whose r0 is such a coordinate is offset twice: rows r0 + 128.. instead of
    r0 + 64.. (the 0.18 error of the warp-specialized causal variants in the H100 sweep). So never pass a
    descriptor row coordinate itself as `base`: pass an expression of it (r0 + 1 + shift, a pointer offset) or a
    value no descriptor uses. scripts/compile_check.py audits compiled warp-specialized kernels for the pattern."""
    return tl.arange(0, BLOCK) + base


@triton.jit
def _fold_tile(acc, m_i, l_i, q, k, v, start, limit, qk_scale,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr):
    """Merge one key tile [start, start + BLOCK_N) into the state of the block's rows. MASKED: keys at or past
    limit are left out (causal: limit is a [BLOCK_M] vector, one limit per row; else the scalar n_k)."""
    raw = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)          # q . k, unscaled, fp32
    if MASKED:
        cols = start + tl.arange(0, BLOCK_N)
        if CAUSAL:
            raw = tl.where(cols[None, :] < limit[:, None], raw, float("-inf"))
        else:
            raw = tl.where(cols[None, :] < limit, raw, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(raw, 1) * qk_scale)
        # a row that has seen no visible key keeps m = -inf: take 0 as its reference so that exp2 gives 0, not NaN
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(raw, 1) * qk_scale)
        m_ref = m_new                                             # finite: every key of the tile is visible
    p = tl.exp2(raw * qk_scale - m_ref[:, None])                  # one FMA + exp2 per score
    alpha = tl.exp2(m_i - m_ref)                                  # 0 while the state is still the identity
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def fold_keys(acc, m_i, l_i, q, k_src, v_src, skn, svn, lo, hi, r0, n_k, causal_shift, qk_scale,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              CAUSAL: tl.constexpr, KEYS_EVEN: tl.constexpr, USE_DESC: tl.constexpr,
              WARP_SPECIALIZE: tl.constexpr, DOT_PREC: tl.constexpr):
    """Fold keys [lo, hi) ∩ [0, n_k) (and, causal, the ones the block's rows can see) into (acc, m, l).

    q: [BLOCK_M, BLOCK_D] for query rows r0 .. r0 + BLOCK_M - 1 (zero columns past HEAD_DIM).
    k_src, v_src: row_source()s of the kv head's keys and values (row strides skn, svn).
    KEYS_EVEN: the caller promises hi <= n_k and hi - lo a multiple of BLOCK_N (no ragged tile), so only the
    causal diagonal can need a mask. lo need not be a multiple of BLOCK_N. Returns the updated (acc, m, l).

    Without warp specialization: a hot loop of full, visible tiles with no mask, then a masked loop over the
    ragged end and the causal diagonal band. With it: ONE loop, masked on every tile unless nothing can need a
    mask (non-causal, KEYS_EVEN) -- triton 3.6's Hopper warp specialization partitions a kernel with exactly one
    loop and no branch inside it (a second loop makes the pass fail; an `if` in the loop makes it give up
    silently), so the kernel that calls this must have no other loop. The mask costs a compare and a select
    per score, hidden under the MMAs at D=128 when the consumer warpgroups overlap.
    """
    hi = tl.minimum(hi, n_k)
    if CAUSAL:
        hi = tl.minimum(hi, r0 + BLOCK_M + causal_shift)          # past the block's last row's horizon: nothing
        # per row: keys < limit are visible. Built as arange + a scalar that is not r0 itself: see row_index
        limit = tl.minimum(row_index(r0 + 1 + causal_shift, BLOCK_M), n_k)
        safe_hi = tl.minimum(hi, r0 + 1 + causal_shift)            # up to its first row's horizon: all visible
    else:
        limit = n_k
        safe_hi = hi
    if WARP_SPECIALIZE:
        for start in tl.range(lo, hi, BLOCK_N, warp_specialize=True):
            k = load_rows(k_src, start, n_k, skn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_DESC, not KEYS_EVEN)
            v = load_rows(v_src, start, n_k, svn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_DESC, not KEYS_EVEN)
            acc, m_i, l_i = _fold_tile(acc, m_i, l_i, q, k, v, start, limit, qk_scale,
                                       BLOCK_N, CAUSAL or not KEYS_EVEN, CAUSAL, DOT_PREC)
    else:
        n_full = tl.maximum(safe_hi - lo, 0) // BLOCK_N
        mid = lo + n_full * BLOCK_N
        # the hot loop: full tiles every row sees, no masks
        for start in tl.range(lo, mid, BLOCK_N):
            k = load_rows(k_src, start, n_k, skn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_DESC, False)
            v = load_rows(v_src, start, n_k, svn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_DESC, False)
            acc, m_i, l_i = _fold_tile(acc, m_i, l_i, q, k, v, start, limit, qk_scale, BLOCK_N, False, CAUSAL, DOT_PREC)
        if CAUSAL or not KEYS_EVEN:
            # the ragged end past n_k and the causal diagonal band: a few tiles, masked
            for start in tl.range(mid, hi, BLOCK_N):
                k = load_rows(k_src, start, n_k, skn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_DESC, True)
                v = load_rows(v_src, start, n_k, svn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_DESC, True)
                acc, m_i, l_i = _fold_tile(acc, m_i, l_i, q, k, v, start, limit, qk_scale, BLOCK_N, True, CAUSAL, DOT_PREC)
    return acc, m_i, l_i


@triton.jit
def normalize(acc, l_i):
    """acc / l per row, fp32; 0 for a row that saw no visible key (l = 0)."""
    has = l_i > 0
    return acc / tl.where(has, l_i, 1.0)[:, None]


# -------------------------------------------------------------------------------------------------------------
# The standalone forward on the core: one program per (query block, batch * query head)
# -------------------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["n_q", "n_k", "causal_shift"])
def _flash_core_fwd(Q, K, V, Out,
                    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
                    H, GROUP, n_q, n_k, causal_shift, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, KEYS_EVEN: tl.constexpr, USE_DESC: tl.constexpr,
                    WARP_SPECIALIZE: tl.constexpr, DOT_PREC: tl.constexpr):
    qb = tl.program_id(0)
    if CAUSAL:
        qb = tl.num_programs(0) - 1 - qb      # the longest rows first: the last wave is short blocks
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP                          # grouped-query: the kv head this query head reads, in place
    r0 = qb * BLOCK_M
    q_base = Q + head_base(b, h, sqb, sqh)
    k_base = K + head_base(b, hk, skb, skh)
    v_base = V + head_base(b, hk, svb, svh)
    o_base = Out + head_base(b, h, sob, soh)
    q_src = row_source(q_base, n_q, sqn, HEAD_DIM, BLOCK_M, BLOCK_D, USE_DESC)
    k_src = row_source(k_base, n_k, skn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_DESC)
    v_src = row_source(v_base, n_k, svn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_DESC)
    q = load_rows(q_src, r0, n_q, sqn, HEAD_DIM, BLOCK_M, BLOCK_D, USE_DESC, True)
    acc, m_i, l_i = init_state(BLOCK_M, BLOCK_D)
    acc, m_i, l_i = fold_keys(acc, m_i, l_i, q, k_src, v_src, skn, svn, 0, n_k, r0, n_k, causal_shift, qk_scale,
                              BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, CAUSAL, KEYS_EVEN, USE_DESC, WARP_SPECIALIZE,
                              DOT_PREC)
    out = normalize(acc, l_i).to(Out.dtype.element_ty)
    o_dst = row_source(o_base, n_q, son, HEAD_DIM, BLOCK_M, BLOCK_D, USE_DESC)
    store_rows(o_dst, r0, out, n_q, son, HEAD_DIM, BLOCK_M, BLOCK_D, USE_DESC)


# -------------------------------------------------------------------------------------------------------------
# Host decisions: descriptors, warp specialization, the scratch allocator, tiles
# -------------------------------------------------------------------------------------------------------------

_HAS_DESCRIPTORS = hasattr(tl, "make_tensor_descriptor")
_HAS_WARP_SPECIALIZE = "warp_specialize" in inspect.signature(tl.range.__init__).parameters


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _tma_layout_ok(t: torch.Tensor) -> bool:
    """A TMA descriptor over one head of t ([B, H, N, D], unit feature stride) needs a 16-byte aligned base for
    every (batch, head) and 16-byte aligned row strides."""
    size = t.element_size()
    if t.data_ptr() % 16:
        return False
    return all((st * size) % 16 == 0 for dim, st in zip(t.shape[:3], t.stride()[:3]) if dim > 1)


def use_descriptors(*tensors: torch.Tensor, force: bool | None = None, min_rows: int = 0) -> bool:
    """The one decision between tensor descriptors and plain pointers for the tiles of these [B, H, N, D]
    tensors. Automatic (force=None): descriptors on a CUDA device of compute capability >= 9 when Triton has
    them, every tensor's layout suits TMA and the longest tensor has at least ``min_rows`` rows (the caller's
    measured length below which pointer loads are faster: each program builds its descriptors and each launch
    allocates their global scratch, which short rows do not win back); pointers in the interpreter and elsewhere.
    force=True asks for descriptors (the interpreter runs them too: the tests use that) and is an error when the
    layout cannot take them; force=False asks for pointers."""
    if force is False:
        return False
    layout_ok = all(_tma_layout_ok(t) for t in tensors)
    if force:
        if not _HAS_DESCRIPTORS:
            raise ValueError(f"{NAME}: descriptors asked for, but triton {triton.__version__} has no "
                             "tl.make_tensor_descriptor")
        if not layout_ok:
            raise ValueError(f"{NAME}: descriptors asked for, but a tensor's base or row strides are not 16-byte "
                             "aligned (TMA needs both)")
        return True
    return descriptors_eligible(*tensors, min_rows=min_rows) and layout_ok


def descriptors_eligible(*tensors: torch.Tensor, min_rows: int = 0) -> bool:
    """What the automatic ``use_descriptors`` asks of the call short of its tensors' layout (a traced call's fake
    tensors have no data pointer): a Triton with descriptors, not the interpreter, a CUDA device of compute
    capability >= 9, and at least ``min_rows`` rows in the longest tensor."""
    t = tensors[0]
    if not _HAS_DESCRIPTORS or interpreted() or t.device.type != "cuda" or \
            max(x.shape[-2] for x in tensors) < min_rows:
        return False
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())[0] >= 9


def warp_specialize_ok(device: torch.device, descriptors: bool) -> bool:
    """Whether tl.range(..., warp_specialize=True) can be asked for: a triton that has it, descriptor loads
    (the producer partition issues TMA), and sm_90 or newer. The interpreter ignores the flag, so it may be
    asked for there too (it then runs the same loop body)."""
    if not (_HAS_WARP_SPECIALIZE and descriptors):
        return False
    if interpreted():
        return True
    return device.type == "cuda" and _capability(
        device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


_tls = threading.local()


_CUDA = torch.device("cuda")       # the current CUDA device (a device object: no string to parse per call)


def _scratch(size: int, alignment: int, stream):
    # device-side descriptors live in global scratch; torch's caching allocator makes it cheap (and graph-safe)
    return torch.empty(size, dtype=torch.int8, device=_CUDA)


def ensure_allocator() -> None:
    """Install the scratch allocator that device-side tensor descriptors need. Triton keeps it in a ContextVar,
    which a new thread (autograd's backward worker, say) does not inherit: call this before every launch that
    uses descriptors; after the first call per thread it costs one attribute read. The interpreter runs
    descriptors without one: nothing to install there."""
    if not getattr(_tls, "allocator_set", False) and not interpreted():
        triton.set_allocator(_scratch)
        _tls.allocator_set = True


# Tiles per (dtype class, padded head dim): (BLOCK_M, BLOCK_N, num_warps, num_stages).
# PLAIN_TILES: the loop without warp specialization (descriptors on sm_90, pointers elsewhere) -- causal, ragged key
# counts and every head dim where warp specialization does not pay. WS_TILES: the warp-specialized loop where it
# pays. From the H100 sweep (kernels/FLASH_CORE.md, fp16 16K TFLOP/s): D=64 tma (128, 128, 4, 3) 448 vs ws 409;
# D=128 ws (128, 128, 4, 2) 557 vs tma (128, 64, 8, 3) 500 (causal tma 491); D=80 / 96 ws 361 / 429 vs tma 269 / 330;
# D=256 tma (128, 64, 8, 2) 531 vs (64, 64, 4, 2) 303. float32 (tf32x3 dots, 3 MMAs per product) is not what this
# core is for: the least-spilling tiles compiled for sm_90 on triton 3.6 (at D >= 128 every tile tried spills).
PLAIN_TILES = {
    ("16", 16): (128, 64, 4, 3),       # not swept: ELSA's former tiles for its narrow head dims
    ("16", 32): (128, 64, 4, 3),
    ("16", 64): (128, 128, 4, 3),
    ("16", 128): (128, 64, 8, 3),
    ("16", 256): (128, 64, 8, 2),
    ("32", 16): (64, 32, 4, 2),
    ("32", 32): (64, 32, 4, 2),
    ("32", 64): (64, 32, 4, 2),
    ("32", 128): (32, 32, 8, 2),
    ("32", 256): (64, 16, 8, 2),
}
WS_TILES = {
    ("16", 128): (128, 128, 4, 2),
}
# Warp specialization on triton 3.6 / sm_90 is right only with two stages: every warp-specialized variant with
# num_stages >= 3 gave NaN in the H100 sweep (all head dims, causal or not; the cause is below the TTGIR, which is
# the same but for the ring depth), so more stages are refused (forward) and never chosen.
WS_STAGES = 2


def ws_proven(causal: bool, keys_even: bool) -> bool:
    """Where the automatic choice may warp-specialize: the cases the H100 has shown right -- non-causal with a key
    range of whole tiles (KEYS_EVEN), two stages. The causal / ragged single masked loop was wrong on the H100
    before row_index (the row double offset) and is kept to an explicit warp_specialize=True until the GPU
    tests that force it (tests/test_flash_core.py) pass there."""
    return not causal and keys_even


def default_config(dtype: torch.dtype, head_dim: int, warp_specialize: bool = False) -> dict:
    """The shipped tiles for this dtype and head dim as tile_config's defaults: with warp_specialize the
    warp-specialized loop's (where the table has none: the plain loop's at WS_STAGES), else the plain loop's."""
    key = ("32" if dtype == torch.float32 else "16", block_d(head_dim))
    if warp_specialize:
        bm, bn, w, s = WS_TILES.get(key, PLAIN_TILES[key][:3] + (WS_STAGES,))
    else:
        bm, bn, w, s = PLAIN_TILES[key]
    return {"fwd": dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s)}


def has_ws_tiles(dtype: torch.dtype, head_dim: int) -> bool:
    return ("32" if dtype == torch.float32 else "16", block_d(head_dim)) in WS_TILES


def flash_core_fwd(q, k, v, causal: bool = False, scale=None, *, precision: str = "tf32x3", config=None,
                   descriptors: bool | None = None, warp_specialize: bool | None = None):
    """Softmax attention forward through the core (no autograd): q [B, Hq, Nq, D], k, v [B, Hkv, Nk, D].

    causal is bottom-right aligned for Nq != Nk. precision: float32 dot precision (tf32x3, ieee, tf32).
    config={"fwd": {block_m, block_n, num_warps, num_stages}} overrides tiles; descriptors / warp_specialize:
    None = the automatic choice, True / False = force (an error where impossible)."""
    return forward(q, k, v, causal, scale, precision=precision, config=config, descriptors=descriptors,
                   warp_specialize=warp_specialize)[0]


def forward(q, k, v, causal: bool = False, scale=None, *, precision: str = "tf32x3", config=None,
            descriptors: bool | None = None, warp_specialize: bool | None = None):
    """flash_core_fwd, returning (out, what ran): a dict with the tiles, descriptors, warp_specialize and the
    CompiledKernel (None when nothing was launched). The sweep and the GPU tests read the compiled kernel's
    metadata: with warp specialization in effect it has more warps than asked (a producer warpgroup)."""
    shape = check_inputs(NAME, q, k, v, causal=causal, scale=scale)
    check_precision(NAME, precision)
    if not (warp_specialize is None or isinstance(warp_specialize, bool)):
        raise ValueError(f"{NAME}: warp_specialize must be a bool or None, got {warp_specialize!r}")
    if not (descriptors is None or isinstance(descriptors, bool)):
        raise ValueError(f"{NAME}: descriptors must be a bool or None, got {descriptors!r}")
    scale = default_scale(scale, shape.head_dim)
    q, k, v = unit_last(NAME, q), unit_last(NAME, k), unit_last(NAME, v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    use_desc = use_descriptors(q, k, v, out, force=descriptors)
    ws_ok = warp_specialize_ok(q.device, use_desc)
    if warp_specialize and not ws_ok:
        raise ValueError(f"{NAME}: warp specialization asked for, but it needs descriptor loads on sm_90+ and a "
                         f"triton with tl.range(warp_specialize=...) (descriptors={use_desc}, "
                         f"triton {triton.__version__})")
    if warp_specialize is None:
        # automatic: the warp-specialized tiles where the table has them and the case is proven
        ws_tiles = default_config(q.dtype, shape.head_dim, True)["fwd"]
        ws = ws_ok and has_ws_tiles(q.dtype, shape.head_dim) and \
            ws_proven(causal, shape.len_kv % ws_tiles["block_n"] == 0)
        tiles = tile_config(NAME, default_config(q.dtype, shape.head_dim, ws), config)["fwd"]
        # tiles overridden out of what is proven: the plain loop
        ws = ws and tiles["num_stages"] == WS_STAGES and ws_proven(causal, shape.len_kv % tiles["block_n"] == 0)
    else:
        ws = warp_specialize
        tiles = tile_config(NAME, default_config(q.dtype, shape.head_dim, ws), config)["fwd"]
        if ws and tiles["num_stages"] != WS_STAGES:
            raise ValueError(f"{NAME}: warp specialization needs num_stages={WS_STAGES}, got "
                             f"{tiles['num_stages']} (more stages gave NaN on the H100: kernels/FLASH_CORE.md)")
    ran = dict(tiles=tiles, descriptors=False, warp_specialize=False, compiled=None)
    if out.numel() == 0:
        return out, ran
    if shape.len_kv == 0:
        return out.zero_(), ran                 # no key at all: every row sees none
    if use_desc:
        ensure_allocator()
    bm, bn = tiles["block_m"], tiles["block_n"]
    grid = (triton.cdiv(shape.len_q, bm), shape.batch * shape.heads_q)
    with on_device(q):
        compiled = launch(_flash_core_fwd, grid, (
            q, k, v, out, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
            shape.heads_q, shape.group, shape.len_q, shape.len_kv, shape.causal_offset, scale * LOG2E), dict(
            HEAD_DIM=shape.head_dim, BLOCK_D=block_d(shape.head_dim), BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal,
            KEYS_EVEN=shape.len_kv % bn == 0, USE_DESC=use_desc, WARP_SPECIALIZE=ws,
            DOT_PREC=dot_precision(q.dtype, precision), num_warps=tiles["num_warps"], num_stages=tiles["num_stages"]))
    ran.update(descriptors=use_desc, warp_specialize=ws, compiled=compiled)
    return out, ran
