"""Several workers for one run: one process per clean GPU (`run-matrix --gpus`), or N on the CPU (`--workers`),
taking points from one queue into one run directory.

The parent never initialises CUDA (it reads NVML only). It checks the listed GPUs with the clean-GPU check
(waiting up to --wait for all of them), leaves out those that fail, creates or re-opens the run directory and
holds its lock, and starts one worker per device with multiprocessing's 'spawn' context (CUDA cannot be
forked), each with CUDA_VISIBLE_DEVICES set to its GPU's UUID: a worker sees its own GPU only (as cuda:0), so
neither its torch nor its Triton can touch another worker's GPU, and NVML's process list of a GPU holds its
one worker. From then on every worker checks its own GPU before and after each point, as a single run does
(attnbench.runner; the same Runner.run_point). A CPU worker gets cores // workers torch threads.

The queue. The parent holds the points still to measure and hands them out one at a time, to a worker that is
ready or has just stored one, through a pipe of that worker's own (and reads its events through another): no
lock is shared between processes, so a worker that dies blocks nothing but itself, and its death shows as the
end of its pipe. Without --replicate there is one queue: any device may take any point, and a point is
finished once one complete row holds it. With --replicate each device has its own queue of every point it
has not measured: a point's identity includes the device (`ran_on`), so a resume measures exactly the missing
replicas.

The run directory (attnbench.store) has several writers: each record is one locked append, and the pool is one
holder of its lock (the workers inherit the parent's locked file description), so a second --resume is
refused naming the parent and its workers. Only the parent writes the manifest. Workers report to the parent
(ready, point_start, attempt, point_done, exit; error or interrupted); the parent relays these to `on_event`
(the CLI's progress bar). Ctrl-C (SIGINT to the process group, or to the parent alone), or a manifest write that
fails, stops every worker and leaves the run resumable (RunInterrupted); a worker that dies or fails leaves the
others running and the run resumable (PoolIncomplete; RunInterrupted with the error when what failed was a write to
the run directory: a full disk is every worker's).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
import traceback
from dataclasses import dataclass
from multiprocessing import connection
from pathlib import Path
from typing import Callable

from attnbench import gpu as gpumod
from attnbench.matrix import Matrix
from attnbench.runner import (NoCleanGpu, Runner, RunOptions, check_resumable, cpu_ran_on, gpu_ran_on, holding,
                              prepare_device)
from attnbench.store import RunDirError, RunStore, RunWriteError, utc_now

STOP_GRACE_S = 30.0      # after Ctrl-C, how long a worker may take to finish its current call before it is killed


@dataclass
class PoolLayout:
    """How a run is spread: `gpus` (NVML indices, --device cuda) or `workers` (a count, --device cpu)."""

    gpus: list[int] | None = None
    workers: int | None = None
    replicate: bool = False
    gpus_spec: str | None = None      # --gpus as given ("all", "0,1"): the manifest keeps it


@dataclass
class WorkerSpec:
    worker: int
    ran_on: dict                 # label (cuda:<index> / cpu:<worker>), and for a GPU its index, name and UUID
    threads: int | None = None   # torch threads of a CPU worker


class PoolIncomplete(RuntimeError):
    """Some workers died or failed: the run directory holds what the others measured and can be resumed."""

    def __init__(self, run_dir: Path, problems: list[str]):
        super().__init__("; ".join(problems))
        self.run_dir, self.problems = run_dir, problems


class _SharedFd:
    """A file descriptor that a spawned worker inherits (the same open file description, not a reopened file):
    the run directory's flock then belongs to the whole pool and lasts while any member lives."""

    def __init__(self, fd: int | None):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _attach_fd, (reduction.DupFd(self.fd),)


def _attach_fd(dup) -> _SharedFd:
    return _SharedFd(dup.detach())


# -- the worker -------------------------------------------------------------------------------------------------

def _ignore_signal(signum, frame):
    # a Python no-op rather than SIG_IGN: a signal already caught but not yet handled would otherwise be reported
    # as "ignored due to race condition", with a traceback
    pass


def _stop_signal(signum, frame):
    # once: a second Ctrl-C (the terminal's and the parent's) must not interrupt the clean exit of the first
    signal.signal(signal.SIGINT, _ignore_signal)
    signal.signal(signal.SIGTERM, _ignore_signal)
    raise KeyboardInterrupt


class _ParentGone(Exception):
    """The parent's end of a pipe is closed: it died, and nobody would finish the run's bookkeeping."""


def worker_main(spec: WorkerSpec, matrix: Matrix, options: RunOptions, run_dir: Path, shared_lock: _SharedFd,
                tasks, events) -> None:
    """One worker: measure the points the parent hands out through `tasks` (indices into matrix.points(), one at a
    time; None = no more), reporting through `events`. Both are pipes of this worker alone."""
    # started with SIGINT blocked (_spawn_environment), so no Ctrl-C interrupted the imports; one that came meanwhile
    # is delivered now, to this handler
    signal.signal(signal.SIGINT, _stop_signal)
    signal.signal(signal.SIGTERM, _stop_signal)

    def send(kind, **data):
        try:
            events.send((kind, data))
        except OSError:   # a broken pipe: the parent is gone
            raise _ParentGone from None

    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        prepare_device(options.device)
        import torch

        reader, sm_count = None, None
        if options.device == "cuda":
            reader = gpumod.PynvmlReader()
            if not torch.cuda.is_available():
                raise RuntimeError(f"torch sees no CUDA device with CUDA_VISIBLE_DEVICES="
                                   f"{os.environ.get('CUDA_VISIBLE_DEVICES')}")
            torch.cuda.set_device(0)    # its own GPU, the only one it sees
            sm_count = torch.cuda.get_device_properties(0).multi_processor_count
        elif spec.threads:
            torch.set_num_threads(spec.threads)

        def forward(kind, **d):
            if kind == "attempt":
                send("attempt", point_id=d["point"].id, attempt=d["attempt"], status=d["status"], reasons=d["reasons"])

        runner = Runner(matrix, options, reader=reader, on_event=forward, ran_on=spec.ran_on)
        runner.gpu_index = spec.ran_on.get("index")
        store = RunStore(run_dir)
        points = matrix.points()
        send("ready", pid=os.getpid(), sm_count=sm_count)
        while True:
            try:
                index = tasks.recv()
            except EOFError:
                raise _ParentGone from None
            if index is None:
                break
            point = points[index]
            send("point_start", point_id=point.id)
            row = runner.run_point(point, store)
            send("point_done", point_id=point.id, row=row)
        send("exit")
    except _ParentGone:
        pass
    except KeyboardInterrupt:
        with contextlib.suppress(_ParentGone):
            send("interrupted")
    except BaseException as exc:   # noqa: BLE001 - reported to the parent, which names the worker
        with contextlib.suppress(_ParentGone):
            message = str(exc) if isinstance(exc, RunDirError) else f"{type(exc).__name__}: {exc}"   # ours: one line
            send("error", message=message.splitlines()[0], traceback=traceback.format_exc(),
                 write_error=isinstance(exc, RunWriteError))


# -- the parent -------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _spawn_environment(env: dict):
    """Start a child with `env` on top of ours and SIGINT blocked (the mask is inherited) until it has installed
    its own handler; here a Ctrl-C meanwhile waits, and is delivered when this block ends."""
    saved = {key: os.environ.get(key) for key in env}
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class Pool:
    """Runs a Matrix with several workers into one run directory (see the module's docstring)."""

    def __init__(self, matrix: Matrix, options: RunOptions, layout: PoolLayout, reader=None,
                 on_event: Callable | None = None, sleep=time.sleep):
        self.matrix, self.opt, self.layout, self.reader = matrix, options, layout, reader
        self.on_event = on_event or (lambda kind, **data: None)
        self.sleep = sleep
        self.points = matrix.points()
        self.by_id = {p.id: p for p in self.points}

    # -- which devices get a worker ----------------------------------------------------------------------
    def worker_specs(self) -> tuple[list[WorkerSpec], list[dict]]:
        """(a worker per device that passed the clean-GPU check, the GPUs left out with their reasons)."""
        if self.opt.device == "cpu":
            count = self.layout.workers or 1
            threads = max(1, (os.cpu_count() or 1) // count)
            return [WorkerSpec(i, cpu_ran_on(i), threads) for i in range(count)], []

        def on_probe(gpus, failures, remaining):
            self.on_event("clean_gpu_probe", gpus=gpus, failures=failures, remaining_s=remaining)

        gpus, failures = gpumod.wait_for_clean_gpus(self.reader, self.opt.clean_check, list(self.layout.gpus or []),
                                                    self.opt.wait_s, on_probe=on_probe,
                                                    sample_s=self.opt.snapshot_s, sleep=self.sleep)
        passing = [g for g in gpus if not failures[g.index]]
        if not passing:
            raise NoCleanGpu(gpumod.no_clean_gpu_line(gpus, failures))
        left_out = [{"index": g.index, "name": g.name, "uuid": g.uuid, "reasons": failures[g.index]}
                    for g in gpus if failures[g.index]]
        return [WorkerSpec(i, gpu_ran_on(g)) for i, g in enumerate(passing)], left_out

    # -- the run -----------------------------------------------------------------------------------------
    def run(self, resume: Path | None = None) -> Path:
        """Measure into a new run directory, or finish `resume`; returns the run directory."""
        prepare_device(self.opt.device)
        if resume is not None:
            store = RunStore.open_existing(resume)
            store.lock()
            with holding(store):
                manifest = check_resumable(store, self.matrix, self.opt, self.layout.replicate)
                for line in store.repair():
                    self.on_event("repair", run_dir=store.path, message=line)
                if manifest.get("finished_utc") and not self._missing(store, self._known_devices(manifest)):
                    self.on_event("complete", run_dir=store.path, total=len(self.points))
                    return store.path
                specs, left_out = self.worker_specs()
                pool = dict(manifest.get("pool") or {})
                pool.update(self._pool_record(specs, left_out, pool.get("devices")))
                store.update_manifest(interrupted=False, resumed_utc=utc_now(), pool=pool)
                return self._measure(store, specs, left_out)
        specs, left_out = self.worker_specs()
        manifest = Runner(self.matrix, self.opt, reader=self.reader).manifest(None)
        if self.opt.device == "cuda":
            first = specs[0].ran_on
            manifest["gpu"] = {"index": first["index"], "name": first["name"], "uuid": first["uuid"]}
        manifest["pool"] = self._pool_record(specs, left_out, None)
        store = RunStore.create(self.opt.results_root, self.matrix.name, manifest)
        with holding(store):
            return self._measure(store, specs, left_out)

    def _pool_record(self, specs: list[WorkerSpec], left_out: list[dict], devices: list | None) -> dict:
        """The manifest's `pool`: the layout asked for, and every device that has measured in this run."""
        known = {d["label"]: d for d in devices or []}
        for spec in specs:
            known[spec.ran_on["label"]] = {**known.get(spec.ran_on["label"], {}), **spec.ran_on}
        return {"gpus": self.layout.gpus_spec, "workers": len(specs), "replicate": self.layout.replicate,
                "devices": [known[label] for label in sorted(known)], "left_out": left_out}

    @staticmethod
    def _known_devices(manifest: dict) -> list[str]:
        return [d["label"] for d in (manifest.get("pool") or {}).get("devices") or []]

    def _missing(self, store: RunStore, labels: list[str]) -> dict[str, list[int]]:
        """Point indices still to measure: per device label with --replicate, else under the key None."""
        if self.layout.replicate:
            done = store.finished_replicas()
            return {label: [i for i, p in enumerate(self.points) if (p.id, label) not in done] for label in labels
                    if any((p.id, label) not in done for p in self.points)}
        done_ids = store.finished_point_ids()
        todo = [i for i, p in enumerate(self.points) if p.id not in done_ids]
        return {None: todo} if todo else {}

    def _measure(self, store: RunStore, specs: list[WorkerSpec], left_out: list[dict]) -> Path:
        ctx = multiprocessing.get_context("spawn")
        labels = [s.ran_on["label"] for s in specs]
        todo = self._missing(store, labels)
        total = len(self.points) * (len(specs) if self.layout.replicate else 1)
        for gone in left_out:
            self.on_event("left_out", gpu=gone)
        self.on_event("start", run_dir=store.path, total=total, todo=sum(len(v) for v in todo.values()), gpu=None,
                      devices=labels, replicate=self.layout.replicate)
        # One pipe each way per worker, and no lock shared between processes: a worker that dies (even inside a
        # send) blocks nothing but itself, and its death is seen as the end of its pipe.
        procs: dict[int, multiprocessing.process.BaseProcess] = {}
        channels: dict[int, tuple] = {}      # worker → (the pipe its tasks go down, the pipe its events come up)
        lock = _SharedFd(store.lock_fd)
        try:
            for spec in specs:
                task_out, task_in = ctx.Pipe(duplex=False)
                event_out, event_in = ctx.Pipe(duplex=False)
                env = {"CUDA_VISIBLE_DEVICES": spec.ran_on["uuid"]} if self.opt.device == "cuda" else {}
                proc = ctx.Process(target=worker_main, name=f"attnbench-{spec.ran_on['label']}",
                                   args=(spec, self.matrix, self.opt, store.path, lock, task_out, event_in))
                with _spawn_environment(env):
                    proc.start()
                task_out.close()     # the worker's ends: closed here, so either side sees the other's death
                event_in.close()
                procs[spec.worker], channels[spec.worker] = proc, (task_in, event_out)
            store.name_lock_holders([p.pid for p in procs.values()])
            problems, write_error = self._relay(store, specs, procs, channels, todo)
        except (KeyboardInterrupt, RunWriteError):   # Ctrl-C, or the manifest could not be written: every worker
            self._stop(procs, channels)              # stops, and the run is left interrupted (holding)
            raise
        finally:
            for proc in procs.values():
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=5)
            for task_in, event_out in channels.values():
                task_in.close()
                event_out.close()
        # with --replicate, every device that ever measured in this run owes every point (a GPU left out of this
        # invocation included): the run is finished only when none is missing
        # (a worker that failed after the others had measured everything leaves a complete run: its line was shown)
        still = self._missing(store, self._known_devices(store.read_manifest()))
        if still:
            if write_error:   # a worker could not write the run directory (disk full): stopped as a single run is
                raise RunWriteError(write_error)
            missing = "still missing: " + ", ".join(f"{len(v)} points on {label}" if label else f"{len(v)} points"
                                                    for label, v in sorted(still.items(), key=str))
            store.update_manifest(interrupted=True)
            raise PoolIncomplete(store.path, [*problems, missing])
        store.update_manifest(finished_utc=utc_now(), interrupted=False)
        self.on_event("finish", run_dir=store.path)
        return store.path

    def _relay(self, store: RunStore, specs: list[WorkerSpec], procs: dict, channels: dict,
               todo: dict[str | None, list[int]]) -> tuple[list[str], str | None]:
        """Hand out points one at a time (to a worker that is ready or has just finished one) and relay the
        workers' events until every worker has ended; returns a line per worker that died or failed, and the
        first run-directory write that failed in a worker (its RunWriteError's line), if one did."""
        by_worker = {s.worker: s for s in specs}
        open_pipes = {channels[w][1]: w for w in procs}
        ended: set[int] = set()
        measuring: dict[int, str | None] = {w: None for w in procs}
        problems, write_error = [], None

        def hand_out(worker):
            queue = todo.get(by_worker[worker].ran_on["label"] if self.layout.replicate else None) or []
            with contextlib.suppress(OSError):   # a dead worker: its end of the pipe shows it below
                channels[worker][0].send(queue.pop(0) if queue else None)

        while open_pipes:
            for pipe in connection.wait(list(open_pipes), timeout=1.0):
                worker = open_pipes[pipe]
                label = by_worker[worker].ran_on["label"]
                where = f" while measuring {measuring[worker]} (left for --resume)" if measuring[worker] else ""
                try:
                    kind, d = pipe.recv()
                except (EOFError, OSError):   # the worker has ended; if it never said how, it died
                    del open_pipes[pipe]
                    if worker not in ended:
                        proc = procs[worker]
                        proc.join(timeout=5)
                        line = f"worker {label} (pid {proc.pid}) died with exit code {proc.exitcode}{where}"
                        problems.append(line)
                        self.on_event("worker_failed", device=label, message=line)
                    continue
                if kind == "ready":
                    self._record_ready(store, by_worker[worker], d)
                    self.on_event("worker_ready", device=label, pid=d["pid"])
                    hand_out(worker)
                elif kind == "point_start":
                    measuring[worker] = d["point_id"]
                    self.on_event("point_start", point=self.by_id[d["point_id"]], device=label)
                elif kind == "attempt":
                    self.on_event("attempt", point=self.by_id[d["point_id"]], attempt=d["attempt"],
                                  status=d["status"], reasons=d["reasons"], device=label)
                elif kind == "point_done":
                    measuring[worker] = None
                    self.on_event("point_done", point=self.by_id[d["point_id"]], row=d["row"], device=label)
                    hand_out(worker)
                elif kind == "error":
                    ended.add(worker)
                    if d.get("write_error"):
                        write_error = write_error or d["message"]
                    line = f"worker {label} failed{where}: {d['message']}"
                    problems.append(line)
                    self.on_event("worker_failed", device=label, message=line, traceback=d["traceback"])
                elif kind == "interrupted":   # stopped by a signal to it alone: the run is left resumable
                    ended.add(worker)
                    problems.append(f"worker {label} was interrupted{where}")
                elif kind == "exit":
                    ended.add(worker)
        return problems, write_error

    def _record_ready(self, store: RunStore, spec: WorkerSpec, d: dict) -> None:
        """The manifest learns each worker's pid (and its GPU's SM count, which only CUDA can tell)."""
        manifest = store.read_manifest()
        pool = dict(manifest.get("pool") or {})
        devices = []
        for device in pool.get("devices") or []:
            if device.get("label") == spec.ran_on["label"]:
                device = {**device, "pid": d["pid"], **({"sm_count": d["sm_count"]} if d["sm_count"] else {})}
            devices.append(device)
        changes = {"pool": {**pool, "devices": devices}}
        gpu = manifest.get("gpu")
        if gpu and d["sm_count"] and gpu.get("uuid") == spec.ran_on.get("uuid"):
            changes["gpu"] = {**gpu, "sm_count": d["sm_count"]}
        store.update_manifest(**changes)

    def _stop(self, procs: dict, channels: dict) -> None:
        """Ctrl-C: ask every worker to stop (it ends its current call and exits), kill what does not in time."""
        old = signal.signal(signal.SIGINT, _ignore_signal)   # a second Ctrl-C must not abandon the workers
        try:
            for proc in procs.values():
                if proc.is_alive():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGTERM)
            pipes = [channels[w][1] for w in channels]
            deadline = time.monotonic() + STOP_GRACE_S
            while pipes and time.monotonic() < deadline:
                for pipe in connection.wait(pipes, timeout=0.2):
                    try:
                        pipe.recv()   # drained, so no worker blocks on a full pipe while it exits
                    except (EOFError, OSError):
                        pipes.remove(pipe)
            for proc in procs.values():
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=5)
        finally:
            signal.signal(signal.SIGINT, old)
