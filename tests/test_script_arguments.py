"""The tools in scripts/: a bad option value is one line naming it and exit 2, before any work (attnbench.arguments),
not a traceback once the measuring is done; the shell wrappers likewise. The bad options go to each script's main()
in this process (a new one would spend seconds importing torch to print one line). Each script also starts as a
user starts it, once somewhere in the tests: the tools that need a GPU below, ncu_summary's and model_step_profile's
bad option below, the others in their own tests."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from scripts_loader import exit_code, load_script

from attnbench import arguments

REPO = Path(__file__).resolve().parents[1]


def _run(*argv):
    env = dict(os.environ, PYTHON=sys.executable)       # PYTHONPATH: this checkout first (conftest.py)
    return subprocess.run(list(argv), cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("text, kind, value", [
    ("3", arguments.positive_int, 3), ("0", arguments.non_negative_int, 0), ("2.5", arguments.positive_float, 2.5),
    ("64, 128", arguments.int_list, (64, 128)), ("fp16,", arguments.name_list, ("fp16",)),
])
def test_good_values(text, kind, value):
    assert kind(text) == value


@pytest.mark.parametrize("text, kind, message", [
    ("0", arguments.positive_int, "'0': need a positive integer"),
    ("-1", arguments.non_negative_float, "'-1': need a non-negative number"),
    ("nan", arguments.positive_float, "'nan': need a positive number"),
    ("x", arguments.positive_int, "'x' is not an integer"),
    ("64,x", arguments.int_list, "'64,x': need a comma list of positive integers"),
    (",", arguments.name_list, "',': need a comma list of at least one name"),
])
def test_bad_values(text, kind, message):
    with pytest.raises(argparse.ArgumentTypeError, match="^" + message.replace("(", r"\(")):
        kind(text)


def test_output_paths(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert arguments.output_file(str(tmp_path / "x.json")) == tmp_path / "x.json"
    assert arguments.output_dir(str(tmp_path / "new" / "dir")) == tmp_path / "new" / "dir"
    for kind, text, message in ((arguments.output_file, a_file / "x.json", f"({a_file} is a file, not a folder)"),
                                (arguments.output_file, tmp_path / "no" / "x.json", f"(no folder {tmp_path / 'no'})"),
                                (arguments.output_file, tmp_path, "a folder, not a file"),
                                (arguments.output_dir, a_file / "sub", f"({a_file} is a file, not a folder)")):
        with pytest.raises(argparse.ArgumentTypeError) as exc:
            kind(str(text))
        assert str(exc.value).endswith(message), exc.value


@pytest.mark.parametrize("script, argv, message", [
    ("tune.py", ["--kernel", "elsa", "--device", "cpu", "--budget-s", "-1"], "argument --budget-s: '-1'"),
    ("tune.py", ["--kernel", "pasa", "--device", "cpu", "--write", "{file}/x.json"], "argument --write:"),
    ("compile_check.py", ["--kernel", "elsa", "--dims", "abc"], "argument --dims: 'abc'"),
    ("compile_check.py", ["--kernel", "elsa", "--target", "cuda:x:32"], "argument --target: 'cuda:x:32'"),
    ("compile_check.py", ["--kernel", "elsa", "--dims", "100"], "--dims: 100: head dims are multiples of 8"),
    ("host_cost.py", ["{file}/h.json", "--device", "cpu"], "argument out:"),
    ("host_cost.py", ["{tmp}/h.json", "--device", "cpu", "--repeats", "0"], "argument --repeats: '0'"),
    ("clock_pairing.py", ["{tmp}/c.json", "--device", "cpu", "--warm-s", "-1"], "argument --warm-s: '-1'"),
    ("flash_core_sweep.py", ["--out", "{file}/sub"], "argument --out:"),
    ("cqsa_scaling.py", ["table", "--out", "{tmp}/cq", "--passes", "nosuch"], "argument --passes: 'nosuch'"),
    ("cqsa_scaling.py", ["table", "--out", "{tmp}/cq", "--passes", "fwdbwd"], "'fwdbwd': passes here are fwd, bwd"),
    ("cqsa_scaling.py", ["dist", "--out", "{tmp}/cq", "--passes", "bwd"], "'bwd': passes here are fwd, fwdbwd"),
    ("cqsa_scaling.py", ["report", "--out", "{tmp}/cq", "--merge", "{tmp}/nowhere"], "argument --merge:"),
    ("ncu_summary.py", ["--d", "-1"], "argument --d: '-1': need"),
    ("ncu_summary.py", ["--d", "100"], "argument --d: 100: head dims are multiples of 8"),
    ("cqsa_scaling.py", ["table", "--out", "{tmp}/cq", "--head-dim", "33"], "argument --head-dim: 33: head dims"),
    ("cqsa_scaling.py", ["report", "--out", "{tmp}/cq", "--merge", "{tmp}/bad_points"], "table_points.json: Expecting"),
    ("compile_check.py", ["--kernel", "elsa", "--target", "foo:90:32"], "the backend cuda or hip"),
    ("calibrate.py", ["--tolerance", "-1"], "argument --tolerance: '-1'"),
    ("model_step_profile.py", ["{file}/p.json", "--device", "cpu"], "argument out:"),
])
def test_a_bad_option_is_one_line_and_exit_2(tmp_path, capsys, script, argv, message):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    (tmp_path / "bad_points").mkdir()
    (tmp_path / "bad_points" / "table_points.json").write_text("{bad")
    argv = [a.replace("{file}", str(a_file)).replace("{tmp}", str(tmp_path)) for a in argv]
    code = exit_code(load_script(script.removesuffix(".py")), argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    assert message in lines[0]


@pytest.mark.parametrize("script, argv, message", [
    ("ncu_summary.py", ["--d", "-1"], "argument --d: '-1': need"),
    ("model_step_profile.py", ["{file}/p.json", "--device", "cpu"], "argument out:"),
])
def test_a_bad_option_from_a_started_script(tmp_path, script, argv, message):
    (tmp_path / "a_file").write_text("")
    proc = _run(sys.executable, str(REPO / "scripts" / script), *[a.replace("{file}", str(tmp_path / "a_file"))
                                                                    for a in argv])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr[-2000:]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is present")
@pytest.mark.parametrize("script, argv", [
    ("calibrate.py", []), ("clock_pairing.py", ["{tmp}/c.json"]), ("elsa_bwd_launches.py", ["{tmp}/e.json"]),
    ("flash_core_sweep.py", ["--out", "{tmp}/f"]), ("host_cost.py", ["{tmp}/h.json"]),
    ("tune.py", ["--kernel", "elsa"]),
])
def test_a_tool_that_needs_a_gpu_says_so_in_one_line_with_the_clis_exit_3(tmp_path, script, argv):
    proc = _run(sys.executable, str(REPO / "scripts" / script), *[a.replace("{tmp}", str(tmp_path)) for a in argv])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == arguments.EXIT_NO_GPU == 3 and len(lines) == 1, proc.stderr[-2000:]
    assert "GPU" in lines[0] or "CUDA" in lines[0]


@pytest.mark.parametrize("argv, message", [
    (["--device", "nosuch", "true"], "error: --device 'nosuch': allowed cuda, cpu"),
    (["--bogus"], "error: unknown option '--bogus' (the command to run goes after --)"),
    (["--wait", "abc", "true"], "error: --wait 'abc': need a non-negative number"),
    (["--log"], "error: --log needs a value"),
])
def test_bench_clean_refuses_a_bad_option_before_anything_runs(tmp_path, argv, message):
    proc = _run("bash", str(REPO / "scripts" / "bench_clean.sh"), *argv)
    assert proc.returncode == 2 and proc.stderr.strip() == message and proc.stdout == ""


def test_nightly_says_run_matrix_failed_with_its_exit_code(tmp_path):
    """A failing run-matrix reaches the script's own line (the retry helper leaves the caller's errexit as it was)."""
    proc = _run("bash", str(REPO / "scripts" / "nightly.sh"), "--device", "cpu", "--results-root",
                str(tmp_path / "runs"), "--only", "nothing*")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "!! run-matrix failed (exit 2)"
