"""The runner: retries, every attempt kept, the run directory, resume and Ctrl-C, the CLI end to end."""
import copy
import dataclasses
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from attnbench import runner as runner_mod
from attnbench.gpu import CleanGpuCheck
from attnbench.matrix import load_matrix
from attnbench.measure import SideResult
from attnbench.runner import Runner, RunInterrupted, RunOptions
from attnbench.store import POINT_COLUMNS, RunDirError, RunStore, load_run

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "matrices" / "smoke_cpu.yaml"


def matrix(tmp_path, max_cv=0.03, attempts=4):
    text = f"""
defaults: {{batch: 1, heads: 2, head_dim: 32, timing: {{warmup_ms: 0, rep_ms: 1, min_reps: 3, max_reps: 3, flush_l2: false}},
           retry: {{max_attempts: {attempts}, backoff_s: 0, max_cv: {max_cv}}}}}
cells:
  - {{id: a, kernel: flash, baseline: math, dtype: float32, mode: fwd, seq_lens: [16, 32]}}
  - {{id: b, kernel: flash, baseline: math, dtype: float32, mode: fwdbwd, causal: true, seq_lens: [24]}}
"""
    p = tmp_path / "m.yaml"
    p.write_text(text)
    return load_matrix(p, device="cpu")


def fake_results(script):
    """measure_point replacement: per call, 'noisy' gives widely spread ratios, 'clean' tight ones."""
    calls = []

    def measure_point(point, device, monitor=None):
        kind = script[min(len(calls), len(script) - 1)]
        calls.append(point.id)
        if kind == "interrupt":
            raise KeyboardInterrupt
        drift = 1 + 0.2 * len(calls)      # a noisy window: the median moves between attempts
        ratios = {"noisy": [0.2 * drift, 0.9 * drift, 0.5 * drift, 1.4 * drift],
                  "spread": [0.2, 0.9, 0.5, 1.4]}.get(kind, [0.5, 0.5, 0.5, 0.5])
        k = SideResult(point.cell.kernel, samples_ms=[1.0, 1.1, 1.0, 1.0], flops=1e9)
        b = SideResult(point.cell.baseline, samples_ms=[2.0, 2.0, 2.1, 2.0], flops=1e9)
        return {"kernel": k, "baseline": b, "ratios": ratios}

    return measure_point, calls


def make_runner(m, tmp_path, **kw):
    # the CPU load check is opened wide: other test processes may share this machine
    opts = RunOptions(device="cpu", results_root=tmp_path / "runs", snapshot_s=0, clean_check=CleanGpuCheck(max_cpu_pct=1e9))
    return Runner(m, opts, reader=None, sleep=lambda s: None, **kw)


def attempts_of(run_dir, point_id):
    return [a for a in load_run(run_dir).attempts if a["point_id"] == point_id]


def test_noisy_twice_then_clean_keeps_three_attempts(tmp_path, monkeypatch):
    fake, calls = fake_results(["noisy", "noisy", "clean"])
    monkeypatch.setattr(runner_mod, "measure_point", fake)
    run_dir = make_runner(matrix(tmp_path), tmp_path).run()
    atts = attempts_of(run_dir, "a@16")
    assert [a["status"] for a in atts] == ["noisy", "noisy", "clean"]
    assert [a["attempt"] for a in atts] == [1, 2, 3]
    assert all("ratio spread CV" in a["noisy_reasons"][0] for a in atts[:2])
    row = load_run(run_dir).points.set_index("point_id").loc["a@16"]
    assert row.status == "clean" and row.attempts == 3 and row.lat_ratio == pytest.approx(0.5)


def test_always_noisy_ends_noisy_after_max_attempts(tmp_path, monkeypatch):
    fake, calls = fake_results(["noisy"])
    monkeypatch.setattr(runner_mod, "measure_point", fake)
    run_dir = make_runner(matrix(tmp_path, attempts=4), tmp_path).run()
    run = load_run(run_dir)
    assert len(attempts_of(run_dir, "a@16")) == 4
    assert set(run.points.status) == {"noisy"} and set(run.points.attempts) == {4}
    assert all("ratio spread CV" in r for r in run.points.reason)


def test_persistent_spread_with_a_stable_median_stops_retrying(tmp_path, monkeypatch):
    fake, calls = fake_results(["spread"])
    monkeypatch.setattr(runner_mod, "measure_point", fake)
    run_dir = make_runner(matrix(tmp_path, attempts=4), tmp_path).run()
    assert [a["status"] for a in attempts_of(run_dir, "a@16")] == ["noisy", "noisy"]
    assert load_run(run_dir).points.set_index("point_id").loc["a@16"].status == "noisy"


def test_back_off_only_after_a_disturbed_window(tmp_path, monkeypatch):
    """A spread on a clean GPU is retried at once; a window with a load/clock reason waits backoff_s × attempt."""
    fake, _ = fake_results(["noisy"])
    monkeypatch.setattr(runner_mod, "measure_point", fake)
    m = matrix(tmp_path, attempts=3)
    m.cells = [dataclasses.replace(c, retry={**c.retry, "backoff_s": 5}) for c in m.cells[:1]]
    slept = []
    r = make_runner(m, tmp_path)
    r.sleep = slept.append
    r.run()
    assert slept == []                           # spread only: 3 attempts per point, no waiting
    real_verdict = runner_mod.verdict

    def disturbed(*a, **kw):
        status, reasons, msg = real_verdict(*a, **kw)
        return "noisy", reasons + ["foreign process 4242 (python) appeared"], msg

    monkeypatch.setattr(runner_mod, "verdict", disturbed)
    r = make_runner(m, tmp_path)
    r.sleep = slept.append
    r.run()
    assert slept == [5, 10] * 2                  # two points (a@16, a@32), attempts 1 and 2 back off


def test_power_cap_alone_is_steady_state_but_counts_with_a_clock_sag():
    from fakes import OWN_PID, FakeReader, gpu_state
    from test_clean_gpu import _monitor, _point, _result, _snap

    s = _snap(FakeReader([[gpu_state()]]))
    status, reasons, _ = runner_mod.verdict(_point(), _result(), s, s, _monitor(["sw_power_cap"]), CleanGpuCheck(), OWN_PID, "cuda")
    assert status == "clean"
    status, reasons, _ = runner_mod.verdict(_point(), _result(), s, s, _monitor(["sw_power_cap"], lo=1500), CleanGpuCheck(),
                                            OWN_PID, "cuda")
    assert status == "noisy" and any("sw_power_cap" in r for r in reasons) and any("sagged" in r for r in reasons)


def test_store_round_trip_and_snapshots_before_after(tmp_path, monkeypatch):
    fake, calls = fake_results(["clean"])
    monkeypatch.setattr(runner_mod, "measure_point", fake)
    run_dir = make_runner(matrix(tmp_path), tmp_path).run()
    run = load_run(run_dir)
    assert list(run.points.columns) == POINT_COLUMNS
    assert list(run.points.point_id) == ["a@16", "a@32", "b@24"]
    assert run.points.causal.tolist() == [False, False, True]
    assert run.manifest["device"] == "cpu" and run.manifest["finished_utc"] and run.manifest["matrix_sha256"]
    for key in ("torch", "triton", "python"):
        assert run.manifest["versions"][key]
    for a in run.attempts:
        for snap in (a["before"], a["after"]):
            assert snap["gpu"] is None and "cpu_pct" in snap["system"] and snap["system"]["ram_total_gb"] > 0
        assert a["ratio"]["samples"] == [0.5] * 4


def test_ctrl_c_leaves_a_resumable_run(tmp_path, monkeypatch):
    m = matrix(tmp_path)
    fake, calls = fake_results(["clean", "interrupt"])
    monkeypatch.setattr(runner_mod, "measure_point", fake)
    with pytest.raises(RunInterrupted) as exc:
        make_runner(m, tmp_path).run()
    run_dir = exc.value.run_dir
    run = load_run(run_dir)
    assert list(run.points.point_id) == ["a@16"] and run.manifest["interrupted"] is True
    fake2, calls2 = fake_results(["clean"])
    monkeypatch.setattr(runner_mod, "measure_point", fake2)
    assert make_runner(m, tmp_path).run(resume=run_dir) == run_dir
    assert calls2 == ["a@32", "b@24"]          # the finished point is not redone
    run = load_run(run_dir)
    assert list(run.points.point_id) == ["a@16", "a@32", "b@24"] and run.manifest["interrupted"] is False


def interrupted_run(tmp_path, monkeypatch):
    """A matrix and its run directory, interrupted after the first point."""
    m = matrix(tmp_path)
    fake, _ = fake_results(["clean", "interrupt"])
    monkeypatch.setattr(runner_mod, "measure_point", fake)
    with pytest.raises(RunInterrupted) as exc:
        make_runner(m, tmp_path).run()
    return m, exc.value.run_dir


def test_resume_refuses_a_changed_matrix_and_a_non_run_dir(tmp_path, monkeypatch):
    m, run_dir = interrupted_run(tmp_path, monkeypatch)
    changed = copy.deepcopy(m)
    changed.sha256 = "0" * 64
    changed.cells[0] = dataclasses.replace(changed.cells[0], timing={**changed.cells[0].timing, "min_reps": 99})
    with pytest.raises(RunDirError, match="changed since it started"):
        make_runner(changed, tmp_path).run(resume=run_dir)
    with pytest.raises(RunDirError, match="not a run directory"):
        make_runner(m, tmp_path).run(resume=tmp_path)


def test_resume_accepts_an_edit_outside_the_measured_cells(tmp_path, monkeypatch):
    """Another cell's (or a comment's) edit changes the file's hash but not what this run measures."""
    m, run_dir = interrupted_run(tmp_path, monkeypatch)
    edited = copy.deepcopy(m)
    edited.sha256 = "1" * 64
    fake2, calls2 = fake_results(["clean"])
    monkeypatch.setattr(runner_mod, "measure_point", fake2)
    assert make_runner(edited, tmp_path).run(resume=run_dir) == run_dir
    assert calls2 == ["a@32", "b@24"]


def test_torn_last_line_of_attempts_is_tolerated(tmp_path):
    store = RunStore.create(tmp_path, "x", {"matrix_sha256": "s"})
    store.append_attempt({"point_id": "a@1", "x": float("nan")})
    with open(store.path / "attempts.jsonl", "a") as fh:
        fh.write('{"point_id": "a@2", "tor')
    run = load_run(store.path)
    assert run.attempts == [{"point_id": "a@1", "x": None}]


def test_real_measurement_on_cpu_gives_finite_ratios(tmp_path):
    run_dir = make_runner(matrix(tmp_path, max_cv=10.0), tmp_path).run()
    pts = load_run(run_dir).points
    assert set(pts.status) == {"clean"}
    assert all(math.isfinite(x) and x > 0 for x in pts.lat_ratio)
    assert all(pts.lat_ratio_p10 <= pts.lat_ratio) and all(pts.lat_ratio <= pts.lat_ratio_p90)
    # each side's first call (outside the timed samples) is kept, and the report lists the cells' first ones
    for a in load_run(run_dir).attempts:
        assert a["kernel"]["first_call_ms"] > 0 and a["baseline"]["first_call_ms"] > 0
    from attnbench.report import first_call_table

    table = first_call_table([load_run(run_dir)])
    assert [line.split(" | ")[1] for line in table.splitlines()[2:]] == ["`a`", "`b`"]
    assert "flash: " in table and "(steady " in table


def cli(*args, cwd=REPO, env_extra=None):
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200")
    env.pop("TRITON_INTERPRET", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "attnbench", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=600)


def test_cli_end_to_end_smoke_matrix_on_cpu(tmp_path):
    proc = cli("run-matrix", str(SMOKE), "--device", "cpu", "--results-root", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run_dir,) = list(tmp_path.iterdir())
    pts = pd.read_csv(run_dir / "points.csv")
    assert len(pts) == len(load_matrix(SMOKE, device="cpu").points())
    assert pts.lat_ratio.notna().all() and (pts.lat_ratio > 0).all()
    assert json.loads((run_dir / "manifest.json").read_text())["device"] == "cpu"
    assert "summary" in proc.stdout


def test_cli_without_gpu_exits_3_in_one_line(tmp_path):
    proc = cli("run-matrix", str(SMOKE), "--results-root", str(tmp_path))
    if proc.returncode == 0:
        pytest.skip("this machine has a GPU")
    assert proc.returncode == 3
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "--device cpu" in lines[0] and "Traceback" not in proc.stderr


def test_cli_bad_resume_dir_exits_2(tmp_path):
    proc = cli("run-matrix", str(SMOKE), "--device", "cpu", "--resume", str(tmp_path))
    assert proc.returncode == 2 and "not a run directory" in proc.stderr and "Traceback" not in proc.stderr


def test_runs_lists_progress_and_the_command_that_finishes_a_run(tmp_path, monkeypatch):
    from attnbench.runs import run_progress

    m, run_dir = interrupted_run(tmp_path, monkeypatch)
    info = run_progress(load_run(run_dir))
    assert (info["measured"], info["planned"], info["state"]) == (1, 3, "interrupted")
    program = shlex.join([sys.executable, "-m", "attnbench"])   # how this (pytest) process would be resumed
    assert info["resume"] == f"{program} run-matrix {m.path} --resume {run_dir}"
    proc = cli("runs", str(run_dir.parent))
    assert proc.returncode == 0 and "1/3" in proc.stdout and "interrupted" in proc.stdout
    # a cell of the file edited: the run can no longer be resumed, and says so
    m.path.write_text(m.path.read_text().replace("seq_lens: [16, 32]", "seq_lens: [16, 48]"))
    info = run_progress(load_run(run_dir))
    assert info["planned"] is None and info["state"].startswith("unfinished, not resumable") and info["resume"] is None
    assert cli("runs", str(tmp_path / "nowhere")).returncode == 2
