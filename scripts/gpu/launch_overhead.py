"""Host cost per call on the GPU machine: where the time of a small (launch-bound) attention call goes.

    PYTHONPATH=. python3 scripts/gpu/launch_overhead.py --out $OUT

Each figure is host wall time per call over a loop of calls with no synchronisation inside (the shapes are
small enough that the GPU finishes each call before the host has issued the next: the loop is host-bound),
so it is the price a caller pays per call before the GPU work matters. Writes launch_overhead.json.
Compared: the public Cron Root / ELSA calls, the same kernels' bare Triton JIT launch with precomputed
arguments, the compiled kernel's own launcher (CompiledKernel.run, skipping the JIT's binding and cache
lookup), the torch.compiler.disable wrapper, and SDPA flash as the reference point.
All of those run with the fast launch path (kernels/_launch.py, on by default) OFF, as before it existed. The last
section times the same API calls (same shapes) with it off and on ("*_fastoff" / "*_faston"), the bare
kernels._launch.launch of the Cron Root forward, and the max |difference| of outputs and gradients on vs off
(expected 0.0; the bit-identity test is tests/test_launch.py::test_gpu_fast_launch_bit_identical).
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import kernels._launch as fast_launch
import kernels.cron_root.attention as cra
from kernels.elsa import elsa_attention


def per_call_us(fn, n=400) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / n * 1e6


def direct_launcher(jit_fn, grid, args, kwargs):
    """Launch the compiled kernel through CompiledKernel.run with the JIT's argument order (constexprs
    included; the launcher skips them), bypassing binding, specialisation and the cache lookup."""
    ck = jit_fn[grid](*args, **kwargs)
    names = jit_fn.arg_names
    params = inspect.signature(jit_fn.fn).parameters
    vals = dict(zip(names, args))
    for nm in names[len(args):]:
        vals[nm] = kwargs[nm] if nm in kwargs else params[nm].default
    bound = [vals[nm] for nm in names]
    g = tuple(grid) + (1,) * (3 - len(grid))
    stream = torch.cuda.current_stream().cuda_stream

    def go():
        ck.run(g[0], g[1], g[2], stream, ck.function, ck.packed_metadata, None, None, None, *bound)
    return go


ELSA_SHAPES = {"vit224": (8, 3, 197, 64), "swin_win": (512, 3, 49, 32)}


def cron_fwd_launch(q, k, v):
    """(grid, args, constexprs) of the Cron Root forward launch for fp16 q, k, v without relay keys, as
    cron_root_forward builds them (its tile choice included), with fresh o and lse (args[5], args[6])."""
    b, h, n, d = q.shape
    cfg = cra._configs(d, q.dtype, "tf32x3", q.device, None)
    use_small = cra.triton_cdiv(n, cfg["fwd"]["BLOCK_M"]) * b * h < 2 * cra._num_sms(q.device)
    meta, opts = cra._launch_opts(cfg["fwd_small" if use_small else "fwd"])
    o = torch.empty_like(q)
    lse = torch.empty((b * h, n), dtype=torch.float32, device=q.device)
    grid = (cra.triton_cdiv(n, meta["BLOCK_M"]), b * h)
    args = (q, k, v, k, v, o, lse, *cra._strides(q), *cra._strides(k), *cra._strides(v), *cra._strides(o),
            h, n, cra.window(n), 0, 1 / math.sqrt(d) * cra._LOG2E)
    return grid, args, dict(HEAD_DIM=d, BLOCK_D=cra._block_d(d), PREC="tf32", **meta, **opts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    dev = torch.device("cuda")
    fast_launch.set_enabled(False)     # the figures below are the JIT path's, comparable with earlier runs
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton
    res["triton"] = triton.__version__

    def rec(name, fn, n=400):
        try:
            res[name] = round(per_call_us(fn, n), 2)
        except Exception as exc:      # a probe that fails is reported, the others still run
            res[name] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
        print(f"{name:45s} {res[name]}", flush=True)

    rec("torch.empty_cuda_us", lambda: torch.empty((8, 2048, 64), device=dev, dtype=torch.float16))
    for n_tok in (1024, 2048):
        q, k, v = (torch.randn(1, 8, n_tok, 64, device=dev, dtype=torch.float16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            rec(f"flash_fwd_N{n_tok}", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            rec(f"flash_fwdbwd_N{n_tok}",
                lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do), 200)
        rec(f"cron_fwd_api_N{n_tok}", lambda: cra.cron_root_attention(q, k, v))
        with torch.no_grad():
            rec(f"cron_fwd_api_nograd_N{n_tok}", lambda: cra.cron_root_attention(q, k, v))
            rec(f"cron_fwd_undecorated_N{n_tok}", lambda: cra.cron_root_attention.__wrapped__(q, k, v))
            rec(f"cron_forward_fn_N{n_tok}", lambda: cra.cron_root_forward(q, k, v, None, 8192, "tf32x3"))
        rec(f"cron_fwdbwd_api_N{n_tok}",
            lambda: torch.autograd.grad(cra.cron_root_attention(q, k, v), (q, k, v), do), 200)
        # the bare forward launch, arguments precomputed
        grid, args, kw = cron_fwd_launch(q, k, v)
        o = args[5]
        rec(f"cron_fwd_jit_launch_N{n_tok}", lambda: cra.tk._fwd[grid](*args, **kw))
        try:
            go = direct_launcher(cra.tk._fwd, grid, args, kw)
            rec(f"cron_fwd_compiled_run_N{n_tok}", go)
            go(); torch.cuda.synchronize()
            ref = cra.cron_root_attention(q.detach(), k.detach(), v.detach())
            o.zero_(); go(); torch.cuda.synchronize()
            res[f"cron_fwd_compiled_run_max_diff_N{n_tok}"] = float((o - ref).abs().max())
        except Exception as exc:
            res[f"cron_fwd_compiled_run_N{n_tok}"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
        print(res.get(f"cron_fwd_compiled_run_max_diff_N{n_tok}"), flush=True)
    # ELSA at ViT-T/224 attention shape (B=8, H=3, N=197, D=64) and a Swin window batch
    for label, shape in ELSA_SHAPES.items():
        q, k, v = (torch.randn(*shape, device=dev, dtype=torch.float16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        rec(f"elsa_fwd_api_{label}", lambda: elsa_attention(q, k, v))
        rec(f"elsa_fwdbwd_api_{label}", lambda: torch.autograd.grad(elsa_attention(q, k, v), (q, k, v), do), 200)
        rec(f"sdpa_fwd_{label}", lambda: F.scaled_dot_product_attention(q, k, v))
        rec(f"sdpa_fwdbwd_{label}", lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), do), 200)
    # where ELSA's host time goes: its internal forward/backward without autograd, and a profile of fwd+bwd
    import cProfile
    import io
    import pstats

    import kernels.elsa.attention as ea
    q, k, v = (torch.randn(8, 3, 197, 64, device=dev, dtype=torch.float16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    with torch.no_grad():
        rec("elsa_fwd_api_nograd_vit224", lambda: elsa_attention(q, k, v))
        rec("elsa__forward_stats_vit224", lambda: ea._forward(q, k, v, None, False, 0.125, "tf32x3", True, {}))
        out, mrow, zrow = ea._forward(q, k, v, None, False, 0.125, "tf32x3", True, {})
        rec("elsa__backward_vit224", lambda: ea._backward(do, q, k, v, out, mrow, zrow, None, False, False, 0.125,
                                                          "tf32x3", {}))
        rec("torch.cuda.device_ctx", lambda: torch.cuda.device(q.device).__enter__() or None)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        torch.autograd.grad(elsa_attention(q, k, v), (q, k, v), do)
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    Path(a.out, "elsa_fwdbwd_profile.txt").write_text(buf.getvalue())
    print(buf.getvalue()[:6000])
    fast_launch_section(rec, res, dev)
    elsa_breakdown(rec, res, dev)
    Path(a.out, "launch_overhead.json").write_text(json.dumps(res, indent=1))


def _fwdbwd(fn, q, k, v, do):
    """Output and gradients of one call, for the on/off comparison."""
    out = fn(q, k, v)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), do))


def fast_launch_section(rec, res, dev):
    """The public calls with the fast launch path off and on, same shapes as above."""
    cases = []
    for n_tok in (1024, 2048):
        t = tuple(torch.randn(1, 8, n_tok, 64, device=dev, dtype=torch.float16, requires_grad=True) for _ in range(4))
        cases.append((f"cron_{{}}_api_N{n_tok}", cra.cron_root_attention, t))
    for label, shape in ELSA_SHAPES.items():
        t = tuple(torch.randn(*shape, device=dev, dtype=torch.float16, requires_grad=True) for _ in range(4))
        cases.append((f"elsa_{{}}_api_{label}", elsa_attention, t))
    for name, fn, (q, k, v, do) in cases:
        outs = {}
        for mode in ("off", "on"):
            fast_launch.set_enabled(mode == "on")
            fast_launch.clear()
            rec(name.format("fwd") + f"_fast{mode}", lambda: fn(q, k, v))
            rec(name.format("fwdbwd") + f"_fast{mode}",
                lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do), 200)
            outs[mode] = _fwdbwd(fn, q, k, v, do)
        res[name.format("fwdbwd") + "_fast_max_diff"] = max(float((a.float() - b.float()).abs().max())
                                                             for a, b in zip(outs["off"], outs["on"]))
        print(name.format("fwdbwd") + "_fast_max_diff", res[name.format("fwdbwd") + "_fast_max_diff"], flush=True)
    # the bare forward launch through kernels._launch.launch, arguments precomputed (compare with
    # cron_fwd_jit_launch_N* and cron_fwd_compiled_run_N* above)
    grid, args, kw = cron_fwd_launch(*(torch.randn(1, 8, 1024, 64, device=dev, dtype=torch.float16) for _ in range(3)))
    for mode in ("off", "on"):
        fast_launch.set_enabled(mode == "on")
        rec(f"cron_fwd_launch_fn_N1024_fast{mode}", lambda: fast_launch.launch(cra.tk._fwd, grid, args, kw))
    rec("fast_launch_call_key_us", lambda: fast_launch.call_key(args, kw, 0, None), 2000)
    fast_launch.set_enabled(False)


class _Identity(torch.autograd.Function):
    """The cheapest custom autograd Function: what Function.apply + the backward engine cost by themselves."""
    @staticmethod
    def forward(ctx, q, k, v):
        return q.view_as(q)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


def elsa_breakdown(rec, res, dev):
    """ELSA fwd+bwd at the ViT-T/224 attention shape, piece by piece, with the fast launch path on (the
    default): each of its five launches through the JIT, through kernels._launch.launch and through the
    compiled launcher alone (arguments recorded from a real call), its allocations, plan, validation, the
    autograd machinery (an identity Function), and its internal forward/backward; "sum_*" adds the pieces
    for comparison with the measured API call ("unaccounted" is the difference)."""
    import kernels.elsa.attention as ea
    from kernels.elsa.config import plan_forward

    fast_launch.set_enabled(True)
    shape = ELSA_SHAPES["vit224"]
    B, H, N, D = shape
    q, k, v = (torch.randn(*shape, device=dev, dtype=torch.float16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    recorded = []
    real_launch = ea.launch

    def recording(fn, grid, args, kw):
        recorded.append((fn, grid, args, kw))
        return real_launch(fn, grid, args, kw)
    ea.launch = recording
    try:
        torch.autograd.grad(elsa_attention(q, k, v), (q, k, v), do)
    finally:
        ea.launch = real_launch
    torch.cuda.synchronize()
    p = "bd_"
    launch_sum = {"jit": 0.0, "fast": 0.0, "run": 0.0}
    for fn, grid, args, kw in recorded:
        name = fn.__name__
        rec(f"{p}{name}_jit", lambda: fn[grid](*args, **kw))
        rec(f"{p}{name}_fast", lambda: fast_launch.launch(fn, grid, args, kw))
        try:
            rec(f"{p}{name}_run", direct_launcher(fn, grid, args, kw))
        except Exception as exc:     # the launcher's calling convention changed: reported, the rest runs
            res[f"{p}{name}_run"] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
        for mode in launch_sum:
            val = res[f"{p}{name}_{mode}"]
            launch_sum[mode] += val if isinstance(val, float) else float("nan")
    res[f"{p}launches"] = len(recorded)
    with torch.no_grad():
        rec(f"{p}validate", lambda: ea._validate(q, k, v, False, None, "tf32x3", None, {}))
        rec(f"{p}unit_last_x3", lambda: (ea._unit_last(q), ea._unit_last(k), ea._unit_last(v)))
        rec(f"{p}on_device", lambda: ea._on_device(q).__enter__())
        rec(f"{p}plan_forward_cached", lambda: plan_forward(N, B * H, D, q.dtype, q.device))
        rec(f"{p}empty", lambda: torch.empty((B, H, N, D), dtype=q.dtype, device=dev))
        rec(f"{p}head_strides", lambda: ea._head_strides(q, k, v))
        rec(f"{p}_forward_stats", lambda: ea._forward(q, k, v, None, False, 0.125, "tf32x3", True, {}))
        out, mrow, zrow = ea._forward(q, k, v, None, False, 0.125, "tf32x3", True, {})
        rec(f"{p}_backward", lambda: ea._backward(do, q, k, v, out, mrow, zrow, None, False, False, 0.125, "tf32x3", {}))
    rec(f"{p}identity_function_fwdbwd", lambda: torch.autograd.grad(_Identity.apply(q, k, v), (q,), do), 400)
    api_nograd = torch.no_grad()(elsa_attention)
    rec(f"{p}api_fwd_nograd", lambda: api_nograd(q, k, v))
    rec(f"{p}api_fwd", lambda: elsa_attention(q, k, v))
    rec(f"{p}api_fwdbwd", lambda: torch.autograd.grad(elsa_attention(q, k, v), (q, k, v), do), 400)
    rec(f"{p}sdpa_fwdbwd", lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), do), 400)
    fast_launch.set_enabled(False)
    rec(f"{p}api_fwdbwd_fastoff", lambda: torch.autograd.grad(elsa_attention(q, k, v), (q, k, v), do), 400)
    fast_launch.set_enabled(True)
    for mode, val in launch_sum.items():
        res[f"{p}sum_launches_{mode}"] = round(val, 2)
    parts = {"api_fwdbwd": res[f"{p}api_fwdbwd"], "launches_fast": launch_sum["fast"],
             "_forward+_backward": res[f"{p}_forward_stats"] + res[f"{p}_backward"],
             "identity_function_fwdbwd": res[f"{p}identity_function_fwdbwd"]}
    # what the two internal functions and the autograd machinery leave unexplained in the API call
    res[f"{p}unaccounted_api_fwdbwd"] = round(parts["api_fwdbwd"] - parts["_forward+_backward"]
                                             - parts["identity_function_fwdbwd"], 2)
    res[f"{p}internal_minus_launches"] = round(parts["_forward+_backward"] - parts["launches_fast"], 2)
    for key in ("sum_launches_jit", "sum_launches_fast", "sum_launches_run", "unaccounted_api_fwdbwd",
                "internal_minus_launches"):
        print(f"{p}{key:42s} {res[p + key]}", flush=True)


if __name__ == "__main__":
    main()
