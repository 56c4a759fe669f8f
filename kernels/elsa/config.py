"""ELSA launch configurations: a small table per (dtype class, head dim), plus the partition/chunk plan.

No per-call autotuning: a new sequence length must not re-run a tuning sweep. The tables below are the
defaults (chosen from H100 sweeps, see NOTES.md); ``scripts/tune.py --kernel elsa`` writes the configs it
chooses to ``tuning.json`` beside this file, whose entries replace the defaults they name (``tuned_tables``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels._tuning import parse_dim_key, read_configs

# (dtype class, D) -> (BLOCK_M, BLOCK_N, num_warps, num_stages) for phase 1.
# dtype class: "16" for float16/bfloat16, "32" for float32.
BUILTIN_FWD_TABLE = {
    ("16", 32): (128, 64, 4, 3),      # not swept; D=64's tiles
    ("16", 64): (128, 64, 4, 3),      # H100 N=4K 0.120 ms, 16K 1.34 ms; 8 warps was slower (0.173 / 1.38)
    ("16", 128): (64, 64, 4, 3),      # 4K 0.195 ms vs 0.273 for (128, 64, 8, 3); 16K 2.50 vs 2.46
    ("32", 32): (64, 64, 4, 2),       # not swept; D=64's tiles
    ("32", 64): (64, 64, 4, 2),       # tf32x3 4K 0.756 ms (0.58 x efficient), 249 regs, no spills
    ("32", 128): (32, 32, 4, 2),      # tf32x3 4K 1.76 ms; BM=64 spills (24-170 spilled regs) and is slower
}
# Short sequences: a smaller query block gives more programs (N <= SHORT_N).
SHORT_N = 1024
SHORT_BLOCK_M = 64

# (dtype class, D) -> dq (BLOCK_M, BLOCK_N, warps, stages), dkdv (BLOCK_M, BLOCK_N, warps, stages).
# In dkdv BLOCK_N is the key block a program owns and BLOCK_M the query tile it streams.
BUILTIN_BWD_TABLE = {
    ("16", 32): ((64, 64, 4, 3), (32, 128, 4, 3)),        # not swept; D=64's tiles
    # dkdv (32, 128, 4, 3) spills 2 registers on sm_90 with triton 3.6 (255 regs; 16 with 3.9) and is still the
    # fastest: N=8K bwd 0.99 ms vs 1.13 for the best tile without spills (32, 64, 4, 3) and 1.38 for the same
    # tile at 8 warps (results/dev/elsa/h100_bwd_tiles_2026-11-23.log); the GPU spill test allows exactly these 2
    ("16", 64): ((64, 64, 4, 3), (32, 128, 4, 3)),
    ("16", 128): ((128, 32, 8, 3), (32, 128, 8, 3)),      # N=8K bwd 2.03 ms
    ("32", 32): ((128, 32, 8, 2), (32, 64, 4, 2)),        # not swept; D=64's tiles
    ("32", 64): ((128, 32, 8, 2), (32, 64, 4, 2)),        # tf32x3 N=4K bwd 2.89 ms; BN=64 dkdv at 8 warps spills
    ("32", 128): ((32, 32, 4, 2), (32, 32, 4, 2)),        # not swept: smallest tiles (fp32 D=128 spills first)
}

TUNING_FILE = Path(__file__).with_name("tuning.json")


def tuned_tables(path=TUNING_FILE) -> tuple[dict, dict]:
    """(FWD_TABLE, BWD_TABLE): the built-in tables above with the entries of a tuning file in place of the ones they name
    ("fwd": {"16,64": [bm, bn, warps, stages]}, "bwd": {"16,64": {"dq": [...], "dkdv": [...]}})."""
    stored = read_configs(path)
    fwd, bwd = dict(BUILTIN_FWD_TABLE), dict(BUILTIN_BWD_TABLE)
    for key, cfg in stored.get("fwd", {}).items():
        fwd[parse_dim_key(key)] = tuple(cfg)
    for key, cfg in stored.get("bwd", {}).items():
        old_dq, old_dkdv = bwd.get(parse_dim_key(key), (None, None))
        bwd[parse_dim_key(key)] = (tuple(cfg.get("dq", old_dq)), tuple(cfg.get("dkdv", old_dkdv)))
    return fwd, bwd


FWD_TABLE, BWD_TABLE = tuned_tables()

# Partition plan: enough (query block, bh, partition) programs for TARGET_WAVES waves of the GPU,
# at least MIN_P_LONG partitions from LONG_N keys on (a real multi-partition scan), partitions at
# least MIN_W keys wide, at most MAX_P of them (phase-2 traffic grows with P).
TARGET_WAVES = 2
LONG_N = 4096
MIN_P_LONG = 2
MIN_W = 128
MAX_P = 16
# Q-chunking: chunk the query rows so the fp32 summary buffer stays within SUMMARY_BUDGET x the
# output's bytes (extra memory O(N)), but never below CHUNK_MIN_WAVES waves of programs per launch.
SUMMARY_BUDGET = 1.0
CHUNK_MIN_WAVES = 8
# Phase 2: rows per program and partitions reduced per slab, per D (slab = KBT x ROWS x D fp32).
PHASE2_ROWS = {32: 64, 64: 32, 128: 16}
PHASE2_KBT = 2   # 4 spilled at D=64, BM=128 (255 regs); phase 2 is memory-bound anyway
DEFAULT_SM_COUNT = 132   # H100 SXM; used on the CPU (interpreter) where there is no SM count

_sm_cache: dict = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_cache:
        _sm_cache[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_cache[idx]


def dtype_class(dtype: torch.dtype) -> str:
    return "32" if dtype == torch.float32 else "16"


@dataclass(frozen=True)
class FwdPlan:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    width: int          # W: keys per partition (a multiple of block_n)
    parts: int          # P = ceil(N / W)
    q_chunk: int        # query rows per phase-1/phase-2 launch pair (a multiple of block_m)
    p2_rows: int
    p2_kbt: int


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@functools.lru_cache(maxsize=1024)   # a pure function of its arguments, called on every forward (host time)
def plan_forward(n: int, bh: int, d: int, dtype: torch.dtype, device: torch.device, *,
                 block_m=None, block_n=None, num_warps=None, num_stages=None,
                 partition_width=None, q_chunk=None) -> FwdPlan:
    """Tiles, partitions and q-chunks for one forward call. Keyword overrides are test/tuning knobs."""
    bm, bn, warps, stages = FWD_TABLE[(dtype_class(dtype), d)]
    if n <= SHORT_N and bm > SHORT_BLOCK_M:
        bm = SHORT_BLOCK_M
    bm = block_m or bm
    bn = block_n or bn
    warps = num_warps or warps
    stages = num_stages or stages
    sms = sm_count(device)
    if partition_width is not None:
        width = max(bn, -(-int(partition_width) // bn) * bn)
    else:
        qblocks = -(-n // bm)
        parts = -(-TARGET_WAVES * sms // max(1, qblocks * bh))
        parts = min(parts, MAX_P, -(-n // max(MIN_W, bn)))
        if n >= LONG_N:
            parts = max(parts, MIN_P_LONG)
        parts = max(parts, 1)
        width = -(-(-(-n // parts)) // bn) * bn
    parts = max(1, -(-n // width))
    if q_chunk is not None:
        qc = max(bm, -(-int(q_chunk) // bm) * bm)
    else:
        out_bytes = bh * n * d * dtype.itemsize
        row_bytes = parts * bh * (d + 2) * 4               # summary bytes per query row
        qc_budget = int(SUMMARY_BUDGET * out_bytes) // max(1, row_bytes)
        qc_parallel = bm * -(-CHUNK_MIN_WAVES * sms // max(1, bh * parts))
        qc = max(qc_budget, qc_parallel)
        qc = -(-qc // bm) * bm
    qc = min(qc, -(-n // bm) * bm)
    rows = min(PHASE2_ROWS[d], bm)
    kbt = min(PHASE2_KBT, _next_pow2(parts))
    return FwdPlan(bm, bn, warps, stages, width, parts, qc, rows, kbt)


@dataclass(frozen=True)
class BwdPlan:
    dq: tuple
    dkdv: tuple
    pre_block_m: int = 64


def plan_backward(d: int, dtype: torch.dtype, *, dq_config=None, dkdv_config=None) -> BwdPlan:
    dq, dkdv = BWD_TABLE[(dtype_class(dtype), d)]
    return BwdPlan(tuple(dq_config or dq), tuple(dkdv_config or dkdv))


def summary_bytes(plan: FwdPlan, n: int, bh: int, d: int) -> int:
    rows = plan.parts * math.ceil(min(plan.q_chunk, n) / plan.block_m) * bh * plan.block_m
    return rows * (d + 2) * 4
