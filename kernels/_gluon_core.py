"""The Hopper forward written in Gluon (triton.experimental.gluon): FA3's structure, for 16-bit inputs on sm_90.

Plain Triton's warp-specialized core (kernels/_flash_core.py) stops at ~557 TFLOP/s at D=128 16K on the H100 (1.09x
cuDNN's time): its compiler-made partitions wait on loads and on barriers between producer and consumers, and
each consumer runs its two GEMMs and its softmax in sequence. Here the partitions are written out
(kernels/FLASH_CORE.md, "Gluon"):

- a loader partition (1 warp) streams K and V tiles by TMA into a ring of STAGES buffers, with a ready and an empty
  mbarrier per buffer and operand; Q by TMA once;
- two consumer partitions (one warpgroup each: the default partition and a worker) each own 64 of the CTA's 128
  query rows and share every K/V tile (the empty barriers count every consumer's arrival);
- inside a consumer the GEMMs overlap the softmax (FA3's intra-warpgroup pipelining): S_j = Q K_j^T is issued,
  then O += P_{j-1} V_{j-1} on the previous tile's probabilities (P from registers, in the wgmma A-operand
  layout), and the softmax of S_j runs while that second GEMM is in flight;
- PINGPONG (FA3's inter-warpgroup schedule): the two consumers take turns to issue their GEMMs, handing a token
  through two mbarriers, so one consumer's softmax runs while the other's GEMMs use the tensor cores;
- at D = 64, where their items fill the SMs about as well (consumers_for), three consumers instead, 192 query rows
  a CTA, each running S_j, its softmax and O += P_j V_j in turn with neither overlap nor turns: their softmaxes
  interleave on the SM while another's GEMMs run. PASA's fp16 state, whose P is 16-bit from its exponent on and
  whose row sums are the tensor cores', fits the overlap in three consumers' registers: its three keep it (no turns).

The state is the core's: fp32 (m, l, acc) in the base-2 domain with the scale folded into exp2 (one FMA per
score). Causal is bottom-right aligned (row i sees keys j <= i + causal_shift); GQA reads the kv head in place.
A work item is the CTA's query rows (64 a consumer) and one key partition; the plain grid (row blocks, B*Hq,
partitions) runs one per program, a persistent launch (`launch(persistent=...)`, by default at D = 64 and 128:
PERSISTENT_DIMS) runs one program per SM that walks them in rounds, its ring's slots, phases and ping-pong turns
running on from one item to the next, Q reloaded once every consumer is past it (a `q_empty` barrier): an item's
epilogue overlaps the next one's loads and no last wave runs part-empty. An item writes the normalised output (and an
LSE), or with SUMMARY its state into ELSA's phase-1 summary slots (fp32 m and l, the normalised partial output in the
inputs' dtype: partition 0's in the output rows), so ELSA's phase 1 runs on it through `launch`
(kernels/elsa/host.py) with the same phase 2 as the Triton phase 1. With a tile walk (`launch(walk=...)`, RANGES) a
program takes the rows of one item and walks a list of key ranges, each with its own end and causal shift (CQSA's
joined slot waves: kernels/cqsa/schedule.py's tile_walk), the loader and every consumer stepping one cursor tile by
tile. With PASA (`launch(pasa_c=...)`) the consumers take PASA's step instead of the online softmax, on the shifted
keys of its pre-pass, its state held as float16 values (P then in float16 arithmetic, its row sums on the tensor
cores) or, in its hybrid mode, in float32 (`pasa_state`;
kernels/pasa/ops.py, "The Hopper path"; kernels/FLASH_CORE.md, "Gluon: built"). The TMA descriptors span the
flattened [B*H*N, D] rows: a tile that runs past a head's last key reads the next head's rows (TMA's zeros past the
tensor's end), whose scores are masked to -inf and whose values are weighted by 0; query rows past a head's end are
computed and never stored.

Head dims (SPLITS): 64, 128 and 256 as one column tile; 80, 96, 160 and 192 as two (64 + 16, 64 + 32, 128 + 32,
128 + 64), loaded by a second set of descriptors onto the same barriers: QK^T is two MMAs into one accumulator, P.V
two into two, so no MMA runs on padded columns (the Triton core pads 80 and 96 to 128, 160 and 192 to 256).

What this file needs and where it runs: triton 3.6's Gluon API (`gl.warp_specialize(functions_and_args,
worker_num_warps, worker_num_regs)`; later versions changed it), an sm_90 device, a head dim of SPLITS, contiguous
[B, H, N, D] inputs of 16 bits. `available(q, k, v)` is the one test; nothing here runs on the CPU (Gluon has no
interpreter), so the CPU and exactness reference stays the plain core. `gluon_fwd` is the standalone forward, for
tests and timing. A launch builds three host-side descriptors (six for a split head dim); their TMA maps cost
~100-160 us of CPU per ELSA forward (results/dev/gluon_core/elsa_host_time_h100.json), which is why ELSA takes this
core only for enough work.
Making the descriptors in the kernel instead (pointers only at launch, ~35-65 us of CPU per ELSA forward, as on the
Triton core) was measured and not taken: every CTA then builds three TMA maps, and ELSA's phase 1 took 2-7 % longer
at every shape where ELSA uses the core (the same file) -- more than the host time it saves, hidden there. With the
persistent launch (132 programs, each building its maps once) the GPU time was the same or up to 6 % longer and the
host time did not fall everywhere (results/dev/gluon_core/device_descriptors_persistent_h200.json): still not taken.
"""
from __future__ import annotations

import functools
import heapq

import numpy as np
import torch
import triton

from ._common import LOG2E, PASA_M_INIT, check_inputs, default_scale, on_device, sm_count
from ._flash_core import _capability, _tma_layout_ok
from ._launch import Prepared

NAME = "gluon_core"
# head dim -> (D0, D1): the columns of every Q/K/V row as two tiles of power-of-two widths (Gluon's register tensors
# have power-of-two shapes), D1 = 0 for none. wgmma takes K in steps of 16 and N in steps of 8, so QK^T over D0 + D1
# is two MMAs into one accumulator and P.V two MMAs into two (64 x D0 and 64 x D1): D = 80 and 96 run no padded
# columns, where the Triton core pads them to 128 (37.5 % and 25 % of its MMA work on zeros). Each entry is exact
# against float64 on the H100 (tests/test_gluon_core.py) and faster there in ELSA than the Triton core.
SPLITS = {64: (64, 0), 80: (64, 16), 96: (64, 32), 128: (128, 0), 160: (128, 32), 192: (128, 64), 256: (256, 0)}
HEAD_DIMS = tuple(SPLITS)
GLUON_VERSION = "3.6"      # the Gluon API this file is written against (warp_specialize's signature changed later)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    HAS_GLUON = True
except ImportError:            # a triton without Gluon: available() says no
    HAS_GLUON = False

ROWS_PER_CONSUMER = 64       # one warpgroup's wgmma M
# Consumer warpgroups a CTA: a work item is 64 x that many query rows. Two overlap their GEMMs with their softmax
# inside each warpgroup and take turns at the tensor cores (the module's docstring). At D = 64 the softmax outlasts
# the GEMMs it overlaps, and three warpgroups of 160 registers that interleave freely (each S_j, its softmax and
# O += P_j V_j in turn: S, P and O fit without the overlap's second tile) run a query row's keys in 0.91 of two's
# time: ELSA's forward on the H200 where both counts' items fill their SMs alike (B = 1, H = 8: 6K 0.91, 12K 0.92,
# 12K causal 0.91; results/dev/gluon_core/three_consumers_rule_h200.json). But a CTA of 192 rows makes 2/3 as many
# items, and where their last round fills worse, three lose: the core alone at 4K (176 items on 132 SMs: 1.3x two's
# time, three_consumers_h200.json), CQSA's walk at 12K (1.07x). So consumers_for weighs the busiest SM's work under
# either count (busiest_sm, from the caller's items) by THREE_CONSUMERS_ROW_TIME. It picks the faster count, or
# one within 1 %, at all 21 of that file's shapes (ELSA 4K-16K, B x H 8-32, causal, fwd+bwd; CQSA 8K-32K, causal)
# and at ELSA's, CQSA's and the core's in three_consumers_h200.json but one: the core alone at 16K (1,024 items of
# 16K keys), where it picks two and three took 0.97 of their time (only gluon_fwd, tests and probes, runs that).
# PASA's step, which needs the overlap more, lost with three without it (16K: 1.25x in its fp16 state, 1.06x
# hybrid); its fp16 state keeps the overlap in three (_consumer) and weighs them by its own row time
# (kernels/pasa/ops.py, THREE_CONSUMERS_ROW_TIME). At D = 128 three do not fit with 128-key tiles and lost with 64
# (three_consumers_plain_grid_h200.json; PASA's fp16 state too: results/dev/pasa/key_tiles_d128_h200.json).
THREE_CONSUMER_DIMS = (64,)
THREE_CONSUMERS_ROW_TIME = 0.91
# (consumer, loader) registers a thread by consumer count: 2 x 128 x 240 + 128 x 24, 3 x 128 x 160 + 128 x 24
# (the loader's warpgroup is one warp and three parked ones) within sm_90's 65,536 a CTA
REGS = {2: (240, 24), 3: (160, 24)}
# busiest_sm takes the mean from this many items a SM: their last round's rounding is then under 2 %
FLUID_ROUNDS = 64


def busiest_sm(costs, sms: int) -> float:
    """The work of the busiest of `sms` SMs when the items (their costs, in launch order) each go to the SM that is
    free first, one CTA a SM: the plain grid's hardware scheduler, and for items of one cost the persistent launch's
    rounds. From FLUID_ROUNDS items a SM, the mean."""
    costs = np.asarray(costs, dtype=np.float64).ravel()
    if costs.size >= FLUID_ROUNDS * sms:
        return float(costs.sum()) / sms
    loads = [0.0] * min(sms, max(costs.size, 1))
    for cost in costs.tolist():
        heapq.heapreplace(loads, loads[0] + cost)
    return max(loads)


def consumers_for(d: int, busiest, row_time: float | None = None) -> int:
    """Consumer warpgroups a CTA at head dim d: three at THREE_CONSUMER_DIMS where their busiest SM's work, weighed by
    row_time (three's time a query row over two's; None: THREE_CONSUMERS_ROW_TIME, the online softmax's), is below
    two's, else two. busiest(consumers): the caller's busiest_sm of its items (query rows x keys each) with CTAs of
    64 x consumers rows."""
    row_time = THREE_CONSUMERS_ROW_TIME if row_time is None else row_time
    if d in THREE_CONSUMER_DIMS and row_time * busiest(3) < busiest(2):
        return 3
    return 2


def core_consumers(d: int, bh: int, len_q: int, len_kv: int, sms: int, row_time: float | None = None) -> int:
    """consumers_for of gluon_fwd's items (and PASA's): each row block of each of the bh heads against every key."""
    return consumers_for(d, lambda c: busiest_sm(
        np.full(-(-len_q // (c * ROWS_PER_CONSUMER)) * bh, c * ROWS_PER_CONSUMER * len_kv), sms), row_time)


# (BLOCK_N, STAGES) per head dim: shared memory holds Q (64 rows a consumer x D) and STAGES K and V tiles (<= 227
# KB). From D = 192 the 64-key tiles keep the consumers' accumulators, scores and probabilities within their 240
# registers (sm_90 compile check, scripts/compile_check.py --kernel gluon_core); D = 160 spills 72-192 bytes with
# 128-key tiles and still ran 7-8 % faster than with 64 on the H100 (results/dev/gluon_core/head_dims_h100.json,
# "tiles", where the other head dims' candidates lost). D = 128 with 192-key tiles (FA3's 176 is near it), held as two
# score tiles of 128 and 64 keys, was exact and slower in ELSA, CQSA and causal calls (kernels/FLASH_CORE.md)
TILES = {64: (128, 3), 80: (128, 3), 96: (128, 3), 128: (128, 2), 160: (128, 2), 192: (64, 2), 256: (64, 2)}
# ELSA's phase 1 and CQSA's resident forward take this core from this much work (B*Hq * Nq * Nk * D; PASA has its
# own, kernels/pasa/ops.py). It was 2^34 while each launch built its host-side descriptor objects (~48 us of CPU per
# launch on the H200 host, ~100-160 us per ELSA forward on the H100's: results/dev/gluon_core/elsa_host_time_h100.json).
# A prepared launch re-encodes only the TMA maps (kernels/_launch.py; ELSA's forward 83-157 -> 30-55 us of host time,
# results/dev/gluon_core/launch_host_time_h200.json), and then the core is faster than the Triton core or as fast
# from 2^31 (the same file, "min_work"; fp16 over cuDNN, eager / CUDA graph): ELSA at B=1, H=8, 2K, D=64 0.95 / 1.06
# against 0.97 / 1.51, 4K D=64 1.18 / 1.14 against 1.22 / 1.18, H=1 8K D=64 0.76 against 0.92; below 2^31 the same
# (H=1 4K D=64, 2^30: 0.73 against 0.72). CQSA over flash: 2K D=64 1.03 against 1.23, 4K D=128 0.92 against 1.34,
# H=1 4K D=128 0.83 against 0.94, one loss, 32 heads of 2K at D=64 (1.26 against 1.17)
MIN_WORK = 2**31
# The persistent launch (launch(persistent=...)): a program per SM walks the work items, so an item's epilogue
# overlaps the next one's loads and no last wave runs part-empty. Measured against the plain grid on the H200
# (results/dev/gluon_core/persistent_h200.json): faster or the same everywhere not causal (PASA 0.96-1.0 of the plain
# grid's time). Causal, the items' costs differ and the causal order (_work) evens them out where they differ much,
# while it gives up the plain grid's sharing of a head's keys in L2: how many rounds pay is each caller's own (its
# items' spread of costs, its step's weight), so a causal launch runs persistent only with the caller's
# causal_rounds (persistent_default): ELSA's kernels/elsa/config.py causal_rounds, PASA's kernels/pasa/ops.py's.
# D = 64 and 128 measured; the split head dims and 256 stay on the plain grid.
PERSISTENT_DIMS = (64, 128)
# The kernel's PASA constexpr: not PASA, or PASA's step with its state (m, l, the pseudo-average g, acc) held as
# float16 values (the paper's full fp16 mode) or in float32 (its hybrid mode: only the scores Ŝ are float16).
PASA_STATES = {"fp16": 1, "fp32": 2}


if HAS_GLUON:
    M_INIT = gl.constexpr(PASA_M_INIT)      # (a Gluon kernel reads globals only as constexprs)
    PASA_FP16_STATE = gl.constexpr(PASA_STATES["fp16"])

    @gluon.jit
    def released(bar):
        """A partition's shared-memory stores made visible to the tensor cores' reads, then one arrive on bar for
        the whole partition: how ELSA's float32 phase 1 and the Gluon backward hand over a buffer they wrote."""
        fence_async_shared()
        gl.thread_barrier()                  # every thread's stores before the one arrive (the partition's warps)
        mbarrier.arrive(bar, count=1)

    @gluon.jit
    def _rounds(n_items, CAUSAL: gl.constexpr):
        """A persistent program's item count: items go out in rounds of one per program (_work), and the last
        round is partial; causal rounds alternate their direction, so who gets one of the last round does too."""
        programs = gl.num_programs(0)
        full = n_items // programs
        pos = gl.program_id(0)
        if CAUSAL:
            pos = gl.where(full % 2 == 1, programs - 1 - pos, pos)
        return full + (pos < n_items - full * programs).to(gl.int32)

    @gluon.jit
    def _work(w, Items, heads, group, bh_total, n_q, n_k, k_rows, causal_shift, q0, n_blocks, width, parts,
              ROWS: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, RANGES: gl.constexpr,
              PERSISTENT: gl.constexpr):
        """A work item: ROWS query rows (the CTA's Q) of one head against one key partition (or a walk's item). The
        plain grid's program (qb, bh, part) takes one, decoded from its ids; a persistent program takes item w of its
        rounds: round w's items are w * programs + [0, programs), in the plain grid's order when not causal (qb
        fastest, the programs of a round share a head's keys), and causal, the longest row blocks first (qb from the
        last, then the partition, the head fastest), each other round backwards: a long item of one round meets a
        short one of the next, and the programs' work evens out. Each partition decodes the same items (scalar work).
        Returns (q_row, k_row, v_row, row0, row_end, lo, hi, n_tiles, n_unmasked, slot, s_slot, r0): the item's first
        Q row (of all heads' rows), K and V rows, first query row within its head, end of the rows it stores, key
        bounds, tile count, unmasked tiles, ELSA's summary slots and a walk's first range."""
        if PERSISTENT:
            programs = gl.num_programs(0)
            if CAUSAL:
                item = w * programs + gl.where(w % 2 == 0, gl.program_id(0), programs - 1 - gl.program_id(0))
                bh = item % bh_total
                part = (item // bh_total) % parts
                qb = n_blocks - 1 - item // (bh_total * parts)
            else:
                item = w * programs + gl.program_id(0)
                qb = item % n_blocks
                bh = (item // n_blocks) % bh_total
                part = item // (n_blocks * bh_total)
        else:
            bh = gl.program_id(1)
            qb = gl.program_id(0)
            if CAUSAL:
                qb = n_blocks - 1 - qb                    # the longest rows first
            part = gl.program_id(2)
        b = bh // heads
        hk = (bh % heads) // group
        kv_head = b * (heads // group) + hk
        if RANGES:
            entry = Items + 4 * gl.program_id(0)
            row0 = gl.load(entry)
            row_end = gl.load(entry + 1)              # the rows stored: [row0, row_end)
            r0 = gl.load(entry + 2)
            n_tiles = gl.load(entry + 3)              # >= 1 (tile_walk)
            lo = 0                                    # ELSA's partition bounds and slot: not used by a walk
            hi = 0
            n_unmasked = 0
            slot = 0
            s_slot = 0
        else:
            row0 = q0 + qb * ROWS                         # the item's first query row within its head
            lo = part * width
            hi = gl.minimum(lo + width, n_k)
            if CAUSAL:
                # keys past the item's last row's horizon are future for all its rows
                hi = gl.minimum(hi, row0 + ROWS + causal_shift)
                seen = gl.minimum(row0 + 1 + causal_shift, n_k)      # keys every row of the item sees
            else:
                seen = n_k
            # tiles [0, n_unmasked) are whole and seen by every row: no mask; at least one tile is run (a causal
            # partition with hi <= lo computes one masked tile and stores nothing)
            n_tiles = gl.maximum(gl.cdiv(hi - lo, BLOCK_N), 1)
            n_unmasked = gl.maximum(seen - lo, 0) // BLOCK_N
            slot = ((part * n_blocks + qb) * bh_total + bh) * ROWS
            s_slot = slot - n_blocks * bh_total * ROWS    # partition 0 has none: it is in Out
            row_end = n_q
            r0 = 0
        # the partition's first key (a walk's tiles add their range's first key)
        return (bh * n_q + row0, kv_head * k_rows + lo, kv_head * n_k + lo, row0, row_end, lo, hi, n_tiles,
                n_unmasked, slot, s_slot, r0)

    @gluon.jit
    def _loader(q_desc, k_desc, v_desc, q2_desc, k2_desc, v2_desc, q_bufs, k_bufs, v_bufs, q2_bufs, k2_bufs, v2_bufs,
                q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, Items, Ranges, heads, group, bh_total, n_q, n_k,
                k_rows, causal_shift, q0, n_blocks, width, parts, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                D1: gl.constexpr, CAUSAL: gl.constexpr, RANGES: gl.constexpr, PASA: gl.constexpr,
                PERSISTENT: gl.constexpr):
        ROWS: gl.constexpr = q_bufs.type.shape[0] * q_bufs.type.shape[1]     # consumers x their rows
        if PERSISTENT:
            g = 0                                     # the ring's tiles so far: its slots and phases run on
            for w in range(_rounds(n_blocks * bh_total * parts, CAUSAL)):
                q_row, k_row, v_row, row0, row_end, lo, hi, n_tiles, n_unmasked, slot, s_slot, r0 = _work(
                    w, Items, heads, group, bh_total, n_q, n_k, k_rows, causal_shift, q0, n_blocks, width, parts,
                    ROWS, BLOCK_N, CAUSAL, RANGES, PERSISTENT)
                # Q's buffers are free once every consumer has its previous item's last S = Q K^T
                mbarrier.wait(q_empty, (w & 1) ^ 1)
                _load_item(q_desc, k_desc, v_desc, q2_desc, k2_desc, v2_desc, q_bufs, k_bufs, v_bufs, q2_bufs,
                           k2_bufs, v2_bufs, q_bar, k_ready, v_ready, k_empty, v_empty, q_row, k_row, v_row, n_k,
                           n_tiles, Ranges, r0, g, BLOCK_N, STAGES, D1, RANGES, PASA)
                g += n_tiles
        else:
            q_row, k_row, v_row, row0, row_end, lo, hi, n_tiles, n_unmasked, slot, s_slot, r0 = _work(
                0, Items, heads, group, bh_total, n_q, n_k, k_rows, causal_shift, q0, n_blocks, width, parts,
                ROWS, BLOCK_N, CAUSAL, RANGES, PERSISTENT)
            _load_item(q_desc, k_desc, v_desc, q2_desc, k2_desc, v2_desc, q_bufs, k_bufs, v_bufs, q2_bufs, k2_bufs,
                       v2_bufs, q_bar, k_ready, v_ready, k_empty, v_empty, q_row, k_row, v_row, n_k, n_tiles, Ranges,
                       r0, 0, BLOCK_N, STAGES, D1, RANGES, PASA)

    @gluon.jit
    def _load_item(q_desc, k_desc, v_desc, q2_desc, k2_desc, v2_desc, q_bufs, k_bufs, v_bufs, q2_bufs, k2_bufs,
                   v2_bufs, q_bar, k_ready, v_ready, k_empty, v_empty, q_row, k_row, v_row, n_k, n_tiles, Ranges, r0,
                   g, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, D1: gl.constexpr, RANGES: gl.constexpr,
                   PASA: gl.constexpr):
        """One work item's loads: its Q rows onto q_bar, its n_tiles K and V tiles into the ring from its g-th
        slot use on."""
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
        D0: gl.constexpr = q_desc.block_type.shape[1]
        NWG: gl.constexpr = q_bufs.type.shape[0]          # consumer warpgroups, a Q buffer each
        # a split head dim: each row's columns [D0, D0 + D1) come by a second copy onto the same barrier
        if D1 > 0:
            mbarrier.expect(q_bar, NWG * (q_desc.block_type.nbytes + q2_desc.block_type.nbytes))
        else:
            mbarrier.expect(q_bar, NWG * q_desc.block_type.nbytes)
        for wg in gl.static_range(NWG):
            tma.async_copy_global_to_shared(q_desc, [q_row + wg * BLOCK_M, 0], q_bar, q_bufs.index(wg))
            if D1 > 0:
                tma.async_copy_global_to_shared(q2_desc, [q_row + wg * BLOCK_M, D0], q_bar, q2_bufs.index(wg))
        if RANGES:
            r = r0
            t = 0
            r_lo, r_hi, r_shift, r_tiles, r_unmasked = _range_at(Ranges, r)
        else:
            r_lo = 0                                  # one range from the partition's first key: tile i
        for i in range(n_tiles):
            s = (g + i) % STAGES
            phase = ((g + i) // STAGES) & 1
            if not RANGES:
                t = i
            # PASA: K̃'s windows lie one after another in its buffer, V's window t is the keys it shifted
            row = r_lo + t * BLOCK_N
            _load_ring_slot(k_desc, k2_desc, k_bufs, k2_bufs, k_ready, k_empty, s, phase, k_row + row, D1)
            if PASA:
                row = _window_start(t, n_k, BLOCK_N)
            _load_ring_slot(v_desc, v2_desc, v_bufs, v2_bufs, v_ready, v_empty, s, phase, v_row + row, D1)
            if RANGES:
                r, t, r_lo, r_hi, r_shift, r_tiles, r_unmasked = _next_tile(Ranges, r, t, r_lo, r_hi, r_shift,
                                                                             r_tiles, r_unmasked)

    @gluon.jit
    def _load_ring_slot(desc, desc2, bufs, bufs2, ready, empty, s, phase, row, D1: gl.constexpr):
        """One K or V tile into ring slot s once every consumer released it: each row's first D0 columns and
        (D1 > 0) its next D1, both onto the slot's ready barrier. A slot starts empty: its first wait (phase 1)
        passes at once."""
        mbarrier.wait(empty.index(s), phase ^ 1)
        if D1 > 0:
            mbarrier.expect(ready.index(s), desc.block_type.nbytes + desc2.block_type.nbytes)
            tma.async_copy_global_to_shared(desc2, [row, desc.block_type.shape[1]], ready.index(s), bufs2.index(s))
        else:
            mbarrier.expect(ready.index(s), desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [row, 0], ready.index(s), bufs.index(s))

    @gluon.jit
    def _range_at(Ranges, r):
        """Key range r of a tile walk (RANGES): its first key, its key bound, its causal shift (key n visible from
        query m iff n <= m + shift), its tile count and how many of its first tiles need no mask."""
        entry = Ranges + 5 * r
        return gl.load(entry), gl.load(entry + 1), gl.load(entry + 2), gl.load(entry + 3), gl.load(entry + 4)

    @gluon.jit
    def _first_tile(Ranges, r0, lo, n_k, causal_shift, n_unmasked, RANGES: gl.constexpr):
        """The consumers' cursor at an item's first tile, (t, r, r_lo, r_hi, r_shift, r_tiles, r_unmasked): tile t of
        key range r holds keys from r_lo + t * BLOCK_N (PASA: from its window's start), bounded by r_hi, causal shift
        r_shift, masked from its r_unmasked-th tile. A walk (RANGES) starts at its range r0 and steps the cursor
        through its table (_next_tile); otherwise the partition is the one range and t the tile index."""
        if RANGES:
            r_lo, r_hi, r_shift, r_tiles, r_unmasked = _range_at(Ranges, r0)
        else:
            r_lo, r_hi, r_shift, r_tiles, r_unmasked = lo, n_k, causal_shift, 0, n_unmasked
        return 0, r0, r_lo, r_hi, r_shift, r_tiles, r_unmasked

    @gluon.jit
    def _next_tile(Ranges, r, t, r_lo, r_hi, r_shift, r_tiles, r_unmasked):
        """The walk's cursor one tile on: tile t + 1 of range r, or tile 0 of range r + 1 (after the last tile it
        reads the table's sentinel row, never used)."""
        t += 1
        if t == r_tiles:
            r += 1
            t = 0
            r_lo, r_hi, r_shift, r_tiles, r_unmasked = _range_at(Ranges, r)
        return r, t, r_lo, r_hi, r_shift, r_tiles, r_unmasked

    @gluon.jit
    def _window_start(t, n_k, BLOCK_N: gl.constexpr):
        """PASA's KV window t: keys from t * BLOCK_N, but the last, ragged one is [n_k - BLOCK_N, n_k) (n real keys
        whenever n_k >= BLOCK_N; kernels/pasa/kernel.py's _window_start)."""
        return gl.minimum(t * BLOCK_N, gl.maximum(n_k - BLOCK_N, 0))

    @gluon.jit
    def _first_key(r_lo, t, r_hi, BLOCK_N: gl.constexpr, PASA: gl.constexpr):
        """The key of tile t's first column: r_lo + t * BLOCK_N, or PASA's window start (its range: every key)."""
        if PASA:
            key = _window_start(t, r_hi, BLOCK_N)
        else:
            key = r_lo + t * BLOCK_N
        return key

    @gluon.jit
    def _softmax(qk, m_i, l_i, col0, row0, n_k, causal_shift, qk_scale, s_layout: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr):
        """One tile's online-softmax step: (p, m, l, alpha), p unnormalised in fp32, alpha the factor for acc."""
        if MASK:
            cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            keep = cols[None, :] < n_k
            if CAUSAL:
                rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
                keep = keep & (cols[None, :] <= rows[:, None] + causal_shift)
            qk = gl.where(keep, qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)     # a row with no visible key yet: p = 0, not NaN
        p = gl.exp2(qk * qk_scale - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _round16(x):
        """x rounded to float16 (to nearest, ties to even), held in float32: PASA's state format
        (kernels/pasa/emulate.py's rounding). Two elements per packed conversion, in one asm block: written as
        x.to(float16).to(float32), the 16-bit values make ptxas (triton 3.6) serialize every wgmma of the kernel
        ("non wgmma instructions reading accumulator registers", C7514), which cost PASA its GEMM/softmax overlap."""
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t; .reg .b16 lo, hi; cvt.rn.f16x2.f32 t, $3, $2; mov.b32 {lo, hi}, t; "
            "cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }", "=r,=r,r,r", [x], dtype=gl.float32, is_pure=True, pack=2)

    @gluon.jit
    def _state(x, PASA: gl.constexpr):
        """x in PASA's state format: rounded to a float16 value (the fp16 state), or as it is (the fp32 state)."""
        if PASA == PASA_FP16_STATE:
            x = _round16(x)
        return x

    @gluon.jit
    def _exp16(qk, frame16):
        """The fp16 state's P, two scores per instruction in float16 arithmetic: fp16(2^fp16(fp16(Ŝ - F)·L)) with
        Ŝ = fp16(qk), F = frame16 (float16, one per row), L = fp16(log2 e) = 1.4423828125, and 2^x by
        ex2.approx.f16x2 (MUFU.EX2.F16: never above the rounded 2^x, one ulp below it for ~30 % of arguments;
        kernels/pasa/emulate.py holds its table). Masked scores (-inf) give 0."""
        return gl.inline_asm_elementwise(
            "{ .reg .b32 s, a, l; mov.b32 l, 0x3DC53DC5; cvt.rn.f16x2.f32 s, $2, $1; sub.rn.f16x2 a, s, $3; "
            "mul.rn.f16x2 a, a, l; ex2.approx.f16x2 $0, a; }", "=r,r,r,r", [qk, frame16], dtype=gl.float16,
            is_pure=True, pack=2)

    @gluon.jit
    def _bookkeeping16(ybar, g_old, q, m_i, mu, c):
        """The fp16 state's per-row bookkeeping (_pasa_softmax) in float16 arithmetic, two rows an instruction:
        (g_new, m_new, cand_old, frame16). An fp16 +, - or x rounded once equals the fp32 operation rounded to fp16
        (fp32's 24 bits are at least 2 * 11 + 2: the double rounding is innocuous), so this is the chain of fp32
        operations each rounded to fp16, bit for bit, without a conversion and an unpacking after each: the chain
        every exponent of the row waits for is shorter by most of its latency. ybar - g_new (ybar in fp32) is its one
        fp32 operation. q = (ybar - g_old) / (t + 1) in fp32; mu the row's fp32 score max, rounded and clamped to
        M_INIT here (fp16(max(qk)) = max(fp16(qk)): rounding is monotone); frame16 = max(m_new - d_cur, M_INIT) as
        float16 (0xFB53 is fp16's -60000, PASA_M_INIT)."""
        return gl.inline_asm_elementwise(
            "{ .reg .b32 rq, rgo, rgn, ryd, rc, rdc, rdp, rm, rco, rmu, rmn, rlim; .reg .b16 lo, hi; "
            ".reg .f32 fa, fb; mov.b32 rlim, 0xFB53FB53; "
            "cvt.rn.f16x2.f32 rq, $12, $11; cvt.rn.f16x2.f32 rgo, $10, $9; add.rn.f16x2 rgn, rgo, rq; "
            "mov.b32 {lo, hi}, rgn; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; "
            "sub.rn.f32 fa, $7, $0; sub.rn.f32 fb, $8, $1; cvt.rn.f16x2.f32 ryd, fb, fa; "
            "cvt.rn.f16x2.f32 rc, $18, $17; mul.rn.f16x2 rdc, rc, ryd; "
            "sub.rn.f16x2 rdp, rgo, rgn; mul.rn.f16x2 rdp, rc, rdp; "
            "cvt.rn.f16x2.f32 rm, $14, $13; add.rn.f16x2 rco, rm, rdp; "
            "cvt.rn.f16x2.f32 rmu, $16, $15; max.f16x2 rmu, rmu, rlim; add.rn.f16x2 rmn, rmu, rdc; "
            "max.f16x2 rmn, rmn, rco; sub.rn.f16x2 $6, rmn, rdc; max.f16x2 $6, $6, rlim; "
            "mov.b32 {lo, hi}, rmn; cvt.f32.f16 $2, lo; cvt.f32.f16 $3, hi; "
            "mov.b32 {lo, hi}, rco; cvt.f32.f16 $4, lo; cvt.f32.f16 $5, hi; }",
            "=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r", [ybar, g_old, q, m_i, mu, c],
            dtype=(gl.float32, gl.float32, gl.float32, gl.float16), is_pure=True, pack=2)

    @gluon.jit
    def _pasa_softmax(qk, m_i, l_i, g_i, t, c, col0, row0, n_k, causal_shift, log2e, s_layout: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr,
                      PASA: gl.constexpr):
        """PASA's step for KV window t (kernels/pasa/kernel.py's _pasa_block_fused, rounding where
        kernels/pasa/emulate.py's "fused" variant rounds, with its float16 exponent in the fp16 state): qk holds the
        shifted, scaled scores in fp32, Ŝ = fp16(qk); the state (m, l, the global pseudo-average g) is held in
        float32, as float16 values with the fp16 state (PASA, PASA_STATES). Returns (p, m, l, g, alpha): p with the
        frame correction folded into its exponent, alpha the factor for acc (in the state format).
        The fp16 state computes its per-row bookkeeping (_bookkeeping16) and p (_exp16: a third of the instructions
        per score of rounding fp32 values) in float16 arithmetic and leaves l to the consumer, whose MMA of p with a
        ones tile sums it on the tensor cores (l is returned as it came); the fp32 state computes p and l in fp32."""
        ybar = gl.sum(qk, 1) / BLOCK_N                       # the local pseudo-average: every column, pre-mask
        if PASA == PASA_FP16_STATE:
            s = qk                                            # rounded to fp16 in _exp16, two at a time
        else:
            s = _round16(qk)                                  # the fp16 score tile, in fp32
        if MASK:
            cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            # the last window's keys below t * BLOCK_N belong to the window before it. Causal, n_k is folded into
            # each row's bound (its horizon or n_k, whichever is first): with a column mask for n_k besides the
            # horizon's compare, as the online softmax builds it, ptxas kept 56 of P's 16-bit values in local memory
            # across the persistent kernel's key loop at D = 128 (224 bytes; the fp32 state 80), and persistent
            # launches ran up to 2x their plain grid's time (kernels/pasa/ops.py)
            if CAUSAL:
                rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
                end = gl.minimum(rows + causal_shift + 1, n_k)
                keep = (cols >= t * BLOCK_N)[None, :] & (cols[None, :] < end[:, None])
            else:
                keep = ((cols >= t * BLOCK_N) & (cols < n_k))[None, :]
            s = gl.where(keep, s, float("-inf"))
        mu = gl.max(s, 1)
        if PASA != PASA_FP16_STATE:
            mu = gl.maximum(mu, M_INIT)
        if t == 0:
            g_old = _state(ybar, PASA)
        else:
            g_old = g_i
        if PASA == PASA_FP16_STATE:
            g_new, m_new, cand_old, frame16 = _bookkeeping16(ybar, g_old, (ybar - g_old) / (t + 1.0), m_i, mu, c)
            alpha = _round16(gl.exp2((cand_old - m_new) * log2e))
            p = _exp16(s, frame16[:, None])
        else:
            g_new = g_old + (ybar - g_old) / (t + 1.0)
            d_cur = c * (ybar - g_new)                # this window's statistics into frame g_new
            cand_old = m_i + c * (g_old - g_new)      # the running state from frame g_old to g_new
            m_new = gl.maximum(mu + d_cur, cand_old)
            alpha = gl.exp2((cand_old - m_new) * log2e)
            # the exponent s - (m_new - d_cur) is <= 0 up to rounding; the clamp keeps a row that sees no key of
            # this window finite (its -inf scores give p = 0)
            frame = gl.maximum(m_new - d_cur, M_INIT)
            p = gl.exp2(s * log2e - (frame * log2e)[:, None])
            l_i = alpha * l_i + gl.sum(p, 1)
        return p, m_new, l_i, g_new, alpha

    @gluon.jit
    def _step(qk, m_i, l_i, g_i, t, c, col0, row0, n_k, causal_shift, qk_scale, s_layout: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr,
              PASA: gl.constexpr):
        """One tile's softmax step, (p, m, l, g, alpha): the online softmax (g unused), or PASA's (qk_scale is
        log2 e then: the scale is in K̃)."""
        if PASA:
            p, m_i, l_i, g_i, alpha = _pasa_softmax(qk, m_i, l_i, g_i, t, c, col0, row0, n_k, causal_shift, qk_scale,
                                                    s_layout, BLOCK_M, BLOCK_N, MASK, CAUSAL, PASA)
        else:
            p, m_i, l_i, alpha = _softmax(qk, m_i, l_i, col0, row0, n_k, causal_shift, qk_scale, s_layout, BLOCK_M,
                                          BLOCK_N, MASK, CAUSAL)
        return p, m_i, l_i, g_i, alpha

    @gluon.jit
    def _tile_step(qk, m_i, l_i, g_i, masked, t, c, col0, row0, n_k, causal_shift, qk_scale, s_layout: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, PASA: gl.constexpr):
        """_step with the mask only where the tile needs it (`masked`, decided per tile at run time): a tile wholly
        inside the keys and seen by every row skips building and applying it."""
        if masked:
            p, m_i, l_i, g_i, alpha = _step(qk, m_i, l_i, g_i, t, c, col0, row0, n_k, causal_shift, qk_scale,
                                            s_layout, BLOCK_M, BLOCK_N, True, CAUSAL, PASA)
        else:
            p, m_i, l_i, g_i, alpha = _step(qk, m_i, l_i, g_i, t, c, col0, row0, n_k, causal_shift, qk_scale,
                                            s_layout, BLOCK_M, BLOCK_N, False, CAUSAL, PASA)
        return p, m_i, l_i, g_i, alpha

    @gluon.jit
    def _normalised(acc, l_i):
        """acc / l in acc's layout (0 for a row that sees no key: acc is 0 there)."""
        l_r = gl.convert_layout(l_i, gl.SliceLayout(1, acc.type.layout))
        return acc / gl.where(l_r > 0, l_r, 1.0)[:, None]

    @gluon.jit
    def _store_cols(dst, out, row, col0, row0, row_end, HEAD_DIM: gl.constexpr, MASK_ROWS: gl.constexpr):
        """One column tile of a consumer's output in dst's dtype at rows row + r, columns col0 + c of a
        [*, HEAD_DIM] slab; MASK_ROWS stores only the query rows row0 + r < row_end."""
        layout: gl.constexpr = out.type.layout
        rows = gl.arange(0, out.type.shape[0], layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, out.type.shape[1], layout=gl.SliceLayout(0, layout))
        offs = (row + rows).to(gl.int64)[:, None] * HEAD_DIM + (col0 + cols)[None, :]
        if MASK_ROWS:
            gl.store(dst + offs, out.to(dst.dtype.element_ty), mask=(row0 + rows < row_end)[:, None])
        else:
            gl.store(dst + offs, out.to(dst.dtype.element_ty))

    @gluon.jit
    def _consumer(q_bufs, k_bufs, v_bufs, q2_bufs, k2_bufs, v2_bufs, q_bar, q_empty, k_ready, v_ready, k_empty,
                  v_empty, turn_bars, ones_buf, Out, Lse, Sbuf, Items, Ranges, heads, group, bh_total, n_q, n_k, k_rows,
                  causal_shift, qk_scale, pasa_c, q0, n_blocks, width, parts, n_slots, BLOCK_N: gl.constexpr,
                  BLOCK_D: gl.constexpr, D1: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                  PINGPONG: gl.constexpr, SUMMARY: gl.constexpr, LSE_MODE: gl.constexpr, RANGES: gl.constexpr,
                  PASA: gl.constexpr, PERSISTENT: gl.constexpr, WG: gl.constexpr):
        """Consumer WG's rows of this program's work items (_work): the plain grid's one, or a persistent
        program's, with the ring's tile count g and the item count carried from one to the next (the ring's slots,
        phases and ping-pong turns run on; Q's barrier flips once per item)."""
        ROWS: gl.constexpr = q_bufs.type.shape[0] * q_bufs.type.shape[1]     # consumers x their rows
        if PERSISTENT:
            g = 0
            for w in range(_rounds(n_blocks * bh_total * parts, CAUSAL)):
                o_row, k_row, v_row, row0, row_end, lo, hi, n_tiles, n_unmasked, slot, s_slot, r0 = _work(
                    w, Items, heads, group, bh_total, n_q, n_k, k_rows, causal_shift, q0, n_blocks, width, parts,
                    ROWS, BLOCK_N, CAUSAL, RANGES, PERSISTENT)
                _consume_item(q_bufs, k_bufs, v_bufs, q2_bufs, k2_bufs, v2_bufs, q_bar, q_empty, k_ready, v_ready,
                              k_empty, v_empty, turn_bars, ones_buf, Out, Lse, Sbuf, o_row, row0, row_end, n_k, lo, hi,
                              n_tiles, n_unmasked, causal_shift, qk_scale, pasa_c, slot, s_slot, n_slots, Ranges,
                              r0, g, w, WG, BLOCK_N, BLOCK_D, D1, STAGES, CAUSAL, PINGPONG, SUMMARY, LSE_MODE, RANGES,
                              PASA, PERSISTENT)
                g += n_tiles
        else:
            o_row, k_row, v_row, row0, row_end, lo, hi, n_tiles, n_unmasked, slot, s_slot, r0 = _work(
                0, Items, heads, group, bh_total, n_q, n_k, k_rows, causal_shift, q0, n_blocks, width, parts,
                ROWS, BLOCK_N, CAUSAL, RANGES, PERSISTENT)
            _consume_item(q_bufs, k_bufs, v_bufs, q2_bufs, k2_bufs, v2_bufs, q_bar, q_empty, k_ready, v_ready,
                          k_empty, v_empty, turn_bars, ones_buf, Out, Lse, Sbuf, o_row, row0, row_end, n_k, lo, hi,
                          n_tiles, n_unmasked, causal_shift, qk_scale, pasa_c, slot, s_slot, n_slots, Ranges, r0, 0, 0,
                          WG, BLOCK_N, BLOCK_D, D1, STAGES, CAUSAL, PINGPONG, SUMMARY, LSE_MODE, RANGES, PASA,
                          PERSISTENT)

    @gluon.jit
    def _consume_item(q_bufs, k_bufs, v_bufs, q2_bufs, k2_bufs, v2_bufs, q_bar, q_empty, k_ready, v_ready, k_empty,
                      v_empty, turn_bars, ones_buf, Out, Lse, Sbuf, o_row, row0, row_end, n_k, lo, hi, n_tiles,
                      n_unmasked, causal_shift, qk_scale, pasa_c, slot, s_slot, n_slots, Ranges, r0, g, it,
                      WG: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, D1: gl.constexpr,
                      STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, SUMMARY: gl.constexpr,
                      LSE_MODE: gl.constexpr, RANGES: gl.constexpr, PASA: gl.constexpr, PERSISTENT: gl.constexpr):
        """One work item of consumer WG: its tiles are the ring's g-th on, its Q the it-th load onto q_bar. Two
        consumers run the overlapped, ping-ponged schedule (the module's docstring), three the plain one
        (consumers_for), but for PASA's fp16 state: its three run the overlapped one without turns (its P is 16-bit
        and its l the tensor cores', so S_j, P_{j-1} and acc fit three's registers: 0 spilled bytes, persistent, not
        causal)."""
        BLOCK_M: gl.constexpr = q_bufs.type.shape[1]
        NWG: gl.constexpr = q_bufs.type.shape[0]
        HEAD_DIM: gl.constexpr = BLOCK_D + D1           # a row's elements in Out and in ELSA's partials
        dtype: gl.constexpr = q_bufs.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BLOCK_D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        # PV_GROUPS: the MMA groups of one O += P V (one per column tile, and PASA's fp16 state's l += P 1), left in
        # flight through the softmax
        if D1 > 0:
            o2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                 instr_shape=[16, D1, 16])
            p2_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o2_layout, k_width=2)
            row_o2: gl.constexpr = gl.SliceLayout(1, o2_layout)
            PV_GROUPS: gl.constexpr = 3 if PASA == PASA_FP16_STATE else 2
            q2_smem = q2_bufs.index(WG)
            acc2 = gl.zeros([BLOCK_M, D1], gl.float32, o2_layout)
        else:
            PV_GROUPS: gl.constexpr = 2 if PASA == PASA_FP16_STATE else 1
        if PASA == PASA_FP16_STATE:
            # PASA's fp16 state sums P on the tensor cores (_pasa_softmax): l is a [BLOCK_M, 8] accumulator of
            # P·1 (the ones tile, B of the MMA), every column the row sum, rounded and scaled by alpha as acc is
            l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                instr_shape=[16, 8, 16])
            pl_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=2)
            row_l: gl.constexpr = gl.SliceLayout(1, l_layout)
            lacc = gl.zeros([BLOCK_M, 8], gl.float32, l_layout)
            ones_b = ones_buf.permute((1, 0))

        q_smem = q_bufs.index(WG)
        my_row0 = row0 + WG * BLOCK_M
        m_i = gl.full([BLOCK_M], M_INIT if PASA else float("-inf"), gl.float32, row_s)
        l_i = gl.full([BLOCK_M], 0.0, gl.float32, row_s)
        g_i = gl.full([BLOCK_M], 0.0, gl.float32, row_s)      # PASA's global pseudo-average (else unused)
        acc = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, o_layout)
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        mbarrier.wait(q_bar, it & 1)

        if NWG == 2 or PASA == PASA_FP16_STATE:
            gl.static_assert(NWG == 2 or not PINGPONG, "turns take two consumers")
            # tile 0: S_0 alone. Ping-pong: consumer 0 takes the first turn (a fresh mbarrier's phase 1 counts as
            # complete), then the two alternate, one turn each per tile: turn t of consumer 0 waits for phase
            # (t & 1) ^ 1, of consumer 1 for t & 1
            s0 = g % STAGES
            if PINGPONG:
                mbarrier.wait(turn_bars.index(WG), (g & 1) ^ (1 - WG))
            mbarrier.wait(k_ready.index(s0), (g // STAGES) & 1)
            qk = warpgroup_mma(q_smem, k_bufs.index(s0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            if D1 > 0:
                qk = warpgroup_mma(q2_smem, k2_bufs.index(s0).permute((1, 0)), qk, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn_bars.index(1 - WG), count=1)
            qk = warpgroup_mma_wait(0, deps=[qk])
            mbarrier.arrive(k_empty.index(s0), count=1)
            if PERSISTENT:
                if n_tiles == 1:
                    mbarrier.arrive(q_empty, count=1)       # the item's last read of Q is done
            t, r, r_lo, r_hi, r_shift, r_tiles, r_unmasked = _first_tile(Ranges, r0, lo, n_k, causal_shift, n_unmasked,
                                                                         RANGES)
            p, m_i, l_i, g_i, alpha = _tile_step(qk, m_i, l_i, g_i, t >= r_unmasked, t, pasa_c,
                                                 _first_key(r_lo, t, r_hi, BLOCK_N, PASA), my_row0, r_hi, r_shift,
                                                 qk_scale, s_layout, BLOCK_M, BLOCK_N, CAUSAL, PASA)
            if RANGES:
                r, t, r_lo, r_hi, r_shift, r_tiles, r_unmasked = _next_tile(Ranges, r, t, r_lo, r_hi, r_shift, r_tiles,
                                                                             r_unmasked)

            for j in range(1, n_tiles):
                s = (g + j) % STAGES
                prev = (g + j - 1) % STAGES
                if PINGPONG:
                    mbarrier.wait(turn_bars.index(WG), ((g + j) & 1) ^ (1 - WG))
                mbarrier.wait(k_ready.index(s), ((g + j) // STAGES) & 1)
                qk = warpgroup_mma(q_smem, k_bufs.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                if D1 > 0:
                    qk = warpgroup_mma(q2_smem, k2_bufs.index(s).permute((1, 0)), qk, is_async=True)
                mbarrier.wait(v_ready.index(prev), ((g + j - 1) // STAGES) & 1)
                p16 = p.to(dtype)
                p_op = gl.convert_layout(p16, p_layout)
                acc = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
                if D1 > 0:
                    p2_op = gl.convert_layout(p16, p2_layout)
                    acc2 = warpgroup_mma(p2_op, v2_bufs.index(prev), acc2, is_async=True)
                if PASA == PASA_FP16_STATE:
                    pl_op = gl.convert_layout(p16, pl_layout)
                    lacc = warpgroup_mma(pl_op, ones_b, lacc, is_async=True)
                if PINGPONG:
                    mbarrier.arrive(turn_bars.index(1 - WG), count=1)
                # the older groups (S_j) done; O += P V stays in flight through the softmax
                qk = warpgroup_mma_wait(PV_GROUPS, deps=[qk])
                mbarrier.arrive(k_empty.index(s), count=1)
                if PERSISTENT:
                    if j == n_tiles - 1:
                        mbarrier.arrive(q_empty, count=1)
                if not RANGES:
                    t = j
                p, m_i, l_i, g_i, alpha = _tile_step(qk, m_i, l_i, g_i, t >= r_unmasked, t, pasa_c,
                                                     _first_key(r_lo, t, r_hi, BLOCK_N, PASA), my_row0, r_hi, r_shift,
                                                     qk_scale, s_layout, BLOCK_M, BLOCK_N, CAUSAL, PASA)
                if RANGES:
                    r, t, r_lo, r_hi, r_shift, r_tiles, r_unmasked = _next_tile(Ranges, r, t, r_lo, r_hi, r_shift,
                                                                                 r_tiles, r_unmasked)
                # PASA's fp16 state keeps acc in float16 values: rounded once per window, before the (then exact)
                # alpha product
                if PASA == PASA_FP16_STATE:
                    if D1 > 0:
                        acc, p_op, acc2, p2_op, lacc, pl_op = warpgroup_mma_wait(
                            0, deps=[acc, p_op, acc2, p2_op, lacc, pl_op])
                        acc2 = _state(acc2, PASA) * gl.convert_layout(alpha, row_o2)[:, None]
                    else:
                        acc, p_op, lacc, pl_op = warpgroup_mma_wait(0, deps=[acc, p_op, lacc, pl_op])
                    lacc = _state(lacc, PASA) * gl.convert_layout(alpha, row_l)[:, None]
                elif D1 > 0:
                    acc, p_op, acc2, p2_op = warpgroup_mma_wait(0, deps=[acc, p_op, acc2, p2_op])
                    acc2 = _state(acc2, PASA) * gl.convert_layout(alpha, row_o2)[:, None]
                else:
                    acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
                mbarrier.arrive(v_empty.index(prev), count=1)
                acc = _state(acc, PASA)
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]

            last = (g + n_tiles - 1) % STAGES
            mbarrier.wait(v_ready.index(last), ((g + n_tiles - 1) // STAGES) & 1)
            p16 = p.to(dtype)
            p_op = gl.convert_layout(p16, p_layout)
            acc = warpgroup_mma(p_op, v_bufs.index(last), acc, is_async=True)
            if D1 > 0:
                p2_op = gl.convert_layout(p16, p2_layout)
                acc2 = warpgroup_mma(p2_op, v2_bufs.index(last), acc2, is_async=True)
            if PASA == PASA_FP16_STATE:
                pl_op = gl.convert_layout(p16, pl_layout)
                lacc = warpgroup_mma(pl_op, ones_b, lacc, is_async=True)
                if D1 > 0:
                    acc, p_op, acc2, p2_op, lacc, pl_op = warpgroup_mma_wait(0, deps=[acc, p_op, acc2, p2_op, lacc,
                                                                                      pl_op])
                else:
                    acc, p_op, lacc, pl_op = warpgroup_mma_wait(0, deps=[acc, p_op, lacc, pl_op])
                l_i = gl.convert_layout(gl.max(_state(lacc, PASA), 1), row_s)
            elif D1 > 0:
                acc, p_op, acc2, p2_op = warpgroup_mma_wait(0, deps=[acc, p_op, acc2, p2_op])
            else:
                acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
            mbarrier.arrive(v_empty.index(last), count=1)

        else:
            # three consumers (consumers_for): no overlap inside a warpgroup and no turns; per tile S_j, its softmax,
            # then O += P_j V_j, waited for at once: the other warpgroups' GEMMs use the tensor cores meanwhile (the
            # online softmax and PASA's fp32 state, whose acc is not rounded; the fp16 state's three run the
            # overlapped schedule above)
            gl.static_assert(D1 == 0, "three consumers: head dims of one column tile")
            t, r, r_lo, r_hi, r_shift, r_tiles, r_unmasked = _first_tile(Ranges, r0, lo, n_k, causal_shift, n_unmasked,
                                                                         RANGES)
            for j in range(n_tiles):
                s = (g + j) % STAGES
                phase = ((g + j) // STAGES) & 1
                mbarrier.wait(k_ready.index(s), phase)
                qk = warpgroup_mma(q_smem, k_bufs.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                qk = warpgroup_mma_wait(0, deps=[qk])
                mbarrier.arrive(k_empty.index(s), count=1)
                if PERSISTENT:
                    if j == n_tiles - 1:
                        mbarrier.arrive(q_empty, count=1)
                if not RANGES:
                    t = j
                p, m_i, l_i, g_i, alpha = _tile_step(qk, m_i, l_i, g_i, t >= r_unmasked, t, pasa_c,
                                                     _first_key(r_lo, t, r_hi, BLOCK_N, PASA), my_row0, r_hi,
                                                     r_shift, qk_scale, s_layout, BLOCK_M, BLOCK_N, CAUSAL, PASA)
                if RANGES:
                    r, t, r_lo, r_hi, r_shift, r_tiles, r_unmasked = _next_tile(Ranges, r, t, r_lo, r_hi, r_shift,
                                                                                 r_tiles, r_unmasked)
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                mbarrier.wait(v_ready.index(s), phase)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                acc = warpgroup_mma(p_op, v_bufs.index(s), acc, is_async=True)
                acc, p_op = warpgroup_mma_wait(0, deps=[acc, p_op])
                mbarrier.arrive(v_empty.index(s), count=1)

        rows_s = gl.arange(0, BLOCK_M, layout=row_s)
        acc = _state(acc, PASA)
        if D1 > 0:
            acc2 = _state(acc2, PASA)
        out = _normalised(acc, l_i)
        if D1 > 0:
            out2 = _normalised(acc2, l_i)
        out_row = o_row + WG * BLOCK_M
        if SUMMARY:
            # ELSA's phase-1 slots (kernels/elsa/kernel.py's _store_summary): fp32 m and l at [slot + r] and
            # [n_slots + slot + r]; the normalised output in the inputs' dtype, partition 0's into the output rows
            # themselves (phase 2 merges in place), another's at row s_slot + r of the [*, HEAD_DIM] slab after
            # them; a causal partition past every row's horizon (hi <= lo) stores nothing
            if hi > lo:
                base = (slot + WG * BLOCK_M).to(gl.int64)
                gl.store(Sbuf + base + rows_s, m_i)
                gl.store(Sbuf + n_slots + base + rows_s, l_i)
                if lo == 0:
                    _store_cols(Out, out, out_row, 0, my_row0, row_end, HEAD_DIM, True)
                    if D1 > 0:
                        _store_cols(Out, out2, out_row, BLOCK_D, my_row0, row_end, HEAD_DIM, True)
                else:
                    partials = (Sbuf + 2 * n_slots.to(gl.int64)).to(gl.pointer_type(dtype))
                    s_base = (s_slot + WG * BLOCK_M).to(gl.int64)
                    _store_cols(partials, out, s_base, 0, 0, 0, HEAD_DIM, False)
                    if D1 > 0:
                        _store_cols(partials, out2, s_base, BLOCK_D, 0, 0, HEAD_DIM, False)
        else:
            _store_cols(Out, out, out_row, 0, my_row0, row_end, HEAD_DIM, True)
            if D1 > 0:
                _store_cols(Out, out2, out_row, BLOCK_D, my_row0, row_end, HEAD_DIM, True)
            if LSE_MODE != 0:
                has = l_i > 0
                lse = m_i + gl.log2(gl.where(has, l_i, 1.0))
                if LSE_MODE == 1:
                    lse = lse / 1.4426950408889634      # natural log; -inf for a row that sees no key
                else:
                    lse = gl.where(has, lse, float("inf"))   # ELSA's: base 2, +inf (its backward's zero weight)
                gl.store(Lse + (o_row + WG * BLOCK_M + rows_s), lse, mask=my_row0 + rows_s < row_end)

    @gluon.jit
    def _gluon_fwd_kernel(q_desc, k_desc, v_desc, q2_desc, k2_desc, v2_desc, Out, Lse, Sbuf, Items, Ranges, heads,
                          group, bh_total, n_q, n_k, k_rows, causal_shift, qk_scale, pasa_c, q0, n_blocks, width,
                          parts, n_slots, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, D1: gl.constexpr,
                          CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, SUMMARY: gl.constexpr,
                          LSE_MODE: gl.constexpr, RANGES: gl.constexpr, PASA: gl.constexpr,
                          PERSISTENT: gl.constexpr, CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                          LOADER_REGS: gl.constexpr, LAUNCH_DEPENDENTS: gl.constexpr = False):
        """Work items of ROWS = CONSUMERS x 64 query rows q0 + qb * ROWS + [0, ROWS) of head bh (of bh_total) against
        the keys [part * width, part * width + width) (one partition holding every key: width >= n_k), n_blocks row
        blocks per head and parts partitions: the plain grid (n_blocks, bh_total, parts) runs one per program;
        PERSISTENT, a grid of at most one program per SM walks them all (_work has the order). CONSUMERS (2, or 3 at
        THREE_CONSUMER_DIMS) consumer warpgroups, CONSUMER_REGS registers each. The descriptors q/k/v_desc load
        each row's first D0 columns; with D1 > 0, q2/k2/v2_desc its next D1 (else they are None).
        SUMMARY stores the state in ELSA's phase-1 slots (n_slots slot rows in all; partition 0's partial output in
        out's rows); otherwise out (and the LSE: LSE_MODE 1 natural, 2 ELSA's base 2) is written.
        RANGES (a tile walk, `launch(walk=...)`, never persistent): program (item, bh) takes the rows [start, end)
        of Items[item] ([*, 4] int32: start, end, first range, tiles; end - start <= ROWS) and walks the key ranges
        of the Ranges table ([*, 5] int32, tile_walk's) from its first range for its tile count; out and LSE rows
        below end.
        PASA (one partition, out only; 0 = not PASA, else its state: PASA_STATES): k_desc reads PASA's shifted keys
        K̃ (k_rows rows per kv head: whole windows of BLOCK_N, which is PASA's window n), v_desc V at each window's
        start, and the consumers take PASA's step with its recovery constant pasa_c, qk_scale being log2 e.
        Otherwise k_rows is n_k and pasa_c unused.
        LAUNCH_DEPENDENTS: each program lets the next kernel on the stream start at once if it was launched as a
        programmatic dependent (griddepcontrol.launch_dependents; ELSA's phase 2, which waits for this kernel's
        stores before it reads): its launch then overlaps this kernel's last programs instead of following them."""
        if LAUNCH_DEPENDENTS:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
        BLOCK_D: gl.constexpr = q_desc.block_type.shape[1]
        dtype: gl.constexpr = q_desc.dtype

        q_bufs = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_M, BLOCK_D], q_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], v_desc.layout)
        if D1 > 0:
            q2_bufs = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_M, D1], q2_desc.layout)
            k2_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D1], k2_desc.layout)
            v2_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D1], v2_desc.layout)
        else:                                         # never read: the partitions' arguments need a value
            q2_bufs = q_bufs
            k2_bufs = k_bufs
            v2_bufs = v_bufs
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())   # PERSISTENT: Q's buffers
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())   # two consumers' turns
        mbarrier.init(q_bar, count=1)
        mbarrier.init(q_empty, count=CONSUMERS)           # every consumer's last S = Q K^T of an item
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=CONSUMERS)      # every consumer releases every buffer
            mbarrier.init(v_empty.index(i), count=CONSUMERS)
        for i in gl.static_range(2):
            mbarrier.init(turn_bars.index(i), count=1)
        if PASA == PASA_FP16_STATE:
            # ones: B of the MMA P·1 that sums the fp16 state's P per row (stored K-major, as K's tiles are)
            ones_buf = gl.allocate_shared_memory(
                dtype, [8, BLOCK_N], gl.NVMMASharedLayout.get_default_for([8, BLOCK_N], dtype),
                gl.full([8, BLOCK_N], 1.0, dtype, gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])))
        else:
            ones_buf = q_bufs                         # never read
        fence_async_shared()

        # consumer 0 is the default partition, the other consumers and the loader workers. (The partitions' argument
        # tuples are spelled out: a tuple built once and extended by a consumer's index loses its constexprs.)
        if CONSUMERS == 3:
            gl.warp_specialize([
                (_consumer, (q_bufs, k_bufs, v_bufs, q2_bufs, k2_bufs, v2_bufs, q_bar, q_empty, k_ready, v_ready,
                             k_empty, v_empty, turn_bars, ones_buf, Out, Lse, Sbuf, Items, Ranges, heads, group,
                             bh_total, n_q, n_k, k_rows, causal_shift, qk_scale, pasa_c, q0, n_blocks, width, parts,
                             n_slots, BLOCK_N, BLOCK_D, D1, STAGES, CAUSAL, PINGPONG, SUMMARY, LSE_MODE, RANGES, PASA,
                             PERSISTENT, 0)),
                (_consumer, (q_bufs, k_bufs, v_bufs, q2_bufs, k2_bufs, v2_bufs, q_bar, q_empty, k_ready, v_ready,
                             k_empty, v_empty, turn_bars, ones_buf, Out, Lse, Sbuf, Items, Ranges, heads, group,
                             bh_total, n_q, n_k, k_rows, causal_shift, qk_scale, pasa_c, q0, n_blocks, width, parts,
                             n_slots, BLOCK_N, BLOCK_D, D1, STAGES, CAUSAL, PINGPONG, SUMMARY, LSE_MODE, RANGES, PASA,
                             PERSISTENT, 1)),
                (_consumer, (q_bufs, k_bufs, v_bufs, q2_bufs, k2_bufs, v2_bufs, q_bar, q_empty, k_ready, v_ready,
                             k_empty, v_empty, turn_bars, ones_buf, Out, Lse, Sbuf, Items, Ranges, heads, group,
                             bh_total, n_q, n_k, k_rows, causal_shift, qk_scale, pasa_c, q0, n_blocks, width, parts,
                             n_slots, BLOCK_N, BLOCK_D, D1, STAGES, CAUSAL, PINGPONG, SUMMARY, LSE_MODE, RANGES, PASA,
                             PERSISTENT, 2)),
                (_loader, (q_desc, k_desc, v_desc, q2_desc, k2_desc, v2_desc, q_bufs, k_bufs, v_bufs, q2_bufs, k2_bufs,
                           v2_bufs, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, Items, Ranges, heads, group,
                           bh_total, n_q, n_k, k_rows, causal_shift, q0, n_blocks, width, parts, BLOCK_N, STAGES, D1,
                           CAUSAL, RANGES, PASA, PERSISTENT)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (q_bufs, k_bufs, v_bufs, q2_bufs, k2_bufs, v2_bufs, q_bar, q_empty, k_ready, v_ready,
                             k_empty, v_empty, turn_bars, ones_buf, Out, Lse, Sbuf, Items, Ranges, heads, group,
                             bh_total, n_q, n_k, k_rows, causal_shift, qk_scale, pasa_c, q0, n_blocks, width, parts,
                             n_slots, BLOCK_N, BLOCK_D, D1, STAGES, CAUSAL, PINGPONG, SUMMARY, LSE_MODE, RANGES, PASA,
                             PERSISTENT, 0)),
                (_consumer, (q_bufs, k_bufs, v_bufs, q2_bufs, k2_bufs, v2_bufs, q_bar, q_empty, k_ready, v_ready,
                             k_empty, v_empty, turn_bars, ones_buf, Out, Lse, Sbuf, Items, Ranges, heads, group,
                             bh_total, n_q, n_k, k_rows, causal_shift, qk_scale, pasa_c, q0, n_blocks, width, parts,
                             n_slots, BLOCK_N, BLOCK_D, D1, STAGES, CAUSAL, PINGPONG, SUMMARY, LSE_MODE, RANGES, PASA,
                             PERSISTENT, 1)),
                (_loader, (q_desc, k_desc, v_desc, q2_desc, k2_desc, v2_desc, q_bufs, k_bufs, v_bufs, q2_bufs, k2_bufs,
                           v2_bufs, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, Items, Ranges, heads, group,
                           bh_total, n_q, n_k, k_rows, causal_shift, q0, n_blocks, width, parts, BLOCK_N, STAGES, D1,
                           CAUSAL, RANGES, PASA, PERSISTENT)),
            ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def available(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether gluon_fwd can run these inputs: ``eligible`` and contiguous tensors whose layout TMA can read
    (16-byte aligned bases and rows)."""
    return eligible(q) and all(t.is_contiguous() and _tma_layout_ok(t) for t in (q, k, v))


def eligible(q: torch.Tensor) -> bool:
    """What ``available`` asks of the call short of its tensors' layout (a traced call's fake tensors have no data
    pointer): gluon_on (Gluon, sm_90), 16-bit, a head dim of HEAD_DIMS."""
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in HEAD_DIMS and gluon_on(q.device)


def gluon_on(device: torch.device) -> bool:
    """Whether this file's Gluon (triton 3.6's API) runs on the device: a CUDA device of sm_90 (Hopper: wgmma)."""
    if not HAS_GLUON or not triton.__version__.startswith(GLUON_VERSION) or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)[0] == 9


@functools.lru_cache(maxsize=32)
def descriptor_layout(rows: int, d: int, dtype: torch.dtype):
    """The shared-memory layout of a [rows, d] tile of a 16-bit dtype (or fp32, the backward's dQ): the kernels'
    descriptors' (and what scripts/compile_check.py gives their signature)."""
    return gl.NVMMASharedLayout.get_default_for([rows, d], {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16,
                                                            torch.float32: gl.float32}[dtype])


def tile_descriptor(t2d: torch.Tensor, rows: int, cols: int):
    """A descriptor over the rows of t2d ([rows of every head, D], unit column stride; its rows may be longer, as
    PASA's K̃ rows padded to a power of two are) loading [rows, cols] tiles."""
    return TensorDescriptor(t2d, list(t2d.shape), [t2d.stride(0), 1], [rows, cols],
                            descriptor_layout(rows, cols, t2d.dtype))


def _describe(d: int, block_n: int) -> tuple:
    """A launch's six leading descriptor arguments as Prepared's ``describe`` (q, k, v: the call's tensors 0-2):
    each row's first D0 columns, then its next D1 (None when D1 = 0), in tiles of a consumer's rows (q) or BLOCK_N."""
    d0, d1 = SPLITS[d]
    rows = (ROWS_PER_CONSUMER, block_n, block_n)
    firsts = tuple(described_rows(i, d, rows[i], d0) for i in range(3))
    seconds = tuple(described_rows(i, d, rows[i], d1) for i in range(3)) if d1 else (None, None, None)
    return firsts + seconds


def described_rows(i: int, d: int, rows: int, cols: int) -> tuple:
    """A ``describe`` entry of a Prepared launch: the descriptor of [rows, cols] tiles over the rows of d columns of
    the call's tensor i (t [..., rows, d], the rows of every head one after the other)."""
    return i, functools.partial(_rows_descriptor, d=d, rows=rows, cols=cols)


def _rows_descriptor(t: torch.Tensor, d: int, rows: int, cols: int):
    return tile_descriptor(t.view(-1, d), rows, cols)


def persistent_default(d: int, causal: bool, items: int, sms: int, causal_rounds: int = 0) -> bool:
    """Whether a launch (not a walk) of `items` work items (row blocks x heads x partitions) on `sms` SMs runs
    persistent: at the measured head dims (PERSISTENT_DIMS), and causal only while the items fill at most the
    caller's causal_rounds rounds of the SMs (0: the plain grid)."""
    if d not in PERSISTENT_DIMS:
        return False
    return not causal or items <= causal_rounds * sms


def round_kv_bytes(bh_q: int, group: int, len_k: int, d: int, sms: int) -> int:
    """The bytes of 16-bit K and V a causal persistent round reads: its programs take the heads fastest (_work), so
    a round spans min(bh_q, sms) query heads, `group` of them a kv head, each kv head's len_k keys of K and V."""
    return -(-min(bh_q, sms) // group) * 4 * len_k * d


def launch(q, k, v, out, lse, sbuf, **options):
    """One launch (prepare's, made for this call alone) over q, k, v into out, lse, sbuf. Returns the
    CompiledKernel."""
    items, ranges = options.get("walk") or (out, out)
    return prepare(q, k, v, **options)(q, k, v, out, lse, sbuf, items, ranges)


class PlannedLaunch:
    """A plan's launch of the core, its options fixed when the plan is made and prepared (``prepare``) at its first
    call, from that call's tensors (ELSA's phase 1 and CQSA's walk, on the tensors the plan reads; PASA's main loop,
    on the K̃ each call makes): ``go = PlannedLaunch(**options); go(q, k, v, out, lse, sbuf, items, ranges)``."""

    __slots__ = ("options", "prepared")

    def __init__(self, **options):
        self.options = options
        self.prepared = None

    def __call__(self, q, k, v, out, lse, sbuf, items, ranges):
        go = self.prepared
        if go is None:
            go = self.prepared = prepare(q, k, v, **self.options)
        return go(q, k, v, out, lse, sbuf, items, ranges)


def prepare(q, k, v, *, causal: bool, qk_scale: float, q0: int = 0, n_blocks: int = 0, parts: int = 1,
            width: int = 0, n_slots: int = 0, summary: bool = False, lse_mode: int, consumers: int = 2,
            pingpong: bool = True, tiles=None, regs=None, walk=None, pasa_c=None, pasa_state: str = "fp16",
            persistent: bool | None = None, causal_rounds: int = 0, programs: int | None = None,
            launch_dependents: bool = False) -> Prepared:
    """The launch over n_blocks blocks of 64 x `consumers` query rows from row q0 (work items: row blocks x B * Hq x
    parts; the plain grid has one program each, a persistent launch (persistent=True; None: persistent_default, with
    causal_rounds) `programs` of them, by default one per SM), partitions of `width` keys (a multiple of BLOCK_N
    unless one partition holds every key), for inputs laid out as q, k, v: a Prepared launch (kernels/_launch.py),
    called as ``go(q, k, v, out, lse, sbuf, items, ranges)`` with tensors of these shapes and strides (items, ranges:
    walk's tables, else any tensor: never read), on q's device made current by the caller, which checked available(q, k,
    v). After its first call it encodes the three (six at a split head dim) TMA maps at the call's pointers and calls
    the launcher's C entry: no descriptor objects, no key (its host time: kernels/_launch.py). With walk=(items, ranges)
    (int32 tables on q's device, built by a tile walk such as kernels/cqsa/schedule.py's tile_walk with this launch's
    BLOCK_N), one program per item and head (grid (items, B * Hq, 1)): each walks its rows' key ranges, out and the LSE
    are written for its rows. With pasa_c (PASA's recovery constant in the state format) the programs take PASA's step
    with its state in pasa_state (a key of PASA_STATES): k is then PASA's K̃ [B, Hkv, whole windows of BLOCK_N keys, D]
    (rows may be padded: only the row stride counts), qk_scale is log2 e, one partition, out only. consumers: the
    consumer warpgroups of a CTA, 2 or (at THREE_CONSUMER_DIMS) 3 (consumers_for chooses); pingpong: two consumers'
    turns (three take none); regs: (consumer, loader) registers, REGS' for the consumer count by default.
    launch_dependents: the next kernel, launched as a programmatic dependent (one that waits for this one's stores
    itself: ELSA's phase 2), may start as soon as every program has started."""
    d = q.shape[-1]
    block_n, stages = tiles or TILES[d]
    if consumers not in (2, 3) or (consumers == 3 and d not in THREE_CONSUMER_DIMS):
        raise ValueError(f"{NAME}: {consumers} consumer warpgroups at head dim {d}: two, or three at head dims "
                         f"{THREE_CONSUMER_DIMS}")
    regs = regs or REGS[consumers]
    pasa = 0 if pasa_c is None else PASA_STATES.get(pasa_state)
    if pasa is None:
        raise ValueError(f"{NAME}: pasa_state must be one of {sorted(PASA_STATES)} (got {pasa_state!r})")
    heads, n_q, n_k = q.shape[1], q.shape[2], v.shape[2]
    bh = q.shape[0] * heads
    if walk is None:
        grid = (n_blocks, bh, parts)
        work = n_blocks * bh * parts
        sms = sm_count(q.device, 1)
        if persistent is None:
            persistent = persistent_default(d, causal, work, sms, causal_rounds)
        if persistent:
            if programs is not None and programs < 1:
                raise ValueError(f"{NAME}: a persistent launch needs at least one program (got programs={programs})")
            grid = (min(work, programs or sms), 1, 1)
    else:
        if persistent:
            raise ValueError(f"{NAME}: a tile walk runs on the plain grid, not persistent")
        grid = (walk[0].shape[0], bh, 1)
    return Prepared(_gluon_fwd_kernel, grid, (
        heads, heads // k.shape[1], bh, n_q, n_k, k.shape[2], n_k - n_q, qk_scale, 0.0 if pasa_c is None else pasa_c,
        q0, n_blocks, width, parts, n_slots),
        dict(BLOCK_N=block_n, STAGES=stages, D1=SPLITS[d][1], CAUSAL=causal, PINGPONG=pingpong and consumers == 2,
             SUMMARY=summary, LSE_MODE=lse_mode, RANGES=walk is not None, PASA=pasa, PERSISTENT=bool(persistent),
             CONSUMERS=consumers, CONSUMER_REGS=regs[0], LOADER_REGS=regs[1], LAUNCH_DEPENDENTS=launch_dependents,
             num_warps=4), describe=_describe(d, block_n))


def gluon_fwd(q, k, v, causal: bool = False, scale=None, *, consumers: int | None = None, pingpong: bool = True,
              tiles=None, regs=None, return_lse: bool = False, persistent: bool | None = None,
              programs: int | None = None):
    """Softmax attention forward (no autograd) on sm_90: q [B, Hq, Nq, D], k, v [B, Hkv, Nk, D], contiguous,
    float16 / bfloat16, D in HEAD_DIMS. Causal is bottom-right aligned. consumers: the CTA's consumer warpgroups
    (None: core_consumers' choice), tiles=(BLOCK_N, STAGES) overrides TILES, regs=(consumer, loader) the partitions'
    registers, persistent and programs the launch's grid (launch).
    Returns out (and the natural-log LSE [B, Hq, Nq] in fp32 with return_lse)."""
    shape = check_inputs(NAME, q, k, v, causal=causal, scale=scale)
    if not available(q, k, v):
        raise ValueError(f"{NAME}: needs triton {GLUON_VERSION}'s Gluon, an sm_90 GPU, float16/bfloat16, head dim "
                         f"in {HEAD_DIMS} and contiguous, 16-byte aligned inputs (got {q.dtype}, D={shape.head_dim}, "
                         f"{q.device}, triton {triton.__version__})")
    scale = default_scale(scale, shape.head_dim)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device) if return_lse else out
    if out.numel() == 0 or shape.len_kv == 0:
        out.zero_()
        return (out, lse.fill_(float("-inf"))) if return_lse else out
    if consumers is None:
        consumers = core_consumers(shape.head_dim, q.shape[0] * q.shape[1], shape.len_q, shape.len_kv,
                                   sm_count(q.device, 1))
    with on_device(q):
        launch(q, k, v, out, lse, out, causal=causal, qk_scale=scale * LOG2E, q0=0,
               n_blocks=triton.cdiv(shape.len_q, consumers * ROWS_PER_CONSUMER), parts=1, width=shape.len_kv,
               n_slots=0, summary=False, lse_mode=1 if return_lse else 0, consumers=consumers, pingpong=pingpong,
               tiles=tiles, regs=regs, persistent=persistent, programs=programs)
    return (out, lse) if return_lse else out
