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
from statistics import NormalDist

import pandas as pd
import pytest
from test_faults import assert_one_line
from test_faults import cli as run_cli      # the real entry point, in this process

from attnbench import runner as runner_mod
from attnbench.gpu import CleanGpuCheck
from attnbench.matrix import load_matrix
from attnbench.measure import NoisePolicy, PairResult, SideResult, median_ci_half_width
from attnbench.runner import Runner, RunInterrupted, RunOptions
from attnbench.store import POINT_COLUMNS, RunDirError, RunStore, load_run

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "matrices" / "smoke_cpu.yaml"


def matrix(tmp_path, attempts=4):
    text = f"""
defaults: {{batch: 1, heads: 2, head_dim: 32, timing: {{warmup_ms: 0, rep_ms: 1, min_reps: 3, max_reps: 3, flush_l2: false}},
           retry: {{max_attempts: {attempts}, backoff_s: 0}}}}
cells:
  - {{id: a, kernel: flash, baseline: math, dtype: float32, mode: fwd, seq_lens: [16, 32]}}
  - {{id: b, kernel: flash, baseline: math, dtype: float32, mode: fwdbwd, causal: true, seq_lens: [24]}}
"""
    p = tmp_path / "m.yaml"
    p.write_text(text)
    return load_matrix(p, device="cpu")


# a wide spread (CV 20 %, normal quantiles in a shuffled order), its median known to about ±2.5 % from 400 pairs
SPREAD_RATIOS = [0.5 * (1 + 0.2 * NormalDist().inv_cdf((i * 7919 % 400 + 0.5) / 400)) for i in range(400)]


def fake_results(script):
    """measure_point replacement: per call, 'clean' gives tight ratios, 'spread' widely spread ones (a launch-bound
    point in a clean window), 'interrupt' raises KeyboardInterrupt."""
    calls = []

    def measure_point(point, device, monitor=None, slowdown=None):
        kind = script[min(len(calls), len(script) - 1)]
        calls.append(point.id)
        if kind == "interrupt":
            raise KeyboardInterrupt
        ratios = SPREAD_RATIOS if kind == "spread" else [0.5, 0.5, 0.5, 0.5]
        k = SideResult(point.cell.kernel, samples_ms=[1.0] * len(ratios), flops=1e9)
        b = SideResult(point.cell.baseline, samples_ms=[2.0] * len(ratios), flops=1e9)
        return PairResult(k, b, list(ratios), timing_mode=point.timing_mode, reps=len(ratios),
                          stop="ci" if kind == "clean" else "budget", ci_half_width=median_ci_half_width(ratios),
                          loop_s=0.1)

    return measure_point, calls


def disturb(monkeypatch, script):
    """The noise policy sees the windows `script` names: a list of disturbance-reason lists, one per attempt."""
    seen = []

    def disturbances(self, *a, **kw):
        reasons = script[min(len(seen), len(script) - 1)]
        seen.append(reasons)
        return list(reasons)

    monkeypatch.setattr(NoisePolicy, "disturbances", disturbances)
    return seen


def make_runner(m, tmp_path, argv=(), slowdown=None, **kw):
    # the CPU load check is opened wide: other test processes may share this machine
    opts = RunOptions(device="cpu", results_root=tmp_path / "runs", snapshot_s=0,
                      clean_check=CleanGpuCheck(max_cpu_pct=1e9), argv=list(argv), slowdown=dict(slowdown or {}))
    return Runner(m, opts, reader=None, sleep=lambda s: None, **kw)


def attempts_of(run_dir, point_id):
    return [a for a in load_run(run_dir).attempts if a["point_id"] == point_id]


FOREIGN = ["foreign process during run: 4242"]


def test_disturbed_twice_then_clean_keeps_three_attempts_and_backs_off(tmp_path, monkeypatch):
    fake, calls = fake_results(["clean"])
    monkeypatch.setattr(runner_mod, "measure_point", fake)
    disturb(monkeypatch, [FOREIGN, FOREIGN, []])
    m = matrix(tmp_path)
    m.cells = [dataclasses.replace(m.cells[0], retry={**m.cells[0].retry, "backoff_s": 5}, seq_lens=(16,))]
    slept = []
    r = make_runner(m, tmp_path)
    r.sleep = slept.append
    run_dir = r.run()
    atts = attempts_of(run_dir, "a@16")
    assert [a["status"] for a in atts] == ["disturbed", "disturbed", "clean"]
    assert [a["attempt"] for a in atts] == [1, 2, 3]
    assert atts[0]["disturbed_reasons"] == FOREIGN and atts[2]["disturbed_reasons"] == []
    assert slept == [5, 10]                      # backoff_s × attempt after each disturbed window
    row = load_run(run_dir).points.set_index("point_id").loc["a@16"]
    assert row.status == "clean" and row.attempts == 3 and row.lat_ratio == pytest.approx(0.5)


def test_always_disturbed_ends_disturbed_after_max_attempts(tmp_path, monkeypatch):
    fake, calls = fake_results(["clean"])
    monkeypatch.setattr(runner_mod, "measure_point", fake)
    disturb(monkeypatch, [FOREIGN])
    run_dir = make_runner(matrix(tmp_path, attempts=4), tmp_path).run()
    run = load_run(run_dir)
    assert len(attempts_of(run_dir, "a@16")) == 4
    assert set(run.points.status) == {"disturbed"} and set(run.points.attempts) == {4}
    assert all("foreign process" in r for r in run.points.reason)


def test_spread_in_a_clean_window_is_measured_not_retried(tmp_path, monkeypatch):
    """A launch-bound point's spread is a property of the point: one attempt, clean, with its spread and CI."""
    fake, calls = fake_results(["spread"])
    monkeypatch.setattr(runner_mod, "measure_point", fake)
    disturb(monkeypatch, [[]])
    run_dir = make_runner(matrix(tmp_path, attempts=4), tmp_path).run()
    assert calls == ["a@16", "a@32", "b@24"]
    row = load_run(run_dir).points.set_index("point_id").loc["a@16"]
    assert row.status == "clean" and row.attempts == 1 and pd.isna(row.reason)
    assert row.spread == pytest.approx(0.2, rel=0.05)
    assert row.ci_half_width == pytest.approx(median_ci_half_width(SPREAD_RATIOS), rel=1e-4)
    assert 0.02 < row.ci_half_width < 0.03
    assert row.lat_ratio_ci_low < row.lat_ratio < row.lat_ratio_ci_high and row.timing == "eager"
    (a,) = attempts_of(run_dir, "a@16")
    assert a["sampling"]["stop"] == "budget" and a["sampling"]["reps"] == 400
    assert a["sampling"]["target_ci_half_width"] == 0.015


def test_power_cap_alone_is_steady_state_but_counts_with_a_clock_sag():
    from fakes import OWN_PID, FakeReader, gpu_state
    from test_clean_gpu import POLICY, _monitor, _result, _snap

    s = _snap(FakeReader([[gpu_state()]]))
    status, reasons, _ = POLICY.verdict(_result(), s, s, _monitor(["sw_power_cap"]), CleanGpuCheck(), OWN_PID, "cuda")
    assert status == "clean"
    status, reasons, _ = POLICY.verdict(_result(), s, s, _monitor(["sw_power_cap"], lo=1500), CleanGpuCheck(), OWN_PID, "cuda")
    assert status == "disturbed" and any("sw_power_cap" in r for r in reasons) and any("sagged" in r for r in reasons)


def test_store_round_trip_and_snapshots_before_after(tmp_path, monkeypatch):
    fake, calls = fake_results(["clean"])
    monkeypatch.setattr(runner_mod, "measure_point", fake)
    monkeypatch.setenv("ATTNBENCH_TRACED_LAUNCHES", "0")             # a kernel switch: the manifest names it
    monkeypatch.setenv("ATTNBENCH_GIT_COMMIT", "abc123")              # provenance, recorded as git_commit instead
    run_dir = make_runner(matrix(tmp_path), tmp_path).run()
    run = load_run(run_dir)
    assert run.manifest["kernel_switches"] == {"ATTNBENCH_TRACED_LAUNCHES": "0"}
    assert run.manifest["git_commit"] == "abc123"
    assert list(run.points.columns) == POINT_COLUMNS
    assert list(run.points.point_id) == ["a@16", "a@32", "b@24"]
    assert run.points.causal.tolist() == [False, False, True]
    assert run.manifest["device"] == "cpu" and run.manifest["finished_utc"] and run.manifest["matrix_sha256"]
    for key in ("torch", "triton", "python"):
        assert run.manifest["versions"][key]
    for a in run.attempts:
        for snap in (a["before"], a["after"]):
            assert snap["gpu"] is None and "cpu_pct" in snap["system"] and snap["system"]["ram_total_gb"] > 0
        assert a["ratio"]["samples"] == [0.5] * 4 and a["timing_mode"] == "eager"


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
    changed.cells[0] = dataclasses.replace(changed.cells[0], timing={**changed.cells[0].timing, "flush_l2": True})
    with pytest.raises(RunDirError, match="changed since it started"):
        make_runner(changed, tmp_path).run(resume=run_dir)
    with pytest.raises(RunDirError, match="not a run directory"):
        make_runner(m, tmp_path).run(resume=tmp_path)


def test_resume_with_another_matrix_names_the_runs_own(tmp_path, monkeypatch):
    """A run resumed with another matrix file is refused naming the file and matrix it was started with (not "the
    cells of the other file changed"), with the command that finishes it."""
    m, run_dir = interrupted_run(tmp_path, monkeypatch)
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    (other_dir / "n.yaml").write_text(m.path.read_text().replace("seq_lens: [16, 32]", "seq_lens: [64]"))
    with pytest.raises(RunDirError) as refused:
        make_runner(load_matrix(other_dir / "n.yaml", device="cpu"), tmp_path).run(resume=run_dir)
    assert str(refused.value).startswith(f"{run_dir}: started with {m.path} (matrix 'm'), resumed with "
                                         f"{other_dir / 'n.yaml'} (matrix 'n'); finish it with: ")
    assert str(refused.value).endswith(f" run-matrix {m.path} --resume {run_dir}")


def test_resume_accepts_a_change_of_the_sampling_policy(tmp_path, monkeypatch):
    """How precisely points are sampled and how disturbed windows are retried is not what a run measures."""
    m, run_dir = interrupted_run(tmp_path, monkeypatch)
    tuned = copy.deepcopy(m)
    tuned.sha256 = "2" * 64
    tuned.cells = [dataclasses.replace(c, timing={**c.timing, "min_reps": 99, "ci_half_width": 0.005},
                                       retry={**c.retry, "max_attempts": 1}) for c in tuned.cells]
    fake2, calls2 = fake_results(["clean"])
    monkeypatch.setattr(runner_mod, "measure_point", fake2)
    assert make_runner(tuned, tmp_path).run(resume=run_dir) == run_dir
    assert calls2 == ["a@32", "b@24"]


def test_resume_accepts_an_edit_outside_the_measured_cells(tmp_path, monkeypatch):
    """Another cell's (or a comment's) edit changes the file's hash but not what this run measures."""
    m, run_dir = interrupted_run(tmp_path, monkeypatch)
    edited = copy.deepcopy(m)
    edited.sha256 = "1" * 64
    fake2, calls2 = fake_results(["clean"])
    monkeypatch.setattr(runner_mod, "measure_point", fake2)
    assert make_runner(edited, tmp_path).run(resume=run_dir) == run_dir
    assert calls2 == ["a@32", "b@24"]


def test_resume_keeps_the_selection_the_run_was_started_with(tmp_path, monkeypatch):
    """A run of the file's cell `a` (--only a), resumed with the whole file or another cell's selection, would
    measure cells it was never meant to hold (the file's hash matches either way): refused in one line that gives
    the command finishing it. Its own selection, or a glob that selects the same cells, resumes it."""
    fake, _ = fake_results(["clean", "interrupt"])
    monkeypatch.setattr(runner_mod, "measure_point", fake)
    path = matrix(tmp_path).path
    with pytest.raises(RunInterrupted) as exc:
        make_runner(matrix(tmp_path).select("a"), tmp_path, argv=["run-matrix", str(path), "--only", "a"]).run()
    run_dir = exc.value.run_dir
    fake2, calls2 = fake_results(["clean"])
    monkeypatch.setattr(runner_mod, "measure_point", fake2)
    for other, said in ((matrix(tmp_path), "every cell"), (matrix(tmp_path).select("b"), "--only 'b'")):
        with pytest.raises(RunDirError) as refused:
            make_runner(other, tmp_path).run(resume=run_dir)
        assert str(refused.value) == (f"{run_dir}: started with --only 'a', resumed with {said}; finish it with: "
                                      f"{shlex.join([sys.executable, '-m', 'attnbench'])} run-matrix {path} --only a "
                                      f"--resume {run_dir}")
    assert calls2 == [] and list(load_run(run_dir).points.point_id) == ["a@16"]
    assert make_runner(matrix(tmp_path).select("[a]"), tmp_path).run(resume=run_dir) == run_dir
    assert calls2 == ["a@32"] and list(load_run(run_dir).points.point_id) == ["a@16", "a@32"]


def test_resume_keeps_the_slowdown_the_run_was_planted_with(tmp_path, monkeypatch):
    """A gate-proof run (--slowdown flash=1.15) resumed without it, or with another factor, would hold slowed and
    unslowed points under one manifest: refused in one line that gives the command finishing it; with its own
    slowdown it resumes, planting it in what is left."""
    fake, _ = fake_results(["clean", "interrupt"])
    monkeypatch.setattr(runner_mod, "measure_point", fake)
    m = matrix(tmp_path)
    argv = ["run-matrix", str(m.path), "--slowdown", "flash=1.15"]
    with pytest.raises(RunInterrupted) as exc:
        make_runner(m, tmp_path, argv=argv, slowdown={"flash": 1.15}).run()
    run_dir = exc.value.run_dir
    planted = []
    fake2, calls2 = fake_results(["clean"])

    def measure(point, device, monitor=None, slowdown=None):
        planted.append(slowdown)
        return fake2(point, device)

    monkeypatch.setattr(runner_mod, "measure_point", measure)
    program = shlex.join([sys.executable, "-m", "attnbench"])
    hint = f"{program} run-matrix {m.path} --slowdown flash=1.15 --resume {run_dir}"
    for other, said in (({}, "no --slowdown"), ({"flash": 1.2}, "--slowdown flash=1.2")):
        with pytest.raises(RunDirError) as refused:
            make_runner(m, tmp_path, slowdown=other).run(resume=run_dir)
        assert str(refused.value) == (f"{run_dir}: started with --slowdown flash=1.15, resumed with {said}; "
                                      f"finish it with: {hint}")
    assert calls2 == []
    assert make_runner(m, tmp_path, slowdown={"flash": 1.15}).run(resume=run_dir) == run_dir
    assert calls2 == ["a@32", "b@24"] and planted == [{"flash": 1.15}] * 2


def test_resume_keeps_the_kernel_switches_the_run_was_started_with(tmp_path, monkeypatch):
    """A run made with ATTNBENCH_TRACED_LAUNCHES=0 resumed without it (or with another value) would measure two code
    paths under one manifest: refused in one line naming both sets and the command that finishes it (the switch
    set again, as the resume hint always gives it); with them as they were it resumes."""
    monkeypatch.setenv("ATTNBENCH_TRACED_LAUNCHES", "0")
    m, run_dir = interrupted_run(tmp_path, monkeypatch)
    fake2, calls2 = fake_results(["clean"])
    monkeypatch.setattr(runner_mod, "measure_point", fake2)
    monkeypatch.delenv("ATTNBENCH_TRACED_LAUNCHES")
    hint = f"ATTNBENCH_TRACED_LAUNCHES=0 {shlex.join([sys.executable, '-m', 'attnbench'])} run-matrix {m.path} " \
           f"--resume {run_dir}"
    for now, said in ((None, "none"), ("1", "ATTNBENCH_TRACED_LAUNCHES=1")):
        if now is not None:
            monkeypatch.setenv("ATTNBENCH_TRACED_LAUNCHES", now)
        with pytest.raises(RunDirError) as refused:
            make_runner(m, tmp_path).run(resume=run_dir)
        assert str(refused.value) == (f"{run_dir}: started with the kernel switches ATTNBENCH_TRACED_LAUNCHES=0, "
                                      f"resumed with {said} (its points would measure two code paths); finish it "
                                      f"with: {hint}")
    assert calls2 == []
    monkeypatch.setenv("ATTNBENCH_TRACED_LAUNCHES", "0")
    assert make_runner(m, tmp_path).run(resume=run_dir) == run_dir and calls2 == ["a@32", "b@24"]


def test_torn_last_line_of_attempts_is_tolerated(tmp_path):
    store = RunStore.create(tmp_path, "x", {"matrix_sha256": "s"})
    store.append_attempt({"point_id": "a@1", "x": float("nan")})
    with open(store.path / "attempts.jsonl", "a") as fh:
        fh.write('{"point_id": "a@2", "tor')
    run = load_run(store.path)
    assert run.attempts == [{"point_id": "a@1", "x": None}]


def test_real_measurement_on_cpu_gives_finite_ratios(tmp_path):
    run_dir = make_runner(matrix(tmp_path), tmp_path).run()
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
    env = dict(os.environ, COLUMNS="200")       # PYTHONPATH: this checkout first (conftest.py)
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
    # no GPU for this process on any machine: CUDA_VISIBLE_DEVICES hides them from torch (NVML still sees them); a
    # matrix a GPU can run (the file is checked first: smoke_cpu.yaml's float32 flash cell is refused for cuda)
    proc = cli("run-matrix", str(REPO / "matrices" / "nightly.yaml"), "--results-root", str(tmp_path),
               env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 3
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "--device cpu" in lines[0] and "Traceback" not in proc.stderr


def test_cli_bad_resume_dir_exits_2(tmp_path, capsys):
    assert_one_line(run_cli(capsys, "run-matrix", SMOKE, "--device", "cpu", "--resume", tmp_path), 2,
                    "not a run directory")


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


# --- timing modes and planted slowdowns through the runner ------------------------------------------------

class _CpuGraphStandIn:
    """Graph mode on a CPU for the plumbing: the CPU clock, with every capture counted."""

    def __init__(self, captures):
        from attnbench.measure.timer import CpuTimer

        self._cpu, self.captures, self.mode, self.device = CpuTimer(), captures, "graph", "cpu"

    def arm(self, body):
        self.captures.append(body)
        return body

    def __getattr__(self, name):
        return getattr(self._cpu, name)


def test_timing_mode_both_measures_and_labels_each_point_twice(tmp_path, monkeypatch):
    from attnbench.measure import pair as pair_mod
    from attnbench.measure.timer import make_timer
    from attnbench.report import build_report

    from attnbench import runner as runner_mod

    captures = []
    monkeypatch.setattr(pair_mod, "make_timer",
                        lambda device, mode="eager": _CpuGraphStandIn(captures) if mode == "graph" else make_timer(device))
    # on the CPU the runner records graph points as skipped (CUDA graphs need a GPU): the stand-in times them here
    monkeypatch.setattr(runner_mod, "_skip_reason", lambda point, device: None)
    m = matrix(tmp_path)
    m.cells = [dataclasses.replace(m.cells[0], timing={**m.cells[0].timing, "mode": "both"})]
    run_dir = make_runner(m, tmp_path).run()
    run = load_run(run_dir)
    assert list(run.points.point_id) == ["a@16", "a@16:graph", "a@32", "a@32:graph"]
    assert list(run.points.timing) == ["eager", "graph", "eager", "graph"]
    assert set(run.points.status) == {"clean"} and len(captures) == 4      # two points × two sides captured
    assert [a["timing_mode"] for a in run.attempts] == ["eager", "graph", "eager", "graph"]
    text = build_report([run_dir], tmp_path / "R.md", plots=False).read_text()
    assert "fp32 fwd · B1 H2 D32 · graph" in text and "| `a` | 16 graph | clean |" in text
    assert "(plots/CPU/a_graph.png)" in text


def test_planted_slowdown_is_caught_by_the_gate_at_every_length(tmp_path, monkeypatch):
    """--slowdown flash=1.15 through the runner, the store and the gate: every point SLOWER, a plain rerun SAME.
    The device is the fake one of test_measure (workloads draw 1.5 ms ± 10 % durations, the planted delay adds to
    them), so the verdicts are exact."""
    from attnbench.gate import compare_runs
    from attnbench.measure import pair as pair_mod
    from test_measure import FakeClock, FakeDelay, FakeTimer, fake_workload

    timer, clock = FakeTimer(), FakeClock()
    FakeDelay.timer = timer
    monkeypatch.setattr(pair_mod, "Delay", FakeDelay)
    monkeypatch.setattr(pair_mod, "make_timer", lambda device, mode="eager": timer)
    seeds = iter(range(1000))
    monkeypatch.setattr(runner_mod, "_make_workload",
                        lambda point, slot, device: fake_workload(timer, clock, 1.5, 0.1, next(seeds)))
    m = matrix(tmp_path)
    m.cells = [dataclasses.replace(c, timing={**c.timing, "max_reps": 10_000, "max_ms": 60_000}) for c in m.cells]

    def run(**opts):
        o = RunOptions(device="cpu", results_root=tmp_path / "runs", snapshot_s=0, clean_check=CleanGpuCheck(max_cpu_pct=1e9), **opts)
        return Runner(m, o, reader=None, sleep=lambda s: None).run()

    base, slowed, again = run(), run(slowdown={"flash": 1.15}), run()
    assert load_run(slowed).manifest["injected_slowdown"] == {"flash": 1.15}
    rows = compare_runs(base, slowed)
    assert {r.point_id: r.verdict for r in rows} == {"a@16": "SLOWER", "a@32": "SLOWER", "b@24": "SLOWER"}
    # each run's median ratio is known to +-1.5 % (the stopping rule's half-width): their quotient to about +-3 %
    assert all(r.change == pytest.approx(1.15, abs=0.035) for r in rows)
    assert {r.verdict for r in compare_runs(base, again)} == {"SAME"}
    assert all(a["kernel"]["delay_ms"] == pytest.approx(0.15 * 1.5, rel=0.15) for a in load_run(slowed).attempts)
    assert all(a["sampling"]["stop"] == "ci" for a in load_run(slowed).attempts)


@pytest.mark.parametrize("item, expected", [
    ("elsa=1.15", "'elsa' is not measured by"),
    ("flash=1.0", "finite number > 1"),
    ("flash=0.5", "finite number > 1"),
    ("flash=inf", "finite number > 1"),
    ("flash=fast", "finite number > 1"),
    ("flash", "expected BACKEND=FACTOR"),
])
def test_cli_slowdown_is_validated_in_one_line(tmp_path, capsys, item, expected):
    result = run_cli(capsys, "run-matrix", SMOKE, "--device", "cpu", "--results-root", tmp_path, "--slowdown", item)
    assert_one_line(result, 2, expected)
    assert not list(tmp_path.iterdir())
