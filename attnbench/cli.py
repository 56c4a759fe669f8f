"""The command line: a thin Typer layer that parses, calls the harness functions and renders with rich.

Exit codes: 0 ok · 1 a verdict failed (gate SLOWER or BROKEN, a spot-check that did not PASS, verify failed) · 2
bad input (matrix, run directory, option) · 3 no GPU/NVML · 4 no clean GPU within --wait · 5 a worker of a pool
(--gpus / --workers) died or failed: the others' points are kept, the run is resumable · 6 the run directory could
not be written (disk full, no permission): what was stored is kept, the run is resumable · 130 interrupted (Ctrl-C
or SIGTERM).
User mistakes get one line on stderr, never a traceback: the matrix and the run directory are validated
where they are read (matrix.py, store.py), options here (`_check_number`, `_check_results_root`), and a
usage error from the option parser is one line too (`main`).
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="attnbench: clean-GPU benchmarks of attention kernels against PyTorch SDPA.")


def _console(stderr: bool = False) -> Console:
    # Not a terminal (CI log, `| tee`): no folding to 80 columns; every table row stays one line.
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 100_000)


console = _console()
err = _console(stderr=True)
_argv: list[str] = []   # this invocation's arguments (set by main): the manifest keeps them for the resume hint


def _command_line() -> list[str]:
    return list(_argv or sys.argv[1:])

DeviceOpt = typer.Option("cuda", "--device", help="cuda (NVML clean-GPU check, CUDA events) or cpu (Triton interpreter, system-load check)")


def fail(message: str, code: int) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _user_errors():
    """The exceptions that mean 'the user asked for something wrong' → one line, exit 2."""
    from attnbench.backends import BackendError
    from attnbench.matrix import MatrixError
    from attnbench.store import RunDirError

    return (MatrixError, BackendError, RunDirError)


def _check_device(device: str) -> None:
    if device not in ("cuda", "cpu"):
        fail(f"--device {device!r}: allowed cuda, cpu", 2)
    from attnbench.runner import prepare_device

    prepare_device(device)


def _check_number(option: str, value, low=None, high=None, *, low_open: bool = False, high_open: bool = False,
                  integer: bool = False) -> None:
    """One line, exit 2, for a numeric option outside its range (NaN included: it compares false with anything)."""
    if value is None:
        return
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if not math.isfinite(value) or below or above:
        if low is not None and high is not None:
            bound = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        elif low is not None:
            bound = f"{'>' if low_open else '≥'} {low:g}"
        else:
            bound = f"{'<' if high_open else '≤'} {high:g}"
        fail(f"{option} {value:g}: need {'an integer' if integer else 'a number'} {bound}", 2)


def _check_clean_gpu_options(max_util, min_free_gb, wait=None) -> None:
    _check_number("--max-util", max_util, 0, 100)
    _check_number("--min-free-gb", min_free_gb, 0)
    _check_number("--wait", wait, 0)


def _check_results_root(results_root: Path, name: str = "results root") -> None:
    from attnbench.store import RunDirError, check_results_root

    try:
        check_results_root(results_root, name)
    except RunDirError as exc:
        fail(str(exc), 2)


def _device_memory(device: str, reader) -> int | None:
    """Bytes of memory the device offers to one point's inputs: the largest visible GPU's, or the host's RAM."""
    if device == "cpu":
        import psutil

        return psutil.virtual_memory().total
    if reader is None:
        return None
    from attnbench.gpu import visible_to_cuda

    indices = visible_to_cuda(reader)
    return max((reader.read(i)["mem_total"] for i in indices), default=None)


def _reader():
    from attnbench.gpu import NoGpuError, PynvmlReader

    try:
        return PynvmlReader()
    except NoGpuError as exc:
        fail(str(exc), 3)


def _clean_gpu_check(thresholds: dict | None, max_util: float | None, min_free_gb: float | None):
    """The matrix's clean-GPU thresholds (its `gate:` mapping), with the command line's on top."""
    from attnbench.gpu import CleanGpuCheck

    check = CleanGpuCheck(**(thresholds or {}))
    if max_util is not None:
        check.max_util_pct = max_util
    if min_free_gb is not None:
        check.min_free_gb = min_free_gb
    return check


# --- gpu-status --------------------------------------------------------------------------------

@app.command("gpu-status")
def gpu_status(as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
               max_util: float = typer.Option(8.0, help="clean-GPU check: max utilisation %"),
               min_free_gb: float = typer.Option(12.0, help="clean-GPU check: min free memory, GB"),
               sample_s: float = typer.Option(1.0, help="utilisation sampling window, seconds")):
    """Every visible GPU (utilisation sampled over a window, memory, clocks, power, throttle reasons, processes) and the system."""
    from attnbench.gpu import status_all

    _check_clean_gpu_options(max_util, min_free_gb)
    _check_number("--sample-s", sample_s, 0, 60)
    status = status_all(_reader(), _clean_gpu_check(None, max_util, min_free_gb), sample_s=sample_s)
    if as_json:
        print(json.dumps(status, indent=2, default=str))
        return
    t = Table(title=f"GPUs at {status['utc']}  (clean: util ≤ {max_util:g}%, free ≥ {min_free_gb:g} GB)")
    for col in ("idx", "name", "util % (max/median)", "mem used/free/total GB", "temp", "SM clock", "power",
                "clock events", "processes", "clean"):
        t.add_column(col)
    for g in status["gpus"]:
        samples = sorted(g["util_samples"]) or [float("nan")]
        procs = ", ".join(f"{p['pid']} {p['name']} {p['mem_mb'] or 0:.0f}MB" for p in g["processes"]) or "-"
        t.add_row(str(g["index"]), f"{g['name']}\n{g['uuid']}",
                  f"{g['util_pct']:.0f} / {samples[len(samples) // 2]:.0f} ({len(g['util_samples'])} samples)",
                  f"{g['mem_used_gb']:.1f} / {g['mem_free_gb']:.1f} / {g['mem_total_gb']:.1f}",
                  f"{g['temp_c']} C", f"{g['sm_clock_mhz']} / {g['sm_clock_max_mhz']} MHz",
                  f"{(g['power_w'] or 0):.0f} / {(g['power_limit_w'] or 0):.0f} W",
                  ", ".join(g["throttle_reasons"]) or "none", procs,
                  "[green]PASS[/]" if g["is_clean"] else "[red]FAIL[/] " + "; ".join(g["not_clean_because"]))
    console.print(t)
    s = status["system"]
    load = " ".join(f"{x:.2f}" for x in s["load_avg"] or [])
    console.print(f"system: CPU {s['cpu_pct']:.0f}% · load {load} · RAM {s['ram_used_gb']:.1f}/{s['ram_total_gb']:.1f} GB")
    console.print("busiest: " + ", ".join(f"{p['pid']} {p['name']} {p['cpu_pct']:.0f}% {p['rss_mb']:.0f}MB"
                                          for p in s["top_processes"]))


# --- list --------------------------------------------------------------------------------------

@app.command("list")
def list_backends(long: bool = typer.Option(False, "--long", help="add each backend's description")):
    """The backend registry: what each implementation supports (our kernels and the PyTorch baselines)."""
    from attnbench.backends import registry_rows

    t = Table(title="backends" + ("" if long else " (--long: with descriptions)"))
    columns = ["name", "status", "dtypes", "modes", "causal", "head dims", "shapes", "devices", "options"]
    for col in columns + (["description"] if long else []):
        t.add_column(col, overflow="fold")
    for r in registry_rows():
        if r["status"] != "ok":
            t.add_row(r["name"], f"[yellow]{r['status']}[/]", *[""] * (len(t.columns) - 2))
        else:
            t.add_row(r["name"], "ok", r["dtypes"], r["modes"], r["causal"], r["head_dims"], r["shapes"],
                      r["devices"], r["options"], *([r["description"]] if long else []))
    console.print(t)


# --- run-matrix --------------------------------------------------------------------------------

def _plan_table(matrix, device: str, history: dict | None = None, runs_read: int = 0) -> Table:
    """The expanded plan; with `history` (point_id → seconds from stored runs) each point's last wall time
    and the total, so a run can be fitted into a limited GPU lease."""
    from attnbench.runner import _skip_reason

    points = matrix.points()
    known = [history[p.id] for p in points if history and p.id in history]
    skipped = sum(1 for p in points if _skip_reason(p, device))
    title = f"plan: {matrix.name} ({len(points)} points, device {device}"
    title += f"; {skipped} skipped: their backend or timing mode cannot run there)" if skipped else ")"
    if history is not None:
        title += (f"; last time {sum(known) / 60:.1f} min for {len(known)} of them "
                  f"(from {runs_read} stored {device} runs; {len(points) - len(known)} never measured)")
    t = Table(title=title)
    for col in ("point", "kernel", "baseline", "dtype", "mode", "causal", "shape (B,H,N,D)", "note", "last s"):
        t.add_column(col)
    for p in points:
        c = p.cell
        if c.is_model:
            shape = f"model {c.model} img {p.n} batch {c.batch}" + (" compiled" if c.compile else "")
        else:
            shape = f"({c.batch},{c.heads},{p.q_len},{c.head_dim})"
            if c.grouped or p.q_len != p.kv_len:      # q's shape, then k's and v's
                shape += f" k,v ({c.batch},{c.heads_kv},{p.kv_len},{c.head_dim})"
        note = _skip_reason(p, device) or ""
        if not note and c.baseline_max_n is not None and p.n > c.baseline_max_n:
            note = f"baseline skipped above N={c.baseline_max_n}"
        last = f"{history[p.id]:.0f}" if history and p.id in history else "–"
        t.add_row(p.id, c.kernel, c.baseline, c.dtype, c.mode, str(c.causal).lower(), shape,
                  f"skip: {note}" if note else "", last)
    return t


def _require_gpu():
    """The NVML reader for the GPU path; no GPU/NVML/CUDA → one line, exit 3 (before any measuring: the commands
    check their own inputs first, so a mistake in them is named on a machine without a GPU too)."""
    reader = _reader()
    import torch

    if not torch.cuda.is_available():
        fail("torch sees no CUDA device (NVML does); check the driver / CUDA_VISIBLE_DEVICES, or use --device cpu", 3)
    return reader


class _PointCount:
    """`[k/N, ETA h:mm:ss] ` for a point's line where no progress bar is drawn (not a terminal): the ETA from the
    points this invocation has measured so far."""

    def start(self, total: int, done: int) -> None:
        import time

        self.total, self.done, self.measured, self.t0 = total, done, 0, time.monotonic()

    def advance(self) -> str:
        import time

        self.done, self.measured = self.done + 1, self.measured + 1
        left = round((time.monotonic() - self.t0) / self.measured * max(self.total - self.done, 0))
        return f"[{self.done}/{self.total}, ETA {left // 3600}:{left // 60 % 60:02d}:{left % 60:02d}] "


def _run(matrix, device: str, clean_check, gpu: Optional[str], wait: float, resume: Optional[Path],
         results_root: Path, max_attempts: Optional[int], argv: list[str], reader=None,
         slowdown: Optional[dict] = None, layout=None) -> Path:
    """Run with a live progress bar; returns the run directory. Shared by run-matrix and spot-check. `layout`
    (attnbench.pool.PoolLayout): several workers; their lines name the device that measured each point."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from attnbench.gpu import NoGpuError
    from attnbench.pool import Pool, PoolIncomplete
    from attnbench.runner import NoCleanGpu, Runner, RunInterrupted, RunOptions

    opts = RunOptions(device=device, results_root=results_root, clean_check=clean_check, gpu=gpu, wait_s=wait,
                      max_attempts=max_attempts, argv=argv, snapshot_s=1.0 if device == "cuda" else 0.2,
                      slowdown=slowdown or {})
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=err, transient=False)
    # not a terminal (CI log): the bar is not drawn until the end, so each point's line carries the count and ETA
    state = {"task": None, "measuring": {}, "count": None if err.is_terminal else _PointCount()}

    def stop_progress():
        if state["task"] is not None:   # stopping a bar never started would print an empty line
            progress.stop()

    def show_measuring():
        busy = " · ".join(f"{k} {v}" for k, v in sorted(state["measuring"].items()))
        progress.update(state["task"], description=busy or "idle")

    def on_event(kind, **d):
        if kind == "clean_gpu_probe":
            fails = "; ".join(f"GPU {i}: {', '.join(f)}" for i, f in d["failures"].items() if f) or "clean"
            err.print(f"[dim]clean-GPU probe: {fails} (waiting {d['remaining_s']:.0f}s more)[/]", highlight=False)
        elif kind == "repair":
            err.print(f"[yellow]repaired[/] {d['run_dir']}: {d['message']}", highlight=False, soft_wrap=True)
        elif kind == "complete":
            err.print(f"run dir: {d['run_dir']}  ·  already complete ({d['total']} points): nothing to measure",
                      highlight=False, soft_wrap=True)
        elif kind == "left_out":
            g = d["gpu"]
            err.print(f"[yellow]GPU {g['index']} ({g['name']}) left out[/]: {'; '.join(g['reasons'])}", highlight=False,
                      soft_wrap=True)
        elif kind == "start":
            if d.get("devices") is not None:
                unit = "measurements (every point on every worker)" if d["replicate"] else "points"
                where = f"{len(d['devices'])} workers: {', '.join(d['devices'])}"
                if device == "cpu":
                    where += " (CPU: perf numbers are not meaningful)"
            else:
                unit = "points"
                where = f"GPU {d['gpu'].index} {d['gpu'].name}" if d["gpu"] is not None else "CPU (perf numbers are not meaningful)"
            err.print(f"run dir: {d['run_dir']}  ·  {where}  ·  {d['todo']}/{d['total']} {unit} to measure")
            progress.start()
            state["task"] = progress.add_task("starting", total=d["total"], completed=d["total"] - d["todo"])
            if state["count"] is not None:
                state["count"].start(d["total"], d["total"] - d["todo"])
        elif kind == "point_start":
            if "device" in d:   # a pool: what each worker is measuring now
                state["measuring"][d["device"]] = d["point"].id
                show_measuring()
            else:
                progress.update(state["task"], description=d["point"].id)
        elif kind == "attempt" and d["status"] == "disturbed":
            who = f"[{d['device']}] " if "device" in d else ""
            progress.console.print(f"[yellow]{escape(who)}{d['point'].id}: attempt {d['attempt']} disturbed[/] "
                                   f"({'; '.join(d['reasons'])})", highlight=False)
        elif kind == "point_done":
            r = d["row"]
            ratio = "-" if r["lat_ratio"] is None else f"{r['lat_ratio']:.3f}"
            if r["ci_half_width"] is not None:
                ratio += f" ±{r['ci_half_width']:.1%}"
            who = f"[{d['device']}] " if "device" in d else ""
            if state["count"] is not None:
                who = state["count"].advance() + who
            progress.console.print(f"{escape(who)}{r['point_id']}: {r['status']} lat_ratio {ratio}"
                                   + (f" ({r['reason']})" if r["reason"] else ""), highlight=False)
            if "device" in d:
                state["measuring"].pop(d["device"], None)
                show_measuring()
            progress.advance(state["task"])
        elif kind == "worker_failed":
            state["measuring"].pop(d["device"], None)
            show_measuring()
            progress.console.print(f"[red]{escape(d['message'])}[/]", highlight=False, soft_wrap=True)

    if layout is not None:
        runner = Pool(matrix, opts, layout, reader=reader, on_event=on_event)
    else:
        runner = Runner(matrix, opts, reader=reader, on_event=on_event)

    def terminated(signum, frame):   # `timeout`, a batch scheduler: stopped as Ctrl-C stops a run (resumable, marked)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        return runner.run(resume=resume)
    except NoCleanGpu as exc:
        fail(f"{exc} (after waiting {wait:g}s; use --wait to wait longer)", 4)
    except NoGpuError as exc:
        fail(str(exc), 3)
    except RunInterrupted as exc:
        from attnbench.store import RunStore, resume_command

        stop_progress()
        if exc.error:    # a file of the run that could not be written (disk full, no permission)
            err.print(f"[bold red]error:[/] {escape(exc.error)}; everything measured is kept in "
                      f"{escape(str(exc.run_dir))}; once it can be written, finish it with:",
                      highlight=False, soft_wrap=True)
        else:
            err.print(f"[yellow]interrupted[/]: everything measured is kept in {escape(str(exc.run_dir))}; "
                      "finish it with:", highlight=False, soft_wrap=True)
        err.print(resume_command(RunStore(exc.run_dir).read_manifest(), exc.run_dir), markup=False,
                  highlight=False, soft_wrap=True)
        raise typer.Exit(6 if exc.error else 130)
    except PoolIncomplete as exc:
        from attnbench.store import RunStore, resume_command

        stop_progress()
        err.print(f"[red]incomplete[/]: {escape('; '.join(exc.problems))}. Everything measured is kept in "
                  f"{escape(str(exc.run_dir))}; finish it with:", highlight=False, soft_wrap=True)
        err.print(resume_command(RunStore(exc.run_dir).read_manifest(), exc.run_dir), markup=False,
                  highlight=False, soft_wrap=True)
        raise typer.Exit(5)
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_progress()


def _summary_table(run_dir: Path) -> Table:
    from attnbench.store import load_run

    run = load_run(run_dir)
    pooled = "pool" in run.manifest    # several workers: each row names the device that measured it
    t = Table(title=f"summary: {run_dir}")
    for col in ("point", *(("ran on",) if pooled else ()), "kernel ms", "baseline ms", "lat_ratio [p10–p90] ±CI",
                "mem_ratio", "status", "note"):
        t.add_column(col, overflow="fold")

    def f(v, fmt="{:.3f}"):
        return "-" if v != v or v is None else fmt.format(v)

    for _, r in run.points.iterrows():
        ratio = "-" if r.lat_ratio != r.lat_ratio else f"{r.lat_ratio:.3f} [{r.lat_ratio_p10:.3f}–{r.lat_ratio_p90:.3f}]"
        if ratio != "-" and r.ci_half_width == r.ci_half_width:
            ratio += f" ±{r.ci_half_width:.1%}"
        t.add_row(r.point_id, *((str(r.ran_on),) if pooled else ()), f(r.kernel_ms), f(r.baseline_ms), ratio,
                  f(r.mem_ratio), r.status, "" if r.reason != r.reason else str(r.reason))
    return t


@app.command("run-matrix")
def run_matrix(matrix_path: Path = typer.Argument(..., help="YAML matrix (see matrices/README.md)"),
               device: str = DeviceOpt,
               dry_run: bool = typer.Option(False, "--dry-run", help="print the expanded plan; touch no GPU"),
               resume: Optional[Path] = typer.Option(None, "--resume", help="finish an interrupted run directory"),
               gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU index or UUID (default: the cleanest passing one)"),
               max_util: Optional[float] = typer.Option(None, help="clean-GPU check: max utilisation % (default 8, or the matrix's)"),
               min_free_gb: Optional[float] = typer.Option(None, help="clean-GPU check: min free GB (default 12, or the matrix's)"),
               wait: float = typer.Option(0.0, "--wait", help="seconds to wait for a clean GPU before exit 4"),
               max_attempts: Optional[int] = typer.Option(None, help="override every cell's retry.max_attempts"),
               results_root: Path = typer.Option(Path("results/runs"), help="where run directories are created"),
               only: Optional[str] = typer.Option(None, "--only", help="run only the cells whose id matches this glob"),
               slowdown: List[str] = typer.Option([], "--slowdown", help="BACKEND=F: make every call of BACKEND F times "
                                                  "as long (F > 1, e.g. 1.15) with a calibrated delay after it: a "
                                                  "deliberate, recorded regression to prove the perf gate"),
               gpus: Optional[str] = typer.Option(None, "--gpus", help="all, or GPU indices as gpu-status numbers them "
                                                  "(e.g. 0,1): one worker process per listed GPU that passes the "
                                                  "clean-GPU check (the others are left out, named); the workers take "
                                                  "points from one queue into one run directory, each point stamped "
                                                  "with its GPU"),
               workers: Optional[int] = typer.Option(None, "--workers", help="--device cpu only: N worker processes, "
                                                     "the same code path as --gpus (for tests; CPU numbers mean nothing)"),
               replicate: bool = typer.Option(False, "--replicate", help="with --gpus / --workers: every point on every "
                                              "worker; the report shows each point's cross-device spread")):
    """Run a YAML matrix: wait for a clean GPU, measure every point kernel ⇄ baseline interleaved, store the run.
    With --gpus (or --workers on the CPU): one worker process per device, points from one queue, one run directory."""
    from attnbench.matrix import load_matrix
    from attnbench.store import load_run

    _check_device(device)
    _check_clean_gpu_options(max_util, min_free_gb, wait)
    _check_number("--max-attempts", max_attempts, 1, integer=True)
    if dry_run and resume is not None:
        fail("--dry-run prints a new run's plan; --resume DIR finishes a stored run (give one of them)", 2)
    if only is not None and not only.strip():
        fail("--only '': need a glob of cell ids (e.g. 'elsa_*'); leave --only out for every cell", 2)
    layout = _pool_layout(device, gpu, gpus, workers, replicate)
    try:        # the file and the options first, so a mistake in them is named on a machine without a GPU too
        matrix = _selected(load_matrix(matrix_path, device=device), only, matrix_path)
        slow = _parse_slowdown(slowdown, matrix)
        if resume is not None:
            load_run(resume)
    except _user_errors() as exc:
        fail(str(exc), 2)
    reader = _require_gpu() if device == "cuda" and not dry_run else None
    if layout is not None and layout.gpus_spec is not None and reader is not None:
        from attnbench.gpu import GpuListError, resolve_gpu_list

        try:
            layout.gpus = resolve_gpu_list(layout.gpus_spec, reader)
        except GpuListError as exc:
            fail(str(exc), 2)
    try:
        matrix.check_fits(_device_memory(device, reader), device)
        if dry_run:
            from attnbench.planning import point_seconds

            history, runs_read = point_seconds(results_root, device)
            console.print(_plan_table(matrix, device, history, runs_read))
            return
        if resume is None:
            _check_results_root(results_root)
        clean_check = _clean_gpu_check(matrix.gate, max_util, min_free_gb)
        run_dir = _run(matrix, device, clean_check, gpu, wait, resume, results_root, max_attempts, _command_line(),
                       reader, slow, layout)
        console.print(_summary_table(run_dir))
        console.print(f"run directory: {run_dir}")
    except _user_errors() as exc:
        fail(str(exc), 2)


def _selected(matrix, only: Optional[str], matrix_path: Path):
    """The matrix's cells --only picks (one line, exit 2 when it picks none)."""
    picked = matrix.select(only)
    if not picked.cells:
        fail(f"--only {only!r}: no cell of {matrix_path} matches", 2)
    return picked


def _check_gpu_option(device: str, gpu: Optional[str]) -> None:
    if gpu is not None and device != "cuda":
        fail("--gpu picks a GPU for --device cuda; --device cpu measures on the CPU", 2)


def _pool_layout(device: str, gpu: Optional[str], gpus: Optional[str], workers: Optional[int], replicate: bool):
    """The worker pool asked for (attnbench.pool.PoolLayout), or None for today's single process. The rule: --gpus
    is for --device cuda (one worker per GPU), --workers for --device cpu; --gpu (one GPU) is for --device cuda too
    and excludes --gpus; --replicate needs one of them. Bad values: one line, exit 2 (the GPU indices are checked
    against the machine once NVML is read)."""
    from attnbench.gpu import GpuListError, parse_gpu_list
    from attnbench.pool import PoolLayout

    _check_gpu_option(device, gpu)
    if gpus is not None:
        if device != "cuda":
            fail("--gpus selects GPUs for --device cuda; with --device cpu give --workers N", 2)
        if gpu is not None:
            fail("--gpu names one GPU and --gpus several: give one of them", 2)
        try:
            parse_gpu_list(gpus)
        except GpuListError as exc:
            fail(str(exc), 2)
    if workers is not None:
        if device != "cpu":
            fail("--workers is for --device cpu; on GPUs give --gpus all|0,1,… (one worker per GPU)", 2)
        _check_number("--workers", workers, 1, 64, integer=True)
    if replicate and gpus is None and workers is None:
        fail("--replicate runs every point on every worker: give --gpus (or --workers with --device cpu)", 2)
    if gpus is None and workers is None:
        return None
    return PoolLayout(workers=workers, replicate=replicate, gpus_spec=gpus)


def _parse_slowdown(items: list[str], matrix) -> dict:
    """--slowdown BACKEND=F items → {backend: F}: a backend the (selected) matrix measures, F finite and > 1."""
    import math

    used = sorted({c.kernel for c in matrix.cells} | {c.baseline for c in matrix.cells})
    out = {}
    for item in items:
        name, sep, text = item.partition("=")
        try:
            factor = float(text)
        except ValueError:
            factor = float("nan")
        if not sep or not name:
            fail(f"--slowdown {item!r}: expected BACKEND=FACTOR, e.g. elsa=1.15", 2)
        if name not in used:
            fail(f"--slowdown {item!r}: {name!r} is not measured by {matrix.path} (its backends: {', '.join(used)})", 2)
        if not math.isfinite(factor) or factor <= 1:
            fail(f"--slowdown {item!r}: the factor must be a finite number > 1 (1.15 = 15 % slower)", 2)
        if name in out:
            fail(f"--slowdown {item!r}: {name} has a factor already ({name}={out[name]:g}): give one per backend", 2)
        out[name] = factor
    return out


# --- runs ---------------------------------------------------------------------------------------

@app.command("runs")
def runs(results_root: Path = typer.Argument(Path("results/runs"), help="folder holding run directories")):
    """Every stored run: how many of its planned points it measured, and the command that finishes it."""
    from rich.table import Table

    from attnbench.runs import run_progress
    from attnbench.store import RunDirError, load_run, run_dirs

    if not results_root.is_dir():
        fail(f"{results_root}: {'not a folder' if results_root.exists() else 'no such folder'}", 2)
    try:
        directories = run_dirs(results_root)
    except RunDirError as exc:          # a root it cannot read
        fail(str(exc), 2)
    if not directories:
        fail(f"{results_root}: no run directories", 2)
    table = Table("run", "matrix", "points", "state")
    commands = []
    for run_dir in directories:
        try:
            info = run_progress(load_run(run_dir))
        except RunDirError as exc:
            table.add_row(run_dir.name, "–", "–", f"unreadable: {exc}")
            continue
        planned = "?" if info["planned"] is None else str(info["planned"])
        table.add_row(info["run"], info["matrix"], f"{info['measured']}/{planned}", info["state"])
        if info["resume"]:
            commands.append(info["resume"])
    console.print(table, markup=False)
    if commands:   # outside the table: a command folded into a cell could not be pasted
        console.print("to finish the unfinished runs:", highlight=False)
        for command in commands:
            console.print(command, markup=False, highlight=False, soft_wrap=True)


# --- verify-2pass ------------------------------------------------------------------------------

@app.command("verify-2pass")
def verify_2pass(device: str = DeviceOpt):
    """Instrument real ELSA launches and show that the forward is a two-pass parallel scan (phase 1 → HBM → phase 2)."""
    _check_device(device)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            fail("no CUDA device; use --device cpu", 3)
    from kernels.elsa.verify_2pass import verify_two_pass

    rows, ok, failures = verify_two_pass(device)
    t = Table(title=f"ELSA two-pass verification ({device})")
    cols = list(rows[0].keys()) if rows else []
    for col in cols:
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(*[str(r[c]) for c in cols])
    console.print(t)
    if ok:
        console.print("VERIFY: TWO-PASS PARALLEL SCAN CONFIRMED (phase1->global summaries->phase2 reduce, no FA fusion)",
                      soft_wrap=True, highlight=False)
    else:
        console.print(f"VERIFY: FAILED {'; '.join(failures)}", soft_wrap=True, highlight=False)
        raise typer.Exit(1)


# --- report / gate / spot-check ----------------------------------------------------------------

@app.command("report")
def report(run_dirs: Optional[List[Path]] = typer.Argument(None, help="run directories (one GPU model)"),
           runs_file: Optional[Path] = typer.Option(None, "--runs", help="a text file listing the run directories, one "
                                                    "per line, relative to the file (e.g. results/H100_runs.txt); a "
                                                    "line starting with ! supersedes earlier runs' points"),
           out: Optional[Path] = typer.Option(None, "--out", help="markdown path (default results/RESULTS_<GPU>.md)"),
           plots_dir: Optional[Path] = typer.Option(None, "--plots-dir", help="where the PNGs go"),
           no_plots: bool = typer.Option(False, "--no-plots", help="tables only")):
    """Regenerate the RESULTS markdown (tables, trends, load summary) and the plots from stored runs."""
    from attnbench.report import build_report
    from attnbench.runs import read_run_list

    try:
        listed = read_run_list(runs_file) if runs_file is not None else []
        dirs = list(run_dirs or []) + [run_dir for run_dir, _ in listed]
        if not dirs:
            fail("name the run directories, or a file listing them with --runs (e.g. results/H100_runs.txt)", 2)
        path = build_report(dirs, out, plots_dir, plots=not no_plots,
                            superseding=[run_dir for run_dir, supersedes in listed if supersedes])
    except (*_user_errors(), ValueError) as exc:
        fail(str(exc), 2)
    except OSError as exc:
        fail(f"cannot write the report{f' to {out}' if out else ''} or its plots: {exc.filename}: "
             f"{exc.strerror or exc}", 2)
    console.print(f"wrote {path}", highlight=False)


def _options_given(ctx: typer.Context, *names: str) -> list[str]:
    """The options among `names` (parameter names) given on the command line, as their flags: where an option means
    nothing with another, it is refused rather than dropped in silence."""
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    return [flags[n] for n in names
            if getattr(ctx.get_parameter_source(n), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")]


@app.command("gate")
def gate_cmd(ctx: typer.Context,
             baseline: Optional[Path] = typer.Option(None, "--baseline", help="baseline run dir (or a folder of runs: "
                                                     "its newest other than --current)"),
             current: Optional[Path] = typer.Option(None, "--current", help="current run dir"),
             tolerance: float = typer.Option(0.07, "--tolerance", help="relative change that counts as SLOWER/FASTER"),
             out: Optional[Path] = typer.Option(None, "--out", help="markdown summary (default <current>/gate.md)"),
             allow_other_gpu: bool = typer.Option(False, "--allow-other-gpu",
                                                  help="compare runs made on different GPU models (or devices)"),
             bless: Optional[Path] = typer.Option(None, "--bless", help="no comparison: install this finished run as "
                                                  "the baseline of its GPU (<baselines-root>/<gpu>/), replacing the last"),
             baselines_root: Path = typer.Option(Path("results/baselines"), "--baselines-root",
                                                 help="where --bless installs baselines (one bless at a time)")):
    """Per point SAME / FASTER / SLOWER / NOISY / BASELINE (only the baseline's own time moved) / HOST (a
    host-bound point moved with the machine's host) from the paired-ratio samples of both runs, BROKEN (the kernel
    failed in the current run only) and MISSING (no ratio in either run, or a point of one run only); exit 1 on any
    SLOWER or BROKEN; a run against itself is refused (exit 2).
    With --bless RUN: make RUN the baseline of its GPU instead."""
    from attnbench import gate as gatemod
    from attnbench.runs import torn_text
    from attnbench.store import load_run

    if bless is not None:
        extra = _options_given(ctx, "baseline", "current", "tolerance", "out", "allow_other_gpu")
        if extra:
            fail(f"--bless RUN installs a baseline and compares nothing; it takes no {', '.join(extra)}", 2)
        try:
            target = gatemod.bless_run(bless, baselines_root)
        except _user_errors() as exc:
            fail(str(exc), 2)
        commit = load_run(target).manifest.get("git_commit") or "unknown commit"
        console.print(f"baseline for {target.parent.name}: {target} (measured {commit})", highlight=False)
        return
    if baseline is None or current is None:
        fail("gate needs --baseline RUN and --current RUN (or --bless RUN)", 2)
    if _options_given(ctx, "baselines_root"):
        fail("--baselines-root is where --bless installs a baseline; a comparison takes --baseline RUN", 2)
    _check_number("--tolerance", tolerance, 0, 1, low_open=True, high_open=True)
    try:
        base_run, current_run = gatemod.load_pair(baseline, current)
        for run in (base_run, current_run):
            if run.torn:           # a record left out of the comparison (a torn points row: MISSING): say so
                err.print(f"warning: {run.path}: {torn_text(run)}", highlight=False, soft_wrap=True)
        gatemod.check_comparable(base_run, current_run, allow_other_gpu=allow_other_gpu)
        rows = gatemod.compare_runs(base_run, current_run, tolerance=tolerance)
    except (*_user_errors(), ValueError) as exc:
        fail(str(exc), 2)
    md = gatemod.gate_markdown(rows, baseline=str(base_run.path), current=str(current_run.path), tolerance=tolerance)
    target = out or current_run.path / "gate.md"
    try:
        target.write_text(md)
    except OSError as exc:
        fail(f"{target}: cannot write the gate summary ({exc.strerror or exc}); choose another --out", 2)
    console.print(md, highlight=False, soft_wrap=True)
    raise typer.Exit(gatemod.gate_exit_code(rows))


@app.command("spot-check")
def spot_check(ctx: typer.Context,
               matrix_path: Path = typer.Argument(Path("matrices/spot_check.yaml"),
                                                  help="spot-check YAML (cells + checks)"),
               device: str = DeviceOpt,
               gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU index or UUID"),
               max_util: Optional[float] = typer.Option(None, help="clean-GPU check: max utilisation %"),
               min_free_gb: Optional[float] = typer.Option(None, help="clean-GPU check: min free GB"),
               wait: float = typer.Option(0.0, "--wait", help="seconds to wait for a clean GPU before exit 4"),
               results_root: Path = typer.Option(Path("results/runs"), help="where the run directory is kept"),
               resume: Optional[Path] = typer.Option(None, "--resume", help="finish an interrupted spot-check run directory"),
               rescore: Optional[Path] = typer.Option(None, "--rescore", help="no measuring: score a stored spot-check "
                                                      "run against the file's current bands (correctness checks: not "
                                                      "run), the file read for the device the run was measured on")):
    """Run the spot-check points and print one verdict per check (PASS, FAIL, NOT_LANDED, ERROR); exit 0 only if
    there are checks and every one passes."""
    from attnbench import spotcheck
    from attnbench.store import load_run

    _check_device(device)
    _check_clean_gpu_options(max_util, min_free_gb, wait)
    _check_gpu_option(device, gpu)
    if rescore is not None:
        extra = _options_given(ctx, "gpu", "max_util", "min_free_gb", "wait", "results_root", "resume")
        if extra:
            fail(f"--rescore DIR scores a stored run without measuring; it takes no {', '.join(extra)}", 2)
        _rescore_spot_check(matrix_path, rescore, device if _options_given(ctx, "device") else None)
    try:        # the file first, so a mistake in it is named on a machine without a GPU too
        plan = spotcheck.load_spot_check(matrix_path, device=device)
        if resume is not None:
            load_run(resume)
    except _user_errors() as exc:
        fail(str(exc), 2)
    reader = _require_gpu() if device == "cuda" else None
    try:
        run = None
        if plan.matrix is not None:
            plan.matrix.check_fits(_device_memory(device, reader), device)
            if resume is None:
                _check_results_root(results_root)
            clean_check = _clean_gpu_check(plan.matrix.gate, max_util, min_free_gb)
            run = load_run(_run(plan.matrix, device, clean_check, gpu, wait, resume, results_root, None,
                                _command_line(), reader))
        torch_device = device
        if device == "cuda":
            import torch

            torch_device = f"cuda:{torch.cuda.current_device()}"   # the GPU the clean-GPU check chose, not blindly GPU 0
        results = spotcheck.evaluate_checks(plan, run, device=torch_device)
    except _user_errors() as exc:
        fail(str(exc), 2)
    table = spotcheck.spot_check_table(results)
    console.print(table, highlight=False, soft_wrap=True, markup=False)   # descriptions hold [seed: …]
    if run is not None:
        (run.path / "spot_check.md").write_text(table)
        console.print(f"run directory: {run.path}", highlight=False)
    raise typer.Exit(spotcheck.spot_check_exit_code(results))


def _rescore_spot_check(matrix_path: Path, run_dir: Path, device: str | None) -> None:
    """Perf bands re-evaluated on a stored run (after a band change); writes spot_check_rescored.md beside it. The
    file is read for the device the run was measured on (a --device given must be that one)."""
    from attnbench import spotcheck
    from attnbench.store import RunDirError, load_run

    try:
        run = load_run(run_dir)
        measured_on = run.manifest.get("device") or "cuda"
        if device not in (None, measured_on):
            raise RunDirError(f"--device {device}: {run.path} was measured on {measured_on}, and --rescore reads "
                              f"{matrix_path} for that device (leave --device out)")
        plan = spotcheck.load_spot_check(matrix_path, device=measured_on)   # the device only for validation
        perf = [c for c in plan.checks if c.get("kind") != "correctness"]    # correctness needs the kernels run
        if not {c for check in perf for c in check["cells"]} & set(run.points["cell_id"]):
            raise RunDirError(f"{run.path}: holds no point of the cells {matrix_path}'s checks judge (its matrix is "
                              f"{run.manifest.get('matrix_name', '?')}): re-score a run of that spot-check file")
        results = spotcheck.evaluate_checks(perf, run, run_correctness=False)   # the points are all stored
    except _user_errors() as exc:
        fail(str(exc), 2)
    table = (f"Perf bands of `{matrix_path}` re-scored on this stored run (`attnbench spot-check --rescore`); "
             "the correctness checks are in the run's own spot_check.md.\n\n" + spotcheck.spot_check_table(results))
    target = run.path / "spot_check_rescored.md"
    try:
        target.write_text(table)
    except OSError as exc:
        fail(f"{target}: cannot write the re-scored table ({exc.strerror or exc})", 2)
    console.print(table, highlight=False, soft_wrap=True, markup=False)
    raise typer.Exit(spotcheck.spot_check_exit_code(results))


@app.command("accuracy")
def accuracy(device: str = DeviceOpt,
             out_dir: Path = typer.Option(Path("results/accuracy"), "--out-dir", help="CSV, markdown table and heat-maps"),
             n: int = typer.Option(1407, help="sequence length (the paper's)"),
             heads_q: int = typer.Option(28, help="query heads"),
             seeds: int = typer.Option(3, help="random seeds per grid point")):
    """PASA's overflow/accuracy benchmark: non-finite fraction and relative RMSE of pasa, fa16 and SDPA flash,
    efficient and math (same dtype) and math in float32, on the paper's uniform and hybrid normal-Bernoulli grids
    (float64 reference). On the CPU, SDPA flash and efficient are skipped (their GPU kernels are what is compared)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from kernels.pasa import accuracy as acc

    _check_device(device)
    for option, value in (("--n", n), ("--heads-q", heads_q), ("--seeds", seeds)):
        _check_number(option, value, 1, integer=True)
    if heads_q % acc.PAPER_HEADS_KV:
        fail(f"--heads-q {heads_q}: need a multiple of {acc.PAPER_HEADS_KV} (the grid's key/value heads, each shared "
             "by a group of query heads)", 2)
    _check_results_root(out_dir, "--out-dir")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            fail("no CUDA device; use --device cpu (slow: the kernels run in the Triton interpreter)", 3)
    with Progress(TextColumn("accuracy grid"), BarColumn(), MofNCompleteColumn(), TextColumn("ETA"),
                  TimeRemainingColumn(), console=err) as progress:
        task = progress.add_task("grid", total=None)
        df = acc.accuracy_grid(seeds=tuple(range(seeds)), n=n, heads_q=heads_q, device=device,
                               on_point=lambda done, total: progress.update(task, completed=done, total=total))
    df.to_csv(out_dir / "accuracy.csv", index=False)
    table = acc.accuracy_table_markdown(df)
    biased = ("\nOn the biased points (x₀ ≠ 0), per method: overflow and the range of rel_rmse where the output "
              "is finite.\n\n" + acc.biased_inputs_markdown(df))
    (out_dir / "accuracy.md").write_text(table + biased)
    pngs = acc.plot_accuracy_heatmaps(df, out_dir)
    console.print(table + biased, highlight=False, soft_wrap=True)
    console.print(acc.check_accuracy_targets(df).to_string(), highlight=False)
    console.print(f"wrote {out_dir}/accuracy.csv, accuracy.md and {len(pngs)} heat-maps", highlight=False)


def _click_exception():
    try:   # typer ≥ 0.28 vendors click; older typer (the GPU machine's) uses click itself
        from typer._click.exceptions import ClickException
    except ImportError:
        from click.exceptions import ClickException
    return ClickException


def _given(exc, argv: list[str]) -> str:
    """' (given: VALUE)' for a parser error about an option's value, naming the value as typed where click's message
    does not (typer 0.29's says only "Input should be a valid integer"); else ''."""
    param = getattr(exc, "param", None)
    for opt in getattr(param, "opts", None) or ():
        for i, arg in enumerate(argv):
            if arg == opt and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(opt + "="):
                value = arg[len(opt) + 1:]
            else:
                continue
            return "" if repr(value) in exc.format_message() else f" (given: {value!r})"
    return ""


def main(argv: list[str] | None = None) -> None:
    global _argv
    argv = sys.argv[1:] if argv is None else list(argv)
    _argv = argv
    # Triton's interpreter must be configured before anything imports triton.
    if "--device" in argv:
        i = argv.index("--device")
        if i + 1 < len(argv) and argv[i + 1] == "cpu":
            os.environ.setdefault("TRITON_INTERPRET", "1")
    elif any(a.startswith("--device=cpu") for a in argv):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        code = app(args=argv, prog_name="attnbench", standalone_mode=False)
    except _click_exception() as exc:
        # the parser's own errors (unknown option, missing argument, not a number): one line, like ours
        if type(exc).__name__ == "NoArgsIsHelpError":   # `attnbench` alone: typer has printed the help already
            if exc.format_message().strip():
                err.print(exc.format_message(), markup=False, highlight=False)
        else:
            context = getattr(exc, "ctx", None)
            where = f"{context.command_path}: " if context is not None else ""
            err.print(f"[bold red]error:[/] {escape(where + exc.format_message() + _given(exc, argv))} (see --help)",
                      highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
