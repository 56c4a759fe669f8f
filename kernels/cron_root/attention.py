"""Cron Root attention: the public function, its input checks, tile configs and the autograd Function.

Launches per call: forward = 1 Triton kernel (+ 2 small torch means for the relay keys/values when
N > relay_threshold); backward = 3 Triton kernels (dQ, global-slot dK/dV, local dK/dV) + one zero fill.
"""
from __future__ import annotations

import math

import torch

from .._launch import launch
from . import kernel as tk
from .reference import RELAY_THRESHOLD, visible_anchors, visible_relay_blocks, window
from .tuning import device_name, tuned_configs

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PRECISIONS = ("tf32x3", "ieee")
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128
_LOG2E = 1.4426950408889634

# Default tile configs for 16-bit inputs per head-dim bucket (D <= 64, D <= 128), from the FlashAttention
# tutorial's Hopper tiles, checked for spills and shared memory on sm_90; tuning.json overrides them per GPU
# name where a tuning sweep found better ones (the H100 entry holds only the measured hybrid crossovers).
# fwd: query tile BLOCK_M, local-band key chunk BLOCK_N, gathered anchor/relay chunk BLOCK_S.
# dq: the same roles; glob: slot chunk BLOCK_G x query chunk BLOCK_Q; loc: key tile BLOCK_N x query chunk BLOCK_Q.
GPU_CONFIGS = {
    64: dict(
        fwd=dict(BLOCK_M=128, BLOCK_N=64, BLOCK_S=64, num_warps=4, num_stages=3),
        fwd_small=dict(BLOCK_M=64, BLOCK_N=64, BLOCK_S=64, num_warps=4, num_stages=3),
        dq=dict(BLOCK_M=64, BLOCK_N=64, BLOCK_S=64, num_warps=4, num_stages=2),
        glob=dict(BLOCK_G=64, BLOCK_Q=64, num_warps=4, num_stages=2),
        loc=dict(BLOCK_N=64, BLOCK_Q=64, num_warps=4, num_stages=2),
    ),
    128: dict(
        fwd=dict(BLOCK_M=128, BLOCK_N=64, BLOCK_S=64, num_warps=8, num_stages=2),
        fwd_small=dict(BLOCK_M=64, BLOCK_N=64, BLOCK_S=64, num_warps=4, num_stages=2),
        dq=dict(BLOCK_M=64, BLOCK_N=64, BLOCK_S=32, num_warps=4, num_stages=2),
        glob=dict(BLOCK_G=64, BLOCK_Q=64, num_warps=8, num_stages=2),
        loc=dict(BLOCK_N=64, BLOCK_Q=64, num_warps=8, num_stages=2),
    ),
}
# float32 operands take twice the registers and shared memory: smaller tiles, or the defaults above spill and
# (D=128) exceed the 227 KB of shared memory. "ieee" dots run on FMA units and need the smallest tiles.
FP32_CONFIGS = {
    ("tf32x3", 64): dict(
        fwd=dict(BLOCK_M=64, BLOCK_N=32, BLOCK_S=32, num_warps=4, num_stages=2),
        fwd_small=dict(BLOCK_M=64, BLOCK_N=32, BLOCK_S=32, num_warps=4, num_stages=2),
        dq=dict(BLOCK_M=64, BLOCK_N=32, BLOCK_S=32, num_warps=4, num_stages=2),
        glob=dict(BLOCK_G=32, BLOCK_Q=32, num_warps=4, num_stages=2),
        loc=dict(BLOCK_N=32, BLOCK_Q=32, num_warps=4, num_stages=2),
    ),
    ("tf32x3", 128): dict(
        fwd=dict(BLOCK_M=64, BLOCK_N=32, BLOCK_S=32, num_warps=8, num_stages=2),
        fwd_small=dict(BLOCK_M=64, BLOCK_N=32, BLOCK_S=32, num_warps=8, num_stages=2),
        dq=dict(BLOCK_M=32, BLOCK_N=32, BLOCK_S=32, num_warps=4, num_stages=2),
        glob=dict(BLOCK_G=32, BLOCK_Q=32, num_warps=4, num_stages=2),
        loc=dict(BLOCK_N=32, BLOCK_Q=32, num_warps=4, num_stages=2),
    ),
}
for _d in (64, 128):
    FP32_CONFIGS[("ieee", _d)] = dict(
        fwd=dict(BLOCK_M=32, BLOCK_N=32, BLOCK_S=32, num_warps=4, num_stages=1),
        fwd_small=dict(BLOCK_M=32, BLOCK_N=32, BLOCK_S=32, num_warps=4, num_stages=1),
        dq=dict(BLOCK_M=32, BLOCK_N=32, BLOCK_S=32, num_warps=4, num_stages=1),
        glob=dict(BLOCK_G=32, BLOCK_Q=32, num_warps=4, num_stages=1),
        loc=dict(BLOCK_N=32, BLOCK_Q=32, num_warps=4, num_stages=1),
    )
# The interpreter: 16-row tiles make the loops (band, anchors, relay, tails) run several chunks at test sizes.
CPU_CONFIG = dict(
    fwd=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_S=16),
    fwd_small=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_S=16),
    dq=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_S=16),
    glob=dict(BLOCK_G=16, BLOCK_Q=16),
    loc=dict(BLOCK_N=16, BLOCK_Q=16),
)
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


def _interpreted() -> bool:
    return type(tk._fwd).__name__ == "InterpretedFunction"


def validate(q, k, v, causal, scale, relay_threshold, precision, name="cron_root", triton=True) -> None:
    """One-line ValueError naming the first problem with the inputs or options."""
    if not causal:
        raise ValueError(f"{name}: causal=False is not supported (Cron Root is a causal-only pattern)")
    for t, tn in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: {tn} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: {tn} must be [B, H, N, D], got {t.dim()} dims {tuple(t.shape)}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"{name}: q, k, v must have the same shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{name}: q, k, v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"{name}: dtype {q.dtype} unsupported (float16, bfloat16, float32)")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{name}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, h, n, d = q.shape
    if n < 1 or b < 1 or h < 1:
        raise ValueError(f"{name}: empty input {tuple(q.shape)}")
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{name}: head dim {d} unsupported ({MIN_HEAD_DIM}..{MAX_HEAD_DIM})")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"{name}: scale must be a finite float or None, got {scale!r}")
    if not isinstance(relay_threshold, int) or isinstance(relay_threshold, bool):
        raise ValueError(f"{name}: relay_threshold must be an int, got {relay_threshold!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"{name}: precision must be one of {PRECISIONS}, got {precision!r}")
    if triton and q.device.type == "cpu" and not _interpreted():
        raise ValueError(f"{name}: CPU tensors need the Triton interpreter (set TRITON_INTERPRET=1 before importing)")
    if triton and q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: device {q.device} unsupported (cuda, or cpu via the Triton interpreter)")


def _rowmajor(t: torch.Tensor) -> torch.Tensor:
    # kernels take any b/h/n strides but need unit stride over D (and offsets inside one (b, h) in int32)
    st = t.stride()
    if st[-1] != 1 or (t.shape[-2] - 1) * st[-2] + t.shape[-1] >= 2**31:
        t = t.contiguous()
    return t


def _strides(t: torch.Tensor):
    # one stride() call, not three: these run for every tensor of every launch (host time at short N)
    return t.stride()[:3]


_base_configs: dict = {}


def default_gpu_configs(d: int, dtype: torch.dtype, precision: str) -> dict:
    """The built-in GPU tile configs for a head dim, dtype and fp32 dot precision (before tuning.json)."""
    bucket = 64 if d <= 64 else 128
    return FP32_CONFIGS[(precision, bucket)] if dtype == torch.float32 else GPU_CONFIGS[bucket]


def _configs(d: int, dtype: torch.dtype, precision: str, device: torch.device, override: dict | None) -> dict:
    """Tile configs for one call: defaults (per head-dim bucket; float32 per precision), then for 16-bit
    inputs the GPU's tuning.json entry, then the caller's override."""
    bucket = 64 if d <= 64 else 128
    key = (device, bucket, dtype == torch.float32, precision)
    if key not in _base_configs:
        if device.type == "cpu":
            cfg = {kname: dict(v) for kname, v in CPU_CONFIG.items()}
        else:
            cfg = {kname: dict(v) for kname, v in default_gpu_configs(d, dtype, precision).items()}
            if dtype != torch.float32:
                for kname, v in tuned_configs(device_name(device), bucket).items():
                    cfg[kname].update(v)
        _base_configs[key] = cfg
    cfg = _base_configs[key]
    if override:
        cfg = {kname: dict(v) for kname, v in cfg.items()}
        for kname, v in override.items():
            cfg[kname].update(v)
    return cfg


def _launch_opts(cfg: dict) -> tuple[dict, dict]:
    """Split a config into constexpr tile sizes and launch options (num_warps, num_stages); other keys
    (e.g. the global kernel's forced ``segments``) are read by the caller."""
    meta = {k: v for k, v in cfg.items() if k.startswith("BLOCK_")}
    launch = {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")}
    return meta, launch


def _dot_precision(dtype: torch.dtype, precision: str) -> str:
    # input_precision only acts on float32 operands; 16-bit dots always use the tensor cores, and "tf32" is
    # Triton's own default there (it changes nothing for fp16/bf16).
    return precision if dtype == torch.float32 else "tf32"


def _relay(t: torch.Tensor, n_relay: int, w: int) -> torch.Tensor:
    # only full blocks can ever be visible (block r needs (r+2)W <= N), so no padding is needed here;
    # computed in the input dtype on the input's device, as the original does
    return t[:, :, : n_relay * w].unflatten(2, (n_relay, w)).mean(3).contiguous()


def cron_root_forward(q, k, v, scale, relay_threshold, precision, config=None):
    """Run the forward kernel; returns (o, lse2, rk, rv, meta) where lse2 is the base-2 row log-sum-exp."""
    b, h, n, d = q.shape
    w = window(n)
    n_relay = visible_relay_blocks(n, relay_threshold)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    cfgs = _configs(d, q.dtype, precision, q.device, config)
    if n_relay > 0:
        rk, rv = _relay(k, n_relay, w), _relay(v, n_relay, w)
    else:
        rk, rv = k, v  # never read: the relay loop runs 0 times
    o = torch.empty_like(q)
    if o.stride(-1) != 1:
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b * h, n), dtype=torch.float32, device=q.device)
    # small grids leave SMs idle with 128-row tiles: use 64-row tiles then
    use_small = q.device.type == "cuda" and triton_cdiv(n, cfgs["fwd"]["BLOCK_M"]) * b * h < 2 * _num_sms(q.device)
    meta, opts = _launch_opts(cfgs["fwd_small" if use_small else "fwd"])
    grid = (triton_cdiv(n, meta["BLOCK_M"]), b * h)
    launch(tk._fwd, grid, (q, k, v, rk, rv, o, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
                           h, n, w, n_relay, scale * _LOG2E),
           dict(HEAD_DIM=d, BLOCK_D=_block_d(d), PREC=_dot_precision(q.dtype, precision), **meta, **opts))
    return o, lse, rk, rv, dict(w=w, n_relay=n_relay, scale=scale)


def cron_root_backward(q, k, v, o, lse, rk, rv, do, meta, precision, config=None):
    """dQ, dK, dV: three kernels (dQ + Delta; global-slot dK/dV into an fp32 buffer; local dK/dV + scatter)."""
    b, h, n, d = q.shape
    cfgs = _configs(d, q.dtype, precision, q.device, config)
    do = _rowmajor(do)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty((b * h, n), dtype=torch.float32, device=q.device)
    n_slots = visible_anchors(n) + meta["n_relay"]
    # fp32 accumulators for anchor and relay-slot gradients (atomics in fp32, cast once at the end)
    dg = torch.zeros((2, b * h, max(n_slots, 1), d), dtype=torch.float32, device=q.device)
    launch_dq(q, k, v, o, lse, rk, rv, do, dq, delta, meta, precision, cfgs["dq"])
    if n_slots > 0:
        launch_global(q, k, v, rk, rv, do, lse, delta, dg, meta, precision, cfgs["glob"])
    launch_local(q, k, v, do, lse, delta, dg, dk, dv, meta, precision, cfgs["loc"])
    return dq, dk, dv


def launch_dq(q, k, v, o, lse, rk, rv, do, dq, delta, meta, precision, cfg):
    b, h, n, d = q.shape
    scale = meta["scale"]
    m, lo = _launch_opts(cfg)
    launch(tk._bwd_dq, (triton_cdiv(n, m["BLOCK_M"]), b * h), (
        q, k, v, rk, rv, o, do, dq, lse, delta,
        *_strides(q), *_strides(k), *_strides(v), *_strides(o), *_strides(do), *_strides(dq),
        h, n, meta["w"], meta["n_relay"], scale * _LOG2E, scale),
        dict(HEAD_DIM=d, BLOCK_D=_block_d(d), PREC=_dot_precision(q.dtype, precision), **m, **lo))


def launch_global(q, k, v, rk, rv, do, lse, delta, dg, meta, precision, cfg):
    b, h, n, d = q.shape
    scale, n_relay, n_anchor = meta["scale"], meta["n_relay"], visible_anchors(n)
    m, lo = _launch_opts(cfg)
    bg, bq = m["BLOCK_G"], m["BLOCK_Q"]
    n_chunks = triton_cdiv(n_anchor, bg) + triton_cdiv(n_relay, bg)
    # cut each slot chunk's query range into segments so that the grid fills the GPU; every segment adds its
    # partial sums with fp32 atomics, so fewer segments = less contention
    per_sm = cfg.get("programs_per_sm", GLOBAL_PROGRAMS_PER_SM)
    n_seg = max(1, per_sm * _num_sms(q.device) // (n_chunks * b * h))
    n_seg = min(n_seg, max(1, n // (4 * bq)))          # keep >= 4 query chunks per program
    n_seg = cfg.get("segments", n_seg)
    seg_len = triton_cdiv(triton_cdiv(n, n_seg), bq) * bq
    n_seg = triton_cdiv(n, seg_len)
    launch(tk._bwd_global, (n_chunks, n_seg, b * h), (
        q, k, v, rk, rv, do, lse, delta, dg[0], dg[1],
        *_strides(q), *_strides(k), *_strides(v), *_strides(do),
        h, n, meta["w"], n_anchor, n_relay, seg_len, scale * _LOG2E, scale),
        dict(HEAD_DIM=d, BLOCK_D=_block_d(d), PREC=_dot_precision(q.dtype, precision), **m, **lo))


def launch_local(q, k, v, do, lse, delta, dg, dk, dv, meta, precision, cfg):
    b, h, n, d = q.shape
    scale, w = meta["scale"], meta["w"]
    m, lo = _launch_opts(cfg)
    launch(tk._bwd_local, (triton_cdiv(n, m["BLOCK_N"]), b * h), (
        q, k, v, do, lse, delta, dg[0], dg[1], dk, dv,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), *_strides(dv),
        h, n, w, visible_anchors(n), meta["n_relay"], scale * _LOG2E, scale, 1.0 / w),
        dict(HEAD_DIM=d, BLOCK_D=_block_d(d), PREC=_dot_precision(q.dtype, precision), **m, **lo))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_d(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


class _CronRoot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, relay_threshold, precision, config):
        o, lse, rk, rv, meta = cron_root_forward(q, k, v, scale, relay_threshold, precision, config)
        ctx.save_for_backward(q, k, v, o, lse, rk, rv)
        ctx.meta, ctx.precision, ctx.config = meta, precision, config
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, rk, rv = ctx.saved_tensors
        dq, dk, dv = cron_root_backward(q, k, v, o, lse, rk, rv, do, ctx.meta, ctx.precision, ctx.config)
        return dq, dk, dv, None, None, None, None


@torch.compiler.disable  # a graph break: dynamo must not trace into the launches (as in the original)
def cron_root_attention(q, k, v, causal: bool = True, scale: float | None = None,
                        relay_threshold: int = RELAY_THRESHOLD, precision: str = "tf32x3", _config=None):
    """Cron Root sparse causal attention, O(N sqrt N): local window + strided anchors + relay block means.

    q, k, v: [B, H, N, D] (float16, bfloat16 or float32; 16 <= D <= 128; any N >= 1), same device.
    The relay phase exists iff N > relay_threshold (default 8192, the original's gate); it changes the result.
    ``precision`` applies to float32 inputs only: "tf32x3" (default, ~fp32 accurate) or "ieee" (exact, slow).
    ``_config`` overrides tile sizes (used by the tuning script). Differentiable in q, k and v.
    """
    validate(q, k, v, causal, scale, relay_threshold, precision)
    q, k, v = _rowmajor(q), _rowmajor(k), _rowmajor(v)
    return _CronRoot.apply(q, k, v, scale, relay_threshold, precision, _config)
