#!/usr/bin/env python3
"""Compile PASA's Triton kernels for sm_90 without a GPU and report registers, spills, shared memory and
wgmma use per (variant, D, causal, tile config): a cheap filter before `scripts/tune.py --kernel pasa` spends
device time (a config that spills, or whose P·V is not a wgmma, is not worth timing).

    PYTHONPATH=. python3 scripts/gpu/pasa_compile_check.py [--variants ref,fused] \
        [--dims 64,128] [--configs D:bm,bn,w,s;...] [--json out.json]

Method as in cron_root/elsa_compile_check.py (through sm90_compile.py): ASTSource + triton.compile for an
explicit target, resource usage from the cuobjdump shipped with Triton; arguments specialised like a launch
on contiguous tensors (pointers divisible by 16, N a plain i32, c an fp32). STATE = fp16 (the paper's
allocation); `--state fp32` compiles the hybrid mode. The candidates default to CANDIDATES below.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sm90_compile  # noqa: E402
from sm90_compile import compile_usage, launch_signature, parse_target  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from kernels.pasa import kernel as K  # noqa: E402
from kernels.pasa.attention import VARIANTS  # noqa: E402

PTRS = {"Q", "KS", "V", "O", "K"}
FLOATS = {"c_arg", "diag", "off", "qk_scale"}
NO_STRIDES = re.compile(r"^$")     # the kernels take no stride arguments (contiguous [B, H, N, D])
# the tile candidates the GPU sweep times (kept here so this script runs without torch.cuda)
# static PTX instruction counts next to the resource usage (both loops, unmasked and masked, are in the PTX)
PTX_COUNTS = {"cvt_f16x2": "cvt.rn.f16x2.f32", "cvt_f32_f16": "cvt.f32.f16", "ex2": "ex2.approx",
              "wgmma_wait": "wgmma.wait_group"}
_compiled = []


def _capture(*args, **kwargs):   # keep the compiled kernel that compile_usage makes, for its PTX
    cc = _triton_compile(*args, **kwargs)
    _compiled.append(cc)
    return cc


_triton_compile = triton.compile
sm90_compile.triton.compile = _capture
CANDIDATES = {
    64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 4, 3), (64, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
}


def compile_main(variant: str, d: int, cfg, causal: bool, state, target) -> dict:
    bm, bn, warps, stages = cfg
    meta = dict(BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=d, CAUSAL=causal, STATE=state, FUSED=VARIANTS[variant])
    sig, consts, attrs = launch_signature(K._pasa_fwd_kernel, meta, "fp16", PTRS, set(), FLOATS, NO_STRIDES)
    usage = compile_usage(K._pasa_fwd_kernel, sig, consts, attrs, warps, stages, target)
    ptx = _compiled.pop().asm.get("ptx", "")
    usage.update({k: ptx.count(pat) for k, pat in PTX_COUNTS.items()})
    return usage


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="cuda:90:32")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--dims", default="64,128")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--state", default="fp16", choices=("fp16", "fp32"))
    p.add_argument("--configs", default="", help="'D:bm,bn,w,s;D:…' instead of the sweep's candidates")
    p.add_argument("--json")
    a = p.parse_args()
    target = parse_target(a.target)
    state = {"fp16": tl.float16, "fp32": tl.float32}[a.state]
    cands = CANDIDATES
    if a.configs:
        cands = {}
        for part in a.configs.split(";"):
            d, cfg = part.split(":")
            cands.setdefault(int(d), []).append(tuple(int(x) for x in cfg.split(",")))
    rows = []
    for d in (int(x) for x in a.dims.split(",")):
        for cfg in cands[d]:
            for causal in (bool(int(x)) for x in a.causal.split(",")):
                for variant in a.variants.split(","):
                    row = dict(variant=variant, D=d, causal=causal, state=a.state, cfg=list(cfg))
                    try:
                        row.update(compile_main(variant, d, cfg, causal, state, target))
                    except Exception as exc:  # out of shared memory, etc.: report and go on
                        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                    rows.append(row)
                    print(f"{variant:10s} D={d:3d} causal={int(causal)} cfg={row['cfg']}: " + (
                        f"regs={row.get('regs')} spill_stack={row.get('spill_stack')} shared={row.get('shared')} "
                        f"wgmma={row.get('wgmma')} cp_async={row.get('cp_async')} "
                        + " ".join(f"{k}={row.get(k)}" for k in PTX_COUNTS)
                        + ("" if row.get("fits_smem") else " (over sm_90's shared memory: cannot launch)")
                        if "error" not in row else row["error"]), flush=True)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"target": a.target, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
