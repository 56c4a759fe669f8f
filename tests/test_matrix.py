"""Matrix validation: every error names file, cell, field, value and what is allowed; the CLI exits 2 in one line."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attnbench import backends
from attnbench.matrix import TIMING_DEFAULTS, MatrixError, load_matrix

REPO = Path(__file__).resolve().parent.parent

GOOD_CELL = """
  - id: a
    kernel: efficient
    baseline: math
    dtype: float16
    mode: fwd
    seq_lens: [128, 256]
"""


def write(tmp_path, body, name="m.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


def matrix_text(cells=GOOD_CELL, defaults="defaults: {batch: 1, heads: 2, head_dim: 64}\n"):
    return defaults + "cells:\n" + cells


def test_good_matrix_expands_points(tmp_path):
    m = load_matrix(write(tmp_path, matrix_text()))
    assert [p.id for p in m.points()] == ["a@128", "a@256"]
    pasa = GOOD_CELL.replace("kernel: efficient", "kernel: pasa") + "    kernel_options: {variant: ref}\n"
    assert load_matrix(write(tmp_path, matrix_text(pasa), "p.yaml")).cells[0].kernel_options == {"variant": "ref"}
    assert m.gate == {"max_util_pct": 8.0, "min_free_gb": 12.0}
    assert m.cells[0].retry["max_attempts"] == 4 and m.cells[0].timing["flush_l2"] is True
    assert len(m.sha256) == 64


@pytest.mark.parametrize("cells, expected", [
    (GOOD_CELL.replace("kernel: efficient", "kernel: nosuch"), ["cell 'a'", "field 'kernel'", "unknown backend 'nosuch'", "known:"]),
    (GOOD_CELL.replace("baseline: math", "baseline: mathx"), ["cell 'a'", "field 'baseline'", "unknown backend 'mathx'"]),
    (GOOD_CELL.replace("dtype: float16", "dtype: fp8"), ["cell 'a'", "field 'dtype'", "'fp8'", "float32, float16, bfloat16"]),
    (GOOD_CELL.replace("mode: fwd", "mode: train"), ["cell 'a'", "field 'mode'", "'train'", "fwd, bwd, fwdbwd"]),
    (GOOD_CELL.replace("[128, 256]", "[128, -4]"), ["cell 'a'", "seq_lens", "-4", "positive integers"]),
    (GOOD_CELL.replace("[128, 256]", "[0]"), ["cell 'a'", "seq_lens", "positive integers"]),
    (GOOD_CELL.replace("[128, 256]", "[]"), ["cell 'a'", "seq_lens", "non-empty list"]),
    (GOOD_CELL + GOOD_CELL, ["cell 'a'", "duplicate id"]),
    (GOOD_CELL + "    colour: red\n", ["cell 'a'", "unknown key 'colour'", "allowed:"]),
    (GOOD_CELL.replace("dtype: float16", "dtype: [float16]"), ["cell 'a'", "field 'dtype' = ['float16']", "allowed"]),
    (GOOD_CELL.replace("mode: fwd", "mode: {a: 1}"), ["cell 'a'", "field 'mode' = {'a': 1}", "allowed"]),
    (GOOD_CELL + "    kernel_options: {beta: 2}\n", ["cell 'a'", "kernel_options.beta", "unknown option for efficient"]),
    (GOOD_CELL.replace("kernel: efficient", "kernel: pasa") + "    kernel_options: {variant: fast}\n",
     ["cell 'a'", "kernel_options.variant", "'fast'", "variant must be one of ref, fused"]),
    (GOOD_CELL.replace("kernel: efficient", "kernel: pasa") + "    kernel_options: {state_dtype: fp8}\n",
     ["cell 'a'", "kernel_options.state_dtype", "'fp8'", "state_dtype must be one of fp16, fp32"]),
    # open-valued options, checked by the kernel's own check_options at load time, not met as a failed point
    (GOOD_CELL.replace("kernel: efficient", "kernel: pasa") + "    kernel_options: {beta: 1.0}\n",
     ["cell 'a'", "kernel_options.beta", "= 1.0", "[0, 1)"]),
    (GOOD_CELL.replace("kernel: efficient", "kernel: cqsa") + "    kernel_options: {c: 6}\n",
     ["cell 'a'", "kernel_options.c", "= 6", "no interest set"]),
    (GOOD_CELL.replace("kernel: efficient", "kernel: cqsa") + "    kernel_options: {c: 7.0}\n",
     ["cell 'a'", "kernel_options.c", "= 7.0", "no interest set"]),
    (GOOD_CELL.replace("kernel: efficient", "kernel: cqsa") + "    kernel_options: {itr: 0}\n",
     ["cell 'a'", "kernel_options.itr", "= 0", "itr must be an int >= 1"]),
    (GOOD_CELL.replace("kernel: efficient", "kernel: cqsa") + "    kernel_options: {c: 133, itr: 6}\n",
     ["cell 'a'", "field 'kernel_options'", "responsibility budget"]),
    (GOOD_CELL.replace("kernel: efficient", "kernel: cqsa") + "    kernel_options: {mem_budget: true}\n",
     ["cell 'a'", "kernel_options.mem_budget", "= True", "positive number of bytes"]),
    (GOOD_CELL.replace("kernel: efficient", "kernel: cqsa") + "    kernel_options: {mem_budget: 1000000000}\n"
     "    timing: {mode: graph}\n", ["cell 'a'", "kernel_options.mem_budget", "eagerly", "graph mode"]),
    (GOOD_CELL.replace("kernel: efficient", "kernel: elsa") + "    kernel_options: {precision: fp64}\n",
     ["cell 'a'", "kernel_options.precision", "'fp64'", "tf32x3"]),
    (GOOD_CELL.replace("kernel: efficient", "kernel: cron_root") + "    causal: true\n"
     "    kernel_options: {relay_threshold: 8192.5}\n",
     ["cell 'a'", "kernel_options.relay_threshold", "must be an int"]),
    (GOOD_CELL.replace("kernel: efficient", "kernel: cron_root_hybrid") + "    causal: true\n"
     "    kernel_options: {crossover: -1}\n", ["cell 'a'", "kernel_options.crossover", "int >= 0"]),
    (GOOD_CELL + "    timing: {warmup: 3}\n", ["cell 'a'", "timing.warmup", "unknown key"]),
    (GOOD_CELL + "    retry: {max_attempts: 0}\n", ["cell 'a'", "retry.max_attempts", "≥ 1"]),
    (GOOD_CELL + "    causal: maybe\n", ["cell 'a'", "causal", "true, false"]),
    # an empty list, false or an empty string where a mapping belongs is a mistake, not "the defaults"
    (GOOD_CELL + "    timing: []\n", ["cell 'a'", "field 'timing' = []", "need a mapping"]),
    (GOOD_CELL + "    retry: false\n", ["cell 'a'", "field 'retry' = False", "need a mapping"]),
    (GOOD_CELL + "    kernel_options: ''\n", ["cell 'a'", "field 'kernel_options' = ''", "need a mapping"]),
    (GOOD_CELL + "    baseline_options: 0\n", ["cell 'a'", "field 'baseline_options' = 0", "need a mapping"]),
])
def test_validation_errors_name_file_cell_field_value(tmp_path, cells, expected):
    assert_one_line_matrix_error(tmp_path, cells, expected)


def assert_one_line_matrix_error(tmp_path, cells, expected):
    """Loading a matrix of these cells fails with one line that names the file and every expected part."""
    path = write(tmp_path, matrix_text(cells))
    with pytest.raises(MatrixError) as exc:
        load_matrix(path)
    msg = str(exc.value)
    assert str(path) in msg and "\n" not in msg
    for part in expected:
        assert part in msg, (part, msg)


def test_backend_capabilities_are_checked_for_the_target_device(tmp_path):
    # cudnn cannot do float32 on a GPU: a validation error, unless the cell allows skipping
    cell = GOOD_CELL.replace("kernel: efficient", "kernel: cudnn").replace("float16", "float32")
    with pytest.raises(MatrixError, match=r"cell 'a': kernel cudnn: float32 unsupported on cuda"):
        load_matrix(write(tmp_path, matrix_text(cell)))
    m = load_matrix(write(tmp_path, matrix_text(cell + "    allow_skip: true\n")))
    assert m.cells[0].allow_skip
    # head_dim the backend cannot do
    cell = GOOD_CELL.replace("kernel: efficient", "kernel: cudnn")
    with pytest.raises(MatrixError, match=r"head_dim 136 unsupported \(supports multiples of 8 from 8 to 128\)"):
        load_matrix(write(tmp_path, matrix_text(cell, "defaults: {batch: 1, heads: 2, head_dim: 136}\n")))
    # efficient has no CPU implementation: with --device cpu its points load and are skipped with the reason
    # (any GPU matrix runs on the CPU), while what the backend cannot do on any device stays an error there too
    from attnbench.runner import _skip_reason

    m = load_matrix(write(tmp_path, matrix_text()), device="cpu")
    assert not m.cells[0].allow_skip
    assert _skip_reason(m.points()[0], "cpu") == "efficient: device cpu unsupported (supports cuda)"
    assert _skip_reason(m.points()[0], "cuda") is None
    cell = GOOD_CELL.replace("kernel: efficient", "kernel: cudnn")
    with pytest.raises(MatrixError, match=r"head_dim 136 unsupported"):
        load_matrix(write(tmp_path, matrix_text(cell, "defaults: {batch: 1, heads: 2, head_dim: 136}\n")), device="cpu")
    # flash in float32 runs on the CPU (not on a GPU): a head dim it cannot take is named, not the GPU's dtypes
    cell = GOOD_CELL.replace("kernel: efficient", "kernel: flash").replace("dtype: float16", "dtype: float32")
    assert load_matrix(write(tmp_path, matrix_text(cell)), device="cpu").cells[0].kernel == "flash"
    with pytest.raises(MatrixError, match=r"kernel flash: head_dim 33 unsupported \(supports multiples of 8"):
        load_matrix(write(tmp_path, matrix_text(cell, "defaults: {batch: 1, heads: 2, head_dim: 33}\n")), device="cpu")


def test_reserved_kernel_not_landed_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(backends.KERNEL_PACKAGES, "future_kernel", "kernels.future_kernel_not_here")
    cell = GOOD_CELL.replace("kernel: efficient", "kernel: future_kernel")
    with pytest.raises(MatrixError, match=r"kernel 'future_kernel' is not implemented yet"):
        load_matrix(write(tmp_path, matrix_text(cell)))


def test_yaml_syntax_error_reports_line(tmp_path):
    path = write(tmp_path, "defaults: {batch: 1\ncells:\n  - id: a\n")
    with pytest.raises(MatrixError, match=r"YAML syntax error at line \d+"):
        load_matrix(path)


@pytest.mark.parametrize("body, expected", [
    ("cells: []\n", "'cells' must be a non-empty list"),
    ("colour: red\ncells:\n" + GOOD_CELL, "unknown top-level key 'colour'"),
    ("- a\n- b\n", "top level must be a mapping"),
    ("defaults: {heads: 2, head_dim: 64, flavour: x}\ncells:\n" + GOOD_CELL, "defaults: unknown key 'flavour'"),
    ("defaults: []\ncells:\n" + GOOD_CELL, "'defaults' must be a mapping"),
    ("gate: []\ncells:\n" + GOOD_CELL, r"field 'gate' = \[\]: need a mapping"),
    (matrix_text(GOOD_CELL + "    timing:\n"), None),                 # no value: no overrides (the defaults)
])
def test_structural_errors(tmp_path, body, expected):
    if expected is None:
        assert load_matrix(write(tmp_path, body)).cells[0].timing == TIMING_DEFAULTS
        return
    with pytest.raises(MatrixError, match=expected):
        load_matrix(write(tmp_path, body))


def test_missing_file(tmp_path):
    with pytest.raises(MatrixError, match="no such matrix file"):
        load_matrix(tmp_path / "nope.yaml")
    with pytest.raises(MatrixError, match="a directory, not a matrix file"):
        load_matrix(tmp_path)


def run_cli(*args, env_extra=None):
    import os

    env = dict(os.environ, COLUMNS="200")       # PYTHONPATH: this checkout first (conftest.py)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "attnbench", *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)


def test_cli_validation_error_is_one_line_exit_2(tmp_path, capsys):
    from test_faults import assert_one_line
    from test_faults import cli as cli_here

    path = write(tmp_path, matrix_text(GOOD_CELL.replace("dtype: float16", "dtype: fp8")))
    assert_one_line(cli_here(capsys, "run-matrix", path, "--device", "cpu", "--dry-run"), 2, "field 'dtype'")


def test_cli_dry_run_prints_plan_without_gpu(tmp_path):
    proc = run_cli("run-matrix", "matrices/smoke_cpu.yaml", "--device", "cpu", "--dry-run", "--results-root", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "flash_vs_math_fp32_fwd@64" in proc.stdout and "3 points" in proc.stdout
    assert "last time 0.0 min for 0 of them (from 0 stored cpu runs; 3 never measured)" in proc.stdout


# --- timing modes and the stopping rule's target ------------------------------------------------------------

def test_timing_mode_both_gives_an_eager_and_a_graph_point_per_length(tmp_path):
    m = load_matrix(write(tmp_path, matrix_text(GOOD_CELL + "    timing: {mode: both, ci_half_width: 0.01}\n")))
    assert [(p.id, p.timing_mode) for p in m.points()] == [
        ("a@128", "eager"), ("a@128:graph", "graph"), ("a@256", "eager"), ("a@256:graph", "graph")]
    assert m.cells[0].timing["ci_half_width"] == 0.01 and m.cells[0].timing["max_ms"] == 2000.0
    m = load_matrix(write(tmp_path, matrix_text(GOOD_CELL + "    timing: {mode: graph}\n")))
    assert [p.id for p in m.points()] == ["a@128:graph", "a@256:graph"]
    assert [p.id for p in load_matrix(write(tmp_path, matrix_text())).points()] == ["a@128", "a@256"]   # eager default


def test_graph_points_on_the_cpu_are_skipped_with_the_reason(tmp_path):
    """Any matrix runs with --device cpu: a graph-mode point is recorded as skipped there (CUDA graphs need a
    GPU), as a GPU-only backend's is, and the cell's eager points are measured; on the GPU nothing is skipped."""
    from attnbench.runner import _skip_reason

    cell = GOOD_CELL.replace("kernel: efficient", "kernel: flash") + "    timing: {mode: both}\n"
    path = write(tmp_path, matrix_text(cell))
    skips = {p.id: _skip_reason(p, "cpu") for p in load_matrix(path, device="cpu").points()}
    assert skips == {"a@128": None, "a@128:graph": "CUDA graph timing needs a GPU", "a@256": None,
                     "a@256:graph": "CUDA graph timing needs a GPU"}
    assert not any(_skip_reason(p, "cuda") for p in load_matrix(path).points())
    proc = run_cli("run-matrix", str(path), "--device", "cpu", "--dry-run")
    assert proc.returncode == 0 and proc.stdout.count("skip: CUDA graph timing needs a GPU") == 2, proc.stderr


@pytest.mark.parametrize("extra, device, expected", [
    ("    timing: {mode: fast}\n", "cuda", ["cell 'a'", "timing.mode", "'fast'", "eager, graph, both"]),
    ("    timing: {mode: both}\n    mode: bwd\n", "cuda", ["cell 'a'", "timing.mode", "mode bwd", "fwdbwd"]),
    ("    timing: {ci_half_width: 0}\n", "cuda", ["cell 'a'", "timing.ci_half_width", "(0, 1)"]),
    ("    timing: {ci_half_width: 1.5}\n", "cuda", ["cell 'a'", "timing.ci_half_width", "1.5"]),
    ("    timing: {ci_half_width: yes}\n", "cuda", ["cell 'a'", "timing.ci_half_width"]),
    ("    timing: {max_ms: 0}\n", "cuda", ["cell 'a'", "timing.max_ms", "≥ 1"]),
    ("    retry: {min_clock_frac: 1.2}\n", "cuda", ["cell 'a'", "retry.min_clock_frac", "(0, 1]"]),
    ("    retry: {max_cv: 0.03}\n", "cuda", ["cell 'a'", "retry.max_cv", "unknown key"]),
])
def test_timing_validation(tmp_path, extra, device, expected):
    cell = GOOD_CELL.replace("    mode: fwd\n", "") if "mode: bwd" in extra else GOOD_CELL
    with pytest.raises(MatrixError) as exc:
        load_matrix(write(tmp_path, matrix_text(cell + extra)), device=device)
    for part in expected:
        assert part in str(exc.value), str(exc.value)


def test_model_cells_time_eagerly(tmp_path):
    body = matrix_text("""
  - id: vit
    model: vit_tiny_patch16_224
    img_sizes: [224]
    kernel: native
    dtype: float16
    mode: fwd
    timing: {mode: graph}
""")
    with pytest.raises(MatrixError, match="model cells time eagerly"):
        load_matrix(write(tmp_path, body))


# -- the attention problem's shape: grouped K/V heads, query and key lengths ---------------------------

SHAPED = """
  - {id: gqa, kernel: math, baseline: flash, dtype: float16, mode: fwd, heads: 8, kv_heads: 2, seq_lens: [128, 256]}
  - {id: mqa, kernel: math, baseline: flash, dtype: float16, mode: fwd, heads: 8, kv_heads: 1, seq_lens: [128]}
  - {id: chunk, kernel: math, baseline: flash, dtype: float16, mode: fwd, causal: true, q_len: 64, seq_lens: [64, 256]}
  - {id: quarter, kernel: math, baseline: flash, dtype: float16, mode: fwd, q_len: N/4, seq_lens: [128, 256]}
  - {id: twice, kernel: math, baseline: flash, dtype: float16, mode: fwd, kv_len: 'N * 2', seq_lens: [128]}
  - {id: text, kernel: math, baseline: flash, dtype: float16, mode: fwd, kv_len: 77, seq_lens: [128]}
  - {id: spelled, kernel: math, baseline: flash, dtype: float16, mode: fwd, heads: 2, kv_heads: 2, q_len: N, kv_len: N/1, seq_lens: [128]}
"""


def test_shape_fields_resolve_per_point_and_name_it_in_the_id(tmp_path):
    m = load_matrix(write(tmp_path, matrix_text(SHAPED)), device="cpu")
    got = {p.id: (p.q_len, p.kv_len, p.cell.heads, p.cell.heads_kv) for p in m.points()}
    assert got == {
        "gqa@128:hkv2": (128, 128, 8, 2), "gqa@256:hkv2": (256, 256, 8, 2), "mqa@128:hkv1": (128, 128, 8, 1),
        "chunk@64": (64, 64, 2, 2), "chunk@256:q64": (64, 256, 2, 2),      # a fixed 64-token chunk vs 256 keys
        "quarter@128:q32": (32, 128, 2, 2), "quarter@256:q64": (64, 256, 2, 2),
        "twice@128:kv256": (128, 256, 2, 2), "text@128:kv77": (128, 77, 2, 2),
        "spelled@128": (128, 128, 2, 2),
    }
    cells = {c.id: c for c in m.cells}
    assert cells["gqa"].grouped and not cells["gqa"].cross
    assert cells["chunk"].cross and not cells["chunk"].grouped and cells["chunk"].q_len == 64
    assert cells["quarter"].q_len == "N/4" and cells["twice"].kv_len == "N*2"   # canonical text
    # the defaults spelled out are the defaults: nothing new in the id or the plan
    assert (cells["spelled"].kv_heads, cells["spelled"].q_len, cells["spelled"].kv_len) == (None, None, None)


def test_plan_fingerprint_includes_shape_fields_only_when_they_differ_from_the_defaults(tmp_path):
    plain = "  - {id: a, kernel: math, baseline: flash, dtype: float16, mode: fwd, seq_lens: [128]}\n"

    def plan(cell):
        return load_matrix(write(tmp_path, matrix_text(cell)), device="cpu").plan_sha256()

    assert plan(plain) == plan(plain.replace("}", ", kv_heads: 2, q_len: N, kv_len: 'N*1'}"))
    assert plan(plain) != plan(plain.replace("}", ", kv_heads: 1}"))
    assert plan(plain) != plan(plain.replace("}", ", q_len: N/2}"))
    assert plan(plain) != plan(plain.replace("}", ", kv_len: 77}"))


def test_plan_fingerprint_covers_the_problem_not_the_sampling_policy(tmp_path):
    """An interrupted run resumes after its points' sampling or retry policy changed (budgets, the CI target,
    retries, the description), never after a change of what is measured or of what a time means."""
    base = GOOD_CELL + "    timing: {warmup_ms: 25, rep_ms: 200, ci_half_width: 0.015}\n    retry: {max_attempts: 4}\n"

    def plan(cell):
        return load_matrix(write(tmp_path, matrix_text(cell)), device="cuda").plan_sha256()

    same = [base.replace("ci_half_width: 0.015", "ci_half_width: 0.005, max_ms: 9000, max_reps: 50"),
            base.replace("warmup_ms: 25, rep_ms: 200", "warmup_ms: 1, rep_ms: 10, min_reps: 3"),
            base.replace("max_attempts: 4", "max_attempts: 2, backoff_s: 0, min_clock_frac: 0.8"),
            base + "    description: another word\n",
            base.replace("timing: {", "timing: {mode: eager, flush_l2: true, ")]      # the defaults spelled out
    assert {plan(c) for c in same} == {plan(base)}
    different = [base.replace("timing: {", "timing: {flush_l2: false, "), base.replace("timing: {", "timing: {mode: both, "),
                 base.replace("seq_lens: [128, 256]", "seq_lens: [128, 512]"), base.replace("dtype: float16", "dtype: float32"),
                 base + "    causal: true\n", base + "    head_dim: 128\n", base + "    kernel_options: {}\n    batch: 2\n",
                 base.replace("baseline: math", "baseline: flash")]
    plans = [plan(c) for c in different]
    assert plan(base) not in plans and len(set(plans)) == len(plans)


def _committed_runs():
    return sorted(p.parent for p in [*(REPO / "results" / "runs").glob("*/manifest.json"),
                                     *(REPO / "results" / "baselines").glob("*/*/manifest.json")])


@pytest.mark.parametrize("run_dir", _committed_runs(), ids=lambda p: p.name)
def test_committed_runs_are_complete_and_resume_as_a_no_op_with_todays_matrices(tmp_path, run_dir):
    """Every committed run (results/runs and each GPU's baseline), with the cells its command line selects today, has
    nothing left to measure (or, where it was interrupted, resumes with today's matrix): `attnbench runs` calls it complete, and `--resume` of a copy accepts it, measures
    nothing and rewrites nothing. Their fingerprints (where they recorded one) also covered the sampling policy
    that has changed since, so completeness is what keeps them resumable; the fingerprint's own rule is
    test_plan_fingerprint_covers_the_problem_not_the_sampling_policy."""
    import shutil

    from attnbench.runner import Runner, RunOptions
    from attnbench.runs import run_progress
    from attnbench.spotcheck import load_spot_check
    from attnbench.store import RunDirError, load_run

    copy = tmp_path / run_dir.name
    shutil.copytree(run_dir, copy)
    manifest = load_run(copy).manifest
    argv, device = manifest["argv"], manifest.get("device") or "cuda"
    if argv[0] == "spot-check":
        m = load_spot_check(REPO / manifest["matrix_path"], device=device).matrix
    else:
        only = argv[argv.index("--only") + 1] if "--only" in argv else None
        m = load_matrix(REPO / manifest["matrix_path"], device=device).select(only)
    info = run_progress(load_run(copy))
    if load_run(copy).manifest.get("interrupted"):
        # a run cut off by a time limit (kept: what it measured is cited): it must stay resumable
        # with today's matrix, by a command that names it
        assert info["state"] == "interrupted" and info["resume"] and f"--resume {copy}" in info["resume"], info
        assert info["measured"] < info["planned"], info
        return
    assert (info["state"], info["resume"]) == ("complete", None), info

    def contents():      # every file, in subfolders too (a run that nightly.sh reported on holds plots/)
        return {str(p.relative_to(copy)): p.read_bytes() for p in copy.rglob("*") if p.is_file()}

    before = contents()
    events = []
    runner = Runner(m, RunOptions(device=device, results_root=tmp_path / "runs"), reader=None,
                    on_event=lambda kind, **data: events.append(kind))
    if (manifest.get("pool") or {}).get("replicate"):
        # a --replicate run resumes only with its worker pool (--gpus: GPUs this machine lacks); a resume without
        # it is refused in one line that says so, and nothing is written
        with pytest.raises(RunDirError, match=r"started with --replicate .*resume it with --replicate and --gpus"):
            runner.run(resume=copy)
        assert contents() == before
        return
    assert runner.run(resume=copy) == copy
    assert events == ["complete"]
    assert contents() == before


@pytest.mark.parametrize("cells, expected", [
    (GOOD_CELL + "    kv_heads: 3\n", ["cell 'a'", "field 'kv_heads' = 3", "divisor of heads (2): 1, 2"]),
    (GOOD_CELL + "    kv_heads: 0\n", ["field 'kv_heads' = 0"]),
    (GOOD_CELL + "    kv_heads: true\n", ["field 'kv_heads' = True"]),
    (GOOD_CELL + "    kv_heads: 4\n", ["field 'kv_heads' = 4", "divisor of heads (2)"]),
    (GOOD_CELL + "    q_len: N/3\n", ["cell 'a'", "field 'q_len' = 'N/3'", "seq_lens has 128, not a multiple of 3"]),
    (GOOD_CELL + "    q_len: M/2\n", ["field 'q_len' = 'M/2'", "N, N/k, N*k"]),
    (GOOD_CELL + "    q_len: N/0\n", ["field 'q_len' = 'N/0'", "k ≥ 1"]),
    (GOOD_CELL + "    kv_len: 0\n", ["field 'kv_len' = 0", "positive length"]),
    (GOOD_CELL + "    kv_len: 2.5\n", ["field 'kv_len' = 2.5"]),
    (GOOD_CELL + "    q_len: 64\n    kv_len: 512\n", ["'q_len' = 64", "'kv_len' = 512", "both fixed"]),
    (GOOD_CELL + "    compile: true\n", ["unknown key 'compile' for an attention cell"]),
])
def test_shape_field_errors_name_file_cell_field_value(tmp_path, cells, expected):
    assert_one_line_matrix_error(tmp_path, cells, expected)


MODEL_CELL = """
  - {id: v, model: vit_tiny_patch16_224, img_sizes: [224], kernel: elsa, dtype: float16, mode: train%s}
"""


def test_model_cells_take_compile_and_refuse_attention_shape_fields(tmp_path):
    m = load_matrix(write(tmp_path, "cells:\n" + MODEL_CELL % ", compile: true"), device="cpu")
    assert m.cells[0].compile is True and m.points()[0].id == "v@224"
    plain = load_matrix(write(tmp_path, "cells:\n" + MODEL_CELL % ""), device="cpu")
    assert plain.cells[0].compile is False
    assert m.plan_sha256() != plain.plan_sha256()
    for extra, culprit in ((", compile: 'yes'", "field 'compile' = 'yes': allowed true, false"),
                           (", kv_heads: 1", "unknown key 'kv_heads' for a model cell")):
        with pytest.raises(MatrixError, match=culprit):
            load_matrix(write(tmp_path, "cells:\n" + MODEL_CELL % extra), device="cpu")


@pytest.fixture
def plain_kernel(monkeypatch):
    """A kernel package whose BACKENDS entry declares neither gqa nor cross: both default to unsupported."""
    import sys
    import types

    from kernels.reference import reference_attention

    module = types.ModuleType("kernels_plain_for_tests")
    module.BACKENDS = {"plain": dict(fn=lambda q, k, v, causal=False, scale=None: reference_attention(
        q, k, v, causal=causal, scale=scale).to(q.dtype), dtypes=("float32", "float16"), devices=("cuda", "cpu"))}
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(backends.KERNEL_PACKAGES, "plain", module.__name__)
    return "plain"


def test_grouped_and_cross_cells_need_a_backend_that_declares_them(tmp_path, plain_kernel):
    from attnbench.runner import _skip_reason

    b = backends.get_backend(plain_kernel)
    assert (b.gqa, b.cross) == (False, False)
    assert all(backends.get_backend(n).gqa and backends.get_backend(n).cross for n in ("math", "flash", "cudnn"))
    # efficient refuses enable_gqa on torch 2.11 (the H100): grouped cells skip it rather than erroring mid-run
    assert (backends.get_backend("efficient").gqa, backends.get_backend("efficient").cross) == (False, True)
    gqa = f"  - {{id: g, kernel: {plain_kernel}, baseline: math, dtype: float32, mode: fwd, kv_heads: 1, seq_lens: [64]}}\n"
    with pytest.raises(MatrixError, match=r"cell 'g': kernel plain: grouped-query K/V \(fewer key/value heads than "
                                          r"query heads\) unsupported \(set allow_skip"):
        load_matrix(write(tmp_path, matrix_text(gqa)), device="cpu")
    cross = f"  - {{id: c, kernel: {plain_kernel}, baseline: math, dtype: float32, mode: fwd, q_len: 64, seq_lens: [64, 128]}}\n"
    with pytest.raises(MatrixError, match=r"cell 'c': kernel plain: query length != key length unsupported"):
        load_matrix(write(tmp_path, matrix_text(cross)), device="cpu")
    # allowed to skip: the point whose lengths differ is skipped with the reason, the square one runs
    m = load_matrix(write(tmp_path, matrix_text(cross.replace("}", ", allow_skip: true}"))), device="cpu")
    reasons = {p.id: _skip_reason(p, "cpu") for p in m.points()}
    assert reasons == {"c@64": None, "c@128:q64": "plain: query length != key length unsupported"}


def test_inputs_fit_check_counts_grouped_k_v_and_both_lengths(tmp_path):
    # q 1×8×N×64 fp16 plus k, v 1×1×N×64: 10 × N × 64 × 2 bytes; 512 fits in 700 KB, 1024 does not
    cell = "  - {id: a, kernel: math, baseline: flash, dtype: float16, mode: fwd, heads: 8, kv_heads: 1, seq_lens: [512, 1024]}\n"
    path = write(tmp_path, matrix_text(cell))
    with pytest.raises(MatrixError) as exc:
        load_matrix(path).check_fits(700_000, "cuda")
    msg = str(exc.value)
    assert "seq_lens' has 1024" in msg and "q 1×8×1024×64, k 1×1×1024×64, v 1×1×1024×64 float16" in msg
    assert f"{10 * 1024 * 64 * 2:,} bytes" in msg
    load_matrix(write(tmp_path, matrix_text(cell.replace(", 1024", "")))).check_fits(700_000, "cuda")


def test_full_matrix_holds_the_issue_17_cells():
    """Llama-3-8B attention for every kernel vs flash and cuDNN, ViT-H/14 for ELSA vs flash and efficient, and each
    kernel at D = 80 and 96 beside 64 and 128 on one shape (ELSA also at 160, 192, 256: `widehead_*`): selectable by
    prefix (`--only`)."""
    full = REPO / "matrices" / "full.yaml"
    kernels = {"elsa", "cqsa", "pasa", "cron_root"}
    llama = load_matrix(full).select("llama3_*").cells
    gqa = [c for c in llama if c.grouped]
    assert {(c.kernel, c.baseline) for c in gqa if c.mode == "fwd"} == {(k, b) for k in kernels for b in ("flash", "cudnn")}
    assert all((c.heads, c.head_dim, c.causal, c.dtype) == (32, 128, True, "float16") for c in llama)
    assert {c.heads_kv for c in gqa} == {8}
    assert {c.kernel for c in llama if not c.grouped} == kernels            # the MHA counterparts
    vith = load_matrix(full).select("vith14_*").cells
    assert {(c.baseline, c.mode) for c in vith} == {(b, m) for b in ("flash", "efficient") for m in ("fwd", "fwdbwd")}
    assert all((c.kernel, c.heads, c.head_dim, c.seq_lens) == ("elsa", 16, 80, (257, 1025)) for c in vith)
    dims = {}
    for c in load_matrix(full).select("headdim_*").cells:
        dims.setdefault(c.kernel, set()).add(c.head_dim)
    assert dims == {k: {64, 80, 96, 128} for k in kernels}
    assert {c.head_dim for c in load_matrix(full).select("*head*_elsa_*").cells} == {64, 80, 96, 128, 160, 192, 256}
