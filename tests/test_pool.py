"""run-matrix with several workers (attnbench.pool), on the CPU through the real CLI: `--workers 2` end to end,
`--replicate` and the report's cross-device spread (checked against a hand computation on the stored rows), a
worker killed mid-run and the resume that measures only what is missing, Ctrl-C to the process group, a second
resume refused while the pool holds the run, bad --gpus / --workers values, and records appended by two processes
at once. `-m gpu`: `--gpus all` on the GPUs of a CUDA machine.
"""
from __future__ import annotations

import csv
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnbench import cli as cli_mod
from attnbench.analysis import spread_pct
from attnbench.gpu import GpuListError, resolve_gpu_list
from attnbench.store import TORN_FILE, RunDirError, RunStore, load_run
from fakes import FakeReader, gpu_state
from test_faults import REPO, TINY, _env, assert_one_line, cli, cli_process, data_lines, sigint_default

IDS = ["a@16", "a@32", "a@48"]
LONG = TINY.replace("seq_lens: [16, 32, 48]", f"seq_lens: {list(range(16, 28))}")   # 12 points
LONG_IDS = [f"a@{n}" for n in range(16, 28)]
MID = TINY.replace("seq_lens: [16, 32, 48]", f"seq_lens: {list(range(16, 23))}")     # 7 points
MID_IDS = [f"a@{n}" for n in range(16, 23)]


def _start(root: Path, *args):
    """`attnbench run-matrix tiny.yaml --device cpu --results-root runs ARGS` in `root`: (the run directory, the
    result)."""
    (root / "tiny.yaml").write_text(TINY)
    result = cli_process("run-matrix", "tiny.yaml", "--device", "cpu", "--results-root", "runs", *args, cwd=root)
    assert result.code == 0, result.err[-3000:]
    assert "Traceback" not in result.err
    (run_dir,) = (root / "runs").iterdir()
    return run_dir, result


@pytest.fixture(scope="module")
def pooled(tmp_path_factory):
    return _start(tmp_path_factory.mktemp("pooled"), "--workers", "2")


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    return _start(tmp_path_factory.mktemp("replicated"), "--workers", "2", "--replicate")


def _rows(run: Path) -> list[dict]:
    with open(run / "points.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def _attempts(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines() if line.strip()]


# -- --workers 2 -------------------------------------------------------------------------------------------------

def test_two_workers_measure_every_point_once_each_stamped(pooled, capsys, tmp_path):
    run, result = pooled
    rows = _rows(run)
    assert sorted(r["point_id"] for r in rows) == IDS
    manifest = json.loads((run / "manifest.json").read_text())
    pool = manifest["pool"]
    assert (pool["gpus"], pool["workers"], pool["replicate"]) == (None, 2, False)
    pids = {d["label"]: d["pid"] for d in pool["devices"]}
    assert sorted(pids) == ["cpu:0", "cpu:1"] and len(set(pids.values())) == 2
    assert manifest["finished_utc"] and not manifest["interrupted"]
    assert manifest["argv"][-2:] == ["--workers", "2"] and manifest["device"] == "cpu"
    final = {}
    for a in _attempts(run):
        assert a["ran_on"]["label"] in pids and a["ran_on"]["pid"] == pids[a["ran_on"]["label"]]
        final[a["point_id"]] = a["ran_on"]["label"]
    for r in rows:
        assert r["ran_on"] == final[r["point_id"]] and r["ran_on_uuid"] == ""
        # the log names the worker of every point
        assert f"[{r['ran_on']}] {r['point_id']}: {r['status']} lat_ratio" in result.err
    assert not (run / ".lock").exists()
    # read back by runs, report and gate like any run
    listed = cli(capsys, "runs", run.parent)
    assert listed.code == 0 and "3/3" in listed.out and "complete" in listed.out
    assert cli(capsys, "report", run, "--no-plots", "--out", tmp_path / "r.md").code == 0
    text = (tmp_path / "r.md").read_text()
    assert "| cpu, 2 workers |" in text and "| CPU, 2 workers |" in text and "Cross-device spread" not in text
    baseline = tmp_path / "baseline"           # the same run under its own name: a run is not gated against itself
    shutil.copytree(run, baseline)
    gated = cli(capsys, "gate", "--baseline", baseline, "--current", run, "--out", tmp_path / "g.md")
    assert gated.code == 0 and "**Gate: PASS**" in gated.out


# -- --replicate --------------------------------------------------------------------------------------------------

def test_spread_is_max_minus_min_over_the_median():
    assert spread_pct([1.1, 1.5, 1.0]) == pytest.approx(0.5 / 1.1 * 100)   # median 1.1 (the mean 1.2 would give 41.7)
    assert spread_pct([0.9, 1.1]) == pytest.approx(0.2 / 1.0 * 100)
    assert spread_pct([2.0, 2.0]) == 0.0


def test_replicate_measures_every_point_on_every_worker(replicated, capsys):
    run, _ = replicated
    pairs = sorted((r["point_id"], r["ran_on"]) for r in _rows(run))
    assert pairs == sorted((p, d) for p in IDS for d in ("cpu:0", "cpu:1"))
    listed = cli(capsys, "runs", run.parent)
    assert listed.code == 0 and "6/6" in listed.out and "complete" in listed.out


def test_report_shows_the_cross_device_spread_of_the_stored_medians(replicated, tmp_path, capsys):
    run, _ = replicated
    assert cli(capsys, "report", run, "--no-plots", "--out", tmp_path / "r.md").code == 0
    text = (tmp_path / "r.md").read_text()
    section = text.split("## Cross-device spread (--replicate)")[1].split("\n## ")[0]
    assert "(max − min) / median of the per-device medians" in section
    table = {line.split(" | ")[0].strip("| `"): line.strip("|").split(" | ")
             for line in section.splitlines() if line.startswith("| `")}
    assert sorted(table) == IDS
    by_point: dict[str, dict[str, dict]] = {}
    for r in _rows(run):
        by_point.setdefault(r["point_id"], {})[r["ran_on"]] = r
    spreads = {}
    for point, replicas in by_point.items():
        # by hand, from the strings in points.csv
        ratios = [float(replicas[d]["lat_ratio"]) for d in ("cpu:0", "cpu:1")]
        times = [float(replicas[d]["kernel_ms"]) for d in ("cpu:0", "cpu:1")]
        lat_spread = (max(ratios) - min(ratios)) / ((ratios[0] + ratios[1]) / 2) * 100
        ms_spread = (max(times) - min(times)) / ((times[0] + times[1]) / 2) * 100
        cells = [c.strip() for c in table[point]]
        assert cells[1] == f"cpu:0 {ratios[0]:.4f} · cpu:1 {ratios[1]:.4f}"
        assert cells[2] == f"{lat_spread:.2f} %"
        assert cells[4] == f"{ms_spread:.2f} %"
        statuses = {replicas[d]["status"] for d in replicas}
        assert (cells[5] == "clean") == (statuses == {"clean"})
        if statuses == {"clean"}:
            spreads[point] = lat_spread
    summary = next(line for line in section.splitlines() if line.startswith(f"`{run.name}`"))
    assert f"{len(spreads)} clean on every device" in summary
    if spreads:
        worst = max(spreads, key=lambda p: (spreads[p], [-ord(c) for c in p]))
        assert f"max {spreads[worst]:.2f} % (`{worst}`), median {statistics.median(spreads.values()):.2f} %" in summary


def test_gate_refuses_a_replicated_run(replicated, capsys, tmp_path, pooled):
    run, _ = replicated
    for args in (["--baseline", pooled[0], "--current", run], ["--baseline", run, "--current", pooled[0]]):
        assert_one_line(cli(capsys, "gate", *args, "--out", tmp_path / "g.md"), 2, str(run), "--replicate")
    assert_one_line(cli(capsys, "gate", "--bless", run, "--baselines-root", tmp_path / "b"), 2, str(run), "--replicate")


def test_resume_measures_exactly_the_missing_replicas(replicated, tmp_path, capsys):
    src, _ = replicated
    run = tmp_path / "runs" / src.name
    shutil.copytree(src, run)
    (tmp_path / "tiny.yaml").write_text(TINY)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest.update(finished_utc=None)
    (run / "manifest.json").write_text(json.dumps(manifest))
    lines = (run / "points.csv").read_bytes().splitlines(keepends=True)
    lost = {("a@32", "cpu:1"), ("a@48", "cpu:0")}
    header = next(csv.reader([lines[0].decode()]))
    at = header.index("point_id"), header.index("ran_on")
    kept = [line for line in lines[1:] if tuple(next(csv.reader([line.decode()]))[i] for i in at) not in lost]
    assert len(kept) == 4
    (run / "points.csv").write_bytes(lines[0] + b"".join(kept))
    before = len(_attempts(run))
    # the same layout is needed: without --replicate (or with it on a run started without) it is one line, exit 2
    args = ["run-matrix", tmp_path / "tiny.yaml", "--device", "cpu", "--resume", run]
    assert_one_line(cli(capsys, *args), 2, str(run), "--replicate")
    assert_one_line(cli(capsys, *args, "--workers", "2"), 2, str(run), "--replicate")
    done = cli_process(*args, "--workers", "2", "--replicate")
    assert done.code == 0, done.err[-3000:]
    new = {(a["point_id"], a["ran_on"]["label"]) for a in _attempts(run)[before:]}
    assert new == lost
    assert data_lines(run / "points.csv")[:4] == kept
    assert sorted((r["point_id"], r["ran_on"]) for r in _rows(run)) == sorted((p, d) for p in IDS
                                                                               for d in ("cpu:0", "cpu:1"))
    assert json.loads((run / "manifest.json").read_text())["finished_utc"]
    pooled_run = tmp_path / "runs2"
    shutil.copytree(src.parent, pooled_run)
    for name in ("manifest.json",):
        m = json.loads((pooled_run / src.name / name).read_text())
        m["pool"]["replicate"] = False
        (pooled_run / src.name / name).write_text(json.dumps(m))
    assert_one_line(cli(capsys, "run-matrix", tmp_path / "tiny.yaml", "--device", "cpu", "--workers", "2",
                        "--replicate", "--resume", pooled_run / src.name), 2, "without --replicate")


# -- a worker dies; Ctrl-C; the lock ------------------------------------------------------------------------------

def _popen(work: Path, args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "attnbench", *args], cwd=work, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _wait_for_rows(work: Path, proc, rows: int, workers: int = 2) -> Path:
    """The run directory, once it holds `rows` points and every worker has reported its pid."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        for points in work.glob("*/*/points.csv"):
            try:
                devices = json.loads((points.parent / "manifest.json").read_text())["pool"]["devices"]
            except (ValueError, KeyError):
                continue
            if len(points.read_bytes().splitlines()) > rows and sum("pid" in d for d in devices) == workers:
                return points.parent
        time.sleep(0.05)
    out, err = proc.communicate(timeout=60)
    pytest.fail(f"the run never stored {rows} points: {err[-3000:]}")


def test_a_killed_worker_leaves_a_resumable_run_and_resume_measures_only_the_missing(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "long.yaml").write_text(LONG)
    args = ["run-matrix", "long.yaml", "--device", "cpu", "--results-root", "runs", "--workers", "2"]
    proc = _popen(work, args)
    run = _wait_for_rows(work, proc, 2)
    # while the pool holds the run, a second resume would be refused, naming the parent and its workers (the CLI's
    # one line for a held lock: test_faults)
    with pytest.raises(RunDirError, match=rf"pid {proc.pid} \(workers \d+, \d+\)"):
        RunStore(run).lock()
    victim = next(d for d in json.loads((run / "manifest.json").read_text())["pool"]["devices"]
                  if d["label"] == "cpu:1")
    os.kill(victim["pid"], signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert "Traceback" not in err
    assert f"worker cpu:1 (pid {victim['pid']}) died with exit code -9" in err
    stored = {r["point_id"] for r in _rows(run)}
    if stored == set(LONG_IDS):   # killed between two points (it held none): cpu:0 measured the rest, the run is complete
        assert proc.returncode == 0, err[-3000:]
        pytest.skip("the worker died between two points, holding none: the run completed, so no resume to check")
    assert proc.returncode == 5, err[-3000:]
    hint = err.strip().splitlines()[-1]
    assert shlex.split(hint) == [sys.executable, "-m", "attnbench", *args, "--resume", f"runs/{run.name}"]
    rows = data_lines(run / "points.csv")
    stored = {line.decode().split(",")[0] for line in rows}
    missing = set(LONG_IDS) - stored
    before = len(_attempts(run))
    assert load_run(run).manifest["interrupted"] and not load_run(run).manifest["finished_utc"]
    pasted = subprocess.run(hint, shell=True, cwd=work, env=_env(), capture_output=True, text=True, timeout=300)
    assert pasted.returncode == 0, pasted.stderr[-3000:]
    assert {a["point_id"] for a in _attempts(run)[before:]} == missing
    assert data_lines(run / "points.csv")[: len(rows)] == rows
    assert sorted(r["point_id"] for r in _rows(run)) == sorted(LONG_IDS)
    for record in ((run / TORN_FILE).read_text().splitlines() if (run / TORN_FILE).exists() else []):
        assert json.loads(record)["file"] in ("points.csv", "attempts.jsonl")   # a record the kill tore, kept


def test_ctrl_c_stops_every_worker_and_the_hint_finishes_the_run(tmp_path):
    import psutil

    work = tmp_path / "work"
    work.mkdir()
    (work / "mid.yaml").write_text(MID)
    args = ["run-matrix", "mid.yaml", "--device", "cpu", "--results-root", "my runs", "--workers", "2",
            "--replicate"]
    # its own process group, as a terminal's Ctrl-C reaches it, with SIGINT at its default (test_faults.sigint_default)
    proc = _popen(work, args, start_new_session=True, preexec_fn=sigint_default)
    run = _wait_for_rows(work, proc, 2)
    pids = [d["pid"] for d in json.loads((run / "manifest.json").read_text())["pool"]["devices"]]
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "interrupted" in err
    hint = err.strip().splitlines()[-1]
    assert shlex.split(hint) == [sys.executable, "-m", "attnbench", *args, "--resume", f"my runs/{run.name}"]
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)
    assert not (run / ".lock").exists() and load_run(run).manifest["interrupted"]
    rows = data_lines(run / "points.csv")
    assert 2 <= len(rows) < 14
    pasted = subprocess.run(hint, shell=True, cwd=work, env=_env(), capture_output=True, text=True, timeout=300)
    assert pasted.returncode == 0, pasted.stderr[-3000:]
    assert data_lines(run / "points.csv")[: len(rows)] == rows
    assert sorted((r["point_id"], r["ran_on"]) for r in _rows(run)) == sorted(
        (p, d) for p in MID_IDS for d in ("cpu:0", "cpu:1"))


FULL_DISK = """
import errno, os
_write = os.write

def write(fd, data):   # every process of the pool (the spawned workers import this too): attempts.jsonl is full
    try:
        full = os.readlink(f"/proc/self/fd/{fd}").endswith("attempts.jsonl")
    except OSError:
        full = False
    if full:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _write(fd, data)

os.write = write
"""


def test_a_full_disk_stops_the_pool_as_a_single_run(tmp_path):
    """The workers cannot append (ENOSPC, simulated in every process through a sitecustomize): each is named with
    the file and the OS error, and the run ends as a single process's would: one error line, the command that
    finishes it (with --workers), exit 6, the manifest interrupted; the command finishes it once there is room."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FULL_DISK)
    work = tmp_path / "work"
    work.mkdir()
    (work / "tiny.yaml").write_text(TINY)
    args = ["run-matrix", "tiny.yaml", "--device", "cpu", "--results-root", "runs", "--workers", "2"]
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(site), os.environ["PYTHONPATH"]])}
    full = subprocess.run([sys.executable, "-m", "attnbench", *args], cwd=work, env=env, capture_output=True,
                          text=True, timeout=300)
    (run,) = (work / "runs").iterdir()
    assert full.returncode == 6 and "Traceback" not in full.stderr, full.stderr[-3000:]
    lines = full.stderr.strip().splitlines()
    failed = f"runs/{run.name}/attempts.jsonl: cannot write (No space left on device)"
    assert sum(line.startswith("worker cpu:") and line.endswith(failed) for line in lines) == 2, lines
    (error,) = [line for line in lines if line.startswith("error:")]
    assert error.startswith(f"error: {failed}; everything measured is kept in runs/{run.name}")
    assert shlex.split(lines[-1]) == [sys.executable, "-m", "attnbench", *args, "--resume", f"runs/{run.name}"]
    assert load_run(run).manifest["interrupted"] and (run / "attempts.jsonl").read_bytes() == b""
    pasted = subprocess.run(lines[-1], shell=True, cwd=work, env=_env(), capture_output=True, text=True, timeout=300)
    assert pasted.returncode == 0, pasted.stderr[-3000:]
    assert sorted(r["point_id"] for r in _rows(run)) == IDS


def test_a_set_aside_record_never_glues_onto_a_torn_one(tmp_path):
    """torn_records.jsonl is appended to as the run's logs are: a record a writer died in the middle of is kept as
    a line of its own, and the next one set aside starts on a new line."""
    run = tmp_path / "run"
    run.mkdir()
    torn_aside = '{"file": "attempts.jsonl", "set_aside_utc": "2026-12-01T00:00:00Z", "text": "{\\"po'
    (run / TORN_FILE).write_text(torn_aside)
    (run / "attempts.jsonl").write_text('{"point_id": "a@16"}\n{"point_id": "a@3')
    RunStore(run).append_attempt({"point_id": "a@48"})
    lines = (run / TORN_FILE).read_text().splitlines()
    assert lines[0] == torn_aside and json.loads(lines[1])["text"] == '{"point_id": "a@3'
    assert [json.loads(line)["point_id"] for line in (run / "attempts.jsonl").read_text().splitlines()] == \
        ["a@16", "a@48"]


# -- bad options --------------------------------------------------------------------------------------------------

BAD_OPTIONS = {
    # id: (options, what the one line names)
    "gpus-on-cpu": (["--device", "cpu", "--gpus", "0"], ["--gpus", "--workers"]),
    "workers-on-cuda": (["--workers", "2"], ["--workers is for --device cpu", "--gpus"]),
    "workers-0": (["--device", "cpu", "--workers", "0"], ["--workers 0"]),
    "workers-too-many": (["--device", "cpu", "--workers", "65"], ["--workers 65"]),
    "workers-not-a-number": (["--device", "cpu", "--workers", "two"], ["--workers", "'two'", "valid int"]),
    "gpus-not-an-index": (["--gpus", "0,x"], ["--gpus '0,x'", "'x' is not a GPU index"]),
    "gpus-negative": (["--gpus", "-1"], ["--gpus '-1'", "'-1' is not a GPU index"]),
    "gpus-twice": (["--gpus", "0,1,0"], ["--gpus '0,1,0'", "GPU 0 is listed twice"]),
    "gpus-empty-item": (["--gpus", "0,,1"], ["--gpus '0,,1'", "empty item"]),
    "gpus-empty": (["--gpus", ""], ["--gpus ''", "empty item"]),
    "gpu-and-gpus": (["--gpus", "0,1", "--gpu", "0"], ["--gpu", "--gpus"]),
    "replicate-alone": (["--device", "cpu", "--replicate"], ["--replicate", "--workers"]),
}


@pytest.mark.parametrize("case", sorted(BAD_OPTIONS))
def test_bad_pool_option_is_one_line_exit_2(tmp_path, capsys, case):
    options, culprits = BAD_OPTIONS[case]
    (tmp_path / "tiny.yaml").write_text(TINY)
    result = cli(capsys, "run-matrix", tmp_path / "tiny.yaml", "--results-root", tmp_path / "runs", *options)
    assert_one_line(result, 2, *culprits)
    assert not (tmp_path / "runs").exists()


def _two_gpus(name1="NVIDIA H100 80GB HBM3"):
    return FakeReader([[gpu_state(uuid="GPU-aaaa-0")], [gpu_state(uuid="GPU-bbbb-1", name=name1)]])


@pytest.mark.parametrize("spec, env, expected", [
    ("all", None, [0, 1]), ("1,0", None, [1, 0]), ("all", "1", [1]), ("all", "GPU-bbbb", [1]), ("0", "0,1", [0])])
def test_gpu_list_resolves_against_the_machine(monkeypatch, spec, env, expected):
    if env is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    assert resolve_gpu_list(spec, _two_gpus()) == expected


@pytest.mark.parametrize("spec, env, name1, culprit", [
    ("0,2", None, None, "GPU 2 does not exist (NVML sees 2: 0, 1)"),
    ("0", "1", None, "GPU 0 is hidden by CUDA_VISIBLE_DEVICES='1'"),
    ("all", "", None, "no GPU is visible"),
    ("all", None, "NVIDIA A100-SXM4-80GB", "GPUs of different models (0: NVIDIA H100 80GB HBM3, 1: NVIDIA A100"),
])
def test_gpu_list_that_the_machine_cannot_serve(monkeypatch, spec, env, name1, culprit):
    if env is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    with pytest.raises(GpuListError) as info:
        resolve_gpu_list(spec, _two_gpus(name1 or "NVIDIA H100 80GB HBM3"))
    assert culprit in str(info.value)


def test_gpu_index_beyond_the_machine_through_the_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(cli_mod, "_require_gpu", _two_gpus)   # a machine with two GPUs, as NVML reports them
    (tmp_path / "tiny.yaml").write_text(TINY.replace("dtype: float32", "dtype: float16"))   # a matrix a GPU runs
    result = cli(capsys, "run-matrix", tmp_path / "tiny.yaml", "--results-root", tmp_path / "runs", "--gpus", "0,7")
    assert_one_line(result, 2, "--gpus '0,7'", "GPU 7 does not exist")


def test_no_listed_gpu_passes_the_clean_gpu_check(tmp_path, capsys, monkeypatch):
    """Every listed GPU fails the check: exit 4 naming each one and why; nothing is created."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    busy = FakeReader([[gpu_state(util=50, uuid="GPU-aaaa-0")], [gpu_state(free_gb=2, uuid="GPU-bbbb-1")]])
    monkeypatch.setattr(cli_mod, "_require_gpu", lambda: busy)
    monkeypatch.setattr(cli_mod, "_device_memory", lambda device, reader: 80 * 2**30)
    (tmp_path / "tiny.yaml").write_text(TINY.replace("dtype: float32", "dtype: float16"))
    result = cli(capsys, "run-matrix", tmp_path / "tiny.yaml", "--results-root", tmp_path / "runs", "--gpus", "all")
    assert result.code == 4, result.err
    line = result.err_lines[-1]
    assert "GPU 0" in line and "util 50% > 8%" in line and "GPU 1" in line and "free 2.0 GB < 12 GB" in line
    assert not list((tmp_path / "runs").glob("*"))


def test_the_gpu_path_on_a_machine_without_cuda(tmp_path, monkeypatch):
    """The parent's side of `--gpus` with NVML faked: GPU 1 fails the clean-GPU check and is left out, GPU 0 gets a
    worker started with CUDA_VISIBLE_DEVICES=<its UUID>; here that worker cannot reach CUDA, so it fails with one
    line, the run is kept (resumable) and says which devices it had."""
    from attnbench.gpu import CleanGpuCheck
    from attnbench.matrix import load_matrix
    from attnbench.pool import Pool, PoolIncomplete, PoolLayout
    from attnbench.runner import RunOptions

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    (tmp_path / "m.yaml").write_text(TINY.replace("dtype: float32", "dtype: float16"))
    matrix = load_matrix(tmp_path / "m.yaml", device="cuda")
    reader = FakeReader([[gpu_state(uuid="GPU-aaaa-0")], [gpu_state(util=60, uuid="GPU-bbbb-1")]])
    events = []
    opts = RunOptions(device="cuda", results_root=tmp_path / "runs", clean_check=CleanGpuCheck(), snapshot_s=0.01)
    pool = Pool(matrix, opts, PoolLayout(gpus=[0, 1], gpus_spec="all"), reader=reader,
                on_event=lambda kind, **d: events.append((kind, d)))
    with pytest.raises(PoolIncomplete) as info:
        pool.run()
    kinds = [k for k, _ in events]
    assert kinds[:3] == ["clean_gpu_probe", "left_out", "start"] and kinds[-1] == "worker_failed"
    assert events[1][1]["gpu"]["index"] == 1 and "util 60% > 8%" in events[1][1]["gpu"]["reasons"][0]
    assert events[2][1]["devices"] == ["cuda:0"]
    (failure,) = info.value.problems[:-1]
    assert failure.startswith("worker cuda:0 failed: ") and "\n" not in failure
    assert "still missing: 3 points" in info.value.problems[-1]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"   # the worker's own value was set for its start only
    manifest = load_run(info.value.run_dir).manifest
    assert manifest["gpu"] == {"index": 0, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-aaaa-0"}
    assert [d["label"] for d in manifest["pool"]["devices"]] == ["cuda:0"]
    assert manifest["pool"]["left_out"][0]["index"] == 1 and manifest["interrupted"]
    assert not (info.value.run_dir / ".lock").exists()


# -- appends from several processes ----------------------------------------------------------------------------

WRITER = """
import json, sys
from attnbench.store import RunStore
store = RunStore(sys.argv[1])
who = sys.argv[2]
for i in range(int(sys.argv[3])):
    store.append_attempt({"point_id": f"{who}@{i}", "who": who, "i": i, "pad": who * (20000 + 37 * i)})
"""


def test_two_processes_appending_never_interleave_within_a_record(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "attempts.jsonl").touch()
    count = 150   # records of 20-26 KB: several pipe buffers (4 KB) and I/O buffers (8 KB) each
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(run), who, str(count)], cwd=REPO, env=_env())
             for who in "xy"]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    lines = (run / "attempts.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]   # every line one whole record
    for who in "xy":
        mine = [r for r in records if r["who"] == who]
        assert [r["i"] for r in mine] == list(range(count))
        assert all(r["pad"] == who * (20000 + 37 * r["i"]) for r in mine)
    assert not (run / TORN_FILE).exists()


def test_a_record_torn_by_a_dead_writer_is_set_aside_by_the_next_append(tmp_path):
    """A writer killed mid-record leaves a partial line; the next writer's append (under the file's lock) moves it
    to torn_records.jsonl before writing, so it never ends up in the middle of the file."""
    run = tmp_path / "run"
    run.mkdir()
    whole = json.dumps({"point_id": "a@16", "attempt": 1}) + "\n"
    torn = '{"point_id": "a@32", "attem'
    (run / "attempts.jsonl").write_text(whole + torn)
    (run / "points.csv").write_text("point_id,status\r\na@16,clean\r\na@32,cl")
    store = RunStore(run)
    store._columns = ["point_id", "status"]
    store.append_attempt({"point_id": "a@48", "attempt": 1})
    store.append_point({"point_id": "a@48", "status": "clean"})
    assert [json.loads(line)["point_id"] for line in (run / "attempts.jsonl").read_text().splitlines()] == \
        ["a@16", "a@48"]
    assert (run / "points.csv").read_bytes() == b"point_id,status\r\na@16,clean\r\na@48,clean\r\n"
    aside = [json.loads(line) for line in (run / TORN_FILE).read_text().splitlines()]
    assert [(a["file"], a["text"]) for a in aside] == [("attempts.jsonl", torn), ("points.csv", "a@32,cl")]
    # a whole record that only lost its newline keeps its place
    (run / "attempts.jsonl").write_text(whole.rstrip("\n"))
    store.append_attempt({"point_id": "a@64", "attempt": 1})
    assert [json.loads(line)["point_id"] for line in (run / "attempts.jsonl").read_text().splitlines()] == \
        ["a@16", "a@64"]


# -- the GPU machine -------------------------------------------------------------------------------------------

GPU_MATRIX = """name: pool_gpu
defaults: {batch: 1, heads: 8, head_dim: 64, timing: {warmup_ms: 5, rep_ms: 20, min_reps: 10, max_reps: 200},
           retry: {max_attempts: 2, backoff_s: 1}}
cells:
  - {id: flash_vs_math, kernel: flash, baseline: math, dtype: float16, mode: fwd, seq_lens: [1024, 2048, 4096]}
"""


@pytest.mark.gpu
def test_gpus_all_runs_one_worker_per_gpu(tmp_path, capsys):
    import torch

    from attnbench.gpu import PynvmlReader, visible_to_cuda

    if torch.cuda.is_initialized():
        pytest.skip("this pytest process holds a CUDA context, which the clean-GPU check sees as a foreign process: "
                    "run tests/test_pool.py on its own")
    reader = PynvmlReader()
    indices = visible_to_cuda(reader)
    held = sorted({pid for i in indices for pid, _ in reader.read(i)["processes"]})
    if held:
        pytest.skip(f"processes {held} hold a GPU (pytest-xdist's other workers, say), which the clean-GPU check "
                    "refuses, as it should: run tests/test_pool.py on its own")
    (tmp_path / "m.yaml").write_text(GPU_MATRIX)
    ids = [f"flash_vs_math@{n}" for n in (1024, 2048, 4096)]
    modes = [[]] + ([["--replicate"]] if len(indices) >= 2 else [])
    for extra in modes:
        root = tmp_path / ("replicated" if extra else "pooled")
        result = cli_process("run-matrix", tmp_path / "m.yaml", "--gpus", "all", "--results-root", root, *extra,
                             timeout=600)
        assert result.code == 0, result.err[-3000:]
        (run,) = root.iterdir()
        manifest = json.loads((run / "manifest.json").read_text())
        devices = manifest["pool"]["devices"]
        assert [d["index"] for d in devices] == sorted(indices) and all(d["sm_count"] > 0 for d in devices)
        assert manifest["gpu"]["name"] == devices[0]["name"] and manifest["gpu"]["sm_count"] > 0
        rows = _rows(run)
        labels = {f"cuda:{i}": reader.read(i)["uuid"] for i in indices}
        for r in rows:
            assert labels[r["ran_on"]] == r["ran_on_uuid"] and r["status"] in ("clean", "disturbed")
        if extra:
            assert sorted((r["point_id"], r["ran_on"]) for r in rows) == sorted((p, d) for p in ids for d in labels)
            assert cli(capsys, "report", run, "--no-plots", "--out", tmp_path / "r.md").code == 0
            assert "## Cross-device spread (--replicate)" in (tmp_path / "r.md").read_text()
        else:
            assert sorted(r["point_id"] for r in rows) == ids
            # the workers' processes were on their own GPUs only: no attempt saw another process on its GPU
            for a in _attempts(run):
                assert not [r for r in a["disturbed_reasons"] if "foreign process" in r], a["disturbed_reasons"]
