"""A kernel's time over its baseline's paired as the harness pairs them, and each run alone, with the SM clock and
the power each ran at: whether a ratio depends on what runs beside it.

    PYTHONPATH=. python3 scripts/clock_pairing.py OUT.json --kernel pasa --baseline cudnn --shapes 16384x64,65536x128
    python scripts/clock_pairing.py OUT.json --device cpu --kernel elsa --baseline math --shapes 64x16   # the plumbing

Why: a long tensor-core call keeps a Hopper card at its power limit (the steady state that attnbench.measure.noise
records as `sw_power_cap`), where the driver sets the SM clock from the power drawn. Two kernels that draw different
power per clock settle at different clocks when each runs alone; paired call by call (kernel, baseline, baseline,
kernel, ...: attnbench.measure.pair) both run at one shared clock. So the harness's ratio compares the two at equal
clocks, and a kernel that draws less power runs faster alone than its paired ratio says (or slower, drawing more).

Per shape and repeat, through the harness's own workloads (attnbench.backends.make_attention_workload: B, H, fresh
random inputs) and timer (attnbench.measure.pair.measure_pair: CUDA events, L2 flushed before every call, exactly
--calls timed calls a side, no CI stop):
  alone    each side by itself: --warm-s seconds of its calls (the clock settles; a first call of each side,
           which compiles, comes before every phase), then its timed calls;
           ratio = the kernel's median / the baseline's
  paired   both sides interleaved as a matrix cell times them; ratio = the median of the pairs' ratios
with the median SM clock (MHz) and power (W) NVML read every --sample-ms while each phase ran (the clock as it is;
the power, on Ampere and newer GPUs, NVML's average over the last second: the warm second before each alone phase
makes it that side's, a paired phase reads both sides' mix). OUT.json is rewritten after every row (a later row's
failure keeps the rows before it), and each row printed with the rows left. On the CPU (--device cpu, Triton
interpreter) there is no clock or power and the times mean nothing: the plumbing only.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before anything imports triton
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attnbench.arguments import EXIT_NO_GPU, Parser, non_negative_float, output_file, positive_float, positive_int  # noqa: E402


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'16384x64,65536x128' -> [(16384, 64), (65536, 128)] (query/key length x head dim)."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes: {item.strip()!r}: need NxD with positive integers (e.g. 16384x64)")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def parse_args(argv=None):
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=output_file, help="JSON file to write")
    ap.add_argument("--kernel", default="pasa", help="the backend timed against the baseline (default pasa)")
    ap.add_argument("--baseline", default="cudnn", help="default cudnn")
    ap.add_argument("--shapes", default="16384x64,65536x64", help="NxD,... (default 16384x64,65536x64)")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--mode", default="fwd", choices=("fwd", "bwd", "fwdbwd"))
    ap.add_argument("--batch", type=positive_int, default=1)
    ap.add_argument("--heads", type=positive_int, default=8)
    ap.add_argument("--calls", type=positive_int, default=20, help="timed calls a side in each phase (default 20)")
    ap.add_argument("--warm-s", type=non_negative_float, default=1.0,
                    help="seconds of a side's calls before it is timed alone")
    ap.add_argument("--repeats", type=positive_int, default=2, help="alone and paired phases per shape (default 2)")
    ap.add_argument("--sample-ms", type=positive_float, default=2.0, help="NVML read interval (default 2 ms)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args(argv)
    try:
        args.shapes = parse_shapes(args.shapes)
    except ValueError as exc:
        ap.error(str(exc))
    return args


class Sampler:
    """NVML's SM clock and power of one GPU every `interval_s`, in a thread, each read stamped with perf_counter;
    `phase(t0, t1)` summarises the reads taken between two stamps. probe() -> (sm_clock_mhz, power_w)."""

    def __init__(self, probe, interval_s: float):
        self.probe, self.interval_s = probe, interval_s
        self.reads: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            clock, power = self.probe()
            self.reads.append((time.perf_counter(), clock, power))
            self._stop.wait(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def phase(self, t0: float, t1: float) -> dict:
        return phase_summary([r for r in self.reads if t0 <= r[0] <= t1])


def phase_summary(reads) -> dict:
    """Median and minimum SM clock, median power, and the number of reads (a phase shorter than one read has none:
    its clock and power are None)."""
    from attnbench.measure.stats import summary

    clocks = summary([r[1] for r in reads if r[1] is not None])
    power = summary([r[2] for r in reads if r[2] is not None])["median"]
    return {"clock_mhz": clocks["median"], "clock_min_mhz": clocks["min"],
            "power_w": None if power is None else round(power, 1), "reads": len(reads)}


def nvml_probe():
    """(probe, power limit in W) for the GPU torch runs on: NVML's SM clock and power draw, two reads a call."""
    import torch

    from attnbench.gpu import PynvmlReader, visible_to_cuda

    reader = PynvmlReader()
    index = visible_to_cuda(reader)[torch.cuda.current_device()]
    nv = reader.nv
    handle = nv.nvmlDeviceGetHandleByIndex(index)

    def probe():
        return nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM), nv.nvmlDeviceGetPowerUsage(handle) / 1e3
    return probe, nv.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3


def run(args, probe=None, power_limit_w=None, on_row=None) -> dict:
    """Every shape's repeats (module docstring): the result so far goes to on_row(res) after each row, and a line
    per row is printed with how many are done and about how long the rest takes."""
    import torch

    from attnbench.backends import get_backend, make_attention_workload
    from attnbench.matrix import TIMING_DEFAULTS
    from attnbench.measure.pair import measure_pair
    from attnbench.measure.stats import summary

    kernel_backend, baseline_backend = get_backend(args.kernel), get_backend(args.baseline)
    if probe is None:
        if args.device == "cuda":
            probe, power_limit_w = nvml_probe()
        else:
            probe = lambda: (None, None)   # noqa: E731  (no clock or power on the CPU)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    # exactly --calls timed calls a side (no CI stop, no time budget); the rest as a matrix cell's defaults
    timing = dict(TIMING_DEFAULTS, warmup_ms=0, rep_ms=1, min_reps=args.calls, max_reps=args.calls,
                  ci_half_width=0.0, max_ms=float("inf"))
    res = {"meta": {"kernel": args.kernel, "baseline": args.baseline, "dtype": args.dtype, "mode": args.mode,
                    "batch": args.batch, "heads": args.heads, "calls": args.calls, "warm_s": args.warm_s,
                    "repeats": args.repeats, "torch": torch.__version__, "power_limit_w": power_limit_w,
                    "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"},
           "rows": []}

    def ok(pair):
        for side in (pair.kernel, pair.baseline):
            if side is not None and side.status != "ok":
                raise ValueError(f"{side.backend} side: {side.status}: {side.message}")
        return pair

    total, started = len(args.shapes) * args.repeats, time.perf_counter()
    with Sampler(probe, args.sample_ms / 1e3) as sampler:
        for n, d in args.shapes:
            common = dict(batch=args.batch, heads=args.heads, n=n, head_dim=d, dtype=args.dtype, mode=args.mode,
                          causal=False, device=args.device)
            for backend in (kernel_backend, baseline_backend):
                why = backend.unsupported_reason(dtype=args.dtype, mode=args.mode, causal=False, head_dim=d,
                                                 device=args.device)
                if why:
                    raise ValueError(why)
            sides = {"kernel": (args.kernel, make_attention_workload(kernel_backend, **common)),
                     "baseline": (args.baseline, make_attention_workload(baseline_backend, **common))}
            for _, workload in sides.values():          # the first call compiles: before every phase
                if workload.prepare is not None:
                    workload.prepare()
                workload.run()
            sync()
            for repeat in range(args.repeats):
                row = {"n": n, "d": d, "repeat": repeat, "alone": {}}
                for role, (name, workload) in sides.items():
                    end = time.perf_counter() + args.warm_s
                    while time.perf_counter() < end:
                        if workload.prepare is not None:
                            workload.prepare()
                        workload.run()
                        sync()
                    t0 = time.perf_counter()
                    alone = ok(measure_pair(workload, None, kernel_name=name, baseline_name=None, timing=timing,
                                            device=args.device))
                    row["alone"][role] = {"ms": round(alone.kernel.summary()["ms_median"], 4),
                                          **sampler.phase(t0, time.perf_counter())}
                row["alone"]["ratio"] = round(row["alone"]["kernel"]["ms"] / row["alone"]["baseline"]["ms"], 4)
                t0 = time.perf_counter()
                pair = ok(measure_pair(sides["kernel"][1], sides["baseline"][1], kernel_name=args.kernel,
                                       baseline_name=args.baseline, timing=timing, device=args.device))
                row["paired"] = {"ratio": round(summary(pair.ratios)["median"], 4),     # the harness's lat_ratio
                                 "ci_half_width": pair.ci_half_width,
                                 "kernel_ms": round(pair.kernel.summary()["ms_median"], 4),
                                 "baseline_ms": round(pair.baseline.summary()["ms_median"], 4),
                                 **sampler.phase(t0, time.perf_counter())}
                res["rows"].append(row)
                done = len(res["rows"])
                left_s = (time.perf_counter() - started) / done * (total - done)
                print(f"[{done}/{total}, ~{left_s:.0f} s left] {line(row, args)}", flush=True)
                if on_row is not None:
                    on_row(res)
            for _, workload in sides.values():
                if workload.release is not None:
                    workload.release()
    return res


def _at(phase: dict) -> str:
    """' at 1800 MHz, 690 W' where NVML read them during the phase, else nothing."""
    read = [f"{v:.0f} {unit}" for v, unit in ((phase["clock_mhz"], "MHz"), (phase["power_w"], "W")) if v is not None]
    return f" at {', '.join(read)}" if read else ""


def line(row: dict, args) -> str:
    """One row as printed: the shape, each side alone, then paired."""
    alone, paired = row["alone"], row["paired"]
    sides = "; ".join(f"{name} {alone[role]['ms']:.3f} ms{_at(alone[role])}"
                      for role, name in (("kernel", args.kernel), ("baseline", args.baseline)))
    return (f"{row['n']}x{row['d']} #{row['repeat']}: alone {alone['ratio']:.3f} ({sides}), paired "
            f"{paired['ratio']:.3f} ({paired['kernel_ms']:.3f} / {paired['baseline_ms']:.3f} ms{_at(paired)})")


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out
    from attnbench.backends import BackendError
    from attnbench.gpu import NoGpuError
    from kernels._tuning import write_json_atomic

    def write(res):          # after every row, whole or not at all: what was measured stays if a later row fails
        write_json_atomic(out, res, indent=1)

    try:
        run(args, on_row=write)
    except NoGpuError as exc:
        print(f"clock_pairing: {exc}", file=sys.stderr)
        return EXIT_NO_GPU
    except (BackendError, ValueError) as exc:   # a backend name, a point it refuses
        print(f"clock_pairing: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
