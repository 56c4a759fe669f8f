"""ELSA launch configurations: a small table per (dtype class, head-dim tile), the partition / q-chunk plan,
and the tile-config override (``config=``) in the canonical string form the torch.library ops take.

No per-call autotuning: a new sequence length must not re-run a tuning sweep. Phase 1 of 16-bit inputs without a
bias runs the Gluon core at its head dims (64-256: kernels/_gluon_core.SPLITS) on sm_90 from its MIN_WORK
(FwdPlan.gluon: its CTA and key tile), else the flash core's loop with the core's tiles (kernels/_flash_core.py's
PLAIN_TILES, and WS_TILES where the warp-specialized loop is taken; ``core_tiles``). The built-in tables below serve the rest: the forward table
float32 and the 16-bit bias path (this package's own loop), the backward table every backward. Their 64- and
128-wide entries come from H100 sweeps or, where a comment says so, an sm_90 compile check (NOTES.md,
results/dev/elsa/); the 16- and 32-wide entries reuse the 64-wide ones; the 256-wide ones come from the compile
check (registers, spills, shared memory). ``scripts/tune.py --kernel elsa`` writes the configs it chooses to
``tuning.json`` beside this file, whose entries replace the built-in ones they name (``tuned_tables``, and
``tuned_short_tables`` for the short calls' window and one-launch tiles); a forward
key it names also replaces the core's plain tiles for 16-bit inputs without a bias (``FWD_TUNED``; the
warp-specialized tiles stay). A caller's ``config=`` overrides all of them for one call.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import _flash_core as core
from .. import _gluon_bwd as gluon_bwd
from .. import _gluon_core as gluon_core
from . import gluon_phase1
from .._common import DEFAULT_L2_BYTES, block_d, tile_config
from .._tuning import TuningFileError, min_work_entries, parse_dim_key, read_configs

# (dtype class, BLOCK_D) -> (BLOCK_M, BLOCK_N, num_warps, num_stages) for phase 1.
# dtype class: "16" for float16/bfloat16, "32" for float32. BLOCK_D = the head dim padded to a power of two
# (D = 40 runs in the 64-wide tiles, D = 80 and 96 in the 128-wide ones, D = 136..256 in the 256-wide ones).
# 16-bit inputs without a bias run the flash core's loop with the core's tiles (core_tiles: kernels/_flash_core.py's
# PLAIN_TILES and WS_TILES, from the H100 sweep; a key tuning.json names replaces the plain ones: FWD_TUNED); this
# table serves float32 and the 16-bit bias path (this package's own loop, which loads a bias tile per key tile; the
# 16-bit timings below are that loop's, measured before the core).
BUILTIN_FWD_TABLE = {
    ("16", 16): (128, 64, 4, 3),      # D=64's tiles
    ("16", 32): (128, 64, 4, 3),      # not swept; D=64's tiles
    ("16", 64): (128, 64, 4, 3),      # H100 N=4K 0.120 ms, 16K 1.34 ms; 8 warps was slower (0.173 / 1.38)
    ("16", 128): (64, 64, 4, 3),      # 4K 0.195 ms vs 0.273 for (128, 64, 8, 3); 16K 2.50 vs 2.46
    ("16", 256): (64, 64, 8, 2),      # sm_90 compile check (not timed): 216 regs, no spills, 160 KB shared
    ("32", 16): (64, 64, 4, 2),       # D=64's tiles
    ("32", 32): (64, 64, 4, 2),       # not swept; D=64's tiles
    # tf32x3 4K 0.756 ms (0.58 x efficient), 249 regs, no spills; as the only partition (below LONG_N: out and lse
    # stored by phase 1) 255 regs and 6 spilled, kept: the five tiles tried that do not spill took 1.12-1.99x its
    # time over 7 shapes of 197-4000 tokens on the H200 (geometric means; 32 x 32 won at 197 tokens, 0.87x, and took
    # up to 1.65x elsewhere: results/dev/elsa/fp32_single_partition_tiles_h200.json)
    ("32", 64): (64, 64, 4, 2),
    ("32", 128): (32, 32, 4, 2),      # tf32x3 4K 1.76 ms; BM=64 spills (24-170 spilled regs) and is slower
    ("32", 256): (16, 32, 8, 2),      # sm_90 compile check (not timed): the only tile tried without spills
}
# The 16-bit backward in one launch up to this much work (B * Hq * Nq * Nk; backward_launches). On the H200
# (scripts/elsa_bwd_launches.py, results/dev/elsa/bwd_one_launch_h200.json) a fwd+bwd call's host time is 0.84-0.99x
# two launches' up to 2048 rows. The backward's GPU time, one launch over two, follows the work: up to 2^25 (ViT-T's
# 1025-token layer at batch 8, 2^24.6; B=1 H=8 N=2048, 2^25) 0.76-0.94x at D=64 non-causal (the two jobs fill the
# GPU together), 0.77-1.09x causal, 0.92x at Swin's 49-token windows, 1.02-1.18x at D=128; from 2^27 (B=1 H=8
# N=4096; B=4 H=16 N=2048) 1.19-1.39x non-causal (the grid is full and every dK/dV program reloads O). float32 keeps
# two launches: its merged kernel took 1.17-1.63x the GPU time non-causal from 577 rows.
ONE_LAUNCH_MAX_WORK = 1 << 25
# The 16-bit backward without a bias runs the Gluon backward on sm_90 (kernels/_gluon_bwd.py: five GEMMs per tile
# where the Triton backward's two kernels take seven; warp-specialized, dQ by TMA reduce-add) from this much work
# (B * Hq * Nq * Nk), per (head dim, causal). Its launch's host work (five host-side TMA descriptors, its prologue,
# dQ's cast), run while the GPU idles once the forward is done, must be repaid: at 4K a fwd+bwd call on it took
# 2.05x cuDNN's time at D = 128 against 1.61 on the Triton backward (runs/20261128T212449Z_hopper; ~0.3-0.4 ms of
# host time exposed, inferred, not measured on the host). These built-in values (8K at B=1, H=8; 16K at D = 64
# without a mask) came from its GPU time alone (results/dev/gluon_bwd/crossover_h200.json) and that run.
# scripts/tune.py --kernel elsa --sections gluonbwd measures the crossover through the harness's timer (fwd+bwd,
# host time included) and writes it to the tuning file ("gluon_bwd_min_work": {"<D>,<causal 0/1>": work}), which
# replaces these: on the H200 from 3K at D = 128 (causal: 0.99 +- 0.02 of the Triton one's time there) and 6K at
# D = 64 (results/dev/gluon_bwd/crossover_harness_h200/); re-tuned after the Gluon backward's launch order
# (_gluon_bwd.heads_fastest_pays), D = 64 from 4K (results/dev/gluon_bwd/crossover_launch_order_h200/: at 4K 0.95,
# causal 0.91 of the Triton one's time; 3K-4K calls are host-bound, and a repeat on the warm machine put both at 3K).
BUILTIN_GLUON_BWD_MIN_WORK = {(64, False): 1 << 31, (64, True): 1 << 29, (128, False): 1 << 29, (128, True): 1 << 29}
# The one-launch backward of short calls (Nq <= SHORT_N) in smaller key blocks and one stage (a tuning file's
# "short_bwd" entries replace these: scripts/tune.py --kernel elsa --sections short16): on the H200
# (results/dev/elsa/short_tiles_h200.json, fp16, backward kernel time) 38 us against 71 at Swin's windows (B_=512
# H=3 N=49 D=32, bias gradient), 55 against 72 at N=64, 9.8 against 14.9 at ViT-T's 197 tokens (B=8 H=3 D=64;
# 13.6 against 25.0 with a bias), 15.4 against 16.9 at 128 and 34 against 37 at 577 tokens; at 1025 tokens 96
# against 80, hence the bound. As a one-launch kernel takes the larger warp count and the smaller stage count of
# its two jobs, this is 4 warps and 1 stage. Measured at D=32 and 64 only.
BUILTIN_SHORT_ONE_LAUNCH_BWD = {key: ((64, 32, 4, 1), (32, 64, 4, 1)) for key in (("16", 16), ("16", 32), ("16", 64))}
# Short sequences: a smaller query block gives more programs (NQ <= SHORT_N); no warp specialization there (its two
# consumer warpgroups split a 128-row block).
SHORT_N = 1024
SHORT_BLOCK_M = 64
# Windows (Swin's 7 x 7 = 49 tokens; queries and keys both <= WINDOW_N): the 16-bit bias path's loop in 16 x 32 tiles
# on one warp (a tuning file's "window_fwd" entries replace these: --sections window16). On the H200
# (results/dev/elsa/short_tiles_h200.json, fp16, the relative-position bias broadcast over the windows) phase 1 in
# 32 x 32 tiles took 16.7 us against 58.9 with the short rule's (64, 64, 4, 3) at B_=512 H=3 N=49 D=32 (SDPA's
# efficient kernel: 27), 6.3 against 19.9 at B_=32 H=12, 22.0 against 58.5 at N=64; at 197 tokens the same tiles
# took 5x the time, hence the bound. 16 x 32 then: 2.2 % faster than 32 x 32 over Swin-T's windows (scripts/tune.py
# --sections window16 on the H200, results/dev/elsa/tune_short_h200.json: 1.248 against 1.275 x efficient's time,
# CI +-0.8 / 1.0 %), and it does not spill where 32 x 32 spilled 4 registers (SHORT_BIAS_TILES' file). Measured at
# D=32 (every Swin-v1 head) only.
WINDOW_N = 64
BUILTIN_WINDOW_FWD_TILES = {("16", 32): (16, 32, 1, 1)}
# Biased calls of at most SHORT_N query rows, where the tables' tiles spill registers with a bias (its [BM, BN] tile,
# loaded through one pointer per element when its row stride is not a multiple of 16: 49 at Swin's windows): phase 1's
# tiles ("fwd") and the backward's ("bwd": dQ, dK/dV), before WINDOW_FWD_TILES and overrides. Spills as triton 3.6
# compiles them on the H200 (n_spills at B=1 H=2 N=49, results/dev/elsa/bias_tiles_h200.json), the tables' tiles
# against these: fp16 D=16 phase 1 72 -> 0; D=32 (above WINDOW_N) 88 -> 0; D=128 268 -> 0 (bf16 the same);
# D=256 68 -> 0 and its one-launch backward 10 -> 0; fp32 D=16 16 -> 0, D=32 20 -> 0, D=64 22 -> 0 and its
# backward dQ / dK/dV 6 / 10 -> 0. The other keys' tiles do not spill with a bias there. Phase 1's forward time in
# these tiles against the tables' (the same file's "times": do_bench, B*H = 1024 / 128 / 32 at N = 49 / 197 / 577)
# was 0.2-0.8x, but for float32 D=64 at 577 tokens (1.17x). The sm_90 compile check (scripts/compile_check.py)
# reproduces the window tiles' spills but not these (none in the tables' tiles at D=128, where the H200 spilled
# 268): the GPU test (tests/test_elsa.py, test_gpu_registered_configs_do_not_spill) is what judges them.
SHORT_BIAS_TILES = {
    ("16", 16): {"fwd": (64, 32, 4, 2)},
    ("16", 32): {"fwd": (64, 32, 4, 2)},
    ("16", 128): {"fwd": (64, 32, 4, 1)},
    ("16", 256): {"fwd": (32, 32, 4, 1), "bwd": ((16, 32, 4, 1), (32, 16, 4, 1))},
    ("32", 16): {"fwd": (64, 32, 4, 2)},
    ("32", 32): {"fwd": (64, 32, 4, 2)},
    ("32", 64): {"fwd": (64, 32, 4, 1), "bwd": ((64, 16, 4, 1), (16, 64, 4, 1))},
}
# Phase 1 takes the Gluon core (kernels/_gluon_core.py) from its MIN_WORK (2^31 of B*Hq * Nq * Nk * D; the
# measurements are there). It was 2^34 while the core's launch built its descriptor objects at every call, ~100-160 us
# of CPU per forward against ~40-50 on the Triton core (results/dev/gluon_core/elsa_host_time_h100.json): in the H100
# nightly gate the D=64 4K forward (B=1, H=8: 2^33) then went from 0.86x to 1.07x flash on the core
# (runs/20261125T005121Z_nightly). Its prepared launch re-encodes the TMA maps alone (kernels/_launch.py): ELSA's
# forward on the core costs 30-55 us of host time on the H200 host, as on the Triton core.

# Causal phase 1 on the Gluon core runs persistent (the core's causal order: longest row blocks first, the heads
# fastest, every other round reversed) only where its items' costs differ much: one launch (q-chunk) over a square
# call's rows from 0, whose items span the whole causal triangle, while K and V of the kv heads a round reads fit in
# L2 (gluon_core.round_kv_bytes), up to this many rounds of the SMs; elsewhere the plain grid, whose programs share a
# head's keys. On the H200 (results/dev/elsa/causal_grid_h200.json: B=1, fp16 unless named, CUDA-graph time,
# persistent over plain): such launches at H = 8 D = 64 4K-12K 0.76-0.95, D = 128 4K-8K 0.90-0.97 (bf16 8K 0.93),
# Llama-3's 32 / 8 heads at 2K and 4K (15.5 rounds) 0.82 and 0.93. Two q-chunks (the second's rows from about Nq / 2:
# half its items see a whole partition) and chunked prefill (more keys than queries) hold items of near-equal cost:
# D = 128 12K-32K 1.05-1.08 (bf16 16K 1.06), D = 64 32K 1.03, 32 / 8 heads 8K-32K 1.06-1.10, 2K-8K rows on 8K-32K keys
# 1.02-1.08 (8 heads of 2K rows on 32K keys at 2.9 rounds, persistent under the earlier rule of four rounds: 1.07);
# 32 kv heads of 8K 1.20; one exception left plain, D = 64 16K in two q-chunks, 0.96. A persistent grid walking such
# items in the plain grid's order instead gained 0-3 % or lost up to 20 %
# (results/dev/gluon_core/causal_plain_order_h200.json): not kept. The rounds stop at the most measured: a square
# call in one q-chunk (config={"plan": {"q_chunk": N}}; results/dev/elsa/one_q_chunk_causal_h200.json, over cuDNN's
# causal, the shipped two chunks / one chunk plain / one chunk persistent) gained persistent at 31 rounds, Llama-3's
# 32 / 8 heads of 8K 1.05 / 1.06 / 1.02, and at H = 8 D = 64 16K 1.02 / 0.98 / 0.93, D = 128 12K 0.99 / 0.97 / 0.94;
# past L2 it gained at most 2 % or lost (32 kv heads of 8K 1.05 / 1.06 / 1.12). So a causal plan on the core takes
# one q-chunk wherever that chunk runs persistent by this rule (_partitions' persistent_rounds): 16-bit is speed
# first, and one chunk's summaries cost 34-36 % more memory above the inputs than SUMMARY_BUDGET's chunks at the
# measured shapes (Llama-3 8K 98 -> 132 MiB), bounded by the rule's L2 and rounds. As shipped, over the budget's chunks
# (results/dev/elsa/one_q_chunk_default_h200.json, CUDA-graph time, outputs bit-identical): D = 64 16K 0.92 (bf16
# 0.92), D = 128 12K 0.96 (0.95), Llama-3 8K 0.98; fwd+bwd D = 64 16K 0.97, Llama-3 8K 0.99.
CAUSAL_PERSISTENT_ROUNDS = 32


def causal_rounds(nq: int, nk: int, q_chunk: int, bh: int, group: int, d: int, sms: int, l2: int) -> int:
    """The rounds a causal phase 1 on the Gluon core may run persistent (the core's causal_rounds; 0: the plain
    grid): CAUSAL_PERSISTENT_ROUNDS for a square call in one q-chunk whose round's K and V fit in `l2` bytes."""
    if nq != nk or q_chunk < nq or gluon_core.round_kv_bytes(bh, group, nk, d, sms) > l2:
        return 0
    return CAUSAL_PERSISTENT_ROUNDS


# (dtype class, BLOCK_D) -> dq (BLOCK_M, BLOCK_N, warps, stages), dkdv (BLOCK_M, BLOCK_N, warps, stages).
# In dkdv BLOCK_N is the key block a program owns and BLOCK_M the query tile it streams.
BUILTIN_BWD_TABLE = {
    ("16", 16): ((64, 64, 4, 3), (32, 128, 4, 3)),        # D=64's tiles
    ("16", 32): ((64, 64, 4, 3), (32, 128, 4, 3)),        # not swept; D=64's tiles
    # dkdv (32, 128, 4, 3) spills 2 registers on sm_90 with triton 3.6 (255 regs; 16 with 3.9) and is still the
    # fastest: N=8K bwd 0.99 ms vs 1.13 for the best tile without spills (32, 64, 4, 3) and 1.38 for the same
    # tile at 8 warps (results/dev/elsa/bwd_tiles_h100.log); the GPU spill test allows exactly these 2
    ("16", 64): ((64, 64, 4, 3), (32, 128, 4, 3)),
    ("16", 128): ((128, 32, 8, 3), (32, 128, 8, 3)),      # N=8K bwd 2.03 ms
    ("16", 256): ((64, 32, 8, 2), (64, 32, 8, 2)),        # sm_90 compile check (not timed): no spills
    ("32", 16): ((128, 32, 8, 2), (32, 64, 4, 2)),        # D=64's tiles
    ("32", 32): ((128, 32, 8, 2), (32, 64, 4, 2)),        # not swept; D=64's tiles
    ("32", 64): ((128, 32, 8, 2), (32, 64, 4, 2)),        # tf32x3 N=4K bwd 2.89 ms; BN=64 dkdv at 8 warps spills
    # fp32 D >= 128 backward: tf32x3 keeps hi/lo copies of every operand live, and every tile spills on sm_90. D=128
    # timed on the H100 (scripts/tune.py --sections bwd32d128, N=4K, results/dev/elsa/bwd_fp32_d128_tiles_h100.json):
    # 1.52x efficient's backward time against 1.95x for the tiles that spilled least ((16, 32, 4, 2), (32, 32, 8, 2))
    ("32", 128): ((32, 128, 8, 1), (32, 32, 4, 2)),
    ("32", 256): ((16, 32, 8, 2), (16, 16, 8, 2)),
}

TUNING_FILE = Path(__file__).with_name("tuning.json")


def _stored_entries(path, stored: dict, table: str) -> dict:
    """{(dtype class, BLOCK_D): value} of one table of a tuning file; a key that is not one of the tables' is a
    TuningFileError naming the file, the table and the key."""
    entries = {}
    for key, value in stored.get(table, {}).items():
        try:
            dim = parse_dim_key(key)
        except ValueError:
            dim = None
        if dim not in BUILTIN_FWD_TABLE:
            raise TuningFileError(f"{path}: {table}[{key!r}]: not a (dtype class, BLOCK_D) of the tables "
                                  f"({', '.join(f'{c},{d}' for c, d in BUILTIN_FWD_TABLE)})")
        entries[dim] = value
    return entries


def _backward_entry(cfg: dict, old: tuple) -> tuple:
    return tuple(cfg.get("dq", old[0])), tuple(cfg.get("dkdv", old[1]))


def tuned_tables(path=TUNING_FILE) -> tuple[dict, dict]:
    """(FWD_TABLE, BWD_TABLE): the built-in tables above with the entries of a tuning file in place of the ones they
    name, keyed "<dtype class>,<BLOCK_D>" like the tables ("fwd": {"16,64": [bm, bn, warps, stages]},
    "bwd": {"16,64": {"dq": [...], "dkdv": [...]}}, either of dq / dkdv may be left out)."""
    stored = read_configs(path)
    fwd, bwd = dict(BUILTIN_FWD_TABLE), dict(BUILTIN_BWD_TABLE)
    fwd_entries, bwd_entries = _stored_entries(path, stored, "fwd"), _stored_entries(path, stored, "bwd")
    fwd.update((dim, tuple(cfg)) for dim, cfg in fwd_entries.items())
    bwd.update((dim, _backward_entry(cfg, bwd[dim])) for dim, cfg in bwd_entries.items())
    return fwd, bwd


def tuned_gluon_bwd_min_work(path=TUNING_FILE) -> dict:
    """GLUON_BWD_MIN_WORK: the built-in thresholds with a tuning file's in place of the ones it names
    ("gluon_bwd_min_work": {"<head dim>,<causal 0 / 1>": B * Hq * Nq * Nk}; kernels._tuning.min_work_entries)."""
    return min_work_entries(path, "gluon_bwd_min_work", BUILTIN_GLUON_BWD_MIN_WORK)


def tuned_short_tables(path=TUNING_FILE) -> tuple[dict, dict]:
    """(WINDOW_FWD_TILES, SHORT_ONE_LAUNCH_BWD): the short calls' built-in tables with a tuning file's entries
    ("window_fwd": {"16,32": [bm, bn, warps, stages]}, "short_bwd": {"16,64": {"dq": [...], "dkdv": [...]}}; a
    short_bwd entry for a key without a built-in one starts from BWD_TABLE's)."""
    stored = read_configs(path)
    window, short = dict(BUILTIN_WINDOW_FWD_TILES), dict(BUILTIN_SHORT_ONE_LAUNCH_BWD)
    window.update((dim, tuple(cfg)) for dim, cfg in _stored_entries(path, stored, "window_fwd").items())
    short.update((dim, _backward_entry(cfg, short.get(dim, BWD_TABLE[dim])))
                 for dim, cfg in _stored_entries(path, stored, "short_bwd").items())
    return window, short


FWD_TABLE, BWD_TABLE = tuned_tables()
WINDOW_FWD_TILES, SHORT_ONE_LAUNCH_BWD = tuned_short_tables()
GLUON_BWD_MIN_WORK = tuned_gluon_bwd_min_work()
# the forward keys the tuning file names: for 16-bit inputs without a bias they replace the flash core's plain tiles
# (scripts/tune.py times its candidates through config=, i.e. on the plain loop)
FWD_TUNED = frozenset(parse_dim_key(k) for k in read_configs(TUNING_FILE).get("fwd", {}))

# Partition plan: below LONG_N keys one partition (phase 1 writes the output, no phase 2). From LONG_N on enough
# (query block, bh, partition) programs for TARGET_WAVES waves of the GPU and at least MIN_P_LONG partitions: ELSA
# is a two-pass parallel scan there (`attnbench verify-2pass` checks it from real launches), with partitions at least
# MIN_W keys wide, at most MAX_P of them (phase-2 traffic grows with P). Below LONG_N a split measured slower on the
# H100 wherever the old rule made one (up to 2 waves of programs, from 256 keys): in device time (CUDA graphs) one
# partition took 3-35 % less at all 14 such shapes of 512-2048 tokens, D = 64 and 128, e.g. ViT-T's 1025-token layer
# (B=8, H=3, D=64) 29.9 us against 37.2 split in two (flash: 34.6), B=1 H=8 N=2048 D=128 34.4 against 53.0 split in
# three (results/dev/elsa/key_split_h100.json): the second launch, the summaries and phase 2 cost more than the extra
# programs gain, and called eagerly the split is one more launch of host time too. From 4096 keys one partition was
# faster too (4-15 % at 4K-16K, 16-bit, the same file) but would no longer be the scan.
TARGET_WAVES = 2
LONG_N = 4096
MIN_P_LONG = 2
MIN_W = 128
MAX_P = 16
# Q-chunking, per dtype class: chunk the query rows so the summary buffer stays within SUMMARY_BUDGET x the
# output's bytes (extra memory O(N): peak above the inputs ~ (1 + budget) x the output's), but never below
# CHUNK_MIN_WAVES waves of phase-1 programs per launch (fewer leave SMs idle in each chunk's last wave). float32:
# the memory target (peak above the inputs <= 1.3 x SDPA efficient's) with chunks of ~15 waves of its small tiles
# anyway; 16-bit: speed first, 4 waves of 128-row programs per chunk. Where each program holds a SM alone (float32's
# phase 1 on wgmma, 128-row programs) and the chunks are fitted to whole waves below, a wave is exact and one is enough:
# at 4K (B=1, H=8) the budget's chunks of 8 blocks (one wave each) instead of two waves' 16 (peak above the inputs
# 1.53 -> 1.27 x efficient's, 1-2 % slower: runs/20261129T105145Z_hopper, 20261129T105649Z_hopper). Causal, twice
# that: half a causal chunk's programs are empty or short (4K D=128: 1.42 x efficient's time in one-wave chunks, 1.22
# in two-wave ones, whose summaries are twice the budget there; results/dev/elsa/fp32_phase1_prefetch_h200.json).
SUMMARY_BUDGET = {"32": 0.25, "16": 0.5}
CHUNK_MIN_WAVES = {"32": 2, "16": 4}
ONE_CTA_PER_SM_MIN_WAVES = 1
# ... and then fit the chunks to whole waves: a chunk of QB query blocks launches QB x bh x P programs, and a
# chunk whose last wave is part-full leaves SMs idle until the next chunk's launch. On the H100 at 8K, bh=16, P=2,
# D=128, chunks of 17 blocks (4.1 waves each) held ELSA's forward to 480 TFLOP/s against the Gluon core's 605 alone
# (results/dev/gluon_core/head_dims_h100.json); two chunks of 32 blocks: 580 (runs/20261125T062122Z_full). Up to
# CHUNK_FIT_GROWTH x the chunk above is searched for the fewest wave slots (+ CHUNK_COST_WAVES per chunk: its
# phase-2 launch and pipeline ramp), the smallest chunk on a tie; float32 keeps its memory target (no growth). The
# 16-bit budget's two chunks cost nothing measurable: one chunk of every row at 16K D = 128 (B=1, H=8, twice the
# summaries) took 1.03-1.12x cuDNN's time against 1.00-1.02 (results/dev/elsa/one_q_chunk_h200.json).
CHUNK_FIT_GROWTH = {"32": 1, "16": 2}
CHUNK_COST_WAVES = 0.25
# Phase 2: rows per program, per dtype class and BLOCK_D, and partitions reduced per slab (the m and z of KBT
# partitions; the parts of (KBT + 1) // 2 partitions from partition 1, ROWS x BLOCK_D values each). These were timed
# on the H100 with the phase 2 before its loads were issued at once (kernel.py), when its S slabs were KBT wide. 16-bit
# (partials in 16 bits): 64 rows at D=64 and 32 at D=128 took 10-16 % less phase-2 time on the H100 than 32 and 16
# (4K-16K, and Llama-3's causal GQA at 8K; results/dev/elsa/phase2_16bit_partials_h100.json). Re-timed on the H200 with
# the one-round-trip phase 2 (results/dev/elsa/phase2_retime_h200.json, every spill-free (ROWS, KBT), 4K and 16K):
# within 1-7 % of the fastest ((32, 2) at D=64, (16, 2) at D=128), under 1 us a call, below the harness's noise: kept.
# float32 keeps the smaller slabs: 64 rows at D=64 spill there (sm_90 compile check, scripts/compile_check.py).
PHASE2_ROWS = {"16": {16: 64, 32: 64, 64: 64, 128: 32, 256: 16},
               "32": {16: 64, 32: 64, 64: 32, 128: 16, 256: 8}}
# Partitions per slab, the same way: 2 (4 spilled at D=64, BM=128: 255 regs; phase 2 is memory-bound anyway), but
# 1 for 16-bit at BLOCK_D = 256 (D = 136-256): with 2 there phase 2 took 0.33-0.44 ms at D = 160 and 256 (B=1, H=16,
# 8K) against 0.06-0.08 with 1, whatever the rows and warps (results/dev/elsa/phase2_wide_h100.json). float32 keeps
# 2 (not timed there).
PHASE2_KBT = {"16": {16: 2, 32: 2, 64: 2, 128: 2, 256: 1},
              "32": {16: 2, 32: 2, 64: 2, 128: 2, 256: 2}}
PHASE2_WARPS = 4
DEFAULT_SM_COUNT = 132   # H100 SXM; used on the CPU (interpreter) where there is no SM count

TILE_PARAMS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
PLAN_PARAMS = ("partition_width", "q_chunk", "bwd_launches", "gluon_bwd_min_work")   # 0 in the defaults: the plan's

def dtype_class(dtype: torch.dtype) -> str:
    return "32" if dtype == torch.float32 else "16"


# ------------------------------------------------------------------------------------------------
# Tile-config override: config={part: {param: value}} -> one canonical string (an op argument)
# ------------------------------------------------------------------------------------------------

def core_tiles(dtype: torch.dtype, head_dim: int, bias: bool = False, warp_specialize: bool = False):
    """Phase 1's (BLOCK_M, BLOCK_N, num_warps, num_stages) before the short-N rule and overrides: for 16-bit inputs
    without a bias the flash core's tables (its warp-specialized tiles when asked and present; its plain tiles
    unless the tuning file changed this key), FWD_TABLE else."""
    key = (dtype_class(dtype), block_d(head_dim))
    if key[0] == "16" and not bias:
        if warp_specialize and key in core.WS_TILES:
            return core.WS_TILES[key]
        return FWD_TABLE[key] if key in FWD_TUNED else core.PLAIN_TILES[key]
    return FWD_TABLE[key]


def default_config(dtype: torch.dtype, head_dim: int) -> dict:
    """The tile parameters of every part for this dtype and head dim (the plain phase-1 tiles; the plan's values
    are 0 = chosen per call). What ``config=`` may override."""
    key = (dtype_class(dtype), block_d(head_dim))
    dq, dkdv = BWD_TABLE[key]
    return {"fwd": dict(zip(TILE_PARAMS, core_tiles(dtype, head_dim))), "plan": dict.fromkeys(PLAN_PARAMS, 0),
            "dq": dict(zip(TILE_PARAMS, dq)), "dkdv": dict(zip(TILE_PARAMS, dkdv))}


def canonical_config(override, dtype: torch.dtype, head_dim: int) -> str:
    """Validate ``config=`` (kernels._common.tile_config, plus what Triton needs: power-of-two blocks of at least
    16, power-of-two warps) and return it as "part.param=value;..." (sorted, only the overridden values);
    "" for none."""
    if not override:
        return ""
    tile_config("elsa", default_config(dtype, head_dim), override)
    items = []
    for part, params in override.items():
        for param, value in params.items():
            if param.startswith("BLOCK") and (value < 16 or value & (value - 1)):
                raise ValueError(f"elsa: config[{part!r}][{param!r}] must be a power of two >= 16, got {value}")
            if param == "num_warps" and value & (value - 1):
                raise ValueError(f"elsa: config[{part!r}]['num_warps'] must be a power of two, got {value}")
            if param == "bwd_launches" and value not in (1, 2):
                raise ValueError(f"elsa: config['plan']['bwd_launches'] must be 1 or 2, got {value}")
            items.append(f"{part}.{param}={value}")
    return ";".join(sorted(items))


@functools.lru_cache(maxsize=256)
def parse_config(text: str) -> dict:
    """The overrides of a canonical config string: {part: {param: value}}."""
    parts: dict = {}
    for item in filter(None, text.split(";")):
        name, value = item.split("=")
        part, param = name.split(".")
        parts.setdefault(part, {})[param] = int(value)
    return parts


def _tiles(part: str, table_value: tuple, overrides: dict) -> tuple:
    given = overrides.get(part, {})
    return tuple(given.get(name, default) for name, default in zip(TILE_PARAMS, table_value))


# ------------------------------------------------------------------------------------------------
# Forward plan
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FwdPlan:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    width: int          # W: keys per partition (a multiple of block_n)
    parts: int          # P = ceil(NK / W); 1: phase 1 writes the output itself (no phase 2)
    q_chunk: int        # query rows per phase-1/phase-2 launch pair (a multiple of block_m)
    p2_rows: int
    p2_kbt: int
    warp_specialize: bool = False   # phase 1 runs the flash core's warp-specialized loop
    gluon: bool = False             # phase 1 runs the Gluon Hopper core (kernels/_gluon_core.py)
    tf32_gluon: bool = False        # float32 phase 1 runs on wgmma (gluon_phase1.py)
    causal_rounds: int = 0          # causal on the core: the rounds its launches may run persistent (causal_rounds)

    @property
    def final(self) -> bool:
        """One partition: nothing to merge, phase 1 normalises and writes the output (one launch)."""
        return self.parts == 1


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@functools.lru_cache(maxsize=1024)   # a pure function of its arguments
def plan_forward(nq: int, nk: int, bh: int, d: int, dtype: torch.dtype, sms: int, config: str = "",
                 causal: bool = False, bias: bool = False, ws_capable: bool = False,
                 gluon_capable: bool = False, tf32_capable: bool = False, group: int = 1,
                 l2: int = DEFAULT_L2_BYTES) -> FwdPlan:
    """Tiles, partitions and q-chunks for one forward call: queries [bh, nq], keys [*, nk], head dim d, sms
    streaming multiprocessors, `group` query heads a kv head, an L2 of `l2` bytes; ``config`` a canonical override
    string (canonical_config); ws_capable: the call's tensors and device can take the flash core's warp-specialized
    loop (core.warp_specialize_ok with descriptors).
    Phase 1 warp-specializes only with the core's warp-specialized tiles unchanged (no override of them), 128-row
    blocks (N > SHORT_N) and where the core has it proven (core.ws_proven: non-causal, NK a multiple of BLOCK_N).
    gluon_capable: the call's tensors and device can take the Gluon Hopper core (gluon_core.available, with
    descriptors); phase 1 then runs it for 16-bit inputs without a bias, N > SHORT_N and at least its MIN_WORK,
    unless the caller overrides the forward tiles (its CTA is 64 query rows a consumer warpgroup, as many as
    gluon_core.consumers_for chooses, its key tile gluon_core.TILES'). tf32_capable: float32 inputs with tf32x3
    products on a GPU gluon_phase1 takes; phase 1 then runs it without a bias, at its HEAD_DIMS, from its MIN_WORK,
    unless the caller overrides the forward tiles. Causal on the Gluon core, the plan's causal_rounds are
    causal_rounds' for its q-chunks, and it takes one q-chunk wherever that chunk runs persistent."""
    bd = block_d(d)
    cls = dtype_class(dtype)
    overrides = parse_config(config)
    gluon = (gluon_capable and cls == "16" and not bias and nq > SHORT_N and "fwd" not in overrides
             and bh * nq * nk * d >= gluon_core.MIN_WORK)
    tf32_gluon = (tf32_capable and cls == "32" and not bias and d in gluon_phase1.HEAD_DIMS
                  and "fwd" not in overrides and bh * nq * nk * d >= gluon_phase1.MIN_WORK)
    ws_tiles = core_tiles(dtype, d, bias, True)
    ws = (ws_capable and cls == "16" and not bias and (cls, bd) in core.WS_TILES and nq > SHORT_N
          and core.ws_proven(causal, nk % ws_tiles[1] == 0))
    bm, bn, warps, stages = ws_tiles if ws else core_tiles(dtype, d, bias)
    if nq <= SHORT_N and bm > SHORT_BLOCK_M:
        bm = SHORT_BLOCK_M
    if bias and nq <= SHORT_N and "fwd" in SHORT_BIAS_TILES.get((cls, bd), {}):
        bm, bn, warps, stages = SHORT_BIAS_TILES[(cls, bd)]["fwd"]
    if bias and max(nq, nk) <= WINDOW_N and (cls, bd) in WINDOW_FWD_TILES:
        bm, bn, warps, stages = WINDOW_FWD_TILES[(cls, bd)]
    bm, bn, warps, stages = _tiles("fwd", (bm, bn, warps, stages), overrides)
    ws = ws and (bm, bn, warps, stages) == ws_tiles
    plan_given = overrides.get("plan", {})
    # causal on the core: the rounds one q-chunk of all rows may run persistent, and one q-chunk where it would
    # (CAUSAL_PERSISTENT_ROUNDS' note); a q-chunk short of the rows runs the plain grid
    rounds = causal_rounds(nq, nk, nq, bh, group, d, sms, l2) if gluon and causal else 0
    if tf32_gluon:
        bm, bn, warps, stages = gluon_phase1.BLOCK_M, gluon_phase1.TILES[d], gluon_phase1.NUM_WARPS, 1
    if gluon:
        (bn, stages), warps, ws = gluon_core.TILES[d], 4, False

        def busiest(consumers):
            rows = gluon_core.ROWS_PER_CONSUMER * consumers
            return _busiest_sm_work(nq, nk, bh, rows, bn, *_partitions(nq, nk, bh, rows, bn, d, dtype, sms,
                                                                      plan_given, False, causal, rounds),
                                    causal, sms)

        bm = gluon_core.ROWS_PER_CONSUMER * gluon_core.consumers_for(d, busiest)
    width, parts, qc = _partitions(nq, nk, bh, bm, bn, d, dtype, sms, plan_given, tf32_gluon, causal, rounds)
    rows = min(PHASE2_ROWS[cls][bd], bm)
    kbt = min(PHASE2_KBT[cls][bd], _next_pow2(parts))
    return FwdPlan(bm, bn, warps, stages, width, parts, qc, rows, kbt, ws, gluon, tf32_gluon,
                   rounds if qc >= nq else 0)


def _partitions(nq: int, nk: int, bh: int, bm: int, bn: int, d: int, dtype: torch.dtype, sms: int,
                plan_given: dict, one_cta_per_sm: bool = False, causal: bool = False,
                persistent_rounds: int = 0) -> tuple[int, int, int]:
    """(W, P, q_chunk) of a forward with bm-row blocks and bn-key tiles: config's plan overrides where given, else
    one partition below LONG_N keys and enough for TARGET_WAVES waves from it; q-chunks within the summary budget
    but of at least CHUNK_MIN_WAVES waves, fitted to whole waves (fit_chunk; one_cta_per_sm: phase 1's programs
    run one a SM, so a wave is exactly `sms` programs, the fit may go down to the whole waves below and one wave
    is enough, two when causal: ONE_CTA_PER_SM_MIN_WAVES); unless the caller gives q_chunk, one chunk of all rows
    where the core runs it persistent with `persistent_rounds` (gluon_core.persistent_default: a causal call on the
    core that one chunk lets run so)."""
    cls = dtype_class(dtype)
    if "partition_width" in plan_given:
        width = max(bn, -(-plan_given["partition_width"] // bn) * bn)
    elif nk < LONG_N:
        width = max(bn, -(-nk // bn) * bn)                 # one partition
    else:
        qblocks = -(-nq // bm)
        parts = -(-TARGET_WAVES * sms // max(1, qblocks * bh))
        parts = max(min(parts, MAX_P, -(-nk // max(MIN_W, bn))), MIN_P_LONG)
        width = max(bn, -(-(-(-nk // parts)) // bn) * bn)
    parts = max(1, -(-nk // width))
    all_rows = -(-max(nq, 1) // bm) * bm
    if parts == 1:
        qc = all_rows                                      # no summaries, nothing to chunk
    elif "q_chunk" in plan_given:
        qc = max(bm, -(-plan_given["q_chunk"] // bm) * bm)
    elif gluon_core.persistent_default(d, True, all_rows // bm * bh * parts, sms, persistent_rounds):
        qc = all_rows                                      # the core runs one chunk of all rows persistent
    else:
        out_bytes = bh * nq * d * dtype.itemsize
        row_bytes = bh * summary_row_bytes(parts, d, dtype)  # summary bytes per query row
        qc_budget = int(SUMMARY_BUDGET[cls] * out_bytes) // max(1, row_bytes)
        if one_cta_per_sm:
            min_waves = ONE_CTA_PER_SM_MIN_WAVES * (2 if causal else 1)
        else:
            min_waves = CHUNK_MIN_WAVES[cls]
        qc_parallel = bm * -(-min_waves * sms // max(1, bh * parts))
        qc = max(qc_budget, qc_parallel)
        qc = fit_chunk(-(-qc // bm), CHUNK_FIT_GROWTH[cls], -(-max(nq, 1) // bm), bh * parts, sms,
                       one_cta_per_sm) * bm
    return width, parts, min(qc, all_rows)


def _busiest_sm_work(nq: int, nk: int, bh: int, bm: int, bn: int, width: int, parts: int, q_chunk: int,
                     causal: bool, sms: int) -> float:
    """The busiest SM's work (query rows x keys) in phase 1 on the Gluon core, its q-chunks' launches one after
    the other: each chunk's items (bm rows of a head against one partition; causal, the keys up to the rows'
    horizon, at least one tile) in the plain grid's order (query blocks fastest, the longest first when causal),
    gluon_core.busiest_sm."""
    total = 0.0
    lo = np.arange(parts)[:, None] * width
    for q0 in range(0, nq, q_chunk):
        r0 = q0 + np.arange(-(-min(q_chunk, nq - q0) // bm))[None, :] * bm
        hi = np.minimum(lo + width, nk)
        if causal:
            hi = np.minimum(hi, r0 + bm + (nk - nq))[:, ::-1]
        keys = np.broadcast_to(np.maximum(hi - lo, bn), (parts, r0.shape[1]))
        total += gluon_core.busiest_sm(np.broadcast_to(bm * keys[:, None, :], (parts, bh, r0.shape[1])), sms)
    return total


def fit_chunk(blocks: int, growth: int, total: int, programs_per_block: int, sms: int,
              down_to_whole_waves: bool = False) -> int:
    """Query blocks per q-chunk: from `blocks` to growth x blocks, the count whose chunks (the last one holding the
    rest of `total`) take the fewest wave slots of `sms` programs, counting CHUNK_COST_WAVES per chunk; the
    smallest count on a tie. down_to_whole_waves: from the count that fills the whole waves below `blocks`' instead
    (where a program holds a SM alone, 17 blocks of 16 programs on 132 SMs take three waves, the third nearly empty;
    16 take two)."""
    def cost(per_chunk):
        full, rest = divmod(total, per_chunk)
        slots = full * -(-per_chunk * programs_per_block // sms) + -(-rest * programs_per_block // sms)
        return slots + CHUNK_COST_WAVES * (full + (rest > 0))

    if blocks >= total:
        return blocks
    low = max(1, blocks * programs_per_block // sms * sms // programs_per_block) if down_to_whole_waves else blocks
    return min(range(min(low, blocks), min(blocks * growth, total) + 1), key=lambda c: (cost(c), c))


@dataclass(frozen=True)
class BwdPlan:
    dq: tuple       # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    dkdv: tuple
    gluon: bool = False     # the Gluon backward (kernels/_gluon_bwd.py) instead of the dQ and dK/dV launches


@functools.lru_cache(maxsize=256)
def plan_backward(d: int, dtype: torch.dtype, config: str = "", nq: int | None = None, launches: int = 2,
                  bias: bool = False, causal: bool = False, work: int = 0, gluon_capable: bool = False) -> BwdPlan:
    """The dQ and dK/dV tiles: BWD_TABLE's, or SHORT_ONE_LAUNCH_BWD's for a one-launch backward (``launches``,
    from backward_launches) of at most SHORT_N query rows (``nq``), or SHORT_BIAS_TILES' for such a call with a
    bias where it has them; config's overrides on top. gluon_capable: the call's tensors and device can take the
    Gluon backward (_gluon_bwd.usable, no bias gradient, not packed); it runs then for 16-bit inputs without a bias
    in two launches' place from GLUON_BWD_MIN_WORK (``work`` = B * Hq * Nq * Nk; config's plan.gluon_bwd_min_work
    instead where given), unless config overrides the backward's tiles."""
    overrides = parse_config(config)
    gluon = (gluon_capable and dtype_class(dtype) == "16" and not bias and launches == 2 and d in gluon_bwd.HEAD_DIMS
             and "dq" not in overrides and "dkdv" not in overrides
             and work >= (overrides.get("plan", {}).get("gluon_bwd_min_work") or GLUON_BWD_MIN_WORK[(d, causal)]))
    key = (dtype_class(dtype), block_d(d))
    dq, dkdv = BWD_TABLE[key]
    short = nq is not None and nq <= SHORT_N
    if launches == 1 and short and key in SHORT_ONE_LAUNCH_BWD:
        dq, dkdv = SHORT_ONE_LAUNCH_BWD[key]
    if bias and short and "bwd" in SHORT_BIAS_TILES.get(key, {}):
        dq, dkdv = SHORT_BIAS_TILES[key]["bwd"]
    return BwdPlan(_tiles("dq", dq, overrides), _tiles("dkdv", dkdv, overrides), gluon)


def backward_launches(bh: int, nq: int, nk: int, dtype: torch.dtype, config: str = "") -> int:
    """2: the dQ launch (storing Delta) then the dK/dV launch; 1: both jobs in one launch, each dK/dV program
    recomputing Delta from O. One launch for 16-bit inputs up to ONE_LAUNCH_MAX_WORK (bh = batch x query heads,
    times Nq x Nk), where a call's time is mostly the host's: it saves a launch and the Delta buffer (host time),
    and the two jobs' programs share the GPU instead of running one short grid after the other. config's
    plan.bwd_launches overrides it."""
    given = parse_config(config).get("plan", {}).get("bwd_launches")
    if given is not None:
        return given
    return 1 if dtype_class(dtype) == "16" and bh * nq * nk <= ONE_LAUNCH_MAX_WORK else 2


def summary_row_bytes(parts: int, d: int, dtype: torch.dtype) -> int:
    """Summary bytes per query row (of one head) with `parts` partitions: fp32 (m, z) of every partition, and the
    part of the output of every partition but the first, whose part the output rows themselves hold until phase 2
    merges in place -- float32: the weighted sum s; 16-bit: the normalised s / z in the output's dtype (a 16-bit
    output cannot hold an unnormalised sum, and s / z cannot overflow)."""
    return 2 * parts * 4 + (parts - 1) * d * dtype.itemsize


def summary_numel(plan: FwdPlan, nq: int, bh: int, d: int, dtype: torch.dtype) -> int:
    """The size of the summary buffer of one q-chunk in fp32 elements (it is allocated as float32; 0 when phase 1
    writes the output itself): M and Z for P slots of rows [P, QB, BH, BLOCK_M], then S for the partitions 1..P-1
    (in the output's dtype)."""
    if plan.final:
        return 0
    rows = math.ceil(min(plan.q_chunk, nq) / plan.block_m) * bh * plan.block_m
    return rows * summary_row_bytes(plan.parts, d, dtype) // 4


def summary_bytes(plan: FwdPlan, nq: int, bh: int, d: int, dtype: torch.dtype) -> int:
    """Bytes of the summary buffer of one q-chunk (0 when phase 1 writes the output itself)."""
    return summary_numel(plan, nq, bh, d, dtype) * 4
