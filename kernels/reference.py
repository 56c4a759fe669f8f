"""Float64 reference attention, shared by the tests and by attnbench's accuracy checks."""
from __future__ import annotations

import math

import torch


def reference_attention(q, k, v, causal: bool = False, scale: float | None = None, attn_bias=None, mask=None):
    """Exact softmax attention computed in float64 on the inputs' device.

    q: [B, Hq, Nq, D]; k, v: [B, Hkv, Nk, D] with Hq % Hkv == 0 (grouped-query: query head h reads key/value
    head h // (Hq // Hkv)); any float dtype. Causal with Nq != Nk is aligned bottom-right (query i sees keys
    j <= i + Nk - Nq). ``attn_bias`` is added to the scores (broadcastable to
    [B, H, Nq, Nk]); ``mask`` is a boolean tensor broadcastable to the scores, True = attend.
    Rows with no visible key return 0 (the convention all our kernels follow).
    Returns float64 [B, H, Nq, D]; differentiable, so gradients can be compared too.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q64, k64, v64 = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k64, v64 = k64.repeat_interleave(group, dim=1), v64.repeat_interleave(group, dim=1)
    scores = torch.matmul(q64, k64.transpose(-1, -2)) * scale
    if attn_bias is not None:
        scores = scores + attn_bias.double()
    visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)
    if causal:
        nq, nk = scores.shape[-2:]
        visible = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(diagonal=nk - nq)
    if mask is not None:
        visible = visible & mask
    scores = scores.masked_fill(~visible, float("-inf"))
    row_has_key = torch.isfinite(scores).any(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~row_has_key, 0.0), dim=-1) * row_has_key
    return torch.matmul(probs, v64)
