"""Public entry points: ``pasa_attention`` and the comparator ``fa16_attention`` (forward only)."""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import triton

from kernels._tuning import read_configs
from kernels.pasa.beta import default_beta, ideal_invariance, shift_entries
LOG2E = 1.4426950408889634   # host-side copy (the kernels use a tl.constexpr)
from kernels.pasa.kernel import _fa16_fwd_kernel, _pasa_fwd_kernel, _shift_k_kernel

HEAD_DIMS = (64, 128)
STATE_DTYPES = ("fp16", "fp32")   # the softmax state: the paper's full fp16, or its hybrid fp32 mode
# Main-loop variants: name -> the FUSED constexpr of _pasa_fwd_kernel (README "Main loop"). "ref": Algorithm 1
# as written (γ applied to a fresh P·V tile); "fused": γ folded into the exponent and P·V
# accumulated in place. Both keep the paper's allocation (fp16 scores, state and A).
VARIANTS = {"ref": False, "fused": True}
# "ref" is the default: on the H100 (results/dev/pasa/h100/variants.csv, 2026-11-23) it beat "fused" at every
# tile but one (fused is 1-11 % more accurate in emulation; it stays available as variant="fused").
BUILTIN_VARIANT = "ref"

# Hopper tiles: (BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim, from the H100 sweep
# (5 tiles x both loops, N 8K/16K, causal and not, vs SDPA flash; the sweep is `scripts/tune.py --kernel pasa`):
# (64, 64, 4, 3) was best for both head dims with the ref loop, geomean lat_ratio 0.96 (D=64, worst 1.00) and
# 0.84 (D=128, worst 0.93), where the earlier (128, 64, 4|8, 3) tiles gave 1.05-1.09 and 0.98-1.06.
# BLOCK_N is also PASA's shifting-window length n, so β is solved for it (unchanged at 64).
# fa16 keeps PASA's tiling, as its definition asks ("the same tiling without the shift").
BUILTIN_CONFIGS = {
    "pasa": {64: (64, 64, 4, 3), 128: (64, 64, 4, 3)},
    "fa16": {64: (64, 64, 4, 3), 128: (64, 64, 4, 3)},
}
# `scripts/tune.py --kernel pasa` writes the tiles and loop it chooses to tuning.json beside this file; its entries
# ("pasa"/"fa16": {"64": [bm, bn, warps, stages]}, "variant": {"default": "ref"}) replace the built-in ones above.
TUNING_FILE = Path(__file__).with_name("tuning.json")


def tuned_defaults(path=TUNING_FILE) -> tuple[dict, str]:
    """(DEFAULT_CONFIGS, DEFAULT_VARIANT): the built-in tiles and loop with a tuning file's entries in their place."""
    stored = read_configs(path)
    configs = {kernel: dict(tiles) for kernel, tiles in BUILTIN_CONFIGS.items()}
    for kernel in configs:
        for d, cfg in stored.get(kernel, {}).items():
            configs[kernel][int(d)] = tuple(cfg)
    variant = stored.get("variant", {}).get("default", BUILTIN_VARIANT)
    if variant not in VARIANTS:
        raise ValueError(f"{path}: variant.default = {variant!r}: allowed {', '.join(VARIANTS)}")
    return configs, variant


DEFAULT_CONFIGS, DEFAULT_VARIANT = tuned_defaults()

BACKWARD_ERROR = ("{name}: backward is not supported — PASA is a forward-only (inference) algorithm; "
                  "the paper defines no backward pass")


def _check_inputs(name: str, q, k, v, state_dtype: str | None = None):
    """One-line ValueErrors for everything the kernels cannot do."""
    for t, label in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: {label} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: {label} must be 4-D [B, H, N, D], got shape {tuple(t.shape)}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"{name}: q, k, v must have the same shape [B, H, N, D], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{name}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{name}: dtype {q.dtype} unsupported (a float16 kernel: pass float16, or bfloat16 "
                         "which is converted to float16)")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{name}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{name}: device {q.device.type} unsupported (cuda, or cpu through the Triton interpreter)")
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{name}: CPU tensors need the Triton interpreter (set TRITON_INTERPRET=1 before "
                         "triton is imported)")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"{name}: head_dim {q.shape[-1]} unsupported (supports {', '.join(map(str, HEAD_DIMS))})")
    if q.shape[2] == 0:
        raise ValueError(f"{name}: sequence length must be ≥ 1")
    if state_dtype is not None and state_dtype not in STATE_DTYPES:
        raise ValueError(f"{name}: state_dtype must be 'fp16' or 'fp32', got {state_dtype!r}")


def _to_fp16(name: str, q, k, v):
    """bf16 → fp16, as the paper prescribes; refuse values that fp16 cannot hold instead of making inf."""
    if q.dtype == torch.float16:
        return q.contiguous(), k.contiguous(), v.contiguous()
    out = []
    for t, label in ((q, "q"), (k, "k"), (v, "v")):
        t16 = t.to(torch.float16).contiguous()
        if not bool(torch.isfinite(t16).all()):
            raise ValueError(f"{name}: bfloat16 {label} has values beyond the float16 range (|x| > 65504); "
                             "PASA converts bfloat16 inputs to float16")
        out.append(t16)
    return tuple(out)


def _config(kernel: str, head_dim: int, block_m, block_n, num_warps, num_stages):
    bm, bn, warps, stages = DEFAULT_CONFIGS[kernel][head_dim]
    bm = bm if block_m is None else int(block_m)
    bn = bn if block_n is None else int(block_n)
    for label, value in (("block_m", bm), ("block_n", bn)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{kernel}: {label} must be a power of two ≥ 16, got {value}")
    return bm, bn, (warps if num_warps is None else num_warps), (stages if num_stages is None else num_stages)


def _state_tl(state_dtype: str):
    import triton.language as tl

    return {"fp16": tl.float16, "fp32": tl.float32}[state_dtype]


def _pasa_forward(q, k, v, causal, scale, beta, block_m, block_n, state_dtype, num_warps, num_stages, variant):
    bsz, heads, n, d = q.shape
    bm, bn, warps, stages = _config("pasa", d, block_m, block_n, num_warps, num_stages)
    if beta is None:
        beta = default_beta(bn, scale)
    beta = float(beta)
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"pasa: beta must be in [0, 1) (β = 1 makes the shifting matrix singular), got {beta}")
    diag, off = shift_entries(beta, bn, scale, "fp16")   # λM's two distinct entries, rounded to fp16 (①)
    c = ideal_invariance(beta)                           # the recovery uses the ideal c = β/(1−β), as the paper
    n_blocks = triton.cdiv(n, bn)
    k_shift = torch.empty((bsz, heads, n_blocks * bn, d), device=q.device, dtype=torch.float16)
    _shift_k_kernel[(n_blocks, bsz * heads)](k, k_shift, n, diag, off, BLOCK_N=bn, HEAD_DIM=d,
                                              num_warps=4, num_stages=1)
    out = torch.empty_like(q)
    _pasa_fwd_kernel[(triton.cdiv(n, bm), bsz * heads)](
        q, k_shift, v, out, n, c, BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=d, CAUSAL=bool(causal),
        STATE=_state_tl(state_dtype), FUSED=VARIANTS[variant], num_warps=warps, num_stages=stages)
    return out


def _fa16_forward(q, k, v, causal, scale, block_m, block_n, num_warps, num_stages):
    bsz, heads, n, d = q.shape
    bm, bn, warps, stages = _config("fa16", d, block_m, block_n, num_warps, num_stages)
    out = torch.empty_like(q)
    _fa16_fwd_kernel[(triton.cdiv(n, bm), bsz * heads)](
        q, k, v, out, n, scale * LOG2E, BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=d, CAUSAL=bool(causal),
        num_warps=warps, num_stages=stages)
    return out


class _ForwardOnly(torch.autograd.Function):
    """Autograd node whose backward says clearly that there is none (instead of a silent zero grad)."""

    @staticmethod
    def forward(ctx, name, run, q, k, v):
        ctx.name = name
        return run(q, k, v)

    @staticmethod
    def backward(ctx, grad_out):
        raise NotImplementedError(BACKWARD_ERROR.format(name=ctx.name))


def _run(name, run, q, k, v):
    in_dtype = q.dtype
    q16, k16, v16 = _to_fp16(name, q, k, v)
    out = _ForwardOnly.apply(name, run, q16, k16, v16) if torch.is_grad_enabled() else run(q16, k16, v16)
    return out.to(in_dtype)


def pasa_attention(q, k, v, causal=False, scale=None, beta=None, *, state_dtype="fp16",
                   block_m=None, block_n=None, num_warps=None, num_stages=None, variant=None):
    """PASA forward (Algorithm 1 of the spec): softmax attention computed with fp16 scores and fp16 state
    without overflow, by shifting each KV block by β × its mean inside the first GEMM and recovering
    the global pseudo-average online.

    q, k, v: [B, H, N, D] float16 or bfloat16 (converted to float16 first, as the paper prescribes),
    D ∈ {64, 128}. ``beta=None`` solves the optimal-accuracy condition for this kernel's block length
    and scale (``kernels.pasa.beta.default_beta``). ``state_dtype="fp32"`` is the paper's hybrid mode
    (fp16 scores, fp32 statistics). ``variant`` picks the main loop (``VARIANTS``; None: ``DEFAULT_VARIANT``).
    Returns the input dtype. Forward only: backward raises.
    """
    _check_inputs("pasa", q, k, v, state_dtype)
    variant = DEFAULT_VARIANT if variant is None else variant
    if variant not in VARIANTS:
        raise ValueError(f"pasa: variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)

    def run(q16, k16, v16):
        return _pasa_forward(q16, k16, v16, causal, scale, beta, block_m, block_n, state_dtype,
                             num_warps, num_stages, variant)

    return _run("pasa", run, q, k, v)


def fa16_attention(q, k, v, causal=False, scale=None, *, block_m=None, block_n=None, num_warps=None,
                   num_stages=None):
    """The comparator FA16-FP32: PASA's tiling without the shift, the unscaled QKᵀ rounded to fp16
    (overflows once a score passes 65504: the row becomes NaN), softmax state and output in fp32.
    Same inputs and dtypes as ``pasa_attention``; forward only."""
    _check_inputs("fa16", q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)

    def run(q16, k16, v16):
        return _fa16_forward(q16, k16, v16, causal, scale, block_m, block_n, num_warps, num_stages)

    return _run("fa16", run, q, k, v)
