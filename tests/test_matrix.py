"""Matrix validation: every error names file, cell, field, value and what is allowed; the CLI exits 2 in one line."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attnbench import backends
from attnbench.matrix import MatrixError, load_matrix

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
    (GOOD_CELL + "    kernel_options: {beta: 2}\n", ["cell 'a'", "kernel_options.beta", "unknown option for efficient"]),
    (GOOD_CELL + "    timing: {warmup: 3}\n", ["cell 'a'", "timing.warmup", "unknown key"]),
    (GOOD_CELL + "    retry: {max_attempts: 0}\n", ["cell 'a'", "retry.max_attempts", "≥ 1"]),
    (GOOD_CELL + "    causal: maybe\n", ["cell 'a'", "causal", "true, false"]),
])
def test_validation_errors_name_file_cell_field_value(tmp_path, cells, expected):
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
    with pytest.raises(MatrixError, match=r"head_dim 80 unsupported"):
        load_matrix(write(tmp_path, matrix_text(cell, "defaults: {batch: 1, heads: 2, head_dim: 80}\n")))
    # efficient has no CPU implementation: with --device cpu its points load and are skipped with the reason
    # (any GPU matrix runs on the CPU), while what the backend cannot do on any device stays an error there too
    from attnbench.runner import _skip_reason

    m = load_matrix(write(tmp_path, matrix_text()), device="cpu")
    assert not m.cells[0].allow_skip
    assert _skip_reason(m.points()[0], "cpu") == "efficient: device cpu unsupported (supports cuda)"
    assert _skip_reason(m.points()[0], "cuda") is None
    cell = GOOD_CELL.replace("kernel: efficient", "kernel: cudnn")
    with pytest.raises(MatrixError, match=r"head_dim 80 unsupported"):
        load_matrix(write(tmp_path, matrix_text(cell, "defaults: {batch: 1, heads: 2, head_dim: 80}\n")), device="cpu")


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
])
def test_structural_errors(tmp_path, body, expected):
    with pytest.raises(MatrixError, match=expected):
        load_matrix(write(tmp_path, body))


def test_missing_file(tmp_path):
    with pytest.raises(MatrixError, match="no such matrix file"):
        load_matrix(tmp_path / "nope.yaml")


def run_cli(*args, env_extra=None):
    import os

    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "attnbench", *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)


def test_cli_validation_error_is_one_line_exit_2(tmp_path):
    path = write(tmp_path, matrix_text(GOOD_CELL.replace("dtype: float16", "dtype: fp8")))
    proc = run_cli("run-matrix", str(path), "--device", "cpu", "--dry-run")
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "field 'dtype'" in lines[0] and "Traceback" not in proc.stderr


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


@pytest.mark.parametrize("extra, device, expected", [
    ("    timing: {mode: fast}\n", "cuda", ["cell 'a'", "timing.mode", "'fast'", "eager, graph, both"]),
    ("    timing: {mode: graph}\n", "cpu", ["cell 'a'", "timing.mode", "need a GPU"]),
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
