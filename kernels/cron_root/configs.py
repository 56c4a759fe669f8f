"""Tile configs of the Cron Root kernels: built-in defaults per head-dim bucket, the per-GPU tuning.json
entries over them, and the caller's ``config={part: {param: value}}`` override (kernels._common.tile_config).

Parts: fwd (query tile BLOCK_M, local-band key chunk BLOCK_N, gathered anchor/relay chunk BLOCK_S), fwd_small
(the same for grids too small to fill the GPU with fwd's tiles), dq (the same roles), glob (slot chunk BLOCK_G
x query chunk BLOCK_Q; programs_per_sm or a forced number of query segments), loc (key tile BLOCK_N x query
chunk BLOCK_Q); each with num_warps and num_stages on the GPU.

The override travels through the torch.library ops as a canonical string (op arguments cannot be dicts):
``encode`` validates the dict and writes it, ``resolve`` turns (device, dtype, head dim, precision, string)
into the merged configs once per process and caches them.
"""
from __future__ import annotations

import torch

from .._common import block_d, tile_config
from .tuning import device_name, tuned_configs

NAME = "cron_root"
_TILE_PARAMS = ("num_warps", "num_stages")
# every parameter a part takes: what an override may name (kernels._common.tile_config checks against it)
PARAMS = {
    "fwd": ("BLOCK_M", "BLOCK_N", "BLOCK_S", *_TILE_PARAMS),
    "fwd_small": ("BLOCK_M", "BLOCK_N", "BLOCK_S", *_TILE_PARAMS),
    "dq": ("BLOCK_M", "BLOCK_N", "BLOCK_S", *_TILE_PARAMS),
    "glob": ("BLOCK_G", "BLOCK_Q", *_TILE_PARAMS, "programs_per_sm", "segments"),
    "loc": ("BLOCK_N", "BLOCK_Q", *_TILE_PARAMS),
}
_SCHEMA = {part: dict.fromkeys(params, 1) for part, params in PARAMS.items()}


# 16-bit inputs, per head-dim bucket (the padded tile width block_d: <= 64, 128, 256). The 64 and 128 buckets
# are the FlashAttention tutorial's Hopper tiles, timed on the H100; 256 halves the tiles so that K/V chunks
# and the fp32 accumulators fit sm_90's registers and 227 KB of shared memory (checked by compiling for
# sm_90: no spills). tuning.json overrides them per GPU name where a sweep found better ones.
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
    256: dict(
        fwd=dict(BLOCK_M=64, BLOCK_N=32, BLOCK_S=32, num_warps=8, num_stages=1),
        fwd_small=dict(BLOCK_M=32, BLOCK_N=32, BLOCK_S=32, num_warps=4, num_stages=2),
        dq=dict(BLOCK_M=32, BLOCK_N=32, BLOCK_S=32, num_warps=4, num_stages=2),
        glob=dict(BLOCK_G=32, BLOCK_Q=32, num_warps=8, num_stages=2),
        loc=dict(BLOCK_N=32, BLOCK_Q=32, num_warps=8, num_stages=1),
    ),
}
# float32 operands take twice the registers and shared memory: smaller tiles, or the 16-bit ones spill and
# (D >= 128) exceed the shared memory. "tf32" runs one MMA where "tf32x3" runs three, with the same operands:
# the same tiles. "ieee" dots run on FMA units and need the smallest tiles. At D = 256 every precision takes
# 16-row tiles, the only ones that do not spill heavily on sm_90 (float32 at D = 256 is a correctness path).
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
    ("tf32x3", 256): dict(
        fwd=dict(BLOCK_M=16, BLOCK_N=32, BLOCK_S=32, num_warps=8, num_stages=1),
        fwd_small=dict(BLOCK_M=16, BLOCK_N=32, BLOCK_S=32, num_warps=8, num_stages=1),
        dq=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_S=16, num_warps=8, num_stages=1),
        glob=dict(BLOCK_G=16, BLOCK_Q=16, num_warps=8, num_stages=1),
        loc=dict(BLOCK_N=16, BLOCK_Q=16, num_warps=8, num_stages=1),
    ),
}
for _bucket in (64, 128, 256):
    FP32_CONFIGS[("tf32", _bucket)] = FP32_CONFIGS[("tf32x3", _bucket)]
for _bucket in (64, 128):
    FP32_CONFIGS[("ieee", _bucket)] = dict(
        fwd=dict(BLOCK_M=32, BLOCK_N=32, BLOCK_S=32, num_warps=4, num_stages=1),
        fwd_small=dict(BLOCK_M=32, BLOCK_N=32, BLOCK_S=32, num_warps=4, num_stages=1),
        dq=dict(BLOCK_M=32, BLOCK_N=32, BLOCK_S=32, num_warps=4, num_stages=1),
        glob=dict(BLOCK_G=32, BLOCK_Q=32, num_warps=4, num_stages=1),
        loc=dict(BLOCK_N=32, BLOCK_Q=32, num_warps=4, num_stages=1),
    )
FP32_CONFIGS[("ieee", 256)] = FP32_CONFIGS[("tf32x3", 256)]
# The interpreter: 16-row tiles make the loops (band, anchors, relay, tails) run several chunks at test sizes.
CPU_CONFIG = dict(
    fwd=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_S=16),
    fwd_small=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_S=16),
    dq=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_S=16),
    glob=dict(BLOCK_G=16, BLOCK_Q=16),
    loc=dict(BLOCK_N=16, BLOCK_Q=16),
)


def bucket(head_dim: int) -> int:
    """The head-dim bucket of the tile tables: the padded tile width, at least 64."""
    return max(64, block_d(head_dim))


def forward_tiles(head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_D2): the forward's head-dim columns. One tile block_d(D) wide, masked past D (BLOCK_D2 = 0),
    or for 16-bit inputs whose padded tile is at most 128 wide, a full power-of-two tile [0, BLOCK_D) inside D and
    a narrower one [BLOCK_D, BLOCK_D + BLOCK_D2) masked past D, where the two are narrower than the padded tile:
    D = 40 and 48 -> 32 + 16, 72 and 80 -> 64 + 16, 88 and 96 -> 64 + 32 (80 columns of MMA work, not 128). The
    split forward takes the tiles of its first tile's bucket (64): on the H100 at B=1, H=16, N=8192 it ran D = 80
    in 0.085 ms with them, 0.104 with the 128 bucket's and 0.114 padded (timed when it was made; that sweep's file
    was not kept). The harness on the H200 (results/runs/20261128T112215Z_full, headdim_cron_root_*): D = 64 / 80 /
    96 / 128 in 0.080 / 0.096 / 0.111 / 0.127 ms, each head dim's dense-equivalent TFLOP/s between its neighbours'.
    Not split: float32 (its tf32x3 split forward made an illegal memory access on the H100 with triton 3.6, not
    traced: results/dev/head_dim_two_tiles) and D > 128 (not measured on the GPU)."""
    full = block_d(head_dim)
    first = full // 2
    if dtype == torch.float32 or full > 128 or head_dim == full or first < 16:
        return full, 0
    second = block_d(head_dim - first)
    return (first, second) if first + second < full else (full, 0)


def default_gpu_configs(head_dim: int, dtype: torch.dtype, precision: str) -> dict:
    """The built-in GPU tile configs for a head dim, dtype and float32 dot precision (before tuning.json)."""
    b = bucket(head_dim)
    return FP32_CONFIGS[(precision, b)] if dtype == torch.float32 else GPU_CONFIGS[b]


def encode(config) -> str:
    """The canonical string of a tile override (``""`` for none): ``part:param=value,...;part:...``, parts and
    parameters sorted. One-line ValueError for an unknown part or parameter, a value that is not a positive
    int, or a BLOCK_* size that is not a power of two >= 16 (tl.dot's smallest tile)."""
    if not config:
        return ""
    tile_config(NAME, _SCHEMA, config)
    parts = []
    for part in sorted(config):
        for param, value in config[part].items():
            if param.startswith("BLOCK_") and (value < 16 or value & (value - 1)):
                raise ValueError(f"{NAME}: config[{part!r}][{param!r}] must be a power of two >= 16, got {value}")
        parts.append(part + ":" + ",".join(f"{p}={config[part][p]}" for p in sorted(config[part])))
    return ";".join(parts)


def decode(text: str) -> dict:
    """The override dict of a canonical string (the inverse of ``encode``)."""
    out = {}
    for item in filter(None, text.split(";")):
        part, params = item.split(":")
        out[part] = {p: int(v) for p, v in (kv.split("=") for kv in params.split(","))}
    return out


_resolved: dict = {}


def resolve(device: torch.device, dtype: torch.dtype, head_dim: int, precision: str, config: str) -> dict:
    """Tile configs of one call: defaults (per head-dim bucket; float32 per precision; the interpreter's own),
    then for 16-bit inputs the GPU's tuning.json entry, then the caller's override. Cached."""
    key = (device, dtype, bucket(head_dim), precision, config)
    cfg = _resolved.get(key)
    if cfg is None:
        if device.type == "cpu":
            cfg = {part: dict(p) for part, p in CPU_CONFIG.items()}
        else:
            cfg = {part: dict(p) for part, p in default_gpu_configs(head_dim, dtype, precision).items()}
            if dtype != torch.float32:
                for part, p in tuned_configs(device_name(device), bucket(head_dim)).items():
                    cfg[part].update(p)
        for part, p in decode(config).items():
            cfg[part].update(p)
        _resolved[key] = cfg
    return cfg
