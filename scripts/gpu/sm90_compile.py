"""Ahead-of-time compilation of a Triton kernel for a GPU target without the GPU, and its resource usage:
registers, spill stack (cuobjdump of the cubin), shared memory and whether it fits sm_90's 227 KB, and the
wgmma / cp.async instructions in the PTX. Shared by the *_compile_check.py scripts."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

SMEM_MAX = 232448   # sm_90: 227 KB of shared memory per block (opt-in); a config above it cannot launch


def parse_target(text: str) -> GPUTarget:
    """"cuda:90:32" → GPUTarget("cuda", 90, 32)."""
    backend, arch, warp = text.split(":")
    return GPUTarget(backend, int(arch), int(warp))


def launch_signature(fn, constexprs: dict, dtype: str, ptrs: set, fp32_ptrs: set, floats: set, stride_re):
    """(signature, constexprs, attrs) as a launch on contiguous tensors specialises them: the constexprs as
    given, pointers (`dtype`, or fp32 for `fp32_ptrs`) and strides (names matching `stride_re`) divisible by
    16, `floats` as fp32, every other argument a plain i32."""
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name], consts[name] = "constexpr", constexprs[name]
        elif name in ptrs or name in fp32_ptrs:
            sig[name] = "*fp32" if name in fp32_ptrs else f"*{dtype}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if stride_re.match(name):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def compile_usage(fn, signature: dict, constexprs: dict, attrs: dict, num_warps: int, num_stages: int,
                  target: GPUTarget) -> dict:
    """Compile `fn` (a @triton.jit function) for `target`; return shared, fits_smem, regs, spill_stack, wgmma, cp_async."""
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages})
    cc = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), target=target,
                        options=options.__dict__)
    ptx = cc.asm.get("ptx", "")
    usage = {"shared": cc.metadata.shared, "fits_smem": cc.metadata.shared <= SMEM_MAX,
             "wgmma": ptx.count("wgmma.mma_async"), "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca")}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cc.asm["cubin"])
    try:
        out = subprocess.run([os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"),
                              "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if m:
        usage.update(regs=int(m.group(1)), spill_stack=int(m.group(2)))
    return usage
