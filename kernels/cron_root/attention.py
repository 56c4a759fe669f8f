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

Host time: everything derived from the shapes and options (grids, tile constexprs, slot counts, scratch
layout) is computed once per problem and cached (``_plan``); a call reads the strides once per tensor,
allocates and launches. The autograd formula is registered on the op's Autograd key as a lean
autograd.Function (``_fwd_autograd``): torch.library.register_autograd's generic wrapper costs about twice
as much host time per call (schema default filling, metadata objects; NOTES.md, "Host cost").
"""
from __future__ import annotations

import torch

from .._common import (LOG2E, PRECISIONS, check_inputs, check_precision, default_scale, dot_precision,
                       block_d, launch, on_device, unit_last)
from . import configs
from . import kernel as tk
from .reference import RELAY_THRESHOLD, visible_anchors, visible_relay_blocks, window

NAME = "cron_root"
# Global-slot backward: aim for this many programs per SM (the query range of a slot chunk is cut into segments);
# a glob config may set "programs_per_sm" (tuned) or "segments" (forced, for tests).
GLOBAL_PROGRAMS_PER_SM = 4

_sm_count: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_count:
        _sm_count[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_count[idx]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split(cfg: dict, grid: tuple, head_dim: int, prec: str, **constexprs) -> tuple:
    """(grid, constexprs + launch options) of one launch: the BLOCK_* sizes and num_warps/num_stages of a
    config (other keys, e.g. glob's ``segments``, are read by the planner), the head-dim constexprs and any
    others given."""
    meta = {k: v for k, v in cfg.items() if k.startswith("BLOCK_") or k in ("num_warps", "num_stages")}
    meta.update(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), PREC=prec, **constexprs)
    return grid, meta


class _Plan:
    """Everything one problem's launches need that does not depend on the tensors' addresses or strides."""
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
        # small grids leave SMs idle with the big query tiles: use the small ones then
        fwd = cfgs["fwd"]
        if device.type == "cuda" and _cdiv(n, fwd["BLOCK_M"]) * b * h < 2 * _num_sms(device):
            fwd = cfgs["fwd_small"]
        self.fwd = _split(fwd, (_cdiv(n, fwd["BLOCK_M"]), b * h), d, prec)
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
        n_seg = max(1, per_sm * _num_sms(device) // max(1, n_chunks * b * heads_kv))
        n_seg = min(n_seg, max(1, n // (4 * bq)))          # keep >= 4 query chunks per program
        n_seg = glob.get("segments", n_seg)
        self.seg_len = _cdiv(_cdiv(n, n_seg), bq) * bq
        self.glob = _split(glob, (n_chunks, _cdiv(n, self.seg_len), b * heads_kv), d, prec, GROUPED=grouped)


_plans: dict = {}
_MAX_PLANS = 4096


def _plan(q, k, relay_threshold, precision, config) -> _Plan:
    key = (q.shape, k.shape[1], q.dtype, q.device, relay_threshold, precision, config)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= _MAX_PLANS:      # many distinct shapes: start over rather than grow without bound
            _plans.clear()
        plan = _plans[key] = _Plan(q.shape, k.shape[1], q.dtype, q.device, relay_threshold, precision, config)
    return plan


def _like(t: torch.Tensor) -> torch.Tensor:
    """An output shaped like t with a unit feature stride (the kernels' one layout requirement); the fake
    implementations use it too, so real and fake outputs have the same strides."""
    out = torch.empty_like(t)
    return out if out.stride(-1) == 1 else t.new_empty(t.shape)


def _relay(t: torch.Tensor, n_relay: int, w: int) -> torch.Tensor:
    # block means of the first n_relay full blocks, [B, Hkv, n_relay, D] contiguous; only full blocks can ever
    # be visible (block r needs (r+2)W <= N), so no padding. In the input dtype, as the original computes them.
    return t[:, :, : n_relay * w].unflatten(2, (n_relay, w)).mean(3).contiguous()


def _forward(q, k, v, scale, relay_threshold, precision, config):
    """The forward op on CPU (interpreter) and CUDA tensors: (out, lse)."""
    p = _plan(q, k, relay_threshold, precision, config)
    o = _like(q)
    lse = q.new_empty(p.lse_shape, dtype=torch.float32)
    q, k, v = unit_last(NAME, q), unit_last(NAME, k), unit_last(NAME, v)
    # relay off: k and v stand in for the relay buffers, which the relay loops (0 trips) never read
    rk, rv = (_relay(k, p.n_relay, p.w), _relay(v, p.n_relay, p.w)) if p.n_relay else (k, v)
    sq, sk, sv, so = q.stride(), k.stride(), v.stride(), o.stride()
    grid, meta = p.fwd
    with on_device(q):
        launch(tk._fwd, grid, (q, k, v, rk, rv, o, lse, sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1],
                               sv[2], so[0], so[1], so[2], p.h, p.g, p.n, p.w, p.n_relay, scale * LOG2E), meta)
    return o, lse


def _backward(do, q, k, v, o, lse, scale, relay_threshold, precision, config):
    """The backward op: (dq, dk, dv), dk and dv summed over the query heads that share a key/value head."""
    p = _plan(q, k, relay_threshold, precision, config)
    dq, dk, dv = _like(q), _like(k), _like(v)
    scratch = q.new_empty(p.scratch, dtype=torch.float32)
    q, k, v = unit_last(NAME, q), unit_last(NAME, k), unit_last(NAME, v)
    o, do = unit_last(NAME, o), unit_last(NAME, do)
    # the relay means again (two small reductions, only for N > relay_threshold) rather than a forward output
    rk, rv = (_relay(k, p.n_relay, p.w), _relay(v, p.n_relay, p.w)) if p.n_relay else (k, v)
    sq, sk, sv, so, sdo = q.stride(), k.stride(), v.stride(), o.stride(), do.stride()
    sdq, sdk, sdv = dq.stride(), dk.stride(), dv.stride()
    qk_scale = scale * LOG2E
    with on_device(q):
        # dQ + Delta; also clears the global-slot accumulators in scratch
        grid, meta = p.dq
        launch(tk._bwd_dq, grid, (
            q, k, v, rk, rv, o, do, dq, lse, scratch,
            sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], so[0], so[1], so[2],
            sdo[0], sdo[1], sdo[2], sdq[0], sdq[1], sdq[2],
            p.h, p.g, p.n, p.w, p.n_relay, p.dg_off, p.dg_size, qk_scale, scale), meta)
        if p.n_slots:
            grid, meta = p.glob
            launch(tk._bwd_global, grid, (
                q, k, v, rk, rv, do, lse, scratch,
                sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sdo[0], sdo[1], sdo[2],
                p.h, p.g, p.n, p.w, p.n_anchor, p.n_relay, p.seg_len, p.dg_off, p.dg_size, qk_scale, scale), meta)
        grid, meta = p.loc
        launch(tk._bwd_local, grid, (
            q, k, v, do, lse, scratch, dk, dv,
            sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sdo[0], sdo[1], sdo[2],
            sdk[0], sdk[1], sdk[2], sdv[0], sdv[1], sdv[2],
            p.h, p.g, p.n, p.w, p.n_anchor, p.n_relay, p.dg_off, p.dg_size, qk_scale, scale, 1.0 / p.w), meta)
    return dq, dk, dv


# --- the torch.library ops -----------------------------------------------------------------------------------

_lib = torch.library.Library("attnbench", "FRAGMENT")
_lib.define("cron_root_fwd(Tensor q, Tensor k, Tensor v, float scale, int relay_threshold, str precision, "
            "str config) -> (Tensor, Tensor)")
_lib.define("cron_root_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale, "
            "int relay_threshold, str precision, str config) -> (Tensor, Tensor, Tensor)")
for _key in ("CPU", "CUDA"):
    _lib.impl("cron_root_fwd", _forward, _key)
    _lib.impl("cron_root_bwd", _backward, _key)
fwd_op = torch.ops.attnbench.cron_root_fwd.default
bwd_op = torch.ops.attnbench.cron_root_bwd.default


@torch.library.register_fake("attnbench::cron_root_fwd", lib=_lib)
def _forward_fake(q, k, v, scale, relay_threshold, precision, config):
    b, h, n, _ = q.shape
    return _like(q), q.new_empty((b * h, n), dtype=torch.float32)


@torch.library.register_fake("attnbench::cron_root_bwd", lib=_lib)
def _backward_fake(grad_out, q, k, v, out, lse, scale, relay_threshold, precision, config):
    return _like(q), _like(k), _like(v)


_BELOW_AUTOGRAD = torch._C._after_autograd_keyset
_Tensor = torch.Tensor
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active


def _plain(*tensors) -> bool:
    """True when redispatching below autograd would land straight in the CPU/CUDA implementation: plain
    tensors (no subclass with a Python dispatch key), no torch dispatch mode (fake tensors, tracing), no
    functorch transform. The Autograd kernels then call the implementation themselves, which saves the
    second pass through the dispatcher (about 3 us of host time per op call); anything else redispatches."""
    for t in tensors:
        if type(t) is not _Tensor:
            return False
    return not _dispatch_modes() and not _functorch_active()


class _CronRootFunction(torch.autograd.Function):
    """The autograd formula of cron_root_fwd: save the inputs, out and lse; the backward is cron_root_bwd."""

    @staticmethod
    def forward(ctx, keyset, q, k, v, scale, relay_threshold, precision, config):
        if keyset is None:
            out, lse = _forward(q, k, v, scale, relay_threshold, precision, config)
        else:
            with torch._C._AutoDispatchBelowAutograd():
                out, lse = fwd_op.redispatch(keyset, q, k, v, scale, relay_threshold, precision, config)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (scale, relay_threshold, precision, config)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = bwd_op(grad_out, q, k, v, out, lse, *ctx.options)
        return None, dq, dk, dv, None, None, None, None


def _fwd_autograd(keyset, q, k, v, scale, relay_threshold, precision, config):
    """cron_root_fwd's Autograd kernel (what torch.library.register_autograd installs, with less host work)."""
    below = None if _plain(q, k, v) else keyset & _BELOW_AUTOGRAD
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _CronRootFunction.apply(below, q, k, v, scale, relay_threshold, precision, config)
    if below is None:
        return _forward(q, k, v, scale, relay_threshold, precision, config)
    with torch._C._AutoDispatchBelowAutograd():
        return fwd_op.redispatch(below, q, k, v, scale, relay_threshold, precision, config)


def _bwd_autograd(keyset, grad_out, q, k, v, out, lse, scale, relay_threshold, precision, config):
    """cron_root_bwd has no derivative: a second backward through it is refused in one line."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (grad_out, q, k, v, out)):
        raise RuntimeError(f"{NAME}: double backward is not supported (the backward has no autograd formula)")
    if _plain(grad_out, q, k, v, out, lse):
        return _backward(grad_out, q, k, v, out, lse, scale, relay_threshold, precision, config)
    with torch._C._AutoDispatchBelowAutograd():
        return bwd_op.redispatch(keyset & _BELOW_AUTOGRAD, grad_out, q, k, v, out, lse, scale, relay_threshold,
                                 precision, config)


_lib.impl("cron_root_fwd", _fwd_autograd, "Autograd", with_keyset=True)
_lib.impl("cron_root_bwd", _bwd_autograd, "Autograd", with_keyset=True)


# --- the public function ---------------------------------------------------------------------------------------

def check_options(name: str, shape, relay_threshold, precision) -> None:
    """The checks kernels._common.check_inputs leaves to the kernel: a non-empty problem and Cron Root's
    own options."""
    if not (shape.batch and shape.heads_q and shape.len_q):
        raise ValueError(f"{name}: empty input: batch {shape.batch}, heads {shape.heads_q}, length {shape.len_q}")
    if type(relay_threshold) is not int:
        raise ValueError(f"{name}: relay_threshold must be an int, got {relay_threshold!r}")
    if precision not in PRECISIONS:
        check_precision(name, precision)


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
    shape = check_inputs(NAME, q, k, v, causal=causal, scale=scale, self_attention=True, causal_only=True)
    check_options(NAME, shape, relay_threshold, precision)
    return fwd_op(q, k, v, default_scale(scale, shape.head_dim), relay_threshold, precision,
                  configs.encode(config))[0]
