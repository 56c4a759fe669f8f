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
PTR32 = {"LSE", "STATE", "WS", "MST", "SST", "ACC"}
NOT_DIV16 = {"H", "HKV", "GROUP", "N_OUT", "N_ROWS", "off_m", "off_l", "off_delta", "off_dk", "off_dv", "causal_off",
             "qk_scale", "sm_scale", "first", "last", "mscale", "n", "g0", "N"}


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
    rows = []
    dts = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    for dt in ("fp16", "bf16", "fp32"):
        for d in (16, 40, 64, 80, 128, 256):          # every head-dim bucket, padded (40, 80) and not
            prec = "tf32x3" if dt == "fp32" else "tf32"
            tiles = K.default_tiles(d, dts[dt], "cuda")
            for name, fn, extra in (("fwd", K.cqsa_fwd_kernel, dict(MODE=1)), ("fwd", K.cqsa_fwd_kernel, dict(MODE=0)),
                                    ("dq", K.cqsa_bwd_dq_kernel, dict(DELTA_FROM_O=True)),
                                    ("dkdv", K.cqsa_bwd_dkdv_kernel, {})):
                for causal in (False, True):
                    consts = K.constexprs(name, d, tiles, causal, prec, **extra)
                    warps, stages = consts.pop("num_warps"), consts.pop("num_stages")
                    # MODE 0 writes fp32 partials (OUT fp32)
                    r = compile_variant(fn, dt, consts, warps, stages,
                                        fp32_ptrs=("OUT",) if extra.get("MODE") == 0 else ())
                    r.update(kernel=fn.__name__, dtype=dt, head_dim=d, causal=causal,
                             config=[consts["BLOCK_M"], consts["BLOCK_N"], warps, stages], **extra)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
        # the streaming row-chunk finaliser (O in the input dtype)
        fn = K.cqsa_finalize_kernel
        r = compile_variant(fn, dt, dict(HEAD_DIM=128, BLOCK_D=128, BLOCK=K.FINAL_BLOCK), 4, 1)
        r.update(kernel=fn.__name__, dtype=dt, head_dim=128, config=[K.FINAL_BLOCK, 4])
        rows.append(r)
        print(json.dumps(r), flush=True)
    out = dict(triton=triton.__version__, target="sm_90 (ptxas -v for sm_90a)", rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    spills = [r for r in rows if r.get("spill_store_bytes") and r["dtype"] != "fp32"]
    print(f"{len(rows)} variants; 16-bit variants that spill: {len(spills)}")


if __name__ == "__main__":
    main()
