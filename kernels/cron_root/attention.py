"""Cron Root attention: the torch.library ops (forward, backward, autograd, fake), their launch plans and the
public function ``cron_root_attention``.

Ops (namespace attnbench):
  cron_root_fwd(q, k, v, scale, relay_threshold, precision, config) -> (out, lse)
  cron_root_bwd(grad_out, q, k, v, out, lse, scale, relay_threshold, precision, config) -> (dq, dk, dv)
``lse`` is the base-2 row log-sum-exp [B*H, N] (float32) the backward needs; ``config`` is the canonical
string of a tile override (configs.encode; "" for none). The ops are opaque to torch.compile (their fake
implementations give the shapes), so the launches, the fast launch path and the interpreter work inside.

Launches per call: forward = 1 Triton kernel (+ 2 small torch means for the relay keys/values when
N > relay_threshold); backward = 3 Triton kernels (dQ, global-slot dK/dV, local dK/dV; 2 when no query sees
an anchor) and 4 allocations (dq, dk, dv, one fp32 scratch).

Host time (NOTES.md, "Host cost"): everything derived from a call's signature (kernels._launch.layout of its
tensors and the options: grids, tile constexprs, slot counts, scratch layout, strides) is computed once and
cached in a plan (``_Forward``, ``_Backward``) whose launches are kernels._launch.Prepared: a call is one key
lookup, its allocations and its launches. The autograd formula is kernels/_ops.py's pattern (one dispatcher
trip per forward, the bodies called directly where the dispatcher would only land in them).
"""
from __future__ import annotations

import torch

from .._common import (LOG2E, PRECISIONS, LaunchPlan, Prepared, SignatureCache, block_d, check_inputs,
                       check_precision, default_scale, dot_precision, in_place, layout, signature, sm_count)
from .._ops import KernelFunction, below_autograd, define_op, not_differentiable, plain, register_autograd
from . import configs
from . import kernel as tk
from .reference import RELAY_THRESHOLD, visible_anchors, visible_relay_blocks, window

NAME = "cron_root"
# Global-slot backward: aim for this many programs per SM (the query range of a slot chunk is cut into segments);
# a glob config may set "programs_per_sm" (tuned) or "segments" (forced, for tests).
GLOBAL_PROGRAMS_PER_SM = 4

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split(cfg: dict, grid: tuple, head_dim: int, prec: str, **constexprs) -> tuple:
    """(grid, constexprs + launch options) of one launch: the BLOCK_* sizes and num_warps/num_stages of a
    config (other keys, e.g. glob's ``segments``, are read by the planner), the head-dim constexprs (one tile
    block_d(D) wide unless ``constexprs`` says otherwise) and any others given."""
    meta = {k: v for k, v in cfg.items() if k.startswith("BLOCK_") or k in ("num_warps", "num_stages")}
    meta.update(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), PREC=prec)
    meta.update(constexprs)
    return grid, meta


class _Problem:
    """What one problem's launches need that depends on its shapes and options only: W, the slot counts, the
    scratch layout and each launch's grid and constexprs."""
    __slots__ = ("h", "g", "n", "w", "n_relay", "n_anchor", "n_slots", "seg_len", "dg_off", "dg_size",
                 "scratch", "lse_shape", "fwd", "dq", "glob", "loc")

    def __init__(self, q_shape, heads_kv, dtype, device, relay_threshold, precision, config):
        b, h, n, d = q_shape
        self.h, self.g, self.n = h, h // heads_kv, n
        self.w = window(n)
        self.n_relay = visible_relay_blocks(n, relay_threshold)
        self.n_anchor = visible_anchors(n)
        self.n_slots = self.n_anchor + self.n_relay
        # backward scratch (float32): Delta [B*H, N], then dG_K and dG_V [B*Hkv, n_slots, D] each
        self.dg_off = b * h * n
        self.dg_size = b * heads_kv * self.n_slots * d
        self.scratch = self.dg_off + 2 * self.dg_size
        self.lse_shape = (b * h, n)
        cfgs = configs.resolve(device, dtype, d, precision, config)
        prec = dot_precision(dtype, precision)
        # the forward's head-dim columns: one padded tile, or two (16-bit D = 80 as 64 + 16) whose tiles are the
        # first column tile's bucket's (configs.forward_tiles)
        tile_d, tile_d2 = configs.forward_tiles(d, dtype)
        fwd_cfgs = cfgs if tile_d2 == 0 else configs.resolve(device, dtype, tile_d, precision, config)
        # small grids leave SMs idle with the big query tiles: use the small ones then
        fwd = fwd_cfgs["fwd"]
        if device.type == "cuda" and _cdiv(n, fwd["BLOCK_M"]) * b * h < 2 * sm_count(device, 1):
            fwd = fwd_cfgs["fwd_small"]
        self.fwd = _split(fwd, (_cdiv(n, fwd["BLOCK_M"]), b * h), d, prec, BLOCK_D=tile_d, BLOCK_D2=tile_d2)
        self.dq = _split(cfgs["dq"], (_cdiv(n, cfgs["dq"]["BLOCK_M"]), b * h), d, prec)
        # the dK/dV kernels run per key/value head and loop over its query heads when there are several
        grouped = self.g > 1
        self.loc = _split(cfgs["loc"], (_cdiv(n, cfgs["loc"]["BLOCK_N"]), b * heads_kv), d, prec, GROUPED=grouped)
        glob = cfgs["glob"]
        bg, bq = glob["BLOCK_G"], glob["BLOCK_Q"]
        n_chunks = _cdiv(self.n_anchor, bg) + _cdiv(self.n_relay, bg)
        # cut each slot chunk's query range into segments so that the grid fills the GPU; every segment adds its
        # partial sums with fp32 atomics, so fewer segments = less contention
        per_sm = glob.get("programs_per_sm", GLOBAL_PROGRAMS_PER_SM)
        n_seg = max(1, per_sm * sm_count(device, 1) // max(1, n_chunks * b * heads_kv))
        n_seg = min(n_seg, max(1, n // (4 * bq)))          # keep >= 4 query chunks per program
        n_seg = glob.get("segments", n_seg)
        self.seg_len = _cdiv(_cdiv(n, n_seg), bq) * bq
        self.glob = _split(glob, (n_chunks, _cdiv(n, self.seg_len), b * heads_kv), d, prec, GROUPED=grouped)


def _like(t: torch.Tensor) -> torch.Tensor:
    """An output shaped like t with a unit feature stride (the kernels' one layout requirement); the fake
    implementations use it too, so real and fake outputs have the same strides."""
    out = torch.empty_like(t)
    return out if out.stride(-1) == 1 else t.new_empty(t.shape)


def _like_layout(t: torch.Tensor) -> tuple:
    """(empty_like keeps a unit feature stride, the strides _like(t) gives): a function of t's shape and strides,
    found once per plan on a meta tensor of that layout (no memory)."""
    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    st = torch.empty_like(meta).stride()
    return (True, st) if st[-1] == 1 else (False, meta.new_empty(t.shape).stride())


def _relay(t: torch.Tensor, n_relay: int, w: int) -> torch.Tensor:
    # block means of the first n_relay full blocks, [B, Hkv, n_relay, D] contiguous; only full blocks can ever
    # be visible (block r needs (r+2)W <= N), so no padding. In the input dtype, as the original computes them.
    return t[:, :, : n_relay * w].unflatten(2, (n_relay, w)).mean(3).contiguous()


_empty_like = torch.empty_like
_f32 = torch.float32


class _Forward(LaunchPlan):
    """The forward of one signature (kernels._launch: layout of q, k, v and the options): its allocations and
    its one Prepared launch (+ the relay means for N > relay_threshold)."""

    def __init__(self, q, k, v, scale, relay_threshold, precision, config):
        shape = check_inputs(NAME, q, k, v, causal=True, scale=scale, self_attention=True, causal_only=True)
        check_problem(NAME, shape, relay_threshold, precision)       # the op called directly: checked too
        p = self.p = _Problem(q.shape, k.shape[1], q.dtype, q.device, relay_threshold, precision, config)
        self.place(q.device)
        (cq, sq), (ck, sk), (cv, sv) = in_place(NAME, q), in_place(NAME, k), in_place(NAME, v)
        self.copy = (cq, ck, cv) if cq or ck or cv else None
        self.o_like, so = _like_layout(q)
        grid, meta = p.fwd
        self.launch = Prepared(tk._fwd, grid, (sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2],
                                               so[0], so[1], so[2], p.h, p.g, p.n, p.w, p.n_relay, scale * LOG2E),
                               meta)

    def run(self, q, k, v):
        p = self.p
        o = _empty_like(q) if self.o_like else q.new_empty(q.shape)
        lse = q.new_empty(p.lse_shape, dtype=_f32)
        if self.copy is not None:
            cq, ck, cv = self.copy
            q, k, v = q.contiguous() if cq else q, k.contiguous() if ck else k, v.contiguous() if cv else v
        # relay off: k and v stand in for the relay buffers, which the relay loops (0 trips) never read
        rk, rv = (_relay(k, p.n_relay, p.w), _relay(v, p.n_relay, p.w)) if p.n_relay else (k, v)
        self.launch(q, k, v, rk, rv, o, lse)
        return o, lse


class _Backward(LaunchPlan):
    """The backward of one signature (layout of dO, q, k, v, O, lse and the options): four allocations (dq, dk,
    dv, one fp32 scratch) and three Prepared launches (dQ, which also clears the global-slot accumulators;
    global-slot dK/dV, skipped when no query sees a slot; local dK/dV)."""

    def __init__(self, do, q, k, v, o, lse, scale, relay_threshold, precision, config):
        shape = check_inputs(NAME, q, k, v, causal=True, scale=scale, self_attention=True, causal_only=True)
        check_problem(NAME, shape, relay_threshold, precision)
        p = self.p = _Problem(q.shape, k.shape[1], q.dtype, q.device, relay_threshold, precision, config)
        for label, t, want in (("grad_out", do, q.shape), ("out", o, q.shape), ("lse", lse, p.lse_shape)):
            dtype = _f32 if label == "lse" else q.dtype
            if tuple(t.shape) != tuple(want) or t.dtype != dtype or t.device != q.device:
                raise ValueError(f"{NAME}: {label} is {tuple(t.shape)} {t.dtype} on {t.device}, expected "
                                 f"{tuple(want)} {dtype} on {q.device}")
        if lse.stride() != (p.n, 1):
            raise ValueError(f"{NAME}: lse must be contiguous, got strides {lse.stride()}")
        self.place(q.device)
        ins = [in_place(NAME, t) for t in (q, k, v, o, do)]
        self.copy = tuple(c for c, _ in ins) if any(c for c, _ in ins) else None
        sq, sk, sv, so, sdo = (st for _, st in ins)
        (self.q_like, sdq), (self.k_like, sdk), (self.v_like, sdv) = _like_layout(q), _like_layout(k), _like_layout(v)
        qk_scale = scale * LOG2E
        grid, meta = p.dq
        self.dq = Prepared(tk._bwd_dq, grid, (
            sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], so[0], so[1], so[2],
            sdo[0], sdo[1], sdo[2], sdq[0], sdq[1], sdq[2],
            p.h, p.g, p.n, p.w, p.n_relay, p.dg_off, p.dg_size, qk_scale, scale), meta)
        self.glob = None
        if p.n_slots:
            grid, meta = p.glob
            self.glob = Prepared(tk._bwd_global, grid, (
                sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sdo[0], sdo[1], sdo[2],
                p.h, p.g, p.n, p.w, p.n_anchor, p.n_relay, p.seg_len, p.dg_off, p.dg_size, qk_scale, scale), meta)
        grid, meta = p.loc
        self.loc = Prepared(tk._bwd_local, grid, (
            sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sdo[0], sdo[1], sdo[2],
            sdk[0], sdk[1], sdk[2], sdv[0], sdv[1], sdv[2],
            p.h, p.g, p.n, p.w, p.n_anchor, p.n_relay, p.dg_off, p.dg_size, qk_scale, scale, 1.0 / p.w), meta)

    def run(self, do, q, k, v, o, lse):
        p = self.p
        dq = _empty_like(q) if self.q_like else q.new_empty(q.shape)
        dk = _empty_like(k) if self.k_like else k.new_empty(k.shape)
        dv = _empty_like(v) if self.v_like else v.new_empty(v.shape)
        scratch = q.new_empty(p.scratch, dtype=_f32)
        if self.copy is not None:
            q, k, v, o, do = (t.contiguous() if c else t for t, c in zip((q, k, v, o, do), self.copy))
        # the relay means again (two small reductions, only for N > relay_threshold) rather than a forward output
        rk, rv = (_relay(k, p.n_relay, p.w), _relay(v, p.n_relay, p.w)) if p.n_relay else (k, v)
        self.dq(q, k, v, rk, rv, o, do, dq, lse, scratch)
        if self.glob is not None:
            self.glob(q, k, v, rk, rv, do, lse, scratch)
        self.loc(q, k, v, do, lse, scratch, dk, dv)
        return dq, dk, dv


_fwd_plans = SignatureCache()
_bwd_plans = SignatureCache()


def forward_plan(q, k, v, scale, relay_threshold, precision, config) -> _Forward:
    """The cached plan of this forward signature (made on first use)."""
    key = (layout(q, k, v), scale, relay_threshold, precision, config)
    return _fwd_plans.get(key) or _fwd_plans.put(key, _Forward(q, k, v, scale, relay_threshold, precision, config))


def backward_plan(do, q, k, v, o, lse, scale, relay_threshold, precision, config) -> _Backward:
    """The cached plan of this backward signature (made on first use)."""
    key = (layout(do, q, k, v, o, lse), scale, relay_threshold, precision, config)
    return _bwd_plans.get(key) or _bwd_plans.put(
        key, _Backward(do, q, k, v, o, lse, scale, relay_threshold, precision, config))


def _forward(q, k, v, scale, relay_threshold, precision, config):
    """The forward op's body (CPU through the interpreter, CUDA): (out, lse)."""
    return forward_plan(q, k, v, scale, relay_threshold, precision, config)(q, k, v)


def _backward(do, q, k, v, o, lse, scale, relay_threshold, precision, config):
    """The backward op's body: (dq, dk, dv), dk and dv summed over the query heads that share a key/value head."""
    return backward_plan(do, q, k, v, o, lse, scale, relay_threshold, precision, config)(do, q, k, v, o, lse)


# --- the torch.library ops -----------------------------------------------------------------------------------

_lib = torch.library.Library("attnbench", "FRAGMENT")
fwd_op = define_op(_lib, "cron_root_fwd(Tensor q, Tensor k, Tensor v, float scale, int relay_threshold, "
                         "str precision, str config) -> (Tensor, Tensor)", _forward)
bwd_op = define_op(_lib, "cron_root_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                         "float scale, int relay_threshold, str precision, str config) -> (Tensor, Tensor, Tensor)",
                   _backward)


@torch.library.register_fake("attnbench::cron_root_fwd", lib=_lib)
def _forward_fake(q, k, v, scale, relay_threshold, precision, config):
    b, h, n, _ = q.shape
    return _like(q), q.new_empty((b * h, n), dtype=torch.float32)


@torch.library.register_fake("attnbench::cron_root_bwd", lib=_lib)
def _backward_fake(grad_out, q, k, v, out, lse, scale, relay_threshold, precision, config):
    return _like(q), _like(k), _like(v)


class _CronRootFunction(KernelFunction):
    """cron_root_fwd's autograd formula (kernels/_ops.py): save the inputs, out and lse; the backward is
    cron_root_bwd."""

    @staticmethod
    def forward(ctx, is_plain, q, k, v, scale, relay_threshold, precision, config):
        if is_plain:
            out, lse = _forward(q, k, v, scale, relay_threshold, precision, config)
        else:
            with below_autograd():
                out, lse = fwd_op(q, k, v, scale, relay_threshold, precision, config)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (scale, relay_threshold, precision, config)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)      # no zero gradient for lse (kernels/_ops.py)
        return out, lse

    @staticmethod
    def gradients(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if plain(grad_out, q, k, v, out, lse):
            dq, dk, dv = _backward(grad_out, q, k, v, out, lse, *ctx.options)
        else:
            dq, dk, dv = bwd_op(grad_out, q, k, v, out, lse, *ctx.options)
        return None, dq, dk, dv, None, None, None, None


# what the public functions call: the Autograd kernel, or the op where a mode, tracer or compiler must see it
fwd_call = register_autograd(_lib, "cron_root_fwd", _CronRootFunction, _forward)
not_differentiable(_lib, "cron_root_bwd")


# --- the public function ---------------------------------------------------------------------------------------

def check_options(name: str, relay_threshold=RELAY_THRESHOLD, precision="tf32x3") -> None:
    """Cron Root's own options, checked without a tensor (the harness checks a matrix's cells with it at load
    time)."""
    if type(relay_threshold) is not int or relay_threshold < 0:
        raise ValueError(f"{name}: relay_threshold must be an int >= 0 (0: always relay), got {relay_threshold!r}")
    if precision not in PRECISIONS:
        check_precision(name, precision)


def check_problem(name: str, shape, relay_threshold, precision) -> None:
    """The checks kernels._common.check_inputs leaves to the kernel: a non-empty problem and Cron Root's
    own options."""
    if not (shape.batch and shape.heads_q and shape.len_q):
        raise ValueError(f"{name}: empty input: batch {shape.batch}, heads {shape.heads_q}, length {shape.len_q}")
    check_options(name, relay_threshold, precision)


def validate(q, k, v, causal, scale, relay_threshold, precision) -> float:
    """The checks of a call (the contract's and Cron Root's own); returns the resolved scale."""
    shape = check_inputs(NAME, q, k, v, causal=causal, scale=scale, self_attention=True, causal_only=True)
    check_problem(NAME, shape, relay_threshold, precision)
    return default_scale(scale, shape.head_dim)


# the checks of a call signature that passed them -> its resolved scale (kernels._common.signature); not under
# torch.compile, which traces the checks instead (a dict write would be a side effect dynamo replays)
_checked = SignatureCache()
_is_compiling = torch.compiler.is_compiling


def cron_root_attention(q, k, v, causal: bool = True, scale: float | None = None,
                        relay_threshold: int = RELAY_THRESHOLD, precision: str = "tf32x3", config=None):
    """Cron Root sparse causal self-attention, O(N sqrt N): local window + strided anchors + relay block means.

    q: [B, H, N, D]; k, v: [B, Hkv, N, D] with H % Hkv == 0 (grouped-query: read in place); float16,
    bfloat16 or float32; D any multiple of 8 from 16 to 256; any N >= 1. Causal only (``causal=False`` and
    a key length other than the query length are one-line errors).
    The relay phase exists iff N > relay_threshold (default 8192, the original's gate); it changes the result.
    ``precision`` applies to float32 inputs: "tf32x3" (default, ~fp32 accurate), "ieee" (exact, slow) or
    "tf32". ``config={part: {param: value}}`` overrides tile sizes (configs.py). Differentiable in q, k, v.
    """
    key = None if config is not None or _is_compiling() else signature(q, k, v, causal, scale, relay_threshold,
                                                                        precision)
    resolved = _checked.get(key)
    if resolved is None:
        resolved = validate(q, k, v, causal, scale, relay_threshold, precision)
        if key is not None:
            _checked.put(key, resolved)
    return fwd_call(q, k, v, resolved, relay_threshold, precision, configs.encode(config))[0]
