"""scripts/tune.py: one tuning entry for the four kernels, on the CPU (tiny sizes, meaningless times), and the
tuning files it writes, read back by each kernel."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scripts_loader import exit_code, load_script

REPO = Path(__file__).resolve().parent.parent


def _tune_module():
    return load_script("tune")


tune = _tune_module()


def run_tune(*args, timeout=900):
    env = dict(os.environ)      # PYTHONPATH: this checkout first (conftest.py)
    env.pop("TRITON_INTERPRET", None)       # the script sets it itself for --device cpu
    return subprocess.run([sys.executable, str(REPO / "scripts" / "tune.py"), *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=REPO)


# one short section per kernel: every code path of the sweep (accuracy check, paired timing, decision, writing)
@pytest.mark.cpu_only
@pytest.mark.parametrize("kernel, sections, expected", [
    ("elsa", "bwd32", [("bwd32:dkdv", "bwd", "32,64"), ("bwd32:dq", "bwd", "32,64")]),
    ("elsa", "window16,short16", [("window16", "window_fwd", "16,32"), ("short16", "short_bwd", "16,32")]),
    ("pasa", "variant", [("variant", "variant", "default")]),
    ("pasa", "shift", [("shift", "shift_inline_max_keys", "64")]),
    ("cqsa", "fwd", [("fwd", "fwd", "16,64")]),
    ("cron_root", "cross,seg", [("cross", "crossover", "fwd"), ("cross", "crossover", "fwdbwd"),
                                ("seg", "configs", "64:glob")]),
])
def test_tune_runs_on_the_cpu_and_writes_only_where_asked(tmp_path, kernel, sections, expected):
    target = tmp_path / "tuning.json"
    before = {p: p.read_bytes() for p in (REPO / "kernels").glob("*/tuning.json")}
    proc = run_tune("--kernel", kernel, "--device", "cpu", "--sections", sections, "--write", str(target),
                    "--out", str(tmp_path / "log"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = json.loads((tmp_path / "log" / f"tune_{kernel}.json").read_text())
    assert [(d["section"], d["table"], d["key"]) for d in log["decisions"]] == expected
    timed = [r for r in log["rows"] if r.get("points") or "ratio" in r]
    assert timed, "nothing was timed"
    # every config a sweep timed, and every path a crossover compared, held its accuracy against float64
    checked = [r for r in log["rows"] if "rel_rmse" in r]
    assert checked, "no accuracy was checked"
    for r in checked:
        errors = r["rel_rmse"] if isinstance(r["rel_rmse"], dict) else {"config": r["rel_rmse"]}
        assert all(e <= tune.TOLERANCE[r["dtype"]] for e in errors.values()), r
        assert all(p["ratio"] > 0 for p in r.get("points", ())), r
    changed = [d for d in log["decisions"] if d["changed"]]
    assert target.is_file() == bool(changed)
    # the kernels' own tuning files are untouched by a CPU run
    assert {p: p.read_bytes() for p in (REPO / "kernels").glob("*/tuning.json")} == before


def tune_here(capsys, *args) -> tuple[int, str]:
    """tune.py's main() in this process, its exit code and stderr: for runs that time nothing (refusals, sections
    that stay where their kernel cannot run), where a new process would spend its time importing torch."""
    capsys.readouterr()
    code = exit_code(tune, list(args))
    return code, capsys.readouterr().err


def test_tune_refuses_unknown_sections_and_a_missing_gpu(capsys):
    code, err = tune_here(capsys, "--kernel", "elsa", "--device", "cpu", "--sections", "fwd99")
    assert code == 2 and "fwd99" in err and "known: fwd16" in err
    code, err = tune_here(capsys, "--kernel", "cron_root", "--device", "cpu", "--sections", "cross",
                          "--cross-timing", "graph")
    assert code == 2 and "--cross-timing graph needs a GPU" in err
    if not torch.cuda.is_available():
        code, err = tune_here(capsys, "--kernel", "elsa", "--sections", "fwd16")
        assert code == 3 and "--device cpu" in err


def test_dims_limits_every_head_dim_sweep_to_those_named(capsys):
    """--dims: a section sweeps only the head dims named, whichever element of its items holds D (ELSA's (dtype
    class, D), Cron Root's (D, heads)); on the CPU the first of those; a bad list is one line and exit 2."""
    gpu = tune.Context("cuda", head_dims=(128,))
    assert gpu.dims(tune.GLUON_BWD_DIMS) == [128]
    assert gpu.dims([("16", 64), ("16", 128), ("32", 128)], lambda pair: pair[1]) == [("16", 128), ("32", 128)]
    assert gpu.dims([(64, 8), (128, 16)], lambda pair: pair[0]) == [(128, 16)]
    assert tune.Context("cuda").dims([64, 128]) == [64, 128]
    assert tune.Context("cpu", head_dims=(128,)).dims([64, 128]) == [128]
    assert tune.Context("cpu").dims([64, 128]) == [64]
    code, err = tune_here(capsys, "--kernel", "elsa", "--device", "cpu", "--sections", "gluonbwd", "--dims", "128,x")
    assert code == 2 and err.strip() == "error: argument --dims: '128,x': need a comma list of positive integers"
    code, err = tune_here(capsys, "--kernel", "elsa", "--device", "cpu", "--dims", "0")
    assert code == 2 and err.strip() == "error: argument --dims: '0': need a comma list of positive integers"
    code, err = tune_here(capsys, "--kernel", "elsa", "--device", "cpu", "--dims", "100")
    assert code == 2 and "--dims: 100: head dims are multiples of 8 from 16 to 256" in err


@pytest.mark.parametrize("kernel, section, extra, expected", [
    ("elsa", "gluonbwd", (), [("gluon_bwd_min_work", "64,0"), ("gluon_bwd_min_work", "64,1")]),
    ("cqsa", "gluonbwd", (), [("gluon_bwd_min_work", "64,0"), ("gluon_bwd_min_work", "64,1")]),
    ("cqsa", "gluonbwd", ("--dims", "128"), [("gluon_bwd_min_work", "128,0"), ("gluon_bwd_min_work", "128,1")]),
    ("pasa", "core", (), [("core_min_work", "64,1")]),
])
def test_a_gluon_crossover_section_stays_where_the_kernel_cannot_run(tmp_path, capsys, kernel, section, extra,
                                                                     expected):
    """ELSA's and CQSA's gluonbwd and PASA's core sections on the CPU (no Gluon there): one decision per key they
    tune there (the first head dim, or the one --dims names, both causal settings; PASA's first key), each keeping
    its entry and saying why, nothing timed, nothing written."""
    from kernels.cqsa import attention as cqsa
    from kernels.elsa import config
    from kernels.pasa import ops

    current = {"elsa": config.GLUON_BWD_MIN_WORK, "cqsa": cqsa.GLUON_BWD_MIN_WORK, "pasa": ops.CORE_MIN_WORK}[kernel]
    target = tmp_path / "tuning.json"
    code, err = tune_here(capsys, "--kernel", kernel, "--device", "cpu", "--sections", section, "--write",
                          str(target), "--out", str(tmp_path / "log"), *extra)
    assert code == 0, err[-3000:]
    log = json.loads((tmp_path / "log" / f"tune_{kernel}.json").read_text())
    want = []
    for table, key in expected:
        d, causal = key.split(",")
        want.append((table, key, current[(int(d), causal == "1")], False))
    assert [(d["table"], d["key"], d["value"], d["changed"]) for d in log["decisions"]] == want
    assert all("needs an sm_90 GPU" in d["why"] for d in log["decisions"])
    assert not [r for r in log["rows"] if "ratio" in r] and not target.exists()


def test_pasa_core_shapes_are_a_full_grid_and_a_thin_one_of_each_work():
    assert tune.pasa_core_shapes(64, 31) == [(32, 1024), (2, 4096)]        # 2^25 rows of keys
    assert tune.pasa_core_shapes(128, 33) == [(16, 2048), (1, 8192)]
    assert tune.pasa_core_shapes(128, 30) == [(32, 512), (2, 2048)]
    for d, level in ((64, 30), (64, 34), (128, 31), (128, 34)):
        for heads, n in tune.pasa_core_shapes(d, level):
            assert heads * n * n * d == 2 ** level and 1 <= heads <= 32 and 512 <= n <= 16384


def test_the_core_threshold_is_the_first_work_level_won_at_every_larger_one():
    def points(*worst_by_level, level0=30):
        out = []
        for i, ratios in enumerate(worst_by_level):
            out += [{"log2_work": level0 + i, "ratio": r} for r in ratios]
        return out

    assert tune.first_level_won(points((1.2, 0.9), (0.95, 0.8), (0.7, 0.99))) == 31
    assert tune.first_level_won(points((0.9, 1.01), (0.95, 0.8), (0.7, 0.99))) == 31     # one shape lost at 2^30
    assert tune.first_level_won(points((0.9, 0.8), (0.95, 1.05))) is None                # lost at the largest
    assert tune.first_level_won(points((0.9,), (0.8,)) + [{"log2_work": 32, "error": "x"}]) == 30
    assert tune.first_level_won([]) is None


def test_the_core_section_times_each_key_with_the_core_forced_and_restores_the_thresholds(monkeypatch):
    """Tuner.pasa_core's flow with the GPU faked (the core said available, the accuracy check and the paired timing
    canned): every (level, heads, N) of its shapes timed once per key, the default call on the core from any work (its
    plan) against the Triton loop named, the decision the first level won, a key that never wins keeps its entry, and
    ops.CORE_MIN_WORK untouched throughout."""
    from kernels import _gluon_core
    from kernels.pasa import attention as pasa
    from kernels.pasa import ops

    saved = dict(ops.CORE_MIN_WORK)
    wins_from = {(64, True): 32, (128, False): 31, (128, True): None}
    timed = []

    def fake_time_ratio(s, options, d, n, causal, device, timing, timing_mode="eager"):
        assert options == {"config": {"plan": {"core_min_work": 1}}} and s.baseline == "pasa"
        assert s.baseline_options == {"variant": pasa.DEFAULT_VARIANT}
        assert ops.CORE_MIN_WORK == saved and timing_mode == "graph"
        level = (s.heads * n * n * d).bit_length() - 1
        timed.append((d, causal, level, s.heads, n))
        first = wins_from[(d, causal)]
        return {"head_dim": d, "n": n, "causal": causal, "ratio": 0.9 if first is not None and level >= first else 1.1,
                "ci_half_width": 0.01}

    monkeypatch.setattr(_gluon_core, "available", lambda q, k, v: True)
    monkeypatch.setattr(tune, "accuracy", lambda s, options, d, device, n: 1e-3)
    monkeypatch.setattr(tune, "time_ratio", fake_time_ratio)
    tuner = tune.Tuner("pasa", "cpu", 1e9, None, log=lambda msg: None, cross_timing="graph")
    tuner.ctx.device = "cuda"           # the GPU's keys and shapes (the device string reaches only the fakes)
    tuner.pasa_core()
    assert ops.CORE_MIN_WORK == saved
    want = [(d, causal, level, heads, n) for d, causal in tune.PASA_CORE_KEYS for level in tune.PASA_CORE_LEVELS
            for heads, n in tune.pasa_core_shapes(d, level)]
    assert timed == want
    got = {d["key"]: (d["value"], d["changed"], d["complete"]) for d in tuner.decisions}
    assert got == {"64,1": (2 ** 32, saved[(64, True)] != 2 ** 32, True),
                   "128,0": (2 ** 31, True, True),
                   "128,1": (saved[(128, True)], False, True)}


@pytest.mark.parametrize("kernel", ["elsa", "cqsa"])
def test_the_gluon_backward_section_pairs_the_kernels_two_backwards(monkeypatch, kernel):
    """Tuner.gluon_bwd's flow with the GPU faked (the Gluon backward said usable, the accuracy check and the paired
    timing canned): per head dim and causal setting every length of GLUON_BWD_NS[kernel] timed once, fwd+bwd eager,
    the Gluon backward from any work against the kernel's own Triton backward (gluon_bwd_paths: the options that
    force each), the entry the work B·H·N² of the first length won at every longer one, a key that never wins keeps
    its entry."""
    from kernels import _gluon_bwd

    wins_from = {(64, False): 8192, (64, True): 4096, (128, False): None, (128, True): 6144}   # in both kernels' NS
    timed = []

    def fake_time_ratio(s, options, d, n, causal, device, timing, timing_mode="eager"):
        gluon, triton_bwd, _ = tune.gluon_bwd_paths(kernel, d)
        assert (s.kernel, s.baseline, s.mode, timing_mode) == (kernel, kernel, "fwdbwd", "eager")
        assert options == gluon and s.baseline_options == triton_bwd
        timed.append((d, causal, n))
        first = wins_from[(d, causal)]
        return {"head_dim": d, "n": n, "causal": causal, "ratio": 0.9 if first is not None and n >= first else 1.1,
                "ci_half_width": 0.01}

    monkeypatch.setattr(_gluon_bwd, "usable", lambda q, k, v, do: True)
    monkeypatch.setattr(tune, "accuracy", lambda s, options, d, device, n: 1e-3)
    monkeypatch.setattr(tune, "time_ratio", fake_time_ratio)
    tuner = tune.Tuner(kernel, "cpu", 1e9, None, log=lambda msg: None)
    tuner.ctx.device = "cuda"           # the GPU's head dims and lengths (the device string reaches only the fakes)
    tuner.gluon_bwd()
    ns = tune.GLUON_BWD_NS[kernel]
    assert timed == [(d, causal, n) for d in tune.GLUON_BWD_DIMS for causal in (False, True) for n in ns]
    table = tune.gluon_bwd_paths(kernel, 64)[2]
    got = {d["key"]: (d["value"], d["complete"]) for d in tuner.decisions}
    assert got == {"64,0": (8 * 8192 ** 2, True), "64,1": (8 * 4096 ** 2, True),
                   "128,0": (table[(128, False)], True), "128,1": (8 * 6144 ** 2, True)}
    assert all(d["changed"] == (d["value"] != table[tuple(map(int, d["key"].split(",")))]) for d in tuner.decisions)


def test_the_gluon_backward_paths_force_each_backward():
    """gluon_bwd_paths' options reach each kernel's backward rule: the Gluon one from one unit of work, the Triton
    one at any work (ELSA: a dK/dV override; CQSA: the plan's unreachable threshold, its tiles untouched)."""
    from kernels._common import MAX_WORK
    from kernels.cqsa import attention as cqsa
    from kernels.elsa import config

    fp16 = torch.float16
    gluon, triton_bwd, table = tune.gluon_bwd_paths("elsa", 128)
    assert table is config.GLUON_BWD_MIN_WORK
    for opts, want in ((gluon, True), (triton_bwd, False)):
        own = config.canonical_config(opts["config"], fp16, 128)
        assert config.plan_backward(128, fp16, own, 8192, 2, False, True, 1 << 40, True).gluon == want
        assert config.plan_backward(128, fp16, own, 64, 2, False, True, 1, True).gluon == want
    gluon, triton_bwd, table = tune.gluon_bwd_paths("cqsa", 64)
    assert table is cqsa.GLUON_BWD_MIN_WORK
    for opts, want in ((gluon, 1), (triton_bwd, MAX_WORK)):
        tiles, min_work = cqsa.split_config(opts["config"])
        assert tiles is None and min_work == want


def test_a_crossover_is_the_first_length_won_at_every_longer_one():
    def points(*ratios):
        return [{"n": 1000 * (i + 1), "ratio": r} for i, r in enumerate(ratios)]

    assert tune.first_win(points(1.2, 0.9, 1.01, 0.95, 0.9)) == 4000
    assert tune.first_win(points(0.9, 0.95, 1.0)) == 1000
    assert tune.first_win(points(0.9, 0.8, 1.05)) is None
    assert tune.first_win(points(1.1, 0.9) + [{"n": 3000, "error": "x"}]) == 2000
    assert tune.first_win([]) is None


def test_elsa_reads_its_gluon_backward_thresholds(tmp_path):
    """A gluon_bwd_min_work entry replaces its built-in threshold, keyed "<D>,<causal 0/1>"; another key or a value
    that is not a positive int is one line naming the file. A caller's plan.gluon_bwd_min_work overrides both."""
    from kernels._tuning import TuningFileError
    from kernels.elsa import config

    path = tmp_path / "tuning.json"
    tune.write_choices("elsa", [decision("gluon_bwd_min_work", "128,1", 12345)], path, "cpu")
    assert config.tuned_gluon_bwd_min_work(path) == {**config.BUILTIN_GLUON_BWD_MIN_WORK, (128, True): 12345}
    assert config.tuned_gluon_bwd_min_work(tmp_path / "absent.json") == config.BUILTIN_GLUON_BWD_MIN_WORK
    for bad in ({"96,0": 5}, {"64,2": 5}, {"64": 5}, {"64,0": 0}, {"64,0": 2.5}):
        path.write_text(json.dumps({"configs": {"gluon_bwd_min_work": bad}}))
        with pytest.raises(TuningFileError, match=r"tuning.json: gluon_bwd_min_work\["):
            config.tuned_gluon_bwd_min_work(path)
    fp16 = torch.float16
    least = config.GLUON_BWD_MIN_WORK[(64, False)]
    own = config.canonical_config({"plan": {"gluon_bwd_min_work": 100}}, fp16, 64)
    assert not config.plan_backward(64, fp16, "", 4096, 2, False, False, 100, True).gluon
    assert config.plan_backward(64, fp16, own, 4096, 2, False, False, 100, True).gluon
    assert not config.plan_backward(64, fp16, own, 4096, 2, False, False, 99, True).gluon
    assert config.plan_backward(64, fp16, "", 4096, 2, False, False, least, True).gluon


def test_cqsa_reads_its_gluon_backward_thresholds(tmp_path):
    """CQSA's gluon_bwd_min_work entries replace its built-in thresholds, keyed "<D>,<causal 0/1>" (the Gluon
    backward's head dims); another key or a value that is not a positive int is one line naming the file."""
    from kernels._tuning import min_work_entries, TuningFileError
    from kernels.cqsa import attention as cqsa
    from kernels.cqsa.kernel import TUNING_FILE

    path = tmp_path / "tuning.json"
    tune.write_choices("cqsa", [decision("gluon_bwd_min_work", "64,0", 8 * 3072 ** 2)], path, "cpu")
    assert (min_work_entries(path, "gluon_bwd_min_work", cqsa.BUILTIN_GLUON_BWD_MIN_WORK)
            == {**cqsa.BUILTIN_GLUON_BWD_MIN_WORK, (64, False): 8 * 3072 ** 2})
    assert cqsa.GLUON_BWD_MIN_WORK == min_work_entries(TUNING_FILE, "gluon_bwd_min_work",
                                                       cqsa.BUILTIN_GLUON_BWD_MIN_WORK)
    for bad in ({"96,0": 5}, {"64,2": 5}, {"128": 5}, {"64,1": 0}, {"64,1": True}):
        path.write_text(json.dumps({"configs": {"gluon_bwd_min_work": bad}}))
        with pytest.raises(TuningFileError, match=r"tuning.json: gluon_bwd_min_work\["):
            min_work_entries(path, "gluon_bwd_min_work", cqsa.BUILTIN_GLUON_BWD_MIN_WORK)


@pytest.mark.cpu_only
def test_the_plan_section_times_the_streaming_engine_and_writes_its_rates(tmp_path):
    """CQSA's plan section times the streaming engine at three forced plans per engine (depth 1 with either
    accumulator at the longer length, the deepest plan at the shorter), fits the planner's rates from them and writes
    them where stream.py reads them."""
    from kernels.cqsa import stream

    target = tmp_path / "tuning.json"
    proc = run_tune("--kernel", "cqsa", "--device", "cpu", "--sections", "plan", "--write", str(target),
                    "--out", str(tmp_path / "log"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = json.loads((tmp_path / "log" / "tune_cqsa.json").read_text())
    assert [(d["table"], d["key"], d["complete"]) for d in log["decisions"]] == [("plan_rates", "fwd", True),
                                                                                 ("plan_rates", "bwd", True)]
    rows = {(r["mode"], r["n"], r["itr"], r["acc"]): r for r in log["rows"]}
    # on the CPU the lengths are 32 and 64, and the deepest plan at 32 tokens is depth 1
    assert len(log["rows"]) == 6 and set(rows) == {(m, n, 1, acc) for m in ("fwd", "bwd")
                                                   for n, acc in ((64, "device"), (64, "host"), (32, "device"))}
    for d in log["decisions"]:
        flops_per_s, task_host_s, merge_bps = d["value"]
        deep = rows[(d["key"], 32, 1, "device")]
        assert task_host_s == deep["seconds"] / 7
        assert deep["seconds"] == pytest.approx(statistics.median(deep["samples_ms"]) / 1e3, rel=1e-6)
        assert flops_per_s > 0 and merge_bps > 0
    assert stream.plan_rates(target) == {d["key"]: tuple(d["value"]) for d in log["decisions"]}


def test_cqsa_reads_its_plan_rates(tmp_path):
    """The streaming planner's rates: tuning.json's plan_rates entries replace the built-in ones; another key or a
    value that is not three positive numbers is one line naming the file."""
    from kernels._tuning import TuningFileError
    from kernels.cqsa import stream
    from kernels.cqsa.kernel import TUNING_FILE

    path = tmp_path / "tuning.json"
    tune.write_choices("cqsa", [decision("plan_rates", "fwd", [1e14, 2e-4, 5e9])], path, "cpu")
    assert stream.plan_rates(path) == {**stream.BUILTIN_PLAN_RATES, "fwd": (1e14, 2e-4, 5e9)}
    assert stream.PLAN_RATES == stream.plan_rates(TUNING_FILE)
    for bad in ({"fwd": [1, 2]}, {"mid": [1, 2, 3]}, {"bwd": [1, 0, 3]}, {"bwd": [1, True, 3]}, {"fwd": "fast"},
                {"bwd": [1, float("inf"), 3]}):
        path.write_text(json.dumps({"configs": {"plan_rates": bad}}))
        with pytest.raises(TuningFileError, match=r"tuning.json: plan_rates\[") as exc:
            stream.plan_rates(path)
        assert "\n" not in str(exc.value)


def test_pasa_reads_its_core_thresholds(tmp_path):
    """A core_min_work entry replaces its built-in threshold, keyed "<D>,<causal 0/1>" (any head dim of the core);
    another key or a value that is not a positive int is one line naming the file."""
    from kernels._tuning import min_work_entries, TuningFileError
    from kernels.pasa import ops

    path = tmp_path / "tuning.json"
    tune.write_choices("pasa", [decision("core_min_work", "128,1", 2 ** 33)], path, "cpu")
    assert (min_work_entries(path, "core_min_work", ops.BUILTIN_CORE_MIN_WORK)
            == {**ops.BUILTIN_CORE_MIN_WORK, (128, True): 2 ** 33})
    assert ops.CORE_MIN_WORK == min_work_entries(ops.TUNING_FILE, "core_min_work", ops.BUILTIN_CORE_MIN_WORK)
    for bad in ({"48,0": 5}, {"64,2": 5}, {"128": 5}, {"64,1": 0}, {"64,1": True}):
        path.write_text(json.dumps({"configs": {"core_min_work": bad}}))
        with pytest.raises(TuningFileError, match=r"tuning.json: core_min_work\["):
            min_work_entries(path, "core_min_work", ops.BUILTIN_CORE_MIN_WORK)


# --- the decision rule ---------------------------------------------------------------------------------------

def test_a_candidate_replaces_the_current_entry_only_beyond_the_noise():
    current = {"value": [1], "score": 1.00, "ci_half_width": 0.01}
    assert tune.choose([current, {"value": [2], "score": 0.90, "ci_half_width": 0.01}])[0]["value"] == [2]
    assert tune.choose([current, {"value": [2], "score": 0.99, "ci_half_width": 0.01}])[0]["value"] == [1]
    assert tune.choose([current, {"value": [2], "score": 0.95, "ci_half_width": None}])[0]["value"] == [1]
    assert tune.choose([{"value": [1], "error": "x"}, {"value": [2], "score": 1.3, "ci_half_width": 0.5}])[0]["value"] == [2]
    assert tune.choose([{"value": [1], "error": "x"}])[0]["value"] == [1]


# --- what tune.py writes is what each kernel reads ----------------------------------------------------------------

def decision(table, key, value, section="s"):
    return {"section": section, "table": table, "key": key, "value": value, "changed": True, "complete": True}


def test_elsa_forward_sweep_starts_from_the_tiles_that_ship():
    """Candidate 0 of a sweep is the entry in use: for 16-bit ELSA that is the flash core's plain tiles (what phase 1
    runs without a tuning entry), not the bias path's table."""
    from kernels import _flash_core as core
    from kernels.elsa import config

    ctx = tune.Context(device="cuda")
    for sweep in tune.elsa_sweeps(ctx, "fwd16"):
        cls, bd = sweep.key.split(",")
        assert sweep.values[0] == list(config.core_tiles(torch.float16, int(bd)))
        if (cls, int(bd)) not in config.FWD_TUNED:
            assert sweep.values[0] == list(core.PLAIN_TILES[(cls, int(bd))])


def test_elsa_short_sweeps_time_where_their_tables_apply():
    """The short calls' sections start from the tables in use and time them where they apply: Swin-T's first-stage
    windows (49 tokens, D=32, 512 windows, a bias taking a gradient, against SDPA's efficient kernel) and ViT-T's
    layer (197 and 577 tokens, batch 8, D=64, against flash)."""
    from kernels.elsa import config

    ctx = tune.Context(device="cuda")
    (window,) = tune.elsa_sweeps(ctx, "window16")
    assert (window.table, window.key, window.mode, window.ns, window.batch, window.heads, window.bias,
            window.baseline) == ("window_fwd", "16,32", "fwd", (49,), 512, 3, True, "efficient")
    assert window.values[0] == list(config.WINDOW_FWD_TILES[("16", 32)])
    assert window.options(window.values[1], 32) == {"config": {"fwd": tune._tiles(window.values[1])}}
    swin, vit = tune.elsa_sweeps(ctx, "short16")
    assert (swin.key, swin.ns, swin.batch, swin.bias, swin.baseline) == ("16,32", (49,), 512, True, "efficient")
    assert (vit.key, vit.ns, vit.batch, vit.bias, vit.baseline) == ("16,64", (197, 577), 8, False, "flash")
    for sweep in (swin, vit):
        assert sweep.table == "short_bwd" and sweep.mode == "bwd" and max(sweep.ns) <= config.SHORT_N
        dq, dkdv = config.SHORT_ONE_LAUNCH_BWD[("16", int(sweep.key.split(",")[1]))]
        assert sweep.values[0] == {"dq": list(dq), "dkdv": list(dkdv)}
    assert max(window.ns) <= config.WINDOW_N


def test_elsa_reads_its_short_tables(tmp_path):
    """window_fwd and short_bwd entries replace the short calls' built-in ones (a short_bwd entry for a key with
    none starts from the backward table's); a key the tables do not have is one line naming the file."""
    from kernels._tuning import TuningFileError
    from kernels.elsa import config

    path = tmp_path / "tuning.json"
    tune.write_choices("elsa", [decision("window_fwd", "16,32", [16, 32, 1, 1]),
                                decision("short_bwd", "16,64", {"dq": [32, 32, 2, 1]}),
                                decision("short_bwd", "16,128", {"dkdv": [32, 64, 8, 1]})], path, "cpu")
    window, short = config.tuned_short_tables(path)
    assert window == {("16", 32): (16, 32, 1, 1)}
    assert short[("16", 64)] == ((32, 32, 2, 1), config.BUILTIN_SHORT_ONE_LAUNCH_BWD[("16", 64)][1])
    assert short[("16", 32)] == config.BUILTIN_SHORT_ONE_LAUNCH_BWD[("16", 32)]
    assert short[("16", 128)] == (config.BWD_TABLE[("16", 128)][0], (32, 64, 8, 1))
    assert config.tuned_short_tables(tmp_path / "absent.json") == (config.BUILTIN_WINDOW_FWD_TILES,
                                                                   config.BUILTIN_SHORT_ONE_LAUNCH_BWD)
    path.write_text(json.dumps({"configs": {"window_fwd": {"16,48": [32, 32, 1, 1]}}}))
    with pytest.raises(TuningFileError, match=r"tuning.json: window_fwd\['16,48'\]: not a \(dtype class, BLOCK_D\)"):
        config.tuned_short_tables(path)


def test_elsa_reads_its_tuning_file(tmp_path):
    from kernels.elsa import config

    path = tmp_path / "tuning.json"
    tune.write_choices("elsa", [decision("fwd", "16,64", [64, 32, 4, 2]),
                                decision("bwd", "32,64", {"dq": [32, 32, 4, 2], "dkdv": [64, 32, 4, 2]})], path, "cpu")
    fwd, bwd = config.tuned_tables(path)
    assert fwd[("16", 64)] == (64, 32, 4, 2) and fwd[("16", 128)] == config.BUILTIN_FWD_TABLE[("16", 128)]
    assert bwd[("32", 64)] == ((32, 32, 4, 2), (64, 32, 4, 2))
    assert config.tuned_tables(tmp_path / "absent.json") == (config.BUILTIN_FWD_TABLE, config.BUILTIN_BWD_TABLE)
    # the plans the kernel launches with come from the tables; a caller's config= still overrides them
    saved = config.FWD_TABLE, config.BWD_TABLE, config.FWD_TUNED
    try:
        config.FWD_TABLE, config.BWD_TABLE, config.FWD_TUNED = fwd, bwd, frozenset({("16", 64)})
        for fn in (config.plan_forward, config.plan_backward):
            fn.cache_clear()
        plan = config.plan_forward(4096, 4096, 8, 64, torch.float16, config.DEFAULT_SM_COUNT)
        assert (plan.block_m, plan.block_n, plan.num_warps, plan.num_stages) == (64, 32, 4, 2)
        override = config.canonical_config({"fwd": {"BLOCK_N": 64}}, torch.float16, 64)
        plan = config.plan_forward(4096, 4096, 8, 64, torch.float16, config.DEFAULT_SM_COUNT, override)
        assert (plan.block_m, plan.block_n) == (64, 64)
        assert config.plan_backward(64, torch.float32) == config.BwdPlan((32, 32, 4, 2), (64, 32, 4, 2))
        # a 16-bit key the file did not set runs the flash core's plain tiles
        from kernels import _flash_core as core
        config.FWD_TUNED = frozenset()
        config.plan_forward.cache_clear()
        plan = config.plan_forward(4096, 4096, 8, 64, torch.float16, config.DEFAULT_SM_COUNT)
        assert (plan.block_m, plan.block_n, plan.num_warps, plan.num_stages) == core.PLAIN_TILES[("16", 64)]
    finally:
        config.FWD_TABLE, config.BWD_TABLE, config.FWD_TUNED = saved
        for fn in (config.plan_forward, config.plan_backward):
            fn.cache_clear()


def test_a_tuning_entry_the_tables_do_not_have_is_one_line(tmp_path):
    from kernels._tuning import TuningFileError
    from kernels.elsa import config

    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"configs": {"fwd": {"16,80": [64, 64, 4, 3]}}}))
    with pytest.raises(TuningFileError, match=r"fwd\['16,80'\]: not a \(dtype class, BLOCK_D\)"):
        config.tuned_tables(path)


def test_pasa_reads_its_tuning_file(tmp_path):
    from kernels.pasa import attention as pasa

    path = tmp_path / "tuning.json"
    tune.write_choices("pasa", [decision("variant", "default", "fused"), decision("pasa", "128", [128, 64, 8, 3])],
                       path, "cpu")
    configs, variant = pasa.tuned_defaults(path)
    assert variant == "fused"
    tiles = {"fwd": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)}
    assert configs["pasa"][128] == configs["fa16"][128] == tiles   # fa16 keeps PASA's tiling
    assert configs["pasa"][64] == pasa.BUILTIN_CONFIGS["pasa"][64]
    assert pasa.BUILTIN_CONFIGS["pasa"][128] != tiles               # the built-in table is not changed
    path.write_text(json.dumps({"configs": {"variant": {"default": "fast"}}}))
    with pytest.raises(ValueError, match="variant.default = 'fast'"):
        pasa.tuned_defaults(path)
    path.write_text(json.dumps({"configs": {"pasa": {"80": [64, 64, 4, 3]}}}))
    with pytest.raises(ValueError, match=r"pasa\['80'\].*head-dim tile width"):
        pasa.tuned_defaults(path)


def test_pasa_reads_its_shift_rule(tmp_path):
    """The K̃ path's crossover (section "shift") replaces ops.py's built-in rule; 16- and 32-wide tiles follow the
    64-wide entry unless they have their own."""
    from kernels.pasa import ops

    path = tmp_path / "tuning.json"
    tune.write_choices("pasa", [decision("shift_inline_max_keys", "64", 256),
                                decision("shift_inline_max_keys", "128", 0)], path, "cpu")
    rule = ops.tuned_shift_rule(path)
    assert rule == {**ops.BUILTIN_SHIFT_INLINE_MAX_KEYS, 16: 256, 32: 256, 64: 256, 128: 0}
    assert ops.BUILTIN_SHIFT_INLINE_MAX_KEYS[64] != 256                   # the built-in table is not changed
    for bad, why in (({"96": 128}, "head-dim tile width"), ({"64": -1}, "key count >= 0"),
                     ({"64": "512"}, "key count >= 0")):
        path.write_text(json.dumps({"configs": {"shift_inline_max_keys": bad}}))
        with pytest.raises(ValueError, match=rf"shift_inline_max_keys\[.*{why}"):
            ops.tuned_shift_rule(path)


def test_cqsa_reads_its_tuning_file(tmp_path, monkeypatch):
    from kernels._tuning import read_configs
    from kernels.cqsa import kernel as cqsa

    path = tmp_path / "tuning.json"
    tune.write_choices("cqsa", [decision("fwd", "16,128", [64, 64, 4, 3])], path, "cpu")
    monkeypatch.setattr(cqsa, "_TUNED", read_configs(path))
    monkeypatch.setattr(cqsa, "_tiles_cache", {})
    monkeypatch.setattr(cqsa, "interpreted", lambda: False)    # the GPU's tiles, read on a CPU: no GPU is touched
    assert cqsa.default_tiles(128, torch.float16, "cuda")[:4] == (64, 64, 4, 3)
    assert cqsa.default_tiles(96, torch.float16, "cuda")[:4] == (64, 64, 4, 3)     # the same 128-wide tiles
    assert cqsa.default_tiles(128, torch.float16, "cuda")[4:] == sum(cqsa._TILES_CUDA[(True, 128)][1:], ())
    assert cqsa.default_tiles(64, torch.float16, "cuda")[:4] == (128, 64, 4, 2)       # not tuned: the built-in choice
    assert cqsa.default_tiles(128, torch.float32, "cuda")[:4] == (64, 32, 4, 2)
    assert cqsa.default_tiles(128, torch.float16, "cpu")[:4] == (32, 32, 4, 1)        # interpreter tiles


def test_cron_root_reads_its_tuning_file(tmp_path, monkeypatch):
    from kernels.cron_root import tuning

    path = tmp_path / "tuning.json"
    entry = tune.write_choices("cron_root", [
        decision("crossover", "fwd", 3072), decision("crossover", "fwdbwd", 8192),
        decision("configs", "64:glob", {"BLOCK_G": 32, "BLOCK_Q": 64, "num_warps": 4, "num_stages": 2}),
        decision("configs", "64:glob", {"programs_per_sm": 4}),
    ], path, "cpu")
    assert entry["crossover"] == 8192 and entry["crossover_workload"].endswith("eager calls (host time included)")
    monkeypatch.setattr(tuning, "TUNING_FILE", path)
    for fn in (tuning.table, tuning.gpu_entry):
        fn.cache_clear()
    try:
        name = "cpu (Triton interpreter)"
        assert tuning.crossover_for(name, False) == 3072 and tuning.crossover_for(name, True) == 8192
        assert tuning.tuned_configs(name, 64) == {"glob": {"BLOCK_G": 32, "BLOCK_Q": 64, "num_warps": 4,
                                                           "num_stages": 2, "programs_per_sm": 4}}
        # the repository's entries are kept
        assert tuning.crossover_for("NVIDIA H100 80GB HBM3", True) == json.loads(
            (REPO / "kernels" / "cron_root" / "tuning.json").read_text())["gpus"]["NVIDIA H100 80GB HBM3"]["crossover_fwdbwd"]
    finally:
        for fn in (tuning.table, tuning.gpu_entry):
            fn.cache_clear()


def test_nothing_is_written_when_every_entry_stayed(tmp_path):
    stayed = dict(decision("fwd", "16,64", [128, 64, 4, 3]), changed=False)
    assert tune.write_choices("elsa", [stayed], tmp_path / "t.json", "cpu") == {}
    assert not (tmp_path / "t.json").exists()


def test_a_tuning_file_records_where_each_table_was_measured(tmp_path):
    """write_configs records the machine of each table it writes and keeps the others' (a file written before that
    was per table: its one block stands for each of its tables), so tiles tuned on one GPU and a threshold tuned on
    another each say where they were measured."""
    from kernels._tuning import read_configs, write_configs

    path = tmp_path / "tuning.json"
    h100 = {"gpu": "NVIDIA H100 80GB HBM3", "utc": "2026-11-24T22:50:15Z"}
    h200 = {"gpu": "NVIDIA H200", "utc": "2026-11-30T14:11:50Z"}
    path.write_text(json.dumps({"note": "n", "measured": h100, "configs": {"fwd": {"16,64": [64, 64, 4, 3]},
                                                                          "dq": {"16,64": [64, 64, 4, 2]}}}))
    write_configs(path, {"gluon_bwd_min_work": {"64,0": 5}, "dq": {"16,128": [64, 128, 8, 2]}}, h200, "n2")
    data = json.loads(path.read_text())
    assert data["measured"] == {"dq": h200, "fwd": h100, "gluon_bwd_min_work": h200} and data["note"] == "n2"
    assert read_configs(path) == {"dq": {"16,128": [64, 128, 8, 2], "16,64": [64, 64, 4, 2]},
                                  "fwd": {"16,64": [64, 64, 4, 3]}, "gluon_bwd_min_work": {"64,0": 5}}
    write_configs(path, {"fwd": {"16,64": [128, 64, 4, 3]}}, h200, "n2")
    assert json.loads(path.read_text())["measured"] == dict.fromkeys(("dq", "fwd", "gluon_bwd_min_work"), h200)
    fresh = tmp_path / "fresh.json"
    write_configs(fresh, {"fwd": {"16,64": [64, 64, 4, 3]}}, h100, "n")
    assert json.loads(fresh.read_text())["measured"] == {"fwd": h100}


def test_compile_check_filters_the_pasa_tiles_the_tuner_times():
    """scripts/compile_check.py --tiles compiles, for sm_90 without a GPU, the PASA candidates tune.py times: one list
    in two scripts, kept equal here."""
    from scripts.compile_check import PASA_CANDIDATES

    assert PASA_CANDIDATES == tune.PASA_TILES
