#!/usr/bin/env python3
"""Compile the Cron Root Triton kernels ahead of time for a GPU target without needing the GPU, and report
per kernel/config: registers, spills (local memory), shared memory. Catches GPU-only compile errors that the
CPU interpreter cannot see, and configs that spill or exceed shared memory.

    python3 scripts/gpu/cron_root_compile_check.py [--target cuda:90:32] [--json out.json]

Uses the Triton AOT path (ASTSource + triton.compile with an explicit target) and the cuobjdump that ships
with Triton for the resource usage. Arguments are specialised like a launch on contiguous [B, H, N, D]
tensors: pointers and strides divisible by 16, the D stride is 1 (not passed), N/W/slot counts plain i32.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90_compile import compile_usage, launch_signature, parse_target  # noqa: E402
from kernels.cron_root import kernel as tk  # noqa: E402
import torch  # noqa: E402
from kernels.cron_root.attention import _block_d, default_gpu_configs  # noqa: E402

PTR_ARGS = {"Q", "K", "V", "RK", "RV", "O", "LSE", "DO", "DQ", "DELTA", "DG_K", "DG_V", "DK", "DV"}
FP32_PTRS = {"LSE", "DELTA", "DG_K", "DG_V"}
FLOAT_ARGS = {"qk_scale", "scale", "inv_w"}
STRIDE_RE = re.compile(r"^s[a-z]+[bhn]$")


def compile_one(fn, dtype, d, cfg, prec, target):
    meta = {k: v for k, v in cfg.items() if k.startswith("BLOCK_")}
    meta.update(HEAD_DIM=d, BLOCK_D=_block_d(d), PREC=prec)
    sig, consts, attrs = launch_signature(fn, meta, dtype, PTR_ARGS, FP32_PTRS, FLOAT_ARGS, STRIDE_RE)
    return compile_usage(fn, sig, consts, attrs, cfg.get("num_warps", 4), cfg.get("num_stages", 3), target)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="cuda:90:32")
    p.add_argument("--json")
    p.add_argument("--dims", default="64,128")
    p.add_argument("--dtypes", default="fp16,bf16,fp32")
    p.add_argument("--precs", default="tf32x3,ieee", help="fp32 dot precisions to compile")
    args = p.parse_args()
    target = parse_target(args.target)
    kernels = {"fwd": tk._fwd, "fwd_small": tk._fwd, "dq": tk._bwd_dq, "glob": tk._bwd_global, "loc": tk._bwd_local}
    rows, failures = [], 0
    for d in (int(x) for x in args.dims.split(",")):
        for dtype in args.dtypes.split(","):
            precs = args.precs.split(",") if dtype == "fp32" else ["tf32"]
            for prec in precs:
                for kname, fn in kernels.items():
                    tdtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
                    cfg = default_gpu_configs(d, tdtype, prec if dtype == "fp32" else "tf32x3")[kname]
                    row = dict(kernel=kname, D=d, dtype=dtype, prec=prec, cfg=cfg)
                    try:
                        row.update(compile_one(fn, dtype, d, cfg, prec, target))
                    except Exception as exc:  # report and continue
                        failures += 1
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                    rows.append(row)
                    print(f"{kname:9s} D={d:3d} {dtype} {prec:6s} " + (
                        f"regs={row.get('regs')} spill_stack={row.get('spill_stack')} shared={row.get('shared')}"
                        if "error" not in row else row["error"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(target=args.target, rows=rows), f, indent=1)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
