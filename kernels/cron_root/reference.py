"""The Cron Root pattern, exactly, and a dense float64 reference of it (the test oracle).

W = ceil(sqrt(N)); query i attends to, in ONE softmax:
  local   tokens j with i - W < j <= i                         (min(i+1, W) tokens, diagonal included)
  anchors tokens j = s*W strictly before the local window       ((s + 1) * W <= i)
  relay   block means r (tokens rW .. rW+W-1, zero-padded, / W) whose whole block lies before the
          local window ((r + 2) * W <= i + 1), only when N > relay_threshold (default 8192, the original's gate)
The dense reference builds that mask over the N tokens plus R = ceil(N/W) relay slots and runs a plain
softmax in float64; gradients flow through the mean, which is exactly the kernel's relay scatter.
"""
from __future__ import annotations

import math

import torch

RELAY_THRESHOLD = 8192


def window(n: int) -> int:
    """W = ceil(sqrt(n)), exact for any int (math.isqrt avoids float rounding at huge n)."""
    if n < 1:
        raise ValueError(f"sequence length must be >= 1, got {n}")
    w = math.isqrt(n)
    return w if w * w == n else w + 1


def uses_relay(n: int, relay_threshold: int = RELAY_THRESHOLD) -> bool:
    """The relay phase exists iff N > relay_threshold (it changes the function, not only the speed)."""
    return n > relay_threshold


def visible_relay_blocks(n: int, relay_threshold: int = RELAY_THRESHOLD) -> int:
    """How many relay blocks any query can see: blocks 0 .. floor(N/W) - 2 (the last block never is)."""
    if not uses_relay(n, relay_threshold):
        return 0
    return max(0, n // window(n) - 1)


def visible_anchors(n: int) -> int:
    """How many anchors any query can see: s with (s + 1) * W <= N - 1."""
    return (n - 1) // window(n)


def cron_root_mask(n: int, relay: bool, device=None) -> torch.Tensor:
    """Boolean [N, N + R] (R = ceil(N/W) relay columns when relay, else [N, N]); True = slot in A(i)."""
    w = window(n)
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    ls = (i - w + 1).clamp(min=0)
    tok_ok = ((j >= ls) & (j <= i)) | ((j % w == 0) & (j < ls))
    if not relay:
        return tok_ok
    r = torch.arange(-(-n // w), device=device)[None, :]
    rel_ok = ((r + 1) * w - 1) < ls
    return torch.cat([tok_ok, rel_ok], dim=-1)


def cron_root_reference(q, k, v, causal: bool = True, scale: float | None = None,
                        relay_threshold: int = RELAY_THRESHOLD, **_options) -> torch.Tensor:
    """Dense float64 Cron Root attention on the inputs' device; differentiable. q: [B, H, N, D]; k, v:
    [B, Hkv, N, D] with H % Hkv == 0 (grouped-query: query head h reads key/value head h // (H // Hkv)).

    Extra keyword options of the kernels (precision, crossover, ...) are accepted and ignored, so this can
    stand in as ``reference=`` for every backend of the package.
    """
    if not causal:
        raise ValueError("cron_root: causal=False is not supported (the pattern is causal only)")
    b, h, n, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q64, k64, v64 = q.double(), k.double(), v.double()
    if k.shape[1] != h:
        k64, v64 = k64.repeat_interleave(h // k.shape[1], 1), v64.repeat_interleave(h // k.shape[1], 1)
    keys, vals = k64, v64
    relay = uses_relay(n, relay_threshold)
    if relay:
        w = window(n)
        nblk = -(-n // w)
        pad = nblk * w - n
        kp = torch.nn.functional.pad(k64, (0, 0, 0, pad))
        vp = torch.nn.functional.pad(v64, (0, 0, 0, pad))
        rk = kp.view(b, h, nblk, w, d).mean(-2)
        rv = vp.view(b, h, nblk, w, d).mean(-2)
        keys, vals = torch.cat([k64, rk], -2), torch.cat([v64, rv], -2)
    ok = cron_root_mask(n, relay, device=q.device)
    s = torch.matmul(q64, keys.transpose(-1, -2)) * scale
    s = s.masked_fill(~ok, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), vals)
