"""Stored runs read back together: several run directories in one DataFrame, the run list a report is built
from, how far each run got against its plan.

``store.py`` writes and reads one run directory; this module works on several (``report``, ``gate``, ``runs``).
Plain functions over plain data, nothing prints.
"""
from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from attnbench.store import Run, RunDirError, load_run, run_dirs


def as_run(run_or_dir) -> Run:
    return run_or_dir if isinstance(run_or_dir, Run) else load_run(run_or_dir)


def gpu_short_name(manifest: dict) -> str:
    """A short, file-name-safe GPU name from a manifest: "NVIDIA H100 80GB HBM3" → "H100"; "CPU" for cpu runs."""
    if manifest.get("device") == "cpu" or not manifest.get("gpu"):
        return "CPU"
    name = str((manifest.get("gpu") or {}).get("name") or "GPU")
    words = [w for w in re.split(r"[\s_]+", name) if w and w.upper() not in ("NVIDIA", "TESLA", "GEFORCE", "QUADRO")]
    for i, word in enumerate(words):
        if word.upper() in ("RTX", "GTX") and i + 1 < len(words):
            return re.sub(r"[^A-Za-z0-9]", "", word.upper() + words[i + 1]) or "GPU"
        if re.search(r"\d", word) and re.search(r"[A-Za-z]", word):
            return re.sub(r"[^A-Za-z0-9]", "", word.split("-")[0]) or "GPU"
    return re.sub(r"[^A-Za-z0-9]", "", "".join(words)) or "GPU"


def sorted_runs(run_dirs) -> list[Run]:
    """Runs (or run directories, loaded here) ordered by start time, then directory name."""
    runs = [as_run(r) for r in run_dirs]
    return sorted(runs, key=lambda r: (str(r.manifest.get("started_utc") or ""), r.path.name))


def load_runs(run_dirs, superseding=()) -> pd.DataFrame:
    """The points of several runs in one DataFrame, each row tagged with its run's manifest fields.

    Added columns: run (directory name), run_path, matrix_name, started_utc, device, gpu_name,
    gpu_short, git_commit, supersedes (the run is one of `superseding`: read_run_list's marked runs), and
    is_model (heads and head_dim empty: n is an image size).
    Runs are ordered by start time, rows keep their order inside a run.
    """
    superseding = {Path(p).resolve() for p in superseding}
    frames = []
    for run in sorted_runs(run_dirs):
        df = run.points.copy()
        m = run.manifest
        tags = {
            "run": run.path.name, "run_path": str(run.path), "matrix_name": m.get("matrix_name"),
            "started_utc": m.get("started_utc"), "device": m.get("device"),
            "gpu_name": (m.get("gpu") or {}).get("name") if m.get("gpu") else None,
            "gpu_short": gpu_short_name(m), "git_commit": m.get("git_commit"),
            "supersedes": run.path.resolve() in superseding,
        }
        for key, value in tags.items():
            df[key] = value
        frames.append(df)
    if not frames:
        raise ValueError("no run directories given")
    df = pd.concat(frames, ignore_index=True)
    df["is_model"] = df["heads"].isna() & df["head_dim"].isna()
    return df


def resolve_run_dir(path) -> Path:
    """A run directory, or a folder holding run directories (e.g. results/baselines/h100/): its newest one."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    subs = run_dirs(path)
    if subs:
        return subs[-1]
    raise RunDirError(f"{path}: not a run directory and holds none")


def read_run_list(path) -> list[tuple[Path, bool]]:
    """The run directories a report is built from, one per line of a text file (e.g. results/H100_runs.txt), each
    with whether it supersedes: (run_dir, supersedes).

    Paths are relative to the file's folder; blank lines and text after ``#`` are ignored. A line that starts
    with ``!`` names a run whose points supersede the same points of every earlier run, whatever their status
    (select_final): a run measuring a kernel that changed, whose disturbed points say more about the kernel now
    than an earlier run's clean ones. RunDirError (one line, naming the file and line) when the file is missing,
    lists nothing, or names a folder that is not a run directory.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise RunDirError(f"{path}: cannot read the run list ({exc.__class__.__name__})") from None
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        supersedes = entry.startswith("!")
        entry = entry.lstrip("!").strip()
        run_dir = path.parent / entry
        if not (run_dir / "manifest.json").is_file():
            raise RunDirError(f"{path}:{lineno}: {entry}: not a run directory (no manifest.json in {run_dir})")
        out.append((run_dir, supersedes))
    if not out:
        raise RunDirError(f"{path}: lists no run directory")
    return out


def torn_text(run: Run) -> str | None:
    """What readers say of a run whose torn last line they left out (store.load_run's Run.torn), or None."""
    if not run.torn:
        return None
    return f"torn last line of {' and '.join(run.torn)} (a crash mid-write): resume re-measures its point"


def run_progress(run: Run) -> dict:
    """How far a stored run got against the plan it was started with, and how to finish it.

    Returns: run, matrix, started, measured (points stored; for a --replicate run, (point, device) pairs),
    planned (points in the plan, times the pool's devices for a --replicate run; None when the
    matrix file is gone or its measured cells changed since), state ("running now, pid …" while a process
    holds its lock), resume (the command that finishes it, or None when it is complete, running or can no longer
    be resumed)."""
    from attnbench.matrix import MatrixError, load_matrix
    from attnbench.store import lock_holder, matrix_file, recorded_only, resume_command

    m = run.manifest
    argv = [str(a) for a in (m.get("argv") or [])]
    command = argv[0] if argv and argv[0] in ("run-matrix", "spot-check") else "run-matrix"
    only = recorded_only(m)
    path = m.get("matrix_path") or "?"
    where = matrix_file(m) or Path(path)
    measured = int(run.points["point_id"].nunique()) if len(run.points) else 0
    # a --replicate run owes every point on every device of its pool: count (point, device) pairs
    replicas = len((m.get("pool") or {}).get("devices") or []) if (m.get("pool") or {}).get("replicate") else 1
    if replicas > 1 and len(run.points):
        measured = len(run.points[["point_id", "ran_on"]].drop_duplicates())
    planned, problem = None, None
    try:
        if command == "spot-check":
            from attnbench.spotcheck import load_spot_check

            matrix = load_spot_check(where, device=m.get("device") or "cuda").matrix
        else:
            matrix = load_matrix(where, device=m.get("device") or "cuda").select(only)
        if matrix is None:            # a spot-check file none of whose cells can run
            problem = "none of its cells can run now"
        elif matrix.can_resume(m) or (m.get("finished_utc") and matrix.covered_by(run.points["point_id"])):
            planned = len(matrix.points()) * replicas   # resumable, or complete under today's plan (resume: a no-op)
        else:
            problem = ("its cells changed in the matrix since" if m.get("plan_sha256")
                       else "the matrix file changed since")
    except (MatrixError, OSError):
        problem = "its matrix file is missing or invalid now"
    torn = torn_text(run)
    lost = planned is not None and measured < planned     # finished once, but rows are missing now
    holder = lock_holder(run.path)
    if holder:                # being measured (or resumed) by a live process now: nothing to finish
        state = f"running now, pid {holder}"
    elif m.get("finished_utc") and not run.torn and not lost:
        state = "complete" + (f" ({problem})" if problem else "")
    elif problem:
        state = f"unfinished, not resumable: {problem}"
    elif run.torn:
        state = f"interrupted, {torn}"
    else:
        state = "interrupted" if m.get("interrupted") or lost else "unfinished"
    resume = resume_command(m, run.path) if state.startswith(("interrupted", "unfinished")) and not problem else None
    return dict(run=run.path.name, matrix=path, started=m.get("started_utc") or "–", measured=measured,
                planned=planned, state=state, resume=resume)
