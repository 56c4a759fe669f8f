"""Sweep tables and trend words on synthetic run directories with known answers.

`make_run` (also used by test_report / test_gate / test_spotcheck) writes a real run directory through
attnbench.store.RunStore, so the tests read exactly what the runner writes.
"""
from __future__ import annotations

import json
import random
from datetime import datetime, timezone

import pytest

from attnbench.analysis import lat_trend, select_final, summarize_cells
from attnbench.formatting import format_n, format_ratio
from attnbench.measure.stats import median_ci, median_ci_half_width, robust_cv
from attnbench.report import sweep_table
from attnbench.runs import load_runs
from attnbench.store import RunDirError, RunStore

H100 = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-0000", "sm_count": 132}


def snapshot(util=1.0, free=80.0, temp=35, clock=1980, cpu=3.0, throttle=(), processes=()):
    return {"utc": "2026-11-22T00:00:00Z",
            "gpu": {"index": 0, "name": H100["name"], "uuid": "GPU-0000", "util_pct": util, "util_samples": [util],
                    "mem_used_gb": 85 - free, "mem_free_gb": free, "mem_total_gb": 85.0, "temp_c": temp,
                    "sm_clock_mhz": clock, "sm_clock_max_mhz": 1980, "power_w": 80.0, "power_limit_w": 700.0,
                    "throttle_reasons": list(throttle), "processes": list(processes)},
            "system": {"cpu_pct": cpu, "load_avg": [0.5, 0.4, 0.3], "ram_used_gb": 10.0, "ram_total_gb": 128.0,
                       "top_processes": []}}


def _side(backend, ms, status="clean", mem=10.0):
    if ms is None:
        return {"backend": backend, "ms_median": None, "ms_p10": None, "ms_p90": None, "ms_min": None, "cv": None,
                "samples_ms": [], "mem_mb": None, "tflops": None, "status": status, "message": None}
    return {"backend": backend, "ms_median": ms, "ms_p10": ms * 0.98, "ms_p90": ms * 1.02, "ms_min": ms * 0.97,
            "cv": 0.01, "samples_ms": [ms] * 5, "mem_mb": mem, "tflops": 100.0, "status": status, "message": None}


def make_run(root, points, *, name="test", device="cuda", gpu=H100, started="2026-11-22T01:00:00Z",
             when=None, seed=0, spread=0.01, n_samples=40):
    """Write a run directory. Each point is a dict with at least cell_id, n and one of:
    ratio (a measured lat_ratio; status clean unless given), or status oom/skipped/error with reason.
    Optional: kernel, baseline, dtype, mode, causal, heads, head_dim (None for model cells), mem_ratio,
    samples (explicit ratio samples), n_samples, spread (per point), baseline_ms (the baseline side's time; the
    kernel's is it x the ratio), attempts (list of statuses of earlier
    attempts, e.g. ["noisy"]), failed_side, timing ("graph" writes the run's newer columns too), kernel_host_ms and
    baseline_host_ms (each side's host time inside a call: one host sample per pair, 2 % noise).
    A "noisy" point records its reason as the legacy runs did (noisy_reasons); a "disturbed" one as runs do now.
    """
    when = when or datetime(2026, 11, 22, 1, 0, 0, tzinfo=timezone.utc)
    manifest = {"matrix_path": f"matrices/{name}.yaml", "matrix_name": name, "matrix_sha256": "0" * 64,
                "argv": ["run-matrix"], "git_commit": "abc123def4567890", "started_utc": started,
                "finished_utc": started.replace("01:", "02:"), "device": device,
                "versions": {"python": "3.12.3", "torch": "2.11.0", "triton": "3.6.0", "cuda": "13.0",
                             "driver": "580.159.04"},
                "gpu": gpu if device == "cuda" else None, "gate": {"max_util_pct": 8.0, "min_free_gb": 12.0},
                "host": "gpu-node-1", "interrupted": False}
    store = RunStore.create(root, name, manifest, now=when)
    rng = random.Random(seed)
    for p in points:
        cell, n = p["cell_id"], p["n"]
        kernel, baseline = p.get("kernel", "elsa"), p.get("baseline", "math")
        status = p.get("status", "clean")
        ratio = p.get("ratio")
        mem_ratio = p.get("mem_ratio", 0.5 if ratio is not None else None)
        model = "heads" in p and p["heads"] is None
        base_ms = p.get("baseline_ms", 1.0 * (n / 1024) ** 2 if not model else 2.0)
        prior = p.get("attempts", [])
        for i, prior_status in enumerate(prior, 1):
            store.append_attempt({"point_id": f"{cell}@{n}", "cell_id": cell, "n": n, "attempt": i,
                                  "utc": started, "status": prior_status, "noisy_reasons": ["clock sag 80%"],
                                  "message": None, "kernel": _side(kernel, base_ms), "baseline": _side(baseline, base_ms),
                                  "ratio": None, "mem_ratio": None, "before": snapshot(util=30.0),
                                  "after": snapshot(clock=1500, throttle=("sw_power_cap",))})
        if ratio is not None:
            samples = p.get("samples") or [ratio * (1 + rng.gauss(0, p.get("spread", spread)))
                                           for _ in range(p.get("n_samples", n_samples))]
            srt = sorted(samples)
            med = srt[len(srt) // 2] if p.get("samples") else ratio
            p10, p90 = srt[int(0.1 * (len(srt) - 1))], srt[int(0.9 * (len(srt) - 1))]
            kside, bside = _side(kernel, base_ms * med, mem=10.0 * mem_ratio if mem_ratio else 10.0), _side(baseline, base_ms)
            for side, key in ((kside, "kernel_host_ms"), (bside, "baseline_host_ms")):
                if key in p:
                    side["host_samples_ms"] = [p[key] * (1 + rng.gauss(0, 0.02)) for _ in samples]
                    side["host_ms_median"] = sorted(side["host_samples_ms"])[len(samples) // 2]
            ratio_rec = {"median": med, "p10": p10, "p90": p90, "samples": samples}
        else:
            med = p10 = p90 = None
            failed = p.get("failed_side", "baseline")
            kside = _side(kernel, None if failed == "kernel" else base_ms, status if failed == "kernel" else "clean")
            bside = _side(baseline, None if failed == "baseline" else base_ms, status if failed == "baseline" else "clean")
            if status == "skipped":
                kside, bside = _side(kernel, None, "skipped"), _side(baseline, None, "skipped")
            ratio_rec = None
        attempt_no = len(prior) + 1
        reasons = [p["reason"]] if status in ("noisy", "disturbed") and p.get("reason") else []
        pid = f"{cell}@{n}" + (":graph" if p.get("timing") == "graph" else "")
        store.append_attempt({"point_id": pid, "cell_id": cell, "n": n, "timing_mode": p.get("timing", "eager"),
                              "attempt": attempt_no, "utc": started, "status": status,
                              ("disturbed_reasons" if status == "disturbed" else "noisy_reasons"): reasons,
                              "message": None if reasons else p.get("reason"),
                              "kernel": kside, "baseline": bside, "ratio": ratio_rec, "mem_ratio": mem_ratio,
                              "before": snapshot(util=p.get("util", 1.0)), "after": snapshot(util=2.0, temp=40)})
        ci = median_ci(ratio_rec["samples"]) if ratio_rec else None
        store.append_point({
            "point_id": pid, "cell_id": cell, "kernel": kernel, "baseline": baseline,
            "dtype": p.get("dtype", "float32"), "mode": p.get("mode", "fwd"), "causal": p.get("causal", False),
            "batch": p.get("batch", 1), "heads": p.get("heads", 8), "head_dim": p.get("head_dim", 64), "n": n,
            "kernel_ms": kside["ms_median"], "kernel_ms_p10": kside["ms_p10"], "kernel_ms_p90": kside["ms_p90"],
            "baseline_ms": bside["ms_median"], "baseline_ms_p10": bside["ms_p10"], "baseline_ms_p90": bside["ms_p90"],
            "lat_ratio": med, "lat_ratio_p10": p10, "lat_ratio_p90": p90,
            "kernel_mem_mb": kside["mem_mb"], "baseline_mem_mb": bside["mem_mb"], "mem_ratio": mem_ratio,
            "kernel_tflops": kside["tflops"], "baseline_tflops": bside["tflops"], "status": status,
            "attempts": attempt_no, "reason": p.get("reason"), "timing": p.get("timing", "eager"),
            "spread": robust_cv(ratio_rec["samples"]) if ratio_rec else None,
            "lat_ratio_ci_low": ci[0] if ci else None, "lat_ratio_ci_high": ci[1] if ci else None,
            "ci_half_width": median_ci_half_width(ratio_rec["samples"]) if ci else None,
            "kernel_host_ms": kside.get("host_ms_median"), "baseline_host_ms": bside.get("host_ms_median"),
        })
    return store.path


def seed_cells():
    """The seed's six attention cells (A100 numbers), with the seed's OOM and a noisy point added."""
    K = 1024
    pts = []
    for n, r, m in [(1 * K, 0.44, 0.09), (4 * K, 0.44, 0.05), (8 * K, 0.36, 0.02)]:
        pts.append(dict(cell_id="elsa_fp32_fwd_vs_math", n=n, ratio=r, mem_ratio=m))
    pts.append(dict(cell_id="elsa_fp32_fwd_vs_math", n=16 * K, status="oom", reason="math OOM: CUDA out of memory"))
    for n, r in [(4 * K, 1.63), (8 * K, 1.20), (16 * K, 1.22), (32 * K, 0.99), (64 * K, 0.95)]:
        pts.append(dict(cell_id="elsa_fp32_fwd_vs_efficient", baseline="efficient", n=n, ratio=r, mem_ratio=1.05))
    for n, r in [(1 * K, 4.57), (4 * K, 2.83), (16 * K, 1.26)]:
        pts.append(dict(cell_id="elsa_fp16_fwd_vs_flash", baseline="flash", dtype="float16", n=n, ratio=r, mem_ratio=0.7))
    pts.append(dict(cell_id="elsa_fp16_fwd_vs_flash", baseline="flash", dtype="float16", n=64 * K, ratio=1.7,
                    status="noisy", reason="ratio cv 5.1% > 3%", attempts=["noisy", "noisy", "noisy"], mem_ratio=1.9))
    for n, r in [(4 * K, 1.05), (8 * K, 0.97), (16 * K, 1.02), (32 * K, 1.08)]:
        pts.append(dict(cell_id="elsa_fp32_fwdbwd_vs_efficient", baseline="efficient", mode="fwdbwd", n=n, ratio=r,
                        mem_ratio=0.8))
    for n, r in [(8 * K, 2.12), (16 * K, 2.21), (32 * K, 1.57)]:
        pts.append(dict(cell_id="elsa_fp16_fwdbwd_vs_flash", baseline="flash", dtype="float16", mode="fwdbwd", n=n,
                        ratio=r, mem_ratio=0.77))
    pts.append(dict(cell_id="elsa_fp16_fwd_vs_cudnn", baseline="cudnn", dtype="float32", n=1 * K, status="skipped",
                    reason="cudnn: float32 unsupported on cuda (supports float16, bfloat16)"))
    pts.append(dict(cell_id="elsa_fp16_fwd_vs_cudnn", baseline="cudnn", dtype="float32", n=4 * K, status="skipped",
                    reason="cudnn: float32 unsupported on cuda (supports float16, bfloat16)"))
    pts.append(dict(cell_id="elsa_fp32_fwdbwd_vs_math", mode="fwdbwd", n=2 * K, ratio=0.76, mem_ratio=0.05))
    pts.append(dict(cell_id="elsa_fp32_fwdbwd_vs_math", mode="fwdbwd", n=4 * K, status="error",
                    reason="RuntimeError: triton compile failed", failed_side="kernel"))
    pts.append(dict(cell_id="elsa_fp32_fwdbwd_vs_math", mode="fwdbwd", n=8 * K, ratio=0.45, mem_ratio=0.02))
    return pts


@pytest.fixture
def seed_run(tmp_path):
    return make_run(tmp_path, seed_cells(), name="full")


# -- formatting -------------------------------------------------------------------------------------------

def test_format_n_and_ratio():
    assert [format_n(n) for n in (1024, 4096, 65536, 262144, 1 << 20, 1000, 4097)] == \
        ["1K", "4K", "64K", "256K", "1M", "1000", "4097"]
    assert format_n(224, model=True) == "224" and format_n(1024, model=True) == "1024"
    assert format_ratio(0.444) == "0.44" and format_ratio(4.566) == "4.57" and format_ratio(0.0042) == "0.0042"
    assert format_ratio(float("nan")) == "–"


# -- trend words: the seed's cells and constructed cases ----------------------------------------------------

K = 1024


@pytest.mark.parametrize("ns,ratios,expected", [
    ([K, 4 * K, 8 * K], [0.44, 0.44, 0.36], "wins all, widens with length"),
    ([4 * K, 8 * K, 16 * K, 32 * K, 64 * K], [1.63, 1.20, 1.22, 0.99, 0.95], "crosses < 1 at ~32K"),
    ([K, 4 * K, 16 * K], [4.57, 2.83, 1.26], "loses all, narrows with length"),
    ([8 * K, 16 * K, 32 * K], [2.12, 2.21, 1.57], "loses all, narrows with length"),
    ([4 * K, 8 * K, 16 * K, 32 * K], [1.05, 0.97, 1.02, 1.08], "parity band"),
    ([K, 4 * K, 16 * K], [0.8, 0.95, 1.3], "crosses > 1 at ~16K"),
    ([K, 4 * K, 16 * K], [1.2, 1.6, 2.4], "loses all, widens with length"),
    ([K, 4 * K], [0.5, 0.5], "wins all"),
    ([K, 4 * K, 16 * K], [0.8, 1.3, 0.7], "mixed"),                      # one last point is no crossing
    ([K, 4 * K, 16 * K, 32 * K], [0.8, 1.3, 0.7, 0.6], "crosses < 1 at ~16K"),
    ([K, 4 * K, 16 * K, 32 * K], [0.8, 1.3, 0.7, 1.4], "mixed"),
    ([224, 512, 768, 1024], [3.74, 1.12, 1.51, 1.40], "loses all, narrows with length"),   # seed ViT-T fp32
    ([224, 384, 512], [0.97, 0.77, 0.85], "wins all, widens with length"),                 # seed Swin-T fp16
    ([K], [float("nan")], "no data"),
])
def test_lat_trend(ns, ratios, expected):
    assert lat_trend(ns, ratios) == expected


def test_trend_is_order_independent():
    assert lat_trend([64 * K, 4 * K, 16 * K], [0.95, 1.63, 1.22]) == lat_trend([4 * K, 16 * K, 64 * K], [1.63, 1.22, 0.95])


# -- the sweep table -------------------------------------------------------------------------------------------

def _by_id(summaries):
    return {s.cell_id: s for s in summaries}


def test_seed_sweeps(seed_run):
    s = _by_id(summarize_cells(load_runs([seed_run])))
    math_cell = s["elsa_fp32_fwd_vs_math"]
    assert math_cell.sweep == "1K 0.44 · 4K 0.44 · 8K 0.36 (math OOM @16K)"
    assert math_cell.mem == "0.02–0.09"
    assert math_cell.trend == "wins all, widens with length + memory win"
    eff = s["elsa_fp32_fwd_vs_efficient"]
    assert eff.sweep == "4K 1.63 · 8K 1.20 · 16K 1.22 · 32K 0.99 · 64K 0.95"
    assert eff.trend == "crosses < 1 at ~32K" and eff.mem == "1.05"
    flash = s["elsa_fp16_fwd_vs_flash"]
    # the noisy 64K point keeps its number with a star but is left out of the trend
    assert flash.sweep == "1K 4.57 · 4K 2.83 · 16K 1.26 · 64K 1.70*"
    assert flash.trend == "loses all, narrows with length + memory win"   # memory from the clean points
    assert flash.mem == "0.70–1.90"                                          # the range shows every measured point
    assert any("@64K: noisy after 4 attempts: ratio cv 5.1% > 3%" in n for n in flash.notes)
    assert s["elsa_fp32_fwdbwd_vs_efficient"].trend == "parity band + memory win"
    assert s["elsa_fp16_fwdbwd_vs_flash"].trend == "loses all, narrows with length + memory win"
    # skipped points are grouped, with the reason in the notes
    cud = s["elsa_fp16_fwd_vs_cudnn"]
    assert cud.sweep == "(skipped @1K, 4K)" and cud.trend == "no data" and cud.mem == "–"
    assert any("float32 unsupported" in n for n in cud.notes)
    # an error in the middle of a sweep stays where it happened
    bwd = s["elsa_fp32_fwdbwd_vs_math"]
    assert bwd.sweep == "2K 0.76 · (error @4K) · 8K 0.45"
    assert any("triton compile failed" in n for n in bwd.notes)


def test_spread_is_shown(seed_run):
    s = _by_id(summarize_cells(load_runs([seed_run])))
    eff = s["elsa_fp32_fwd_vs_efficient"]
    lo, hi = eff.spread.split(" · ")[0].split("–")
    assert float(lo) < 1.63 < float(hi) + 0.01
    assert eff.sweep_with_spread.startswith("4K 1.63 [")
    table = sweep_table(list(s.values()))
    assert table.splitlines()[0] == "| cell | setup | baseline | lat_ratio sweep | p10–p90 | mem_ratio | trend |"
    assert "| `elsa_fp32_fwd_vs_math` | fp32 fwd · B1 H8 D64 | math | 1K 0.44 · 4K 0.44 · 8K 0.36 (math OOM @16K) |" in table
    inline = sweep_table(list(s.values()), spread="inline")
    assert "p10–p90" not in inline.splitlines()[0] and "4K 1.63 [" in inline


def test_model_cells_use_image_sizes(tmp_path):
    pts = [dict(cell_id="vit_t_fp16_fwd", kernel="elsa", baseline="native", dtype="float16", n=n, ratio=r,
                heads=None, head_dim=None, batch=8, mem_ratio=1.0)
           for n, r in [(224, 1.14), (512, 1.36), (1536, 2.93), (2048, 1.71)]]
    run = make_run(tmp_path, pts)
    (s,) = summarize_cells(load_runs([run]))
    assert s.is_model
    assert s.sweep == "224 1.14 · 512 1.36 · 1536 2.93 · 2048 1.71"
    assert s.setup == "fp16 fwd · batch 8"


def test_select_final_prefers_clean_then_latest(tmp_path):
    a = make_run(tmp_path, [dict(cell_id="c", n=1024, ratio=0.5), dict(cell_id="c", n=2048, ratio=0.6, status="noisy")],
                 started="2026-11-22T01:00:00Z", when=datetime(2026, 11, 22, 1, tzinfo=timezone.utc))
    b = make_run(tmp_path, [dict(cell_id="c", n=1024, ratio=0.7, status="noisy"), dict(cell_id="c", n=2048, ratio=0.8)],
                 started="2026-11-22T03:00:00Z", when=datetime(2026, 11, 22, 3, tzinfo=timezone.utc))
    final = select_final(load_runs([b, a]))
    got = {int(r.n): (round(r.lat_ratio, 2), r.status) for r in final.itertuples()}
    assert got == {1024: (0.5, "clean"), 2048: (0.8, "clean")}
    c = make_run(tmp_path, [dict(cell_id="c", n=1024, ratio=0.4)], started="2026-11-22T05:00:00Z",
                 when=datetime(2026, 11, 22, 5, tzinfo=timezone.utc))
    final = select_final(load_runs([a, b, c]))
    assert round(final[final.n == 1024].lat_ratio.iloc[0], 2) == 0.4  # both clean: the later run wins


def test_a_superseding_run_replaces_earlier_points_whatever_their_status(tmp_path):
    """A run marked as superseding (the kernel changed): its disturbed point replaces an earlier run's clean one,
    points it did not measure keep the earlier run's, and a later run competes with it as usual."""
    def run(points, hour):
        return make_run(tmp_path, points, started=f"2026-11-22T0{hour}:00:00Z",
                        when=datetime(2026, 11, 22, hour, tzinfo=timezone.utc))

    old = run([dict(cell_id="c", n=1024, ratio=2.1), dict(cell_id="c", n=2048, ratio=2.0)], 1)
    new = run([dict(cell_id="c", n=1024, ratio=1.2, status="disturbed")], 3)
    got = {int(r.n): (round(r.lat_ratio, 2), r.status) for r in select_final(load_runs([old, new], [new])).itertuples()}
    assert got == {1024: (1.2, "disturbed"), 2048: (2.0, "clean")}
    plain = {int(r.n): round(r.lat_ratio, 2) for r in select_final(load_runs([old, new])).itertuples()}
    assert plain == {1024: 2.1, 2048: 2.0}                                   # unmarked: clean beats disturbed
    later = run([dict(cell_id="c", n=1024, ratio=1.1)], 5)
    final = select_final(load_runs([old, new, later], [new]))
    assert round(final[final.n == 1024].lat_ratio.iloc[0], 2) == 1.1


def test_no_nan_leaks_into_text(seed_run):
    table = sweep_table(summarize_cells(load_runs([seed_run])))
    assert "nan" not in table.lower() and "None" not in table


def test_runner_style_reasons_give_short_labels(tmp_path):
    # the exact reason strings attnbench.runner writes for OOM and baseline_max_n skips
    pts = [dict(cell_id="c", n=1024, ratio=0.5),
           dict(cell_id="c", n=16384, status="oom", reason="math OOM (setup: OutOfMemoryError: CUDA out of memory)"),
           dict(cell_id="c", n=32768, status="skipped", reason="math skipped above N=16384"),
           dict(cell_id="c", n=65536, status="skipped", reason="math skipped above N=16384")]
    (s,) = summarize_cells(load_runs([make_run(tmp_path, pts)]))
    assert s.sweep == "1K 0.50 · (math OOM @16K) · (math skipped @32K, 64K)"


def test_trend_from_clean_points_flags_noisy_points_that_disagree(tmp_path):
    pts = [dict(cell_id="c", n=1024, ratio=2.0, status="noisy"), dict(cell_id="c", n=16384, ratio=0.7),
           dict(cell_id="c", n=65536, ratio=0.68)]
    (s,) = summarize_cells(load_runs([make_run(tmp_path, pts)]))
    assert s.trend.startswith("wins all") and "noisy ones disagree" in s.trend
    pts = [dict(cell_id="d", n=1024, ratio=0.9, status="noisy"), dict(cell_id="d", n=16384, ratio=0.7)]
    (s,) = summarize_cells(load_runs([make_run(tmp_path / "b", pts)]))
    assert s.trend.startswith("wins all") and "disagree" not in s.trend


def test_host_bound_eager_points_carry_a_mark_and_their_host_time(tmp_path):
    """An eager point whose kernel's host time inside a call is at least 0.8 of the call's time is host-bound: a
    dagger after its number and its host time in the notes; it stays in the trend (its window was clean). A graph
    point never is (a replay's host time is not the call's), nor a point without host times (older runs, the CPU).
    A run from between the host samples and their points.csv columns reads them from its final attempts."""
    import csv

    from attnbench.store import load_run

    pts = [dict(cell_id="c", n=4096, ratio=0.2, baseline_ms=0.12, kernel_host_ms=0.047, baseline_host_ms=0.066),
           dict(cell_id="c", n=16384, ratio=0.11, baseline_ms=1.1, kernel_host_ms=0.067, baseline_host_ms=0.048),
           dict(cell_id="c", n=65536, ratio=0.03, baseline_ms=14.0)]
    run = make_run(tmp_path, pts)
    (s,) = summarize_cells(load_runs([run]))
    assert s.sweep == "4K 0.20† · 16K 0.11 · 64K 0.03"
    assert len(s.notes) == 1 and s.notes[0].startswith("`c` @4K: host-bound, 0.04") and "0.024 ms call" in s.notes[0]
    assert s.trend.startswith("wins all")
    graph = make_run(tmp_path, [dict(pts[0], timing="graph")], name="graph")
    (g,) = summarize_cells(load_runs([graph]))
    assert "†" not in g.sweep and not g.notes
    # points.csv as the harness wrote it before its host columns: the host times come from the attempts
    path = run / "points.csv"
    rows = list(csv.reader(path.open(newline="")))
    keep = [i for i, name in enumerate(rows[0]) if not name.endswith("_host_ms")]
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([[row[i] for i in keep] for row in rows])
    loaded = load_run(run).points.set_index("n")
    assert loaded.loc[4096, "kernel_host_ms"] == pytest.approx(0.047, rel=0.05)
    assert loaded.loc[16384, "baseline_host_ms"] == pytest.approx(0.048, rel=0.05)
    assert loaded["kernel_host_ms"].isna().sum() == 1
    (s,) = summarize_cells(load_runs([run]))
    assert s.sweep == "4K 0.20† · 16K 0.11 · 64K 0.03"
    # a final attempt whose host time is not a number: one line naming the file, the point and the field
    attempts = run / "attempts.jsonl"
    lines = attempts.read_text().splitlines()
    last = json.loads(lines[-1])
    last["kernel"]["host_ms_median"] = "fast"
    attempts.write_text("\n".join(lines[:-1] + [json.dumps(last)]) + "\n")
    with pytest.raises(RunDirError, match=rf"attempts.jsonl: point {last['point_id']}: "
                                          r"kernel.host_ms_median 'fast' is not a time in ms"):
        load_run(run)
