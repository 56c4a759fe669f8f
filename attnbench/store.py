"""The run directory: append-only while measuring, read back into DataFrames for reporting.

Layout (``results/runs/<UTC time>_<matrix name>/``):
- ``manifest.json``  what was run, where, with which versions and gate thresholds;
- ``attempts.jsonl`` one record per attempt, with the GPU/system snapshots before and after, flushed as made;
- ``points.csv``     one row per finished point (its final attempt), flushed as made.

A point is finished once its complete row is in ``points.csv``; ``--resume`` skips exactly those, so an
interrupted run loses at most the point that was being measured.

Crash safety. Both logs are written one whole line per append (fsync'd), so a crash can leave only a *torn last line*:
the start of a record without its newline. Readers (report, runs, gate) leave it out and say so (``Run.torn``: the
report's runs table, the runs listing, a warning line of the gate); a resume, holding the run directory's lock, moves
it to ``torn_records.jsonl`` (kept, never dropped) and measures its point again. Anything malformed before the last
line is corruption: a one-line ``RunDirError``, as is a file that cannot be read, a manifest field of the wrong type
or a points.csv number that is not one. While a run is written, ``.lock`` (fcntl) holds the writer's pid, so a
second ``--resume`` of the same directory is refused instead of interleaving rows, and ``runs`` lists the run as
running (``lock_holder``). A write that fails (disk full, no permission) is a ``RunWriteError`` naming the file and
the OS error; an append that fails is cut off again, so its file ends as it did (the runner then stops the run,
resumable: attnbench.runner.holding).

Several writers (a worker pool, attnbench.pool). The pool is one holder of ``.lock``: its parent takes it and
every worker inherits the same locked file description, so the lock lasts while any of them lives, and the file
names the parent and its workers. Each record is appended under an exclusive flock of its file, in one
``write`` (looped only on a short write) and fsync'd, so two workers' records never interleave. A writer killed
mid-record leaves a partial line that the next append finds, under that lock, and sets aside in
``torn_records.jsonl`` (itself appended to the same way) before writing: a torn record never ends up in the middle
of a file. Every row names the
device that ran it (``ran_on``: ``cuda:<NVML index>`` or ``cpu:<worker>``, and the GPU's UUID); with
``--replicate`` a point is finished per device (``finished_replicas``).
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import re
import shlex
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from kernels._tuning import write_json_atomic

POINT_COLUMNS = [
    "point_id", "cell_id", "kernel", "baseline", "dtype", "mode", "causal", "batch", "heads", "head_dim", "n",
    "kernel_ms", "kernel_ms_p10", "kernel_ms_p90", "baseline_ms", "baseline_ms_p10", "baseline_ms_p90",
    "lat_ratio", "lat_ratio_p10", "lat_ratio_p90", "kernel_mem_mb", "baseline_mem_mb", "mem_ratio",
    "kernel_tflops", "baseline_tflops", "status", "attempts", "reason",
    # how the point was timed and how well its median ratio is known
    "timing", "spread", "lat_ratio_ci_low", "lat_ratio_ci_high", "ci_half_width",
    # the attention problem's K/V heads and lengths (= heads, n, n unless the cell says otherwise)
    "kv_heads", "q_len", "kv_len",
    # the device that measured the point: cuda:<NVML index> or cpu:<worker>, and the GPU's UUID (empty on a CPU)
    "ran_on", "ran_on_uuid",
    # each side's median host time inside a timed call (the enqueue; measure.pair): host-bound where it nears the
    # side's own time (measure.noise.host_bound)
    "kernel_host_ms", "baseline_host_ms",
]
# What every stored run has. Runs from before the later columns read back with them filled (timing "eager", the
# rest empty) and keep their own header when resumed.
REQUIRED_COLUMNS = POINT_COLUMNS[:POINT_COLUMNS.index("timing")]
# clean | disturbed: the measurement window (attnbench.measure.noise); "noisy": runs written before that split
STATUSES = ("clean", "disturbed", "noisy", "oom", "skipped", "error")
TEXT_COLUMNS = {"point_id", "cell_id", "kernel", "baseline", "dtype", "mode", "causal", "status", "reason", "timing",
                "ran_on", "ran_on_uuid"}
NUMBER_COLUMNS = [c for c in POINT_COLUMNS if c not in TEXT_COLUMNS]
HEADER_LINE = ",".join(POINT_COLUMNS) + "\r\n"   # as csv.writer writes it
LOCK_FILE = ".lock"                      # the writer's pid (a pool's: its parent's, then its workers') while measured
TORN_FILE = "torn_records.jsonl"         # torn last lines set aside by a resume, with where they came from
SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


class RunDirError(ValueError):
    """A run directory that cannot be read or resumed (one line for the user)."""


class RunWriteError(RunDirError):
    """A file of a run directory that could not be written (disk full, no permission): one line naming the file
    and the OS error. Nothing already stored is touched: a failed append leaves its file as it was."""


def _cannot_read(path, exc: OSError) -> RunDirError:
    return RunDirError(f"{path}: cannot read ({exc.strerror or exc})")


def _cannot_write(path, exc: OSError) -> RunWriteError:
    return RunWriteError(f"{path}: cannot write ({exc.strerror or exc})")


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _json_default(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


class RunStore:
    """Writes one run directory. Every append is flushed and fsync'd: a crash loses nothing already measured."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock_fd: int | None = None
        self._columns: list[str] | None = None     # points.csv's header, read on the first append

    @classmethod
    def create(cls, root: Path, matrix_name: str, manifest: dict, now: datetime | None = None) -> "RunStore":
        """A new run directory under `root`, locked by this process (release it with `unlock`)."""
        if not SAFE_NAME.fullmatch(matrix_name) or matrix_name in (".", ".."):
            # matrix.py only lets safe names through; this keeps a run directory inside `root` whatever the caller
            raise RunDirError(f"matrix name {matrix_name!r}: not a safe directory name (letters, digits, '-', '_', '.')")
        check_results_root(root)
        now = now or datetime.now(timezone.utc)
        base = f"{now.strftime('%Y%m%dT%H%M%SZ')}_{matrix_name}"
        suffix = 1
        while True:
            path = Path(root) / (base if suffix == 1 else f"{base}-{suffix}")
            try:
                path.mkdir()   # exclusive: two runs started in the same second must not share a directory
                break
            except FileExistsError:
                suffix += 1
            except OSError as exc:
                raise RunDirError(f"{root}: cannot create a run directory there ({exc.strerror or exc})") from None
        store = cls(path)
        try:
            store.lock()
            store.write_manifest(manifest)
            for name, text in (("points.csv", HEADER_LINE), ("attempts.jsonl", "")):
                _write_whole(path / name, text)
        except BaseException:
            store.unlock()
            shutil.rmtree(path, ignore_errors=True)   # made just now and never a run: nothing of it is kept
            raise
        return store

    @classmethod
    def open_existing(cls, path: Path) -> "RunStore":
        path = Path(path)
        for name in ("manifest.json", "points.csv", "attempts.jsonl"):
            try:
                present = (path / name).is_file()
            except OSError as exc:   # a folder this user may not look into
                raise _cannot_read(path / name, exc) from None
            if not present:
                raise RunDirError(f"{path}: not a run directory ({name} missing)")
        return cls(path)

    # -- the lock ---------------------------------------------------------------------------------
    def lock(self) -> None:
        """Take the run directory for this process: RunDirError naming the holder's pid if another has it."""
        import fcntl

        lock_path = self.path / LOCK_FILE
        while True:
            try:
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise RunDirError(f"{self.path}: cannot write the run directory ({exc.strerror or exc})") from None
            if not _try_flock(fd, fcntl.LOCK_EX, PROBE_GRACE_S):   # (a reader's probe holds it for a moment only)
                holder = _lock_holder(fd)
                os.close(fd)
                raise RunDirError(f"{self.path}: in use by another attnbench process (pid {holder}) that holds "
                                  f"its lock ({LOCK_FILE}); wait for it to finish or stop it")
            # the previous holder unlinks the file when it lets go: make sure we locked the file that is there now
            try:
                if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        self._lock_fd = fd
        try:
            _write_holder(fd, f"{os.getpid()}")
        except OSError as exc:
            self.unlock()
            raise _cannot_write(lock_path, exc) from None

    @property
    def lock_fd(self) -> int | None:
        """The locked file descriptor (a worker pool hands duplicates of it to its workers: one holder)."""
        return self._lock_fd

    def name_lock_holders(self, worker_pids) -> None:
        """Write the pool's workers beside this process's pid into the lock file (what a refused resume names)."""
        assert self._lock_fd is not None, "name_lock_holders() needs the run directory's lock"
        try:
            _write_holder(self._lock_fd, f"{os.getpid()}" + (f" (workers {', '.join(map(str, worker_pids))})"
                                                             if worker_pids else ""))
        except OSError as exc:
            raise _cannot_write(self.path / LOCK_FILE, exc) from None

    def unlock(self) -> None:
        if self._lock_fd is None:
            return
        try:
            os.unlink(self.path / LOCK_FILE)   # while still holding it, so a waiter re-checks which file it locked
        except OSError:   # gone already, or a folder it may not change: closing releases the lock all the same
            pass
        os.close(self._lock_fd)
        self._lock_fd = None

    # -- manifest -------------------------------------------------------------------------------
    def read_manifest(self) -> dict:
        path = self.path / "manifest.json"
        try:
            manifest = json.loads(path.read_bytes().decode("utf-8"))
        except OSError as exc:
            raise _cannot_read(path, exc) from None
        except UnicodeDecodeError:
            raise RunDirError(f"{path}: not UTF-8 text") from None
        except json.JSONDecodeError as exc:
            raise RunDirError(f"{path}: invalid JSON ({exc.msg}, line {exc.lineno})") from None
        if not isinstance(manifest, dict):
            raise RunDirError(f"{path}: must be a JSON object, found {type(manifest).__name__}")
        _check_manifest(path, manifest)
        return manifest

    def write_manifest(self, manifest: dict) -> None:
        path = self.path / "manifest.json"
        try:
            write_json_atomic(path, manifest, sort_keys=True, default=_json_default)
        except OSError as exc:
            raise _cannot_write(path, exc) from None

    def update_manifest(self, **changes) -> None:
        manifest = self.read_manifest()
        manifest.update(changes)
        self.write_manifest(manifest)

    # -- appends --------------------------------------------------------------------------------
    def append_attempt(self, record: dict) -> None:
        line = json.dumps(record, default=_json_default, allow_nan=False) if _all_finite(record) else \
            json.dumps(_nan_to_none(record), default=_json_default)
        _append_line(self.path / "attempts.jsonl", line + "\n", heal=True)

    def append_point(self, row: dict) -> None:
        unknown = set(row) - set(POINT_COLUMNS)
        if unknown:
            raise KeyError(f"unknown point columns: {sorted(unknown)}")
        # a run started by an older harness keeps its own header when resumed: its columns only (attempts.jsonl
        # still holds everything)
        values = [_csv_value(row.get(col)) for col in self._header()]
        buf = io.StringIO()
        csv.writer(buf).writerow(values)
        _append_line(self.path / "points.csv", buf.getvalue(), heal=True)   # one write: a crash tears at most this row

    def _header(self) -> list[str]:
        """points.csv's own header (read once; a resume repairs an emptied or torn file before appending)."""
        if self._columns is None:
            rows, _, _ = _read_points(self.path / "points.csv")
            self._columns = rows[0] if rows else list(POINT_COLUMNS)
        return self._columns

    def finished_point_ids(self) -> set[str]:
        """The points with a complete row in points.csv (a torn last row does not count)."""
        rows, _, _ = _read_points(self.path / "points.csv")
        if not rows:
            return set()
        column = rows[0].index("point_id")
        return {row[column] for row in rows[1:]}

    def finished_replicas(self) -> set[tuple[str, str]]:
        """(point_id, ran_on) of every complete row: what a --replicate run has measured on which device
        (rows from before the ran_on column: device "")."""
        rows, _, _ = _read_points(self.path / "points.csv")
        if not rows:
            return set()
        column = rows[0].index("point_id")
        device = rows[0].index("ran_on") if "ran_on" in rows[0] else None
        return {(row[column], row[device] if device is not None else "") for row in rows[1:]}

    def repair(self) -> list[str]:
        """Under the lock, before resuming: move torn last lines to torn_records.jsonl and give an emptied
        points.csv its header back. Returns one line per thing done (empty: nothing needed)."""
        assert self._lock_fd is not None, "repair() needs the run directory's lock"
        done = []
        points = self.path / "points.csv"
        rows, _, torn = _read_points(points)
        if torn and not (not rows and HEADER_LINE.startswith(torn)):   # a torn header holds no measurement
            _set_aside(self.path, "points.csv", torn)
            done.append(f"points.csv: torn last row {_preview(torn)} set aside in {TORN_FILE}; its point is measured again")
        if not rows:
            _write_whole(points, HEADER_LINE)     # 0 bytes, or only a torn header
            done.append("points.csv: header restored")
        elif torn:
            _truncate_tail(points, len(torn.encode("utf-8", "surrogateescape")))
        attempts = self.path / "attempts.jsonl"
        _, torn, complete_tail = _read_attempts(attempts)
        if complete_tail:      # a whole record that only lacks its newline
            _append_line(attempts, "\n")
        elif torn:
            _set_aside(self.path, "attempts.jsonl", torn)
            _truncate_tail(attempts, len(torn.encode("utf-8", "surrogateescape")))
            done.append(f"attempts.jsonl: torn last record {_preview(torn)} set aside in {TORN_FILE}")
        return done


def _write_whole(path: Path, text: str) -> None:
    """A file's whole text, fsync'd (a run's new logs, a header restored); RunWriteError where it cannot be."""
    try:
        with open(path, "w", newline="") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise _cannot_write(path, exc) from None


def _set_aside(run_dir: Path, source: str, text: str) -> None:
    """A torn last line of `source`, kept in torn_records.jsonl with where it came from."""
    record = {"file": source, "set_aside_utc": utc_now(), "text": text}
    _append_line(run_dir / TORN_FILE, json.dumps(record, ensure_ascii=True) + "\n", heal=True)


def _append_line(path: Path, line: str, *, heal: bool = False) -> None:
    """Append one whole record and fsync it, under an exclusive flock of the file: the records of several
    writers (a worker pool) never interleave. `heal`: first set aside a partial last line that a writer killed
    mid-record left (it cannot be one being written: that writer would hold the lock), so the new record starts
    on a line of its own and the torn one never ends up in the middle of the file. A write that fails (disk
    full, no permission) is cut off again, so the file ends as it did, and raised as RunWriteError."""
    import fcntl

    data = line.encode("utf-8")
    fd = None
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)   # read too: _heal_tail
        fcntl.flock(fd, fcntl.LOCK_EX)
        if heal:
            _heal_tail(path, fd)
        end = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:   # one write for a regular file; the loop only guards against a short write
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, end)   # a part of this record (a disk that filled up mid-write) is not left behind
            raise
    except OSError as exc:
        raise _cannot_write(path, exc) from None
    finally:
        if fd is not None:
            os.close(fd)   # releases the flock


def _heal_tail(path: Path, fd: int) -> None:
    """Under the file's append lock: a partial last line is a record whose writer died mid-write. A whole JSON
    record that only lacks its newline gets it; anything else is moved to torn_records.jsonl (kept) and cut off.
    (points.csv without one complete line has a torn header: left to resume, which restores it.)"""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    start, chunk = size, 1 << 16
    while start > 0:   # just after the last newline (0: none), read backwards in chunks (attempts.jsonl is large)
        lo = max(0, start - chunk)
        cut = os.pread(fd, start - lo, lo).rfind(b"\n")
        start = lo + cut + 1 if cut >= 0 else lo
        if cut >= 0:
            break
    if start == 0 and path.name == "points.csv":
        return   # a torn header: resume restores it
    tail = os.pread(fd, size - start, start).decode("utf-8", "surrogateescape")
    if path.name in ("attempts.jsonl", TORN_FILE):
        try:
            whole = isinstance(json.loads(tail), dict)
        except ValueError:
            whole = False
        if whole or path.name == TORN_FILE:   # torn_records.jsonl keeps a torn record of its own as its own line
            os.write(fd, b"\n")
            return
    _set_aside(path.parent, path.name, tail)
    os.ftruncate(fd, start)


def _truncate_tail(path: Path, nbytes: int) -> None:
    try:
        with open(path, "r+b") as fh:
            fh.truncate(os.fstat(fh.fileno()).st_size - nbytes)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise _cannot_write(path, exc) from None


def _preview(text: str, width: int = 40) -> str:
    return repr(text if len(text) <= width else text[:width] + "…")


def _csv_value(value):
    if value is None:
        return ""
    if isinstance(value, float):
        if not math.isfinite(value):
            return ""
        return repr(round(value, 6)) if abs(value) >= 1e-3 else f"{value:.6g}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return " ".join(value.splitlines())   # one row per line: what makes a torn row detectable
    return value


def _split_tail(path: Path) -> tuple[str, str]:
    """A line-oriented file → (its complete lines, the torn tail after the last newline or '')."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise _cannot_read(path, exc) from None
    cut = data.rfind(b"\n") + 1
    try:
        complete = data[:cut].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RunDirError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    # a crash may also cut a multi-byte character: keep the tail's bytes exactly (surrogateescape)
    return complete, data[cut:].decode("utf-8", "surrogateescape")


def _read_points(path: Path) -> tuple[list[list[str]], str, str]:
    """points.csv → (header + complete rows as lists of fields, their text, the torn tail). A malformed row
    before the last line is corruption (RunDirError); an empty file reads as no rows at all (not even a header)."""
    complete, torn = _split_tail(path)
    rows = list(csv.reader(io.StringIO(complete, newline="")))
    if rows:
        missing = [c for c in REQUIRED_COLUMNS if c not in rows[0]]
        if missing:
            raise RunDirError(f"{path}: missing columns {', '.join(missing)}")
        for lineno, row in enumerate(rows[1:], 2):
            if len(row) != len(rows[0]):
                raise RunDirError(f"{path}:{lineno}: {len(row)} fields, expected {len(rows[0])} "
                                  f"(a corrupt row, not a torn last line)")
    return rows, complete, torn


def _read_attempts(path: Path) -> tuple[list[dict], str, bool]:
    """attempts.jsonl → (records, torn tail, whether the tail is a whole record lacking only its newline)."""
    complete, torn = _split_tail(path)
    records = []
    for lineno, line in enumerate(complete.split("\n"), 1):
        if line.strip():
            records.append(_attempt(path, lineno, line))
    if torn.strip():
        try:
            record = json.loads(torn)
        except ValueError:
            return records, torn, False
        if isinstance(record, dict):
            records.append(record)
            return records, "", True
    return records, torn if torn.strip() else "", False


def _attempt(path: Path, lineno: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except ValueError:
        raise RunDirError(f"{path}:{lineno}: invalid JSON (a corrupt record, not a torn last line)") from None
    if not isinstance(record, dict):
        raise RunDirError(f"{path}:{lineno}: an attempt record must be a JSON object")
    return record


def _all_finite(obj) -> bool:
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, dict):
        return all(_all_finite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_all_finite(v) for v in obj)
    return True


def _nan_to_none(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nan_to_none(v) for v in obj]
    return obj


# -- reading back ----------------------------------------------------------------------------------

# the manifest's fields that readers use, with the JSON type each must have (null is allowed: not known)
MANIFEST_TYPES = {
    "argv": list, "program": list, "matrix_path": str, "matrix_name": str, "cwd": str, "device": str,
    "started_utc": str, "finished_utc": str, "resumed_utc": str, "git_commit": str, "host": str,
    "matrix_sha256": str, "plan_sha256": str, "interrupted": bool, "gpu": dict, "pool": dict, "versions": dict,
    "gate": dict, "kernel_switches": dict, "injected_slowdown": dict,
}
_JSON_NAMES = {list: "a list", str: "a string", bool: "true or false", dict: "an object", float: "a number"}


def _check_manifest(path: Path, manifest: dict) -> None:
    """Each field readers use has its JSON type (RunDirError naming the field and its value otherwise)."""
    def check(key: str, value, kind) -> None:
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) if kind is float else \
            isinstance(value, kind)
        if value is not None and not ok:
            raise RunDirError(f"{path}: field {key!r} must be {_JSON_NAMES[kind]}, found {json.dumps(value)[:60]}")

    for key, kind in MANIFEST_TYPES.items():
        check(key, manifest.get(key), kind)
    devices = (manifest.get("pool") or {}).get("devices")
    check("pool.devices", devices, list)
    for i, device in enumerate(devices or []):
        check(f"pool.devices[{i}]", device, dict)
    for name, factor in (manifest.get("injected_slowdown") or {}).items():
        check(f"injected_slowdown.{name}", factor, float)


@dataclass
class Run:
    path: Path
    manifest: dict
    points: pd.DataFrame
    attempts: list[dict]
    torn: list[str] = field(default_factory=list)   # files whose torn last line was left out (a resume sets it aside)


def run_dirs(root) -> list[Path]:
    """The run directories directly under `root` (folders holding a manifest.json, and folders this user may not
    look into: reading one names the problem), oldest name first; RunDirError when `root` cannot be read."""
    root = Path(root)
    try:
        entries = list(root.iterdir()) if root.is_dir() else []
    except OSError as exc:
        raise _cannot_read(root, exc) from None
    return sorted(p for p in entries if _holds_manifest(p))


def _holds_manifest(folder: Path) -> bool:
    try:
        return (folder / "manifest.json").is_file()
    except OSError:     # a folder that may not be looked into (a permission): its reader says so
        return True


def load_run(run_dir) -> Run:
    """Read a run directory; RunDirError (one line) if it is not one or a file is corrupt. A torn last line
    (a crash mid-write) is left out and named in `Run.torn`; the files are not changed (a resume repairs them)."""
    store = RunStore.open_existing(Path(run_dir))
    manifest = store.read_manifest()
    rows, complete, torn_points = _read_points(store.path / "points.csv")
    if rows:
        points = pd.read_csv(io.StringIO(complete), dtype={"point_id": str, "cell_id": str, "reason": str})
    else:   # an empty points.csv (a crash right after creating it): no points yet
        points = pd.DataFrame({c: pd.Series(dtype=object) for c in POINT_COLUMNS})
    _check_numbers(store.path / "points.csv", points)
    attempts, torn_attempts, _ = _read_attempts(store.path / "attempts.jsonl")
    for col in POINT_COLUMNS[len(REQUIRED_COLUMNS):]:   # a run from before the column: eager, the rest unknown
        if col not in points.columns:
            points[col] = "eager" if col == "timing" else float("nan")
    if points["causal"].dtype == object:
        points["causal"] = points["causal"].map(lambda v: str(v).lower() == "true")
    torn = [name for name, tail in (("points.csv", torn_points), ("attempts.jsonl", torn_attempts)) if tail]
    run = Run(path=store.path, manifest=manifest, points=points, attempts=attempts, torn=torn)
    if not rows or "kernel_host_ms" not in rows[0]:
        _host_times_from_attempts(run)
    return run


def _check_numbers(path: Path, points: pd.DataFrame) -> None:
    """Every number column of points.csv holds numbers (or nothing): RunDirError naming the row, column, value."""
    for col in NUMBER_COLUMNS:
        if col not in points.columns or pd.api.types.is_numeric_dtype(points[col]):   # read as numbers already
            continue
        bad = points[col].notna() & pd.to_numeric(points[col], errors="coerce").isna()
        if bad.any():
            row = int(bad.to_numpy().argmax())
            raise RunDirError(f"{path}:{row + 2}: column {col!r}: {points[col].iloc[row]!r} is not a number")


def final_attempts(run: Run) -> dict[str, dict]:
    """point_id → its final attempt record: the last one in the file. (Not the highest attempt number: a point
    whose row a crash tore is measured again on resume, and its new attempts count from 1.)"""
    return {a["point_id"]: a for a in run.attempts if a.get("point_id") is not None}


def _host_times_from_attempts(run: Run) -> None:
    """A run written after the host's time was recorded per call but before points.csv had its columns: each
    point's host times from its final attempt record (the same medians the runner now writes)."""
    final = final_attempts(run)
    path = run.path / "attempts.jsonl"
    for side in ("kernel", "baseline"):
        values = []
        for pid in run.points["point_id"]:
            part = (final.get(pid) or {}).get(side)
            v = part.get("host_ms_median") if isinstance(part, dict) else None
            if v is not None and (type(v) not in (int, float) or not v >= 0):
                raise RunDirError(f"{path}: point {pid}: {side}.host_ms_median {v!r} is not a time in ms")
            values.append(float("nan") if v is None else float(v))
        run.points[f"{side}_host_ms"] = values


def check_results_root(root, name: str = "results root") -> None:
    """`root` exists (created if needed) and this process may create files in it (run directories; any output
    folder of the CLI, named by `name` in the error); else RunDirError."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunDirError(f"{name} {root}: exists and is not a folder") from None
    except OSError as exc:
        raise RunDirError(f"{name} {root}: cannot create it ({exc.strerror or exc})") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise RunDirError(f"{name} {root}: not writable by this user")


def lock_holder(run_dir) -> str | None:
    """Who is writing a run directory now: what the holder of its lock wrote (its pid; a pool's parent and
    workers), or None when no process holds it (a lock file left by a killed process is not held). The check is a
    non-blocking try of the lock, let go at once (`RunStore.lock` gives such a probe PROBE_GRACE_S)."""
    import fcntl

    try:
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY)
    except OSError:        # no lock file: nobody (one that cannot be opened: not known, so not claimed)
        return None
    try:
        return None if _try_flock(fd, fcntl.LOCK_SH, 0.0) else _lock_holder(fd)
    finally:
        os.close(fd)       # lets go of the probe's lock


PROBE_GRACE_S = 0.2


def _try_flock(fd: int, kind: int, wait_s: float) -> bool:
    """flock `kind` without blocking, tried again for up to wait_s: False when another process holds it."""
    import fcntl

    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


def _write_holder(fd: int, text: str) -> None:
    """The lock holder's pid (and its workers') into its lock file: written over the old text, then cut to length,
    so a refused process never reads an emptied file."""
    data = f"{text}\n".encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def _lock_holder(fd: int, wait_s: float = 1.0) -> str:
    """What the lock's holder wrote into its lock file. A holder writes it just after it takes the lock, so a
    process refused in between reads it again for up to wait_s before it says "unknown"."""
    deadline = time.monotonic() + wait_s
    while True:
        text = os.pread(fd, 256, 0).decode(errors="replace").strip()
        if text or time.monotonic() > deadline:
            return text or "unknown"
        time.sleep(0.01)


def recorded_only(manifest: dict) -> str | None:
    """The --only glob a run was started with (None: every cell, or a run that did not record its argv)."""
    argv = [str(a) for a in (manifest.get("argv") or [])]
    only = next((a.split("=", 1)[1] for a in argv if a.startswith("--only=")), None)
    if "--only" in argv[:-1]:
        only = argv[argv.index("--only") + 1]
    return only


def matrix_file(manifest: dict) -> Path | None:
    """The matrix file a run was started with (a relative path is relative to where it was started: its cwd)."""
    path = manifest.get("matrix_path")
    if not path:
        return None
    return Path(manifest["cwd"]) / path if manifest.get("cwd") and not Path(path).is_absolute() else Path(path)


def resume_command(manifest: dict, run_dir) -> str:
    """The shell command that finishes a run: the program and command line it was started with (every option:
    --device, --results-root, --gpu, --only, ...) plus --resume RUN_DIR, after the kernel switches it ran with;
    prefixed by a cd when it was started in another folder than this one."""
    program = [str(a) for a in (manifest.get("program") or ["attnbench"])]
    argv = [str(a) for a in (manifest.get("argv") or [])]
    if not argv or argv[0] not in ("run-matrix", "spot-check"):
        argv = ["run-matrix", str(manifest.get("matrix_path") or "?")]   # runs that did not record their argv
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--resume", "--dry-run"):
            skip = arg == "--resume"
        elif not arg.startswith("--resume="):
            kept.append(arg)
    # the kernel switches it ran with (ATTNBENCH_*), set again: a resume under others is refused
    env = "".join(f"{k}={shlex.quote(str(v))} " for k, v in sorted((manifest.get("kernel_switches") or {}).items()))
    started_in = manifest.get("cwd")
    run_dir = Path(run_dir)
    if started_in and Path(started_in) != Path.cwd():
        return (f"cd {shlex.quote(started_in)} && {env}"
                + shlex.join([*program, *kept, "--resume", str(run_dir.resolve())]))
    return env + shlex.join([*program, *kept, "--resume", str(run_dir)])
