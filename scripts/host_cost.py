"""Host time per attention call at a launch-bound shape, for SDPA and our four kernels, and ELSA's call piece by
piece: what a call costs the CPU before the GPU work matters (issue 16: at most 1.5x SDPA for elsa, cron_root
and pasa, 2x for cqsa's resident path).

    PYTHONPATH=. python3 scripts/host_cost.py OUT.json                       # GPU machine
    python scripts/host_cost.py OUT.json --device cpu --n 32 --calls 2       # CPU: the plumbing, interpreted

Shape: B=1, H=1, N=128, D=64, float16 (--n, --dtype change it). A measurement is `--calls` calls in a row with no
synchronisation inside (at this shape the GPU finishes each call before the host has issued the next, so the
loop is host-bound) after `--warmup` calls and a synchronisation: host time per call = wall time of the loop /
calls. Each is repeated `--repeats` times; the median is reported (and the minimum, in the JSON).

Modes: fwd (inputs require grad, grad enabled: a training step's forward), fwd_nograd (inference), fwdbwd
(forward + torch.autograd.grad of q, k and v). Kernels: SDPA (PyTorch's own backend choice), elsa, cron_root
(causal: its only mode), pasa (forward only), cqsa (resident: inputs on the compute device).

ELSA's pieces, same shape, fast launch path on (kernels/_launch.py), inputs requiring grad where it matters:
  validate            the checks the first call of a signature runs (later calls: a cache lookup)
  public_fn           elsa_attention's own Python with the op replaced by a no-op
  signature           the plan key host.forward builds per call (shapes, strides, dtypes, devices, options)
  alloc_fwd/_bwd      the torch.empty calls of a training forward / a backward at this shape
  launch_fwd/_bwd     the prepared launches alone (buffers preallocated); *_jit: the same through Triton's JIT
  host_fwd(_nograd)   the op body: plan lookup, allocations, launches (host.forward)
  host_bwd            the backward op body (host.backward)
  op_fwd(_nograd)     torch.ops.attnbench.elsa: dispatch, the autograd kernel, autograd.Function, the body
  op_bwd              torch.ops.attnbench.elsa_bwd: dispatch + body
  api_*               elsa_attention; api_*_fastoff: the same with the fast launch path off
  autograd_identity   an identity autograd.Function through torch.autograd.grad: the engine's own fwd+bwd cost
and the differences that split a call: dispatch_fwd = op_fwd - host_fwd (dispatch + autograd.Function),
dispatch_fwd_nograd, public_fwd = api_fwd - op_fwd, backward_engine = api_fwdbwd - api_fwd - op_bwd (the autograd
engine, the saved tensors, the Function's backward).
Writes the JSON to OUT and a short table to stdout. A probe that fails is reported and the others still run.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # the repository root: kernels/, attnbench/

KERNELS = {"elsa": "kernels.elsa", "cron_root": "kernels.cron_root", "pasa": "kernels.pasa", "cqsa": "kernels.cqsa"}
TARGET = {"elsa": 1.5, "cron_root": 1.5, "pasa": 1.5, "cqsa": 2.0}       # x SDPA's host time, issue 16
MODES = ("fwd", "fwd_nograd", "fwdbwd")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: Triton interpreter (checks the plumbing; the times mean nothing)")
    ap.add_argument("--n", type=int, default=128, help="sequence length (default 128)")
    ap.add_argument("--dtype", default="float16", choices=("float16", "float32", "bfloat16"))
    ap.add_argument("--calls", type=int, default=300, help="calls per timed loop (default 300)")
    ap.add_argument("--warmup", type=int, default=20, help="calls before each timed loop (default 20)")
    ap.add_argument("--repeats", type=int, default=5, help="timed loops per figure, median reported (default 5)")
    ap.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated subset of " + ",".join(KERNELS))
    return ap.parse_args(argv)


class Timer:
    """Host time per call of fn over `calls` unsynchronised calls; median and min of `repeats` loops."""

    def __init__(self, torch, device, calls, warmup, repeats):
        self.torch, self.calls, self.warmup, self.repeats = torch, calls, warmup, repeats
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def __call__(self, fn, calls=None) -> dict:
        calls = calls or self.calls
        samples = []
        for _ in range(self.repeats):
            for _ in range(self.warmup):
                fn()
            self.sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - t0) / calls * 1e6)
            self.sync()
        return {"median_us": round(statistics.median(samples), 2), "min_us": round(min(samples), 2)}


def _kernel_entry(name):
    """(fn, causal, has_backward) of a kernel package's registered backend."""
    caps = importlib.import_module(KERNELS[name]).BACKENDS[name]
    causal = tuple(caps.get("causal", (False, True))) == (True,)
    return caps["fn"], causal, "bwd" in caps.get("modes", ("fwd", "bwd", "fwdbwd"))


def measure_calls(torch, fn, q, k, v, do, has_backward: bool, record, prefix: str):
    """fwd, fwd_nograd and (when the kernel has a backward) fwdbwd of fn(q, k, v)."""
    record(f"{prefix}.fwd", lambda: fn(q, k, v))
    with torch.no_grad():
        record(f"{prefix}.fwd_nograd", lambda: fn(q, k, v))
    if has_backward:
        record(f"{prefix}.fwdbwd", lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do))


def elsa_pieces(torch, q, k, v, do, record, res):
    """ELSA's call split into its pieces (see the module docstring)."""
    import kernels._launch as fast_launch
    from kernels.elsa import attention, elsa_attention, host, ops

    scale = 1.0 / q.shape[-1] ** 0.5
    opts = (None, False, scale, "tf32x3", "")
    was_enabled = fast_launch.enabled()
    fast_launch.set_enabled(True)
    torch.autograd.grad(elsa_attention(q, k, v), (q, k, v), do)           # plans, compiled kernels
    with torch.no_grad():
        elsa_attention(q, k, v)
    fwd_plan = host.forward_plan(q, k, v, *opts, True)
    out, lse = host.forward(q, k, v, *opts, True)
    bwd_plan = host.backward_plan(do, q, k, v, *opts, False)
    c = fwd_plan.c
    sbuf = torch.empty(max(1, fwd_plan.sbuf_numel), dtype=torch.float32, device=q.device)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty(bwd_plan.lse_shape, dtype=torch.float32, device=q.device)

    def launch_fwd():
        for p1, p2, _ in fwd_plan.chunks:
            if p2 is None:
                p1(q, k, v, q, out, out, lse)
            else:
                p1(q, k, v, q, sbuf, out, lse)
                p2(sbuf, out, lse)

    def launch_fwd_jit():
        for p1, p2, _ in fwd_plan.chunks:
            first = (q, k, v, q, out, out, lse) if p2 is None else (q, k, v, q, sbuf, out, lse)
            p1.jit_fn[p1.grid](*first, *p1.fixed, **p1.constexprs)
            if p2 is not None:
                p2.jit_fn[p2.grid](sbuf, out, lse, *p2.fixed, **p2.constexprs)

    def launch_bwd():
        bwd_plan.dq(q, k, v, out, do, lse, delta, dq, q, delta)
        bwd_plan.dkdv(q, k, v, do, lse, delta, dk, dv, q)

    def launch_bwd_jit():
        for p, tensors in ((bwd_plan.dq, (q, k, v, out, do, lse, delta, dq, q, delta)),
                           (bwd_plan.dkdv, (q, k, v, do, lse, delta, dk, dv, q))):
            p.jit_fn[p.grid](*tensors, *p.fixed, **p.constexprs)

    def alloc_fwd():
        torch.empty(fwd_plan.out_shape, dtype=c.dtype, device=c.device)
        torch.empty(fwd_plan.lse_shape, dtype=torch.float32, device=c.device)
        if not fwd_plan.plan.final:
            torch.empty(fwd_plan.sbuf_numel, dtype=torch.float32, device=c.device)

    def alloc_bwd():
        torch.empty(bwd_plan.q_shape, dtype=c.dtype, device=c.device)
        torch.empty(bwd_plan.kv_shape, dtype=c.dtype, device=c.device)
        torch.empty(bwd_plan.kv_shape, dtype=c.dtype, device=c.device)
        torch.empty(bwd_plan.lse_shape, dtype=torch.float32, device=c.device)

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            return q.view_as(q)

        @staticmethod
        def backward(ctx, g):
            return g, g, g

    with torch.no_grad():
        record("elsa_pieces.validate", lambda: attention._validate(q, k, v, False, None, "tf32x3", None))
        record("elsa_pieces.signature", lambda: host._signature(q, k, v, *opts, True))
        record("elsa_pieces.alloc_fwd", alloc_fwd)
        record("elsa_pieces.alloc_bwd", alloc_bwd)
        record("elsa_pieces.launch_fwd", launch_fwd)
        record("elsa_pieces.launch_fwd_jit", launch_fwd_jit)
        record("elsa_pieces.launch_bwd", launch_bwd)
        record("elsa_pieces.launch_bwd_jit", launch_bwd_jit)
        record("elsa_pieces.host_fwd", lambda: host.forward(q, k, v, *opts, True))
        record("elsa_pieces.host_fwd_nograd", lambda: host.forward(q, k, v, *opts, False))
        record("elsa_pieces.host_bwd", lambda: host.backward(do, q, k, v, out, lse, *opts, False))
        record("elsa_pieces.op_fwd_nograd", lambda: ops.elsa(q, k, v, *opts))
        record("elsa_pieces.op_bwd", lambda: ops.elsa_bwd(do, q, k, v, out, lse, *opts))
    record("elsa_pieces.op_fwd", lambda: ops.elsa(q, k, v, *opts))
    real_op = ops.elsa
    ops.elsa = lambda *args: q
    try:
        record("elsa_pieces.public_fn", lambda: elsa_attention(q, k, v))
    finally:
        ops.elsa = real_op
    record("elsa_pieces.autograd_identity", lambda: torch.autograd.grad(Identity.apply(q, k, v), (q, k, v), do))
    fast_launch.set_enabled(False)
    try:
        record("elsa_pieces.api_fwd_fastoff", lambda: elsa_attention(q, k, v))
        record("elsa_pieces.api_fwdbwd_fastoff", lambda: torch.autograd.grad(elsa_attention(q, k, v), (q, k, v), do))
    finally:
        fast_launch.set_enabled(was_enabled)
    pieces, api = res["elsa_pieces"], res["kernels"].get("elsa", {})

    def diff(name, a, *minus):
        vals = [a] + list(minus)
        if all(isinstance(x, dict) for x in vals):
            pieces[name] = {"median_us": round(a["median_us"] - sum(m["median_us"] for m in minus), 2)}
    diff("dispatch_fwd", pieces.get("op_fwd"), pieces.get("host_fwd"))
    diff("dispatch_fwd_nograd", pieces.get("op_fwd_nograd"), pieces.get("host_fwd_nograd"))
    diff("public_fwd", api.get("fwd"), pieces.get("op_fwd"))
    diff("backward_engine", api.get("fwdbwd"), api.get("fwd"), pieces.get("op_bwd"))


def run(args) -> dict:
    if args.device == "cpu" and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"            # before triton is imported (by torch or the kernels)
    import torch
    import torch.nn.functional as F

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("host_cost: no CUDA device (--device cpu checks the plumbing)")
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    names = [n for n in args.kernels.split(",") if n]
    timer = Timer(torch, args.device, args.calls, args.warmup, args.repeats)
    import triton
    res = {"meta": {"device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
                    "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
                    "shape": [1, 1, args.n, 64], "dtype": args.dtype, "calls": args.calls, "warmup": args.warmup,
                    "repeats": args.repeats, "unit": "us of host time per call (median of repeats)"},
           "kernels": {}, "elsa_pieces": {}, "ratios": {}, "errors": {}}

    def record(path, fn):
        """Time fn into res[group][name] for path "group.name" ("sdpa.fwd" goes to res["kernels"]["sdpa"]["fwd"])."""
        group, name = path.split(".")
        try:
            val = timer(fn)
        except Exception as exc:      # a probe that fails is reported, the others still run
            res["errors"][path] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            return
        if group == "elsa_pieces":
            res[group][name] = val
        else:
            res["kernels"].setdefault(group, {})[name] = val

    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, do = (torch.randn(1, 1, args.n, 64, generator=g).to(dev, dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    measure_calls(torch, lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v, do, True,
                  record, "sdpa")
    for name in names:
        try:
            fn, causal, has_backward = _kernel_entry(name)
        except Exception as exc:
            res["errors"][name] = f"import failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            continue
        call = (lambda fn, causal: lambda q, k, v: fn(q, k, v, causal=causal))(fn, causal)
        measure_calls(torch, call, q, k, v, do, has_backward, record, name)
        if not has_backward:
            res["kernels"].setdefault(name, {})["fwdbwd"] = "n/a: forward only"
    if "elsa" in names:
        try:
            elsa_pieces(torch, q, k, v, do, record, res)
        except Exception as exc:
            res["errors"]["elsa_pieces"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    sdpa = res["kernels"].get("sdpa", {})
    for name in names:
        got = res["kernels"].get(name, {})
        res["ratios"][name] = {mode: round(got[mode]["median_us"] / sdpa[mode]["median_us"], 2) for mode in MODES
                               if isinstance(got.get(mode), dict) and isinstance(sdpa.get(mode), dict)}
        res["ratios"][name]["target"] = TARGET[name]
    return res


def table(res) -> str:
    m = res["meta"]
    lines = [f"host time per call, us (median of {m['repeats']} x {m['calls']} calls), B=1 H=1 N={m['shape'][2]} "
             f"D=64 {m['dtype']}, {m['device']}, torch {m['torch']}, triton {m['triton']}",
             f"{'kernel':<11}" + "".join(f"{h:>12}" for h in MODES) + "".join(f"{h + '/sdpa':>16}" for h in MODES)
             + f"{'target':>8}"]

    def us(entry):
        return f"{entry['median_us']:.1f}" if isinstance(entry, dict) else "-"

    for name, modes in res["kernels"].items():
        r = res["ratios"].get(name, {})
        lines.append(f"{name:<11}" + "".join(f"{us(modes.get(h)):>12}" for h in MODES)
                     + "".join(f"{r.get(h, ''):>16}" for h in MODES) + f"{r.get('target', ''):>8}")
    if res["elsa_pieces"]:
        lines.append("elsa pieces: " + ", ".join(f"{k} {us(v)}" for k, v in res["elsa_pieces"].items()))
    for where, err in res["errors"].items():
        lines.append(f"error {where}: {err}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if out.parent and not out.parent.exists():
        print(f"host_cost: directory {out.parent} does not exist", file=sys.stderr)
        return 2
    unknown = [n for n in args.kernels.split(",") if n and n not in KERNELS]
    if unknown:
        print(f"host_cost: unknown kernel(s) {', '.join(unknown)} (known: {', '.join(KERNELS)})", file=sys.stderr)
        return 2
    res = run(args)
    out.write_text(json.dumps(res, indent=1))
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
