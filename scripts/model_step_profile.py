"""Where a model cell's step goes: the native timm model and the model with our kernel, side by side.

    PYTHONPATH=. python3 scripts/model_step_profile.py OUT.json --model swin_tiny_patch4_window7_224.ms_in1k \
        --img-size 224 --dtype float16 --mode train [--compile] [--kernel elsa] [--batch 8]
    python scripts/model_step_profile.py OUT.json --device cpu --img-size 32 ...   # CPU: the plumbing only

A `matrices/models.yaml` cell's lat_ratio says how much longer the step takes; this says why. Both sides are the
harness's own workloads (attnbench.models.make_model_workload: same weights, input, step and, with --compile,
the same torch.compile), timed as the harness times a cell (attnbench.measure.pair.measure_pair: --rounds pairs
in alternating order, L2 flushed, each step's untimed prepare outside its sample), so the machine's drift falls on
both. Then a few steps of each side run under torch.profiler, which gives the GPU's busy time per step (the sum of
its kernels' durations: one stream) and the kernels themselves. Per side:
  wall_ms        median time of a step as the harness's timer takes it (min beside it)
  gpu_busy_ms    the step's kernels' summed time; wall - busy is the time the GPU waited on the host
  kernels        kernels launched per step
  top            the kernels taking most time per step (name, ms, launches per step)
A step whose GPU is busy for a small part of its wall time is host-bound: its lat_ratio is the two sides' host
time per step, not their kernels' speed. On the CPU (--device cpu, Triton interpreter) only wall_ms and the
structure mean anything.
"""
from __future__ import annotations

import collections
import json
import os
import statistics
import sys
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before anything imports triton
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attnbench.arguments import Parser, output_file, positive_int  # noqa: E402

TOP = 12


def parse_args(argv=None):
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=output_file, help="JSON file to write")
    ap.add_argument("--model", default="swin_tiny_patch4_window7_224.ms_in1k", help="timm model name")
    ap.add_argument("--img-size", type=positive_int, default=224)
    ap.add_argument("--batch", type=positive_int, default=8)
    ap.add_argument("--dtype", default="float16", choices=("float16", "float32", "bfloat16"))
    ap.add_argument("--mode", default="train", choices=("train", "fwd"))
    ap.add_argument("--compile", action="store_true", help="the whole model under torch.compile on both sides")
    ap.add_argument("--kernel", default="elsa", help="the attention the model is patched with (default elsa)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--warmup", type=positive_int, default=8, help="steps of each side before timing (default 8)")
    ap.add_argument("--rounds", type=positive_int, default=20,
                    help="timed pairs, one step of each side each (default 20)")
    ap.add_argument("--profile-steps", type=positive_int, default=5, help="steps of each side profiled (default 5)")
    args = ap.parse_args(argv)
    if args.kernel == "native":
        ap.error("--kernel native: the native model is the other side already; name a kernel (elsa)")
    return args


def kernel_summary(events, steps: int) -> dict:
    """GPU busy time, launches and the top kernels per step from profiler events (device-side kernel events only)."""
    time_us, count = collections.Counter(), collections.Counter()
    for e in events:
        if e["device"]:
            time_us[e["name"]] += e["us"]
            count[e["name"]] += 1
    return {"gpu_busy_ms": round(sum(time_us.values()) / steps / 1e3, 3),
            "kernels": round(sum(count.values()) / steps, 1),
            "top": [{"name": name, "ms": round(us / steps / 1e3, 3), "launches": round(count[name] / steps, 1)}
                    for name, us in time_us.most_common(TOP)]}


def profiled_events(torch, step, steps: int, device: str) -> list[dict]:
    """{name, us, device} of every event of `steps` profiled steps; device: a GPU kernel (not a CPU op)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    gpu = torch.autograd.DeviceType.CUDA
    return [{"name": e.name, "us": e.device_time_total, "device": e.device_type == gpu} for e in prof.events()]


def run(args) -> dict:
    import torch

    from attnbench.matrix import TIMING_DEFAULTS
    from attnbench.measure.pair import measure_pair
    from attnbench.models import make_model_workload

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sides = {name: make_model_workload(args.model, args.img_size, args.batch, args.dtype, args.mode, name,
                                       args.device, compile=args.compile)
             for name in ("native", args.kernel)}

    def step(workload):
        def one():
            if workload.prepare is not None:
                workload.prepare()
            workload.run()
        return one

    steps = {name: step(w) for name, w in sides.items()}
    for one in steps.values():
        for _ in range(args.warmup):
            one()
    sync()
    # exactly --rounds pairs (no CI stop, no time budget); the rest of the timing as a matrix cell's defaults
    timing = dict(TIMING_DEFAULTS, warmup_ms=0, rep_ms=1, min_reps=args.rounds, max_reps=args.rounds,
                  ci_half_width=0.0, max_ms=float("inf"))
    pair = measure_pair(sides[args.kernel], sides["native"], kernel_name=args.kernel, baseline_name="native",
                        timing=timing, device=args.device)
    for side in (pair.kernel, pair.baseline):
        if side.status != "ok":
            raise ValueError(f"{side.backend} side: {side.status}: {side.message}")
    res = {"meta": {"model": args.model, "img_size": args.img_size, "batch": args.batch, "dtype": args.dtype,
                    "mode": args.mode, "compile": args.compile, "kernel": args.kernel, "rounds": args.rounds,
                    "profile_steps": args.profile_steps, "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"},
           "sides": {}}
    for name, timed in (("native", pair.baseline), (args.kernel, pair.kernel)):
        summary = timed.summary()
        side = {"wall_ms": round(summary["ms_median"], 3), "wall_min_ms": round(summary["ms_min"], 3)}
        if args.device == "cuda":
            side.update(kernel_summary(profiled_events(torch, steps[name], args.profile_steps, args.device),
                                       args.profile_steps))
        res["sides"][name] = side
        sides[name].release()
    native, ours = res["sides"]["native"], res["sides"][args.kernel]
    res["wall_ratio"] = round(statistics.median(pair.ratios), 3)
    if "gpu_busy_ms" in native:
        res["gpu_busy_ratio"] = round(ours["gpu_busy_ms"] / native["gpu_busy_ms"], 3)
    return res


def table(res) -> str:
    m = res["meta"]
    lines = [f"{m['model']} @{m['img_size']} batch {m['batch']} {m['dtype']} {m['mode']}"
             + (" compiled" if m["compile"] else "") + f", {m['device']}, torch {m['torch']}; "
             f"wall: median of {m['rounds']} steps per side, paired in alternation (the harness's timer)"]
    for name, side in res["sides"].items():
        busy = side.get("gpu_busy_ms")
        lines.append(f"{name:<8} wall {side['wall_ms']:.2f} ms (min {side['wall_min_ms']:.2f})"
                     + (f", GPU busy {busy:.2f} ms ({100 * busy / side['wall_ms']:.0f} % of the wall), "
                        f"{side['kernels']:.0f} kernels" if busy is not None else ""))
        for k in side.get("top", []):
            lines.append(f"    {k['ms']:8.3f} ms  x{k['launches']:<6g} {k['name'][:90]}")
    lines.append(f"wall ratio (paired median): {res['wall_ratio']}"
                 + (f"; GPU busy ratio: {res['gpu_busy_ratio']}" if "gpu_busy_ratio" in res else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("timm") is None:
        print("model_step_profile: the models come from timm, which is not installed here", file=sys.stderr)
        return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("model_step_profile: no CUDA GPU here (--device cpu runs the plumbing)", file=sys.stderr)
        return 3
    try:
        res = run(args)
    except ValueError as exc:         # a cell the harness refuses (model name, image size, dtype, kernel)
        print(f"model_step_profile: {exc}", file=sys.stderr)
        return 2
    args.out.write_text(json.dumps(res, indent=1))
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
