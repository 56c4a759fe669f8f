"""Compile every Stream-CQSA kernel variant for sm_90 without a GPU and report registers and spills.

    PYTHONPATH=. python3 scripts/gpu/cqsa_compile_check.py --out results/dev/cqsa/sm90_compile_check.json

Uses Triton's ahead-of-time compile with the same specialisation a real launch gets (pointers and
strides divisible by 16), then ptxas -v from the Triton wheel. It checks that each (dtype, head dim,
causal, mode) variant compiles for Hopper, uses wgmma and cp.async-pipelined loads, and which tile
configurations spill — a cheap first filter before any device time is spent.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.cqsa import kernel as K

PTR16 = {"Q", "K", "V", "DO", "OUT", "DQ", "DK", "DV", "O"}
PTR32 = {"LSE", "ACC", "MST", "LST", "LSE2", "DELTA", "DQACC", "DKACC", "DVACC", "OUTI", "LSEI", "SST"}
NOT_DIV16 = {"H", "qk_scale", "sm_scale", "first", "last", "mscale", "n", "g0"}


def _ptxas():
    here = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cands = sorted(glob.glob(os.path.join(here, "ptxas*")), key=lambda p: ("blackwell" not in p, p))
    for p in cands:                      # the first one that accepts the PTX version Triton emits
        yield p


def compile_variant(fn, dtype: str, consts: dict, warps: int, stages: int, fp32_ptrs=()) -> dict:
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        if name in fp32_ptrs:
            sig[name] = "*fp32"
        elif name in PTR16:
            sig[name] = "*" + dtype
        elif name in PTR32:
            sig[name] = "*fp32"
        elif name in ("ITEMS", "RANGES"):
            sig[name] = "*i32"
        elif name in ("qk_scale", "sm_scale", "mscale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if name not in NOT_DIV16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    ptx = ck.asm["ptx"]
    row = dict(shared_bytes=getattr(ck.metadata, "shared", None), wgmma=ptx.count("wgmma.mma_async"),
               cp_async=ptx.count("cp.async.cg") + ptx.count("cp.async.ca"))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    for ptxas in _ptxas():
        r = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                           text=True)
        regs = re.findall(r"Used (\d+) registers", r.stderr)
        if regs:
            row["registers"] = int(regs[0])
            row["spill_store_bytes"] = int(re.findall(r"(\d+) bytes spill stores", r.stderr)[0])
            break
    os.unlink(f.name)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cuda = torch.device("cuda")
    rows = []
    dts = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    for dt, d in [("fp16", 128), ("bf16", 128), ("fp16", 64), ("bf16", 64), ("fp16", 32), ("fp32", 128), ("fp32", 64),
                  ("fp32", 32)]:
        prec = "tf32x3" if dt == "fp32" else "ieee"
        for kind, fns in (("fwd", [K.cqsa_fwd_kernel]), ("bwd", [K.cqsa_bwd_dq_kernel, K.cqsa_bwd_dkdv_kernel])):
            bm, bn, w, st = K.config(kind, d, dts[dt], cuda)
            for fn in fns:
                for causal in (False, True):
                    for mode in ((0, 1) if kind == "fwd" else (None,)):
                        consts = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, PRECISION=prec)
                        if mode is not None:
                            consts["MODE"] = mode
                        r = compile_variant(fn, dt, consts, w, st)
                        r.update(kernel=fn.__name__, dtype=dt, head_dim=d, causal=causal, mode=mode,
                                 config=[bm, bn, w, st])
                        rows.append(r)
                        print(json.dumps(r), flush=True)
                        if mode == 1:
                            # streaming merge="kernel": the accumulator is passed as OUT (fp32, never stored)
                            r = compile_variant(fn, dt, consts, w, st, fp32_ptrs=("OUT",))
                            r.update(kernel=fn.__name__, dtype=dt, head_dim=d, causal=causal, mode=mode,
                                     config=[bm, bn, w, st], note="streaming merge=kernel (OUT fp32)")
                            rows.append(r)
                            print(json.dumps(r), flush=True)
        # the streaming row-chunk finaliser (O in the input dtype)
        fn = K.cqsa_finalize_kernel
        r = compile_variant(fn, dt, dict(HEAD_DIM=d, BLOCK=K.FINAL_BLOCK), 4, 1)
        r.update(kernel=fn.__name__, dtype=dt, head_dim=d, config=[K.FINAL_BLOCK, 4])
        rows.append(r)
        print(json.dumps(r), flush=True)
    out = dict(triton=triton.__version__, target="sm_90 (ptxas -v for sm_90a)", rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
