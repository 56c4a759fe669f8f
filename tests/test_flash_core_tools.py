"""The GPU tools around the flash core, checked on the CPU: the sweep's plan and summary (scripts/flash_core_sweep.py)
and the Nsight Compute summary's parsing, reduction and comparison (scripts/ncu_summary.py). Their GPU runs are
the lead's (kernels/FLASH_CORE.md lists the commands)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts import flash_core_sweep as sweep  # noqa: E402
from scripts import ncu_summary as ncu  # noqa: E402


def test_sweep_plan_is_the_budgeted_grid():
    jobs = sweep.plan(["fp16", "bf16"], [64, 128], [80, 96, 256])
    assert len(jobs) == len(set(jobs)) == 2 * 2 * 2 * 10 + 9      # the count the docstring budgets
    for dtype in ("fp16", "bf16"):
        for d in (64, 128, 80, 96, 256):
            cands = sweep.CANDIDATES.get(d) or sweep.CLIFF_CANDIDATES[d]
            assert sweep.shipped(dtype, d) in cands, f"the shipped tiles for {dtype} D={d} are not swept"
    # warp specialization only where triton 3.6 builds it (4 warps asked)
    assert all(w == 4 for (_, _, _, variant, _, _, w, _) in jobs if variant == "ws")
    assert len(sweep.plan(["fp16"], [64], [], quick=True)) == 2 * 3


def _row(variant, cfg, ms, **kw):
    return dict(stage="search", dtype="fp16", D=128, N=16384, causal=False, variant=variant, cfg=cfg, status="ok",
                ms=ms, tflops=sweep.attention_flops(16384, 128, False) / ms / 1e9, cudnn_tflops=610.0,
                flash_tflops=357.0, ratio_cudnn=ms / 2.0, ratio_flash=ms / 3.4, **kw)


def test_sweep_summary_shows_the_best_of_each_variant_and_what_was_not_timed():
    rows = [dict(stage="env", gpu="NVIDIA H100 80GB HBM3", torch="2.11.0", triton="3.6.0"),
            _row("ws", [128, 128, 4, 2], 2.1, ws_effective=True, shipped=True),
            _row("ws", [128, 64, 4, 2], 2.4, ws_effective=True),
            _row("tma", [128, 128, 8, 2], 2.5),
            dict(stage="search", dtype="fp16", D=128, N=16384, causal=False, variant="tma", cfg=[128, 128, 4, 3],
                 status="compile_error", error="OutOfResources: out of resource: shared memory"),
            dict(stage="search", dtype="fp16", D=128, N=16384, causal=False, variant="ptr", cfg=[128, 64, 4, 2],
                 status="wrong", err_vs_flash=0.02)]
    text = sweep.summary(rows, ["lengths fp16 D=128 N=65536 causal=True: 3 variants (budget)"])
    lines = text.splitlines()
    ws_line = next(ln for ln in lines if "| ws |" in ln)
    assert "(128, 128, 4, 2) (shipped)" in ws_line and "| 1.05 |" in ws_line    # 2.1 ms over cuDNN's 2.0 ms
    assert sum("| ws |" in ln for ln in lines) == 1 and any("| tma |" in ln for ln in lines)
    assert any("compile_error: OutOfResources" in ln for ln in lines)
    assert any("wrong: err_vs_flash 2.00e-02" in ln for ln in lines)
    assert any("(budget)" in ln for ln in lines)
    rows[1]["ws_effective"] = False
    assert "| ws* |" in sweep.summary(rows, [])                                  # asked for, compiled without


def test_sweep_refuses_to_run_without_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts/flash_core_sweep.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    if "needs a CUDA GPU" not in proc.stderr:
        pytest.skip("a GPU is present")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    bad = subprocess.run([sys.executable, str(REPO / "scripts/flash_core_sweep.py"), "--out", str(tmp_path),
                          "--dims", "48"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--dims: 48 has no candidate tiles" in bad.stderr


RAW = '''==PROF== Connected to process 1234
"ID","Kernel Name","Grid Size","Block Size","gpu__time_duration.sum","sm__throughput.avg.pct_of_peak_sustained_elapsed","dram__throughput.avg.pct_of_peak_sustained_elapsed","sm__warps_active.avg.pct_of_peak_sustained_active","sm__maximum_warps_per_active_cycle_pct","launch__registers_per_thread","launch__shared_mem_per_block_dynamic","launch__shared_mem_per_block_static","dram__bytes_read.sum","dram__bytes_write.sum","sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active","sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active","sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","sm__ops_path_tensor_src_fp16_dst_fp32.sum"
"","","","","usecond","%","%","%","%","register/thread","Kbyte","byte","Mbyte","Kbyte","%","%","%","ratio","ratio","ratio","inst"
"0","_elsa_phase1","(128, 8, 2)","(128, 1, 1)","2,500.5","71.2","9.8","12.4","12.5","255","98.3","0","300.5","40","58.3","41.0","22.5","0.31","1.20","0.05","1,099,511,627,776"
'''


def test_ncu_raw_report_reduces_to_the_table():
    values, units = ncu.parse_raw_csv(RAW)
    s = ncu.reduce_metrics(values, units)
    assert s["kernel"] == "_elsa_phase1" and s["duration_us"] == pytest.approx(2500.5)
    assert s["tensor_pipes_pct"] == {"tensor_op_gmma": 58.3}
    assert list(s["top_pipes_pct"]) == ["xu", "fma"]
    assert list(s["top_stalls"]) == ["wait", "long_scoreboard", "barrier"]
    assert s["dram_read_bytes"] == pytest.approx(300.5e6) and s["dram_write_bytes"] == pytest.approx(40e3)
    assert s["shared_dynamic_bytes"] == pytest.approx(98.3e3) and s["registers_per_thread"] == 255
    assert s["tensor_tops"] == pytest.approx(2 ** 40 / 2500.5e-6 / 1e12)
    text = ncu.table([("before", s), ("after", dict(s, duration_us=2000.0))])
    assert "| duration (us) | 2500.5 | 2000.0 |" in text
    assert "tensor_op_gmma 58.3" in text and "wait 1.20" in text
    with pytest.raises(ValueError, match="no kernel row"):
        ncu.parse_raw_csv(RAW.splitlines()[0] + "\n")


def test_ncu_compare_and_workloads(tmp_path, capsys):
    values, units = ncu.parse_raw_csv(RAW)
    for name in ("before", "after"):
        (tmp_path / f"{name}.json").write_text(json.dumps(ncu.reduce_metrics(values, units)))
    assert ncu.main(["--compare", str(tmp_path / "before.json"), str(tmp_path / "after.json")]) == 0
    assert "| | before | after |" in capsys.readouterr().out
    assert ncu.main(["--compare", str(tmp_path / "missing.json")]) == 2
    assert callable(ncu.resolve("flash_core")) and callable(ncu.resolve("kernels.elsa:elsa_attention"))
    with pytest.raises(SystemExit, match="expected one of"):
        ncu.resolve("nonsense")
    assert ncu.find_ncu() is None or Path(ncu.find_ncu()).name == "ncu"


def test_ncu_metric_names_are_read_from_the_query():
    listing = ("Device GH100\n----\nMetric Name   Metric Type  Metric Unit  Metric Description\n"
               "dram__bytes_read   Counter  byte   # of bytes read from DRAM\n"
               "sm__pipe_tensor_op_gmma_cycles_active  Counter  cycle  # of cycles where the GMMA pipe was active\n")
    assert ncu.metric_names(listing) == {"dram__bytes_read", "sm__pipe_tensor_op_gmma_cycles_active"}
    assert ncu.metric_names('"dram__bytes_read","Counter"\n') == {"dram__bytes_read"}
