"""Gate verdicts on synthetic pairs of runs: a shift inside the noise is never SLOWER."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest

from attnbench.gate import bootstrap_change, compare_runs, gate_exit_code, gate_markdown
from test_analysis import make_run

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


def test_baseline_folder_resolves_to_its_run(tmp_path):
    b, c = _pair(tmp_path, BASE, seed=0)
    rows = compare_runs(b.parent, c)   # a folder of runs: the newest one (here the current run itself)
    assert set(verdicts(rows).values()) == {"SAME"}
