"""GPU-time planning for ``run-matrix --dry-run``: how long each point took the last time a run measured it.

For fitting a run into a limited GPU lease, never for a reported number.
"""
from __future__ import annotations

from datetime import datetime

from attnbench.store import RunDirError, load_run, run_dirs

RESUME_GAP_S = 300.0   # a longer gap between two attempt records is a run resumed later, not a point's duration


def _timestamp(text) -> float | None:
    """A record's UTC time in seconds; None when it has none that reads (a hand-edited or corrupt record)."""
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp() if text else None
    except ValueError:
        return None


def point_seconds(results_root, device: str) -> tuple[dict[str, float], int]:
    """Wall seconds each point took in the latest stored run that measured it on `device` (its attempts,
    snapshots and back-offs included): point_id → seconds, and how many runs were read. An attempt's time is
    the gap since the record before it (or since the run started); gaps over RESUME_GAP_S are resumptions
    and count as unknown. The attempts of a worker pool's devices interleave in the file: each device's records
    are timed against that device's previous one. A record without a readable time or point leaves unknown its own
    point and the next one of its device (advice, not a measurement: such records are passed over)."""
    runs = []
    for d in run_dirs(results_root):
        try:
            run = load_run(d)
        except RunDirError:
            continue
        if run.manifest.get("device") == device:
            runs.append(run)
    seconds: dict[str, float] = {}
    for run in sorted(runs, key=lambda r: str(r.manifest.get("started_utc"))):
        per_point: dict[str, float | None] = {}
        started = _timestamp(run.manifest.get("started_utc"))
        prev: dict[str | None, float | None] = {}   # device label → its previous record's time
        for a in run.attempts:
            ran_on = a.get("ran_on")
            label = str(ran_on.get("label")) if isinstance(ran_on, dict) else None
            last, now = prev.get(label, started), _timestamp(a.get("utc"))
            gap = now - last if now is not None and last is not None else None
            prev[label] = now
            known = gap is not None and 0 <= gap <= RESUME_GAP_S
            pid = a.get("point_id")
            if not isinstance(pid, str) or (pid in per_point and per_point[pid] is None):
                continue
            per_point[pid] = (per_point.get(pid) or 0.0) + gap if known else None
        seconds.update({pid: s for pid, s in per_point.items() if s is not None})
    return seconds, len(runs)
