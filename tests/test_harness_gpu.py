"""Harness checks that need the real H100: NVML, each SDPA backend really forced, OOM, the timer vs do_bench."""
import pytest
import torch

pytestmark = pytest.mark.gpu


def test_real_nvml_readings():
    from attnbench.gpu import PynvmlReader, sample_gpus

    reader = PynvmlReader()
    g = sample_gpus(reader, [0], sample_s=1.0, samples=10)[0]
    assert g.name and g.uuid.startswith("GPU-")
    assert len(g.util_samples) == 10 and 0 <= g.util_pct <= 100
    assert 0 < g.mem_free_gb <= g.mem_total_gb and g.mem_total_gb > 70
    assert g.sm_clock_max_mhz and g.sm_clock_max_mhz >= 1000
    assert g.power_limit_w and g.power_limit_w > 100
    assert isinstance(g.throttle_reasons, list)


@pytest.mark.parametrize("name, kernel_hint", [("flash", "flash"), ("efficient", "fmha"), ("cudnn", "cudnn"),
                                               ("math", "gemm")])
def test_each_sdpa_backend_is_really_forced(name, kernel_hint):
    from torch.profiler import ProfilerActivity, profile

    from attnbench.backends import get_backend

    q, k, v = (torch.randn(1, 8, 1024, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    fn = get_backend(name).fn
    fn(q, k, v)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(q, k, v)
        torch.cuda.synchronize()
    names = " ".join(e.name.lower() for e in prof.events() if e.device_type.name == "CUDA")
    if name == "math":
        assert "flash" not in names and "fmha" not in names and "cudnn" not in names
        assert "softmax" in names
    else:
        assert kernel_hint in names, names[:500]   # e.g. cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma...
        # a fused kernel, not the math path's GEMMs and softmax (on Hopper cuBLAS's GEMMs are named sm90_... too)
        assert "softmax" not in names and "gemm" not in names, names[:500]


def test_forced_backend_refuses_instead_of_falling_back():
    from attnbench.backends import get_backend

    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.float32) for _ in range(3))
    with pytest.raises(RuntimeError):
        get_backend("flash").fn(q, k, v)


def test_oom_is_a_result_and_memory_is_released():
    from attnbench.matrix import Cell, Point
    from attnbench.runner import measure_point

    free_before = torch.cuda.mem_get_info()[0]
    # math at N=256K materialises 8·256K² fp16 scores = 1 TB: must OOM on an 80 GB card
    from attnbench.matrix import TIMING_DEFAULTS

    cell = Cell(id="oom", kernel="flash", baseline="math", dtype="float16", mode="fwd", batch=1, seq_lens=(262144,),
                heads=8, head_dim=64, timing={**TIMING_DEFAULTS, "warmup_ms": 1, "rep_ms": 5, "min_reps": 3,
                                              "max_reps": 5})
    result = measure_point(Point(cell, 262144), "cuda")
    assert result.baseline.status == "oom"
    assert result.kernel.status == "ok" and len(result.kernel.samples_ms) >= 3
    torch.cuda.synchronize()
    assert torch.cuda.mem_get_info()[0] > free_before - 2 * 2**30


# --- timing modes, planted slowdowns, calibration ------------------------------------------------------

@pytest.fixture
def gpu_to_itself():
    """The tests that judge a time: beside other pytest-xdist workers on the same GPU their times are not the
    kernel's (on the H200 under -n 4 a planted 1.15 read 1.07 at 4K; alone, inside its band), so they skip there."""
    import os

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        pytest.skip(f"judges GPU time: run without -n (here {workers} xdist workers share the GPU)")


def _flash_pair(n=4096, mode="fwd", name="flash"):
    from attnbench.backends import get_backend, make_attention_workload

    make = lambda seed: make_attention_workload(get_backend(name), batch=1, heads=8, n=n, head_dim=64,  # noqa: E731
                                                dtype="float16", mode=mode, causal=False, device="cuda", seed=seed)
    return make(0), make(1)


@pytest.mark.parametrize("n, factor, tolerance", [(4096, 1.0, 0.02), (4096, 1.15, 0.03),
                                                   (16384, 1.0, 0.02), (16384, 1.15, 0.03)])
@pytest.mark.parametrize("timing_mode", ["eager", "graph"])
def test_planted_slowdown_lands_at_its_factor(timing_mode, n, factor, tolerance, gpu_to_itself):
    """flash against flash (other inputs), one side slowed by `factor` (1.0: none): the median paired ratio is the
    factor in both timing modes; flash against itself pairs to 1 within 2 %. At 4K (a 0.06-0.1 ms call) the planted
    delay, a sleep kernel whose fixed cost was calibrated alone, landed at 1.07-1.15 on the H100 and 1.05-1.06 on the
    H200 until measure_pair corrected it where it runs (pair._plant_delay). Below 4K (1K: 0.03 ms) the paired ratio
    of flash against itself is itself 5 % off in eager mode on the H100 (launch jitter against the L2 flush), so no
    slowdown factor is claimed there."""
    from attnbench.matrix import TIMING_DEFAULTS
    from attnbench.measure import measure_pair

    a, b = _flash_pair(n)
    res = measure_pair(a, b, kernel_name="flash", baseline_name="flash", timing=dict(TIMING_DEFAULTS), device="cuda",
                       mode=timing_mode, slowdown={"kernel": factor})
    assert res.kernel.status == "ok" and res.timing_mode == timing_mode
    ratio = sorted(res.ratios)[len(res.ratios) // 2]
    assert ratio == pytest.approx(factor, abs=tolerance), (ratio, res.reps, res.ci_half_width)


@pytest.mark.parametrize("name, mode", [("flash", "fwdbwd"), ("cudnn", "fwd"), ("elsa", "fwd"), ("elsa", "fwdbwd"),
                                        ("cron_root", "fwd"), ("pasa", "fwd"), ("cqsa", "fwd")])
def test_graph_mode_captures_every_backend(name, mode, gpu_to_itself):
    from attnbench.backends import get_backend, make_attention_workload
    from attnbench.matrix import TIMING_DEFAULTS
    from attnbench.measure import measure_pair

    causal = name == "cron_root"
    wl = make_attention_workload(get_backend(name), batch=1, heads=8, n=4096, head_dim=64, dtype="float16",
                                 mode=mode, causal=causal, device="cuda")
    graph = measure_pair(wl, None, kernel_name=name, baseline_name=None, timing=dict(TIMING_DEFAULTS),
                         device="cuda", mode="graph")
    eager = measure_pair(wl, None, kernel_name=name, baseline_name=None, timing=dict(TIMING_DEFAULTS),
                         device="cuda", mode="eager")
    assert graph.kernel.status == "ok", graph.kernel.message
    g, e = graph.kernel.summary()["ms_median"], eager.kernel.summary()["ms_median"]
    assert 0 < g <= e * 1.05      # a replay never pays more than the eager loop's host gaps


def test_timer_calibrates_against_do_bench(tmp_path, gpu_to_itself):
    """scripts/calibrate.py: the harness's eager median within 5 % of triton.testing.do_bench (both flush L2), its
    graph-mode median within 5 % of do_bench_cudagraph where L2 cannot matter (the script says which rows are
    judged). The H100's figures: results/calibration_h100.json."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / "calibration.json"
    proc = subprocess.run([sys.executable, "scripts/calibrate.py", "--out", str(out)], cwd=repo, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert any(r["judged"] for r in rows)
    off = [r for r in rows if r["judged"] and abs(r["rel_diff"]) > 0.05]
    assert not off, off           # the rows themselves: a failure says which point and by how much


# -- what each forced SDPA backend claims for grouped K/V, Nq != Nk and head dims (attnbench.backends) -----------

SDPA = ("math", "efficient", "flash", "cudnn")
# (Hq, Hkv, Nq, Nk, causal, D): grouped K/V (GQA, MQA), Nq != Nk (non-causal, bottom-right causal), both
CLAIM_CASES = [(8, 2, 512, 512, True, 128), (8, 1, 512, 512, False, 64), (8, 8, 256, 1024, False, 64),
               (8, 8, 256, 1024, True, 64), (8, 2, 256, 1024, True, 128)]


@pytest.mark.parametrize("name", SDPA)
@pytest.mark.parametrize("case", CLAIM_CASES, ids=lambda c: "H{}-Hkv{}-Nq{}-Nk{}-causal{}-D{}".format(*c))
def test_sdpa_gqa_and_cross_claims_hold_on_this_torch(name, case):
    """A claimed capability runs forced (no fallback) and matches float64, fwd and grads (fp16: 1e-2 on outputs,
    5e-2 on grads, both relative to the reference's largest value); a capability not claimed is refused by torch
    (else the claim could be made). The message says which flag in attnbench/backends.py to change."""
    from attnbench.backends import get_backend
    from kernels.reference import reference_attention

    hq, hkv, nq, nk, causal, d = case
    backend = get_backend(name)
    needs = (["gqa"] if hkv != hq else []) + (["cross"] if nq != nk else [])
    claimed = all(getattr(backend, w) for w in needs) and (backend.head_dims is None or d in backend.head_dims)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, hq, nq, d, device="cuda", dtype=torch.float16, generator=g).requires_grad_()
    k, v = (torch.randn(1, hkv, nk, d, device="cuda", dtype=torch.float16, generator=g).requires_grad_() for _ in range(2))
    try:
        out = backend.fn(q, k, v, causal=causal)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        torch.cuda.synchronize()
    except RuntimeError as exc:
        assert not claimed, f"{name} claims {'+'.join(needs)} (Backend(...) in attnbench/backends.py) but torch refused: {exc}"
        return
    assert claimed, f"{name} ran {'+'.join(needs)}: the claim can be made in attnbench/backends.py"
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*exact, causal=causal)
    refs = torch.autograd.grad(ref, exact, torch.ones_like(ref))
    assert (out.double() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()
    for got, want in zip(grads, refs):
        assert got.shape == want.shape
        assert (got.double() - want).abs().max().item() <= 5e-2 * want.abs().max().item()


@pytest.mark.parametrize("name, d", [("flash", 40), ("flash", 80), ("flash", 136), ("flash", 256),
                                     ("cudnn", 40), ("cudnn", 80), ("cudnn", 128), ("efficient", 80)])
def test_sdpa_head_dim_claims_hold_on_this_torch(name, d):
    """The head dims a forced backend claims (every multiple of 8 up to 256 for flash, up to 128 for cuDNN) run,
    forward and backward."""
    from attnbench.backends import get_backend

    backend = get_backend(name)
    assert backend.head_dims is None or d in backend.head_dims
    q, k, v = (torch.randn(1, 8, 1024, d, device="cuda", dtype=torch.float16).requires_grad_() for _ in range(3))
    out = backend.fn(q, k, v, causal=True)
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
