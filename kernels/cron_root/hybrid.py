"""cron_root_hybrid: dense SDPA causal below a measured crossover length, Cron Root from it on.

Below the crossover this computes *dense* causal attention, a different function from the sparse pattern;
``cron_root_hybrid_reference`` mirrors that choice so accuracy checks compare like with like.
The crossover is stored per GPU name in tuning.json (written from a GPU tuning run), with a default.
"""
from __future__ import annotations

import torch

from kernels.reference import reference_attention

from .attention import cron_root_attention, validate
from .reference import RELAY_THRESHOLD, cron_root_reference
from .tuning import crossover_for, device_name

_device_crossover: dict = {}


def _resolve(crossover, device, train: bool) -> int:
    if crossover is None:
        if (device, train) not in _device_crossover:
            _device_crossover[device, train] = crossover_for(device_name(device), train)
        return _device_crossover[device, train]
    if not isinstance(crossover, int) or isinstance(crossover, bool) or crossover < 0:
        raise ValueError(f"cron_root_hybrid: crossover must be an int >= 0 or None, got {crossover!r}")
    return crossover


def _sdpa_causal(q, k, v, scale):
    if q.device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # flash for fp16/bf16 (D <= 256); the memory-efficient kernel takes float32 and other head dims
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def _training(q, k, v) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def cron_root_hybrid(q, k, v, causal: bool = True, scale: float | None = None, crossover: int | None = None,
                     relay_threshold: int = RELAY_THRESHOLD, precision: str = "tf32x3"):
    """SDPA causal (dense) for N < crossover, Cron Root (sparse) for N >= crossover.

    crossover=None uses the value stored for this GPU in tuning.json (or its default): the fwd+bwd crossover
    when autograd will need a backward (grad enabled and an input requires grad), the forward-only one otherwise.
    """
    validate(q, k, v, causal, scale, relay_threshold, precision, name="cron_root_hybrid")
    if q.shape[-2] < _resolve(crossover, q.device, _training(q, k, v)):
        return _sdpa_causal(q, k, v, scale)
    return cron_root_attention(q, k, v, causal=True, scale=scale, relay_threshold=relay_threshold,
                               precision=precision)


def cron_root_hybrid_reference(q, k, v, causal: bool = True, scale: float | None = None,
                               crossover: int | None = None, relay_threshold: int = RELAY_THRESHOLD, **_options):
    """Float64 reference of cron_root_hybrid: dense causal below the crossover, the sparse pattern from it."""
    if not causal:
        raise ValueError("cron_root_hybrid: causal=False is not supported (Cron Root is a causal-only pattern)")
    if q.shape[-2] < _resolve(crossover, q.device, _training(q, k, v)):
        return reference_attention(q, k, v, causal=True, scale=scale)
    return cron_root_reference(q, k, v, causal=True, scale=scale, relay_threshold=relay_threshold)
