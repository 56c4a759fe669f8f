"""flex_cron_root: the same Cron Root function through FlexAttention, the honest peer of our kernel.

The relay slots are not tokens, so the pattern is not a pure token mask: the visible relay block means are
appended to K and V (length N + n_relay) and a mask_mod over the extended key index reproduces the exact
pattern (local band, anchors, relay). Grouped K/V go to flex_attention as they are (enable_gqa); a head dim
that is not a power of two is zero-padded to one (q.k and the kept output columns are unchanged).

Called eagerly, flex_attention is torch.compile'd once and block masks are cached per (N, n_relay, device), so
timings after the first call exclude compilation. Called inside an outer torch.compile (GPU), it is plain
traced code: flex_attention and the block mask are compiled into the caller's graph.
"""
from __future__ import annotations

import torch

from .._common import block_d, check_inputs, default_scale
from .attention import check_problem
from .reference import RELAY_THRESHOLD, visible_relay_blocks, window

NAME = "flex_cron_root"
_compiled = None
_block_masks: dict = {}


def pattern_mask_mod(n: int, w: int):
    """mask_mod(b, h, q_idx, kv_idx) over keys [0, N) = tokens and [N, N + n_relay) = relay block means."""

    def mask_mod(b, h, q_idx, kv_idx):
        token = kv_idx < n
        local = (kv_idx <= q_idx) & (kv_idx + w > q_idx)
        anchor = (kv_idx % w == 0) & (kv_idx + w <= q_idx)
        relay = (kv_idx - n + 2) * w <= q_idx + 1          # relay r = kv_idx - N visible iff (r+2)W <= i+1
        return (token & (local | anchor)) | (~token & relay)

    return mask_mod


def _block_mask(n: int, n_relay: int, device: torch.device, traced: bool):
    from torch.nn.attention.flex_attention import create_block_mask

    mask_mod = pattern_mask_mod(n, window(n))
    if traced:       # inside the caller's compiled graph: built there, no cache (a side effect dynamo would replay)
        return create_block_mask(mask_mod, None, None, n, n + n_relay, device=device)
    key = (n, n_relay, str(device))
    if key not in _block_masks:
        # _compile=True builds the block mask without materialising the [N, N + R] boolean mask (64 GB at 256K)
        _block_masks[key] = create_block_mask(mask_mod, None, None, n, n + n_relay, device=device,
                                              _compile=device.type == "cuda")
    return _block_masks[key]


def _compiled_flex():
    global _compiled
    if _compiled is None:
        import torch._dynamo.config as dynamo_config
        from torch.nn.attention.flex_attention import flex_attention

        # every N is a new static shape; the default limit (8) would silently fall back to eager flex,
        # which materialises the scores
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 256))
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def flex_cron_root(q, k, v, causal: bool = True, scale: float | None = None,
                   relay_threshold: int = RELAY_THRESHOLD, compile: bool = True):
    """Cron Root attention via FlexAttention (compiled unless compile=False, which runs eager flex).

    Inputs as cron_root_attention's: q [B, H, N, D], k, v [B, Hkv, N, D] (grouped-query), D any multiple
    of 8 from 16 to 256, causal only."""
    shape = check_inputs(NAME, q, k, v, causal=causal, scale=scale, self_attention=True, causal_only=True,
                         cpu_bfloat16=True)     # torch's FlexAttention computes, not the Triton interpreter
    check_problem(NAME, shape, relay_threshold, "tf32x3")
    from torch.nn.attention.flex_attention import flex_attention

    n, d = shape.len_q, shape.head_dim
    w = window(n)
    n_relay = visible_relay_blocks(n, relay_threshold)
    if n_relay > 0:
        rk = k[:, :, : n_relay * w].unflatten(2, (n_relay, w)).mean(3)
        rv = v[:, :, : n_relay * w].unflatten(2, (n_relay, w)).mean(3)
        k, v = torch.cat([k, rk], dim=2), torch.cat([v, rv], dim=2)
    width = block_d(d)
    if width != d:      # flex wants a power-of-two head dim: zero columns change neither q.k nor columns < D
        q, k, v = (torch.nn.functional.pad(t, (0, width - d)) for t in (q, k, v))
    traced = torch.compiler.is_compiling()
    block_mask = _block_mask(n, n_relay, q.device, traced)
    fn = flex_attention if traced or not compile else _compiled_flex()
    out = fn(q, k, v, block_mask=block_mask, scale=default_scale(scale, d), enable_gqa=shape.group > 1)
    return out[..., :d] if width != d else out
