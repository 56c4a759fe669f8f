"""ELSA's public function: validation, then the torch.library op (kernels/elsa/ops.py).

The kernels (kernel.py) and their host code (host.py) are described in NOTES.md.
"""
from __future__ import annotations

import torch

from .._common import (HEAD_DIMS, PRECISIONS, SignatureCache, check_inputs, check_precision, default_scale,
                       signature)
from .._ops import eager
from . import host, ops
from .config import canonical_config

__all__ = ["elsa_attention", "elsa_attention_qkvpacked", "HEAD_DIMS", "PRECISIONS"]

# Signatures already validated -> the resolved scale (validation is a fixed cost per call that a short
# sequence feels: it runs once per signature, the cache key holds everything it checks).
_validated = SignatureCache()
_packed_validated = SignatureCache()       # elsa_attention_qkvpacked's: (resolved scale, whether it takes its path)
_is_compiling = torch.compiler.is_compiling


def _check_bias(attn_bias, q, k) -> None:
    if not isinstance(attn_bias, torch.Tensor):
        raise ValueError(f"elsa: attn_bias must be a tensor, got {type(attn_bias).__name__}")
    if not attn_bias.is_floating_point():
        raise ValueError(f"elsa: attn_bias must be a float tensor (additive bias), got {attn_bias.dtype}")
    if attn_bias.device != q.device:
        raise ValueError(f"elsa: attn_bias is on {attn_bias.device}, q on {q.device}")
    scores = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    try:
        fits = attn_bias.dim() <= 4 and torch.broadcast_shapes(attn_bias.shape, scores) == scores
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"elsa: attn_bias must broadcast to [B, Hq, Nq, Nk] = {list(scores)}, "
                         f"got {tuple(attn_bias.shape)}")


def _with_bias(key, attn_bias):
    """A validation cache key extended by what the bias's checks read (its shape, dtype and device); None (do not
    cache) for a bias that is not a plain tensor."""
    if key is None or attn_bias is None:
        return key
    return (key, attn_bias.shape, attn_bias.dtype, attn_bias.device) if type(attn_bias) is torch.Tensor else None


def _validate(q, k, v, causal, scale, precision, attn_bias) -> float:
    shape = check_inputs("elsa", q, k, v, causal=causal, scale=scale)
    check_precision("elsa", precision)
    if attn_bias is not None:
        _check_bias(attn_bias, q, k)
    return default_scale(scale, shape.head_dim)


def elsa_attention(q, k, v, causal=False, scale=None, precision="tf32x3", attn_bias=None, config=None):
    """Exact softmax attention as a two-pass parallel scan over key partitions (ELSA).

    q: [B, Hq, Nq, D]; k, v: [B, Hkv, Nk, D] with Hq a multiple of Hkv (grouped-query / multi-query
      attention: K and V are read in place, dK and dV summed over each group inside the kernel); one dtype
      (float32, float16, bfloat16) on one device; D any multiple of 8 from 16 to 256.
    causal: query i attends to keys j <= i + Nk - Nq (bottom-right aligned; j <= i when Nq == Nk).
    scale: defaults to 1/sqrt(D).
    precision: float32 dot products, "tf32x3" (default, ~fp32 accuracy on tensor cores), "ieee"
      (strict FP32 FMA, slower) or "tf32" (only when asked: ~1e-3 error, not exact). 16-bit inputs
      always use fp16/bf16 tensor-core products with fp32 accumulation.
    attn_bias: optional additive bias on the natural-log scores, broadcastable to [B, Hq, Nq, Nk]
      (read through stride-0 broadcast, never copied); its gradient is computed if it requires grad
      (that materialises a [B, Hq, Nq, Nk] buffer, fp32 unless the bias has that shape: fine for window
      attention, not for long N).
    config: tile overrides {part: {param: value}} for tests and tuning, parts "fwd", "dq", "dkdv"
      (BLOCK_M, BLOCK_N, num_warps, num_stages) and "plan" (partition_width, q_chunk, bwd_launches,
      gluon_bwd_min_work: from how much work B * Hq * Nq * Nk the sm_90 Gluon backward runs); a "dq" or "dkdv"
      override keeps the Triton backward; see config.py.
    Returns [B, Hq, Nq, D]. Where q has its heads inside its rows in memory (sliced from one [B, N, 3, H, D]
      projection), the output is laid out so too, as SDPA's flash and efficient backends lay out theirs:
      out.transpose(1, 2).reshape(B, Nq, Hq * D) is then free (host.out_heads_inner).
    Rows with no visible key give 0. Differentiable; runs under torch.compile(fullgraph=True) and CUDA graphs.
    """
    if config is not None or _is_compiling():
        scale = _validate(q, k, v, causal, scale, precision, attn_bias)
        return ops.elsa(q, k, v, attn_bias, causal, scale, precision, canonical_config(config, q.dtype, q.shape[-1]))
    key = _with_bias(signature(q, k, v, causal, scale, precision), attn_bias)
    resolved = _validated.get(key)
    if resolved is None:
        resolved = _validate(q, k, v, causal, scale, precision, attn_bias)
        if key is not None:
            _validated.put(key, resolved)
    return ops.elsa_call(q, k, v, attn_bias, causal, resolved, precision, "")


def elsa_attention_qkvpacked(qkv, causal=False, scale=None, precision="tf32x3", attn_bias=None):
    """elsa_attention of q, k, v packed in one tensor as one projection makes them (FlashAttention's qkvpacked
    form): qkv [B, N, 3, H, D] -> out [B, N, H, D], with q = qkv[:, :, 0].transpose(1, 2), k and v likewise;
    causal, scale, precision and attn_bias as elsa_attention's.

    In eager mode with plain tensors and more than one head, the slicing of q, k, v and the output's transpose
    happen inside the kernel's own autograd step, and the gradient of qkv is written as one tensor: the view steps
    and the stack of dq, dk, dv that slicing outside would add to every call's autograd graph are not there (host
    time per call: a timm ViT or Swin layer, kernels/timm_patch.py). Elsewhere (torch.compile, dispatch modes,
    tensor subclasses, one head or one token) it is elsa_attention on the slices.
    """
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        got = tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__
        raise ValueError(f"elsa: qkv must be a [B, N, 3, H, D] tensor, got {got}")
    if not _is_compiling() and eager(qkv, attn_bias):
        # the options keyed as elsa_attention keys them (signature: their types too); qkv's strides decide `takes`
        key = signature(qkv, qkv, qkv, causal, scale, precision)
        key = _with_bias(None if key is None else (key, qkv.stride()), attn_bias)
        resolved = _packed_validated.get(key)
        if resolved is None:
            q, k, v = ops.qkv_views(qkv.detach())
            takes = qkv.numel() > 0 and host.out_heads_inner(q)
            resolved = (_validate(q, k, v, causal, scale, precision, attn_bias), takes)
            if key is not None:
                _packed_validated.put(key, resolved)
        if resolved[1]:
            return ops.elsa_packed_call(qkv, attn_bias, causal, resolved[0], precision)
    q, k, v = ops.qkv_views(qkv)
    return elsa_attention(q, k, v, causal, scale, precision, attn_bias).transpose(1, 2)
