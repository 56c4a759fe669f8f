"""Host time per attention call at a launch-bound shape, for SDPA and our four kernels, and each kernel's call piece
by piece: what a call costs the CPU before the GPU work matters (the targets: at most 1.5x SDPA for elsa,
cron_root and pasa, 2x for cqsa's resident path).

    PYTHONPATH=. python3 scripts/host_cost.py OUT.json                         # GPU machine
    python scripts/host_cost.py OUT.json --device cpu --stub-launches          # CPU: the host path, launches stubbed
    python scripts/host_cost.py OUT.json --device cpu --n 16 --calls 1         # CPU: the plumbing, interpreted

Shape: B=1, H=1, N=128, D=64, float16 (--n, --dtype change it). A measurement is `--calls` calls in a row with no
synchronisation inside (at this shape the GPU finishes each call before the host has issued the next, so the
loop is host-bound) after `--warmup` calls and a synchronisation: host time per call = wall time of the loop /
calls. Each is repeated `--repeats` times; the median is reported (the minimum and every sample, in the JSON).
The repeats go round-robin over every figure of the run (one sample of each figure in turn, `repeats` rounds), so
the host's drift over the run (tens of percent on the lent GPU machines) hits SDPA and the kernels alike, and a
kernel's ratio to SDPA is the median over rounds of the ratio of the two samples of one round.

Modes: fwd (inputs require grad, grad enabled: a training step's forward), fwd_nograd (inference), fwdbwd
(forward + torch.autograd.grad of q, k and v), bwd (torch.autograd.grad alone, over one forward's graph kept
with retain_graph: the backward's host time without its forward). Kernels: SDPA (PyTorch's own backend choice;
causal where the kernel is), elsa, cron_root (causal: its only mode), pasa (forward only), cqsa (resident: inputs
on the compute device).

--stub-launches (CPU only): every Triton launch takes kernels._launch's fast path (Prepared) to a launcher that
does nothing, so the figures are the kernels' host path without the interpreter's compute (SDPA's stay its CPU
compute: compare the kernels' pieces, not their ratios to SDPA, there).

Pieces, per kernel (``pieces.<kernel>``), same shape, fast launch path on, inputs requiring grad where it matters:
  validate            the checks a new call signature runs (later calls of the signature: one cache lookup)
  public_fn           the public function's own Python with its call of the op replaced by a no-op
  plan_fwd/_bwd       the op body's plan lookup: the key (kernels._launch.layout + options) and the dict get
  body_fwd(_nograd)   the training (inference) forward body: plan lookup, allocations, Prepared launches
  body_bwd            the backward body
  launches_fwd/_bwd   the body's launches: body minus the body with every Prepared launch a no-op
  allocs_fwd/_bwd     the body with no-op launches minus its plan lookup: the allocations and the glue
  body_*_fastoff      the body with the fast launch path off (every launch through Triton's JIT)
  function_fwd        the kernel's autograd.Function applied directly (C entry) with the body: no dispatcher
  op_fwd(_nograd)     the entry op (torch.ops.attnbench.*): the dispatcher, the Autograd kernel, the Function, the body
  call_fwd            what the public function calls (kernels/_ops.py's ``call``): the Autograd kernel without the
                      dispatcher when nothing else would see the op
  op_bwd              the backward op called directly: the dispatcher and the body
and the differences that split a call:
  dispatch_fwd        op_fwd - function_fwd: the one dispatcher trip into the Autograd kernel
  dispatch_fwd_nograd op_fwd_nograd - body_fwd_nograd: the same without grad
  autograd_fwd        function_fwd - body_fwd: the autograd node, ctx, saved tensors
  entry_saving        op_fwd - call_fwd: the dispatcher trip the eager entry skips
  public_fwd          the kernel's fwd - call_fwd: the public function around its call
  backward            fwdbwd - fwd: what the backward adds
  backward_node       bwd - body_bwd: torch.autograd.grad, the engine and the Python node around the body
Shared pieces (``pieces.shared``): grad_builtin (torch.autograd.grad of a built-in op, q * 1: the engine's own cost,
which SDPA pays too) and autograd_identity (an identity autograd.Function through torch.autograd.grad).
Layer figures (``layer``, with the per-call figures; ELSA only): the attention of one timm ViT layer as its
patched forward runs it, from the qkv projection's output [B, N, 3 * H * D] (requires grad; B=1, H=3 as ViT-T,
N=--n, D=64) to the [B, N, H * D] input of the output projection, fwd (grad on) and fwdbwd: ``sdpa`` (timm's own
path: reshape, permute and unbind into q, k, v, SDPA, transpose and reshape back), ``elsa_slices`` (the same
slicing around elsa_attention) and ``elsa_packed`` (reshape to [B, N, 3, H, D], elsa_attention_qkvpacked,
reshape: what kernels/timm_patch.py calls); ratios (``ratios["layer.<name>"]``) against ``sdpa``. What a model's
eager training step pays per layer beside the kernels, the view steps and the stack of three gradients included.
Then one Swin-T window-attention layer (2 images of 4 windows of 7 x 7 tokens, H=3, D=32), its relative-position
bias gathered from a table that takes a gradient, as timm's fused path runs it (``swin_sdpa``: the bias as SDPA's
attn_mask) and as the patch does (``swin_elsa``: kernels.timm_patch.swin_window_bias, the packed entry), and the
same for a shifted layer, whose 0 / -100 mask makes the bias full-shape (``swin_shifted_*``); fwdbwd's gradients
are qkv's and the table's; ratios against the SDPA figure of the same layer.
Registration patterns (``registration``): empty-bodied ops registered four ways, fwd / fwd_nograd / fwdbwd:
custom_op + register_autograd, a Library op + register_autograd, kernels/_ops.py's pattern (what the kernels use),
and the autograd.Function alone (no op: the floor).
Writes the JSON to OUT and a short table to stdout. A probe that fails is reported and the others still run.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # the repository root: kernels/, attnbench/

from attnbench.arguments import EXIT_NO_GPU, Parser, name_list, non_negative_int, output_file, positive_int  # noqa: E402

KERNELS = {"elsa": "kernels.elsa", "cron_root": "kernels.cron_root", "pasa": "kernels.pasa", "cqsa": "kernels.cqsa"}
TARGET = {"elsa": 1.5, "cron_root": 1.5, "pasa": 1.5, "cqsa": 2.0}       # x SDPA's host time: the targets
MODES = ("fwd", "fwd_nograd", "fwdbwd", "bwd")


def parse_args(argv=None):
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=output_file, help="JSON file to write")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: Triton interpreter (checks the plumbing; the times mean nothing unless --stub-launches)")
    ap.add_argument("--stub-launches", action="store_true",
                    help="CPU only: launches take the fast path to a launcher that does nothing (the host path alone)")
    ap.add_argument("--n", type=positive_int, default=128, help="sequence length (default 128)")
    ap.add_argument("--dtype", default="float16", choices=("float16", "float32", "bfloat16"))
    ap.add_argument("--calls", type=positive_int, default=200, help="calls per timed loop (default 200)")
    ap.add_argument("--warmup", type=non_negative_int, default=20, help="calls before each timed loop (default 20)")
    ap.add_argument("--repeats", type=positive_int, default=15,
                    help="rounds: timed loops per figure, median reported (default 15)")
    ap.add_argument("--kernels", type=name_list, default=tuple(KERNELS),
                    help="comma-separated subset of " + ",".join(KERNELS))
    ap.add_argument("--no-pieces", action="store_true", help="only the per-call figures (no pieces, no registration)")
    return ap.parse_args(argv)


class Timer:
    """Host time per call of fn: one sample is `calls` unsynchronised calls after `warmup` calls and a
    synchronisation (wall time of the loop / calls, in us)."""

    def __init__(self, torch, device, calls, warmup, repeats):
        self.torch, self.calls, self.warmup, self.repeats = torch, calls, warmup, repeats
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def sample(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(self.calls):
            fn()
        us = (time.perf_counter() - t0) / self.calls * 1e6
        self.sync()
        return us


class Schedule:
    """Every figure of a run, measured round-robin: `repeats` rounds, each taking one sample of every figure in
    turn, so a slow or fast moment of the machine (the lent GPU hosts drift by tens of percent over a minute)
    lands on all figures alike rather than on whichever was measured then. A figure is (path, fn, setting):
    setting is a context manager factory entered around each of its samples (no_grad, a stubbed launch, ...).
    A figure whose sample raises is dropped from later rounds and reported."""

    def __init__(self, timer: Timer):
        self.timer, self.figures = timer, []

    def add(self, path: str, fn, setting=contextlib.nullcontext) -> None:
        self.figures.append((path, fn, setting))

    def run(self) -> tuple[dict, dict]:
        """({path: {"median_us", "min_us", "samples"}}, {path: error}); samples[r] is round r's (a figure that
        fails is dropped whole, so the rounds of the figures returned line up)."""
        samples, errors = {path: [] for path, _, _ in self.figures}, {}
        for _ in range(self.timer.repeats):
            for path, fn, setting in self.figures:
                if path in errors:
                    continue
                try:
                    with setting():
                        samples[path].append(self.timer.sample(fn))
                except Exception as exc:      # a probe that fails is reported, the others still run
                    errors[path] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        values = {path: {"median_us": round(statistics.median(s), 2), "min_us": round(min(s), 2),
                         "samples": [round(x, 2) for x in s]}
                  for path, s in samples.items() if s and path not in errors}
        return values, errors


@contextlib.contextmanager
def stub_launches():
    """Every Triton launch through kernels._launch takes its fast path to a launcher that does nothing: the
    interpreter's run returns a stand-in CompiledKernel (stored by launch() and Prepared as a real one is), the
    kernels count as eligible, the device and stream are 0. For the CPU; undone on exit (with every plan and
    stored kernel forgotten)."""
    import triton.runtime.interpreter as interpreter
    from triton import knobs

    import kernels._launch as fast_launch

    class NoLaunch:
        function = None
        packed_metadata = None

        def run(self, *args):
            pass

    ck = NoLaunch()
    saved = (interpreter.InterpretedFunction.run, fast_launch._eligible, fast_launch._get_device,
             fast_launch._get_stream, fast_launch._knobs)
    interpreter.InterpretedFunction.run = lambda self, *args, grid, warmup, **kwargs: ck
    fast_launch._eligible = lambda jit_fn: True
    fast_launch._get_device = lambda: 0
    fast_launch._get_stream = lambda device: 0
    fast_launch._knobs = knobs
    fast_launch.clear()
    try:
        yield
    finally:
        (interpreter.InterpretedFunction.run, fast_launch._eligible, fast_launch._get_device,
         fast_launch._get_stream, fast_launch._knobs) = saved
        fast_launch.clear()


def _kernel_entry(name):
    """(fn, causal, has_backward) of a kernel package's registered backend."""
    caps = importlib.import_module(KERNELS[name]).BACKENDS[name]
    causal = tuple(caps.get("causal", (False, True))) == (True,)
    return caps["fn"], causal, "bwd" in caps.get("modes", ("fwd", "bwd", "fwdbwd"))


LAYER_HEADS, LAYER_DIM = 3, 64       # ViT-T's attention: 3 heads of 64
SWIN_HEADS, SWIN_DIM, SWIN_WINDOW, SWIN_WINDOWS, SWIN_IMAGES = 3, 32, 7, 4, 2  # Swin-T's stage 1: 3 heads of 32
# each ELSA layer figure's ratio is against the SDPA figure of its own layer
LAYER_BASE = {"elsa_slices": "sdpa", "elsa_packed": "sdpa", "swin_elsa": "swin_sdpa",
              "swin_shifted_elsa": "swin_shifted_sdpa"}


def layer_calls(torch, n: int, dtype, dev, record) -> None:
    """The layer figures (module docstring): fwd and fwdbwd of each way to run one ViT layer's attention, then one
    Swin window-attention layer's, without and with the shifted windows' mask."""
    import torch.nn.functional as F

    from kernels.elsa import elsa_attention, elsa_attention_qkvpacked
    from kernels.timm_patch import swin_window_bias

    h, d = LAYER_HEADS, LAYER_DIM
    g = torch.Generator(device="cpu").manual_seed(1)
    qkv = torch.randn(1, n, 3 * h * d, generator=g).to(dev, dtype).requires_grad_(True)
    dx = torch.randn(1, n, h * d, generator=g).to(dev, dtype)

    def sliced(attend):
        def layer(t):
            q, k, v = t.reshape(1, n, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
            return attend(q, k, v).transpose(1, 2).reshape(1, n, h * d)
        return layer

    ways = {"sdpa": sliced(F.scaled_dot_product_attention), "elsa_slices": sliced(elsa_attention),
            "elsa_packed": lambda t: elsa_attention_qkvpacked(t.reshape(1, n, 3, h, d)).reshape(1, n, h * d)}
    for name, layer in ways.items():
        record(f"layer.{name}.fwd", lambda layer=layer: layer(qkv))
        record(f"layer.{name}.fwdbwd", lambda layer=layer: torch.autograd.grad(layer(qkv), (qkv,), dx))

    # Swin: SWIN_IMAGES images of SWIN_WINDOWS 7x7 windows (b_ rows), the relative-position bias gathered from its
    # table each call (it has a gradient), the shifted layer's 0 / -100 mask added: timm's fused path (sdpa) and the
    # patch's (elsa)
    sh, sd, nw, w = SWIN_HEADS, SWIN_DIM, SWIN_WINDOWS, SWIN_WINDOW     # not h, d: the ViT layers' closures read those
    nt, b_ = w * w, nw * SWIN_IMAGES
    table = torch.randn((2 * w - 1) ** 2, sh, generator=g).to(dev, dtype).requires_grad_(True)
    index = torch.randint(0, (2 * w - 1) ** 2, (nt * nt,), generator=g).to(dev)
    mask = torch.where(torch.rand(nw, nt, nt, generator=g) < 0.5, 0.0, -100.0).to(dev, dtype)
    wqkv = torch.randn(b_, nt, 3 * sh * sd, generator=g).to(dev, dtype).requires_grad_(True)
    wdx = torch.randn(b_, nt, sh * sd, generator=g).to(dev, dtype)

    def rel_pos_bias():
        return table[index].view(nt, nt, -1).permute(2, 0, 1).contiguous().unsqueeze(0)

    def swin_sdpa(shifted):
        def layer(t):
            q, k, v = t.reshape(b_, nt, 3, sh, sd).permute(2, 0, 3, 1, 4).unbind(0)
            bias = rel_pos_bias()
            if shifted:
                bias = bias + mask.view(1, nw, 1, nt, nt).expand(SWIN_IMAGES, -1, sh, -1, -1).reshape(-1, sh, nt, nt)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b_, nt, sh * sd)
        return layer

    def swin_elsa(shifted):
        def layer(t):
            bias = swin_window_bias(rel_pos_bias(), mask if shifted else None, b_)
            return elsa_attention_qkvpacked(t.reshape(b_, nt, 3, sh, sd), attn_bias=bias).reshape(b_, nt, sh * sd)
        return layer

    for shifted in (False, True):
        prefix = "swin_shifted" if shifted else "swin"
        for name, layer in ((f"{prefix}_sdpa", swin_sdpa(shifted)), (f"{prefix}_elsa", swin_elsa(shifted))):
            record(f"layer.{name}.fwd", lambda layer=layer: layer(wqkv))
            record(f"layer.{name}.fwdbwd",
                   lambda layer=layer: torch.autograd.grad(layer(wqkv), (wqkv, table), wdx))


def measure_calls(torch, fn, q, k, v, do, has_backward: bool, record, prefix: str):
    """fwd, fwd_nograd and (when the kernel has a backward) fwdbwd and bwd of fn(q, k, v)."""
    record(f"{prefix}.fwd", lambda: fn(q, k, v))
    record(f"{prefix}.fwd_nograd", lambda: fn(q, k, v), torch.no_grad)
    if has_backward:
        record(f"{prefix}.fwdbwd", lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do))
        graph = []          # one forward's graph, made at the first call and kept (retain_graph)

        def bwd():
            if not graph:
                graph.append(fn(q, k, v))
            return torch.autograd.grad(graph[0], (q, k, v), do, retain_graph=True)
        record(f"{prefix}.bwd", bwd)


# --- each kernel's call as pieces ------------------------------------------------------------------------------

def kernel_paths(torch, name, q, k, v, do):
    """One kernel's call taken apart: callables for the pieces (module docstring) and where the public function
    finds its op (to replace it by a no-op). Each kernel's default options at this shape."""
    from torch.autograd import Function

    d = q.shape[-1]
    scale = 1.0 / d ** 0.5
    p = SimpleNamespace(body_bwd=None)
    if name == "elsa":
        from kernels.elsa import attention, host, ops
        opts = (None, False, scale, "tf32x3", "")
        apply = super(Function, ops._ElsaFunction).apply
        p.validate = lambda: attention._validate(q, k, v, False, None, "tf32x3", None)
        p.op_site, p.op_stub = (ops, "elsa_call"), (lambda *a: q)
        p.op_fwd = lambda: ops.elsa(q, k, v, *opts)
        p.call_fwd = lambda: ops.elsa_call(q, k, v, *opts)
        p.function_fwd = lambda: apply(True, q, k, v, *opts)
        p.body_fwd = lambda: host.forward(q, k, v, *opts, True)
        p.body_fwd_nograd = lambda: host.forward(q, k, v, *opts, False)
        p.plan_fwd = lambda: host.forward_plan(q, k, v, *opts, True)
        out, lse = p.body_fwd()
        p.body_bwd = lambda: host.backward(do, q, k, v, out, lse, *opts, False)
        p.plan_bwd = lambda: host.backward_plan(do, q, k, v, out, *opts, False)
        p.op_bwd = lambda: ops.elsa_bwd(do, q, k, v, out, lse, *opts)
    elif name == "cron_root":
        from kernels.cron_root import attention
        from kernels.cron_root.reference import RELAY_THRESHOLD
        opts = (scale, RELAY_THRESHOLD, "tf32x3", "")
        apply = super(Function, attention._CronRootFunction).apply
        p.validate = lambda: attention.validate(q, k, v, True, None, RELAY_THRESHOLD, "tf32x3")
        p.op_site, p.op_stub = (attention, "fwd_call"), (lambda *a: (q, q))
        p.op_fwd = lambda: attention.fwd_op(q, k, v, *opts)
        p.call_fwd = lambda: attention.fwd_call(q, k, v, *opts)
        p.function_fwd = lambda: apply(True, q, k, v, *opts)
        p.body_fwd = p.body_fwd_nograd = lambda: attention._forward(q, k, v, *opts)
        p.plan_fwd = lambda: attention.forward_plan(q, k, v, *opts)
        out, lse = p.body_fwd()
        p.body_bwd = lambda: attention._backward(do, q, k, v, out, lse, *opts)
        p.plan_bwd = lambda: attention.backward_plan(do, q, k, v, out, lse, *opts)
        p.op_bwd = lambda: attention.bwd_op(do, q, k, v, out, lse, *opts)
    elif name == "pasa":
        from kernels._common import block_d
        from kernels.pasa import attention, ops
        opts = (False, scale, attention._DEFAULT_OPTIONS["pasa"][block_d(d)])
        apply = super(Function, ops.FUNCTIONS["pasa"]).apply
        p.validate = lambda: attention.validate("pasa", q, k, v, False, None)
        p.op_site, p.op_stub = (ops, "pasa_call"), (lambda *a: q)
        p.op_fwd = lambda: ops.pasa_fwd(q, k, v, *opts)
        p.call_fwd = lambda: ops.pasa_call(q, k, v, *opts)
        p.function_fwd = lambda: apply(True, q, k, v, *opts)
        p.body_fwd = p.body_fwd_nograd = lambda: ops.pasa_forward(q, k, v, *opts)
        p.plan_fwd = lambda: ops.forward_plan("pasa", q, k, v, *opts)
    elif name == "cqsa":
        from kernels.cqsa import attention
        sc, prec, tiles, gluon_bwd_min_work = attention._resolve(q, k, v, False, None, 7, 1, "tf32x3", None)
        opts = (False, sc, 7, 1, prec, tiles, gluon_bwd_min_work)
        apply = super(Function, attention._CqsaFunction).apply
        p.validate = lambda: attention._resolve(q, k, v, False, None, 7, 1, "tf32x3", None)
        p.op_site, p.op_stub = (attention, "cqsa_call"), (lambda *a: (q, q))
        p.op_fwd = lambda: attention.cqsa_fwd(q, k, v, *opts)
        p.call_fwd = lambda: attention.cqsa_call(q, k, v, *opts)
        p.function_fwd = lambda: apply(True, q, k, v, *opts)
        p.body_fwd = p.body_fwd_nograd = lambda: attention.resident_forward(q, k, v, *opts)
        p.plan_fwd = lambda: attention.forward_plan(q, k, v, *opts[:-1])     # its key: no backward threshold
        out, lse = p.body_fwd()
        p.body_bwd = lambda: attention.resident_backward(do, q, k, v, out, lse, *opts)
        p.plan_bwd = lambda: attention.backward_plan(do, q, k, v, out, lse, *opts)
        p.op_bwd = lambda: attention.cqsa_bwd(do, q, k, v, out, lse, *opts)
    else:
        raise ValueError(f"no pieces for kernel {name!r}")
    return p


def kernel_pieces(torch, name, public, q, k, v, do, record):
    """Schedule one kernel's pieces (module docstring); piece_differences splits them once measured."""
    import kernels._launch as fast_launch

    p = kernel_paths(torch, name, q, k, v, do)
    rec = lambda piece, fn, *setting: record(f"pieces.{name}.{piece}", fn, *setting)     # noqa: E731

    @contextlib.contextmanager
    def launches(fast: bool = True, stubbed: bool = False):
        """no_grad, the fast launch path on or off, every Prepared launch a no-op or real."""
        was, real_call = fast_launch.enabled(), fast_launch.Prepared.__call__
        fast_launch.set_enabled(fast)
        if stubbed:
            fast_launch.Prepared.__call__ = lambda self, *tensors: None
        try:
            with torch.no_grad():
                yield
        finally:
            fast_launch.Prepared.__call__ = real_call
            fast_launch.set_enabled(was)

    @contextlib.contextmanager
    def op_stubbed():
        module, attr = p.op_site
        real_op = getattr(module, attr)
        setattr(module, attr, p.op_stub)
        try:
            yield
        finally:
            setattr(module, attr, real_op)

    backward = p.body_bwd is not None
    rec("validate", p.validate, launches)
    rec("plan_fwd", p.plan_fwd, launches)
    rec("body_fwd", p.body_fwd, launches)
    rec("body_fwd_nograd", p.body_fwd_nograd, launches)
    rec("op_fwd_nograd", p.op_fwd, launches)
    if backward:
        rec("plan_bwd", p.plan_bwd, launches)
        rec("body_bwd", p.body_bwd, launches)
        rec("op_bwd", p.op_bwd, launches)
    rec("body_fwd_nolaunch", p.body_fwd, lambda: launches(stubbed=True))
    rec("body_fwd_fastoff", p.body_fwd, lambda: launches(fast=False))
    if backward:
        rec("body_bwd_nolaunch", p.body_bwd, lambda: launches(stubbed=True))
        rec("body_bwd_fastoff", p.body_bwd, lambda: launches(fast=False))
    rec("function_fwd", p.function_fwd)
    rec("op_fwd", p.op_fwd)
    rec("call_fwd", p.call_fwd)
    rec("public_fn", lambda: public(q, k, v), op_stubbed)
    return backward


def piece_differences(res, name: str, backward: bool) -> None:
    """The differences that split a call (module docstring), from the measured pieces and the kernel's figures."""
    pieces, api = res["pieces"].get(name, {}), res["kernels"].get(name, {})

    def diff(piece, a, *minus):
        vals = [a, *minus]
        if all(isinstance(x, dict) for x in vals):
            pieces[piece] = {"median_us": round(a["median_us"] - sum(m["median_us"] for m in minus), 2)}
    g = pieces.get
    diff("launches_fwd", g("body_fwd"), g("body_fwd_nolaunch"))
    diff("allocs_fwd", g("body_fwd_nolaunch"), g("plan_fwd"))
    diff("dispatch_fwd", g("op_fwd"), g("function_fwd"))
    diff("dispatch_fwd_nograd", g("op_fwd_nograd"), g("body_fwd_nograd"))
    diff("autograd_fwd", g("function_fwd"), g("body_fwd"))
    diff("entry_saving", g("op_fwd"), g("call_fwd"))
    diff("public_fwd", api.get("fwd"), g("call_fwd"))
    if backward:
        diff("launches_bwd", g("body_bwd"), g("body_bwd_nolaunch"))
        diff("allocs_bwd", g("body_bwd_nolaunch"), g("plan_bwd"))
        diff("dispatch_bwd", g("op_bwd"), g("body_bwd"))
        diff("backward", api.get("fwdbwd"), api.get("fwd"))
        diff("backward_node", api.get("bwd"), g("body_bwd"))


def shared_pieces(torch, q, k, v, do, record):
    """The autograd engine's own cost, without and with a Python node."""
    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            return q.view_as(q)

        @staticmethod
        def backward(ctx, g):
            return g, g, g

    record("pieces.shared.grad_builtin", lambda: torch.autograd.grad(q * 1, (q,), do))
    record("pieces.shared.autograd_identity", lambda: torch.autograd.grad(Identity.apply(q, k, v), (q, k, v), do))


_registered: dict = {}
_libraries: list = []


def registration_patterns(torch, q, k, v, do, record):
    """Empty-bodied ops (two allocations forward, three backward) registered four ways (module docstring)."""
    if not _registered:
        _registered.update(_register_patterns(torch))
    for label, fn in _registered.items():
        def call(fn=fn):
            return fn(q, k, v, 0.125, "tf32x3")[0]
        measure_calls(torch, lambda q_, k_, v_, call=call: call(), q, k, v, do, True, record, f"registration.{label}")


def _register_patterns(torch) -> dict:
    """The four registrations of registration_patterns (once per process: an op is defined once)."""
    from kernels import _ops

    ns = "attnbench_host_cost"

    def body(q, k, v, scale, precision):
        return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)

    def bwd_body(g, q, k, v, out, lse, scale, precision):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    fwd_schema = "(Tensor q, Tensor k, Tensor v, float scale, str precision) -> (Tensor, Tensor)"
    bwd_schema = ("(Tensor g, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale, str precision) "
                  "-> (Tensor, Tensor, Tensor)")
    # custom_op + register_autograd
    custom_fwd = torch.library.custom_op(f"{ns}::custom_fwd", body, mutates_args=(), schema=fwd_schema)
    custom_fwd.register_fake(body)
    custom_bwd = torch.library.custom_op(f"{ns}::custom_bwd", bwd_body, mutates_args=(), schema=bwd_schema)
    custom_bwd.register_fake(bwd_body)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:3], *output)
        ctx.options = inputs[3:]
        ctx.mark_non_differentiable(output[1])

    def custom_backward(ctx, g, _):
        return (*custom_bwd(g, *ctx.saved_tensors, *ctx.options), None, None)

    custom_fwd.register_autograd(custom_backward, setup_context=setup_context)
    # a Library op + register_autograd; the kernels/_ops.py pattern
    lib = torch.library.Library(ns, "FRAGMENT")
    for prefix in ("library", "ops"):
        lib.define(f"{prefix}_fwd{fwd_schema}")
        lib.define(f"{prefix}_bwd{bwd_schema}")
        for key in ("CPU", "CUDA"):
            lib.impl(f"{prefix}_fwd", body, key)
            lib.impl(f"{prefix}_bwd", bwd_body, key)
        torch.library.register_fake(f"{ns}::{prefix}_fwd", body, lib=lib)
        torch.library.register_fake(f"{ns}::{prefix}_bwd", bwd_body, lib=lib)
    library_fwd = getattr(torch.ops, ns).library_fwd.default
    library_bwd = getattr(torch.ops, ns).library_bwd.default

    def library_backward(ctx, g, _):
        return (*library_bwd(g, *ctx.saved_tensors, *ctx.options), None, None)

    torch.library.register_autograd(f"{ns}::library_fwd", library_backward, setup_context=setup_context, lib=lib)
    ops_fwd = getattr(torch.ops, ns).ops_fwd.default
    ops_bwd = getattr(torch.ops, ns).ops_bwd.default

    class Pattern(_ops.KernelFunction):
        @staticmethod
        def forward(ctx, is_plain, q, k, v, scale, precision):
            if is_plain:
                out, lse = body(q, k, v, scale, precision)
            else:
                with _ops.below_autograd():
                    out, lse = ops_fwd(q, k, v, scale, precision)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.options = (scale, precision)
            ctx.mark_non_differentiable(lse)
            ctx.set_materialize_grads(False)
            return out, lse

        @staticmethod
        def gradients(ctx, g, _):
            saved = ctx.saved_tensors
            if _ops.plain(g, *saved):
                return (None, *bwd_body(g, *saved, *ctx.options), None, None)
            return (None, *ops_bwd(g, *saved, *ctx.options), None, None)

    _ops.register_autograd(lib, "ops_fwd", Pattern, body)
    _ops.not_differentiable(lib, "ops_bwd")

    def function_only(q, k, v, scale, precision):
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return Pattern.apply(True, q, k, v, scale, precision)
        return body(q, k, v, scale, precision)

    _libraries.append(lib)      # keeps its registrations alive
    return {"custom_op": custom_fwd, "library": library_fwd, "ops_pattern": ops_fwd, "function_only": function_only}


def run(args) -> dict:
    if args.device == "cpu" and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"            # before triton is imported (by torch or the kernels)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("host_cost: no CUDA device (--device cpu checks the plumbing)", file=sys.stderr)
        raise SystemExit(EXIT_NO_GPU)
    with stub_launches() if args.stub_launches else contextlib.nullcontext():
        return measure(torch, args)


def measure(torch, args) -> dict:
    """Every figure of the run (module docstring)."""
    import torch.nn.functional as F

    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    names = list(args.kernels)
    schedule = Schedule(Timer(torch, args.device, args.calls, args.warmup, args.repeats))
    import triton
    res = {"meta": {"device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
                    "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
                    "shape": [1, 1, args.n, 64], "dtype": args.dtype, "calls": args.calls, "warmup": args.warmup,
                    "repeats": args.repeats, "stub_launches": args.stub_launches,
                    "unit": "us of host time per call (median of repeats)",
                    "order": "round-robin: each repeat samples every figure once, in turn",
                    "ratios": "median over rounds of (kernel sample / SDPA sample) within a round"},
           "kernels": {}, "layer": {}, "pieces": {}, "registration": {}, "ratios": {}, "errors": {}}

    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, do = (torch.randn(1, 1, args.n, 64, generator=g).to(dev, dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    measure_calls(torch, lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v, do, True,
                  schedule.add, "sdpa")
    entries, causal_sdpa = {}, False
    for name in names:
        try:
            fn, causal, has_backward = _kernel_entry(name)
        except Exception as exc:
            res["errors"][name] = f"import failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            continue
        if causal and not causal_sdpa:
            causal_sdpa = True
            measure_calls(torch, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v,
                          do, True, schedule.add, "sdpa_causal")
        call = (lambda fn, causal: lambda q, k, v: fn(q, k, v, causal=causal))(fn, causal)
        entries[name] = (call, causal, has_backward)
        measure_calls(torch, call, q, k, v, do, has_backward, schedule.add, name)
    if "elsa" in entries:
        layer_calls(torch, args.n, dtype, dev, schedule.add)
    backward_pieces = {}
    if not args.no_pieces:
        for name, (call, _, _) in entries.items():
            try:
                backward_pieces[name] = kernel_pieces(torch, name, call, q, k, v, do, schedule.add)
            except Exception as exc:
                res["errors"][f"pieces.{name}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        try:
            shared_pieces(torch, q, k, v, do, schedule.add)
            registration_patterns(torch, q, k, v, do, schedule.add)
        except Exception as exc:
            res["errors"]["registration"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    values, errors = schedule.run()
    res["errors"].update(errors)
    for path, val in values.items():
        parts = path.split(".")        # "sdpa.fwd" -> kernels; "pieces.elsa.body_fwd", "registration.library.fwd"
        if parts[0] in ("pieces", "registration", "layer"):
            res[parts[0]].setdefault(parts[1], {})[parts[2]] = val
        else:
            res["kernels"].setdefault(parts[0], {})[parts[1]] = val
    for name, backward in backward_pieces.items():
        piece_differences(res, name, backward)
    for name, (_, _, has_backward) in entries.items():
        if not has_backward:
            res["kernels"].setdefault(name, {}).update(fwdbwd="n/a: forward only", bwd="n/a: forward only")
    for name, (_, causal, _) in entries.items():
        sdpa = res["kernels"].get("sdpa_causal" if causal else "sdpa", {})
        got = res["kernels"].get(name, {})
        res["ratios"][name] = {mode: paired_ratio(got[mode], sdpa[mode]) for mode in MODES
                               if isinstance(got.get(mode), dict) and isinstance(sdpa.get(mode), dict)}
        res["ratios"][name]["vs"] = "sdpa_causal" if causal else "sdpa"
        res["ratios"][name]["target"] = TARGET[name]
    for name, modes in res["layer"].items():
        if name in LAYER_BASE:
            base = res["layer"].get(LAYER_BASE[name], {})
            res["ratios"][f"layer.{name}"] = {mode: paired_ratio(modes[mode], base[mode]) for mode in modes
                                              if mode in base}
    return res


def paired_ratio(got: dict, base: dict) -> float:
    """The kernel's host time over SDPA's: the median over rounds of the two samples' ratio within each round
    (taken a fraction of a second apart, so the host's slow and fast moments cancel)."""
    return round(statistics.median(a / b for a, b in zip(got["samples"], base["samples"])), 2)


def table(res) -> str:
    m = res["meta"]
    lines = [f"host time per call, us (median of {m['repeats']} x {m['calls']} calls), B=1 H=1 N={m['shape'][2]} "
             f"D=64 {m['dtype']}, {m['device']}, torch {m['torch']}, triton {m['triton']}"
             + (", launches stubbed" if m.get("stub_launches") else "")
             + "; x/sdpa: median over rounds of the ratio within a round",
             f"{'kernel':<12}" + "".join(f"{h:>12}" for h in MODES) + "".join(f"{h + '/sdpa':>16}" for h in MODES)
             + f"{'target':>8}"]

    def us(entry):
        return f"{entry['median_us']:.1f}" if isinstance(entry, dict) else "-"

    for name, modes in res["kernels"].items():
        r = res["ratios"].get(name, {})
        lines.append(f"{name:<12}" + "".join(f"{us(modes.get(h)):>12}" for h in MODES)
                     + "".join(f"{r.get(h, ''):>16}" for h in MODES) + f"{r.get('target', ''):>8}")
    for name, modes in res["layer"].items():
        r = res["ratios"].get(f"layer.{name}", {})
        where = (f"{SWIN_IMAGES} x {SWIN_WINDOWS} windows H={SWIN_HEADS} N={SWIN_WINDOW ** 2} D={SWIN_DIM}"
                 if name.startswith("swin")
                 else f"B=1 H={LAYER_HEADS} N={m['shape'][2]} D={LAYER_DIM}")
        lines.append(f"layer {name} ({where}): "
                     + ", ".join(f"{mode} {us(val)}" + (f" ({r[mode]} x {LAYER_BASE[name]})" if mode in r else "")
                                 for mode, val in modes.items()))
    for name, pieces in res["pieces"].items():
        lines.append(f"{name} pieces: " + ", ".join(f"{k} {us(v)}" for k, v in pieces.items()))
    for name, modes in res["registration"].items():
        lines.append(f"registration {name}: " + " / ".join(us(modes.get(h)) for h in MODES))
    for where, err in res["errors"].items():
        lines.append(f"error {where}: {err}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out
    unknown = [n for n in args.kernels if n not in KERNELS]
    if unknown:
        print(f"host_cost: unknown kernel(s) {', '.join(unknown)} (known: {', '.join(KERNELS)})", file=sys.stderr)
        return 2
    if args.stub_launches and args.device != "cpu":
        print("host_cost: --stub-launches is for --device cpu (a GPU run measures the real launches)", file=sys.stderr)
        return 2
    res = run(args)
    out.write_text(json.dumps(res, indent=1))
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
