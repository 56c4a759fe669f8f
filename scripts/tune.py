"""One tuning entry for the four kernels, timed by the harness's own timer (attnbench.measure).

    PYTHONPATH=. python3 scripts/tune.py --kernel elsa [--sections fwd16,bwd16] [--budget-s 540] [--out DIR]
    PYTHONPATH=. python3 scripts/tune.py --kernel cron_root --sections cross
    python scripts/tune.py --kernel pasa --device cpu --write /tmp/pasa.json   # CPU: tiny sizes, meaningless times

Each section sweeps the candidates of one entry of a kernel's config table (tile sizes, warps, stages; PASA's main
loop; Cron Root's backward segmentation) at the kernel's typical sizes. Candidates reach the kernels the one way a
caller overrides tiles, their public ``config={part: {param: value}}`` argument (kernels._common.tile_config). A
candidate is first checked against the float64 reference (relative RMS error of the output, and of dQ, dK, dV for
backward sections, within a per-dtype tolerance); then it is timed against an SDPA baseline with
``attnbench.measure.measure_pair`` (interleaved pairs, L2 flushed, sampled until the 95 % CI of the median ratio is
within ±1 % or the budget ends). Four sections measure a crossover instead of a list of candidates: Cron Root's
"cross" (Cron Root against SDPA flash: from where the hybrid takes Cron Root; on a GPU in device time, the harness's
graph mode, unless --cross-timing eager: see Tuner.crossover), PASA's "shift" (PASA's K̃ made inline against its
pre-pass, pasa_attention(shift=...): up to which key length the main kernel shifts K itself), PASA's "core" (its
default call on the Gluon core against its Triton loop: from how much work the core runs; timed as "cross" is;
Tuner.pasa_core) and ELSA's and CQSA's "gluonbwd" (the backward on the sm_90 Gluon kernel against the kernel's Triton
one, fwd+bwd eager: from how much work the Gluon kernel runs; Tuner.gluon_bwd). CQSA's "plan" times its streaming
engine at forced plans for the rates its planner ranks plans with (Tuner.stream_plan). Otherwise a candidate's score
is the geometric mean of its median ratios over the section's lengths (and causal settings); the current entry is
candidate 0, and it is replaced only when the best candidate's score is lower by more than the combined CI
half-widths (a change must be real, not noise).

The chosen entries are written where the kernel reads them, keyed like the kernel's own tables (dtype class and
head-dim tile width BLOCK_D, the head dim padded to a power of two):
- elsa:      kernels/elsa/tuning.json  ("fwd": {"16,64": [bm, bn, warps, stages]}, "bwd": {"16,64": {dq, dkdv}};
             kernels/elsa/config.py's FWD_TABLE / BWD_TABLE; a 16-bit "fwd" entry also replaces the flash
             core's plain tiles for phase 1 without a bias: config.FWD_TUNED; the short calls' "window_fwd" and
             "short_bwd", sections window16 and short16, timed at Swin-T's windows with their bias and at ViT-T's
             layer: config.WINDOW_FWD_TILES / SHORT_ONE_LAUNCH_BWD; "gluon_bwd_min_work": {"128,0": work}, section
             gluonbwd: config.GLUON_BWD_MIN_WORK, keyed by head dim and causal 0 / 1)
- pasa:      kernels/pasa/tuning.json  ("variant": {"default": "ref"}, "pasa"/"fa16": {"64": [bm, bn, w, s]};
             kernels/pasa/attention.py's DEFAULT_CONFIGS; "shift_inline_max_keys": {"64": 512}, section "shift":
             up to how many keys the main kernel shifts K itself rather than after a pre-pass, kernels/pasa/ops.py;
             "core_min_work": {"64,1": work}, section "core": from how much work B·Hq·Nq·Nk·D the default call
             runs on the Gluon core, ops.CORE_MIN_WORK, keyed by head dim and causal 0 / 1)
- cqsa:      kernels/cqsa/tuning.json  ("fwd"/"dq"/"dkdv": {"16,128": [bm, bn, warps, stages]};
             kernels/cqsa/kernel.py's built-in GPU tiles; "gluon_bwd_min_work": {"128,0": work}, section gluonbwd:
             attention.GLUON_BWD_MIN_WORK, keyed by head dim and causal 0 / 1; "plan_rates": {"fwd": [FLOP/s, host
             seconds a task, host-merge bytes/s]}, section plan: the streaming planner's rates, stream.PLAN_RATES)
- cron_root: kernels/cron_root/tuning.json, the entry of this GPU's name: the hybrid's crossovers
             (crossover_fwd / crossover_fwdbwd / crossover, section "cross") and "configs" per head-dim bucket
             (kernels/cron_root/configs.py merges them over its GPU_CONFIGS).
With --device cpu nothing is written unless --write names a file (the kernel's own file holds GPU choices).
--out DIR keeps every measurement (tune_<kernel>.json, rewritten after each one, so a cut-off run keeps them).
Sections are timed one after the other; --budget-s stops before a candidate that would overrun (on a machine
with a time limit per command, choose --sections to fit). --dims 128 sweeps only the head dims named, in every
section that sweeps head dims (e.g. `--sections gluonbwd --dims 128` after a change to one head dim's kernel).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before anything imports triton
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from attnbench.arguments import EXIT_NO_GPU, Parser, head_dims, output_dir, output_file, positive_float  # noqa: E402
from attnbench.backends import DTYPES, get_backend, make_attention_workload  # noqa: E402
from attnbench.matrix import TIMING_DEFAULTS  # noqa: E402
from attnbench.measure import measure_pair, median_ci_half_width  # noqa: E402
from attnbench.workload import Workload  # noqa: E402
from kernels._common import block_d  # noqa: E402
from kernels._tuning import dim_key, write_configs, write_json_atomic  # noqa: E402
from kernels.reference import reference_attention  # noqa: E402

GPU_TIMING = dict(TIMING_DEFAULTS, ci_half_width=0.01, max_ms=1500.0)
CPU_TIMING = dict(TIMING_DEFAULTS, warmup_ms=0.0, rep_ms=1.0, max_ms=1.0, min_reps=6, max_reps=6, flush_l2=False)
TOLERANCE = {"float16": 1e-2, "bfloat16": 5e-2, "float32": 1e-4}   # relative RMS error against float64: a wrong tile is O(1)
CPU_CANDIDATES = 2          # on the CPU: the current entry and one more per section (the control flow, not speed)


@dataclass
class Sweep:
    """One config entry and its candidates. `values` are JSON-able (what the tuning file stores)."""
    section: str
    kernel: str                 # the backend timed
    table: str                  # where the chosen value is written
    key: str
    dtype: str
    mode: str                   # fwd | bwd | fwdbwd
    head_dims: tuple            # each candidate is timed at every head dim × length × causal setting
    heads: int
    ns: tuple
    values: list                # candidate 0 is the current entry
    options: Callable[[object, int], dict]      # kernel keyword options of a candidate at a head dim
    causal: tuple = (False,)
    baseline: str = "flash"
    baseline_options: dict = field(default_factory=dict)     # the baseline backend's keyword options
    batch: int = 1
    bias: bool = False          # an additive bias [1, H, N, N] taking a gradient (Swin's relative-position bias)


@dataclass
class Context:
    device: str
    chosen: dict = field(default_factory=dict)      # (table, key) -> value chosen by an earlier section
    head_dims: tuple | None = None                  # --dims: the head dims a run sweeps (None: each section's own)

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"

    def sizes(self, *gpu_ns: int) -> tuple:
        """The lengths a section times: the GPU's, or one tiny length on the CPU."""
        return (64,) if self.cpu else gpu_ns

    def dims(self, items: list, head_dim=lambda item: item) -> list:
        """The head dims (or pairs holding one, which head_dim picks) a section sweeps: those of --dims where it is
        given, then all on the GPU, the first on the CPU."""
        if self.head_dims is not None:
            items = [x for x in items if head_dim(x) in self.head_dims]
        return items[:1] if self.cpu else items

    def heads(self, gpu_heads: int) -> int:
        return 1 if self.cpu else gpu_heads

    def limit(self, values: list) -> list:
        return values[:CPU_CANDIDATES] if self.cpu else values

    def baseline(self, gpu_baseline: str) -> str:
        return "math" if self.cpu else gpu_baseline


def _first(current, candidates: list) -> list:
    """The current entry first, then the other candidates (as lists, so they compare with stored JSON)."""
    current = _jsonable(current)
    rest = [_jsonable(c) for c in candidates if _jsonable(c) != current]
    return [current] + rest


def _jsonable(value):
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


# --- ELSA: phase-1 tiles (16-bit, fp32) and the backward's dK/dV and dQ tiles ----------------------------------

ELSA_FWD = {
    ("16", 64): [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (128, 128, 8, 2), (64, 64, 4, 3)],
    ("16", 128): [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 4, 2)],
    ("32", 64): [(64, 32, 4, 2), (64, 64, 4, 2), (64, 32, 4, 3), (128, 32, 8, 2), (32, 64, 4, 2), (64, 64, 8, 3)],
    ("32", 128): [(64, 32, 4, 2), (64, 32, 8, 2), (32, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (32, 64, 4, 3)],
}
ELSA_BWD = {  # (dtype class, D): (dK/dV candidates, dQ candidates)
    ("16", 64): ([(32, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (32, 64, 4, 3), (64, 128, 8, 3)],
                 [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2)]),
    ("16", 128): ([(32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 8, 3), (32, 128, 4, 2)],
                  [(128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3)]),
    ("32", 64): ([(32, 64, 4, 2), (64, 64, 8, 2), (32, 32, 4, 2), (64, 32, 4, 2)],
                 [(64, 32, 4, 2), (64, 64, 8, 2), (32, 32, 4, 2), (128, 32, 8, 2)]),
    # every fp32 D=128 backward config spills; these spill least
    ("32", 128): ([(32, 32, 4, 1), (32, 32, 4, 2), (32, 128, 8, 1), (32, 128, 8, 2)],
                  [(32, 32, 4, 1), (32, 32, 4, 2), (32, 128, 8, 1), (64, 32, 4, 1)]),
}
# The short calls' tables (kernels/elsa/config.py: WINDOW_FWD_TILES, SHORT_ONE_LAUNCH_BWD), timed where they apply:
# Swin-T's first-stage windows (512 windows of 3 heads, 49 tokens, D=32, a relative-position bias taking a gradient)
# and ViT-T's layer (batch 8, 3 heads, D=64, 197 and 577 tokens), against SDPA as those models call it
ELSA_WINDOW_FWD = [(32, 32, 1, 1), (16, 32, 1, 1), (16, 64, 1, 1), (32, 64, 1, 1), (64, 64, 4, 3)]
ELSA_SHORT_BWD = [((64, 32, 4, 1), (32, 64, 4, 1)), ((64, 64, 4, 3), (32, 128, 4, 3)), ((32, 32, 2, 1), (32, 32, 2, 1)),
                  ((64, 32, 2, 1), (32, 64, 2, 1)), ((64, 64, 4, 1), (64, 64, 4, 1))]
ELSA_SHORT_SHAPES = {("16", 32): dict(batch=512, ns=(49,), bias=True, baseline="efficient"),
                     ("16", 64): dict(batch=8, ns=(197, 577), bias=False, baseline="flash")}
ELSA_SECTIONS = {"fwd16": [("16", 64), ("16", 128)], "fwd32": [("32", 64), ("32", 128)],
                 "window16": [("16", 32)], "short16": [("16", 32), ("16", 64)],
                 "bwd16": [("16", 64), ("16", 128)], "bwd32": [("32", 64)], "bwd32d128": [("32", 128)]}
ELSA_DEFAULT = "fwd16,fwd32,bwd16,bwd32"
# The Gluon backward's crossover (section gluonbwd of ELSA and CQSA, Tuner.gluon_bwd): B=1, H=8, at its head dims
# (kernels/_gluon_bwd.py's HEAD_DIMS), up to 16K; ELSA's from past its one-launch backward's work
# (config.ONE_LAUNCH_MAX_WORK: 2048 tokens), CQSA's from 1K (its crossover was 2K-4K on the H200)
GLUON_BWD_DIMS = [64, 128]
GLUON_BWD_NS = {"elsa": (3072, 4096, 6144, 8192, 12288, 16384),
                "cqsa": (1024, 1536, 2048, 3072, 4096, 6144, 8192, 16384)}


def gluon_bwd_paths(kernel: str, d: int) -> tuple[dict, dict, dict]:
    """The gluonbwd section's two backwards of `kernel` at head dim d as its kernel options (the Gluon one from any
    work, the kernel's Triton one), and the thresholds the section tunes. ELSA's: both two launches, the Triton
    backward kept by a dK/dV override (the table's own tiles); CQSA's: by the call's plan alone (its tiles stay)."""
    if kernel == "elsa":
        from kernels.elsa import config

        triton_bwd = {"config": {"plan": {"bwd_launches": 2},
                                 "dkdv": _tiles(config.BWD_TABLE[("16", block_d(d))][1])}}
        return ({"config": {"plan": {"bwd_launches": 2, "gluon_bwd_min_work": 1}}}, triton_bwd,
                config.GLUON_BWD_MIN_WORK)
    from kernels._common import MAX_WORK
    from kernels.cqsa import attention

    return ({"config": {"plan": {"gluon_bwd_min_work": 1}}},
            {"config": {"plan": {"gluon_bwd_min_work": MAX_WORK}}}, attention.GLUON_BWD_MIN_WORK)


def elsa_sweeps(ctx: Context, section: str):
    import torch

    from kernels.elsa import config

    for cls, d in ctx.dims(ELSA_SECTIONS[section], lambda pair: pair[1]):
        dtype = "float32" if cls == "32" else "float16"
        baseline = ctx.baseline("efficient" if cls == "32" else "flash")
        key = dim_key(cls, block_d(d))
        if section in ("window16", "short16"):
            shape = ELSA_SHORT_SHAPES[(cls, d)]
            short = dict(baseline=ctx.baseline(shape["baseline"]), batch=1 if ctx.cpu else shape["batch"],
                         bias=shape["bias"])
            heads, ns = ctx.heads(3), ctx.sizes(*shape["ns"])
            if section == "window16":
                yield Sweep(section, "elsa", "window_fwd", key, dtype, "fwd", (d,), heads, ns,
                            ctx.limit(_first(config.WINDOW_FWD_TILES[(cls, block_d(d))], ELSA_WINDOW_FWD)),
                            lambda c, _d: {"config": {"fwd": _tiles(c)}}, **short)
            else:
                current = config.SHORT_ONE_LAUNCH_BWD[(cls, block_d(d))]
                yield Sweep(section, "elsa", "short_bwd", key, dtype, "bwd", (d,), heads, ns,
                            ctx.limit([{"dq": dq, "dkdv": dkdv} for dq, dkdv in _first(current, ELSA_SHORT_BWD)]),
                            _elsa_bwd_options, **short)
            continue
        if section.startswith("fwd"):
            ns = ctx.sizes(4096) if cls == "32" else ctx.sizes(4096, 16384)
            yield Sweep(section, "elsa", "fwd", key, dtype, "fwd", (d,), ctx.heads(8), ns,
                        # the tiles that run today first: for 16-bit, the flash core's (or the tuned entry)
                        ctx.limit(_first(config.core_tiles(getattr(torch, dtype), d), ELSA_FWD[(cls, d)])),
                        lambda c, _d: {"config": {"fwd": _tiles(c)}},
                        baseline=baseline)
            continue
        ns = ctx.sizes(8192 if cls == "16" else 4096)
        dq0, dkdv0 = (list(c) for c in config.BWD_TABLE[(cls, block_d(d))])
        dkdv_cands, dq_cands = ELSA_BWD[(cls, d)]
        # dK/dV first (with the current dQ tiles), then dQ with the dK/dV tiles just chosen
        yield Sweep(section + ":dkdv", "elsa", "bwd", key, dtype, "bwd", (d,), ctx.heads(8), ns,
                    ctx.limit([{"dq": dq0, "dkdv": c} for c in _first(dkdv0, dkdv_cands)]), _elsa_bwd_options,
                    baseline=baseline)
        dkdv = ctx.chosen.get(("bwd", key), {"dkdv": dkdv0})["dkdv"]
        yield Sweep(section + ":dq", "elsa", "bwd", key, dtype, "bwd", (d,), ctx.heads(8), ns,
                    ctx.limit([{"dq": c, "dkdv": dkdv} for c in _first(dq0, dq_cands)]), _elsa_bwd_options,
                    baseline=baseline)


def _elsa_bwd_options(value: dict, _d: int) -> dict:
    return {"config": {"dq": _tiles(value["dq"]), "dkdv": _tiles(value["dkdv"])}}


# --- PASA: the main loop, then the tiles per head dim (fa16 keeps PASA's tiling) -----------------------------

PASA_TILES = {
    64: [(64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 4)],
    128: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2)],
}
PASA_SHIFT_NS = (128, 197, 256, 384, 512, 768, 1024)   # key (= query) lengths of the K̃ path's crossover
PASA_SHIFT_HEADS = (1, 8, 96)                              # B·H (B = 1): launch-bound to busy
# PASA's Gluon core against its Triton loop: the work levels (log2 of B·Hq·Nq·Nk·D) around ops.CORE_MIN_WORK's
# built-in thresholds, and the (head dim, causal) keys tuned; D = 64 without a mask keeps 2^34 for accuracy, not speed
# (its window on the core is the less accurate there: kernels/pasa/ops.py)
PASA_CORE_LEVELS = (30, 31, 32, 33, 34)
PASA_CORE_KEYS = ((64, True), (128, False), (128, True))
PASA_DEFAULT = "variant,tiles,shift"


TILE_PARAMS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")   # ELSA's and PASA's tile tuples, in this order


def _tiles(c) -> dict:
    """A (BLOCK_M, BLOCK_N, num_warps, num_stages) candidate as one part of a kernel's config= override."""
    return dict(zip(TILE_PARAMS, c))


def _pasa_current(pasa, d: int) -> tuple:
    fwd = pasa.DEFAULT_CONFIGS["pasa"][block_d(d)]["fwd"]
    return tuple(fwd[p] for p in TILE_PARAMS)


def pasa_sweeps(ctx: Context, section: str):
    from kernels.pasa import attention as pasa

    ns = ctx.sizes(8192, 16384)
    if section == "variant":   # one loop for both head dims, each at its current tiles
        yield Sweep("variant", "pasa", "variant", "default", "float16", "fwd", tuple(ctx.dims([64, 128])),
                    ctx.heads(8), ns, _first(pasa.DEFAULT_VARIANT, list(pasa.VARIANTS)),
                    lambda v, _d: {"variant": v},
                    causal=(False, True), baseline=ctx.baseline("flash"))
        return
    variant = ctx.chosen.get(("variant", "default"), pasa.DEFAULT_VARIANT)
    for d in ctx.dims([64, 128]):
        yield Sweep("tiles", "pasa", "pasa", str(d), "float16", "fwd", (d,), ctx.heads(8), ns,
                    ctx.limit(_first(_pasa_current(pasa, d), PASA_TILES[d])),
                    lambda c, _d: {"config": {"fwd": _tiles(c)}, "variant": variant}, causal=(False, True),
                    baseline=ctx.baseline("flash"))


# --- Stream-CQSA (resident): the forward, dQ and dK/dV tiles --------------------------------------------------

CQSA_TILES = {
    ("fwd", 128): [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
    ("fwd", 64): [(128, 64, 4, 2), (128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 2)],
    ("dq", 128): [(64, 64, 8, 2), (64, 64, 8, 3), (64, 128, 8, 2)],
    ("dq", 64): [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (64, 128, 8, 2)],
    ("dkdv", 128): [(32, 64, 8, 2), (64, 64, 8, 2), (64, 64, 8, 3)],
    ("dkdv", 64): [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (64, 128, 8, 2)],
}
CQSA_DEFAULT = "fwd,dq,dkdv"
STREAM_PLAN_NS = (16384, 65536)     # section plan: the host's time per task at the shorter, the rates at the longer
STREAM_PLAN_DEEP = 4                # ... and the depth it times for the host's time (2,401 tasks)


def cqsa_sweeps(ctx: Context, section: str):
    from kernels.cqsa import kernel as cqsa_kernel

    part = cqsa_kernel.PARTS.index(section)
    for d in ctx.dims([64, 128]):
        tiles = cqsa_kernel.default_tiles(d, torch.float16, "cuda")      # the GPU entry, also on a CPU
        current = tiles[4 * part:4 * part + 4]
        yield Sweep(section, "cqsa", section, dim_key("16", block_d(d)), "float16", "fwd" if section == "fwd" else "bwd",
                    (d,), ctx.heads(8), ctx.sizes(16384), ctx.limit(_first(current, CQSA_TILES[(section, d)])),
                    lambda c, _d, section=section: {"config": {section: _tiles(c)}}, baseline=ctx.baseline("flash"))


# --- Cron Root: tiles per head-dim bucket (fwd and the three backward kernels), the hybrid's crossover -----------

def _cr_cfg(kind, c) -> dict:
    if kind in ("fwd", "dq"):
        return dict(BLOCK_M=c[0], BLOCK_N=c[1], BLOCK_S=c[2], num_warps=c[3], num_stages=c[4])
    if kind == "glob":
        return dict(BLOCK_G=c[0], BLOCK_Q=c[1], num_warps=c[2], num_stages=c[3])
    return dict(BLOCK_N=c[0], BLOCK_Q=c[1], num_warps=c[2], num_stages=c[3])


CRON_ROOT_TILES = {
    64: dict(
        fwd=[(128, 64, 64, 4, 3), (128, 64, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3),
             (64, 64, 64, 4, 3), (128, 64, 32, 4, 3), (128, 32, 32, 4, 4), (128, 64, 64, 4, 2)],
        dq=[(64, 64, 64, 4, 2), (64, 64, 64, 4, 3), (128, 64, 64, 8, 2), (64, 32, 32, 4, 2), (128, 32, 32, 8, 2)],
        glob=[(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2)],
        loc=[(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (64, 128, 8, 2), (32, 64, 4, 2), (128, 32, 8, 2)],
    ),
    128: dict(
        fwd=[(128, 64, 64, 8, 2), (128, 64, 64, 8, 3), (128, 32, 32, 4, 3), (64, 64, 64, 4, 3), (64, 64, 32, 4, 2),
             (128, 64, 32, 8, 3)],
        dq=[(64, 64, 32, 4, 2), (64, 64, 64, 4, 2), (64, 32, 32, 4, 2), (128, 64, 64, 8, 2), (64, 64, 64, 8, 2)],
        glob=[(64, 64, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2)],
        loc=[(64, 64, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2)],
    ),
}
CRON_ROOT_SEGMENTS = [1, 2, 4, 8, 16]     # the global-slot backward's programs per SM
CRON_ROOT_CROSS_NS = (256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 4096, 6144, 8192, 12288, 16384)
CRON_ROOT_DEFAULT = "cross,fwd,dq,glob,loc,seg"


def _cr_current(d: int) -> dict:
    """Cron Root's 16-bit GPU tiles for head dim d as this GPU runs them: the built-in ones with this GPU's
    tuning.json entry over them (configs.resolve without a CUDA device: the same merge, also on a CPU)."""
    from kernels.cron_root import configs, tuning

    cfg = {kind: dict(v) for kind, v in configs.default_gpu_configs(d, torch.float16, "tf32x3").items()}
    for kind, v in tuning.tuned_configs(_gpu_name(), configs.bucket(d)).items():
        cfg.setdefault(kind, {}).update(v)
    return cfg


def cron_root_sweeps(ctx: Context, section: str):
    from kernels.cron_root import configs

    for d, heads in ctx.dims([(64, 8), (128, 16)], lambda pair: pair[0]):
        bucket = configs.bucket(d)
        current = _cr_current(d)
        ns = ctx.sizes(65536)
        if section == "seg":     # on the glob tiles chosen by this run's glob section, if it ran
            now = current["glob"].get("programs_per_sm")
            tiles = ctx.chosen.get(("configs", f"{bucket}:glob"), {})
            values = [{"programs_per_sm": s} for s in ([now] if now else []) + [s for s in CRON_ROOT_SEGMENTS if s != now]]
            yield Sweep("seg", "cron_root", "configs", f"{bucket}:glob", "float16", "bwd", (d,), ctx.heads(heads), ns,
                        ctx.limit(values), lambda v, _d, tiles=tiles: {"config": {"glob": {**tiles, **v}}},
                        causal=(True,), baseline=ctx.baseline("flash"))
            continue
        kind = section
        tiles = [_cr_cfg(kind, c) for c in CRON_ROOT_TILES[bucket][kind]]
        cur = {k: v for k, v in current[kind].items() if k.startswith("BLOCK_") or k in ("num_warps", "num_stages")}
        mode = "fwd" if kind == "fwd" else "bwd"
        # a fwd candidate also replaces fwd_small (the tiles for grids too small to fill the GPU), as the stored entry does
        opts = (lambda v, _d: {"config": {"fwd": dict(v), "fwd_small": dict(v)}}) if kind == "fwd" else \
            (lambda v, _d, kind=kind: {"config": {kind: dict(v)}})
        yield Sweep(kind, "cron_root", "configs", f"{bucket}:{kind}", "float16", mode, (d,), ctx.heads(heads), ns,
                    ctx.limit(_first(cur, tiles)), opts, causal=(True,), baseline=ctx.baseline("flash"))


SECTIONS = {
    "elsa": (elsa_sweeps, [*ELSA_SECTIONS, "gluonbwd"], ELSA_DEFAULT),
    "pasa": (pasa_sweeps, ["variant", "tiles", "shift", "core"], PASA_DEFAULT),
    "cqsa": (cqsa_sweeps, ["fwd", "dq", "dkdv", "gluonbwd", "plan"], CQSA_DEFAULT),
    "cron_root": (cron_root_sweeps, ["cross", "fwd", "dq", "glob", "loc", "seg"], CRON_ROOT_DEFAULT),
}


# --- measuring ---------------------------------------------------------------------------------------------------

def _rel_rmse(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def accuracy(s: Sweep, options: dict, d: int, device: str, n: int) -> float:
    """Relative RMS error against the float64 reference (output, and dQ/dK/dV for a backward): the worst one."""
    backend = get_backend(s.kernel)
    gen = torch.Generator(device=device).manual_seed(7)
    heads = 2 if device == "cuda" else 1
    shape = (1, heads, n, d)
    q, k, v, d_out = (torch.randn(shape, generator=gen, device=device, dtype=DTYPES[s.dtype]) for _ in range(4))
    inputs = [q, k, v]
    if s.bias:
        inputs.append(torch.randn((1, heads, n, n), generator=gen, device=device, dtype=DTYPES[s.dtype]))
    kw = {**backend.options, **options}
    ref_fn = backend.reference or reference_attention
    ref_kw = dict(backend.options) if backend.reference else {}
    causal = s.causal[0]

    def call(fn, tensors, **extra):
        bias = {"attn_bias": tensors[3]} if s.bias else {}
        return fn(*tensors[:3], causal=causal, scale=None, **bias, **extra)

    if s.mode == "fwd":
        with torch.no_grad():
            return _rel_rmse(call(backend.fn, inputs, **kw), call(ref_fn, inputs, **ref_kw))
    inputs = [t.requires_grad_() for t in inputs]
    out = call(backend.fn, inputs, **kw)
    grads = torch.autograd.grad(out, inputs, d_out)
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    ref = call(ref_fn, inputs64, **ref_kw)
    ref_grads = torch.autograd.grad(ref, inputs64, d_out.double())
    return max([_rel_rmse(out, ref)] + [_rel_rmse(g, r) for g, r in zip(grads, ref_grads)])


def time_ratio(s: Sweep, options: dict, d: int, n: int, causal: bool, device: str, timing: dict,
               timing_mode: str = "eager") -> dict:
    """One (head dim, length, causal) measurement of a candidate: kernel ⇄ baseline, interleaved, by the harness's
    timer (timing_mode "graph": CUDA-graph replays, device time only)."""
    common = dict(batch=s.batch, heads=s.heads, n=n, head_dim=d, dtype=s.dtype, mode=s.mode, causal=causal,
                  device=device, bias=s.bias)
    kernel = make_attention_workload(get_backend(s.kernel), options=options, **common)
    baseline = make_attention_workload(get_backend(s.baseline), options=s.baseline_options, **common)
    try:
        res = measure_pair(kernel, baseline, kernel_name=s.kernel, baseline_name=s.baseline, timing=timing,
                           device=device, mode=timing_mode)
    finally:
        for wl in (kernel, baseline):
            wl.release()
    row = {"head_dim": d, "n": n, "causal": causal}
    for side in (res.kernel, res.baseline):
        if side.status != "ok":
            return {**row, "error": f"{side.backend} {side.status}: {side.message}"}
    ratios = sorted(res.ratios)
    half = median_ci_half_width(ratios)
    return {**row, "ratio": ratios[len(ratios) // 2], "ci_half_width": half if math.isfinite(half) else math.inf,
            "reps": res.reps, "stop": res.stop, "kernel_ms": res.kernel.summary()["ms_median"],
            "baseline_ms": res.baseline.summary()["ms_median"]}


def choose(results: list[dict]) -> tuple[dict, str]:
    """The winning candidate and why: the best score replaces the current entry (results[0]) only when it is lower
    by more than the two scores' combined CI half-widths."""
    ok = [r for r in results if r.get("score") is not None]
    if not ok:
        return results[0], "no candidate measured: the current entry stays"
    best = min(ok, key=lambda r: r["score"])
    current = results[0]
    if current.get("score") is None:
        return best, "the current entry failed: best measured candidate"
    if best is current:
        return current, "the current entry is the fastest"
    gain = 1 - best["score"] / current["score"]
    halves = (best["ci_half_width"], current["ci_half_width"])
    noise = math.hypot(*halves) if None not in halves else math.inf
    if gain > noise:
        return best, f"{gain:.1%} faster than the current entry (noise ±{_pct(noise)})"
    return current, f"best candidate only {gain:.1%} faster, within the noise (±{_pct(noise)}): the current entry stays"


def first_win(points: list[dict]) -> int | None:
    """The first length N from which the kernel's ratio is at most 1 at every larger measured N (points in
    increasing N; failed points skipped); None when it loses at the longest."""
    cross = None
    for p in reversed([p for p in points if "ratio" in p]):
        if p["ratio"] > 1.0:
            break
        cross = p["n"]
    return cross


def pasa_core_paths() -> tuple[dict, dict]:
    """The core section's two paths as PASA's kernel options: the default call on the Gluon core from any work (its
    plan), and the same call on its Triton loop (naming the default loop keeps the Triton kernel)."""
    from kernels.pasa import attention as pasa

    return {"config": {"plan": {"core_min_work": 1}}}, {"variant": pasa.DEFAULT_VARIANT}


def pasa_core_shapes(d: int, log2_work: int) -> list[tuple[int, int]]:
    """(heads, N) at B = 1 with heads·N²·d = 2^log2_work, N a power of two from 512 to 16K and 1-32 heads: the
    shape of the most heads and that of the fewest (a full grid and a thin one; one where they coincide)."""
    rows = 2 ** log2_work // d
    shapes = [(rows // (n * n), n) for n in (2 ** k for k in range(9, 15))
              if rows % (n * n) == 0 and 1 <= rows // (n * n) <= 32]
    return sorted({shapes[0], shapes[-1]}, reverse=True) if shapes else []


def first_level_won(points: list[dict]) -> int | None:
    """The smallest work level (points' "log2_work") from which the ratio is at most 1 at every measured shape of
    it and of every larger level (first_win over each level's worst ratio; failed points skipped); None when it
    loses at the largest."""
    worst: dict = {}
    for p in points:
        if "ratio" in p:
            worst[p["log2_work"]] = max(worst.get(p["log2_work"], 0.0), p["ratio"])
    return first_win([{"n": level, "ratio": r} for level, r in sorted(worst.items())])


def _pct(x) -> str:
    return "?" if x is None or not math.isfinite(x) else f"{x:.1%}"


class Tuner:
    def __init__(self, kernel: str, device: str, budget_s: float, out_dir: Path | None, log=print,
                 cross_timing: str | None = None, head_dims: tuple | None = None):
        self.kernel, self.device, self.log = kernel, device, log
        # Cron Root's crossover: device time on a GPU (see crossover), the only timing the CPU has otherwise
        self.cross_timing = cross_timing or ("graph" if device == "cuda" else "eager")
        self.ctx = Context(device, head_dims=head_dims)
        self.deadline = time.monotonic() + budget_s
        self.timing = CPU_TIMING if device == "cpu" else GPU_TIMING
        self.rows: list[dict] = []
        self.decisions: list[dict] = []
        self.out_dir = out_dir
        self.slowest_s = 0.0

    def _save(self):
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"tune_{self.kernel}.json"
        # rewritten after every row: whole or not at all, so a crash keeps the rows before it
        write_json_atomic(path, {"kernel": self.kernel, "device": self.device, "measured": measured_on(self.device),
                                 "rows": self.rows, "decisions": self.decisions}, indent=1, default=str)

    def _time_left(self) -> bool:
        return time.monotonic() + 1.5 * self.slowest_s < self.deadline

    def run_sweep(self, s: Sweep) -> dict | None:
        results = []
        check_n = s.ns[0] if self.device == "cpu" else 1024
        for value in s.values:
            if not self._time_left():
                self.log(f"{s.section} {s.key}: budget reached before {value}")
                break
            t0 = time.monotonic()
            row = {"section": s.section, "table": s.table, "key": s.key, "value": value, "dtype": s.dtype,
                   "mode": s.mode, "head_dims": list(s.head_dims), "heads": s.heads, "baseline": s.baseline}
            try:
                row["rel_rmse"] = max(accuracy(s, s.options(value, d), d, self.device, check_n) for d in s.head_dims)
                if not row["rel_rmse"] <= TOLERANCE[s.dtype]:
                    row["error"] = f"rel RMSE {row['rel_rmse']:.2e} > {TOLERANCE[s.dtype]:.0e}"
                else:
                    row["points"] = [time_ratio(s, s.options(value, d), d, n, causal, self.device, self.timing)
                                     for d in s.head_dims for n in s.ns for causal in s.causal]
                    bad = [p["error"] for p in row["points"] if "error" in p]
                    if bad:
                        row["error"] = bad[0]
                    else:
                        logs = [math.log(p["ratio"]) for p in row["points"]]
                        row["score"] = math.exp(sum(logs) / len(logs))
                        half = math.sqrt(sum(p["ci_half_width"] ** 2 for p in row["points"]) / len(row["points"]))
                        row["ci_half_width"] = half if math.isfinite(half) else None   # None: too few samples
            except Exception as exc:   # a config that does not compile (shared memory, registers) is a result
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            self.slowest_s = max(self.slowest_s, time.monotonic() - t0)
            results.append(row)
            self.rows.append(row)
            self._save()
            self.log(f"{s.section} {s.key} {value}: " + (f"x{row['score']:.3f} ±{_pct(row['ci_half_width'])} vs "
                                                         f"{s.baseline}" if "score" in row else row["error"]))
        if not results:
            return None
        winner, why = choose(results)
        decision = {"section": s.section, "table": s.table, "key": s.key, "value": winner["value"],
                    "current": s.values[0], "changed": winner["value"] != s.values[0], "score": winner.get("score"),
                    "why": why, "complete": len(results) == len(s.values)}
        self.decisions.append(decision)
        self.ctx.chosen[(s.table, s.key)] = winner["value"]
        self._save()
        self.log(f"== {s.section} {s.key}: {winner['value']} ({why})")
        return decision

    def run(self, sections: list[str]) -> list[dict]:
        sweeps, _, _ = SECTIONS[self.kernel]
        for section in sections:
            if self.kernel == "cron_root" and section == "cross":
                self.crossover()
                continue
            if self.kernel == "pasa" and section == "shift":
                self.pasa_shift()
                continue
            if self.kernel == "pasa" and section == "core":
                self.pasa_core()
                continue
            if section == "gluonbwd":
                self.gluon_bwd()
                continue
            if self.kernel == "cqsa" and section == "plan":
                self.stream_plan()
                continue
            for s in sweeps(self.ctx, section):
                self.run_sweep(s)
        return self.decisions

    def timed_point(self, s: Sweep, options: dict, d: int, n: int, causal: bool, label: str, timing_mode: str = "eager",
                    **row) -> dict | None:
        """One paired measurement of a crossover section (time_ratio), kept in the log with `row`'s fields; a
        failure is a point with its error; None when the budget ends first."""
        if not self._time_left():
            self.log(f"{label}: budget reached")
            return None
        t0 = time.monotonic()
        try:
            p = time_ratio(s, options, d, n, causal, self.device, self.timing, timing_mode)
        except Exception as exc:
            p = {"head_dim": d, "n": n, "error": f"{type(exc).__name__}: {exc}"}
        self.slowest_s = max(self.slowest_s, time.monotonic() - t0)
        p.update(row)
        self.rows.append({"section": s.section, **p})
        self._save()
        self.log(f"{label}: " + (f"x{p['ratio']:.3f} vs {s.baseline} {s.baseline_options or ''}".rstrip()
                                 if "ratio" in p else p["error"]))
        return p

    def paths_off_tolerance(self, s: Sweep, paths: dict, d: int, n: int) -> list[str]:
        """A crossover section's paths ({name: kernel options}) checked against float64 at length n (accuracy); their
        errors are logged as a row of the section, and what passes TOLERANCE is returned as a reason each."""
        errors = {name: accuracy(s, opts, d, self.device, n) for name, opts in paths.items()}
        self.rows.append({"section": s.section, "key": s.key, "dtype": s.dtype, "rel_rmse": errors})
        return [f"{name} rel RMSE {e:.2e}" for name, e in errors.items() if not e <= TOLERANCE[s.dtype]]

    def decide(self, s: Sweep, value, current, complete: bool, why: str, **extra) -> dict:
        """A crossover section's decision for s.table[s.key], logged and saved: it changes the entry only when the
        sweep was complete."""
        decision = {"section": s.section, "table": s.table, "key": s.key, "value": value, "current": current,
                    "changed": complete and value != current, "complete": complete, "why": why, **extra}
        self.decisions.append(decision)
        self._save()
        self.log(f"== {s.section} {s.table}[{s.key}]: {value} ({why})")
        return decision

    def crossover(self) -> None:
        """Cron Root vs SDPA flash, causal, B=1 H=8 D=64 fp16: per mode the first N from which Cron Root is faster
        at every larger measured N (the hybrid uses SDPA below it).

        Timed in device time (self.cross_timing "graph": CUDA-graph replays) on a GPU. At this small shape an eager
        call below ~3K tokens costs the host more than the GPU on both sides (results/README.md, "Host cost"), so an
        eager sweep there compares Python and C++ host paths, not the kernels, and says nothing about a call whose
        host time is hidden behind queued GPU work (larger batches, a model's other layers, CUDA graphs,
        torch.compile's reduce-overhead). --cross-timing eager measures that host-bound case."""
        ns = (32, 64) if self.device == "cpu" else CRON_ROOT_CROSS_NS
        for mode in ("fwd", "fwdbwd"):
            s = Sweep("cross", "cron_root", "crossover", mode, "float16", mode, (64,), self.ctx.heads(8), ns, [None],
                      lambda v, _d: {}, causal=(True,), baseline=self.ctx.baseline("flash"))
            points = []
            for n in ns:
                p = self.timed_point(s, {}, 64, n, True, f"cross {mode} N={n} ({self.cross_timing})",
                                     timing_mode=self.cross_timing, mode=mode, timing=self.cross_timing)
                if p is None:
                    break
                points.append(p)
            cross = first_win(points)
            complete = len(points) == len(ns)
            decision = {"section": "cross", "table": "crossover", "key": mode, "value": cross, "complete": complete,
                        "timing": self.cross_timing,
                        "changed": cross is not None,
                        "why": "first N from which Cron Root is at least as fast at every larger measured N"
                        if cross is not None else "Cron Root never won at the longest measured lengths"}
            self.decisions.append(decision)
            self._save()
            self.log(f"== cross {mode}: {cross}")

    def gluon_bwd(self) -> None:
        """ELSA's or CQSA's 16-bit backward on the Gluon kernel (kernels/_gluon_bwd.py) against the kernel's own
        Triton backward (gluon_bwd_paths), fwd+bwd called eagerly (host time included: the Gluon launch's host work is
        what it must repay), fp16, B = 1, H = 8, per head dim and causal setting, at GLUON_BWD_NS[kernel]. The work
        B·H·N² of the first N from which the Gluon backward is at least as fast at every larger measured N becomes
        the kernel's gluon_bwd_min_work entry (ELSA's config.GLUON_BWD_MIN_WORK, CQSA's
        attention.GLUON_BWD_MIN_WORK); where it never is, the entry stays. Both backwards are first checked against
        float64. The kernel needs an sm_90 GPU and triton 3.6's Gluon: elsewhere each entry stays and the log says
        why."""
        from kernels import _gluon_bwd

        heads = self.ctx.heads(8)
        ns = self.ctx.sizes(*GLUON_BWD_NS[self.kernel])
        for d in self.ctx.dims(GLUON_BWD_DIMS):
            probe = torch.zeros(1, 1, 16, d, device=self.device, dtype=torch.float16)
            usable = _gluon_bwd.usable(probe, probe, probe, probe)
            gluon, triton_bwd, table = gluon_bwd_paths(self.kernel, d)
            for causal in (False, True):
                key = f"{d},{int(causal)}"
                current = table[(d, causal)]
                s = Sweep("gluonbwd", self.kernel, "gluon_bwd_min_work", key, "float16", "fwdbwd", (d,), heads, ns,
                          [None], lambda v, _d: gluon, causal=(causal,), baseline=self.kernel,
                          baseline_options=triton_bwd)
                points, bad = [], []
                if not usable:
                    bad = ["the Gluon backward needs an sm_90 GPU and triton 3.6's Gluon"]
                else:
                    bad = self.paths_off_tolerance(s, {"gluon": gluon, "triton": triton_bwd}, d, 1024)
                for n in ns if not bad else ():
                    p = self.timed_point(s, gluon, d, n, causal, f"gluonbwd D={d} causal={causal} N={n}")
                    if p is None:
                        break
                    points.append(p)
                cross = first_win(points)
                complete = not bad and len(points) == len(ns)
                value = heads * cross * cross if cross is not None else current       # B = 1
                why = ("; ".join(bad) + ": the entry stays") if bad else (
                    f"the Gluon backward at least as fast from N = {cross} (B=1, H={heads})" if cross is not None
                    else "the Triton backward faster at the longest measured length: the entry stays")
                self.decide(s, value, current, complete, why)

    def stream_plan(self) -> None:
        """Stream-CQSA's planner rates (kernels/cqsa/stream.py, PLAN_RATES: what plan_seconds ranks the plans under a
        budget with), per engine, from the engine timed at forced plans with no budget: fp16, B = 1, H = 8, D = 128,
        not causal, inputs on the device, one call (its whole run: host time included) timed alone by the
        harness (measure_pair without a baseline: its warm-up, L2 flush and sampling), the median. FLOP/s from
        depth 1 at the longer length (the planner's own count of a task's FLOPs), the host's time per task from
        the deepest plan at the shorter one (thousands of small tasks: the host is the bottleneck), a host
        accumulator's merge rate from its extra time over the device accumulator's at depth 1 and the longer
        length. Every timing is a row of the log."""
        from kernels.cqsa import stream
        from kernels.cqsa.divide import max_depth

        heads, d = (1, 32) if self.ctx.cpu else (8, 128)
        short, long = (32, 64) if self.ctx.cpu else STREAM_PLAN_NS
        c = 7                               # the engine's default divide: a plan at depth itr runs c ** itr tasks
        deep = min(STREAM_PLAN_DEEP, max_depth(short, c))
        gen = torch.Generator(device=self.device).manual_seed(7)

        def inputs(n):
            q, k, v, do = (torch.randn((1, heads, n, d), generator=gen, device=self.device, dtype=torch.float16)
                           for _ in range(4))
            out, lse, _ = stream.stream_forward(q, k, v, c=c)
            return dict(q=q, k=k, v=v, out=out, lse=lse, do=do)

        def seconds(mode, x, itr, acc, label) -> float | None:
            if not self._time_left():
                self.log(f"plan {label}: budget reached")
                return None
            t0 = time.monotonic()
            args = (x["q"], x["k"], x["v"]) if mode == "fwd" else (x["q"], x["k"], x["v"], x["out"], x["lse"], x["do"])
            run = stream.stream_forward if mode == "fwd" else stream.stream_backward
            res = measure_pair(Workload(run=lambda: run(*args, c=c, itr=itr, acc=acc)), None, kernel_name="cqsa",
                               baseline_name=None, timing=self.timing, device=self.device).kernel
            self.slowest_s = max(self.slowest_s, time.monotonic() - t0)
            if res.status != "ok":
                raise RuntimeError(f"plan {label}: {res.status}: {res.message}")
            s = res.summary()["ms_median"] / 1e3
            self.rows.append({"section": "plan", "mode": mode, "n": x["q"].shape[2], "itr": itr, "acc": acc,
                              "seconds": s, "samples_ms": res.summary()["samples_ms"]})
            self._save()
            self.log(f"plan {label}: {s * 1e3:.3g} ms")
            return s

        x_short, x_long = inputs(short), inputs(long)
        for mode in ("fwd", "bwd"):
            flops, merge_bytes = stream.plan_traffic(mode, x_long["q"], x_long["k"], c=c)     # a depth-1 task's
            t_dev = seconds(mode, x_long, 1, "device", f"{mode} N={long} depth 1, device accumulator")
            t_host = seconds(mode, x_long, 1, "host", f"{mode} N={long} depth 1, host accumulator")
            t_deep = seconds(mode, x_short, deep, "device", f"{mode} N={short} depth {deep}, device accumulator")
            current = list(stream.PLAN_RATES[mode])
            complete = None not in (t_dev, t_host, t_deep)
            value, why = current, "the timings did not finish: the rates stay"
            if complete:
                value = [c * flops / t_dev, t_deep / c ** deep, current[2]]
                why = "[FLOP/s, host seconds a task, host-merge bytes/s] measured"
                if t_host > t_dev:
                    value[2] = c * merge_bytes / (t_host - t_dev)
                else:
                    why += "; the host accumulator no slower than the device's: its merge rate stays"
            s = Sweep("plan", "cqsa", "plan_rates", mode, "float16", mode, (d,), heads, (short, long), [None],
                      lambda v, _d: {})
            self.decide(s, value, current, complete, why)

    def pasa_shift(self) -> None:
        """PASA's K̃ path per head-dim tile width: inline (the main kernel shifts each window itself) against the
        pre-pass, fp16, non-causal, B = 1, at every B·H of PASA_SHIFT_HEADS; inline is kept up to the longest
        measured N at which it, and at every shorter measured N, is at most as slow as the pre-pass at every B·H
        (0: the pre-pass everywhere). Both paths are first checked against float64."""
        from kernels.pasa import ops

        inline, prepass = {"shift": "inline"}, {"shift": "prepass"}
        heads = (1,) if self.ctx.cpu else PASA_SHIFT_HEADS
        for d in self.ctx.dims([64, 128]):
            key = str(block_d(d))
            ns = self.ctx.sizes(*PASA_SHIFT_NS)
            sweeps = {h: Sweep("shift", "pasa", "shift_inline_max_keys", key, "float16", "fwd", (d,), h, ns, [None],
                               lambda v, _d: inline, baseline="pasa", baseline_options=prepass) for h in heads}
            check_n = ns[0] if self.ctx.cpu else 1024
            bad = self.paths_off_tolerance(sweeps[heads[0]], {"inline": inline, "prepass": prepass}, d, check_n)
            points = []
            for n, h in [(n, h) for n in ns for h in heads] if not bad else ():
                p = self.timed_point(sweeps[h], inline, d, n, False, f"shift D={d} B·H={h} N={n} inline", heads=h)
                if p is None:
                    break
                points.append(p)
            limit = 0
            for n in ns:
                at_n = [p for p in points if p["n"] == n]
                if len(at_n) < len(heads) or any("error" in p or p["ratio"] > 1.0 for p in at_n):
                    break
                limit = n
            complete = not bad and len(points) == len(ns) * len(heads)
            current = ops.SHIFT_INLINE_MAX_KEYS[block_d(d)]
            why = ("; ".join(bad) + ": the rule stays") if bad else (
                f"inline at most as slow as the pre-pass at every B·H up to N = {limit}" if limit else
                f"the pre-pass faster at N = {ns[0]} already")
            self.decide(sweeps[heads[0]], limit if not bad else current, current, complete, why)

    def pasa_core(self) -> None:
        """PASA's default forward on the Gluon core against the same call on its Triton loop (naming the default loop
        keeps the Triton kernel), fp16, at the two shapes of pasa_core_shapes per work level of PASA_CORE_LEVELS, per
        (head dim, causal) of PASA_CORE_KEYS; timed as Cron Root's crossover is (self.cross_timing: on a GPU in device
        time, CUDA-graph replays, unless --cross-timing eager, which adds the core's larger host work per call). The
        core takes the default call at any size by the call's plan (config={"plan": {"core_min_work": 1}}). The level
        from which the core is at least as fast at every shape of it and of every larger level (first_level_won)
        becomes ops.CORE_MIN_WORK's entry; where it never is, the entry stays. Both paths are first checked against
        float64 (the coarse TOLERANCE; their errors are logged). The core needs an sm_90 GPU and triton 3.6's Gluon:
        elsewhere each entry stays and the log says why."""
        from kernels import _gluon_core
        from kernels.pasa import ops

        core, triton_loop = pasa_core_paths()
        keys = PASA_CORE_KEYS[:1] if self.ctx.cpu else PASA_CORE_KEYS
        for d, causal in keys:
            key = f"{d},{int(causal)}"
            current = ops.CORE_MIN_WORK[(d, causal)]
            probe = torch.zeros(1, 1, 16, d, device=self.device, dtype=torch.float16)

            def sweep(heads: int) -> Sweep:
                return Sweep("core", "pasa", "core_min_work", key, "float16", "fwd", (d,), heads, (), [None],
                             lambda v, _d: core, causal=(causal,), baseline="pasa", baseline_options=triton_loop)

            shapes = [(level, heads, n) for level in PASA_CORE_LEVELS for heads, n in pasa_core_shapes(d, level)]
            points, bad = [], []
            if not _gluon_core.available(probe, probe, probe):
                bad = ["the Gluon core needs an sm_90 GPU and triton 3.6's Gluon"]
            else:
                bad = self.paths_off_tolerance(sweep(8), {"core": core, "triton": triton_loop}, d, 1024)
            for level, heads, n in shapes if not bad else ():
                p = self.timed_point(sweep(heads), core, d, n, causal, f"core D={d} causal={causal} 2^{level} "
                                     f"H={heads} N={n} ({self.cross_timing})", timing_mode=self.cross_timing,
                                     heads=heads, log2_work=level, timing=self.cross_timing)
                if p is None:
                    break
                points.append(p)
            level = first_level_won(points)
            complete = not bad and len(points) == len(shapes)
            value = 2 ** level if level is not None else current
            why = ("; ".join(bad) + ": the entry stays") if bad else (
                f"the core at least as fast from 2^{level} of work" if level is not None
                else "the Triton loop faster at the largest measured work: the entry stays")
            self.decide(sweep(8), value, current, complete, why, timing=self.cross_timing)


# --- writing the choices where the kernels read them -------------------------------------------------------------

def _gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)"


def measured_on(device: str) -> dict:
    import triton

    return {"gpu": _gpu_name() if device == "cuda" else "cpu (Triton interpreter; times meaningless)",
            "torch": torch.__version__, "triton": triton.__version__,
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "by": "scripts/tune.py"}


def tuning_file(kernel: str) -> Path:
    return Path(__file__).resolve().parent.parent / "kernels" / kernel / "tuning.json"


def cr_tuning_file() -> Path:
    return tuning_file("cron_root")


NOTES = {
    "elsa": "ELSA launch configs chosen by scripts/tune.py --kernel elsa (harness timer, paired against SDPA); "
            "entries replace kernels/elsa/config.py's built-in tables: fwd {dtype class,BLOCK_D: [BLOCK_M, BLOCK_N, "
            "num_warps, num_stages]}, bwd {dtype class,BLOCK_D: {dq, dkdv}}; gluon_bwd_min_work {D,causal 0/1: "
            "B*Hq*Nq*Nk from which the Gluon backward runs} (its Triton backward paired against it).",
    "pasa": "PASA launch configs chosen by scripts/tune.py --kernel pasa (harness timer, paired against SDPA flash; "
            "the K̃ path inline against the pre-pass); entries replace kernels/pasa/attention.py's BUILTIN_CONFIGS / "
            "BUILTIN_VARIANT: {BLOCK_D: [BLOCK_M, BLOCK_N, num_warps, num_stages]} (fa16 keeps PASA's tiles), and "
            "kernels/pasa/ops.py's BUILTIN_SHIFT_INLINE_MAX_KEYS: {BLOCK_D: keys} and BUILTIN_CORE_MIN_WORK: "
            "{D,causal 0/1: B*Hq*Nq*Nk*D from which the default call runs on the Gluon core} (its Triton loop paired "
            "against it).",
    "cqsa": "Stream-CQSA tiles chosen by scripts/tune.py --kernel cqsa (harness timer, paired against SDPA flash); "
            "entries replace kernels/cqsa/kernel.py's built-in GPU choice: {kind: {dtype class,D: [BLOCK_M, BLOCK_N, "
            "num_warps, num_stages]}}; gluon_bwd_min_work {D,causal 0/1: B*Hq*Nq*Nk from which the resident "
            "backward runs on the Gluon kernel} (its Triton backward paired against it), replacing "
            "kernels/cqsa/attention.py's BUILTIN_GLUON_BWD_MIN_WORK; plan_rates {fwd | bwd: [FLOP/s, host seconds a "
            "task, host-merge bytes/s]} (section plan: the streaming engine timed at forced plans), replacing "
            "kernels/cqsa/stream.py's BUILTIN_PLAN_RATES.",
}


def write_choices(kernel: str, decisions: list[dict], path: Path, device: str) -> dict:
    """Write the decisions that changed an entry (and every measured crossover) to the kernel's tuning file at
    `path`; an entry that stayed is already where the kernel reads it. Returns what was written."""
    decisions = [d for d in decisions if d["changed"]]
    if not decisions:
        return {}
    if kernel == "cron_root":
        return _write_cron_root(decisions, path, device)
    updates: dict = {}
    for d in decisions:
        if kernel == "pasa" and d["table"] == "pasa":       # fa16 keeps PASA's tiling ("the same tiling without the shift")
            updates.setdefault("fa16", {})[d["key"]] = d["value"]
        updates.setdefault(d["table"], {})[d["key"]] = d["value"]
    if updates:
        write_configs(path, updates, measured_on(device), NOTES[kernel])
    return updates


def _write_cron_root(decisions: list[dict], path: Path, device: str) -> dict:
    src = path if path.is_file() else cr_tuning_file()
    data = json.loads(src.read_text())
    name = _gpu_name() if device == "cuda" else "cpu (Triton interpreter)"
    entry = dict(data.setdefault("gpus", {}).get(name, {}))
    cross = {d["key"]: d["value"] for d in decisions if d["table"] == "crossover" and d["value"] is not None}
    timing = next((d.get("timing", "eager") for d in decisions if d["table"] == "crossover"), "eager")
    for mode, n in cross.items():
        entry[f"crossover_{mode}"] = n
        entry["crossover_workload"] = ("B=1 H=8 D=64 float16 vs SDPA flash causal, "
                                       + ("device time (CUDA-graph replays)" if timing == "graph"
                                          else "eager calls (host time included)"))
    if "fwd" in cross and "fwdbwd" in cross:
        entry["crossover"] = max(cross["fwd"], cross["fwdbwd"])
    configs = entry.setdefault("configs", {})
    for d in decisions:
        if d["table"] == "configs":
            bucket, kind = d["key"].split(":")
            configs.setdefault(bucket, {}).setdefault(kind, {}).update(d["value"])
    if not configs:
        entry.pop("configs")
    if entry:
        entry["measured"] = " ".join(f"{k} {v}" for k, v in measured_on(device).items() if k != "by")
        data["gpus"][name] = entry
    write_json_atomic(path, data)
    return entry


def main(argv=None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", required=True, choices=sorted(SECTIONS))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--sections", default=None, help="comma list (default: the kernel's usual set; see SECTIONS)")
    ap.add_argument("--budget-s", type=positive_float, default=540.0,
                    help="stop before a candidate would run past this")
    ap.add_argument("--out", type=output_dir, default=None, help="folder for tune_<kernel>.json (every measurement)")
    ap.add_argument("--write", type=output_file, default=None,
                    help="tuning file to write (default: the kernel's own, GPU only)")
    ap.add_argument("--no-write", action="store_true", help="measure and report only")
    ap.add_argument("--cross-timing", choices=("graph", "eager"), default=None,
                    help="Cron Root's crossover and PASA's core section: device time (graph, the GPU's default) or "
                         "eager calls (the CPU's)")
    ap.add_argument("--dims", type=head_dims, default=None,
                    help="comma list of head dims: sweep only those (default: each section's own), e.g. to re-tune "
                         "after a change to one head dim's kernel")
    args = ap.parse_args(argv)
    _, known, default = SECTIONS[args.kernel]
    sections = (args.sections or default).split(",")
    unknown = [s for s in sections if s not in known]
    if unknown:
        print(f"error: --sections {','.join(unknown)}: not a section of {args.kernel} (known: {', '.join(known)})",
              file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; use --device cpu (tiny sizes, meaningless times)", file=sys.stderr)
        return EXIT_NO_GPU
    if args.cross_timing == "graph" and args.device == "cpu":
        print("error: --cross-timing graph needs a GPU (CUDA graphs)", file=sys.stderr)
        return 2
    tuner = Tuner(args.kernel, args.device, args.budget_s, args.out,
                  log=lambda msg: print(msg, flush=True), cross_timing=args.cross_timing, head_dims=args.dims)
    decisions = tuner.run(sections)
    print("\n== chosen ==")
    for d in decisions:
        print(f"{d['section']:>12} {d['table']}[{d['key']}] = {json.dumps(d['value'])}"
              + (" (changed)" if d["changed"] else "") + ("" if d["complete"] else " (budget ended the sweep)")
              + f"  — {d['why']}")
    path = args.write or (tuning_file(args.kernel) if args.device == "cuda" else None)
    if args.no_write or path is None:
        print("nothing written" + (" (--device cpu: name a file with --write)" if path is None else ""))
        return 0
    written = write_choices(args.kernel, decisions, path, args.device)
    print(f"wrote {path}: {json.dumps(written, default=str)[:2000]}" if written
          else "nothing written: every current entry stayed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
