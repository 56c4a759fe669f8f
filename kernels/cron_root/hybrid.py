"""cron_root_hybrid: dense SDPA causal below a measured crossover length, Cron Root from it on.

Below the crossover this computes *dense* causal attention, a different function from the sparse pattern;
``cron_root_hybrid_reference`` mirrors that choice so accuracy checks compare like with like.
The crossover is stored per GPU name in tuning.json (written from a GPU tuning run), with a default.
Traceable by torch.compile(fullgraph=True): the stored crossover is read as a constant at trace time and
the length test is on a static shape.
"""
from __future__ import annotations

import torch

from kernels.reference import reference_attention

from .._common import check_inputs, default_scale
from . import configs
from .attention import check_options as check_cron_root_options, check_problem, fwd_call
from .reference import RELAY_THRESHOLD, cron_root_reference
from .tuning import crossover_for, device_name

NAME = "cron_root_hybrid"
_device_crossover: dict = {}


@torch.compiler.assume_constant_result
def stored_crossover(device: torch.device, train: bool) -> int:
    """The crossover stored for this device's GPU (tuning.json) for forward-only or fwd+bwd use."""
    key = (device, train)
    if key not in _device_crossover:
        _device_crossover[key] = crossover_for(device_name(device), train)
    return _device_crossover[key]


def check_options(crossover=None, relay_threshold=RELAY_THRESHOLD, precision="tf32x3") -> None:
    """The hybrid's options, checked without a tensor (the harness checks a matrix's cells with it at load
    time)."""
    _check_crossover(crossover)
    check_cron_root_options(NAME, relay_threshold, precision)


def _check_crossover(crossover) -> None:
    if crossover is not None and (type(crossover) is not int or crossover < 0):
        raise ValueError(f"{NAME}: crossover must be an int >= 0 or None, got {crossover!r}")


def _resolve(crossover, device, train: bool) -> int:
    _check_crossover(crossover)
    return stored_crossover(device, train) if crossover is None else crossover


def _sdpa_causal(q, k, v, scale, group: int):
    # PyTorch's own choice: flash for 16-bit inputs, memory-efficient for float32, math for grouped K/V in
    # float32 (GQA runs on flash and math only); never the math kernel where a fused one can run
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                            enable_gqa=group > 1)


def _training(q, k, v) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def cron_root_hybrid(q, k, v, causal: bool = True, scale: float | None = None, crossover: int | None = None,
                     relay_threshold: int = RELAY_THRESHOLD, precision: str = "tf32x3", config=None):
    """SDPA causal (dense) for N < crossover, Cron Root (sparse, the attnbench::cron_root_fwd op) for N >= it.

    crossover=None uses the value stored for this GPU in tuning.json (or its default): the fwd+bwd crossover
    when autograd will need a backward (grad enabled and an input requires grad), the forward-only one otherwise.
    Inputs as cron_root_attention's (grouped K/V included).
    """
    shape = check_inputs(NAME, q, k, v, causal=causal, scale=scale, self_attention=True, causal_only=True)
    check_problem(NAME, shape, relay_threshold, precision)
    tiles = configs.encode(config)          # checked on either side of the crossover
    if shape.len_q < _resolve(crossover, q.device, _training(q, k, v)):
        return _sdpa_causal(q, k, v, scale, shape.group)
    return fwd_call(q, k, v, default_scale(scale, shape.head_dim), relay_threshold, precision, tiles)[0]


def cron_root_hybrid_reference(q, k, v, causal: bool = True, scale: float | None = None,
                               crossover: int | None = None, relay_threshold: int = RELAY_THRESHOLD, **_options):
    """Float64 reference of cron_root_hybrid: dense causal below the crossover, the sparse pattern from it."""
    if not causal:
        raise ValueError(f"{NAME}: causal=False is not supported (Cron Root is a causal-only pattern)")
    if q.shape[-2] < _resolve(crossover, q.device, _training(q, k, v)):
        return reference_attention(q, k, v, causal=True, scale=scale)
    return cron_root_reference(q, k, v, causal=True, scale=scale, relay_threshold=relay_threshold)
