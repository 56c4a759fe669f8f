"""Faults and bad input, driven through the real CLI: every case exits with its code and one line naming the
culprit (file, field, option, value), never a traceback, and nothing measured is lost.

Two ways in, both the real entry point (`attnbench.cli.main` with an argv):
- in-process (`cli`) for input that is refused before anything runs: fast, so every bad input gets a case;
- a subprocess (`cli_process`) for whatever needs a process of its own: real measurements, a crash
  simulated in the files it leaves, Ctrl-C (SIGINT), two resumes of one run, a lock held by another pid.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from attnbench import cli as cli_mod
from attnbench.store import HEADER_LINE, TORN_FILE, RunStore, load_run

REPO = Path(__file__).resolve().parent.parent
H100_BASELINE = REPO / "results" / "baselines" / "h100"

TINY = """name: tiny
defaults: {batch: 1, heads: 1, head_dim: 32, timing: {warmup_ms: 0, rep_ms: 1, min_reps: 3, max_reps: 3, flush_l2: false},
           retry: {max_attempts: 1, backoff_s: 0}}
cells:
  - {id: a, kernel: flash, baseline: math, dtype: float32, mode: fwd, seq_lens: [16, 32, 48]}
"""


# -- the two ways in -----------------------------------------------------------------------------------

class Result:
    def __init__(self, code, out, err):
        self.code, self.out, self.err = code, out, err

    @property
    def err_lines(self):
        return [line for line in self.err.splitlines() if line.strip()]


def cli(capsys, *args) -> Result:
    """`attnbench ARGS` in this process. An exception escaping main() is what a user would see as a traceback."""
    capsys.readouterr()
    code = None
    try:
        cli_mod.main([str(a) for a in args])
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:   # noqa: BLE001 - the test reports it as the traceback it would be
        captured = capsys.readouterr()
        pytest.fail(f"attnbench {' '.join(map(str, args))}: traceback ({type(exc).__name__}: {exc})\n{captured.err}")
    captured = capsys.readouterr()
    return Result(code, captured.out, captured.err)


def _env():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)    # the CLI sets it itself for --device cpu
    env.pop("COLUMNS", None)
    return env


def sigint_default():
    """preexec_fn of the Ctrl-C tests' CLI processes: SIGINT at its default disposition. A shell's background job
    (`cmd &` without job control, as a CI step may be started) runs with SIGINT ignored, its children inherit that,
    and Python then installs no KeyboardInterrupt handler, so the test's Ctrl-C would never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def cli_process(*args, cwd=REPO, timeout=300) -> Result:
    proc = subprocess.run([sys.executable, "-m", "attnbench", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=_env(), timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def assert_one_line(result: Result, code: int, *culprits: str) -> str:
    """Exit `code`, exactly one line on stderr, no traceback, and the line names every culprit."""
    assert "Traceback" not in result.err, result.err
    assert result.code == code, (result.code, result.err)
    assert len(result.err_lines) == 1, result.err
    line = result.err_lines[0]
    for culprit in culprits:
        assert culprit in line, (culprit, line)
    return line


# -- bad matrix files -------------------------------------------------------------------------------------

CELL = "{id: a, kernel: flash, baseline: math, dtype: float32, mode: fwd, seq_lens: [16]"
BASE = "defaults: {batch: 1, heads: 1, head_dim: 32}\n"


def matrix_with(cell_extra: str = "", top: str = "", defaults: str = BASE) -> str:
    return f"{top}{defaults}cells:\n  - {CELL}{cell_extra}}}\n"


def _alias_bomb() -> str:
    # 574 bytes of YAML that would expand to 9**9 (387 million) strings
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\ncells: *i\n"


BAD_MATRICES = {
    # id: (file content, what the one line must name)
    "name-escapes-results-root": (matrix_with(top="name: ../../../escaped\n"), ["field 'name'", "../../../escaped"]),
    "name-with-slash": (matrix_with(top="name: a/b\n"), ["field 'name'", "a/b"]),
    "name-dot-dot": (matrix_with(top="name: '..'\n"), ["field 'name'", "'..'"]),
    "binary-file": (bytes(range(256)) * 4, ["not UTF-8 text"]),
    "latin-1-file": (("name: caf\xe9\n" + matrix_with()).encode("latin-1"), ["not UTF-8 text", "0xe9"]),
    "nul-character": ("name: a\x00b\n" + matrix_with(), ["unacceptable character #x0000"]),
    "over-1-mb": ("# " + "x" * (1 << 20) + "\n" + matrix_with(), ["bytes", "at most 1,048,576"]),
    "alias-bomb": (_alias_bomb(), ["expands to more than 100,000"]),
    "recursive-alias": ("cells: &c [*c]\n", ["alias that contains itself"]),
    "nested-too-deep": ("cells: " + "[" * 1200 + "]" * 1200 + "\n", ["nested too deeply"]),
    "two-documents": (matrix_with() + "---\n" + matrix_with(), ["single document"]),
    "yaml-syntax": ("cells: [\n  {id: a\n", ["YAML syntax error at line 3"]),
    "duplicate-top-key": (matrix_with(top="name: x\nname: y\n"), ["line 2", "duplicate key 'name'"]),
    "duplicate-cell-key": (f"{BASE}cells:\n  - {{id: a, kernel: flash, kernel: math, baseline: math, dtype: float32, "
                           "mode: fwd, seq_lens: [16]}\n", ["line 3", "duplicate key 'kernel'"]),
    "min-reps-over-max-reps": (matrix_with(", timing: {min_reps: 10, max_reps: 3}"),
                               ["cell 'a'", "timing.max_reps", "3", "timing.min_reps (10)"]),
    "reps-not-integer": (matrix_with(", timing: {min_reps: 2.5}"), ["timing.min_reps", "2.5"]),
    "timing-nan": (matrix_with(", timing: {rep_ms: .nan}"), ["timing.rep_ms", "nan"]),
    "flush-l2-quoted-no": (matrix_with(", timing: {flush_l2: 'no'}"), ["timing.flush_l2", "'no'", "true, false"]),
    "allow-skip-quoted-no": (matrix_with(", allow_skip: 'no'"), ["allow_skip", "'no'", "true, false"]),
    "causal-string": (matrix_with(", causal: 'yes'"), ["causal", "'yes'"]),
    "unknown-precision": (f"{BASE}cells:\n  - {{id: e, kernel: elsa, baseline: math, dtype: float32, mode: fwd, "
                          "seq_lens: [16], kernel_options: {precision: fp64}}\n",
                          ["cell 'e'", "kernel_options.precision", "'fp64'", "tf32x3"]),
    "unknown-state-dtype": ("defaults: {batch: 1, heads: 1, head_dim: 64}\ncells:\n  - {id: p, kernel: pasa, "
                            "baseline: math, dtype: float16, mode: fwd, seq_lens: [16], kernel_options: "
                            "{state_dtype: bf16}}\n", ["kernel_options.state_dtype", "'bf16'"]),
    "unknown-option": (matrix_with(", kernel_options: {tile: 64}"), ["kernel_options.tile", "unknown option"]),
    "gate-util-over-100": (matrix_with(top="gate: {max_util_pct: 150}\n"), ["gate.max_util_pct", "150"]),
    "min-clock-frac-over-1": (matrix_with(", retry: {min_clock_frac: 2}"), ["retry.min_clock_frac", "2"]),
    "inputs-exceed-memory": (matrix_with().replace("seq_lens: [16]", "seq_lens: [16, 1099511627776]"),
                             ["cell 'a'", "seq_lens", "1099511627776", "bytes", "of RAM"]),
    "unknown-backend": (matrix_with().replace("kernel: flash", "kernel: flashy"), ["unknown backend 'flashy'"]),
    "kv-heads-not-a-divisor": (matrix_with(", heads: 4, kv_heads: 3"),
                               ["cell 'a'", "field 'kv_heads' = 3", "divisor of heads (4): 1, 2, 4"]),
    "q-len-not-a-rule": (matrix_with(", q_len: 'N/x'"), ["cell 'a'", "field 'q_len' = 'N/x'", "N, N/k, N*k"]),
    "q-len-does-not-divide": (matrix_with(", q_len: N/3"), ["field 'q_len' = 'N/3'", "seq_lens has 16, not a multiple of 3"]),
    "lengths-both-fixed": (matrix_with(", q_len: 8, kv_len: 32"), ["'q_len' = 8", "'kv_len' = 32", "both fixed"]),
    "compile-on-an-attention-cell": (matrix_with(", compile: true"), ["unknown key 'compile' for an attention cell"]),
    "top-level-list": ("- a\n- b\n", ["top level must be a mapping"]),
    "empty-file": ("", ["top level must be a mapping"]),
}


@pytest.mark.parametrize("case", sorted(BAD_MATRICES))
def test_bad_matrix_is_one_line_exit_2(tmp_path, capsys, case):
    content, culprits = BAD_MATRICES[case]
    path = tmp_path / "bad.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    for args in (["run-matrix", path, "--device", "cpu", "--dry-run"],
                 ["run-matrix", path, "--device", "cpu", "--results-root", tmp_path / "runs"],
                 ["spot-check", path, "--device", "cpu", "--results-root", tmp_path / "runs"]):
        assert_one_line(cli(capsys, *args), 2, str(path), *culprits)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    assert not (tmp_path.parent / "escaped").exists()


def test_a_bad_matrix_through_a_real_process(tmp_path):
    """The in-process cases above and a real process say the same."""
    path = tmp_path / "bad.yaml"
    path.write_text(matrix_with(top="name: ../../../escaped\n"))
    assert_one_line(cli_process("run-matrix", path, "--device", "cpu", "--results-root", tmp_path / "runs"), 2,
                    str(path), "field 'name'")


def test_a_matrix_name_cannot_leave_the_results_root(tmp_path):
    """Defence in depth: the store refuses an unsafe name even from a caller that skipped the matrix checks."""
    from attnbench.store import RunDirError

    for name in ("../x", "a/b", "..", ""):
        with pytest.raises(RunDirError, match="not a safe directory name"):
            RunStore.create(tmp_path / "runs", name, {})
    assert not (tmp_path / "x").exists()


# -- bad options --------------------------------------------------------------------------------------------

def _tiny(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path


BAD_OPTIONS = {
    # id: (arguments after `run-matrix TINY --device cpu`, culprits)
    "max-attempts-0": (["--max-attempts", "0"], ["--max-attempts 0", "≥ 1"]),
    "max-attempts-negative": (["--max-attempts", "-3"], ["--max-attempts -3"]),
    "max-attempts-not-a-number": (["--max-attempts", "x"], ["--max-attempts", "'x'", "valid int"]),
    "min-free-gb-negative": (["--min-free-gb", "-1"], ["--min-free-gb -1", "≥ 0"]),
    "max-util-over-100": (["--max-util", "101"], ["--max-util 101", "[0, 100]"]),
    "max-util-negative": (["--max-util", "-1"], ["--max-util -1"]),
    "max-util-nan": (["--max-util", "nan"], ["--max-util nan"]),
    "wait-negative": (["--wait", "-5"], ["--wait -5"]),
    "slowdown-unused-backend": (["--slowdown", "cudnn=2"], ["--slowdown 'cudnn=2'", "flash, math"]),
    "slowdown-malformed": (["--slowdown", "flash"], ["--slowdown 'flash'", "BACKEND=FACTOR"]),
    "slowdown-zero": (["--slowdown", "flash=0"], ["--slowdown 'flash=0'", "> 1"]),
    "slowdown-one": (["--slowdown", "flash=1"], ["--slowdown 'flash=1'", "> 1"]),
    "slowdown-nan": (["--slowdown", "flash=nan"], ["--slowdown 'flash=nan'", "finite"]),
    "slowdown-twice": (["--slowdown", "flash=1.2", "--slowdown", "flash=1.5"], ["--slowdown 'flash=1.5'", "already"]),
    "only-matches-nothing": (["--only", "zzz*"], ["--only 'zzz*'", "no cell"]),
    "only-empty": (["--only", " "], ["--only ''", "glob"]),
    "gpu-on-the-cpu": (["--gpu", "0"], ["--gpu", "--device cpu"]),
    "dry-run-and-resume": (["--dry-run", "--resume", "{tmp}"], ["--dry-run", "--resume"]),
    "unknown-option": (["--fast"], ["No such option: --fast"]),
    "results-root-is-a-file": (["--results-root", "{file}"], ["{file}", "not a folder"]),
    "results-root-under-a-file": (["--results-root", "{file}/runs"], ["{file}/runs", "cannot create"]),
    "resume-not-a-run-dir": (["--resume", "{tmp}"], ["{tmp}", "not a run directory"]),
    "resume-missing": (["--resume", "{tmp}/nowhere"], ["{tmp}/nowhere", "not a run directory"]),
}


@pytest.mark.parametrize("case", sorted(BAD_OPTIONS))
def test_bad_option_is_one_line_exit_2(tmp_path, capsys, case):
    extra, culprits = BAD_OPTIONS[case]
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    fill = {"{file}": str(a_file), "{tmp}": str(tmp_path)}

    def sub(text):
        for key, value in fill.items():
            text = text.replace(key, value)
        return text

    args = ["run-matrix", _tiny(tmp_path), "--device", "cpu"] + [sub(a) for a in extra]
    if "--results-root" not in extra:
        args += ["--results-root", tmp_path / "runs"]
    assert_one_line(cli(capsys, *args), 2, *[sub(c) for c in culprits])
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_results_root(tmp_path, capsys):
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o555)
    try:
        assert_one_line(cli(capsys, "run-matrix", _tiny(tmp_path), "--device", "cpu", "--results-root", root), 2,
                        str(root), "not writable")
    finally:
        root.chmod(0o755)


OTHER_COMMANDS = {
    # id: (arguments, culprits)
    "spot-check-gpu-on-the-cpu": (["spot-check", "{tiny}", "--device", "cpu", "--gpu", "0"], ["--gpu", "--device cpu"]),
    "gate-tolerance-negative": (["gate", "--baseline", "{run}", "--current", "{run}", "--tolerance", "-1"],
                                ["--tolerance -1", "(0, 1)"]),
    "gate-tolerance-zero": (["gate", "--baseline", "{run}", "--current", "{run}", "--tolerance", "0"], ["--tolerance 0"]),
    "gate-tolerance-one": (["gate", "--baseline", "{run}", "--current", "{run}", "--tolerance", "1"], ["--tolerance 1"]),
    "gate-tolerance-nan": (["gate", "--baseline", "{run}", "--current", "{run}", "--tolerance", "nan"],
                           ["--tolerance nan"]),
    "gate-baseline-missing": (["gate", "--baseline", "{tmp}/nowhere", "--current", "{run}"], ["{tmp}/nowhere"]),
    "gate-out-unwritable": (["gate", "--baseline", "{complete}", "--current", "{run}", "--out", "{tmp}/no/dir/gate.md"],
                            ["{tmp}/no/dir/gate.md", "cannot write"]),
    "report-not-a-run": (["report", "{tmp}", "--no-plots"], ["{tmp}", "not a run directory"]),
    "report-out-unwritable": (["report", "{run}", "--no-plots", "--out", "{file}/r.md"], ["{file}/r.md", "{file}"]),
    "runs-missing-root": (["runs", "{tmp}/nowhere"], ["{tmp}/nowhere", "no such folder"]),
    "runs-empty-root": (["runs", "{tmp}/empty"], ["{tmp}/empty", "no run directories"]),
    "spot-check-max-util": (["spot-check", "--device", "cpu", "--max-util", "200"], ["--max-util 200"]),
    "gpu-status-max-util": (["gpu-status", "--max-util", "-3"], ["--max-util -3"]),
    "device-unknown": (["run-matrix", "{tiny}", "--device", "gpu"], ["--device 'gpu'", "cuda, cpu"]),
    "command-unknown": (["benchmark"], ["No such command 'benchmark'"]),
    "argument-missing": (["run-matrix"], ["Missing argument"]),
    "accuracy-n-zero": (["accuracy", "--device", "cpu", "--n", "0"], ["--n 0"]),
}


@pytest.mark.parametrize("case", sorted(OTHER_COMMANDS))
def test_bad_input_to_other_commands_is_one_line_exit_2(tmp_path, capsys, complete_run, case):
    args, culprits = OTHER_COMMANDS[case]
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    (tmp_path / "empty").mkdir()
    run = tmp_path / "run"
    shutil.copytree(complete_run, run)
    fill = {"{run}": str(run), "{complete}": str(complete_run), "{tmp}": str(tmp_path), "{file}": str(a_file),
            "{tiny}": str(_tiny(tmp_path))}

    def sub(text):
        for key, value in fill.items():
            text = text.replace(key, value)
        return text

    assert_one_line(cli(capsys, *[sub(a) for a in args]), 2, *[sub(c) for c in culprits])


# -- the run directory: crashes, locks, resume ----------------------------------------------------------------

@pytest.fixture(scope="module")
def complete_run(tmp_path_factory) -> Path:
    """One real CPU run of TINY (3 points), made once; tests copy it before damaging it."""
    root = tmp_path_factory.mktemp("complete")
    matrix = root / "tiny.yaml"
    matrix.write_text(TINY)
    result = cli_process("run-matrix", "tiny.yaml", "--device", "cpu", "--results-root", "runs", cwd=root)
    assert result.code == 0, result.err[-2000:]
    (run_dir,) = (root / "runs").iterdir()
    return run_dir


def crashed_copy(complete_run: Path, tmp_path: Path) -> Path:
    """The complete run as a crash would have left it before its end: not finished, not marked interrupted."""
    run = tmp_path / "runs" / complete_run.name
    shutil.copytree(complete_run, run)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest.update(finished_utc=None, interrupted=False)
    (run / "manifest.json").write_text(json.dumps(manifest))
    shutil.copy(complete_run.parent.parent / "tiny.yaml", tmp_path / "tiny.yaml")
    return run


def data_lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)[1:]


def resume(run: Path, tmp_path: Path, capsys=None) -> Result:
    """`attnbench run-matrix tiny.yaml --device cpu --resume RUN`: in this process when given capsys, else in its own."""
    args = ["run-matrix", tmp_path / "tiny.yaml", "--device", "cpu", "--resume", run]
    return cli(capsys, *args) if capsys is not None else cli_process(*args)


def assert_counted(result: Result, ids: list[str], first: int, total: int = 3) -> None:
    """Not a terminal (as in CI): each point's line starts with its count and the ETA, which no bar shows there."""
    import re

    lines = [line for line in result.err_lines if " lat_ratio " in line]
    assert len(lines) == len(ids), lines
    for k, (line, point) in enumerate(zip(lines, ids), first):
        assert re.match(rf"\[{k}/{total}, ETA \d+:\d\d:\d\d\] {re.escape(point)}: ", line), line
    assert lines[-1].startswith(f"[{total}/{total}, ETA 0:00:00] ")


def assert_points_once_each(run: Path, ids=("a@16", "a@32", "a@48")):
    pts = pd.read_csv(run / "points.csv")
    assert sorted(pts.point_id) == sorted(ids), pts.point_id.tolist()
    assert len(HEADER_LINE.split(",")) == pts.shape[1]


def test_torn_last_row_of_points_csv(tmp_path, capsys, complete_run):
    run = crashed_copy(complete_run, tmp_path)
    kept = data_lines(run / "points.csv")[:2]
    torn = data_lines(run / "points.csv")[2][:37]
    (run / "points.csv").write_bytes(HEADER_LINE.encode() + b"".join(kept) + torn)
    # readers: the run reads, the torn row is left out and named; nothing is changed by reading
    before = (run / "points.csv").read_bytes()
    listed = cli(capsys, "runs", run.parent)
    assert listed.code == 0 and "2/3" in listed.out and "torn last line of points.csv" in listed.out
    assert cli(capsys, "report", run, "--no-plots", "--out", tmp_path / "r.md").code == 0
    assert "torn last line of points.csv" in (tmp_path / "r.md").read_text()
    baseline = tmp_path / "baseline"           # the same run under its own name: a run is not gated against itself
    shutil.copytree(complete_run, baseline)
    gated = cli(capsys, "gate", "--baseline", baseline, "--current", run, "--out", tmp_path / "g.md")
    assert gated.code == 0 and f"warning: {run}: torn last line of points.csv" in gated.err
    assert "MISSING" in (tmp_path / "g.md").read_text()
    assert (run / "points.csv").read_bytes() == before and not (run / TORN_FILE).exists()
    # resume: the torn row is set aside (kept), its point measured again, the other rows untouched
    result = resume(run, tmp_path, capsys)
    assert result.code == 0, result.err[-2000:]
    assert "torn last row" in result.err and "a@48" in result.err
    assert_counted(result, ["a@48"], first=3)
    assert data_lines(run / "points.csv")[:2] == kept
    assert_points_once_each(run)
    (aside,) = [json.loads(line) for line in (run / TORN_FILE).read_text().splitlines()]
    assert aside["file"] == "points.csv" and aside["text"].encode() == torn
    assert load_run(run).manifest["finished_utc"] and load_run(run).torn == []


def test_torn_last_record_of_attempts_jsonl(tmp_path, capsys, complete_run):
    run = crashed_copy(complete_run, tmp_path)
    # the crash came while the third point's attempt was written: its row was never reached
    lines = (run / "attempts.jsonl").read_bytes().splitlines(keepends=True)
    rows = data_lines(run / "points.csv")
    torn = lines[2][: len(lines[2]) // 2]
    (run / "attempts.jsonl").write_bytes(b"".join(lines[:2]) + torn)
    (run / "points.csv").write_bytes(HEADER_LINE.encode() + b"".join(rows[:2]))
    assert [a["point_id"] for a in load_run(run).attempts] == ["a@16", "a@32"]
    assert load_run(run).torn == ["attempts.jsonl"]
    result = resume(run, tmp_path, capsys)
    assert result.code == 0, result.err[-2000:]
    assert "torn last record" in result.err
    assert (run / "attempts.jsonl").read_bytes().startswith(b"".join(lines[:2]))
    assert [a["point_id"] for a in load_run(run).attempts] == ["a@16", "a@32", "a@48"]
    assert data_lines(run / "points.csv")[:2] == rows[:2]
    assert_points_once_each(run)
    (aside,) = [json.loads(line) for line in (run / TORN_FILE).read_text().splitlines()]
    assert aside["file"] == "attempts.jsonl" and aside["text"].encode() == torn


def test_remeasured_point_is_judged_by_its_new_attempt(tmp_path, complete_run):
    """A point re-measured after a torn row counts its attempts from 1 again: the gate and the report must use
    the newest attempt (the last in the file), not an older one with a higher attempt number."""
    from attnbench.store import final_attempts

    run = crashed_copy(complete_run, tmp_path)
    lines = (run / "attempts.jsonl").read_text().splitlines(keepends=True)
    old = json.loads(lines[2])
    old.update(attempt=2, status="noisy")
    new = json.loads(lines[2])
    (run / "attempts.jsonl").write_text("".join(lines[:2]) + json.dumps(old) + "\n" + json.dumps(new) + "\n")
    assert final_attempts(load_run(run))["a@48"]["status"] == new["status"] and \
        final_attempts(load_run(run))["a@48"]["attempt"] == 1


@pytest.mark.parametrize("damage", ["empty", "torn-header"])
def test_points_csv_without_its_header(tmp_path, capsys, complete_run, damage):
    run = crashed_copy(complete_run, tmp_path)
    (run / "points.csv").write_text("" if damage == "empty" else HEADER_LINE[:20])
    listed = cli(capsys, "runs", run.parent)
    assert listed.code == 0 and "0/3" in listed.out
    result = resume(run, tmp_path, capsys)
    assert result.code == 0, result.err[-2000:]
    assert "header restored" in result.err
    assert_counted(result, ["a@16", "a@32", "a@48"], first=1)
    assert (run / "points.csv").read_bytes().startswith(HEADER_LINE.encode())
    assert_points_once_each(run)


def test_a_finished_run_that_lost_rows_is_not_complete(tmp_path, capsys, complete_run):
    run = tmp_path / "runs" / complete_run.name
    shutil.copytree(complete_run, run)
    shutil.copy(complete_run.parent.parent / "tiny.yaml", tmp_path / "tiny.yaml")
    (run / "points.csv").write_text("")
    listed = cli(capsys, "runs", run.parent)
    (row,) = [line for line in listed.out.splitlines() if run.name in line and "│" in line]
    assert "0/3" in row and "complete" not in row and "interrupted" in row
    assert resume(run, tmp_path, capsys).code == 0
    assert_points_once_each(run)


CORRUPT = {
    # id: (file, content, culprits)
    "points-csv-middle-row": ("points.csv", lambda rows: HEADER_LINE + rows[0][:30] + "\r\n" + rows[1],
                              ["points.csv:2", "fields"]),
    "points-csv-other-columns": ("points.csv", lambda rows: "a,b,c\r\n", ["points.csv", "missing columns"]),
    "attempts-middle-record": ("attempts.jsonl", lambda rows: '{"point_id": "a@1\n{}\n', ["attempts.jsonl:1",
                                                                                           "invalid JSON"]),
    "attempts-not-objects": ("attempts.jsonl", lambda rows: "[1, 2]\n", ["attempts.jsonl:1", "JSON object"]),
    "manifest-a-list": ("manifest.json", lambda rows: "[1, 2]", ["manifest.json", "must be a JSON object"]),
    "manifest-invalid": ("manifest.json", lambda rows: "{", ["manifest.json", "invalid JSON"]),
    "manifest-binary": ("manifest.json", lambda rows: "\udcff", ["manifest.json", "not UTF-8"]),
    "points-csv-ratio-not-a-number": ("points.csv",
                                      lambda rows: HEADER_LINE + rows[0] + _with(rows[1], "lat_ratio", "fast"),
                                      ["points.csv:3", "column 'lat_ratio'", "'fast' is not a number"]),
    "points-csv-n-not-a-number": ("points.csv", lambda rows: HEADER_LINE + _with(rows[0], "n", "x16") + rows[1],
                                  ["points.csv:2", "column 'n'", "'x16' is not a number"]),
}


def _with(row: str, column: str, value: str) -> str:
    """A points.csv row (its text) with one column's value replaced."""
    import csv
    import io

    fields = next(csv.reader([row]))
    fields[HEADER_LINE.strip().split(",").index(column)] = value
    buf = io.StringIO()
    csv.writer(buf).writerow(fields)
    return buf.getvalue()


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_run_directory(tmp_path, capsys, complete_run, case):
    """Corruption (not a torn last line) is one line naming the file and line for every command that reads the
    run, and `runs` still lists the other runs."""
    name, content, culprits = CORRUPT[case]
    run = crashed_copy(complete_run, tmp_path)
    healthy = tmp_path / "runs" / "healthy"
    shutil.copytree(complete_run, healthy)
    rows = [line.decode() for line in data_lines(run / "points.csv")]
    (run / name).write_bytes(content(rows).encode("utf-8", "surrogateescape"))
    for args in (["report", run, "--no-plots", "--out", tmp_path / "r.md"],
                 ["gate", "--baseline", healthy, "--current", run, "--out", tmp_path / "g.md"],
                 ["run-matrix", tmp_path / "tiny.yaml", "--device", "cpu", "--resume", run]):
        assert_one_line(cli(capsys, *args), 2, str(run), *culprits)
    listed = cli(capsys, "runs", run.parent)
    assert listed.code == 0 and "unreadable" in listed.out and "healthy" in listed.out and "3/3" in listed.out


@pytest.mark.parametrize("field, value, said", [("argv", 5, "must be a list, found 5"),
                                                ("pool", "x", 'must be an object, found "x"'),
                                                ("matrix_path", 5, "must be a string, found 5"),
                                                ("gpu", "str", 'must be an object, found "str"')])
def test_manifest_field_of_the_wrong_type(tmp_path, capsys, complete_run, field, value, said):
    """Valid JSON with a field of the wrong type is an unreadable run: one line naming the file and the field."""
    run = crashed_copy(complete_run, tmp_path)
    healthy = tmp_path / "runs" / "healthy"
    shutil.copytree(complete_run, healthy)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest[field] = value
    (run / "manifest.json").write_text(json.dumps(manifest))
    culprits = [f"{run}/manifest.json", f"field {field!r}", said]
    for args in (["report", run, "--no-plots", "--out", tmp_path / "r.md"],
                 ["gate", "--baseline", healthy, "--current", run, "--out", tmp_path / "g.md"],
                 ["run-matrix", tmp_path / "tiny.yaml", "--device", "cpu", "--resume", run]):
        assert_one_line(cli(capsys, *args), 2, *culprits)
    listed = cli(capsys, "runs", run.parent)
    assert listed.code == 0 and "3/3" in listed.out and "Traceback" not in listed.err
    (row,) = [line for line in listed.out.splitlines() if run.name in line]
    assert "unreadable" in row and all(c in row for c in culprits)


@pytest.mark.parametrize("name", ["manifest.json", "points.csv", "attempts.jsonl"])
def test_unreadable_run_file_is_one_line(tmp_path, capsys, complete_run, monkeypatch, name):
    """A run file this user may not read (EACCES, simulated: the tests may run as root) is one line naming it for
    every command that reads the run; `runs` lists it as unreadable and --dry-run passes over it."""
    import errno
    import pathlib

    run = crashed_copy(complete_run, tmp_path)
    healthy = tmp_path / "runs" / "healthy"
    shutil.copytree(complete_run, healthy)
    read_bytes = pathlib.Path.read_bytes

    def refused(self):
        if self == run / name:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return read_bytes(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", refused)
    culprits = [f"{run / name}: cannot read (Permission denied)"]
    for args in (["report", run, "--no-plots", "--out", tmp_path / "r.md"],
                 ["gate", "--baseline", healthy, "--current", run, "--out", tmp_path / "g.md"],
                 ["gate", "--bless", run, "--baselines-root", tmp_path / "baselines"],
                 ["spot-check", "--rescore", run],
                 ["run-matrix", tmp_path / "tiny.yaml", "--device", "cpu", "--resume", run]):
        assert_one_line(cli(capsys, *args), 2, *culprits)
    listed = cli(capsys, "runs", run.parent)
    assert listed.code == 0 and "unreadable" in listed.out and culprits[0] in listed.out and "3/3" in listed.out
    planned = cli(capsys, "run-matrix", tmp_path / "tiny.yaml", "--device", "cpu", "--dry-run",
                  "--results-root", run.parent)
    # the healthy run's time (a few seconds: 0.0 or 0.1 min, by the machine), for its 3 points
    assert planned.code == 0 and re.search(r"last time \d+\.\d min for 3 of them", planned.out), planned.err


def test_resume_of_a_complete_run_changes_nothing(tmp_path, capsys, complete_run):
    run = tmp_path / "runs" / complete_run.name
    shutil.copytree(complete_run, run)
    shutil.copy(complete_run.parent.parent / "tiny.yaml", tmp_path / "tiny.yaml")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    result = resume(run, tmp_path, capsys)
    assert result.code == 0 and "already complete" in result.err, result.err[-2000:]
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_resume_on_another_device_is_refused(tmp_path, capsys, complete_run):
    run = crashed_copy(complete_run, tmp_path)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["device"] = "cuda"
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert_one_line(cli(capsys, "run-matrix", tmp_path / "tiny.yaml", "--device", "cpu", "--resume", run), 2,
                    str(run), "--device cuda")


def test_a_locked_run_directory_names_the_holder(tmp_path, capsys, complete_run):
    run = crashed_copy(complete_run, tmp_path)
    rows = data_lines(run / "points.csv")
    (run / "points.csv").write_bytes(HEADER_LINE.encode() + rows[0])
    holder = RunStore(run)
    holder.lock()
    try:
        result = resume(run, tmp_path)
        assert_one_line(result, 2, str(run), f"pid {os.getpid()}")
        assert data_lines(run / "points.csv") == rows[:1]
    finally:
        holder.unlock()
    assert not (run / ".lock").exists()
    assert resume(run, tmp_path, capsys).code == 0
    assert data_lines(run / "points.csv")[:1] == rows[:1]
    assert_points_once_each(run)


def test_a_lock_taken_a_moment_before_its_pid_is_written_still_names_it(tmp_path):
    """The window two resumes started together can meet: one holds the lock but has not written its pid yet. The
    refused one reads again until it is there (within a second) instead of naming "pid unknown"."""
    import fcntl
    import threading

    from attnbench.store import LOCK_FILE, RunDirError

    store = RunStore.create(tmp_path / "runs", "tiny", {"argv": []})
    store.unlock()
    fd = os.open(store.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    late = threading.Timer(0.2, lambda: os.pwrite(fd, b"4242\n", 0))
    late.start()
    try:
        with pytest.raises(RunDirError, match=r"in use by another attnbench process \(pid 4242\)"):
            RunStore(store.path).lock()
    finally:
        late.join()
        os.close(fd)


def test_two_resumes_of_one_run_never_interleave(tmp_path):
    """Started together, one resume measures and the other is refused naming its pid (or, if it came late,
    finds the run complete): every point is stored exactly once."""
    matrix = tmp_path / "tiny.yaml"
    matrix.write_text(TINY.replace("seq_lens: [16, 32, 48]", "seq_lens: [16, 24, 32, 40, 48]"))
    store = RunStore.create(tmp_path / "runs", "tiny", {"matrix_path": str(matrix), "device": "cpu",
                                                         "matrix_sha256": "", "plan_sha256": _plan(matrix),
                                                         "finished_utc": None, "argv": []})
    store.unlock()
    cmd = [sys.executable, "-m", "attnbench", "run-matrix", str(matrix), "--device", "cpu", "--resume", str(store.path)]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.pid, p.wait(timeout=300), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    codes = sorted(code for _, code, _ in results)
    assert codes in ([0, 0], [0, 2]), results
    for pid, code, err in results:
        if code == 2:
            other = next(q for q, _, _ in results if q != pid)
            assert f"pid {other}" in err and "Traceback" not in err
    ids = pd.read_csv(store.path / "points.csv").point_id.tolist()
    assert sorted(ids) == sorted(f"a@{n}" for n in (16, 24, 32, 40, 48))


def _plan(matrix: Path) -> str:
    from attnbench.matrix import load_matrix

    return load_matrix(matrix, device="cpu").plan_sha256()


# -- a run directory that cannot be written ---------------------------------------------------------------------

def _fail_writes(monkeypatch, path_suffix: str, after: int, err: int):
    """os.write to a file whose path ends with `path_suffix` fails with `err` from its `after`-th call on (the
    first failing record is half written first: a disk that fills up mid-record). The tests may run as root, where
    permissions do not stop a write: the OS error is simulated."""
    import errno as errno_mod

    real_write, calls = os.write, []

    def write(fd, data):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if not target.endswith(path_suffix):
            return real_write(fd, data)
        calls.append(len(data))
        if len(calls) < after:
            return real_write(fd, data)
        if len(calls) == after and len(data) > 1:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(err, os.strerror(err))

    assert err in (errno_mod.ENOSPC, errno_mod.EACCES)
    monkeypatch.setattr(os, "write", write)


def assert_write_error(result: Result, run: Path, culprits) -> str:
    """Exit 6, no traceback, one error line naming the culprits, and last the command that finishes the run."""
    assert "Traceback" not in result.err, result.err
    assert result.code == 6, (result.code, result.err)
    (line,) = [line for line in result.err_lines if line.startswith("error:")]
    for culprit in culprits:
        assert culprit in line, (culprit, line)
    assert f"everything measured is kept in {run}" in line
    hint = result.err_lines[-1]
    assert shlex.split(hint)[-2:] == ["--resume", str(run)], hint
    return hint


def test_an_atomic_json_write_that_fails_leaves_the_old_file_and_nothing_beside_it(tmp_path, monkeypatch):
    import errno

    from kernels import _tuning

    path = tmp_path / "manifest.json"
    _tuning.write_json_atomic(path, {"a": 1})

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_tuning.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        _tuning.write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1} and [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_a_disk_full_mid_run_stops_it_resumably(tmp_path, capsys, monkeypatch):
    """ENOSPC while the second point's attempt is appended: one line naming attempts.jsonl and the OS error, the
    command that finishes the run, exit 6; the half-written record is cut off again, the first point kept, the
    manifest says interrupted; the command finishes the run once the disk has room."""
    import errno

    _fail_writes(monkeypatch, "attempts.jsonl", after=2, err=errno.ENOSPC)
    result = cli(capsys, "run-matrix", _tiny(tmp_path), "--device", "cpu", "--results-root", tmp_path / "runs")
    monkeypatch.undo()
    (run,) = (tmp_path / "runs").iterdir()
    assert_write_error(result, run, [f"{run}/attempts.jsonl: cannot write (No space left on device)"])
    assert [json.loads(line)["point_id"] for line in (run / "attempts.jsonl").read_text().splitlines(True)] == ["a@16"]
    assert (run / "attempts.jsonl").read_bytes().endswith(b"\n")
    kept = data_lines(run / "points.csv")
    assert len(kept) == 1 and json.loads((run / "manifest.json").read_text())["interrupted"] is True
    listed = cli(capsys, "runs", run.parent)
    assert "1/3" in listed.out and "interrupted" in listed.out
    assert cli(capsys, "run-matrix", _tiny(tmp_path), "--device", "cpu", "--resume", run).code == 0
    assert data_lines(run / "points.csv")[:1] == kept
    assert_points_once_each(run)


def test_an_unwritable_manifest_at_the_end_keeps_every_point(tmp_path, capsys, monkeypatch):
    """EACCES when the finished run's manifest is written: one line naming manifest.json, exit 6, every point kept;
    the resume measures nothing and marks it finished."""
    import errno

    from attnbench import store as store_mod

    real, calls = store_mod.write_json_atomic, []

    def write_json_atomic(path, obj, **kw):
        calls.append(path)
        if len(calls) > 1:   # the manifest of the new run is written; then the disk refuses
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path) + ".tmp")
        return real(path, obj, **kw)

    monkeypatch.setattr(store_mod, "write_json_atomic", write_json_atomic)
    result = cli(capsys, "run-matrix", _tiny(tmp_path), "--device", "cpu", "--results-root", tmp_path / "runs")
    monkeypatch.undo()
    (run,) = (tmp_path / "runs").iterdir()
    assert_write_error(result, run, [f"{run}/manifest.json: cannot write (Permission denied)"])
    assert_points_once_each(run)
    resumed = cli(capsys, "run-matrix", _tiny(tmp_path), "--device", "cpu", "--resume", run)
    assert resumed.code == 0 and "0/3 points to measure" in resumed.err, resumed.err
    assert json.loads((run / "manifest.json").read_text())["finished_utc"]


def test_an_unwritable_run_directory_with_a_stale_lock(tmp_path, capsys, complete_run, monkeypatch):
    """A run left by kill -9 (its .lock still there) in a folder that can no longer be written: the resume says so
    in one line with the command that finishes the run, exit 6 (not a traceback from the manifest, then another from
    removing the lock file); nothing in the run changes."""
    import errno

    from attnbench import store as store_mod

    run = crashed_copy(complete_run, tmp_path)
    (run / "points.csv").write_bytes(HEADER_LINE.encode() + data_lines(run / "points.csv")[0])
    (run / ".lock").write_text("4242\n")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    real_unlink = os.unlink

    def unlink(path, *a, **kw):
        if Path(path).parent == run:
            raise denied
        return real_unlink(path, *a, **kw)

    def write_json_atomic(*a, **kw):
        raise denied

    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(store_mod, "write_json_atomic", write_json_atomic)
    result = resume(run, tmp_path, capsys)
    monkeypatch.undo()
    assert_write_error(result, run, [f"{run}/manifest.json: cannot write (Permission denied)"])
    assert {p.name: p.read_bytes() for p in run.iterdir()} == {**before, ".lock": f"{os.getpid()}\n".encode()}


def test_runs_shows_a_run_being_measured_as_running(tmp_path, capsys, complete_run):
    """A run whose lock a live process holds is running (its pid), with no command to finish it; a lock file
    left by a killed process does not count."""
    run = crashed_copy(complete_run, tmp_path)
    (run / "points.csv").write_bytes(HEADER_LINE.encode() + data_lines(run / "points.csv")[0])
    holder = RunStore(run)
    holder.lock()
    try:
        listed = cli(capsys, "runs", run.parent)
    finally:
        holder.unlock()
    (row,) = [line for line in listed.out.splitlines() if run.name in line]
    assert f"running now, pid {os.getpid()}" in row and "interrupted" not in row
    assert "--resume" not in listed.out
    (run / ".lock").write_text("4242\n")          # left by kill -9: nobody holds it
    listed = cli(capsys, "runs", run.parent)
    assert "running" not in listed.out and listed.out.strip().splitlines()[-1].endswith(f"--resume {run}")


def test_dry_run_passes_over_corrupt_attempt_records(tmp_path, capsys, complete_run):
    """One hand-edited attempt record (no time, or one that does not read) anywhere under the results root does
    not stop --dry-run: the other points keep their last wall time."""
    run = crashed_copy(complete_run, tmp_path)
    lines = (run / "attempts.jsonl").read_text().splitlines(keepends=True)
    first = json.loads(lines[0])
    del first["utc"]
    (run / "attempts.jsonl").write_text(json.dumps(first) + "\n" + "".join(lines[1:]) + '{"utc": "garbage"}\n')
    planned = cli(capsys, "run-matrix", tmp_path / "tiny.yaml", "--device", "cpu", "--dry-run",
                  "--results-root", run.parent)
    assert planned.code == 0 and "Traceback" not in planned.err, planned.err
    assert "for 1 of them" in planned.out   # a@48 (a@16 has no time, so a@32's is not known either)


# -- Ctrl-C and the hints that finish a run --------------------------------------------------------------------

@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_hint_and_runs_hint_finish_the_run_when_pasted(tmp_path, stop):
    # SIGTERM (`timeout`, a batch scheduler) stops a run as Ctrl-C does: marked interrupted, the same hint
    work = tmp_path / "work"
    work.mkdir()
    (work / "slow.yaml").write_text(TINY.replace("seq_lens: [16, 32, 48]", f"seq_lens: {list(range(16, 16 + 12))}"))
    args = ["run-matrix", "slow.yaml", "--device", "cpu", "--results-root", "my runs", "--only", "a", "--max-util", "50"]
    proc = subprocess.Popen([sys.executable, "-m", "attnbench", *args], cwd=work, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    deadline = time.monotonic() + 240
    points = None
    while time.monotonic() < deadline and proc.poll() is None:
        found = list((work / "my runs").glob("*/points.csv"))
        if found and len(found[0].read_bytes().splitlines()) >= 3:
            points = found[0]
            break
        time.sleep(0.05)
    assert points is not None, "the run never stored two points"
    proc.send_signal(stop)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    hint = err.strip().splitlines()[-1]
    run_dir = points.parent
    assert json.loads((run_dir / "manifest.json").read_text())["interrupted"] is True
    assert shlex.split(hint) == [sys.executable, "-m", "attnbench", *args, "--resume", f"my runs/{run_dir.name}"]
    measured = data_lines(points)
    assert 2 <= len(measured) < 12
    # `attnbench runs`, from another folder, prints the whole command: a cd to where the run started, all options
    listed = cli_process("runs", work / "my runs", cwd=REPO)
    assert listed.code == 0 and "interrupted" in listed.out
    command = listed.out.strip().splitlines()[-1]
    assert command == (f"cd {shlex.quote(str(work))} && "
                       + shlex.join([sys.executable, "-m", "attnbench", *args, "--resume", str(run_dir)]))
    pasted = subprocess.run(command, shell=True, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert pasted.returncode == 0, pasted.stderr[-2000:]
    assert data_lines(points)[: len(measured)] == measured
    assert_points_once_each(run_dir, [f"a@{n}" for n in range(16, 28)])


# -- the gate never passes on nothing --------------------------------------------------------------------------

def test_gate_refuses_runs_from_another_gpu_and_runs_with_nothing_in_common(tmp_path, capsys, complete_run):
    line = assert_one_line(cli(capsys, "gate", "--baseline", H100_BASELINE, "--current", complete_run,
                               "--out", tmp_path / "g.md"), 2, "H100", "the CPU", "--allow-other-gpu")
    assert "PASS" not in line
    # allowed across GPUs, a CPU run of another matrix still has nothing in common with the H100 nightly
    assert_one_line(cli(capsys, "gate", "--baseline", H100_BASELINE, "--current", complete_run, "--allow-other-gpu",
                        "--out", tmp_path / "g.md"), 2, "nothing to compare", "nightly", "tiny")
    # same device, another matrix: nothing in common
    other = tmp_path / "other"
    shutil.copytree(complete_run, other)
    pts = pd.read_csv(other / "points.csv")
    pts["point_id"] = "b" + pts["point_id"]
    pts.to_csv(other / "points.csv", index=False)
    assert_one_line(cli(capsys, "gate", "--baseline", complete_run, "--current", other, "--out", tmp_path / "g.md"), 2,
                    "nothing to compare")
    # only points that were not measured (skipped) in common: nothing to compare either
    skipped = tmp_path / "skipped"
    shutil.copytree(complete_run, skipped)
    pts = pd.read_csv(skipped / "points.csv")
    pts["status"], pts["lat_ratio"] = "skipped", float("nan")
    pts.to_csv(skipped / "points.csv", index=False)
    assert_one_line(cli(capsys, "gate", "--baseline", complete_run, "--current", skipped, "--out", tmp_path / "g.md"),
                    2, "nothing to compare")
    # a run against itself (or its copy: same name, same start) is refused, not passed
    for current in (complete_run, crashed_copy(complete_run, tmp_path)):
        assert_one_line(cli(capsys, "gate", "--baseline", complete_run, "--current", current, "--out",
                            tmp_path / "g.md"), 2, "same run")


# -- readable in a CI log ------------------------------------------------------------------------------------

def test_tables_are_not_folded_when_piped(capsys, tmp_path, complete_run):
    short = cli(capsys, "list")
    assert short.code == 0 and len(short.out.splitlines()) <= 25, short.out
    assert "description" not in short.out.splitlines()[2] and "SDPA math" not in short.out
    for row in short.out.splitlines()[4:-1]:
        assert row.count("│") == 10, row         # one line per backend: nothing folded onto a second line
    long = cli(capsys, "list", "--long")
    assert "description" in long.out and "SDPA math: the unfused reference path, materialises N×N scores" in long.out
    listed = cli(capsys, "runs", complete_run.parent)
    assert complete_run.name in listed.out and len(listed.out.splitlines()) == 5


def test_parser_errors_are_one_line_too(capsys):
    result = cli(capsys, "run-matrix", "--device")
    assert_one_line(result, 2, "--device")


# -- the README's CPU advice ------------------------------------------------------------------------------------

def test_full_matrix_runs_on_the_cpu(tmp_path, capsys):
    full = REPO / "matrices" / "full.yaml"
    plan = cli(capsys, "run-matrix", full, "--device", "cpu", "--dry-run", "--results-root", tmp_path)
    assert plan.code == 0, plan.err
    assert "skipped: their backend or timing mode cannot run there" in plan.out
    assert "skip: cudnn: device cpu unsupported (supports cuda)" in plan.out
    assert "skip: efficient: device cpu unsupported" in plan.out
    # a real run of full.yaml's cells whose baseline needs a GPU: every point `skipped` with the reason
    result = cli_process("run-matrix", full, "--device", "cpu", "--results-root", tmp_path,
                         "--only", "pasa_fp16_fwd_vs_cudnn_d64")
    assert result.code == 0, result.err[-2000:]
    (run_dir,) = tmp_path.iterdir()
    pts = pd.read_csv(run_dir / "points.csv")
    assert len(pts) == 6 and set(pts.status) == {"skipped"}
    assert set(pts.reason) == {"cudnn: device cpu unsupported (supports cuda)"}


@pytest.mark.gpu
def test_inputs_larger_than_the_gpu_are_refused_at_validation(tmp_path, capsys):
    """On a GPU the bound is the largest visible GPU's memory (NVML), said with the bytes before any gate or run."""
    path = tmp_path / "huge.yaml"
    path.write_text(matrix_with().replace("dtype: float32", "dtype: float16").replace("seq_lens: [16]",
                                                                                       "seq_lens: [16, 68719476736]"))
    assert_one_line(cli(capsys, "run-matrix", path, "--results-root", tmp_path / "runs"), 2,
                    str(path), "68719476736", "bytes", "of GPU memory")
    assert not (tmp_path / "runs").exists()
