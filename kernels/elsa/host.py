"""ELSA host code: the bodies of the torch.library ops (kernels/elsa/ops.py): buffers and launches.

Forward, per q-chunk of rows [q0, q0 + q_chunk):
  phase 1  grid (QB, B*Hq, P): program (qb, bh, p) folds the keys of partition p for BLOCK_M query rows
           into one monoid summary per row and stores it to global memory: (m, z) in fp32, and s in fp32
           (float32 inputs) or s / z in the inputs' dtype (16-bit: half the bytes, and it cannot overflow);
  phase 2  grid (QB*BLOCK_M/ROWS, B*Hq), a separate launch: reads only those summaries, merges the
           partitions of each row (causal: only partitions at or before the block's diagonal) and
           writes out = s / z (0 for a row with no visible key), plus lse = m + log2 z for training.
With a single partition (P = 1, short key lengths) there is nothing to merge: phase 1 writes out and lse
itself, one launch and no summary buffer. On sm_90 phase 1 runs the Gluon core for 16-bit inputs without a bias
(_GluonPhase1) and, for float32 at gluon_phase1.HEAD_DIMS, gluon_phase1.py's wgmma kernel in _elsa_phase1's place
(the plan decides both, from their MIN_WORK).
Backward: a dQ kernel (which also stores Delta = rowsum(dO * O)) then a dK/dV kernel, both rebuilding every
softmax weight as 2^(x - lse); for 16-bit calls up to config.ONE_LAUNCH_MAX_WORK, one kernel whose programs do
either job (its dK/dV programs compute Delta from O themselves): one launch and no Delta buffer where the host
sets the pace.
Extra memory: the summary buffer of one q-chunk plus O(B*Hq*Nq) row terms.

Host cost matters at short sequences (a ViT's 197 tokens): everything that depends only on the call's
signature (shapes, strides, dtypes, devices, options) is computed once and cached — the partition plan, the
strides, the grids and every launch's fixed arguments (kernels._launch.Prepared) — so a call is one key
lookup, its allocations and its launches.
"""
from __future__ import annotations

import torch

from .. import _flash_core as core
from .. import _gluon_bwd as gluon_bwd
from .. import _gluon_core as gluon_core
from .._common import LOG2E, block_d, check_inputs, check_precision, dot_precision, l2_bytes, sm_count, unit_last
from .._launch import LaunchPlan, Prepared, SignatureCache, dependent_launch_ok, layout
from .._ops import traceable
from . import gluon_phase1, trace
from .config import DEFAULT_SM_COUNT, PHASE2_WARPS, backward_launches, plan_backward, plan_forward, summary_numel
from .kernel import _elsa_bwd_dkdv, _elsa_bwd_dq, _elsa_bwd_one_launch, _elsa_phase1, _elsa_phase2

_INT32_MAX = 2**31 - 1
# Phase 1 reads through tensor descriptors only from this many rows (the longer of Nq and Nk). On the H100
# (results/dev/descriptors_vs_pointers_h100.json: B x H 1, 8, 96; D 64 and 128; fp16) pointer loads were faster
# at 23 of the 24 shapes of 128-1024 tokens, by 2-90 % (the exception: D = 128, B x H = 1, N = 256), and they
# spare each launch the descriptors' scratch allocation (~4 us of host time per forward at N = 128); from 2048 on
# they took 1.14-1.32x the descriptors' time at D = 128 and B x H >= 8.
DESC_MIN_ROWS = 2048
_GRID_Y_MAX = 65535
# Plans are keyed by the full call signature (a SignatureCache: cleared when full, each signature is then planned
# once more).
_fwd_plans = SignatureCache()
_bwd_plans = SignatureCache()
_f32 = torch.float32
_zeros = torch.zeros


def clear_plans() -> None:
    """Forget every cached plan (tests; the next call of each signature plans again)."""
    _fwd_plans.clear()
    _bwd_plans.clear()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def out_heads_inner(q) -> bool:
    """Whether the output [B, Hq, Nq, D] is laid out as [B, Nq, Hq, D] in memory: where q is (heads inside rows:
    timm's q, k, v, sliced from one [B, N, 3, Hq, D] projection), the order SDPA's flash and efficient backends
    return too, so the caller's transpose(1, 2).reshape(B, Nq, Hq * D) is a view and not a copy kernel. Every store
    of the output goes through its (batch, head, row) strides: phase 1's pointer stores, its per-head tensor
    descriptors (TMA wants 16-byte multiples for strides; this layout's head and row steps are multiples of D, a
    multiple of 8, times the element size), phase 2's merge. The Gluon core, whose descriptors span all heads'
    rows, takes only a contiguous q, so it never meets this layout. While one head's rows stay within int32 offsets
    (the pointer stores)."""
    _, h, n, d = q.shape
    return h > 1 and n > 1 and q.stride(1) < q.stride(2) and (n - 1) * h * d + d <= _INT32_MAX


def output_strides(q) -> tuple:
    """The strides of the output [B, Hq, Nq, D] of a call with this q: the memory order out_heads_inner says. The
    forward plan (once per signature) and the fake (new_output) take them from here."""
    _, h, n, d = q.shape
    return (n * h * d, d, h * d, 1) if out_heads_inner(q) else (h * n * d, n * d, d, 1)


def new_output(q):
    """The forward's output [B, Hq, Nq, D] in q's dtype and device with output_strides: a tensor of its own, not a
    view (autograd refuses in-place changes to a view a custom Function returns)."""
    return q.new_empty_strided(q.shape, output_strides(q))


def _signature(q, k, v, bias, causal, scale, precision, config, flag):
    """Everything a plan depends on: shapes, strides, dtypes, devices and 16-byte alignment of each data pointer
    (kernels._launch.layout: Triton specialises on it; so do the prepared launches), and the options."""
    return (layout(q, k, v) if bias is None else layout(q, k, v, bias)), causal, scale, precision, config, flag


class _Common:
    """What the forward and the backward plan of one signature share."""

    def __init__(self, q, k, v, bias, causal, scale, precision):
        shape = check_inputs("elsa", q, k, v, causal=causal, scale=scale)   # op called directly: checked too
        check_precision("elsa", precision)
        self.B, self.H, self.HKV = shape.batch, shape.heads_q, shape.heads_kv
        self.NQ, self.NK, self.D = shape.len_q, shape.len_kv, shape.head_dim
        self.group = shape.group
        self.BH = self.B * self.H
        if self.BH > _GRID_Y_MAX:
            raise ValueError(f"elsa: batch x query heads = {self.BH} exceeds the CUDA grid limit {_GRID_Y_MAX}")
        self.BD = block_d(self.D)
        self.dtype = q.dtype
        self.device = q.device
        self.copy = tuple(unit_last("elsa", t) is not t for t in (q, k, v))
        self.any_copy = any(self.copy)
        strides = [((t.shape[1] * t.shape[2] * t.shape[3], t.shape[2] * t.shape[3], t.shape[3]) if c else
                    tuple(t.stride()[:3])) for t, c in zip((q, k, v), self.copy)]
        self.qkv_strides = (*strides[0], *strides[1], *strides[2])
        if bias is None:
            self.bias_strides = (0, 0, 0, 0)
        else:
            view = bias.expand(self.B, self.H, self.NQ, self.NK)
            self.bias_strides = tuple(view.stride())
            if (self.NQ - 1) * abs(self.bias_strides[2]) + (self.NK - 1) * abs(self.bias_strides[3]) > _INT32_MAX:
                raise ValueError("elsa: attn_bias of one head exceeds 2^31 elements (int32 in-head offsets)")
        self.qk_scale = scale * LOG2E
        self.scale = scale
        self.causal = causal
        self.fold_q = q.dtype == torch.float32
        self.scale_in_exp = not self.fold_q and bias is None
        self.prec = dot_precision(q.dtype, precision)
        # the constexprs every kernel takes
        self.flags = dict(HEAD_DIM=self.D, BLOCK_D=self.BD, CAUSAL=causal, HAS_BIAS=bias is not None,
                          FOLD_Q=self.fold_q, SCALE_IN_EXP=self.scale_in_exp, DOT_PREC=self.prec)

    def read(self, q, k, v) -> tuple:
        """q, k, v as the kernels read them: each copied where its last stride is not 1 (``copy``)."""
        if not self.any_copy:
            return q, k, v
        return tuple(t.contiguous() if cp else t for t, cp in zip((q, k, v), self.copy))


# ------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------

class _FwdPlan(LaunchPlan):
    """Buffers and prepared launches of the forward of one signature."""

    def __init__(self, q, k, v, bias, causal, scale, precision, config, need_lse, traced=False):
        c = self.c = _Common(q, k, v, bias, causal, scale, precision)
        self.place(c.device)
        self.need_lse = need_lse
        # the output's memory order, decided on the caller's q as new_output does (run() may copy q)
        self.out_shape = (c.B, c.H, c.NQ, c.D)
        self.out_strides = output_strides(q)
        self.lse_shape = (c.B, c.H, c.NQ)
        # 16-bit without bias: phase 1 is the flash core's loop, through tensor descriptors where the layout allows
        # (decided on the tensors phase 1 reads: the copies run() makes are contiguous) and the rows are long enough.
        # A traced plan (traced_forward: its tensors have no data pointer to check) asks only what the layout does
        # not decide, and is handed to inductor (``traceable``) only where eager may take pointers: it uses pointers
        read = c.read(q, k, v)
        if traced:
            use_desc = False
            self.traceable = not (c.scale_in_exp and core.descriptors_eligible(*read, min_rows=DESC_MIN_ROWS))
        else:
            use_desc = c.scale_in_exp and core.use_descriptors(*read, min_rows=DESC_MIN_ROWS)
        self.use_desc = use_desc
        # the Gluon core's descriptors are made on the host, not by each program: DESC_MIN_ROWS (the Triton core's
        # in-kernel descriptors against its pointer loads) does not apply; the core's MIN_WORK does (plan_forward). At
        # ViT-H/14's 1025 tokens (B=32, H=16, D=80) phase 1 on it took 0.57 ms against 0.83 with pointer loads
        # (results/dev/gluon_core/short_rows_h100.json)
        gluon_ok = c.scale_in_exp and (gluon_core.eligible(q) if traced else gluon_core.available(q, k, v))
        tf32_ok = c.prec == "tf32x3" and gluon_phase1.eligible(q)   # read() gives unit strides; the plan: no bias
        plan = self.plan = plan_forward(c.NQ, c.NK, c.BH, c.D, c.dtype, sm_count(c.device, DEFAULT_SM_COUNT), config,
                                        causal, bias is not None, core.warp_specialize_ok(c.device, use_desc),
                                        gluon_ok, tf32_ok, c.group, l2_bytes(c.device))
        if traced:          # a Gluon kernel (the core's, float32's) is not a Triton kernel inductor can take
            self.traceable = self.traceable and not (plan.gluon or plan.tf32_gluon)
        bm, W, P = plan.block_m, plan.width, plan.parts
        out_strides = self.out_strides[:3]
        qb_max = _cdiv(min(plan.q_chunk, c.NQ), bm) if c.NQ else 0
        nrows = 0 if plan.final else P * qb_max * c.BH * bm
        self.sbuf_numel = summary_numel(plan, c.NQ, c.BH, c.D, c.dtype)
        p1_const = dict(c.flags, BLOCK_M=bm, BLOCK_N=plan.block_n, FINAL=plan.final, STORE_LSE=need_lse,
                        KEYS_EVEN=c.NK % plan.block_n == 0, USE_DESC=use_desc, WARP_SPECIALIZE=plan.warp_specialize,
                        num_warps=plan.num_warps)
        if plan.tf32_gluon:
            phase1 = gluon_phase1._elsa_phase1_tf32      # _elsa_phase1's arguments (a Gluon kernel: no stages)
        else:
            phase1 = _elsa_phase1
            p1_const["num_stages"] = plan.num_stages
        p2_const = dict(HEAD_DIM=c.D, BLOCK_D=c.BD, BLOCK_M=bm, ROWS=plan.p2_rows, KBT=plan.p2_kbt, CAUSAL=causal,
                        STORE_LSE=need_lse, num_warps=PHASE2_WARPS, num_stages=2)
        # phase 2 as a programmatic dependent of phase 1 (eager, sm_90): its launch overlaps phase 1's last programs,
        # and it waits for phase 1's stores in the kernel (PDL). Not when traced: inductor launches what it is handed.
        dependent = not traced and not plan.final and dependent_launch_ok(c.device)
        p2_const.update(PDL=dependent)
        if dependent:
            p2_const.update(launch_pdl=True)
        self.chunks = []            # per q-chunk: (phase-1 launch, phase-2 launch or None, trace info)
        if c.BH == 0:
            return
        for q0 in range(0, c.NQ, plan.q_chunk):
            qlen = min(plan.q_chunk, c.NQ - q0)
            QB = _cdiv(qlen, bm)
            grid1 = (QB, c.BH, P)
            if plan.gluon:
                p1 = _GluonPhase1(causal=causal, qk_scale=c.qk_scale, q0=q0, n_blocks=QB, parts=P, width=W,
                                  n_slots=nrows, summary=not plan.final, lse_mode=2 if need_lse else 0,
                                  consumers=bm // gluon_core.ROWS_PER_CONSUMER, launch_dependents=dependent,
                                  causal_rounds=plan.causal_rounds)
            else:
                p1 = Prepared(phase1, grid1, (*c.qkv_strides, *c.bias_strides, *out_strides, c.H, c.group,
                                              c.NQ, c.NK, q0, QB, c.BH, W, nrows, c.qk_scale), p1_const)
            p2 = None
            grid2 = (QB * (bm // plan.p2_rows), c.BH)
            if not plan.final:
                p2 = Prepared(_elsa_phase2, grid2, (*out_strides, c.H, c.NQ, c.NK, q0, QB, c.BH, P, W, nrows),
                              p2_const)
            self.chunks.append((p1, p2, dict(q0=q0, qlen=qlen, QB=QB, grid1=grid1, grid2=grid2)))

    def run(self, q, k, v, bias, traced=False, out=None):
        """(out, lse or None). traced: torch.compile's trace (traced_forward): each launch through
        Prepared.traced, and a pointer the launch leaves unused gets q, which no launch writes: no two arguments
        of one launch alias a tensor it writes (functionalization could otherwise keep the wrong one's copy).
        out: the output to write (eager; the packed entry's), with the plan's strides (new_output's order)."""
        c = self.c
        if self.use_desc:
            core.ensure_allocator()                 # device-side descriptors: per thread (autograd's too)
        q, k, v = c.read(q, k, v)
        # new_empty_strided: less host time than torch.empty_strided(..., dtype=, device=) (q has the plan's dtype
        # and device); the memory order of new_output
        if out is None:
            out = q.new_empty_strided(self.out_shape, self.out_strides)
        elif out.stride() != self.out_strides:
            raise ValueError(f"elsa: an output buffer with strides {out.stride()}, the plan writes {self.out_strides}")
        lse = q.new_empty(self.lse_shape, dtype=_f32) if self.need_lse else (q if traced else out)
        b = q if bias is None else bias
        if traced:
            sbuf = q if self.plan.final else q.new_empty(self.sbuf_numel, dtype=_f32)
            for p1, p2, _ in self.chunks:
                p1.traced(q, k, v, b, sbuf, out, lse)
                if p2 is not None:
                    p2.traced(sbuf, out, lse)
        elif trace.active():
            self._run_traced(q, k, v, b, out, lse)
        elif self.plan.final:
            for p1, _, _ in self.chunks:
                p1(q, k, v, b, out, out, lse)
        else:
            sbuf = q.new_empty(self.sbuf_numel, dtype=_f32)
            for p1, p2, _ in self.chunks:
                p1(q, k, v, b, sbuf, out, lse)
                p2(sbuf, out, lse)
        return out, (lse if self.need_lse else None)

    def _run_traced(self, q, k, v, b, out, lse):
        """run() with one trace event per launch (trace.py; `attnbench verify-2pass` reads them)."""
        c, plan = self.c, self.plan
        final = plan.final
        sbuf = out if final else q.new_empty(self.sbuf_numel, dtype=_f32)
        if final:
            buffer = dict(summary_shape=None, summary_buffer=None, summary_device="", summary_dtype="",
                          summary_ptr=None)
        else:
            buffer = dict(summary_buffer=(self.sbuf_numel,), summary_device=str(sbuf.device),
                          summary_dtype=str(sbuf.dtype).replace("torch.", ""), summary_ptr=sbuf.data_ptr())
        for p1, p2, info in self.chunks:
            summary_shape = None if final else (plan.parts, info["QB"], c.BH, plan.block_m, c.D)
            ev = trace.start_event(c.device)
            k1 = p1(q, k, v, b, sbuf, out, lse)
            trace.record(start=ev, phase=1, kernel=p1.jit_fn.__name__, grid=info["grid1"],
                         programs=info["QB"] * c.BH * plan.parts, partitions=plan.parts, partition_width=plan.width,
                         q_chunk=(info["q0"], info["qlen"]), block_m=plan.block_m, final=final,
                         args=trace.kernel_arg_names(p1.jit_fn), compiled=k1,
                         **dict(buffer, summary_shape=summary_shape))
            if p2 is not None:
                ev = trace.start_event(c.device)
                k2 = p2(sbuf, out, lse)
                trace.record(start=ev, phase=2, kernel=_elsa_phase2.__name__, grid=info["grid2"],
                             programs=info["grid2"][0] * c.BH, partitions=plan.parts,
                             q_chunk=(info["q0"], info["qlen"]), args=trace.kernel_arg_names(_elsa_phase2),
                             compiled=k2, **dict(buffer, summary_shape=summary_shape))


class _GluonPhase1:
    """Phase 1 on the Gluon Hopper core (kernels/_gluon_core.py), called like the Prepared _elsa_phase1 it
    replaces: the same grid (QB, B*Hq, P) of the plan's row blocks (the core's CTA), the same summary slots, out
    and base-2 lse."""

    __slots__ = ("go",)
    jit_fn = gluon_core._gluon_fwd_kernel if gluon_core.HAS_GLUON else None

    def __init__(self, **options):
        self.go = gluon_core.PlannedLaunch(**options)

    def __call__(self, q, k, v, b, sbuf, out, lse):
        return self.go(q, k, v, out, lse, sbuf, out, out)


def forward_plan(q, k, v, bias, causal: bool, scale: float, precision: str, config: str, need_lse: bool):
    """The cached plan of this forward signature (made on first use)."""
    key = _signature(q, k, v, bias, causal, scale, precision, config, need_lse)
    plan = _fwd_plans.get(key)
    if plan is None:
        plan = _fwd_plans.put(key, _FwdPlan(q, k, v, bias, causal, scale, precision, config, need_lse))
    return plan


def forward(q, k, v, bias, causal: bool, scale: float, precision: str, config: str, need_lse: bool, out=None):
    """(out [B, Hq, Nq, D], lse [B, Hq, Nq] fp32 in log2 units, or None unless need_lse); out: written in place
    when given (new_output's strides)."""
    return forward_plan(q, k, v, bias, causal, scale, precision, config, need_lse)(q, k, v, bias, False, out)


def traced_forward(q, k, v, bias, causal: bool, scale: float, precision: str, config: str, need_lse: bool):
    """forward() as torch.compile traces it (kernels/_ops.py, decompose_when_traced): the same plan's launches
    through wrap_triton, which inductor emits and launches itself. None, and the op stays opaque, where the
    launches cannot be handed over (``traceable``; the plan's ``traceable``: descriptors or the Gluon core)."""
    if not traceable(q, k, v, bias):
        return None
    plan = _FwdPlan(q, k, v, bias, causal, scale, precision, config, need_lse, traced=True)
    return plan.run(q, k, v, bias, traced=True) if plan.traceable else None


# ------------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------------

def dscores_dtype(q_shape, nk: int, bias) -> torch.dtype:
    """The dtype of the backward's dscores: attn_bias's own where attn_bias has dscores' full shape [B, Hq, Nq, Nk]
    (its gradient is dscores cast to its dtype: the kernel's store does that cast, and saves a launch); fp32 where
    the gradient sums dscores over broadcast dimensions."""
    if bias is not None and tuple(bias.shape) == (*q_shape[:3], nk):
        return bias.dtype
    return _f32


class _BwdPlan(LaunchPlan):
    """Buffers and prepared launches of the backward of one signature (that of the forward plus the layouts of dO
    and of the forward's output)."""

    def __init__(self, do, q, k, v, out, bias, causal, scale, precision, config, bias_grad, packed=False,
                 traced=False):
        c = self.c = _Common(q, k, v, bias, causal, scale, precision)
        self.place(c.device)
        for name, t in (("output gradient", do), ("output", out)):
            if tuple(t.shape) != (c.B, c.H, c.NQ, c.D) or t.dtype != c.dtype or t.device != c.device:
                raise ValueError(f"elsa: the {name} is {tuple(t.shape)} {t.dtype} on {t.device}, expected "
                                 f"{(c.B, c.H, c.NQ, c.D)} {c.dtype} on {c.device}")
        contiguous = (c.H * c.NQ * c.D, c.NQ * c.D, c.D)
        self.copy_do = unit_last("elsa", do) is not do
        do_strides = contiguous if self.copy_do else tuple(do.stride()[:3])
        self.copy_out = unit_last("elsa", out) is not out
        o_strides = contiguous if self.copy_out else tuple(out.stride()[:3])     # new_output's order, or any
        if bias_grad and c.NQ * c.NK > _INT32_MAX:
            raise ValueError(f"elsa: the attn_bias gradient of one head ({c.NQ} x {c.NK}) exceeds 2^31 elements")
        self.bias_grad = bias_grad
        self.q_shape, self.kv_shape = (c.B, c.H, c.NQ, c.D), (c.B, c.HKV, c.NK, c.D)
        self.lse_shape = (c.B, c.H, c.NQ)
        self.ds_shape = (c.B, c.H, c.NQ, c.NK)
        self.ds_dtype = dscores_dtype(self.q_shape, c.NK, bias)
        self.launches = backward_launches(c.BH, c.NQ, c.NK, c.dtype, config)
        # the Gluon backward reads q, k, v as run() passes them (copied where c.copy says) and a contiguous dO (its
        # own copy where dO is not); a traced plan (fake tensors, no data pointer) asks what the layout decides
        read = c.read(q, k, v)
        gluon_capable = (not (packed or bias_grad or bias is not None)
                         and (gluon_bwd.eligible(*read) if traced else gluon_bwd.usable(*read, do)))
        plan = self.plan = plan_backward(c.D, c.dtype, config, c.NQ, self.launches, bias is not None, causal,
                                         c.BH * c.NQ * c.NK, gluon_capable)
        kv_strides = (c.HKV * c.NK * c.D, c.NK * c.D, c.D)
        dq_strides = contiguous
        # packed: dq, dk, dv go to the slices of one [B, N, 3, H, D] buffer (run's dqkv), the packed entry's gradient
        self.packed = packed
        if packed:
            if c.group != 1 or c.NQ != c.NK or c.BH == 0 or c.NQ == 0:
                raise ValueError("elsa: a packed q, k, v gradient needs as many key/value heads and keys as queries, "
                                 "and a non-empty problem")
            dq_strides = kv_strides = (c.NQ * 3 * c.H * c.D, c.D, 3 * c.H * c.D)
        dq_m, dq_n, dq_warps, dq_stages = plan.dq
        kv_m, kv_n, kv_warps, kv_stages = plan.dkdv
        q_blocks, kv_blocks = _cdiv(c.NQ, dq_m), _cdiv(c.NK, kv_n)
        if plan.gluon:
            # checked here once (gluon_capable): the launches of run()'s tensors (c.read's, laid out as read; out
            # with o_strides)
            self.gluon = gluon_bwd.Launch(read[0], read[1], o_strides, causal, c.scale,
                                          gluon_bwd.TILES[(c.D, causal)])
            self.grid = self.gluon.kernel.grid
        elif self.launches == 1:
            # one set of warps and stages for both jobs: the larger warp count, the smaller stage count
            kv_programs = kv_blocks * c.B * c.HKV
            self.grid = (kv_programs + q_blocks * c.BH,)
            self.one = Prepared(_elsa_bwd_one_launch, self.grid, (
                *c.qkv_strides, *o_strides, *do_strides, *dq_strides, *kv_strides, *kv_strides, *c.bias_strides,
                c.H, c.group, c.NQ, c.NK, kv_blocks, q_blocks, kv_programs, c.qk_scale, c.scale), dict(
                c.flags, DQ_BLOCK_M=dq_m, DQ_BLOCK_N=dq_n, KV_BLOCK_M=kv_m, KV_BLOCK_N=kv_n, BIAS_GRAD=bias_grad,
                GROUPED=c.group > 1, num_warps=max(dq_warps, kv_warps), num_stages=min(dq_stages, kv_stages)))
        else:
            self.dq_grid = (q_blocks, c.BH)
            self.dq = Prepared(_elsa_bwd_dq, self.dq_grid, (
                *c.qkv_strides, *o_strides, *do_strides, *dq_strides, *c.bias_strides,
                c.H, c.group, c.NQ, c.NK, c.qk_scale, c.scale), dict(
                c.flags, BLOCK_M=dq_m, BLOCK_N=dq_n, BIAS_GRAD=bias_grad, num_warps=dq_warps, num_stages=dq_stages))
            self.dkdv_grid = (kv_blocks, c.B * c.HKV)
            self.dkdv = Prepared(_elsa_bwd_dkdv, self.dkdv_grid, (
                *c.qkv_strides, *do_strides, *kv_strides, *kv_strides, *c.bias_strides,
                c.HKV, c.group, c.NQ, c.NK, c.qk_scale, c.scale), dict(
                c.flags, BLOCK_M=kv_m, BLOCK_N=kv_n, GROUPED=c.group > 1, num_warps=kv_warps, num_stages=kv_stages))
        # nothing to launch for empty problems: the gradients of zero rows / keys are empty or zero
        self.empty = c.BH == 0 or c.NQ == 0 or c.NK == 0

    def run(self, do, q, k, v, out, lse, bias, traced=False, dqkv=None):
        """The gradients. traced: torch.compile's trace (traced_backward), as _FwdPlan.run's traced. dqkv: a
        packed plan's [B, N, 3, H, D] gradient buffer, which dq, dk, dv are then slices of."""
        c = self.c
        q, k, v = c.read(q, k, v)
        if self.copy_do:
            do = do.contiguous()
        if self.copy_out:
            out = out.contiguous()
        dev = c.device
        if self.empty:
            grads = (_zeros(self.q_shape, dtype=c.dtype, device=dev), _zeros(self.kv_shape, dtype=c.dtype, device=dev),
                     _zeros(self.kv_shape, dtype=c.dtype, device=dev))
            return grads + (_zeros(self.ds_shape, dtype=self.ds_dtype, device=dev),) if self.bias_grad else grads
        if self.plan.gluon:
            tracing = trace.active()
            ev = trace.start_event(dev) if tracing else None
            grads = self.gluon(do, q, k, v, out, lse)
            if tracing:
                trace.record(start=ev, phase="bwd", kernel="_gluon_bwd_kernel", grid=self.grid,
                             programs=self.grid[0] * self.grid[1])
            return grads
        if self.packed:
            dq, dk, dv = dqkv.unbind(2)             # [B, N, H, D] views: the launches take their pointers
        else:
            dq = q.new_empty(self.q_shape)
            dk = q.new_empty(self.kv_shape)
            dv = q.new_empty(self.kv_shape)
        ds = q                                      # dS unused without bias_grad
        if self.bias_grad:
            # causal: the tiles past the diagonal are never visited, so they must start at zero
            ds = (q.new_zeros if c.causal else q.new_empty)(self.ds_shape, dtype=self.ds_dtype)
        b = q if bias is None else bias
        grads = (dq, dk, dv, ds) if self.bias_grad else (dq, dk, dv)
        if self.launches == 1:
            launch = self.one.traced if traced else self.one
            if not traced and trace.active():
                ev = trace.start_event(dev)
                k1 = launch(q, k, v, out, do, lse, dq, dk, dv, b, ds)
                trace.record(start=ev, phase="bwd", kernel=_elsa_bwd_one_launch.__name__, grid=self.grid,
                             programs=self.grid[0], compiled=k1)
            else:
                launch(q, k, v, out, do, lse, dq, dk, dv, b, ds)
            return grads
        delta = q.new_empty(self.lse_shape, dtype=_f32)
        if traced:
            self.dq.traced(q, k, v, out, do, lse, delta, dq, b, ds)
            self.dkdv.traced(q, k, v, do, lse, delta, dk, dv, b)
            return grads
        tracing = trace.active()
        ev = trace.start_event(dev) if tracing else None
        kq = self.dq(q, k, v, out, do, lse, delta, dq, b, ds)
        if tracing:
            trace.record(start=ev, phase="bwd_dq", kernel=_elsa_bwd_dq.__name__, grid=self.dq_grid,
                         programs=self.dq_grid[0] * c.BH, compiled=kq)
            ev = trace.start_event(dev)
        kkv = self.dkdv(q, k, v, do, lse, delta, dk, dv, b)
        if tracing:
            trace.record(start=ev, phase="bwd_dkdv", kernel=_elsa_bwd_dkdv.__name__, grid=self.dkdv_grid,
                         programs=self.dkdv_grid[0] * self.dkdv_grid[1], compiled=kkv)
        return grads


def backward_plan(do, q, k, v, out, bias, causal: bool, scale: float, precision: str, config: str,
                  bias_grad: bool, packed: bool = False):
    """The cached plan of this backward signature (made on first use)."""
    key = (_signature(q, k, v, bias, causal, scale, precision, config, bias_grad), do.shape, do.stride(),
           do.dtype, do.data_ptr() & 15 == 0, out.shape, out.stride(), out.dtype, out.data_ptr() & 15 == 0, packed)
    plan = _bwd_plans.get(key)
    if plan is None:
        plan = _bwd_plans.put(key, _BwdPlan(do, q, k, v, out, bias, causal, scale, precision, config, bias_grad,
                                            packed))
    return plan


def backward(do, q, k, v, out, lse, bias, causal: bool, scale: float, precision: str, config: str,
             bias_grad: bool, dqkv=None):
    """(dq, dk, dv), and with bias_grad dscores, the gradient of the natural-log scores [B, Hq, Nq, Nk] (what
    attn_bias's gradient sums; fp32, or attn_bias's dtype where it has that full shape: dscores_dtype); dk, dv
    summed over each key/value head's query group. dqkv: a [B, N, 3, H, D] buffer (q, k, v sliced from one such
    tensor, as many heads and keys as queries) that dq, dk, dv are written to, as its slices."""
    return backward_plan(do, q, k, v, out, bias, causal, scale, precision, config, bias_grad, dqkv is not None)(
        do, q, k, v, out, lse, bias, False, dqkv)


def traced_backward(do, q, k, v, out, lse, bias, causal: bool, scale: float, precision: str, config: str,
                    bias_grad: bool):
    """backward() as torch.compile traces it (traced_forward's counterpart): the Triton backward's launches take no
    descriptors, so every call ``traceable`` can be handed to inductor but one that runs the Gluon backward (host-made
    TMA descriptors): None for it, and the op stays opaque."""
    if not traceable(do, q, k, v, out, lse, bias):
        return None
    plan = _BwdPlan(do, q, k, v, out, bias, causal, scale, precision, config, bias_grad, traced=True)
    if plan.plan.gluon:
        return None
    return plan.run(do, q, k, v, out, lse, bias, traced=True)
