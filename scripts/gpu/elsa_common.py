"""Shared helpers for the ELSA GPU scripts (tuning and benchmark): inputs, SDPA baselines, timing, accuracy."""
from __future__ import annotations

import json
import math
import os
import time

import torch
import triton

from kernels.elsa import elsa_attention, trace_launches


def make_inputs(B, H, N, D, dtype, grad=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn((B, H, N, D), generator=g, device="cuda", dtype=torch.float32).to(dtype).requires_grad_(grad)
            for _ in range(3)]


def sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn(q, k, v, causal=False):
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn


BASELINES = {"flash": sdpa("FLASH_ATTENTION"), "cudnn": sdpa("CUDNN_ATTENTION"),
             "efficient": sdpa("EFFICIENT_ATTENTION"), "math": sdpa("MATH")}


def bench_ms(fn, est_hint_ms=None):
    """Median ms of fn() via triton.testing.do_bench (L2 flushed between calls by do_bench)."""
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def peak_mib(fn):
    """Peak allocated memory above what was allocated before the call (inputs excluded), MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def sampled_max_abs(out, q, k, v, causal, n_rows=192):
    """max |out - float64 reference| over sampled query rows (first, last, random)."""
    N = q.shape[2]
    rows = torch.unique(torch.cat([torch.arange(0, min(N, 64)), torch.arange(max(0, N - 64), N),
                                   torch.randint(0, N, (n_rows - 128,), generator=torch.Generator().manual_seed(3))])).cuda()
    s = torch.matmul(q.detach()[:, :, rows].double(), k.detach().double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        cols = torch.arange(N, device="cuda")
        s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
    ref = torch.matmul(torch.softmax(s, -1), v.detach().double())
    return (out.detach()[:, :, rows].double() - ref).abs().max().item()


def compiled_info(fn):
    """(kernel -> (n_regs, n_spills)) of the kernels launched by fn()."""
    with trace_launches() as events:
        fn()
    info = {}
    for e in events:
        c = e.get("compiled")
        if c is not None:
            info[e["kernel"]] = (getattr(c, "n_regs", None), getattr(c, "n_spills", None))
    return info


def fwd_flops(B, H, N, D, causal):
    return 4.0 * B * H * N * N * D * (0.5 if causal else 1.0)


class Budget:
    def __init__(self, seconds):
        self.t0 = time.time()
        self.seconds = seconds

    def left(self):
        return self.seconds - (time.time() - self.t0)

    def ok(self, need=0.0):
        return self.left() > need


def write_json(path, obj):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


def gpu_header():
    p = torch.cuda.get_device_properties(0)
    return {"gpu": p.name, "sms": p.multi_processor_count, "torch": torch.__version__, "triton": triton.__version__,
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


__all__ = ["make_inputs", "BASELINES", "bench_ms", "peak_mib", "sampled_max_abs", "compiled_info", "fwd_flops",
           "Budget", "write_json", "gpu_header", "elsa_attention"]
