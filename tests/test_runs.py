"""Stored runs read back together (attnbench.runs) and the --dry-run's GPU-time plan (attnbench.planning)."""
from __future__ import annotations

from datetime import datetime

import pytest

from attnbench.runs import gpu_short_name, load_runs, read_run_list, resolve_run_dir
from attnbench.store import RunDirError, RunStore
from test_analysis import H100, make_run, seed_cells


@pytest.fixture
def seed_run(tmp_path):
    return make_run(tmp_path / "runs", seed_cells(), name="full")


def test_gpu_short_name():
    assert gpu_short_name({"device": "cuda", "gpu": H100}) == "H100"
    assert gpu_short_name({"device": "cuda", "gpu": {"name": "NVIDIA A100-SXM4-80GB"}}) == "A100"
    assert gpu_short_name({"device": "cuda", "gpu": {"name": "NVIDIA H200"}}) == "H200"
    assert gpu_short_name({"device": "cuda", "gpu": {"name": "NVIDIA GeForce RTX 4090"}}) == "RTX4090"
    assert gpu_short_name({"device": "cpu", "gpu": None}) == "CPU"


def test_load_runs_tags_manifest_fields(seed_run):
    df = load_runs([seed_run])
    assert set(df["gpu_short"]) == {"H100"} and set(df["gpu_name"]) == {H100["name"]}
    assert set(df["git_commit"]) == {"abc123def4567890"} and not df["is_model"].any()


def test_resolve_run_dir(tmp_path, seed_run):
    assert resolve_run_dir(seed_run) == seed_run
    assert resolve_run_dir(seed_run.parent) == seed_run
    with pytest.raises(RunDirError):
        resolve_run_dir(tmp_path / "nothing")


def test_read_run_list(tmp_path, seed_run):
    """Paths relative to the list's folder, comments and blank lines ignored, a leading ! marks a superseding run;
    a bad line is named by number."""
    listing = seed_run.parent.parent / "GPU_runs.txt"
    listing.write_text(f"# the runs behind RESULTS_GPU.md\n\n{seed_run.parent.name}/{seed_run.name}   # seed cells\n")
    assert [(p.resolve(), sup) for p, sup in read_run_list(listing)] == [(seed_run.resolve(), False)]
    listing.write_text(f"! {seed_run.parent.name}/{seed_run.name}   # the kernel changed\n")
    assert [(p.resolve(), sup) for p, sup in read_run_list(listing)] == [(seed_run.resolve(), True)]
    listing.write_text(f"{seed_run.parent.name}/{seed_run.name}\nruns/nowhere\n")
    with pytest.raises(RunDirError, match=r"GPU_runs.txt:2: runs/nowhere: not a run directory"):
        read_run_list(listing)
    listing.write_text("# nothing yet\n")
    with pytest.raises(RunDirError, match="lists no run directory"):
        read_run_list(listing)
    with pytest.raises(RunDirError, match="cannot read the run list"):
        read_run_list(tmp_path / "missing.txt")


# -- GPU-time planning for run-matrix --dry-run ---------------------------------------------------------------

def test_point_seconds_from_attempt_times(tmp_path):
    """Per point: the gaps between attempt records (first from the run's start), retries summed, a gap over
    RESUME_GAP_S (a run resumed a day later) unknown; only runs of the asked device; the latest run wins."""
    from attnbench.planning import point_seconds

    def run(name, started, device, attempts):
        store = RunStore.create(tmp_path, name, {"matrix_name": name, "device": device, "started_utc": started},
                                now=datetime.fromisoformat(started.replace("Z", "+00:00")))
        for pid, utc in attempts:
            store.append_attempt({"point_id": pid, "cell_id": pid.split("@")[0], "n": int(pid.split("@")[1]),
                                  "attempt": 1, "utc": utc, "status": "clean"})

    run("a", "2026-11-22T01:00:00Z", "cuda", [("x@1", "2026-11-22T01:00:20Z"), ("y@2", "2026-11-22T01:00:23Z"),
                                            ("y@2", "2026-11-22T01:00:30Z"), ("z@3", "2026-11-23T09:00:00Z")])
    run("b", "2026-11-22T02:00:00Z", "cuda", [("x@1", "2026-11-22T02:00:05Z")])
    run("c", "2026-11-22T03:00:00Z", "cpu", [("x@1", "2026-11-22T03:00:50Z")])
    seconds, n_runs = point_seconds(tmp_path, "cuda")
    assert n_runs == 2 and seconds == {"x@1": 5.0, "y@2": 10.0}
    assert point_seconds(tmp_path / "none", "cuda") == ({}, 0)


def test_point_seconds_passes_over_records_without_a_readable_time(tmp_path):
    """A hand-edited record (no utc, a utc that does not read, no point id, ran_on not an object) does not stop the
    plan: its point and the next one of its device are unknown, the others timed as before."""
    from attnbench.planning import point_seconds

    manifest = {"matrix_name": "a", "device": "cuda", "started_utc": "2026-11-22T01:00:00Z"}
    store = RunStore.create(tmp_path, "a", manifest, now=datetime(2026, 11, 22, 1))
    for record in ({"point_id": "w@1", "utc": "2026-11-22T01:00:02Z"}, {"point_id": "x@1"},
                   {"point_id": "y@2", "utc": "2026-11-22T01:00:20Z"}, {"point_id": "z@3", "utc": "garbage"},
                   {"utc": "2026-11-22T01:00:30Z", "ran_on": "cpu"},
                   {"point_id": "v@4", "utc": "2026-11-22T01:00:34Z"}):
        store.append_attempt(record)
    assert point_seconds(tmp_path, "cuda") == ({"w@1": 2.0, "v@4": 4.0}, 1)


def test_unreadable_folders_are_one_line(tmp_path, monkeypatch, seed_run):
    """A results root or a run directory this user may not look into (EACCES, simulated: the tests may run as
    root): RunDirError naming it, not a PermissionError; a run folder that cannot be looked into is still listed,
    so its reader names the problem."""
    import errno
    import os
    import pathlib

    from attnbench.store import load_run, run_dirs

    denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    iterdir, is_file = pathlib.Path.iterdir, pathlib.Path.is_file
    monkeypatch.setattr(pathlib.Path, "iterdir", lambda self: (_ for _ in ()).throw(denied) if self == seed_run.parent
                        else iterdir(self))
    with pytest.raises(RunDirError, match=rf"^{seed_run.parent}: cannot read \(Permission denied\)$"):
        run_dirs(seed_run.parent)
    monkeypatch.undo()

    def refused(self):
        if self.parent == seed_run:
            raise denied
        return is_file(self)

    monkeypatch.setattr(pathlib.Path, "is_file", refused)
    assert run_dirs(seed_run.parent) == [seed_run]
    with pytest.raises(RunDirError, match=rf"^{seed_run}/manifest.json: cannot read \(Permission denied\)$"):
        load_run(seed_run)
