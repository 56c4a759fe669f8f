"""RESULTS markdown: content, plots, and byte-identical regeneration."""
from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from attnbench.analysis import summarize_cells
from attnbench.report import build_report, load_summary, scaling_table
from attnbench.runs import load_runs
from attnbench.store import load_run
from test_analysis import make_run, seed_cells


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "results" / "runs"
    a = make_run(root, seed_cells(), name="full")
    model_pts = [dict(cell_id="vit_t_fp16_fwd", kernel="elsa", baseline="native", dtype="float16", n=n, ratio=r,
                      heads=None, head_dim=None, batch=8, mem_ratio=1.0) for n, r in [(224, 1.14), (512, 1.36)]]
    b = make_run(root, model_pts, name="models", started="2026-11-22T04:00:00Z",
                 when=datetime(2026, 11, 22, 4, tzinfo=timezone.utc))
    return [a, b]


def test_report_content(tmp_path, runs):
    out = build_report(runs, results_root=tmp_path / "results", plots=False)
    assert out == tmp_path / "results" / "RESULTS_H100.md"
    text = out.read_text()
    assert text.startswith("# attnbench results: H100\n")
    assert "perf numbers on CPU" not in text
    # environment and gate thresholds from the manifests
    assert "NVIDIA H100 80GB HBM3 (132 SMs" in text and "580.159.04" in text and "`abc123def456`" in text
    assert "util ≤ 8.0 %, free ≥ 12.0 GB" in text
    # the seed-shaped table with computed trends, marks and notes
    assert "| 1K 0.44 · 4K 0.44 · 8K 0.36 (math OOM @16K) |" in text
    assert "crosses < 1 at ~32K" in text and "64K 1.70*" in text and "`*` = still noisy" in text
    assert "(skipped @1K, 4K)" in text and "2K 0.76 · (error @4K) · 8K 0.45" in text
    assert "### Full models (n = image size)" in text and "224 1.14 · 512 1.36" in text
    # load summary and every point
    assert "## Load during the measurements" in text and "sw_power_cap" in text
    assert "## All points" in text
    # relative links to the plots and the runs
    for name in ("elsa_fp32_fwd_vs_math.png", "vit_t_fp16_fwd.png", "overview_elsa_attention.png"):
        assert f"](plots/H100/{name})" in text
    assert "](runs/20261122T010000Z_full)" in text


def test_plots_are_written(tmp_path):
    pts = [p for p in seed_cells() if p["cell_id"] == "elsa_fp32_fwd_vs_math"]
    pts += [dict(cell_id="vit_t_fp16_fwd", kernel="elsa", baseline="native", dtype="float16", n=n, ratio=r,
                 heads=None, head_dim=None, batch=8, mem_ratio=1.0) for n, r in [(224, 1.14), (512, 1.36)]]
    run = make_run(tmp_path / "runs", pts)
    out = build_report([run], tmp_path / "R.md", tmp_path / "figs")
    text = out.read_text()
    for name in ("elsa_fp32_fwd_vs_math.png", "vit_t_fp16_fwd.png", "overview_elsa_attention.png"):
        png = tmp_path / "figs" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
        assert f"](figs/{name})" in text
    # regenerating with plots gives the same markdown too
    first = text
    assert build_report([run], tmp_path / "R.md", tmp_path / "figs").read_text() == first


def test_report_is_byte_identical(tmp_path, runs):
    out1 = build_report(runs, tmp_path / "a.md", tmp_path / "plots", plots=False)
    first = out1.read_bytes()
    out2 = build_report(list(reversed(runs)), tmp_path / "a.md", tmp_path / "plots", plots=False)
    assert out2.read_bytes() == first
    assert b"nan" not in first.lower().replace(b"nanoseconds", b"")


def test_cpu_report_has_banner(tmp_path):
    run = make_run(tmp_path, [dict(cell_id="smoke", kernel="flash", baseline="math", n=256, ratio=0.8)],
                   device="cpu", name="smoke_cpu")
    out = build_report([run], results_root=tmp_path, plots=False)
    assert out.name == "RESULTS_CPU.md"
    text = out.read_text()
    assert "performance numbers on CPU mean nothing" in text
    assert "| CPU |" in text  # environment row


def test_mixed_gpus_refused(tmp_path):
    a = make_run(tmp_path, [dict(cell_id="c", n=1024, ratio=0.5)])
    b = make_run(tmp_path, [dict(cell_id="c", n=1024, ratio=0.5)], gpu={"index": 0, "name": "NVIDIA A100-SXM4-80GB",
                                                                        "uuid": "x", "sm_count": 108},
                 when=datetime(2026, 11, 22, 5, tzinfo=timezone.utc))
    with pytest.raises(ValueError, match="different GPUs"):
        build_report([a, b], results_root=tmp_path, plots=False)


def test_spot_check_verdicts_are_included(tmp_path, runs):
    (runs[0] / "spot_check.md").write_text("| check | verdict |\n|---|---|\n| P1 | PASS |\n")
    text = build_report(runs, tmp_path / "a.md", tmp_path / "plots", plots=False).read_text()
    assert "## Spot-check verdicts" in text and "| P1 | PASS |" in text
    assert f"]({runs[0].relative_to(tmp_path).as_posix()}/spot_check.md)" in text


def test_first_calls_section_only_when_recorded(tmp_path, runs):
    text = build_report(runs, tmp_path / "a.md", tmp_path / "plots", plots=False).read_text()
    assert "## First calls" not in text            # these runs predate first-call records
    with open(runs[0] / "attempts.jsonl", "a") as fh:
        fh.write(json.dumps({"point_id": "cold@1024", "cell_id": "cold", "n": 1024, "attempt": 1, "status": "clean",
                             "kernel": {"backend": "cron_root", "first_call_ms": 2150.0, "ms_median": 0.05},
                             "baseline": {"backend": "flash", "first_call_ms": 3.2, "ms_median": 0.04}}) + "\n")
    text = build_report(runs, tmp_path / "a.md", tmp_path / "plots", plots=False).read_text()
    assert "## First calls (compilation included)" in text
    assert "| `cold` | 1024 | cron_root: 2150 (steady 0.05) | flash: 3.2 (steady 0.04) |" in text


def test_load_summary_ranges(tmp_path):
    run = make_run(tmp_path, [dict(cell_id="c", n=1024, ratio=0.5, util=0.0, attempts=["noisy"]),
                              dict(cell_id="c", n=2048, ratio=0.6, util=4.0)])
    (row,) = load_summary([load_run(run)])
    assert row["attempts"] == 3 and row["noisy"] == 1
    assert row["util % before"] == "0–30" and row["util % after"] == "1–2"
    assert row["SM MHz after"] == "1500–1980"
    assert row["throttle reasons seen"] == "sw_power_cap"


def test_scaling_table_recovers_known_exponents(tmp_path):
    """Baseline times grow as N² (make_run), the kernel's ratio as N^-½: the kernel grows as N^1.5, i.e. ×2.83 per
    doubling, the baseline ×4.00; a cell with two lengths gets no row; model cells none."""
    K = 1024
    pts = [dict(cell_id="sparse", kernel="cron_root", baseline="flash", n=n, ratio=(n / K) ** -0.5)
           for n in (K, 4 * K, 16 * K, 64 * K)]
    pts += [dict(cell_id="short", n=n, ratio=0.5) for n in (K, 2 * K)]
    pts += [dict(cell_id="m", kernel="elsa", baseline="native", n=n, ratio=1.0, heads=None, head_dim=None, batch=8)
            for n in (224, 384, 512)]
    df = load_runs([make_run(tmp_path, pts, spread=0.0)])
    table = scaling_table(summarize_cells(df))
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == 1 and rows[0].startswith("| `sparse` | cron_root vs flash |")
    assert "1K→4K 2.83 · 4K→16K 2.83 · 16K→64K 2.83" in rows[0]
    assert "1K→4K 4.00 · 4K→16K 4.00 · 16K→64K 4.00" in rows[0] and "| 1.50 / 2.00 |" in rows[0]
    assert scaling_table(summarize_cells(df[df.cell_id == "short"])) is None


def test_cli_report_from_a_run_list(tmp_path, runs):
    """`attnbench report --runs FILE` builds the same markdown as naming the directories; a bad list is one line, exit 2."""
    import subprocess
    import sys

    results = tmp_path / "results"
    expected = build_report(runs, results_root=results, plots=False).read_bytes()
    listing = results / "H100_runs.txt"
    listing.write_text("# runs behind RESULTS_H100.md\n" + "".join(f"runs/{r.name}\n" for r in reversed(runs)))
    out = results / "RESULTS_H100.md"
    out.unlink()

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "attnbench", "report", *args], capture_output=True, text=True,
                              cwd=tmp_path)

    done = cli("--runs", str(listing), "--no-plots", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == expected
    listing.write_text("runs/missing\n")
    done = cli("--runs", str(listing), "--no-plots", "--out", str(out))
    assert done.returncode == 2 and "H100_runs.txt:1: runs/missing: not a run directory" in done.stderr
    assert "Traceback" not in done.stderr
    done = cli("--no-plots")
    assert done.returncode == 2 and "--runs" in done.stderr and "Traceback" not in done.stderr


# --- runs written before timing modes and CIs -------------------------------------------------------------

def _legacy(run_dir):
    """Rewrite a run directory the way the harness wrote it before: points.csv without the newer columns."""
    import pandas as pd

    from attnbench.store import REQUIRED_COLUMNS

    pts = pd.read_csv(run_dir / "points.csv", dtype=str)
    pts[REQUIRED_COLUMNS].to_csv(run_dir / "points.csv", index=False)
    return run_dir


def test_legacy_runs_load_and_report_without_the_new_columns(tmp_path):
    from attnbench.store import POINT_COLUMNS, load_run

    run = make_run(tmp_path / "results" / "runs", seed_cells(), name="full")
    new_text = build_report([run], results_root=tmp_path / "results", plots=False).read_text()
    assert "95 % CI of the median" in new_text and "| ±" in new_text
    loaded = load_run(_legacy(run))
    assert list(loaded.points.columns) == POINT_COLUMNS
    assert set(loaded.points.timing) == {"eager"} and loaded.points.ci_half_width.isna().all()
    old_text = build_report([run], results_root=tmp_path / "results", plots=False).read_text()
    assert "95 % CI of the median" not in old_text and "`*` = still noisy after its retries" in old_text
    assert "| noisy |" in old_text.split("## Load during the measurements")[1]   # the legacy column title


def test_a_resumed_legacy_run_keeps_its_header(tmp_path):
    from attnbench.store import REQUIRED_COLUMNS, RunStore, load_run

    run = _legacy(make_run(tmp_path, [dict(cell_id="a", n=1024, ratio=0.5)], name="x"))
    row = load_run(run).points.iloc[0].to_dict()
    row.update(point_id="a@2048", n=2048, timing="eager", ci_half_width=0.01)
    RunStore(run).append_point({k: (None if v != v else v) for k, v in row.items()})
    header, *lines = (run / "points.csv").read_text().splitlines()
    assert header.split(",") == REQUIRED_COLUMNS and all(len(l.split(",")) == len(REQUIRED_COLUMNS) for l in lines)
    assert list(load_run(run).points.point_id) == ["a@1024", "a@2048"]


def test_disturbed_points_are_starred_with_their_own_note(tmp_path):
    pts = [dict(cell_id="c", n=1024, ratio=0.5), dict(cell_id="c", n=4096, ratio=0.6, status="disturbed",
                                                      reason="foreign process during run: 4242")]
    run = make_run(tmp_path / "results" / "runs", pts, name="full")
    text = build_report([run], results_root=tmp_path / "results", plots=False).read_text()
    assert "1K 0.50 · 4K 0.60*" in text and "`*` = window still disturbed after its retries" in text
    assert "still noisy" not in text and "1 clean, 1 disturbed" in text
