"""The point loop: clean-GPU check, snapshots, interleaved measurement, verdict, retries, resume.

For every point: snapshot(before) → measure kernel ⇄ baseline (attnbench.measure.pair) → snapshot(after)
→ verdict (attnbench.measure.noise). A disturbed window is retried after the policy's back-off, up to the
cell's max_attempts; every attempt is appended to attempts.jsonl as it is made, and the point's final row to
points.csv. Ctrl-C leaves the run directory consistent and resumable. Nothing here prints: progress goes to
an `on_event` callback. How to time, pair, sample and judge lives in attnbench.measure; this is the loop.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from attnbench import gpu as gpumod
from attnbench.backends import get_backend, make_attention_workload
from attnbench.matrix import Matrix, Point
from attnbench.measure import ClockMonitor, NoisePolicy, PairResult, SideResult, measure_pair
from attnbench.store import (RunDirError, RunStore, RunWriteError, matrix_file, recorded_only, resume_command,
                             utc_now)


class RunInterrupted(Exception):
    """Ctrl-C during a run, or `error`: a file of the run directory that could not be written (disk full, no
    permission; one line naming it). The directory is consistent and can be resumed."""

    def __init__(self, run_dir: Path, error: str | None = None):
        super().__init__(error or str(run_dir))
        self.run_dir, self.error = run_dir, error


@contextlib.contextmanager
def holding(store: RunStore):
    """While a run writes its (locked) run directory: unlocked at the end, and a Ctrl-C or a write that fails
    stops the run as an interrupted one (RunInterrupted), marked so in the manifest where it can still be written:
    everything already stored is kept and a resume finishes it."""
    try:
        yield store
    except (KeyboardInterrupt, RunWriteError) as exc:
        with contextlib.suppress(RunDirError):   # the disk may be what failed: then the run stays "unfinished"
            store.update_manifest(interrupted=True)
        raise RunInterrupted(store.path, str(exc) if isinstance(exc, RunWriteError) else None) from None
    finally:
        store.unlock()


@dataclass
class RunOptions:
    device: str = "cuda"                      # "cuda" or "cpu"
    results_root: Path = Path("results/runs")
    clean_check: gpumod.CleanGpuCheck = field(default_factory=gpumod.CleanGpuCheck)
    gpu: str | None = None                    # index or UUID; None = cleanest
    wait_s: float = 0.0                       # how long to wait for a clean GPU before giving up
    max_attempts: int | None = None           # override every cell's retry.max_attempts
    snapshot_s: float = 1.0                   # NVML sampling window of each snapshot
    settle_s: float = 1.0                     # idle time before a snapshot, so NVML util no longer sees our own work
    argv: list[str] = field(default_factory=list)
    slowdown: dict = field(default_factory=dict)   # backend name → time factor > 1 (gate proof only; in the manifest)


def _git_commit() -> str | None:
    if os.environ.get("ATTNBENCH_GIT_COMMIT"):   # set where the tree travels without .git (the device machine)
        return os.environ["ATTNBENCH_GIT_COMMIT"]
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _program() -> list[str]:
    """How this process was started, so the resume hint can be pasted where it ran: the installed `attnbench`
    script, or `python -m attnbench` (the GPU machine runs it from the tree)."""
    if Path(sys.argv[0]).name == "attnbench":
        return ["attnbench"]
    return [sys.executable, "-m", "attnbench"]


def versions(reader=None) -> dict:
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    driver = None
    if reader is not None:
        try:
            d = reader.nv.nvmlSystemGetDriverVersion()
            driver = d.decode() if isinstance(d, bytes) else d
        except Exception:
            driver = None
    return {"python": platform.python_version(), "torch": torch.__version__, "triton": triton_version,
            "cuda": torch.version.cuda, "driver": driver}


def prepare_device(device: str) -> None:
    """The CPU path runs Triton kernels through the interpreter; it must be set before triton is imported."""
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _skip_reason(point: Point, device: str) -> str | None:
    cell = point.cell
    if cell.is_model:
        return None
    reasons = ["CUDA graph timing needs a GPU"] if point.timing_mode == "graph" and device == "cpu" else []
    for slot in ("kernel", "baseline"):
        backend = get_backend(getattr(cell, slot))
        reason = backend.unsupported_reason(dtype=cell.dtype, mode=cell.mode, causal=cell.causal,
                                            head_dim=cell.head_dim, device=device, gqa=cell.grouped,
                                            cross=point.q_len != point.kv_len)
        if reason:
            reasons.append(reason)
    return "; ".join(reasons) or None


def _make_workload(point: Point, slot: str, device: str):
    cell = point.cell
    name = getattr(cell, slot)
    if cell.is_model:
        from attnbench.models import make_model_workload

        return make_model_workload(cell.model, point.n, cell.batch, cell.dtype, cell.mode, name, device,
                                   compile=cell.compile)
    backend = get_backend(name)
    return make_attention_workload(backend, batch=cell.batch, heads=cell.heads, n=point.q_len, head_dim=cell.head_dim,
                                   dtype=cell.dtype, mode=cell.mode, causal=cell.causal, device=device,
                                   options=getattr(cell, f"{slot}_options"), kv_heads=cell.heads_kv, kv_len=point.kv_len)


def measure_point(point: Point, device: str, monitor=None, slowdown: dict | None = None) -> PairResult:
    """One attempt at one point: both workloads built, timed interleaved in the point's timing mode, released.
    `slowdown` maps backend names to a planted time factor (> 1). Never raises for kernel errors."""
    import torch

    cell = point.cell
    timing = dict(cell.timing)
    if cell.is_model:
        timing["flush_l2"] = False   # a whole model streams far more than L2 holds; flushing adds nothing
    slowdown = slowdown or {}
    factors = {slot: slowdown.get(getattr(cell, slot), 1.0) for slot in ("kernel", "baseline")}
    sides = {"kernel": SideResult(cell.kernel), "baseline": SideResult(cell.baseline)}
    workloads = {}
    try:
        for slot in ("kernel", "baseline"):
            if slot == "baseline" and cell.baseline_max_n is not None and point.n > cell.baseline_max_n:
                sides[slot].status = "skipped"
                sides[slot].message = f"{cell.baseline} skipped above N={cell.baseline_max_n}"
                continue
            try:
                workloads[slot] = _make_workload(point, slot, device)
            except Exception as exc:
                sides[slot].fail(exc, "setup: ")
        kw = dict(timing=timing, device=device, mode=point.timing_mode, monitor=monitor)
        if set(workloads) == {"kernel", "baseline"}:
            return measure_pair(workloads["kernel"], workloads["baseline"], kernel_name=cell.kernel,
                                baseline_name=cell.baseline, slowdown=factors, **kw)
        if workloads:
            # one side could not be set up (or is skipped): still time the other alone, so the table shows its cost
            slot, wl = next(iter(workloads.items()))
            alone = measure_pair(wl, None, kernel_name=getattr(cell, slot), baseline_name=None,
                                 slowdown={"kernel": factors[slot]}, **kw)
            sides[slot] = alone.kernel
            return dataclasses.replace(alone, kernel=sides["kernel"], baseline=sides["baseline"])
        return PairResult(sides["kernel"], sides["baseline"], [], timing_mode=point.timing_mode)
    finally:
        for wl in workloads.values():
            if wl.release:
                wl.release()
        workloads.clear()
        import gc

        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def gpu_ran_on(gpu) -> dict:
    """What a record says about the GPU that ran it: its NVML index (label cuda:<index>, as gpu-status numbers
    it), name and UUID."""
    return {"label": f"cuda:{gpu.index}", "index": gpu.index, "name": gpu.name, "uuid": gpu.uuid}


def cpu_ran_on(worker: int = 0) -> dict:
    return {"label": f"cpu:{worker}", "worker": worker}


def _attempt_record(point: Point, attempt: int, status: str, reasons, message, result: PairResult | None,
                    before, after, monitor_summary, ran_on: dict | None = None):
    k = result.kernel.summary() if result else None
    b = result.baseline.summary() if result and result.baseline else None
    mem_ratio = None
    if k and b and k["mem_mb"] is not None and b["mem_mb"]:
        mem_ratio = k["mem_mb"] / b["mem_mb"]
    ratio = result.ratio_summary() if result else None
    sampling = result.sampling_summary(point.cell.timing["ci_half_width"]) if result else None
    return {"point_id": point.id, "cell_id": point.cell.id, "n": point.n, "timing_mode": point.timing_mode,
            "attempt": attempt, "utc": utc_now(), "status": status, "disturbed_reasons": list(reasons),
            "message": message, "kernel": k, "baseline": b, "ratio": ratio, "sampling": sampling,
            "mem_ratio": mem_ratio, "monitor": monitor_summary, "before": before, "after": after,
            "ran_on": {**ran_on, "pid": os.getpid()} if ran_on else None}


def _point_row(point: Point, record: dict, attempts: int) -> dict:
    cell = point.cell
    k, b, r = record["kernel"] or {}, record["baseline"] or {}, record["ratio"] or {}
    reasons = record["disturbed_reasons"]
    reason = record["message"] or ("; ".join(reasons) if reasons else None)
    half = (record["sampling"] or {}).get("ci_half_width") if r else None
    return {"point_id": point.id, "cell_id": cell.id, "kernel": cell.kernel if not cell.is_model else f"{cell.model}:{cell.kernel}",
            "baseline": cell.baseline, "dtype": cell.dtype, "mode": cell.mode, "causal": cell.causal,
            "batch": cell.batch, "heads": cell.heads, "head_dim": cell.head_dim, "n": point.n,
            "kv_heads": cell.heads_kv, "q_len": None if cell.is_model else point.q_len,
            "kv_len": None if cell.is_model else point.kv_len,
            "kernel_ms": k.get("ms_median"), "kernel_ms_p10": k.get("ms_p10"), "kernel_ms_p90": k.get("ms_p90"),
            "baseline_ms": b.get("ms_median"), "baseline_ms_p10": b.get("ms_p10"), "baseline_ms_p90": b.get("ms_p90"),
            "lat_ratio": r.get("median"), "lat_ratio_p10": r.get("p10"), "lat_ratio_p90": r.get("p90"),
            "kernel_mem_mb": k.get("mem_mb"), "baseline_mem_mb": b.get("mem_mb"), "mem_ratio": record["mem_ratio"],
            "kernel_tflops": k.get("tflops"), "baseline_tflops": b.get("tflops"),
            "status": record["status"], "attempts": attempts, "reason": reason,
            "timing": point.timing_mode, "spread": r.get("spread"), "lat_ratio_ci_low": r.get("ci_low"),
            "lat_ratio_ci_high": r.get("ci_high"), "ci_half_width": half,
            "ran_on": (record.get("ran_on") or {}).get("label"), "ran_on_uuid": (record.get("ran_on") or {}).get("uuid"),
            "kernel_host_ms": k.get("host_ms_median"), "baseline_host_ms": b.get("host_ms_median")}


class Runner:
    """Runs a Matrix into a run directory. `reader` is an NVML adapter (None on the CPU path)."""

    def __init__(self, matrix: Matrix, options: RunOptions, reader=None, on_event=None, sleep=time.sleep,
                 ran_on: dict | None = None):
        self.matrix, self.opt, self.reader = matrix, options, reader
        self.on_event = on_event or (lambda kind, **data: None)
        self.sleep = sleep
        self.gpu_index: int | None = None
        # the device every record is stamped with: set when the GPU is chosen (cpu:0 on the CPU); a pool's worker
        # gets its own (attnbench.pool)
        self.ran_on = ran_on if ran_on is not None else (cpu_ran_on(0) if options.device == "cpu" else None)
        self.own_pid = os.getpid()
        self._last_snapshot: tuple[float, dict] | None = None

    def _snapshot(self, reuse_s: float = 0.0) -> dict:
        """A settled GPU + system snapshot. The 'after' of one point is also the 'before' of the next
        when nothing ran in between (younger than `reuse_s`), which halves the idle time per point."""
        now = time.monotonic()
        if reuse_s > 0 and self._last_snapshot and now - self._last_snapshot[0] < reuse_s:
            return self._last_snapshot[1]
        snap = gpumod.snapshot(self.reader, self.gpu_index, sample_s=self.opt.snapshot_s,
                               settle_s=self.opt.settle_s if self.opt.device == "cuda" else 0.0)
        self._last_snapshot = (time.monotonic(), snap)
        return snap

    def select_gpu(self) -> gpumod.GpuStatus | None:
        """The clean-GPU check before the run: choose the cleanest GPU or wait; returns None if none passed in time."""
        if self.opt.device != "cuda":
            return None

        def on_probe(gpus, failures, remaining):
            self.on_event("clean_gpu_probe", gpus=gpus, failures=failures, remaining_s=remaining)

        choice, gpus, failures = gpumod.wait_for_clean_gpu(self.reader, self.opt.clean_check, self.opt.gpu, self.opt.wait_s,
                                                           on_probe=on_probe, sample_s=self.opt.snapshot_s,
                                                           sleep=self.sleep)
        if choice is None:
            raise NoCleanGpu(gpumod.no_clean_gpu_line(gpus, failures))
        self.gpu_index = choice.index
        self.ran_on = gpu_ran_on(choice)
        return choice

    def _bind_torch_device(self, choice) -> None:
        import torch

        for i in range(torch.cuda.device_count()):
            uuid = str(getattr(torch.cuda.get_device_properties(i), "uuid", ""))
            if uuid and choice.uuid.endswith(uuid.replace("GPU-", "")):
                torch.cuda.set_device(i)
                return
        torch.cuda.set_device(0)

    def manifest(self, choice) -> dict:
        import torch

        gpu = None
        if choice is not None:
            gpu = {"index": choice.index, "name": choice.name, "uuid": choice.uuid,
                   "sm_count": torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count}
        return {"matrix_path": str(self.matrix.path), "matrix_name": self.matrix.name,
                "matrix_sha256": self.matrix.sha256, "plan_sha256": self.matrix.plan_sha256(),
                "program": _program(), "argv": self.opt.argv, "cwd": os.getcwd(), "git_commit": _git_commit(),
                "started_utc": utc_now(), "finished_utc": None, "device": self.opt.device,
                "versions": versions(self.reader), "gpu": gpu,
                # stored under "gate", the key every run directory has used for the clean-GPU thresholds
                "gate": {"max_util_pct": self.opt.clean_check.max_util_pct, "min_free_gb": self.opt.clean_check.min_free_gb,
                         **({"max_cpu_pct": self.opt.clean_check.max_cpu_pct} if self.opt.device == "cpu" else {})},
                "host": socket.gethostname(), "interrupted": False, "injected_slowdown": self.opt.slowdown,
                "python_executable": sys.executable, "kernel_switches": kernel_switches()}

    def run(self, resume: Path | None = None) -> Path:
        """Measure every point into a new run directory, or finish `resume`; returns the run directory.
        The directory is locked while this runs, so a second process cannot append to it."""
        prepare_device(self.opt.device)
        if resume is not None:
            store = RunStore.open_existing(resume)
            store.lock()
            with holding(store):
                return self._resume(store)
        choice = self._choose_and_bind_gpu()
        store = RunStore.create(self.opt.results_root, self.matrix.name, self.manifest(choice))
        with holding(store):
            return self._measure(store, self.matrix.points(), set(), choice)

    def _choose_and_bind_gpu(self):
        choice = self.select_gpu()
        if choice is not None:
            self._bind_torch_device(choice)
        return choice

    def _resume(self, store: RunStore) -> Path:
        manifest = check_resumable(store, self.matrix, self.opt, replicate=False)
        for line in store.repair():
            self.on_event("repair", run_dir=store.path, message=line)
        done = store.finished_point_ids()
        points = self.matrix.points()
        if manifest.get("finished_utc") and self.matrix.covered_by(done):
            # a complete run: nothing to measure, and nothing in the directory is rewritten
            self.on_event("complete", run_dir=store.path, total=len(points))
            return store.path
        choice = self._choose_and_bind_gpu()
        store.update_manifest(interrupted=False, resumed_utc=utc_now())
        return self._measure(store, points, done, choice)

    def _measure(self, store: RunStore, points: list[Point], done: set[str], choice) -> Path:
        todo = [p for p in points if p.id not in done]
        self.on_event("start", run_dir=store.path, total=len(points), todo=len(todo), gpu=choice)
        for point in todo:     # a Ctrl-C or a failed write: RunInterrupted (holding)
            self.on_event("point_start", point=point)
            row = self.run_point(point, store)
            self.on_event("point_done", point=point, row=row)
        store.update_manifest(finished_utc=utc_now(), interrupted=False)
        self.on_event("finish", run_dir=store.path)
        return store.path

    def run_point(self, point: Point, store: RunStore) -> dict:
        policy = NoisePolicy.for_cell(point.cell, self.opt.max_attempts)
        skip = _skip_reason(point, self.opt.device)
        if skip:
            snap = self._snapshot(reuse_s=3.0)   # nothing runs for a skipped point: the last snapshot still holds
            record = _attempt_record(point, 1, "skipped", [], skip, None, snap, snap, None, self.ran_on)
            store.append_attempt(record)
            row = _point_row(point, record, 1)
            store.append_point(row)
            return row
        attempt = 0
        while True:
            attempt += 1
            before = self._snapshot(reuse_s=3.0 if attempt == 1 else 0.0)
            monitor = ClockMonitor(self.reader, self.gpu_index) if self.reader is not None and self.gpu_index is not None else None
            result = measure_point(point, self.opt.device, monitor, self.opt.slowdown)
            after = self._snapshot()
            monitor_summary = monitor.summary() if monitor else None
            status, reasons, message = policy.verdict(result, before, after, monitor_summary, self.opt.clean_check,
                                                      self.own_pid, self.opt.device)
            record = _attempt_record(point, attempt, status, reasons, message, result, before, after, monitor_summary,
                                     self.ran_on)
            store.append_attempt(record)
            self.on_event("attempt", point=point, attempt=attempt, status=status, reasons=reasons)
            if not policy.retry(status, attempt):
                break
            self.sleep(policy.backoff(attempt))
        row = _point_row(point, record, attempt)
        store.append_point(row)
        return row


def kernel_switches() -> dict:
    """The kernels' environment switches set in this process (ATTNBENCH_FAST_LAUNCH, ATTNBENCH_TRACED_LAUNCHES,
    ATTNBENCH_DEPENDENT_LAUNCH, ...): a run made with one set measured other code paths than the defaults."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("ATTNBENCH_") and k != "ATTNBENCH_GIT_COMMIT"}


def check_resumable(store: RunStore, matrix: Matrix, opt: RunOptions, replicate: bool) -> dict:
    """The manifest of a run directory that may be finished with `matrix` on opt.device, with its planted
    slowdowns, kernel switches and with or without --replicate, as it was started; RunDirError (one line)
    otherwise."""
    manifest = store.read_manifest()
    # A run whose fingerprint no longer matches (its cells changed, or an older harness fingerprinted its
    # sampling policy too) is refused, unless it is complete under today's plan: then nothing is measured,
    # so nothing can mix with what it holds
    complete = bool(manifest.get("finished_utc")) and matrix.covered_by(store.finished_point_ids())

    def refuse(started: str, resumed: str, why: str = "") -> RunDirError:
        # a setting every point of a run must share, not the run's own: the command that finishes it
        return RunDirError(f"{store.path}: started with {started}, resumed with {resumed}{why}; finish it with: "
                           f"{resume_command(manifest, store.path)}")

    if not matrix.can_resume(manifest) and not complete:
        own = matrix_file(manifest)
        if (manifest.get("matrix_name") or matrix.name) != matrix.name or \
                (own is not None and os.path.realpath(own) != os.path.realpath(matrix.path)):
            # another matrix file than the run's own: name the run's, not a change of the file given
            raise refuse(f"{manifest.get('matrix_path')} (matrix {manifest.get('matrix_name', '?')!r})",
                         f"{matrix.path} (matrix {matrix.name!r})")
        raise RunDirError(f"{store.path}: the cells of {matrix.path} this run measures changed since it "
                          f"started (sha256 {str(manifest.get('matrix_sha256', '?'))[:12]} → "
                          f"{matrix.sha256[:12]}); start a new run")
    if not complete:
        # the same file selected by another --only (or none) would add other cells' points to the run (can_resume
        # accepts the file's hash alone): unless the cells are the same problem, the selection must be the run's own
        started_with = recorded_only(manifest) if manifest.get("argv") else matrix.only
        if started_with != matrix.only and manifest.get("plan_sha256") != matrix.plan_sha256():
            raise refuse(_selection(started_with), _selection(matrix.only))
        # a planted slowdown (the gate's proof) holds for every point of a run or for none
        planted = {name: float(f) for name, f in (manifest.get("injected_slowdown") or {}).items()}
        if planted != opt.slowdown:
            raise refuse(_planted(planted), _planted(opt.slowdown))
        switches = manifest.get("kernel_switches")       # (runs before the manifest kept them: not known)
        if switches is not None and switches != kernel_switches():
            raise refuse(f"the kernel switches {_switches(switches)}", _switches(kernel_switches()),
                         " (its points would measure two code paths)")
    started_on = manifest.get("device") or "cuda"
    if started_on != opt.device:
        raise RunDirError(f"{store.path}: started with --device {started_on}; resume it with --device {started_on}")
    replicated = bool((manifest.get("pool") or {}).get("replicate"))
    if replicated and not replicate:
        raise RunDirError(f"{store.path}: started with --replicate (every point on every worker); resume it with "
                          f"--replicate and --gpus (or --workers on the CPU)")
    if replicate and not replicated:
        raise RunDirError(f"{store.path}: started without --replicate; resume it without --replicate")
    return manifest


def _selection(glob: str | None) -> str:
    """A run's cells as its --only names them, for a message."""
    return f"--only {glob!r}" if glob else "every cell"


def _switches(env: dict) -> str:
    """Kernel switches as shell assignments, for a message."""
    return " ".join(f"{k}={v}" for k, v in sorted(env.items())) or "none"


def _planted(slowdown: dict) -> str:
    """A run's planted slowdowns as its --slowdown items name them, for a message."""
    return " ".join(f"--slowdown {name}={f:g}" for name, f in sorted(slowdown.items())) or "no --slowdown"


class NoCleanGpu(RuntimeError):
    """No GPU passed the clean-GPU check within --wait (CLI: one line, exit 4)."""
