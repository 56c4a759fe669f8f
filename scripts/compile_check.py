#!/usr/bin/env python3
"""Compile a kernel package's Triton code for sm_90 without a GPU and report, per kernel and tile config:
registers, spill stack, shared memory (and whether it fits sm_90's 227 KB), and the wgmma / cp.async
instructions in the PTX; for a Gluon kernel also its shared-memory stores of 4 bytes or fewer in the SASS
(``sts_narrow``: a tile stored from registers that way is usually a layout across the buffer's rows,
bank-conflicted). It catches GPU-only compile errors the CPU interpreter cannot see, and tiles that spill or cannot
launch, before any device time is spent. A Gluon kernel whose wgmmas ptxas serialized (a wait
after each one in the SASS) fails: its hand-written overlap of the GEMMs with the softmax is gone; a Triton kernel's
line says so (PASA's fused loop with the fp16 state is one: its roundings through 16-bit values, as the Gluon
core's PASA step had them before kernels/_gluon_core.py's _round16).

    python3 scripts/compile_check.py --kernel elsa|cron_root|pasa|cqsa|flash_core|gluon_core|all [--json OUT] [--tiles]
        [--ws-only] [--sass] [--inductor-writes] [--dtypes fp16,bf16,fp32] [--dims 64,128] [--target cuda:90:32]

By default it compiles the tiles each kernel ships (what a launch on an H100 uses). ``--tiles`` compiles the
candidate tiles instead, as a filter before a tuning sweep: ELSA's grid of (BLOCK_M, BLOCK_N) in 32/64/128 ×
4/8 warps × 2/3 stages, PASA's sweep candidates, the flash core's (scripts/flash_core_sweep.py), the Gluon
backward's. Exit 1 if any kernel fails to compile; spills are reported,
not failed (some are known and allowed: kernels/elsa/NOTES.md). ``--sass`` prints each job's SASS digest (the
``--json`` rows always hold it): the same digest on two trees means the same sm_90 code, so a refactor can be shown
to change nothing without a GPU.

Method: Triton's ahead-of-time path (ASTSource + triton.compile for an explicit target) with the arguments
specialised as a launch on contiguous [B, H, N, D] tensors specialises them (pointers and strides divisible
by 16, lengths and counts plain i32), and the cuobjdump shipped with Triton for the resource usage.

``--inductor-writes`` compiles nothing: for the kernels torch.compile's graphs launch themselves (ELSA's Triton
kernels, handed to inductor by kernels/_ops.py's decompose_when_traced) it prints what torch's analysis of their
TTIR counts as written, and fails (exit 1) where that includes a tensor the kernel only reads (inductor_writes).

Warp-specialized kernels (their TTGIR has ttg.warp_specialize) are also audited for the row double-offset hazard
(kernels/_flash_core.py, row_index): a tt.splat of a value that a descriptor load/store of the same partition uses
as its row coordinate. Each one is a failure (exit 1): the second consumer warpgroup would read or write rows 64
past its own. ``--ws-only`` compiles only the warp-specialized variants (the Triton core's, and every Gluon kernel:
the audit alone).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)      # compile for real: the interpreter compiles nothing
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from attnbench.arguments import Parser, head_dims, name_list, output_file  # noqa: E402

SMEM_MAX = 232448   # sm_90: 227 KB of shared memory per block (opt-in); a config above it cannot launch
PTX_COUNTS = {"wgmma": ("wgmma.mma_async",), "cp_async": ("cp.async.cg", "cp.async.ca"),
              "ex2": ("ex2.approx",), "cvt_f16x2": ("cvt.rn.f16x2.f32",), "cvt_f32_f16": ("cvt.f32.f16",)}
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class Job:
    """One kernel at one tile config: what to compile and how its arguments are specialised."""
    kernel: str                      # the package: elsa, cron_root, pasa, cqsa
    name: str                        # the Triton function's role, e.g. phase1, dq, fwd
    fn: object                       # the @triton.jit function
    dtype: str                       # fp16, bf16, fp32: the element type of the input/output pointers
    constexprs: dict
    num_warps: int
    num_stages: int
    ptrs: set                        # pointer arguments of the input dtype
    fp32_ptrs: set = field(default_factory=set)   # pointers that are always fp32 (statistics, accumulators)
    i32_ptrs: set = field(default_factory=set)
    floats: set = field(default_factory=set)      # fp32 scalar arguments
    div16: object = None             # name -> True for the integer arguments a launch sees divisible by 16 (strides)
    label: dict = field(default_factory=dict)     # what the report shows besides the kernel
    descs: dict = field(default_factory=dict)     # host-side tensor descriptor arguments: name -> signature type
    gluon: bool = False              # a Gluon kernel (compiled from its own source type)


def signature(job: Job) -> tuple[dict, dict]:
    """(signature, attrs) as a launch on contiguous tensors specialises them: every pointer 16-byte aligned,
    the integers `div16` names divisible by 16, other integers plain i32."""
    sig, attrs = {}, {}
    for i, (name, param) in enumerate(zip(job.fn.arg_names, job.fn.params)):
        if name in job.constexprs or param.is_constexpr:
            sig[name] = "constexpr"
            continue
        if name in job.descs:
            sig[name] = job.descs[name]
            continue
        if name in job.fp32_ptrs or name in job.i32_ptrs or name in job.ptrs:
            sig[name] = "*fp32" if name in job.fp32_ptrs else "*i32" if name in job.i32_ptrs else f"*{job.dtype}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in job.floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if job.div16 is not None and job.div16(name):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


# A region of a warp-specialized kernel's TTGIR: the default (producer) region or a partition (consumers)
_WS_REGION = re.compile(r"^\s*(default|partition\d+)\s*[({]")
# a descriptor load/store (before or after lowering to TMA copies) and its first (row) coordinate
_DESC_ROW = re.compile(r"\b(?:ttng\.async_tma_copy_\w+|tt\.descriptor_\w+)\s+%[\w.]+\[(%[\w.]+)\s*,")
_SPLAT = re.compile(r"=\s*tt\.splat\s+(%[\w.]+)\s*[:{]")


def ws_row_hazards(ttgir: str) -> list[str]:
    """The row double-offset hazard of triton's Hopper warp specialization in a compiled kernel's TTGIR: per
    region (the producer's default region, each consumer partition), values that are both the row coordinate of a
    descriptor load/store and the operand of a tt.splat (a row vector built as that coordinate + arange, which the
    pass offsets twice in the second consumer). Empty for kernels without warp specialization."""
    if "ttg.warp_specialize" not in ttgir:
        return []
    hazards, region, coords, splats = [], "main", set(), set()

    def close():
        hazards.extend(f"{region}: tt.splat of the descriptor row coordinate {name}" for name in sorted(coords & splats))

    for line in ttgir.splitlines():
        m = _WS_REGION.match(line)
        if m:
            close()
            region, coords, splats = m.group(1), set(), set()
        coords.update(_DESC_ROW.findall(line))
        splats.update(_SPLAT.findall(line))
    close()
    return hazards


def declared_constexprs(job: Job) -> dict:
    """The constexprs the job's kernel declares: the job's (one meta dict serves a package's several kernels), and
    at its default each one the job leaves out, as a launch that leaves it out gets."""
    constexprs = {k: v for k, v in job.constexprs.items() if k in job.fn.arg_names}
    constexprs.update({p.name: p.default for p in job.fn.params if p.is_constexpr and p.name not in constexprs})
    return constexprs


# The tensors a kernel handed to inductor only reads: its caller's inputs (and the backward's saved forward output and
# lse). ELSA's Triton kernels are handed over (kernels/_ops.py, decompose_when_traced: torch.library.wrap_triton);
# where torch's analysis counts one of these as written, AOTAutograd copies into it, and a leaf that requires grad
# fails the compile.
READ_ONLY = {"Q", "K", "V", "Bias", "dOut"}
READ_ONLY_BACKWARD = {"Out", "Lse"}
TRACED_KERNELS = {"elsa"}


def read_only(job: Job) -> set:
    """The arguments of this job's kernel that must not count as written (READ_ONLY)."""
    return READ_ONLY | (READ_ONLY_BACKWARD if job.name in ("dq", "dkdv") or job.name.startswith("bwd_") else set())


def inductor_writes(job: Job, target: GPUTarget) -> set:
    """The tensor arguments torch's analysis of a Triton kernel handed to inductor counts as written, for this job
    with pointer loads (the traced launches take no descriptors; kernels/_launch.py, Prepared.traced). The analysis
    reads the kernel's TTIR; a value that a called @triton.jit function returns and that builds a store's address
    makes it count every tensor passed to that function as written, so such a helper must take the indices it
    would return (kernels/elsa/kernel.py, _key_tile). No GPU needed: the TTIR is made for `target`."""
    from torch._higher_order_ops import triton_kernel_wrap as tkw

    kwargs = declared_constexprs(job)
    kwargs.update({flag: False for flag in ("USE_DESC", "WARP_SPECIALIZE") if flag in kwargs})
    for name, kind in signature(job)[0].items():      # the other arguments as a launch's, of their types
        if kind.startswith("*"):
            kwargs[name] = torch.empty(64, dtype=TORCH_DTYPES.get(kind[1:], torch.int32))
        elif kind in ("fp32", "i32"):
            kwargs[name] = 0.5 if kind == "fp32" else 64
        elif kind != "constexpr":
            raise ValueError(f"{job.kernel} {job.name}: argument {name} ({kind}) is never handed to inductor")

    class _Target:       # the analysis asks the active driver for its target: this one, GPU or not (this
        def get_current_target(self):              # script launches nothing, so the driver is not restored)
            return target

    triton.runtime.driver.set_active(_Target())
    if hasattr(tkw, "identify_accessed_tensors"):     # torch >= 2.12
        written = {dep.name for dep in tkw.identify_accessed_tensors(job.fn, kwargs, {}).read_writes.writes}
    else:
        written = set(tkw.identify_mutated_tensors(job.fn, kwargs, {}))
    return {name for name in written if isinstance(kwargs.get(name), torch.Tensor)}


def compile_job(job: Job, target: GPUTarget) -> dict:
    sig, attrs = signature(job)
    constexprs = declared_constexprs(job)
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options({"num_warps": job.num_warps, "num_stages": job.num_stages})
    source = ASTSource
    if job.gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as source
    cc = triton.compile(source(fn=job.fn, signature=sig, constexprs=constexprs, attrs=attrs), target=target,
                        options=options.__dict__)
    ptx = cc.asm.get("ptx", "")
    # warps: as compiled; more than asked when warp specialization added a producer warpgroup
    usage = {"shared": cc.metadata.shared, "fits_smem": cc.metadata.shared <= SMEM_MAX, "warps": cc.metadata.num_warps,
             "ws_hazards": ws_row_hazards(cc.asm.get("ttgir", ""))}
    usage.update({key: sum(ptx.count(p) for p in pats) for key, pats in PTX_COUNTS.items()})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cc.asm["cubin"])
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    try:
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    # ptxas serializes a kernel's wgmmas (a wait after every one: C7514) when it sees a non-wgmma instruction touch an
    # in-flight accumulator, or believes it does; in a Gluon kernel that undoes the hand-written GEMM/softmax overlap
    hgmma = sass.count("HGMMA.")
    usage["wgmma_serialized"] = hgmma > 1 and sass.count("WARPGROUP.DEPBAR") >= hgmma
    # the instructions' digest (cuobjdump's /* offset */ lines, addresses and encodings included): equal digests of
    # one job on two trees mean the same sm_90 code, which is how a refactor is shown to change nothing
    code = "\n".join(line for line in sass.splitlines() if line.strip().startswith("/*"))
    usage["sass_sha256"] = hashlib.sha256(code.encode()).hexdigest()[:16]
    # shared-memory stores of 4 bytes or fewer: where a Gluon kernel stores a tile from registers, a layout that puts
    # a thread's elements across the buffer's rows makes them narrow and, swizzled, bank-conflicted (ELSA's float32
    # phase 1 stored V so, 64 a thread a tile, and ran 1.8x its time: kernels/elsa/NOTES.md, "Precision")
    usage["sts_narrow"] = len(re.findall(r"\*/\s+(?:@!?U?P\w+\s+)?STS(?:\.[US](?:8|16))?\s", code))
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if m:
        usage.update(regs=int(m.group(1)), spill_stack=int(m.group(2)))
    return usage


# -- each kernel package's jobs -------------------------------------------------------------------------------

# A contiguous bias's key stride is 1, and a launch specialises an integer argument equal to 1 into a constant: the
# bias jobs compile it so (without it, triton 3.6 found no spill in the 32 x 32 window tiles, which spilled 4
# registers on the H200; with it, the same 4: kernels/elsa/config.py, SHORT_BIAS_TILES)
BIAS_UNIT_STRIDE = {"sbj": 1}


def elsa_jobs(dtypes, dims, tiles: bool) -> list[Job]:
    from kernels import _flash_core as core
    from kernels._common import block_d
    from kernels.elsa import config, gluon_phase1
    from kernels.elsa import kernel as K

    fp32_ptrs = {"Lse", "Delta", "dS", "Sbuf"}
    ptrs = {"Q", "K", "V", "dOut", "dQ", "dK", "dV", "Bias", "Out"}
    stride = re.compile(r"^s[a-z]+$").match
    fns = {"phase1": K._elsa_phase1, "dq": K._elsa_bwd_dq, "dkdv": K._elsa_bwd_dkdv}
    jobs = []
    for dtype, d in itertools.product(dtypes, dims):
        fp32 = dtype == "fp32"
        key = (config.dtype_class(TORCH_DTYPES[dtype]), block_d(d))
        if tiles:
            grid = [(bm, bn, w, st) for bm, bn, w, st in itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (2, 3))
                    if bm * bn <= 128 * 128 and not (w == 8 and bm * bn < 64 * 64)]
            configs = {name: [(cfg, False, False) for cfg in grid] for name in fns}
        else:
            dq, dkdv = config.BWD_TABLE[key]
            # phase 1: the plain tiles with summaries, and (16-bit) the core's warp-specialized tiles with summaries
            # and as the single partition (FINAL: out through a descriptor, lse through a pointer)
            torch_dtype = TORCH_DTYPES[dtype]
            phase1 = [(config.core_tiles(torch_dtype, d), False, False)]
            if not fp32 and key in core.WS_TILES:
                phase1 += [(config.core_tiles(torch_dtype, d, warp_specialize=True), True, final)
                           for final in (False, True)]
            if fp32:       # and as the single partition (FINAL: out and lse stored), which needs more registers
                phase1.append((config.core_tiles(torch_dtype, d), False, True))
            configs = {"phase1": phase1, "dq": [(dq, False, False)], "dkdv": [(dkdv, False, False)]}
        for name, fn in fns.items():
            for (bm, bn, w, st), ws, final in configs[name]:
                # phase 1 with summaries (P >= 2) and the training output (lse); non-causal, no bias, one head a kv
                # head, whole key tiles; 16-bit phase 1 through the flash core with tensor descriptors
                meta = dict(HEAD_DIM=d, BLOCK_D=block_d(d), BLOCK_M=bm, BLOCK_N=bn, CAUSAL=False, HAS_BIAS=False,
                            BIAS_GRAD=False, FOLD_Q=fp32, SCALE_IN_EXP=not fp32,
                            DOT_PREC="tf32x3" if fp32 else "tf32", FINAL=final, STORE_LSE=True, GROUPED=False,
                            KEYS_EVEN=True, USE_DESC=not fp32, WARP_SPECIALIZE=ws)
                label = dict(D=d, cfg=[bm, bn, w, st])
                if ws:
                    label["ws"] = True
                if final:
                    label["final"] = True
                jobs.append(Job("elsa", name, fn, dtype, meta, w, st, ptrs, fp32_ptrs, floats={"qk_scale", "sm_scale"},
                                div16=stride, label=label))
        if not tiles and fp32 and d in gluon_phase1.HEAD_DIMS:
            if not (gluon_phase1.HAS_GLUON and triton.__version__.startswith(gluon_phase1.GLUON_VERSION)):
                print(f"elsa phase1_tf32: written for triton {gluon_phase1.GLUON_VERSION}'s Gluon, this is "
                      f"{triton.__version__}: skipped", flush=True)
            else:
                # float32's phase 1 on wgmma (kernels/elsa/gluon_phase1.py), with summaries and as the single
                # partition, each causal and not, with ragged key tiles
                for final, causal in itertools.product((False, True), (False, True)):
                    meta = dict(HEAD_DIM=d, BLOCK_D=d, BLOCK_M=gluon_phase1.BLOCK_M, BLOCK_N=gluon_phase1.TILES[d],
                                CAUSAL=causal, HAS_BIAS=False, FOLD_Q=True, SCALE_IN_EXP=False, DOT_PREC="tf32x3",
                                FINAL=final, STORE_LSE=True, KEYS_EVEN=False, USE_DESC=False, WARP_SPECIALIZE=False)
                    label = dict(D=d, cfg=[gluon_phase1.BLOCK_M, gluon_phase1.TILES[d], gluon_phase1.NUM_WARPS, 1])
                    if final:
                        label["final"] = True
                    if causal:
                        label["causal"] = True
                    jobs.append(Job("elsa", "phase1_tf32", gluon_phase1._elsa_phase1_tf32, dtype, meta,
                                    gluon_phase1.NUM_WARPS, 1, ptrs, fp32_ptrs, floats={"qk_scale"}, div16=stride,
                                    label=label, gluon=True))
        if not tiles and not fp32:
            # the 16-bit backward in one launch (config.backward_launches): both jobs' tiles, the larger warp count,
            # the smaller stage count; the table's, and the short calls' (config.SHORT_ONE_LAUNCH_BWD) with Swin's
            # bias gradient
            one_launch = [(config.BWD_TABLE[key], False, "bwd_one_launch")]
            if key in config.SHORT_ONE_LAUNCH_BWD:
                one_launch.append((config.SHORT_ONE_LAUNCH_BWD[key], True, "bwd_one_launch_short"))
            for ((dm, dn, dw, dst), (km, kn, kw, kst)), bias, name in one_launch:
                meta = dict(HEAD_DIM=d, BLOCK_D=block_d(d), DQ_BLOCK_M=dm, DQ_BLOCK_N=dn, KV_BLOCK_M=km,
                            KV_BLOCK_N=kn, CAUSAL=False, HAS_BIAS=bias, BIAS_GRAD=bias, FOLD_Q=False,
                            SCALE_IN_EXP=True, DOT_PREC="tf32", GROUPED=False, **(BIAS_UNIT_STRIDE if bias else {}))
                jobs.append(Job("elsa", name, K._elsa_bwd_one_launch, dtype, meta, max(dw, kw), min(dst, kst),
                                ptrs, fp32_ptrs, floats={"qk_scale", "sm_scale"}, div16=stride,
                                label=dict(D=d, dq=[dm, dn], dkdv=[km, kn], bias=bias)))
        if not tiles and key in config.WINDOW_FWD_TILES:
            # Swin's windows (config.WINDOW_FWD_TILES): phase 1's bias loop as the single partition
            bm, bn, w, st = config.WINDOW_FWD_TILES[key]
            meta = dict(HEAD_DIM=d, BLOCK_D=block_d(d), BLOCK_M=bm, BLOCK_N=bn, CAUSAL=False, HAS_BIAS=True,
                        FOLD_Q=False, SCALE_IN_EXP=False, DOT_PREC="tf32", FINAL=True, STORE_LSE=True,
                        KEYS_EVEN=False, USE_DESC=False, WARP_SPECIALIZE=False, **BIAS_UNIT_STRIDE)
            jobs.append(Job("elsa", "phase1_window", K._elsa_phase1, dtype, meta, w, st, ptrs, fp32_ptrs,
                            floats={"qk_scale", "sm_scale"}, div16=stride,
                            label=dict(D=d, cfg=[bm, bn, w, st], final=True, bias=True)))
        if not tiles:
            # phase 2 after 128-row phase-1 blocks (the core's, the Gluon core's), with the training lse, as the
            # programmatic dependent of phase 1 that eager calls on sm_90 launch (PDL: it waits for phase 1's stores)
            rows = config.PHASE2_ROWS[key[0]][block_d(d)]
            kbt = config.PHASE2_KBT[key[0]][block_d(d)]
            meta = dict(HEAD_DIM=d, BLOCK_D=block_d(d), BLOCK_M=128, ROWS=rows, KBT=kbt, CAUSAL=False,
                        STORE_LSE=True, PDL=True)
            jobs.append(Job("elsa", "phase2", K._elsa_phase2, dtype, meta, config.PHASE2_WARPS, 2, ptrs, fp32_ptrs,
                            div16=stride, label=dict(D=d, rows=rows, kbt=kbt)))
    return jobs


def cron_root_jobs(dtypes, dims, tiles: bool) -> list[Job]:
    from kernels._common import block_d
    from kernels.cron_root import kernel as K
    from kernels.cron_root.configs import default_gpu_configs, forward_tiles

    if tiles:                        # --kernel all --tiles goes on to the other kernels
        print("cron_root: --tiles: no candidate grid here (its tiles are swept on the GPU): skipped", flush=True)
        return []
    ptrs = {"Q", "K", "V", "RK", "RV", "O", "DO", "DQ", "DK", "DV"}
    stride = re.compile(r"^s[a-z]+[bhn]$").match
    fns = {"fwd": K._fwd, "fwd_small": K._fwd, "dq": K._bwd_dq, "glob": K._bwd_global, "loc": K._bwd_local}
    jobs = []
    for d, dtype in itertools.product(dims, dtypes):
        for prec in (("tf32x3", "ieee") if dtype == "fp32" else ("tf32",)):
            configs = default_gpu_configs(d, TORCH_DTYPES[dtype], prec if dtype == "fp32" else "tf32x3")
            # the forward's column tiles, with its first tile's bucket's tiles where it splits the head dim
            tile_d, tile_d2 = forward_tiles(d, TORCH_DTYPES[dtype])
            fwd_configs = default_gpu_configs(tile_d, TORCH_DTYPES[dtype], "tf32x3") if tile_d2 else configs
            for name, fn in fns.items():
                cfg = (fwd_configs if fn is K._fwd else configs)[name]
                for grouped in ((False, True) if name in ("glob", "loc") else (None,)):
                    meta = {k: v for k, v in cfg.items() if k.startswith("BLOCK_")}
                    meta.update(HEAD_DIM=d, BLOCK_D=block_d(d), PREC=prec)
                    if fn is K._fwd:
                        meta.update(BLOCK_D=tile_d, BLOCK_D2=tile_d2)
                    if grouped is not None:
                        meta["GROUPED"] = grouped
                    jobs.append(Job("cron_root", name, fn, dtype, meta, cfg.get("num_warps", 4),
                                    cfg.get("num_stages", 3), ptrs, {"LSE", "SCRATCH"},
                                    floats={"qk_scale", "scale", "inv_w"}, div16=stride,
                                    label=dict(D=d, prec=prec, grouped=grouped, cfg=cfg)))
    return jobs


# PASA's sweep candidates: the tiles scripts/tune.py's PASA_TILES times on the GPU (tests/test_tune.py keeps the two
# equal)
PASA_CANDIDATES = {
    64: [(64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 4)],
    128: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2)],
}


def pasa_jobs(dtypes, dims, tiles: bool) -> list[Job]:
    from kernels._common import block_d
    from kernels.pasa import kernel as K
    from kernels.pasa.attention import DEFAULT_CONFIGS, TILE_PARAMS, VARIANTS
    from kernels.pasa.ops import SHIFT_WARPS

    ptrs, floats = {"Q", "KS", "V", "O", "K"}, {"c_arg", "diag", "off", "qk_scale"}
    stride = re.compile(r"^stride_").match
    jobs = []
    for d in dims:   # PASA converts every input to fp16: one dtype
        shipped = tuple(DEFAULT_CONFIGS["pasa"][block_d(d)]["fwd"][p] for p in TILE_PARAMS)
        configs = PASA_CANDIDATES.get(d, [shipped]) if tiles else [shipped]
        for bm, bn, w, st in configs:
            meta = dict(BLOCK_N=bn, D=d, BLOCK_D=block_d(d))
            jobs.append(Job("pasa", "shift_k", K._shift_k_kernel, "fp16", meta, SHIFT_WARPS, 1, ptrs, floats=floats,
                            div16=stride, label=dict(D=d, cfg=[bn, SHIFT_WARPS, 1])))
            for causal, state, inline in itertools.product((False, True), ("fp16", "fp32"), (False, True)):
                for variant in VARIANTS:
                    meta = dict(BLOCK_M=bm, BLOCK_N=bn, D=d, BLOCK_D=block_d(d), CAUSAL=causal,
                                STATE_FP32=state == "fp32", FUSED=VARIANTS[variant], SHIFT_INLINE=inline)
                    jobs.append(Job("pasa", "fwd_inline" if inline else "fwd", K._pasa_fwd_kernel, "fp16", meta, w,
                                    st, ptrs, floats=floats, div16=stride,
                                    label=dict(D=d, variant=variant, causal=causal, state=state, cfg=[bm, bn, w, st])))
            for causal in (False, True):
                meta = dict(BLOCK_M=bm, BLOCK_N=bn, D=d, BLOCK_D=block_d(d), CAUSAL=causal)
                jobs.append(Job("pasa", "fa16", K._fa16_fwd_kernel, "fp16", meta, w, st, ptrs, floats=floats,
                                div16=stride, label=dict(D=d, causal=causal, cfg=[bm, bn, w, st])))
    return jobs


def cqsa_jobs(dtypes, dims, tiles: bool) -> list[Job]:
    from kernels._common import block_d
    from kernels.cqsa import kernel as K

    if tiles:
        raise SystemExit("--tiles: CQSA has no candidate grid here; pass config= to cqsa_attention to try tiles")
    fp32_ptrs = {"LSE", "STATE", "WS", "MST", "SST", "ACC"}
    ptrs = {"Q", "K", "V", "DO", "OUT", "DQ", "DK", "DV", "O"}
    scalars = {"qk_scale", "sm_scale", "mscale"}
    # the integers a launch may see not divisible by 16 (strides and the rest are)
    not_div16 = {"H", "HKV", "GROUP", "N_OUT", "N_ROWS", "off_m", "off_l", "off_delta", "off_dk", "off_dv",
                 "causal_off", "n_waves", "first", "last", "n", "g0", "N"}
    jobs = []

    def job(name, fn, dtype, meta, w, st, extra_fp32=(), **label):
        return Job("cqsa", name, fn, dtype, meta, w, st, ptrs - set(extra_fp32), fp32_ptrs | set(extra_fp32),
                   i32_ptrs={"ITEMS", "RANGES"}, floats=scalars, div16=lambda arg: arg not in not_div16, label=label)

    # the forward's MODE 1 with K/V through tensor descriptors too (the resident path takes them from
    # cqsa.attention.DESC_MIN_KEYS keys on sm_90)
    kernels = (("fwd", K.cqsa_fwd_kernel, dict(MODE=1)), ("fwd", K.cqsa_fwd_kernel, dict(MODE=1, USE_DESC=True)),
               ("fwd", K.cqsa_fwd_kernel, dict(MODE=0)),
               ("dq", K.cqsa_bwd_dq_kernel, dict(DELTA_FROM_O=True)), ("dkdv", K.cqsa_bwd_dkdv_kernel, {}))
    for dtype, d in itertools.product(dtypes, dims):
        prec = "tf32x3" if dtype == "fp32" else "tf32"
        tiles_d = K.default_tiles(d, TORCH_DTYPES[dtype], "cuda")
        for (part, fn, extra), causal in itertools.product(kernels, (False, True)):
            meta = K.constexprs(part, d, tiles_d, causal, prec, **extra)
            w, st = meta.pop("num_warps"), meta.pop("num_stages")
            label = dict(D=d, causal=causal, **extra, cfg=[meta["BLOCK_M"], meta["BLOCK_N"], w, st])
            # MODE 0 writes fp32 partials; MODE 1 is the resident wave merge and the streaming merge in the kernel
            jobs.append(job(fn.__name__, fn, dtype, meta, w, st,
                            extra_fp32=("OUT",) if extra.get("MODE") == 0 else (), **label))
        jobs.append(job("cqsa_finalize_kernel", K.cqsa_finalize_kernel, dtype,
                        dict(HEAD_DIM=d, BLOCK_D=block_d(d), BLOCK=K.FINAL_BLOCK), 4, 1, D=d,
                        cfg=[K.FINAL_BLOCK, 4]))
    return jobs


def flash_core_jobs(dtypes, dims, tiles: bool) -> list[Job]:
    from kernels import _flash_core as core
    from kernels._common import block_d

    if tiles:
        from scripts.flash_core_sweep import CANDIDATES, CLIFF_CANDIDATES
    jobs = []
    for dtype, d in itertools.product(dtypes, dims):
        fp32 = dtype == "fp32"
        if tiles:
            if fp32:
                continue                                  # the sweep is 16-bit only
            configs = {**CANDIDATES, **CLIFF_CANDIDATES}.get(d, [])
        else:
            key = ("32" if fp32 else "16", block_d(d))
            configs = [("tma", *core.PLAIN_TILES[key])] + ([("ws", *core.WS_TILES[key])] if key in core.WS_TILES else [])
        for (variant, bm, bn, w, st), causal in itertools.product(configs, (False, True)):
            meta = dict(HEAD_DIM=d, BLOCK_D=block_d(d), BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, KEYS_EVEN=True,
                        USE_DESC=variant != "ptr", WARP_SPECIALIZE=variant == "ws",
                        DOT_PREC="tf32x3" if fp32 else "tf32")
            jobs.append(Job("flash_core", "fwd", core._flash_core_fwd, dtype, meta, w, st, {"Q", "K", "V", "Out"},
                            floats={"qk_scale"}, div16=re.compile(r"^s[a-z]+$").match,
                            label=dict(D=d, causal=causal, variant=variant, cfg=[bm, bn, w, st])))
    return jobs


# the Gluon backward's tiles tried by --tiles: (BLOCK_M, BLOCK_N, STAGES, DQ_COLS), where DQ_COLS divides a
# warpgroup's columns of dQ (half the head dim)
BWD_TILE_CANDIDATES = [(64, 64, 2, 64), (64, 64, 2, 32), (64, 64, 3, 32), (128, 64, 2, 64)]


def gluon_core_jobs(dtypes, dims, tiles: bool) -> list[Job]:
    """The Gluon core (kernels/_gluon_core.py) as it ships, 16-bit at its head dims: the standalone forward's output,
    ELSA's summary mode, the tile walk (CQSA) and PASA's step, causal and not, with two consumer warpgroups and
    three where the head dim takes them (PASA: its fp16 state, not causal); and the Gluon backward
    (kernels/_gluon_bwd.py) at its TILES, or with --tiles at BWD_TILE_CANDIDATES, and its Triton prologue. Its Gluon
    API is triton 3.6's: with another triton nothing is compiled (a line says so)."""
    from kernels import _gluon_bwd as gb
    from kernels import _gluon_core as gc

    if not (gc.HAS_GLUON and triton.__version__.startswith(gc.GLUON_VERSION)):
        print(f"gluon_core: written for triton {gc.GLUON_VERSION}'s Gluon, this is {triton.__version__}: skipped",
              flush=True)
        return []
    jobs = []
    for dtype, d in itertools.product([x for x in dtypes if x != "fp32"], [x for x in dims if x in gc.HEAD_DIMS]):
        block_n, stages = gc.TILES[d]
        d0, d1 = gc.SPLITS[d]
        descs, nones = {}, {}
        for suffix, cols in (("_desc", d0), ("2_desc", d1)):
            for name, rows in (("q", gc.ROWS_PER_CONSUMER), ("k", block_n), ("v", block_n)):
                if cols:
                    layout = gc.descriptor_layout(rows, cols, TORCH_DTYPES[dtype])
                    descs[name + suffix] = f"tensordesc<{dtype}[{rows}, {cols}],{layout!r}>"
                else:                  # no second column tile: the launch passes None (a constexpr)
                    nones[name + suffix] = None
        # ELSA's partitions (summary or out), a tile walk over key ranges (CQSA's resident forward: out, lse) and
        # PASA's step (float16 only) with its fp16 and its fp32 (hybrid) state
        modes = ("out", "summary", "walk", "pasa", "pasa_fp32") if dtype == "fp16" else ("out", "summary", "walk")
        # the persistent launch where launch() takes it (PERSISTENT_DIMS: every mode but the walk)
        persist = (False, True) if d in gc.PERSISTENT_DIMS else (False,)
        for causal, mode in itertools.product((False, True), modes):
            # three consumer warpgroups where consumers_for may pick them (for PASA only its fp16 state not causal:
            # kernels/pasa/ops.py's pasa_consumers)
            three = d in gc.THREE_CONSUMER_DIMS and ((mode == "pasa" and not causal) or not mode.startswith("pasa"))
            counts = (2, 3) if three else (2,)
            for persistent, consumers in itertools.product(persist if mode != "walk" else (False,), counts):
                meta = dict(nones, BLOCK_N=block_n, STAGES=stages, D1=d1, CAUSAL=causal, PINGPONG=consumers == 2,
                            SUMMARY=mode == "summary", LSE_MODE={"out": 2, "walk": 1}.get(mode, 0),
                            RANGES=mode == "walk",
                            PASA={"pasa": gc.PASA_STATES["fp16"], "pasa_fp32": gc.PASA_STATES["fp32"]}.get(mode, 0),
                            PERSISTENT=persistent, CONSUMERS=consumers, CONSUMER_REGS=gc.REGS[consumers][0],
                            LOADER_REGS=gc.REGS[consumers][1], LAUNCH_DEPENDENTS=mode == "summary")
                label = dict(D=d, causal=causal, mode=mode, persistent=persistent, cfg=[block_n, stages])
                if consumers != 2:
                    label["consumers"] = consumers
                jobs.append(Job("gluon_core", "fwd", gc._gluon_fwd_kernel, dtype, meta, 4, 1, {"Out"},
                                {"Lse", "Sbuf"}, i32_ptrs={"Items", "Ranges"}, floats={"qk_scale", "pasa_c"},
                                descs=descs, gluon=True, label=label))
        if d in gb.HEAD_DIMS:
            # the backward (kernels/_gluon_bwd.py): Q and dO tiles of BLOCK_M rows, each consumer's K and V of BLOCK_N;
            # causal in both launch orders (heads_fastest_pays)
            for causal, heads_fastest in ((False, False), (True, False), (True, True)):
                for bm, bn, stages, dq_cols in (BWD_TILE_CANDIDATES if tiles else [gb.TILES[(d, causal)]]):
                    if (d // 2) % dq_cols:
                        continue
                    descs = {f"{name}_desc": f"tensordesc<{dtype}[{rows}, {d}],"
                                             f"{gc.descriptor_layout(rows, d, TORCH_DTYPES[dtype])!r}>"
                             for name, rows in (("q", bm), ("do", bm), ("k", bn), ("v", bn))}
                    descs["dq_desc"] = (f"tensordesc<fp32[{bm}, {dq_cols}],"
                                        f"{gc.descriptor_layout(bm, dq_cols, torch.float32)!r}>")
                    jobs.append(Job("gluon_core", "bwd", gb._gluon_bwd_kernel, dtype,
                                    dict(CAUSAL=causal, STAGES=stages, CONSUMER_REGS=gb.CONSUMER_REGS,
                                         LOADER_REGS=gb.LOADER_REGS, HEADS_FASTEST=heads_fastest), 4, 1,
                                    {"DK", "DV"}, {"Lse", "Delta"},
                                    floats={"qk_scale", "sm_scale", "lse_scale"}, descs=descs, gluon=True,
                                    label=dict(D=d, causal=causal, heads_fastest=heads_fastest,
                                               cfg=[bm, bn, stages, dq_cols])))
            # its prologue (a Triton kernel): Delta and the zeroed dQ buffer
            jobs.append(Job("gluon_core", "bwd_prologue", gb._prologue, dtype, dict(D=d, ROWS=gb.PROLOGUE_ROWS), 4,
                            1, {"DO", "O"}, {"Delta", "DQ"}, div16=re.compile(r"^so_[bhn]$").match,
                            label=dict(D=d)))
    return jobs


# the variant --inductor-writes adds for each kernel that takes a bias: causal, with the bias and its gradient
BIASED_CAUSAL = dict(HAS_BIAS=True, BIAS_GRAD=True, CAUSAL=True)


def check_inductor_writes(kernel: str, dtypes, dims, target: GPUTarget) -> int:
    """--inductor-writes: each shipped Triton kernel of the packages handed to inductor, once per job (Gluon
    kernels are never handed over): the tensors torch's analysis counts as written; 1 if any is read-only."""
    failures, seen = 0, set()
    for name in sorted(TRACED_KERNELS if kernel == "all" else {kernel} & TRACED_KERNELS):
        jobs = KERNELS[name](dtypes, dims, False)
        # and each kernel that takes a bias causal with the bias and its gradient, which the shipped jobs leave out
        jobs += [dataclasses.replace(job, constexprs={**job.constexprs, **BIASED_CAUSAL},
                                     label={**job.label, "bias": True, "causal": True})
                 for job in jobs if not job.gluon and "HAS_BIAS" in job.fn.arg_names and
                 not job.constexprs.get("HAS_BIAS")]
        for job in jobs:
            what = f"{job.kernel} {job.name} {job.dtype} " + " ".join(f"{k}={v}" for k, v in job.label.items()
                                                                        if k != "ws")
            if job.gluon or what in seen:
                continue
            seen.add(what)
            written = inductor_writes(job, target)
            wrong = sorted(written & read_only(job))
            failures += bool(wrong)
            print(f"{what}: writes {', '.join(sorted(written)) or 'nothing'}"
                  + (f" (and reads only {', '.join(wrong)}: a compiled graph would copy into them)" if wrong else ""),
                  flush=True)
    if kernel != "all" and kernel not in TRACED_KERNELS:
        print(f"{kernel}: its kernels are launched directly, not handed to inductor: nothing to check", flush=True)
    print(f"{len(seen)} kernels analysed: {failures} write a tensor they only read", flush=True)
    return 1 if failures else 0


KERNELS = {"elsa": elsa_jobs, "cron_root": cron_root_jobs, "pasa": pasa_jobs, "cqsa": cqsa_jobs,
           "flash_core": flash_core_jobs, "gluon_core": gluon_core_jobs}


def _target(text: str) -> str:
    """--target backend:arch:warp size, e.g. cuda:90:32 (checked here, made a GPUTarget by main)."""
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in ("cuda", "hip") or not parts[1].isdigit() or not parts[2].isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: need backend:arch:warp size, the backend cuda or hip, "
                                         "e.g. cuda:90:32")
    return text


def main(argv=None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", required=True, choices=[*KERNELS, "all"])
    p.add_argument("--dtypes", type=name_list, default=("fp16", "bf16", "fp32"),
                   help="element types of the inputs (PASA: always fp16)")
    p.add_argument("--dims", type=head_dims, default=(64, 128), help="head dims")
    p.add_argument("--tiles", action="store_true", help="the candidate tiles of a tuning sweep, not the shipped ones")
    p.add_argument("--ws-only", action="store_true",
                   help="only the warp-specialized variants, Gluon kernels included (their row double-offset audit)")
    p.add_argument("--target", type=_target, default="cuda:90:32", help="backend:arch:warp size")
    p.add_argument("--sass", action="store_true",
                   help="print each job's SASS digest too (in --json always): equal on two trees = the same code")
    p.add_argument("--json", type=output_file, help="write every row here")
    p.add_argument("--inductor-writes", action="store_true",
                   help="compile nothing: what torch's analysis counts as written by each kernel handed to inductor "
                        "(ELSA's Triton kernels); exit 1 where that includes a tensor the kernel only reads")
    a = p.parse_args(argv)
    backend, arch, warp = a.target.split(":")
    dtypes, dims, target = list(a.dtypes), list(a.dims), GPUTarget(backend, int(arch), int(warp))
    bad = [x for x in dtypes if x not in TORCH_DTYPES]
    if bad:
        p.error(f"argument --dtypes: {bad[0]!r}: allowed {', '.join(TORCH_DTYPES)}")
    if a.inductor_writes:
        return check_inductor_writes(a.kernel, dtypes, dims, target)
    rows, failures = [], 0
    for kernel in (KERNELS if a.kernel == "all" else [a.kernel]):
        jobs = KERNELS[kernel](dtypes, dims, a.tiles)
        if a.ws_only:                # the Triton core's warp-specialized variants, and every Gluon kernel
            jobs = [job for job in jobs if job.gluon or job.constexprs.get("WARP_SPECIALIZE")]
        for job in jobs:
            row = dict(kernel=job.kernel, function=job.name, dtype=job.dtype, **job.label)
            try:
                row.update(compile_job(job, target))
            except Exception as exc:   # a compile error is a finding: report it and go on
                failures += 1
                row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
            rows.append(row)
            what = " ".join(f"{k}={v}" for k, v in job.label.items())
            if "error" in row:
                print(f"{job.kernel} {job.name} {job.dtype} {what}: {row['error']}", flush=True)
            else:
                print(f"{job.kernel} {job.name} {job.dtype} {what}: regs={row.get('regs')} "
                      f"spill_stack={row.get('spill_stack')} shared={row['shared']} warps={row['warps']} wgmma={row['wgmma']} "
                      f"cp_async={row['cp_async']}" + ("" if row["fits_smem"] else " (over sm_90's shared memory)")
                      + (" (wgmma serialized by ptxas)" if row["wgmma_serialized"] and not job.gluon else "")
                      + (f" sts_narrow={row['sts_narrow']}" if job.gluon else "")
                      + (f" sass={row['sass_sha256']}" if a.sass else ""), flush=True)
                for hazard in row["ws_hazards"]:
                    failures += 1
                    print(f"  warp-specialization row double offset: {hazard}", flush=True)
                if row["wgmma_serialized"] and job.gluon:
                    failures += 1
                    print("  every wgmma waited on: ptxas serialized them (C7514)", flush=True)
    spilled = sum(1 for r in rows if r.get("spill_stack"))
    print(f"{len(rows)} compiled for {a.target}: {failures} failed, {spilled} spill", flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(dict(target=a.target, triton=triton.__version__, rows=rows), indent=1,
                                           default=str) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
