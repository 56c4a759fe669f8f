"""Gate verdicts on synthetic pairs of runs: a shift inside the noise is never SLOWER."""
from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from attnbench.gate import bootstrap_change, compare_runs, gate_exit_code, gate_markdown
from test_analysis import make_run
from test_faults import assert_one_line
from test_faults import cli as run_cli      # the real entry point, in this process

LATER = datetime(2026, 11, 23, 1, tzinfo=timezone.utc)


def _pts(ratios, **extra):
    return [dict(cell_id="elsa_fp16_fwd_vs_flash", baseline="flash", dtype="float16", n=n, ratio=r, **extra)
            for n, r in ratios.items()]


BASE = {4096: 2.0, 16384: 1.3, 65536: 1.1}


def _pair(tmp_path, current, *, spread=0.01, cur_spread=None, seed=1, base=BASE):
    b = make_run(tmp_path, _pts(base), name="nightly", seed=0, spread=spread)
    c = make_run(tmp_path, _pts(current), name="nightly", seed=seed, spread=cur_spread or spread, when=LATER,
                 started="2026-11-23T01:00:00Z")
    return b, c


def verdicts(rows):
    return {r.n: r.verdict for r in rows}


def test_identical_runs_are_same(tmp_path):
    b, c = _pair(tmp_path, BASE, seed=0)
    rows = compare_runs(b, c)
    assert verdicts(rows) == {4096: "SAME", 16384: "SAME", 65536: "SAME"}
    assert all(abs(r.change - 1) < 1e-12 for r in rows)
    assert gate_exit_code(rows) == 0


def test_rerun_with_fresh_noise_is_same(tmp_path):
    b, c = _pair(tmp_path, BASE, seed=7)
    rows = compare_runs(b, c)
    assert set(verdicts(rows).values()) == {"SAME"} and gate_exit_code(rows) == 0


def test_clearly_slower_is_caught(tmp_path):
    b, c = _pair(tmp_path, {4096: 2.0 * 1.25, 16384: 1.3, 65536: 1.1 * 0.8})
    rows = compare_runs(b, c)
    assert verdicts(rows) == {4096: "SLOWER", 16384: "SAME", 65536: "FASTER"}
    slow = rows[0]
    assert slow.ci_low > 1.07 and 1.2 < slow.change < 1.3
    assert gate_exit_code(rows) == 1
    md = gate_markdown(rows, baseline=str(b), current=str(c))
    assert "**Gate: FAIL** (SLOWER 1 · FASTER 1 · SAME 1)" in md
    # failing rows come first in the table
    table_rows = [line for line in md.splitlines() if line.startswith("| `")]
    assert "SLOWER" in table_rows[0] and "+25" in table_rows[0]


def test_a_ratio_moved_by_the_baseline_alone_is_baseline_not_slower(tmp_path):
    """At 4K the baseline's own time fell 20 % (a launch-bound SDPA on a faster host) and the kernel's stayed: the
    ratio rose 25 %, but the row is BASELINE, which does not fail, and says which side moved. At 16K the kernel
    itself got 25 % slower while the baseline also moved: SLOWER, with both sides' own change. At 64K the ratio
    fell 20 % because the baseline got slower: BASELINE too."""
    base = [dict(cell_id="sdpa_fwd_efficient_vs_math", n=n, ratio=r, baseline_ms=1.0)
            for n, r in ((4096, 0.2), (16384, 0.2), (65536, 0.2))]
    cur = [dict(cell_id="sdpa_fwd_efficient_vs_math", n=4096, ratio=0.25, baseline_ms=0.8),
           dict(cell_id="sdpa_fwd_efficient_vs_math", n=16384, ratio=0.3125, baseline_ms=0.8),
           dict(cell_id="sdpa_fwd_efficient_vs_math", n=65536, ratio=0.16, baseline_ms=1.25)]
    b = make_run(tmp_path, base, name="nightly", seed=0)
    c = make_run(tmp_path, cur, name="nightly", seed=1, when=LATER, started="2026-11-23T01:00:00Z")
    rows = compare_runs(b, c)
    assert verdicts(rows) == {4096: "BASELINE", 16384: "SLOWER", 65536: "BASELINE"}
    moved = rows[0]
    assert 1.2 < moved.change < 1.3 and moved.ci_low > 1.07           # the ratio did move past the band
    assert "the baseline moved, not the kernel" in moved.detail
    assert "kernel's own time +0.0 %" in moved.detail and "baseline's -20.0 %" in moved.detail
    assert "kernel's own time +25.0 %" in rows[1].detail
    assert gate_exit_code([moved, rows[2]]) == 0 and gate_exit_code(rows) == 1
    md = gate_markdown(rows)
    assert "(SLOWER 1 · BASELINE 2)" in md


def test_a_ratio_moved_while_the_kernel_stayed_is_never_slower():
    """The H100 nightly's SDPA efficient-vs-math cell at 1K: the ratio rose 11.8 % [10.6, 13.1] while the kernel's own
    time moved +2.3 % [1.9, 2.8] (inside the band) and the baseline's -10.2 % [-10.9, -0.7] (across its edge): the
    kernel did not change, so NOISY (which does not fail the gate), not SLOWER. The kernel's own time outside the
    band or across its edge keeps the row SLOWER."""
    from attnbench.gate import GateRow, _attribute

    def attributed(kernel, baseline):
        row = GateRow("p@1024", "c", 1024, "SLOWER", change=1.118, ci_low=1.106, ci_high=1.131)
        _attribute(row, {"kernel": kernel, "baseline": baseline}, 0.07)
        return row

    row = attributed((1.023, 1.019, 1.028), (0.898, 0.891, 0.993))
    assert row.verdict == "NOISY" and "kernel's own time stayed inside the band" in row.detail
    assert gate_exit_code([row]) == 0
    assert attributed((1.023, 1.019, 1.028), (0.898, 0.891, 0.92)).verdict == "BASELINE"
    assert attributed((1.06, 1.04, 1.08), (0.95, 0.93, 0.99)).verdict == "SLOWER"       # kernel's edge crossed
    assert attributed((1.10, 1.08, 1.12), (0.98, 0.97, 0.99)).verdict == "SLOWER"


def test_a_host_bound_point_on_a_slower_host_is_host_not_slower(tmp_path):
    """Cron Root's eager 4K forward on two H200 hosts: 0.024 ms a call against flash's 0.12, then 0.051 against 0.157
    on a host about twice as slow (ratio 0.20 -> 0.32). The kernel is host-bound (its host time inside a call, 0.03
    ms, is above its call's time) and the host time ratio (kernel / baseline) did not move: HOST, which does not fail
    the gate. Where that ratio moved too (16K: the kernel's host time 3x, the baseline's 2x) the row stays SLOWER and
    says so; a GPU-bound kernel (64K: 0.03 ms of host time in a call of about 5) stays SLOWER whatever its host did;
    without host samples in the baseline run (runs before they were recorded) the row is judged as before."""
    def pt(n, ratio, base_ms, k_host, b_host):
        return dict(cell_id="cron_root_fp16_fwd_vs_flash", n=n, ratio=ratio, baseline_ms=base_ms,
                    kernel_host_ms=k_host, baseline_host_ms=b_host)

    base = [pt(4096, 0.20, 0.12, 0.03, 0.02), pt(16384, 0.20, 0.12, 0.03, 0.02), pt(65536, 0.20, 25.0, 0.03, 0.02)]
    cur = [pt(4096, 0.32, 0.157, 0.06, 0.04), pt(16384, 0.32, 0.157, 0.09, 0.04), pt(65536, 0.25, 25.0, 0.06, 0.04)]
    b = make_run(tmp_path, base, name="nightly", seed=0)
    c = make_run(tmp_path, cur, name="nightly", seed=1, when=LATER, started="2026-11-23T01:00:00Z")
    rows = compare_runs(b, c)
    assert verdicts(rows) == {4096: "HOST", 16384: "SLOWER", 65536: "SLOWER"}
    host, moved, gpu_bound = rows
    assert host.ci_low > 1.07 and "the machine's host moved, not the kernel" in host.detail
    assert "host-bound (current run: 0.0" in host.detail and "ratio (kernel / baseline) stayed inside" in host.detail
    assert "host time ratio (kernel / baseline) moved too: +4" in moved.detail and "own time" in moved.detail
    assert "host" not in gpu_bound.detail
    assert gate_exit_code([host]) == 0 and gate_exit_code(rows) == 1
    assert "(SLOWER 2 · HOST 1)" in gate_markdown(rows)
    before_host_samples = [{k: v for k, v in p.items() if not k.endswith("_host_ms")} for p in base[:1]]
    old = make_run(tmp_path, before_host_samples, name="nightly", seed=0)
    assert verdicts(compare_runs(old, c))[4096] == "SLOWER"
    # a graph-timed point is never host-bound (its time is the device's), whatever its replay's enqueue took
    graph_b = make_run(tmp_path, [dict(base[0], timing="graph")], name="nightly", seed=0)
    graph_c = make_run(tmp_path, [dict(cur[0], timing="graph")], name="nightly", seed=1, when=LATER,
                       started="2026-11-23T01:00:00Z")
    assert verdicts(compare_runs(graph_b, graph_c))[4096] == "SLOWER"


def test_a_ratio_moved_by_the_baseline_on_another_gpu_model_stays_slower(tmp_path):
    """Absolute times compare only on one GPU model: across models (--allow-other-gpu) the ratio decides."""
    from test_analysis import H100

    base = [dict(cell_id="sdpa_fwd_efficient_vs_math", n=4096, ratio=0.2, baseline_ms=1.0)]
    cur = [dict(cell_id="sdpa_fwd_efficient_vs_math", n=4096, ratio=0.25, baseline_ms=0.8)]
    b = make_run(tmp_path, base, name="nightly", seed=0)
    c = make_run(tmp_path, cur, name="nightly", seed=1, when=LATER, started="2026-11-23T01:00:00Z",
                 gpu=dict(H100, name="NVIDIA H200"))
    assert verdicts(compare_runs(b, c)) == {4096: "SLOWER"}


@pytest.mark.parametrize("seed", range(6))
def test_slower_within_noise_is_never_slower(tmp_path, seed):
    # +5 % with 1 % noise: inside the ±7 % band → SAME (or NOISY), never SLOWER
    b, c = _pair(tmp_path, {n: r * 1.05 for n, r in BASE.items()}, seed=seed)
    rows = compare_runs(b, c, seed=seed)
    assert "SLOWER" not in verdicts(rows).values() and gate_exit_code(rows) == 0


@pytest.mark.parametrize("seed", range(6))
def test_noisy_samples_straddling_the_band_are_noisy(tmp_path, seed):
    # +8 % but with 25 % sample noise: the interval straddles 1.07 → NOISY, not SLOWER
    b, c = _pair(tmp_path, {n: r * 1.08 for n, r in BASE.items()}, spread=0.25, seed=seed + 10)
    rows = compare_runs(b, c, seed=seed)
    vs = set(verdicts(rows).values())
    assert "SLOWER" not in vs and "NOISY" in vs


def test_non_clean_and_missing_points(tmp_path):
    b = make_run(tmp_path, [
        dict(cell_id="a", n=1024, ratio=0.5),
        dict(cell_id="a", n=2048, ratio=0.5),
        dict(cell_id="a", n=4096, ratio=0.5),
        dict(cell_id="a", n=8192, status="oom", reason="math OOM"),
        dict(cell_id="gone", n=1024, ratio=0.5),
    ], name="nightly")
    c = make_run(tmp_path, [
        dict(cell_id="a", n=1024, ratio=0.5, status="noisy", reason="clock sag 85%"),
        dict(cell_id="a", n=2048, status="error", reason="RuntimeError: boom", failed_side="kernel"),
        dict(cell_id="a", n=4096, status="oom", reason="math OOM", failed_side="baseline"),
        dict(cell_id="a", n=8192, status="oom", reason="math OOM"),
        dict(cell_id="new", n=1024, ratio=0.5),
    ], name="nightly", when=LATER, started="2026-11-23T01:00:00Z")
    rows = {r.point_id: r for r in compare_runs(b, c)}
    assert rows["a@1024"].verdict == "NOISY" and "clock sag" in rows["a@1024"].detail
    assert rows["a@2048"].verdict == "BROKEN" and "boom" in rows["a@2048"].detail
    assert rows["a@4096"].verdict == "NOISY" and "math OOM" in rows["a@4096"].detail
    assert rows["a@8192"].verdict == "MISSING" and "oom in both" in rows["a@8192"].detail
    assert rows["gone@1024"].verdict == "MISSING" and "not in the current run" in rows["gone@1024"].detail
    assert rows["new@1024"].verdict == "MISSING" and "not in the baseline" in rows["new@1024"].detail
    assert gate_exit_code(list(rows.values())) == 1   # the kernel now fails where it used to run
    md = gate_markdown(list(rows.values()))
    assert "BROKEN 1" in md and "MISSING 3" in md


def test_bootstrap_is_deterministic():
    base = [1.0, 1.01, 0.99, 1.02, 0.98] * 4
    cur = [x * 1.1 for x in base]
    assert bootstrap_change(base, cur, key="p") == bootstrap_change(base, cur, key="p")
    change, lo, hi = bootstrap_change(base, cur, key="p")
    assert change == pytest.approx(1.1) and lo <= change <= hi


def test_baseline_folder_resolves_to_its_newest_run_other_than_the_current(tmp_path):
    b, c = _pair(tmp_path, {4096: 2.0 * 1.25, 16384: 1.3, 65536: 1.1})
    rows = compare_runs(b.parent, c)   # a folder of runs: its newest but the current one (the newest), so b
    assert verdicts(rows) == {4096: "SLOWER", 16384: "SAME", 65536: "SAME"}


def test_a_run_is_never_gated_against_itself(tmp_path, capsys):
    """--baseline and --current naming one run would PASS whatever it measured: refused, one line, exit 2. A folder
    baseline is its newest run other than the current one: the results root that holds the current run too gates
    it against the run before it, and a folder holding only the current run (or its blessed copy) has none."""
    from attnbench.gate import NotComparable, bless_run

    b, c = _pair(tmp_path / "runs", {4096: 2.0 * 1.25, 16384: 1.3, 65536: 1.1})
    out = tmp_path / "g.md"
    line = assert_one_line(run_cli(capsys, "gate", "--baseline", c, "--current", c, "--out", out), 2, str(c),
                           "same run")
    assert "PASS" not in line and not out.exists()
    with pytest.raises(NotComparable, match="same run"):
        compare_runs(c, c)
    gated = run_cli(capsys, "gate", "--baseline", c.parent, "--current", c, "--out", out)
    assert gated.code == 1 and f"baseline run: `{b}`" in gated.out and "SLOWER" in gated.out
    solo = make_run(tmp_path / "solo", _pts(BASE), name="nightly")
    assert_one_line(run_cli(capsys, "gate", "--baseline", solo.parent, "--current", solo, "--out", out), 2,
                    str(solo.parent), "no run other than")
    bless_run(c, tmp_path / "baselines")           # the folder holds c's copy: c against itself again
    assert_one_line(run_cli(capsys, "gate", "--baseline", tmp_path / "baselines" / "h100", "--current", c,
                            "--out", out), 2, "no run other than")


# --- every measured point is judged, whatever its spread ------------------------------------------------

# a launch-bound point: ratio samples with a 20 % spread, sampled (the stopping rule) until the median is known
SPREAD = dict(cell_id="nightly_elsa_fp16_fwdbwd_vs_flash", baseline="flash", dtype="float16", mode="fwdbwd",
              n=4096, spread=0.20, n_samples=1500)


def _spread_runs(tmp_path, current_ratio, *, current_status="clean", current_reason=None, base_status="clean",
                 base_reason=None, seed=5):
    b = make_run(tmp_path, [dict(SPREAD, ratio=1.30, status=base_status, reason=base_reason)], name="nightly", seed=0)
    c = make_run(tmp_path, [dict(SPREAD, ratio=current_ratio, status=current_status, reason=current_reason)],
                 name="nightly", seed=seed, when=LATER, started="2026-11-23T01:00:00Z")
    return b, c


@pytest.mark.parametrize("seed", range(4))
def test_spread_heavy_undisturbed_point_with_a_planted_15_percent_slowdown_is_slower(tmp_path, seed):
    b, c = _spread_runs(tmp_path, 1.30 * 1.15, seed=seed + 5)
    (row,) = compare_runs(b, c)
    assert row.verdict == "SLOWER", (row.change, row.ci_low, row.ci_high)
    assert 1.07 < row.ci_low and row.change == pytest.approx(1.15, abs=0.03)
    assert gate_exit_code([row]) == 1


@pytest.mark.parametrize("seed", range(4))
def test_the_same_spread_heavy_point_against_itself_is_same(tmp_path, seed):
    b, c = _spread_runs(tmp_path, 1.30, seed=seed + 5)
    (row,) = compare_runs(b, c)
    assert row.verdict == "SAME", (row.change, row.ci_low, row.ci_high)
    assert row.ci_high - row.ci_low < 0.07    # the interval is narrow despite the spread: many paired samples


def test_a_disturbed_window_is_noisy_whatever_the_change(tmp_path):
    b, c = _spread_runs(tmp_path, 1.30 * 1.5, current_status="disturbed",
                        current_reason="foreign process during run: 4242")
    (row,) = compare_runs(b, c)
    assert row.verdict == "NOISY" and "current run: window disturbed" in row.detail and "4242" in row.detail
    assert row.ci_low > 1.07          # the interval alone would have said SLOWER: the window decides
    b, c = _spread_runs(tmp_path / "x", 1.30, base_status="disturbed", base_reason="SM clock sagged to 1500 MHz")
    (row,) = compare_runs(b, c)
    assert row.verdict == "NOISY" and "baseline run: window disturbed" in row.detail


def test_legacy_noisy_points_load_and_spread_only_ones_are_judged(tmp_path):
    """Runs written before the split marked a spread-heavy point `noisy`; its window was clean, so it is judged."""
    b, c = _spread_runs(tmp_path, 1.30 * 1.15, base_status="noisy", base_reason="ratio spread CV 19.4% > 3%")
    (row,) = compare_runs(b, c)
    assert row.verdict == "SLOWER"
    b, c = _spread_runs(tmp_path / "x", 1.30, base_status="noisy",
                        base_reason="SM clock sagged to 1650 MHz (< 90% of 1980)")
    (row,) = compare_runs(b, c)
    assert row.verdict == "NOISY" and "window disturbed" in row.detail


def test_graph_points_pair_only_with_graph_points(tmp_path):
    pts = [dict(cell_id="c", n=4096, ratio=0.8), dict(cell_id="c", n=4096, ratio=0.6, timing="graph")]
    b = make_run(tmp_path, pts, name="nightly")
    c = make_run(tmp_path, [dict(pts[0]), dict(pts[1], ratio=0.6 * 1.2)], name="nightly", seed=3, when=LATER,
                 started="2026-11-23T01:00:00Z")
    rows = {r.point_id: r.verdict for r in compare_runs(b, c)}
    assert rows == {"c@4096": "SAME", "c@4096:graph": "SLOWER"}


@pytest.mark.parametrize("edit", [dict(kernel="pasa"), dict(dtype="bfloat16"), dict(head_dim=128), dict(heads=16)])
def test_a_point_id_naming_another_problem_in_the_current_run_is_refused(tmp_path, capsys, edit):
    """A cell edited between the runs (its kernel, dtype or shape) keeps its point ids: the gate refuses to compare
    its ratios as one point's (one line, exit 2), where it would have called the change SLOWER or SAME."""
    from attnbench.gate import NotComparable, check_comparable
    from attnbench.store import load_run

    base = [dict(p, head_dim=64, heads=8) for p in _pts(BASE)]
    b = make_run(tmp_path, base, name="nightly", seed=0)
    c = make_run(tmp_path, [dict(p, **edit) if p["n"] == 16384 else p for p in base], name="nightly", seed=1,
                 when=LATER, started="2026-11-23T01:00:00Z")
    (column, value), = edit.items()
    with pytest.raises(NotComparable, match=rf"point elsa_fp16_fwd_vs_flash@16384 measured a different problem "
                                            rf"in each run \({column} .* 1 such point"):
        check_comparable(load_run(b), load_run(c))
    assert_one_line(run_cli(capsys, "gate", "--baseline", b, "--current", c), 2, "different problem")
    check_comparable(load_run(b), load_run(b))          # a run against itself (and unedited cells) passes


# --- bless -----------------------------------------------------------------------------------------------

def test_bless_installs_the_run_for_its_gpu_and_replaces_the_previous_one(tmp_path):
    from attnbench.gate import NotComparable, bless_run

    first = make_run(tmp_path / "runs", _pts(BASE), name="nightly")
    second = make_run(tmp_path / "runs", _pts(BASE), name="nightly", seed=2, when=LATER, started="2026-11-23T01:00:00Z")
    root = tmp_path / "baselines"
    installed = bless_run(first, root)
    assert installed == root / "h100" / first.name and (installed / "points.csv").is_file()
    installed = bless_run(second, root)
    assert sorted(p.name for p in (root / "h100").iterdir()) == [second.name, "baseline.json"]
    record = json.loads((root / "h100" / "baseline.json").read_text())
    assert record["run"] == second.name and record["git_commit"] == "abc123def4567890"
    assert record["points"] == {"clean": 3}
    # the gate reads the folder: the blessed run is the baseline (of another run: not of itself)
    rows = compare_runs(root / "h100", first)
    assert {r.verdict for r in rows} == {"SAME"}
    assert [r.baseline_ratio for r in rows] == [r.current_ratio for r in compare_runs(first, second)]
    with pytest.raises(NotComparable, match="no run other than"):
        compare_runs(root / "h100", second)


def test_bless_refuses_unfinished_and_slowed_runs(tmp_path):
    from attnbench.gate import bless_run
    from attnbench.store import RunDirError, RunStore

    run = make_run(tmp_path / "runs", _pts(BASE), name="nightly")
    RunStore(run).update_manifest(finished_utc=None, interrupted=True)
    with pytest.raises(RunDirError, match="not finished"):
        bless_run(run, tmp_path / "baselines")
    RunStore(run).update_manifest(finished_utc="2026-11-22T02:00:00Z", interrupted=False,
                                  injected_slowdown={"elsa": 1.15})
    with pytest.raises(RunDirError, match="planted slowdown"):
        bless_run(run, tmp_path / "baselines")
    assert not (tmp_path / "baselines").exists()


def test_cli_bless_and_gate(tmp_path):
    from test_runner import cli

    b, c = _pair(tmp_path / "runs", BASE, seed=3)
    proc = cli("gate", "--bless", str(b), "--baselines-root", str(tmp_path / "baselines"))
    assert proc.returncode == 0, proc.stderr
    assert "baseline for h100" in proc.stdout and "abc123def4567890" in proc.stdout
    proc = cli("gate", "--baseline", str(tmp_path / "baselines" / "h100"), "--current", str(c))
    assert proc.returncode == 0 and "Gate: PASS" in proc.stdout
    proc = cli("gate", "--current", str(c))
    assert proc.returncode == 2 and "--baseline RUN and --current RUN" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli("gate", "--bless", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "not a run directory" in proc.stderr


def test_bless_takes_no_comparison_options_and_a_comparison_no_baselines_root(tmp_path, capsys):
    """Options that mean nothing with --bless (or without it) are refused, not silently dropped."""
    run = make_run(tmp_path / "runs", _pts(BASE), name="nightly")
    root = tmp_path / "baselines"
    assert_one_line(run_cli(capsys, "gate", "--bless", run, "--baselines-root", root, "--tolerance", "5", "--out",
                            "/nonexistent/x.md"), 2, "--bless", "--tolerance", "--out")
    assert_one_line(run_cli(capsys, "gate", "--bless", run, "--baselines-root", root, "--allow-other-gpu"), 2,
                    "--allow-other-gpu")
    assert not root.exists()
    assert_one_line(run_cli(capsys, "gate", "--baseline", run, "--current", run, "--baselines-root", root), 2,
                    "--baselines-root", "--bless")


def test_bless_into_a_root_it_cannot_write_is_one_line(tmp_path, capsys, monkeypatch):
    """A file as --baselines-root, or a copy that fails (an unwritable root, a full disk): one line, exit 2, and the
    previous baseline stays installed with nothing half-copied beside it."""
    import os
    import shutil

    first = make_run(tmp_path / "runs", _pts(BASE), name="nightly")
    second = make_run(tmp_path / "runs", _pts(BASE), name="nightly", seed=2, when=LATER, started="2026-11-23T01:00:00Z")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert_one_line(run_cli(capsys, "gate", "--bless", first, "--baselines-root", a_file), 2, str(a_file))
    root = tmp_path / "baselines"
    assert run_cli(capsys, "gate", "--bless", first, "--baselines-root", root).code == 0

    def denied(src, dst, **kwargs):     # a copy that fails half-way
        os.mkdir(dst)
        raise PermissionError(13, "Permission denied", str(dst))
    monkeypatch.setattr(shutil, "copytree", denied)
    assert_one_line(run_cli(capsys, "gate", "--bless", second, "--baselines-root", root), 2, str(root),
                    "Permission denied")
    assert sorted(p.name for p in (root / "h100").iterdir()) == [first.name, "baseline.json"]


@pytest.mark.skipif(__import__("os").geteuid() == 0, reason="root writes into read-only folders")
def test_bless_into_a_read_only_root_is_one_line(tmp_path, capsys):
    run = make_run(tmp_path / "runs", _pts(BASE), name="nightly")
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o555)
    try:
        assert_one_line(run_cli(capsys, "gate", "--bless", run, "--baselines-root", root), 2, str(root))
    finally:
        root.chmod(0o755)


def test_bless_while_another_bless_holds_the_root_is_refused(tmp_path, capsys):
    """Two blesses at once would copy into one folder and remove each other's runs: the baselines root's lock lets one
    in; the other is one line naming the holder's pid, and the installed baseline is whole."""
    import os

    from attnbench.store import RunStore

    first = make_run(tmp_path / "runs", _pts(BASE), name="nightly")
    second = make_run(tmp_path / "runs", _pts(BASE), name="nightly", seed=2, when=LATER, started="2026-11-23T01:00:00Z")
    root = tmp_path / "baselines"
    assert run_cli(capsys, "gate", "--bless", first, "--baselines-root", root).code == 0
    holder = RunStore(root)
    holder.lock()                      # another bless, mid-install
    try:
        assert_one_line(run_cli(capsys, "gate", "--bless", second, "--baselines-root", root), 2, str(root),
                        f"pid {os.getpid()}")
    finally:
        holder.unlock()
    assert json.loads((root / "h100" / "baseline.json").read_text())["run"] == first.name
    assert run_cli(capsys, "gate", "--bless", second, "--baselines-root", root).code == 0
    assert sorted(p.name for p in (root / "h100").iterdir()) == [second.name, "baseline.json"]


def test_nightly_script_blesses_gates_and_refuses_to_bless_a_slowed_run(tmp_path):
    """scripts/nightly.sh end to end on the CPU with the smoke matrix: --bless arms the gate, the next run is gated."""
    import os
    import subprocess
    import sys

    from test_runner import REPO

    env = dict(os.environ, NIGHTLY_MATRIX="matrices/smoke_cpu.yaml", BASELINES_ROOT=str(tmp_path / "baselines"),
               PYTHON=sys.executable, RETRIES="0")
    env.pop("TRITON_INTERPRET", None)

    def nightly(*args):
        return subprocess.run(["bash", str(REPO / "scripts" / "nightly.sh"), "--device", "cpu", "--results-root",
                               str(tmp_path / "runs"), *args], capture_output=True, text=True, env=env, timeout=600)

    first = nightly("--bless")
    assert first.returncode == 0, first.stderr[-2000:]
    assert "gate skipped" in first.stderr
    record = json.loads((tmp_path / "baselines" / "cpu" / "baseline.json").read_text())
    blessed = tmp_path / "baselines" / "cpu" / record["run"]
    assert (blessed / "points.csv").is_file() and (tmp_path / "runs" / record["run"] / "REPORT.md").is_file()
    second = nightly()
    assert second.returncode in (0, 1), second.stderr[-2000:]    # CPU timings may well differ: only the plumbing
    (run2,) = [p for p in (tmp_path / "runs").iterdir() if p.name != record["run"]]
    assert "# Perf gate" in (run2 / "gate.md").read_text() and f"baseline run: `{blessed}`" in second.stdout
    slowed = nightly("--bless", "--slowdown", "flash=1.15", "--only", "flash_vs_math_fp32_fwd")
    assert slowed.returncode == 2 and "planted slowdown" in slowed.stderr
    assert json.loads((tmp_path / "baselines" / "cpu" / "baseline.json").read_text())["run"] == record["run"]
