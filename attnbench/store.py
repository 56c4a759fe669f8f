"""The run directory: append-only while measuring, read back into DataFrames for reporting.

Layout (``results/runs/<UTC time>_<matrix name>/``):
- ``manifest.json``  what was run, where, with which versions and gate thresholds;
- ``attempts.jsonl`` one record per attempt, with the GPU/system snapshots before and after, flushed as made;
- ``points.csv``     one row per finished point (its final attempt), flushed as made.

A point is finished once its row is in ``points.csv``; ``--resume`` skips exactly those, so an
interrupted run loses at most the point that was being measured.
"""
from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

POINT_COLUMNS = [
    "point_id", "cell_id", "kernel", "baseline", "dtype", "mode", "causal", "batch", "heads", "head_dim", "n",
    "kernel_ms", "kernel_ms_p10", "kernel_ms_p90", "baseline_ms", "baseline_ms_p10", "baseline_ms_p90",
    "lat_ratio", "lat_ratio_p10", "lat_ratio_p90", "kernel_mem_mb", "baseline_mem_mb", "mem_ratio",
    "kernel_tflops", "baseline_tflops", "status", "attempts", "reason",
    # how the point was timed and how well its median ratio is known (runs before these columns: filled on load)
    "timing", "spread", "lat_ratio_ci_low", "lat_ratio_ci_high", "ci_half_width",
]
LEGACY_COLUMNS = POINT_COLUMNS[:POINT_COLUMNS.index("timing")]   # what every stored run has
# clean | disturbed: the measurement window (attnbench.measure.noise); "noisy": runs written before that split
STATUSES = ("clean", "disturbed", "noisy", "oom", "skipped", "error")


class RunDirError(ValueError):
    """A run directory that cannot be read or resumed (one line for the user)."""


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
        self._columns: list[str] | None = None     # points.csv's header, read on the first append

    @classmethod
    def create(cls, root: Path, matrix_name: str, manifest: dict, now: datetime | None = None) -> "RunStore":
        now = now or datetime.now(timezone.utc)
        base = f"{now.strftime('%Y%m%dT%H%M%SZ')}_{matrix_name}"
        path = Path(root) / base
        suffix = 1
        while path.exists():  # two runs in the same second must not share a directory
            suffix += 1
            path = Path(root) / f"{base}-{suffix}"
        path.mkdir(parents=True)
        store = cls(path)
        store.write_manifest(manifest)
        with open(path / "points.csv", "w", newline="") as fh:
            csv.writer(fh).writerow(POINT_COLUMNS)
        (path / "attempts.jsonl").touch()
        return store

    @classmethod
    def open_existing(cls, path: Path) -> "RunStore":
        path = Path(path)
        for name in ("manifest.json", "points.csv", "attempts.jsonl"):
            if not (path / name).is_file():
                raise RunDirError(f"{path}: not a run directory ({name} missing)")
        return cls(path)

    # -- manifest -------------------------------------------------------------------------------
    def read_manifest(self) -> dict:
        try:
            return json.loads((self.path / "manifest.json").read_text())
        except json.JSONDecodeError as exc:
            raise RunDirError(f"{self.path / 'manifest.json'}: invalid JSON ({exc.msg}, line {exc.lineno})") from None

    def write_manifest(self, manifest: dict) -> None:
        tmp = self.path / "manifest.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=_json_default) + "\n")
        os.replace(tmp, self.path / "manifest.json")  # atomic: a reader never sees half a manifest

    def update_manifest(self, **changes) -> None:
        manifest = self.read_manifest()
        manifest.update(changes)
        self.write_manifest(manifest)

    # -- appends --------------------------------------------------------------------------------
    def append_attempt(self, record: dict) -> None:
        line = json.dumps(record, default=_json_default, allow_nan=False) if _all_finite(record) else \
            json.dumps(_nan_to_none(record), default=_json_default)
        _append_line(self.path / "attempts.jsonl", line + "\n")

    def append_point(self, row: dict) -> None:
        unknown = set(row) - set(POINT_COLUMNS)
        if unknown:
            raise KeyError(f"unknown point columns: {sorted(unknown)}")
        # a run directory started by an older harness keeps its own header (resumed runs): its columns only;
        # attempts.jsonl still holds everything
        values = [_csv_value(row.get(col)) for col in self._header()]
        with open(self.path / "points.csv", "a", newline="") as fh:
            csv.writer(fh).writerow(values)
            fh.flush()
            os.fsync(fh.fileno())

    def _header(self) -> list[str]:
        if self._columns is None:
            with open(self.path / "points.csv", newline="") as fh:
                self._columns = next(csv.reader(fh), None) or POINT_COLUMNS
        return self._columns

    def finished_point_ids(self) -> set[str]:
        with open(self.path / "points.csv", newline="") as fh:
            return {row["point_id"] for row in csv.DictReader(fh)}


def _append_line(path: Path, line: str) -> None:
    with open(path, "a") as fh:
        fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())


def _csv_value(value):
    if value is None:
        return ""
    if isinstance(value, float):
        if not math.isfinite(value):
            return ""
        return repr(round(value, 6)) if abs(value) >= 1e-3 else f"{value:.6g}"
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


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

@dataclass
class Run:
    path: Path
    manifest: dict
    points: pd.DataFrame
    attempts: list[dict]


def run_dirs(root) -> list[Path]:
    """The run directories directly under `root` (folders holding a manifest.json), oldest name first."""
    root = Path(root)
    return sorted(p for p in root.iterdir() if (p / "manifest.json").is_file()) if root.is_dir() else []


def load_run(run_dir) -> Run:
    """Read a run directory; RunDirError (one line) if it is not one or a file is corrupt."""
    store = RunStore.open_existing(Path(run_dir))
    manifest = store.read_manifest()
    try:
        points = pd.read_csv(store.path / "points.csv", dtype={"point_id": str, "cell_id": str, "reason": str})
    except pd.errors.ParserError as exc:
        raise RunDirError(f"{store.path / 'points.csv'}: {exc}") from None
    missing = [c for c in LEGACY_COLUMNS if c not in points.columns]
    if missing:
        raise RunDirError(f"{store.path / 'points.csv'}: missing columns {', '.join(missing)}")
    for col in POINT_COLUMNS[len(LEGACY_COLUMNS):]:   # a run from before timing modes and CIs: eager, unknown CI
        if col not in points.columns:
            points[col] = "eager" if col == "timing" else float("nan")
    if points["causal"].dtype == object:
        points["causal"] = points["causal"].map(lambda v: str(v).lower() == "true")
    attempts = []
    with open(store.path / "attempts.jsonl") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                attempts.append(json.loads(line))
            except json.JSONDecodeError:
                # the last line may be torn by a kill mid-write; anything earlier is corruption
                if lineno == sum(1 for _ in open(store.path / "attempts.jsonl")):
                    break
                raise RunDirError(f"{store.path / 'attempts.jsonl'}:{lineno}: invalid JSON") from None
    return Run(path=store.path, manifest=manifest, points=points, attempts=attempts)
