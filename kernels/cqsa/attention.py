"""Public entry point and the resident path: torch.library ops with autograd, and their slot-wave launches.

Resident mode (inputs on the compute device, no budget): every task of a head runs, but instead of one
launch per task the tasks are batched into slot waves (see schedule.py): all c**itr tasks' row blocks of one
slot × all (batch, head) pairs. At one division level (itr = 1, the default) every wave cuts the rows into the
same blocks, so the waves are joined: one launch, where each program runs its row block's item of every wave in
turn and merges them in registers with the log-sum-exp rule, then writes O and the global lse (no state between
waves). Where they do not join (itr > 1), l**itr launches fold into shared fp32 (m, l, acc) state, the last
writing O and lse. The backward runs the same way for dQ (its first wave also computes δ = rowsum(dO ⊙ O)) and
for dK/dV: two launches when joined. Joined forward waves of 16-bit inputs on sm_90 run on the Gluon Hopper core
instead (kernels/_gluon_core.py, from its MIN_WORK, default tiles): each 128-row block's ranges of every wave, walked
as one tile sequence (schedule.tile_walk), with no padded columns at D = 80 / 96 / 160 / 192. Their backward at
itr = 1 (D = 64 / 128, from GLUON_BWD_MIN_WORK) runs the Gluon backward ELSA's runs (kernels/_gluon_bwd.py): the
whole sequence as one task, the task tree's root (_Backward).

The resident forward and backward are ops in the ``attnbench`` namespace (``attnbench::cqsa_fwd`` returns
(out, lse), ``attnbench::cqsa_bwd`` returns (dq, dk, dv)) with a registered autograd formula and fake
implementations, so ``cqsa_attention`` runs inside ``torch.compile(fullgraph=True)`` and CUDA graphs.
Streaming mode (a memory budget, or inputs on the host while a GPU exists) is stream.py's engine and runs
eagerly only; under torch.compile it says so.

Host time per call is what short sequences pay (NOTES.md, host cost): the public function caches its checks per
call signature; an op body is one key lookup for the plan of its signature (kernels._launch.layout of its tensors
and the options: ``_Forward``, ``_Backward``), whose launches are kernels._launch.Prepared over slot-wave tables
cached on the device per (Nq, Nk, c, itr, causal, tiles, D, precision, device); then two (forward: out, lse) or
four (backward: dq, dk, dv, workspace) allocations and the launches (one forward, two backward when joined). The
autograd layer is kernels/_ops.py's pattern.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from .. import _flash_core as core
from .. import _gluon_bwd as gluon_bwd
from .. import _gluon_core as gluon_core
from .._common import (LOG2E, LaunchPlan, Prepared, SignatureCache, block_d, default_scale, dot_precision,
                       in_place, layout, signature, sm_count, split_plan)
from .._ops import KernelFunction, below_autograd, define_op, not_differentiable, plain, register_autograd
from .._tuning import min_work_entries
from .checks import check_call
from .kernel import (TUNING_FILE, constexprs, cqsa_bwd_dkdv_kernel, cqsa_bwd_dq_kernel, cqsa_fwd_kernel,
                     default_tiles, resolve_tiles)
from .schedule import resident_schedule, tile_walk
from .stream import stream_attention

# --- the slot-wave tables of one problem shape, shared by every signature of that shape ----------------


class _Tables:
    """Slot-wave tables on one device: ranges and [(items, count)] per wave, for the forward (query rows),
    dQ (query rows) and dK/dV (key rows), and each kernel's constexprs. The backward's tables are built on its
    first use."""
    __slots__ = ("key", "fwd", "dq", "dkdv", "fwd_consts", "dq_consts", "dkdv_consts")

    def __init__(self, key):
        self.key = key
        self.fwd = self.dq = self.dkdv = None


_tables = SignatureCache(256)


def _device_tables(n, n_kv, c, itr, block, causal, rows, device):
    """One schedule's tables on the device: (ranges, [(items, count, n_waves)] per launch): the joined waves in one
    launch where every wave cuts the rows into the same blocks (schedule.join_waves; always at itr = 1), else one
    launch per wave."""
    sched = resident_schedule(n, c, itr, block, causal, n_kv, rows)
    ranges, waves = sched.on(device)
    joined = sched.joined_on(device)
    if joined is not None:
        return ranges, [(joined, int(joined.shape[0]), int(joined.shape[1]))]
    return ranges, [(w, int(w.shape[0]), 1) for w in waves]


def _schedule(n, n_kv, c, itr, causal, tiles, head_dim, precision, device, backward: bool) -> _Tables:
    key = (n, n_kv, c, itr, causal, tiles, head_dim, precision, device)
    t = _tables.get(key)
    if t is None:
        t = _tables.put(key, _Tables(key))
        t.fwd = _device_tables(n, n_kv, c, itr, tiles[0], causal, "q", device)
        t.fwd_consts = constexprs("fwd", head_dim, tiles, causal, precision, MODE=1)
    if backward and t.dq is None:
        t.dq = _device_tables(n, n_kv, c, itr, tiles[4], causal, "q", device)      # dQ: BLOCK_M query rows
        t.dkdv = _device_tables(n, n_kv, c, itr, tiles[9], causal, "k", device)    # dK/dV: BLOCK_N key rows
        t.dq_consts = constexprs("dq", head_dim, tiles, causal, precision, DELTA_FROM_O=True)
        t.dkdv_consts = constexprs("dkdv", head_dim, tiles, causal, precision)
    return t


@functools.lru_cache(maxsize=64)
def _host_walk(n, n_kv, c, causal, rows, block_n):
    """The joined slot waves as the Gluon core's tile walk over row blocks of `rows` with `block_n`-key tiles (numpy
    (items, ranges): schedule.tile_walk), or None where the waves do not join."""
    sched = resident_schedule(n, c, 1, rows, causal, n_kv, "q")
    if sched.joined is None:
        return None
    return tile_walk(sched.joined, sched.ranges, block_n, causal, n_kv - n)


def _walk(n, n_kv, c, causal, head_dim, consumers, device):
    """_host_walk of the Gluon core's row blocks (64 rows a consumer warpgroup) and key tile at this head dim, on the
    device, or None where the waves do not join."""
    rows, block_n = consumers * gluon_core.ROWS_PER_CONSUMER, gluon_core.TILES[head_dim][0]
    key = ("walk", n, n_kv, c, causal, rows, block_n, device)
    if key not in _tables:
        walk = _host_walk(n, n_kv, c, causal, rows, block_n)
        _tables.put(key, None if walk is None else tuple(torch.from_numpy(t).to(device) for t in walk))
    return _tables[key]


def _walk_consumers(n, n_kv, c, causal, head_dim, heads, sms) -> int:
    """The core's consumer warpgroups for this walk on `sms` SMs (gluon_core.consumers_for): its items' tiles times
    their rows, one item a CTA in the launch's order (items fastest, then the B x H heads)."""
    block_n = gluon_core.TILES[head_dim][0]

    def busiest(consumers):
        rows = consumers * gluon_core.ROWS_PER_CONSUMER
        walk = _host_walk(n, n_kv, c, causal, rows, block_n)
        return math.inf if walk is None else gluon_core.busiest_sm(np.tile(walk[0][:, 3] * rows, heads), sms)

    return gluon_core.consumers_for(head_dim, busiest)


def _launches(kernel, tables, programs: int, fixed: tuple, consts: dict) -> list:
    """One Prepared launch per entry of _device_tables' list: grid (its items, programs), the fixed arguments then
    its wave count and (first, last) flags; each is called with the kernel's tensors and its items and ranges last.
    A single launch (joined waves) is first and last: it writes the results and never touches the state."""
    last = len(tables) - 1
    return [(items, Prepared(kernel, (count, programs), (*fixed, n_waves, int(i == 0), int(i == last)), consts))
            for i, (items, count, n_waves) in enumerate(tables)]


# --- the resident forward and backward: one plan of Prepared launches per call signature ----------------

# The forward reads K and V through tensor descriptors only from this many keys: up to 4096 pointer loads were
# faster on the H100 at 35 of 36 shapes (B x H 1, 8, 96; D 64 and 128; fp16;
# results/dev/descriptors_vs_pointers_h100.json), by 1-74 %: the descriptors' per-program setup and scratch
# allocation per launch (the exception, D = 128, B x H = 8, N = 1024, took 2.3x, between neighbours at 0.79x and
# 0.89x); from 8K descriptors were faster (+1-2 % at 8K, +5-6 % at 16K and 64K). Both comparisons ran on the
# earlier 128 x 64 forward tiles; the tuned 64 x 64 tiles (tuning.json) were chosen on the descriptor path at 16K.
DESC_MIN_KEYS = 8192


class _Forward(LaunchPlan):
    """A resident forward signature (kernels._launch.layout of q, k, v and the options): out and lse, then one
    launch of the joined slot waves; where they do not join (itr > 1), one fp32 state buffer (acc | m | l) and one
    launch per slot wave (l**itr).

    Joined waves of 16-bit inputs run on the Gluon Hopper core (kernels/_gluon_core.py) where it takes them (sm_90,
    contiguous inputs, its head dims), from its MIN_WORK and with the default tiles (a ``config`` override keeps
    this package's kernel): one program per row block (the core's CTA) walks the block's column ranges of every wave
    (schedule.tile_walk), merging them in registers as the Triton kernel's joined waves do."""

    def __init__(self, q, k, v, causal: bool, scale: float, c: int, itr: int, precision: str, tiles):
        B, H, N, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        self.place(q.device)
        self.out_shape, self.lse_shape = (B, H, N, D), (B, H, N)
        self.empty = N == 0 or B * H == 0
        if self.empty:
            return
        (cq, sq), (ck, sk), (cv, sv) = in_place("cqsa", q), in_place("cqsa", k), in_place("cqsa", v)
        self.copy = (cq, ck, cv) if cq or ck or cv else None
        self.walk = None
        if (itr == 1 and gluon_core.available(q, k, v) and B * H * N * Nk * D >= gluon_core.MIN_WORK
                and tiles == default_tiles(D, q.dtype, q.device.type)):
            consumers = _walk_consumers(N, Nk, c, causal, D, B * H, sm_count(q.device, 1))
            self.walk = _walk(N, Nk, c, causal, D, consumers, q.device)
        if self.walk is not None:
            self.gluon_launch = gluon_core.PlannedLaunch(walk=self.walk, causal=causal, qk_scale=scale * LOG2E,
                                                         lse_mode=1, consumers=consumers)
            return
        t = _schedule(N, Nk, c, itr, causal, tiles, D, precision, q.device, False)
        rows = B * H * N
        self.ranges, tables = t.fwd
        self.state_numel = rows * (D + 2) if len(tables) > 1 else 0
        # 16-bit K and V tiles through tensor descriptors where the layout allows (read in place: not for copied
        # inputs) and the head dim fills its tile. On the H100 (results/runs/20261124T200428Z_hopper and
        # 20261124T200836Z_full) that is +1-2 % at D=64 and D=128 8K, +5 % at 16K, +6 % at 64K; at D=80 and 96
        # (128-wide tiles) the descriptors' boxes past the head dim cost 4 % (results/dev/cqsa/descriptor_head_dims/),
        # so padded head dims keep pointer loads, as does float32 (the tf32x3 path the core is not tuned for), and
        # so do key lengths below DESC_MIN_KEYS.
        use_desc = (self.copy is None and q.dtype != torch.float32 and block_d(D) == D
                    and core.use_descriptors(k, v, min_rows=DESC_MIN_KEYS))
        self.use_desc = use_desc
        self.launches = _launches(cqsa_fwd_kernel, tables, B * H, (
            sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2],
            H, H // Hkv, N, rows * D, rows * (D + 1), Nk - N, scale * LOG2E), dict(t.fwd_consts, USE_DESC=use_desc))

    def run(self, q, k, v):
        # new_empty: half the host time of torch.empty(shape, dtype=, device=)
        out = q.new_empty(self.out_shape)
        lse = q.new_empty(self.lse_shape, dtype=_f32)
        if self.empty:
            return out, lse
        if self.walk is not None:
            self.gluon_launch(q, k, v, out, lse, out, *self.walk)
            return out, lse
        if self.copy is not None:
            cq, ck, cv = self.copy
            q, k, v = q.contiguous() if cq else q, k.contiguous() if ck else k, v.contiguous() if cv else v
        if self.use_desc:
            core.ensure_allocator()                 # device-side descriptors: per thread (autograd's too)
        state = q.new_empty(self.state_numel, dtype=_f32) if self.state_numel else lse    # lse: unused there
        ranges = self.ranges
        for items, go in self.launches:
            go(q, k, v, out, lse, state, items, ranges)
        return out, lse


# The resident backward at itr = 1 runs the sm_90 Gluon backward (kernels/_gluon_bwd.py) from this much work
# B * Hq * Nq * Nk, per (head dim, causal): on the H200 (results/dev/cqsa/gluon_backward_h200.json, fwd+bwd eager,
# fp16, B = 1, H = 8, 1K-16K) the first length from which it was at least as fast as this package's two kernels at
# every longer one: 2K (4K at D = 64 without a mask), then 0.42-0.75x their time from 4K (Llama-3-8B's causal GQA at
# 8K: 0.50x). Below it the Gluon launch's host work (its prologue, five TMA maps, dQ's cast) is not repaid, as in
# ELSA's backward (kernels/FLASH_CORE.md, "Gluon: the backward"). `scripts/tune.py --kernel cqsa --sections gluonbwd`
# measures the crossover with the harness's timer (paired, L2 flushed) and writes it to the tuning file
# ("gluon_bwd_min_work": {"<D>,<causal 0/1>": work}), whose entries replace these: on the H200 it found 2K at D = 128
# as here, and at D = 64 2K without a mask, 4K causal (results/dev/cqsa/gluon_backward_tune_h200/); after the
# backward's causal launch order (_gluon_bwd.heads_fastest_pays) causal D = 64 from 3K (1.02 -> 0.92 of the two
# kernels' time there), D = 128 from 1K, causal 1.5K (results/dev/cqsa/gluon_backward_tune_launch_order_h200/: those
# 1K-1.5K calls are host-bound, where the earlier tuning measured 1.07 / 1.08 and this one 0.89 / 0.94); after its
# causal D = 128 tiles were masked only where they cross the diagonal, causal D = 128 from 1K too (0.91 there,
# results/dev/gluon_bwd/crossover_per_tile_mask_h200/; 1K is the shortest length the section times). A call's
# config={"plan": {"gluon_bwd_min_work": work}} replaces them for that call (how the tuner times one backward against
# the other).
BUILTIN_GLUON_BWD_MIN_WORK = {(64, False): 8 * 4096 ** 2, (64, True): 8 * 2048 ** 2, (128, False): 8 * 2048 ** 2,
                              (128, True): 8 * 2048 ** 2}
GLUON_BWD_MIN_WORK = min_work_entries(TUNING_FILE, "gluon_bwd_min_work", BUILTIN_GLUON_BWD_MIN_WORK)
PLAN_PARAMS = ("gluon_bwd_min_work",)       # config["plan"] (kernels._common.split_plan)


def split_config(config) -> tuple[dict | None, int]:
    """A call's config as its tile parts (resolve_tiles's override, None for none) and its plan's gluon_bwd_min_work
    (0: none given, GLUON_BWD_MIN_WORK's)."""
    tiles, plan = split_plan("cqsa", config, PLAN_PARAMS)
    return tiles, plan.get("gluon_bwd_min_work", 0)


def _gluon_backward(do, q, k, v, out, causal: bool, itr: int, tiles, gluon_bwd_min_work: int):
    """Whether this resident backward runs on the Gluon backward: itr = 1, 16-bit inputs it can read (sm_90,
    contiguous q, k, v, a head dim of its HEAD_DIMS: gluon_bwd.usable), the default tiles (a ``config`` override
    keeps this package's kernels, as in the forward), O with a unit last stride, from gluon_bwd_min_work (the call's
    plan) or else GLUON_BWD_MIN_WORK."""
    B, H, N, D = q.shape
    return (itr == 1 and gluon_bwd.usable(q, k, v, do) and out.stride(-1) == 1
            and B * H * N * k.shape[2] >= (gluon_bwd_min_work or GLUON_BWD_MIN_WORK[(D, causal)])
            and tiles == default_tiles(D, q.dtype, q.device.type))


class _Backward(LaunchPlan):
    """A resident backward signature (layout of dO, q, k, v, O, lse and the options): dq, dk, dv and one fp32
    workspace (δ, after the dq and dk/dv accumulators where those run as several waves), then the dQ launch (its
    first wave computes δ = rowsum(dO ⊙ O)) and the dK/dV launch, each of the joined waves where they join, else
    one per wave.

    At itr = 1 with 16-bit inputs on sm_90 (_gluon_backward) it is the Gluon backward instead, the one ELSA's
    backward runs (kernels/_gluon_bwd.py): one program per block of keys walks every query tile that sees them.
    That is the §4.2 form with one task, the whole sequence: the root of the task tree, a frontier like any other
    (spec §4.2, §5.1: every term is a sum over kept pairs, and the backward may use its own schedule). Its dQ is
    added by TMA reductions, so unlike this package's two kernels its dQ is not bit-for-bit deterministic (fp32 adds
    in the order the programs reach them)."""

    def __init__(self, do, q, k, v, out, lse, causal: bool, scale: float, c: int, itr: int, precision: str, tiles,
                 gluon_bwd_min_work: int):
        B, H, N, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        self.place(q.device)
        self.q_shape, self.kv_shape = (B, H, N, D), (B, Hkv, Nk, D)
        self.empty = N == 0 or Nk == 0 or B * H == 0
        self.gluon = None
        if self.empty:
            return
        if _gluon_backward(do, q, k, v, out, causal, itr, tiles, gluon_bwd_min_work):
            # the kernel's row statistic is base 2 (p = exp2(s * scale * log2 e - lse2)); ours is the natural log,
            # which its loader scales as it reads it
            self.gluon = gluon_bwd.Launch(q, k, out.stride()[:3], causal, scale, gluon_bwd.TILES[(D, causal)],
                                          lse_scale=LOG2E)
            return
        ins = [in_place("cqsa", x) for x in (q, k, v, do)]
        # out and lse are read as contiguous [B, H, N(, D)] (the forward's own outputs are)
        self.copy = (*(cp for cp, _ in ins), not out.is_contiguous(), not lse.is_contiguous())
        if not any(self.copy):
            self.copy = None
        sq, sk, sv, sd = (st for _, st in ins)
        t = _schedule(N, Nk, c, itr, causal, tiles, D, precision, q.device, True)
        self.dq_ranges, dq_tables = t.dq
        self.dkdv_ranges, dkdv_tables = t.dkdv
        # the fp32 accumulators across waves, only where a kernel runs as several launches: dq at 0, then dk, dv
        n_q = B * H * N * D if len(dq_tables) > 1 else 0
        n_kv = B * Hkv * Nk * D if len(dkdv_tables) > 1 else 0
        off_delta = n_q + 2 * n_kv
        self.ws_numel = off_delta + B * H * N
        strides = (sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sd[0], sd[1], sd[2])
        qk_scale = scale * LOG2E
        self.dq = _launches(cqsa_bwd_dq_kernel, dq_tables, B * H, (
            *strides, H, H // Hkv, N, N, off_delta, Nk - N, qk_scale, scale), t.dq_consts)
        self.dkdv = _launches(cqsa_bwd_dkdv_kernel, dkdv_tables, B * Hkv, (
            *strides, Hkv, H // Hkv, N, Nk, off_delta, n_q, n_q + n_kv, Nk - N, qk_scale, scale), t.dkdv_consts)

    def run(self, do, q, k, v, out, lse):
        if self.gluon is not None:
            return self.gluon(do, q, k, v, out, lse)
        dq = q.new_empty(self.q_shape)
        dk = k.new_empty(self.kv_shape)
        dv = v.new_empty(self.kv_shape)
        if self.empty:
            return dq.zero_(), dk.zero_(), dv.zero_()
        if self.copy is not None:
            q, k, v, do, out, lse = (x.contiguous() if cp else x for x, cp in zip((q, k, v, do, out, lse), self.copy))
        ws = q.new_empty(self.ws_numel, dtype=_f32)
        ranges = self.dq_ranges
        for items, go in self.dq:
            go(q, k, v, out, do, lse, ws, dq, items, ranges)
        ranges = self.dkdv_ranges
        for items, go in self.dkdv:
            go(q, k, v, do, lse, ws, dk, dv, items, ranges)
        return dq, dk, dv


_f32 = torch.float32
_fwd_plans = SignatureCache()
_bwd_plans = SignatureCache()


def forward_plan(q, k, v, causal: bool, scale: float, c: int, itr: int, precision: str, tiles) -> _Forward:
    """The cached plan of this resident forward signature (made on first use)."""
    tiles = tuple(tiles)
    key = (layout(q, k, v), causal, scale, c, itr, precision, tiles)
    return _fwd_plans.get(key) or _fwd_plans.put(key, _Forward(q, k, v, causal, scale, c, itr, precision, tiles))


def backward_plan(do, q, k, v, out, lse, causal: bool, scale: float, c: int, itr: int, precision: str,
                  tiles, gluon_bwd_min_work: int = 0) -> _Backward:
    """The cached plan of this resident backward signature (made on first use)."""
    tiles = tuple(tiles)
    key = (layout(do, q, k, v, out, lse), causal, scale, c, itr, precision, tiles, gluon_bwd_min_work)
    return _bwd_plans.get(key) or _bwd_plans.put(
        key, _Backward(do, q, k, v, out, lse, causal, scale, c, itr, precision, tiles, gluon_bwd_min_work))


def resident_forward(q, k, v, causal: bool, scale: float, c: int, itr: int, precision: str, tiles,
                     gluon_bwd_min_work: int = 0):
    """O [B,Hq,Nq,D] (q's dtype) and the global natural-log lse [B,Hq,Nq] (fp32), everything on q's device.
    gluon_bwd_min_work is the backward's (split_config), carried by the forward op for its autograd formula."""
    return forward_plan(q, k, v, causal, scale, c, itr, precision, tiles)(q, k, v)


def resident_backward(do, q, k, v, out, lse, causal: bool, scale: float, c: int, itr: int, precision: str, tiles,
                      gluon_bwd_min_work: int = 0):
    """(dq, dk, dv) in the inputs' dtype; dk, dv summed over the query heads that share a key/value head."""
    return backward_plan(do, q, k, v, out, lse, causal, scale, c, itr, precision, tiles,
                         gluon_bwd_min_work)(do, q, k, v, out, lse)


# --- the ops ------------------------------------------------------------------------------------------------

_lib = torch.library.Library("attnbench", "FRAGMENT")
# Resident CQSA forward: (out [B,Hq,Nq,D], lse [B,Hq,Nq] fp32 natural log); precision: tl.dot's input precision;
# tiles: resolve_tiles()'s 12 ints; gluon_bwd_min_work: the backward's threshold for the Gluon kernel (0: the
# table's). Backward (§4.2 form with the forward's global lse): (dq, dk, dv).
cqsa_fwd = define_op(_lib, "cqsa_fwd(Tensor q, Tensor k, Tensor v, bool causal, float scale, int c, int itr, "
                           "str precision, int[] tiles, int gluon_bwd_min_work=0) -> (Tensor, Tensor)",
                     resident_forward)
cqsa_bwd = define_op(_lib, "cqsa_bwd(Tensor do, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
                           "float scale, int c, int itr, str precision, int[] tiles, int gluon_bwd_min_work=0) "
                           "-> (Tensor, Tensor, Tensor)", resident_backward)


@torch.library.register_fake("attnbench::cqsa_fwd", lib=_lib)
def _cqsa_fwd_fake(q, k, v, causal, scale, c, itr, precision, tiles, gluon_bwd_min_work=0):
    B, H, N, D = q.shape
    return q.new_empty((B, H, N, D)), q.new_empty((B, H, N), dtype=torch.float32)


@torch.library.register_fake("attnbench::cqsa_bwd", lib=_lib)
def _cqsa_bwd_fake(do, q, k, v, out, lse, causal, scale, c, itr, precision, tiles, gluon_bwd_min_work=0):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class _CqsaFunction(KernelFunction):
    """cqsa_fwd's autograd formula (kernels/_ops.py): save the inputs, out and lse; the backward is cqsa_bwd."""

    @staticmethod
    def forward(ctx, is_plain, q, k, v, causal, scale, c, itr, precision, tiles, gluon_bwd_min_work=0):
        if is_plain:
            out, lse = resident_forward(q, k, v, causal, scale, c, itr, precision, tiles)
        else:
            with below_autograd():
                out, lse = cqsa_fwd(q, k, v, causal, scale, c, itr, precision, tiles, gluon_bwd_min_work)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (causal, scale, c, itr, precision, tiles, gluon_bwd_min_work)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)      # no zero gradient for lse (kernels/_ops.py)
        return out, lse

    @staticmethod
    def gradients(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if plain(dout, q, k, v, out, lse):
            dq, dk, dv = resident_backward(dout, q, k, v, out, lse, *ctx.options)
        else:
            dq, dk, dv = cqsa_bwd(dout, q, k, v, out, lse, *ctx.options)
        return None, dq, dk, dv, None, None, None, None, None, None, None


# what cqsa_attention calls: the Autograd kernel, or the op where a mode, tracer or compiler must see it
cqsa_call = register_autograd(_lib, "cqsa_fwd", _CqsaFunction, resident_forward)
not_differentiable(_lib, "cqsa_bwd")


# --- the public function ------------------------------------------------------------------------------------

# A call's checks and what follows from them (the scale, tl.dot's precision, the tiles), per call signature
# (kernels._common.signature: the inputs' shapes, dtypes and devices and the options with their exact types), for
# the signatures that passed them; not under torch.compile, which traces the checks instead.
_checked = SignatureCache()
_is_compiling = torch.compiler.is_compiling


def _resolve(q, k, v, causal, scale, c, itr, precision, config):
    """(scale, dot precision, tiles, the Gluon backward's threshold) of a resident call, after its checks."""
    shape = check_call(q, k, v, causal=causal, scale=scale, c=c, itr=itr, precision=precision)
    tile_override, gluon_bwd_min_work = split_config(config)
    tiles = resolve_tiles(shape.head_dim, q.dtype, q.device.type, tile_override)
    return default_scale(scale, shape.head_dim), dot_precision(q.dtype, precision), list(tiles), gluon_bwd_min_work


def cqsa_attention(q, k, v, causal=False, scale=None, c=7, itr=1, mem_budget=None, *, precision="tf32x3",
                   config=None, stream=None, device=None, return_stats=False, **stream_opts):
    """Exact softmax attention computed as independent CQS subsequence tasks.

    q: [B, Hq, Nq, D]; k, v: [B, Hkv, Nk, D] with Hq % Hkv == 0 (grouped-query K/V read in place); causal with
    Nq != Nk is aligned bottom-right. float32, float16, bfloat16 (CUDA); D any multiple of 8 from 16 to 256.
    c: chunk count (a key of INTEREST_SETS); itr: divide granularity (depth) >= 1.
    precision: float32 dot products, "tf32x3" (default), "ieee" or "tf32". config: tile overrides,
    ``{"fwd" | "dq" | "dkdv": {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages": int}}`` (BLOCK_M queries,
    BLOCK_N keys); resident calls also take ``config["plan"] = {"gluon_bwd_min_work": work}``: from how much work
    B * Hq * Nq * Nk the backward runs on the Gluon kernel (below). Gradients are bit-for-bit reproducible except
    where the backward runs on the sm_90 Gluon kernel (itr = 1, 16-bit, D = 64 / 128, from GLUON_BWD_MIN_WORK or
    the plan's), whose dQ is summed by TMA reductions in no fixed order; a config that changes any tile (or
    itr > 1) keeps this package's deterministic kernels.
    mem_budget: bytes the process may hold on the compute device while the call runs, what it held before
    included (torch.cuda.memory_allocated: inputs there, cuBLAS's workspaces). Given, the streaming engine
    runs (itr then is the smallest depth it starts from; the planner and the OOM guardrail may go
    deeper). Inputs on the host with a GPU present are streamed to the GPU too (``stream`` forces
    either mode; streaming runs eagerly only, never under torch.compile).
    Returns [B, Hq, Nq, D] on the inputs' device; with return_stats=True, (out, stats) (stats None when
    resident).
    """
    if stream is None:
        stream = mem_budget is not None or (isinstance(q, torch.Tensor) and q.device.type == "cpu"
                                            and torch.cuda.is_available())
    if stream:
        if isinstance(config, dict) and "plan" in config:
            raise ValueError("cqsa: config['plan'] is the resident backward's: streaming runs its own kernels")
        out, stats = stream_attention(q, k, v, causal=causal, scale=scale, c=c, itr=itr, precision=precision,
                                      config=config, device=device, mem_budget=mem_budget, **stream_opts)
        return (out, stats) if return_stats else out
    if mem_budget is not None or stream_opts or device is not None:
        raise ValueError("cqsa: mem_budget, device and the streaming engine's options need stream mode")
    key = None if config is not None or _is_compiling() else signature(q, k, v, causal, scale, c, itr, precision)
    settings = _checked.get(key)
    if settings is None:
        settings = _resolve(q, k, v, causal, scale, c, itr, precision, config)
        if key is not None:
            _checked.put(key, settings)
    sc, prec, tiles, gluon_bwd_min_work = settings
    out = cqsa_call(q, k, v, causal, sc, c, itr, prec, tiles, gluon_bwd_min_work)[0]
    return (out, None) if return_stats else out
