"""The GPU tools around the flash core, checked on the CPU: the sweep's plan and summary (scripts/flash_core_sweep.py)
and the Nsight Compute summary's parsing, reduction and comparison (scripts/ncu_summary.py). Their GPU
commands are in kernels/FLASH_CORE.md."""
import json
import re
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
    assert len(jobs) == len(set(jobs)) == 2 * 2 * 2 * 8 + 9       # the count the docstring budgets
    for dtype in ("fp16", "bf16"):
        for d, causal in ((64, False), (64, True), (128, False), (128, True), (80, False), (96, False),
                          (256, False)):
            cands = sweep.CANDIDATES.get(d) or sweep.CLIFF_CANDIDATES[d]
            assert sweep.shipped(dtype, d, causal) in cands, f"the shipped tiles for {dtype} D={d} are not swept"
    # warp specialization only where triton 3.6 builds it (4 warps asked) and is right (2 stages)
    assert all(w == 4 and s == 2 for (_, _, _, variant, _, _, w, s) in jobs if variant == "ws")
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


def test_sweep_times_through_the_harness_timer(tmp_path, monkeypatch):
    """The sweep's timings are the harness's (attnbench.measure.measure_pair): q20 <= median <= q80 of its samples,
    and a call that fails is an error, not a time."""
    import torch
    monkeypatch.setattr(sweep, "DEVICE", "cpu")
    monkeypatch.setattr(sweep, "TIMING", dict(sweep.TIMING, flush_l2=False, warmup_ms=0.0, rep_ms=5.0, max_ms=5.0))
    s = sweep.Sweep(tmp_path, budget_s=60)
    x = torch.randn(64, 64)
    med, q20, q80 = s.time_ms(lambda: x @ x)
    assert 0 < q20 <= med <= q80

    def broken():
        raise RuntimeError("no kernel")

    with pytest.raises(RuntimeError, match="timing failed: .*no kernel"):
        s.time_ms(broken)


def test_sweep_refuses_to_run_without_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts/flash_core_sweep.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    if "needs a CUDA GPU" not in proc.stderr:
        pytest.skip("a GPU is present")
    assert proc.returncode == 3 and proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    bad = subprocess.run([sys.executable, str(REPO / "scripts/flash_core_sweep.py"), "--out", str(tmp_path),
                          "--dims", "48"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--dims: 48 has no candidate tiles" in bad.stderr


RAW = '''==PROF== Connected to process 1234
"ID","Kernel Name","Grid Size","Block Size","gpu__time_duration.sum","sm__throughput.avg.pct_of_peak_sustained_elapsed","dram__throughput.avg.pct_of_peak_sustained_elapsed","sm__warps_active.avg.pct_of_peak_sustained_active","sm__maximum_warps_per_active_cycle_pct","launch__registers_per_thread","launch__shared_mem_per_block_dynamic","launch__shared_mem_per_block_static","dram__bytes_read.sum","dram__bytes_write.sum","sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active","sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active","sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","sm__ops_path_tensor_src_fp16_dst_fp32.sum","smsp__inst_executed_op_shared_st.sum","l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum","l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum","smsp__inst_executed_op_shared_ld.sum","l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum","l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"
"","","","","usecond","%","%","%","%","register/thread","Kbyte","byte","Mbyte","Kbyte","%","%","%","ratio","ratio","ratio","inst","inst","","","inst","",""
"0","_elsa_phase1","(128, 8, 2)","(128, 1, 1)","2,500.5","71.2","9.8","12.4","12.5","255","98.3","0","300.5","40","58.3","41.0","22.5","0.31","1.20","0.05","1,099,511,627,776","1,000","4,000","3,000","500","1,000","0"
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
    # shared stores at 4 wavefronts an instruction, 3 of them conflicts; loads at 2, none
    assert s["shared_st"] == {"inst": 1000, "wavefronts": 4000, "bank_conflicts": 3000}
    assert "| 4.00, 3,000 · 2.00, 0 |" in text
    with pytest.raises(ValueError, match="no kernel row"):
        ncu.parse_raw_csv(RAW.splitlines()[0] + "\n")


# `ncu --page source --print-source sass --csv` of a warp-specialized kernel, cut down: a consumer partition (240
# registers), a loader (24) and the loader's idle warps parked at a barrier; the (Not Issued) columns are not read
SOURCE = """"Kernel Name","_gluon_fwd_kernel",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_barrier","stall_long_sb","stall_wait","stall_selected","stall_barrier (Not Issued)"
"0x7f0000000000","      MOV R1, c[0x0][0x28] ","1","1","0","0","1","0","0"
"0x7f0000000010","      USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0 ","0","0","0","0","0","0","0"
"0x7f0000000020","      MUFU.EX2 R2, R3 ","30","20","0","0","20","10","0"
"0x7f0000000030","@!P0  BRA 0x7f0000000020 ","10","10","0","10","0","0","0"
"0x7f0000000040","      USETMAXREG.DEALLOC.CTAPOOL 0x18 ","0","0","0","0","0","0","0"
"0x7f0000000050","@!P0  BRA 0x7f0000000040 ","9","9","0","9","0","0","0"
"0x7f0000000060","      BAR.SYNC.DEFER_BLOCKING 0x1 ","0","0","0","0","0","0","0"
"0x7f0000000070","      NOP ","50","50","50","0","0","0","50"
"""


def test_ncu_source_stalls_split_at_register_reallocations():
    # --source-stalls: each stretch between two USETMAXREG is one partition's code; an idle wait shows as its own
    # stretch, so the kernel-wide barrier share (50 of 100 samples here) is seen to be parked warps
    s = ncu.source_stalls(SOURCE, top=2, min_share=0.05)
    assert s["samples"] == 100
    assert [(st["code"], st["regs"], st["share"]) for st in s["stretches"]] == [
        ("0x10-0x30", 240, 0.4), ("0x40-0x70", 24, 0.59)]
    assert s["other_share"] == pytest.approx(0.01)          # the first instruction, before any reallocation
    assert s["stretches"][0]["stalls"] == {"wait": 0.5, "long_sb": 0.25, "selected": 0.25}
    assert s["stretches"][1]["stalls"] == {"barrier": round(50 / 59, 3), "long_sb": round(9 / 59, 3)}
    assert [(t["offset"], t["sass"], t["share"]) for t in s["top"]] == [("0x70", "NOP", 0.5),
                                                                      ("0x20", "MUFU.EX2 R2, R3", 0.3)]
    assert s["top"][1]["stalls"] == {"wait": 0.2, "selected": 0.1}
    text = ncu.source_table(s)
    assert "| 0x10-0x30 | 240 | 40.0 % | wait 50 %, selected 25 %, long_sb 25 % |" in text
    assert "| other stretches | | 1.0 % | |" in text and "| 0x70 | `NOP` | 50.0 % | barrier 50.0 % |" in text
    with pytest.raises(ValueError, match="no \"Address\" header"):
        ncu.source_stalls(RAW)


def test_ncu_compare_and_workloads(tmp_path, capsys):
    values, units = ncu.parse_raw_csv(RAW)
    for name in ("before", "after"):
        (tmp_path / f"{name}.json").write_text(json.dumps(ncu.reduce_metrics(values, units)))
    assert ncu.main(["--compare", str(tmp_path / "before.json"), str(tmp_path / "after.json")]) == 0
    assert "| | before | after |" in capsys.readouterr().out
    assert ncu.main(["--compare", str(tmp_path / "missing.json")]) == 2
    # a JSON of another shape is one line naming its file, not a traceback
    shapes = {"list": "[1]", "kernel_not_text": '{"kernel": 1}', "pipes_not_a_map": '{"kernel": "k", "top_pipes_pct": 5}'}
    for name, text in shapes.items():
        (tmp_path / f"{name}.json").write_text(text)
        capsys.readouterr()
        assert ncu.main(["--compare", str(tmp_path / f"{name}.json")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{name}.json: not a summary this tool wrote" in err
    assert callable(ncu.resolve("flash_core")) and callable(ncu.resolve("kernels.elsa:elsa_attention"))
    with pytest.raises(SystemExit, match="expected one of"):
        ncu.resolve("nonsense")
    assert ncu.find_ncu() is None or Path(ncu.find_ncu()).name == "ncu"


def test_ncu_backward_profiles_a_backward_kernel_of_the_fwd_bwd_call(tmp_path, monkeypatch, capsys):
    # --backward: the child runs forward and backward (--backward passed on), ncu is pointed at the workload's
    # backward kernel, the outputs say so; a workload without a backward default needs --kernel
    import subprocess

    calls = []
    monkeypatch.setattr(ncu, "find_ncu", lambda: "/opt/ncu")
    monkeypatch.setattr(ncu, "known_metrics", lambda path: set())
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd) or
                        subprocess.CompletedProcess(cmd, 1, "", "no GPU here"))
    assert ncu.main(["--workload", "elsa", "--backward", "--out", str(tmp_path)]) == 1
    cmd = calls[-1]
    assert "regex:_gluon_bwd_kernel|_elsa_bwd" in cmd and cmd[-1] == "--backward"
    assert str(tmp_path / "elsa_d128_n16384_fp16_bwd.ncu-rep") in cmd
    assert ncu.main(["--workload", "elsa", "--out", str(tmp_path)]) == 1
    assert "regex:phase1" in calls[-1] and "--backward" not in calls[-1]
    assert ncu.main(["--workload", "pasa", "--backward", "--out", str(tmp_path)]) == 2
    assert "--kernel REGEX is needed for workload 'pasa' with --backward" in capsys.readouterr().err


def test_ncu_metric_names_are_read_from_the_query():
    listing = ("Device GH100\n----\nMetric Name   Metric Type  Metric Unit  Metric Description\n"
               "dram__bytes_read   Counter  byte   # of bytes read from DRAM\n"
               "sm__pipe_tensor_op_gmma_cycles_active  Counter  cycle  # of cycles where the GMMA pipe was active\n")
    assert ncu.metric_names(listing) == {"dram__bytes_read", "sm__pipe_tensor_op_gmma_cycles_active"}
    assert ncu.metric_names('"dram__bytes_read","Counter"\n') == {"dram__bytes_read"}


# --- the warp-specialization row double-offset audit (scripts/compile_check.py), compiled for sm_90 on the CPU ---

_HAZARD_KERNELS = '''
import triton
import triton.language as tl

from kernels import _flash_core as core


@triton.jit
def folded(Q, K, V, Out, M, n, qk_scale, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           HAZARD: tl.constexpr):
    r0 = tl.program_id(0) * BLOCK_M
    q = core.load_rows(core.row_source(Q, n, D, D, BLOCK_M, D, True), r0, n, D, D, BLOCK_M, D, True, True)
    acc, m, l = core.init_state(BLOCK_M, D)
    acc, m, l = core.fold_keys(acc, m, l, q, core.row_source(K, n, D, D, BLOCK_N, D, True),
                               core.row_source(V, n, D, D, BLOCK_N, D, True), D, D, 0, n, r0, n, 0, qk_scale,
                               BLOCK_M, BLOCK_N, D, D, False, True, True, True, "tf32")
    if HAZARD:
        rows = r0 + tl.arange(0, BLOCK_M)        # r0 is Q's descriptor row coordinate: offset twice
        tl.store(M + rows, m, mask=rows < n)
    else:
        tl.store(M + r0 + tl.arange(0, BLOCK_M), m, mask=tl.arange(0, BLOCK_M) < n - r0)
    core.store_rows(core.row_source(Out, n, D, D, BLOCK_M, D, True), r0, core.normalize(acc, l).to(tl.float16),
                    n, D, D, BLOCK_M, D, True)
'''

_AUDIT = '''
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from scripts.compile_check import Job, compile_job, GPUTarget
import hazard_kernels as hk
for hazard in (True, False):
    job = Job("t", "folded", hk.folded, "fp16", dict(D=64, BLOCK_M=128, BLOCK_N=128, HAZARD=hazard), 4, 2,
              {"Q", "K", "V", "Out"}, {"M"}, floats={"qk_scale"}, div16=lambda name: False)
    row = compile_job(job, GPUTarget("cuda", 90, 32))
    print(hazard, row["warps"], len(row["ws_hazards"]))
'''


def _no_interpreter_env():
    import os
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def test_ws_audit_finds_the_row_double_offset(tmp_path):
    """The audit on a kernel built both ways, compiled for sm_90 by the installed triton (no GPU needed): a row
    vector built on Q's descriptor coordinate is flagged (the second consumer would store rows 64 past its own),
    the same store through a pointer offset is not; both kernels are warp-specialized (12 warps)."""
    (tmp_path / "hazard_kernels.py").write_text(_HAZARD_KERNELS)
    proc = subprocess.run([sys.executable, "-c", _AUDIT, str(REPO), str(tmp_path)], capture_output=True, text=True,
                          timeout=600, env=_no_interpreter_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.split()
    assert lines[:3] == ["True", "12", "2"] and lines[3:] == ["False", "12", "0"], proc.stdout


def test_shipped_warp_specialized_kernels_pass_the_audit():
    """The core's warp-specialized tiles (D=128), causal and not, compiled for sm_90: no row double offset (the
    causal per-row limits are built by row_index on r0 + 1 + shift, not on r0)."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts/compile_check.py"), "--kernel", "flash_core",
                           "--ws-only", "--dims", "128", "--dtypes", "fp16"], capture_output=True, text=True,
                          timeout=600, env=_no_interpreter_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "2 compiled for cuda:90:32: 0 failed" in proc.stdout and "warps=12" in proc.stdout


def test_sass_digest_names_the_code(tmp_path):
    """--sass / --json: each job's SASS digest is the same when the same tree is compiled again (a refactor that
    keeps every digest changed no instruction) and differs between two jobs whose code differs (causal or not)."""
    def digests(name):
        out = tmp_path / f"{name}.json"
        proc = subprocess.run([sys.executable, str(REPO / "scripts/compile_check.py"), "--kernel", "flash_core",
                               "--ws-only", "--dims", "128", "--dtypes", "fp16", "--sass", "--json", str(out)],
                              capture_output=True, text=True, timeout=600, env=_no_interpreter_env(), cwd=REPO)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        rows = json.loads(out.read_text())["rows"]
        assert all(f"sass={r['sass_sha256']}" in proc.stdout for r in rows)
        return [r["sass_sha256"] for r in rows]

    first, again = digests("first"), digests("again")
    assert len(first) == 2 and all(len(d) == 16 and int(d, 16) >= 0 for d in first)
    assert first == again and first[0] != first[1]


_STORE_INDEX_KERNELS = '''
import triton
import triton.language as tl


@triton.jit
def _rows_and_values(X, n, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    return rows, tl.load(X + rows, mask=rows < n)


@triton.jit
def _values(X, rows, n):
    return tl.load(X + rows, mask=rows < n)


@triton.jit
def copy(X, Y, n, BLOCK: tl.constexpr, RETURNED: tl.constexpr):
    if RETURNED:            # Y's store address built from a helper's result
        rows, x = _rows_and_values(X, n, BLOCK)
    else:                   # the helper takes the rows
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = _values(X, rows, n)
    tl.store(Y + rows, x, mask=rows < n)
'''

_WRITES = '''
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from scripts.compile_check import Job, inductor_writes, GPUTarget
import store_index_kernels as sk
for returned in (True, False):
    job = Job("t", "copy", sk.copy, "fp32", dict(BLOCK=64, RETURNED=returned), 4, 1, {"X", "Y"})
    print(returned, ",".join(sorted(inductor_writes(job, GPUTarget("cuda", 90, 32)))))
'''


def test_inductor_writes_counts_an_address_from_a_helper(tmp_path):
    """compile_check's inductor_writes (no GPU needed) is what torch's analysis of a kernel handed to inductor
    says it writes: a kernel that stores Y at rows a helper returned counts X, which the helper read, as written
    too; the same kernel with the rows passed to the helper writes Y only."""
    (tmp_path / "store_index_kernels.py").write_text(_STORE_INDEX_KERNELS)
    proc = subprocess.run([sys.executable, "-c", _WRITES, str(REPO), str(tmp_path)], capture_output=True, text=True,
                          timeout=600, env=_no_interpreter_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "X,Y", "False", "Y"], proc.stdout


def test_elsa_kernels_handed_to_inductor_write_only_their_outputs():
    """scripts/compile_check.py --inductor-writes: ELSA's Triton kernels, which torch.compile's graphs launch
    themselves (kernels/_ops.py, decompose_when_traced), write only their outputs in torch's analysis, with and
    without a bias and its gradient; a kernel seen writing Q, K, V, the bias, dO or (backward) O and the lse made
    compiled training steps fail (AOTAutograd copied into a leaf that requires grad)."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts/compile_check.py"), "--kernel", "elsa",
                           "--inductor-writes", "--dims", "32,64,128", "--dtypes", "fp16,fp32"], capture_output=True,
                          text=True, timeout=600, env=_no_interpreter_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " 0 write a tensor they only read" in proc.stdout
    lines = proc.stdout.splitlines()
    for head, writes in (("elsa phase1 fp16 D=64 ", "writes Out, Sbuf"),
                         ("elsa dq fp32 D=128 ", "writes Delta, dQ, dS"),
                         ("elsa bwd_one_launch_short fp16 D=32 ", "writes dK, dQ, dS, dV"),
                         ("elsa phase1_window fp16 D=32 ", "writes Lse, Out")):
        assert any(row.startswith(head) and row.endswith(writes) for row in lines), (head, proc.stdout[-3000:])


def test_short_call_tiles_compile_without_spills():
    """ELSA's short calls' tiles (config.SHORT_ONE_LAUNCH_BWD with Swin's bias gradient, config.WINDOW_FWD_TILES),
    compiled for sm_90 by the installed triton: they compile and spill nothing."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts/compile_check.py"), "--kernel", "elsa", "--dims", "32",
                           "--dtypes", "fp16"], capture_output=True, text=True, timeout=600,
                          env=_no_interpreter_env(), cwd=REPO)
    from kernels.elsa import config

    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert " 0 failed" in proc.stdout
    (dm, dn, *_), (km, kn, *_) = config.SHORT_ONE_LAUNCH_BWD[("16", 32)]
    for job in (f"elsa bwd_one_launch_short fp16 D=32 dq=[{dm}, {dn}] dkdv=[{km}, {kn}] bias=True",
                f"elsa phase1_window fp16 D=32 cfg={list(config.WINDOW_FWD_TILES[('16', 32)])} final=True bias=True"):
        line = next((row for row in proc.stdout.splitlines() if row.startswith(job + ":")), None)
        assert line is not None and " spill_stack=0 " in line, (job, proc.stdout[-2000:])


def test_elsa_float32_on_wgmma_compiles_or_says_why_not():
    """scripts/compile_check.py --kernel elsa at float32 D = 128: with triton 3.6 ELSA's phase 1 on wgmma
    (kernels/elsa/gluon_phase1.py) compiles for sm_90 with summaries and as the single partition, each causal and
    not, within shared memory (224 KB: K in two buffers), its 44 wgmmas in each consumer warpgroup (S two a K step,
    P V three), spilling nothing but, as the single partition without the mask, the 14 values of the launch's
    prologue its producer reads once before its loop (56 bytes; the wgmmas' descriptors hoisted out of the
    consumers' loop had spilled 120 and 160 bytes, gluon_phase1._zero_of; V's tile loaded as [1, 4] rows, 32 in the
    producer), and storing its tiles 16 bytes at a time (V's tile loaded as [1, 4] rows went out as 64 4-byte
    stores, bank-conflicted: 1.8x the time); with another triton one line says why it is not compiled."""
    import triton

    from kernels.elsa import gluon_phase1

    proc = subprocess.run([sys.executable, str(REPO / "scripts/compile_check.py"), "--kernel", "elsa",
                           "--dims", "128", "--dtypes", "fp32"], capture_output=True, text=True, timeout=600,
                          env=_no_interpreter_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    if gluon_phase1.HAS_GLUON and triton.__version__.startswith(gluon_phase1.GLUON_VERSION):
        lines = [row for row in proc.stdout.splitlines() if row.startswith("elsa phase1_tf32 fp32 D=128 ")]
        assert len(lines) == 4 and sum("final=True" in row for row in lines) == 2, proc.stdout[-2000:]
        for row in lines:
            assert "over sm_90's shared memory" not in row and " wgmma=88 " in row and " sts_narrow=0" in row, row
            prologue_only = "final=True:" in row                  # the single partition without the causal mask
            assert int(re.search(r" spill_stack=(\d+) ", row).group(1)) <= (56 if prologue_only else 0), row
    else:
        assert (f"elsa phase1_tf32: written for triton {gluon_phase1.GLUON_VERSION}'s Gluon, this is "
                f"{triton.__version__}: skipped") in proc.stdout


def test_gluon_core_compile_check_compiles_or_says_why_not():
    """scripts/compile_check.py --kernel gluon_core: with triton 3.6 (the H100's; the Gluon API the core is written
    against) every shipped variant, the backward's too, compiles for sm_90 and fits its shared memory; with another
    triton nothing is compiled and one line says why (the CI machine's newest triton lands here)."""
    import triton

    from kernels import _gluon_core as gc

    proc = subprocess.run([sys.executable, str(REPO / "scripts/compile_check.py"), "--kernel", "gluon_core",
                           "--dims", "64", "--dtypes", "fp16"], capture_output=True, text=True, timeout=600,
                          env=_no_interpreter_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    if gc.HAS_GLUON and triton.__version__.startswith(gc.GLUON_VERSION):
        # at D=64 fp16: the forward's five modes (out, ELSA's summary, the walk, PASA with either state; all but
        # the walk on both grids) with two consumer warpgroups, the first three with three too, and the backward,
        # each causal and not, and the backward's prologue
        assert "31 compiled for cuda:90:32: 0 failed" in proc.stdout and "warps=12" in proc.stdout
        assert "consumers=3" in proc.stdout and "warps=16" in proc.stdout
        assert "gluon_core bwd fp16 D=64 causal=True" in proc.stdout
        assert "gluon_core bwd_prologue fp16 D=64: regs=" in proc.stdout
        assert "over sm_90's shared memory" not in proc.stdout
    else:
        assert f"written for triton {gc.GLUON_VERSION}'s Gluon, this is {triton.__version__}: skipped" in proc.stdout
        assert "0 compiled for cuda:90:32" in proc.stdout
