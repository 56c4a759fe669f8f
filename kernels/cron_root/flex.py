"""flex_cron_root: the same Cron Root function through FlexAttention, the honest peer of our kernel.

The relay slots are not tokens, so the pattern is not a pure token mask: the visible relay block means are
appended to K and V (length N + n_relay) and a mask_mod over the extended key index reproduces the exact
pattern (local band, anchors, relay). flex_attention is torch.compile'd; compiled code and block masks are
cached per (N, device), so timings after the first call exclude compilation (the first call includes it).
"""
from __future__ import annotations

import torch

from .attention import validate
from .reference import RELAY_THRESHOLD, visible_relay_blocks, window

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


def block_mask_for(n: int, n_relay: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    key = (n, n_relay, str(device))
    if key not in _block_masks:
        # _compile=True builds the block mask without materialising the [N, N + R] boolean mask (64 GB at 256K)
        _block_masks[key] = create_block_mask(pattern_mask_mod(n, window(n)), None, None, n, n + n_relay,
                                              device=device, _compile=device.type == "cuda")
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
    """Cron Root attention via FlexAttention (compiled unless compile=False, which runs eager flex)."""
    validate(q, k, v, causal, scale, relay_threshold, "tf32x3", name="flex_cron_root", triton=False)
    d = q.shape[-1]
    if d & (d - 1):
        raise ValueError(f"flex_cron_root: head dim {d} unsupported (FlexAttention needs a power of two)")
    n = q.shape[-2]
    w = window(n)
    n_relay = visible_relay_blocks(n, relay_threshold)
    if n_relay > 0:
        rk = k[:, :, : n_relay * w].unflatten(2, (n_relay, w)).mean(3)
        rv = v[:, :, : n_relay * w].unflatten(2, (n_relay, w)).mean(3)
        k, v = torch.cat([k, rk], dim=2), torch.cat([v, rv], dim=2)
    block_mask = block_mask_for(n, n_relay, q.device)
    if compile:
        fn = _compiled_flex()
    else:
        from torch.nn.attention.flex_attention import flex_attention as fn
    return fn(q, k, v, block_mask=block_mask, scale=scale)
