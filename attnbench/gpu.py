"""GPU and system snapshots (NVML + psutil), the clean-GPU check, and the choice of the cleanest GPU.

NVML is reached through a small adapter (``PynvmlReader``) so tests can drive the check with a fake
that reports busy, low-memory, throttled or foreign-process states. Utilisation is *sampled* over a
window (several readings, ≥ 1 s by default), never read once: one instant says little about a GPU
someone else is using in bursts.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

import psutil

# NVML clock-event ("throttle") reason bits, decoded to words.
CLOCK_EVENT_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# Which reasons disturb a measurement (and which are the card's steady state) is the noise policy's call:
# attnbench.measure.noise.


class NoGpuError(RuntimeError):
    """No GPU or no NVML where one is needed (CLI: one line, exit 3)."""


def decode_reasons(mask: int) -> list[str]:
    words = [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]
    unknown = mask & ~sum(CLOCK_EVENT_REASONS)
    if unknown:
        words.append(f"unknown_0x{unknown:x}")
    return words


class PynvmlReader:
    """The real NVML, through nvidia-ml-py's ``pynvml``. Raises NoGpuError if NVML or a GPU is missing."""

    def __init__(self):
        try:
            import pynvml
        except ImportError:
            raise NoGpuError("NVML is not available (pip install nvidia-ml-py); use --device cpu on a machine without a GPU") from None
        self.nv = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NoGpuError(f"no NVIDIA GPU/driver found (NVML: {exc}); use --device cpu on a machine without a GPU") from None
        if pynvml.nvmlDeviceGetCount() == 0:
            raise NoGpuError("NVML reports no GPU; use --device cpu on a machine without a GPU")

    def device_count(self) -> int:
        return self.nv.nvmlDeviceGetCount()

    def _safe(self, fn, *args, default=None):
        try:
            return fn(*args)
        except self.nv.NVMLError:
            return default

    def read(self, index: int) -> dict:
        nv, h = self.nv, self.nv.nvmlDeviceGetHandleByIndex(index)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        util = self._safe(nv.nvmlDeviceGetUtilizationRates, h)
        procs = self._safe(nv.nvmlDeviceGetComputeRunningProcesses, h, default=[]) or []
        name = nv.nvmlDeviceGetName(h)
        uuid = nv.nvmlDeviceGetUUID(h)
        reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        return {
            "name": name.decode() if isinstance(name, bytes) else name,
            "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
            "util_pct": None if util is None else float(util.gpu),
            "mem_used": mem.used, "mem_free": mem.free, "mem_total": mem.total,
            "temp_c": self._safe(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
            "sm_clock_mhz": self._safe(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
            "sm_clock_max_mhz": self._safe(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM),
            "power_mw": self._safe(nv.nvmlDeviceGetPowerUsage, h),
            "power_limit_mw": self._safe(nv.nvmlDeviceGetEnforcedPowerLimit, h),
            "clock_event_mask": self._safe(reasons_fn, h, default=0) or 0,
            "processes": [(p.pid, p.usedGpuMemory) for p in procs],
        }


def _integer_indices(count: int) -> list[int]:
    """The NVML indices a CUDA_VISIBLE_DEVICES of integers lets this process use (visible_to_cuda resolves one
    that names UUIDs)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None or env.strip() == "":
        return list(range(count)) if env is None else []
    return [int(item) for item in (x.strip() for x in env.split(",")) if item.isdigit() and int(item) < count]


def _process_name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except (psutil.Error, OSError):
        return "?"


@dataclass
class GpuStatus:
    index: int
    name: str
    uuid: str
    util_pct: float                  # max of the sampled readings: a burst counts
    util_samples: list[float]
    mem_used_gb: float
    mem_free_gb: float
    mem_total_gb: float
    temp_c: float | None
    sm_clock_mhz: float | None
    sm_clock_max_mhz: float | None
    power_w: float | None
    power_limit_w: float | None
    throttle_reasons: list[str]
    processes: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def sample_gpus(reader, indices: list[int], sample_s: float = 1.0, samples: int = 10) -> list[GpuStatus]:
    """Read every GPU in `indices` `samples` times over `sample_s` seconds."""
    reads: dict[int, list[dict]] = {i: [] for i in indices}
    interval = sample_s / max(samples - 1, 1)
    for k in range(samples):
        for i in indices:
            reads[i].append(reader.read(i))
        if k < samples - 1 and sample_s > 0:
            time.sleep(interval)
    out = []
    for i in indices:
        last = reads[i][-1]
        utils = [r["util_pct"] for r in reads[i] if r["util_pct"] is not None]
        mask = 0
        for r in reads[i]:
            mask |= r["clock_event_mask"]
        pids = {}
        for r in reads[i]:
            for pid, used in r["processes"]:
                pids[pid] = used
        gb = 1024 ** 3
        out.append(GpuStatus(
            index=i, name=last["name"], uuid=last["uuid"],
            util_pct=max(utils) if utils else float("nan"), util_samples=utils,
            mem_used_gb=last["mem_used"] / gb, mem_free_gb=min(r["mem_free"] for r in reads[i]) / gb,
            mem_total_gb=last["mem_total"] / gb, temp_c=last["temp_c"],
            sm_clock_mhz=last["sm_clock_mhz"], sm_clock_max_mhz=last["sm_clock_max_mhz"],
            power_w=None if last["power_mw"] is None else last["power_mw"] / 1000,
            power_limit_w=None if last["power_limit_mw"] is None else last["power_limit_mw"] / 1000,
            throttle_reasons=decode_reasons(mask),
            processes=[{"pid": pid, "name": _process_name(pid), "mem_mb": None if used is None else used / 2**20}
                       for pid, used in sorted(pids.items())],
        ))
    return out


def system_snapshot(top: int = 5) -> dict:
    vm = psutil.virtual_memory()
    procs = []
    for p in psutil.process_iter(["pid", "name", "cpu_percent", "memory_info"]):
        info = p.info
        rss = info["memory_info"].rss / 2**20 if info.get("memory_info") else 0.0
        procs.append({"pid": info["pid"], "name": info["name"], "cpu_pct": info.get("cpu_percent") or 0.0, "rss_mb": rss})
    procs.sort(key=lambda r: (-r["cpu_pct"], -r["rss_mb"]))
    own = os.getpid()
    others = sum(r["cpu_pct"] for r in procs if r["pid"] != own) / (psutil.cpu_count() or 1)
    return {
        "cpu_pct": psutil.cpu_percent(interval=None),
        "others_cpu_pct": others,           # CPU used by processes other than us, % of all cores
        "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "ram_used_gb": (vm.total - vm.available) / 1024**3, "ram_total_gb": vm.total / 1024**3,
        "top_processes": procs[:top],
    }


def _prime_cpu_counters() -> None:
    # psutil's cpu_percent compares with the previous call: prime it so the next reading covers the window
    psutil.cpu_percent(interval=None)
    for p in psutil.process_iter(["cpu_percent"]):
        pass


@dataclass
class CleanGpuCheck:
    """When a GPU counts as clean enough to measure on (not to be confused with the regression gate, gate.py)."""

    max_util_pct: float = 8.0
    min_free_gb: float = 12.0
    max_cpu_pct: float = 90.0        # the system-load check used with --device cpu

    def failures(self, gpu: GpuStatus, own_pids: set[int] | None = None) -> list[str]:
        """Why `gpu` is not clean (empty list: it passes)."""
        own_pids = own_pids if own_pids is not None else {os.getpid()}
        out = []
        if not gpu.util_pct <= self.max_util_pct:
            out.append(f"util {gpu.util_pct:.0f}% > {self.max_util_pct:g}%")
        if gpu.mem_free_gb < self.min_free_gb:
            out.append(f"free {gpu.mem_free_gb:.1f} GB < {self.min_free_gb:g} GB")
        foreign = [p for p in gpu.processes if p["pid"] not in own_pids]
        if foreign:
            out.append("foreign process " + ", ".join(f"{p['pid']} ({p['name']})" for p in foreign))
        return out


def snapshot(reader, index: int | None, sample_s: float = 1.0, samples: int = 10, settle_s: float = 0.0) -> dict:
    """The full before/after record: one GPU (or none on the CPU path) plus the system.

    `settle_s`: wait this long after our own GPU work has finished before sampling. NVML's utilisation is
    the busy fraction of a trailing window (up to 1 s), so without settling it reports our *own* last
    kernels and every point would look like it ran on a busy GPU.
    """
    if settle_s > 0:
        _sync_cuda()
        time.sleep(settle_s)
    _prime_cpu_counters()
    if reader is not None and index is not None:
        gpu = sample_gpus(reader, [index], sample_s, samples)[0].as_dict()
    else:
        time.sleep(min(sample_s, 0.5))
        gpu = None
    return {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gpu": gpu, "system": system_snapshot()}


def _sync_cuda() -> None:
    import sys

    torch = sys.modules.get("torch")   # only if the caller already uses torch: a snapshot never initialises CUDA
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def status_all(reader, check: CleanGpuCheck, sample_s: float = 1.0, samples: int = 10) -> dict:
    """What `attnbench gpu-status` shows: every visible GPU, whether it passes the clean-GPU check, and the system."""
    _prime_cpu_counters()
    gpus = sample_gpus(reader, visible_to_cuda(reader), sample_s, samples)
    rows = []
    for g in gpus:
        fails = check.failures(g)
        rows.append({**g.as_dict(), "is_clean": not fails, "not_clean_because": fails})
    return {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "clean_gpu_check": check.__dict__,
            "gpus": rows, "system": system_snapshot()}


def choose_gpu(gpus: list[GpuStatus], check: CleanGpuCheck, wanted: str | None = None) -> tuple[GpuStatus | None, dict]:
    """The cleanest passing GPU (lowest util, then most free memory), or the one named by index/UUID.

    Returns (choice or None, {index: failures}) so the caller can name what failed.
    """
    if wanted is not None:
        named = [g for g in gpus if str(g.index) == str(wanted) or g.uuid == wanted]
        if not named:
            known = ", ".join(f"{g.index} ({g.uuid})" for g in gpus)
            raise NoGpuError(f"GPU '{wanted}' not found (visible: {known})")
        gpus = named
    failures = {g.index: check.failures(g) for g in gpus}
    passing = [g for g in gpus if not failures[g.index]]
    passing.sort(key=lambda g: (g.util_pct, -g.mem_free_gb))
    return (passing[0] if passing else None), failures


def wait_for_clean_gpu(reader, check: CleanGpuCheck, wanted: str | None, wait_s: float, on_probe=None,
                       sample_s: float = 1.0, clock=time.monotonic, sleep=time.sleep) -> tuple[GpuStatus | None, list[GpuStatus], dict]:
    """Probe until a GPU passes the check or `wait_s` runs out; `on_probe(gpus, failures, remaining_s)` shows a live line."""
    deadline = clock() + wait_s
    while True:
        gpus = sample_gpus(reader, visible_to_cuda(reader), sample_s)
        choice, failures = choose_gpu(gpus, check, wanted)
        remaining = deadline - clock()
        if on_probe is not None:
            on_probe(gpus, failures, max(remaining, 0.0))
        if choice is not None or remaining <= 0:
            return choice, gpus, failures
        sleep(min(5.0, max(remaining, 0.0)))


def no_clean_gpu_line(gpus: list[GpuStatus], failures: dict) -> str:
    """One line naming each GPU and the numbers that failed."""
    parts = [f"GPU {g.index} ({g.name}, {g.uuid[:12]}): {'; '.join(failures.get(g.index, []))}" for g in gpus
             if failures.get(g.index)]
    return "no clean GPU: " + " | ".join(parts) if parts else "no clean GPU"


def cpu_load_failures(check: CleanGpuCheck, snap: dict) -> list[str]:
    """The CPU path's check: other processes' CPU use (ours is the measurement itself)."""
    cpu = snap["system"].get("others_cpu_pct", snap["system"]["cpu_pct"])
    return [f"other processes use {cpu:.0f}% CPU > {check.max_cpu_pct:g}%"] if cpu > check.max_cpu_pct else []


# -- several GPUs (run-matrix --gpus) ------------------------------------------------------------------------

class GpuListError(ValueError):
    """A --gpus value that names no usable set of GPUs (CLI: one line, exit 2)."""


def parse_gpu_list(spec: str) -> list[int] | None:
    """`--gpus` text → NVML indices in the order given, or None for `all`. Only the syntax is checked here
    (no GPU is needed); `resolve_gpu_list` checks the indices against the machine."""
    text = spec.strip()
    if text == "all":
        return None
    items = [item.strip() for item in text.split(",")]
    hint = "give all, or GPU indices as gpu-status numbers them, e.g. 0,1"
    if not text or not all(items):
        raise GpuListError(f"--gpus {spec!r}: an empty item; {hint}")
    out: list[int] = []
    for item in items:
        if not re.fullmatch(r"[0-9]{1,4}", item):
            raise GpuListError(f"--gpus {spec!r}: {item!r} is not a GPU index; {hint}")
        if int(item) in out:
            raise GpuListError(f"--gpus {spec!r}: GPU {int(item)} is listed twice")
        out.append(int(item))
    return out


def visible_to_cuda(reader) -> list[int]:
    """The NVML indices CUDA_VISIBLE_DEVICES lets this process use, UUID (or UUID prefix) entries included: the GPUs
    the clean-GPU check, gpu-status and --gpus consider."""
    count = reader.device_count()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None or not any(item.strip().startswith(("GPU-", "MIG-")) for item in env.split(",")):
        return _integer_indices(count)
    uuids = {i: reader.read(i)["uuid"] for i in range(count)}
    out = []
    for item in (x.strip() for x in env.split(",")):
        match = [i for i, u in uuids.items() if item and u.startswith(item)]
        if len(match) != 1:
            break   # CUDA stops at the first entry it cannot resolve
        out.append(match[0])
    return out


def resolve_gpu_list(spec: str, reader) -> list[int]:
    """`--gpus all|0,1,…` → the NVML indices to start one worker on each: every GPU this process may use for
    `all`, else the listed ones, each of which must exist and be visible. One run measures one GPU model, so
    GPUs of different models are refused. GpuListError (one line) otherwise."""
    wanted = parse_gpu_list(spec)
    count = reader.device_count()
    visible = visible_to_cuda(reader)
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if wanted is None:
        if not visible:
            raise GpuListError(f"--gpus {spec!r}: no GPU is visible (CUDA_VISIBLE_DEVICES={env!r})")
        wanted = visible
    for index in wanted:
        if index >= count:
            raise GpuListError(f"--gpus {spec!r}: GPU {index} does not exist (NVML sees {count}: "
                               f"{', '.join(map(str, range(count)))})")
        if index not in visible:
            raise GpuListError(f"--gpus {spec!r}: GPU {index} is hidden by CUDA_VISIBLE_DEVICES={env!r}")
    names = {index: reader.read(index)["name"] for index in wanted}
    if len(set(names.values())) > 1:
        models = ", ".join(f"{i}: {n}" for i, n in names.items())
        raise GpuListError(f"--gpus {spec!r}: GPUs of different models ({models}); one run measures one GPU "
                           "model: list GPUs of one model")
    return list(wanted)


def wait_for_clean_gpus(reader, check: CleanGpuCheck, indices: list[int], wait_s: float, on_probe=None,
                        sample_s: float = 1.0, clock=time.monotonic, sleep=time.sleep) -> tuple[list[GpuStatus], dict]:
    """The clean-GPU check of a worker pool's GPUs: probe `indices` until every one passes or `wait_s` runs out.
    Returns (the GPUs as last sampled, {index: failures}); the caller starts workers on the passing ones."""
    deadline = clock() + wait_s
    while True:
        gpus = sample_gpus(reader, indices, sample_s)
        failures = {g.index: check.failures(g) for g in gpus}
        remaining = deadline - clock()
        if on_probe is not None:
            on_probe(gpus, failures, max(remaining, 0.0))
        if not any(failures.values()) or remaining <= 0:
            return gpus, failures
        sleep(min(5.0, max(remaining, 0.0)))
