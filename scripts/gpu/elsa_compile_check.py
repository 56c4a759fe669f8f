#!/usr/bin/env python3
"""Compile ELSA's Triton kernels for sm_90 without a GPU and report registers, spills and shared memory per
tile config: a pre-filter for the configs `scripts/tune.py --kernel elsa` times on the H100 (a config that spills
hundreds of registers is not worth device time).

    python3 scripts/gpu/elsa_compile_check.py [--dtype float32] [--dim 128] [--json out.json]

Same method as cron_root_compile_check.py (both through sm90_compile.py): ASTSource + triton.compile for an explicit target, resource usage
from the cuobjdump that ships with Triton; arguments specialised like a launch on contiguous [B, H, N, D]
tensors (pointers and strides divisible by 16, N and H plain i32). Non-causal, no bias.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90_compile import compile_usage, launch_signature, parse_target  # noqa: E402
from kernels.elsa import kernel as tk  # noqa: E402

FP32_PTRS = {"L2", "Delta", "dBias", "Msum", "Zsum", "Ssum", "Mrow", "Zrow"}
PTRS = {"Q", "K", "V", "dOut", "dQ", "dK", "dV", "Bias", "Out"} | FP32_PTRS
FLOATS = {"qk_scale", "sm_scale"}
STRIDE = re.compile(r"^s[a-z]+$")
KERNELS = {"phase1": tk._elsa_phase1, "dq": tk._elsa_bwd_dq, "dkdv": tk._elsa_bwd_dkdv}


def compile_one(fn, dtype, d, bm, bn, warps, stages, target):
    fp32 = dtype == "float32"
    meta = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=False, HAS_BIAS=False, BIAS_GRAD=False, FOLD_Q=fp32,
                SCALE_IN_EXP=not fp32, DOT_PREC="tf32x3" if fp32 else "tf32")
    tdt = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[dtype]
    sig, consts, attrs = launch_signature(fn, meta, tdt, PTRS, FP32_PTRS, FLOATS, STRIDE)
    return compile_usage(fn, sig, consts, attrs, warps, stages, target)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="cuda:90:32")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--kernels", default="phase1,dq,dkdv")
    p.add_argument("--blocks", default="32,64,128")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="2,3")
    p.add_argument("--json")
    a = p.parse_args()
    target = parse_target(a.target)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    rows = []
    for kname in a.kernels.split(","):
        for bm, bn, w, st in itertools.product(ints(a.blocks), ints(a.blocks), ints(a.warps), ints(a.stages)):
            if bm * bn > 128 * 128 or (w == 8 and bm * bn < 64 * 64):
                continue
            row = dict(kernel=kname, dtype=a.dtype, D=a.dim, cfg=[bm, bn, w, st])
            try:
                row.update(compile_one(KERNELS[kname], a.dtype, a.dim, bm, bn, w, st, target))
            except Exception as exc:  # out of shared memory, etc.: report and go on
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            rows.append(row)
            print(f"{kname:6s} {a.dtype} D={a.dim} cfg={row['cfg']}: " + (
                f"regs={row.get('regs')} spill_stack={row.get('spill_stack')} shared={row.get('shared')}"
                + ("" if row.get("fits_smem") else " (over sm_90's shared memory: cannot launch)")
                if "error" not in row else row["error"]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"target": a.target, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
