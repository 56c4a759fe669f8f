"""The Gluon Hopper core (kernels/_gluon_core.py) and ELSA's phase 1 on it.

CPU: the core is never taken there (Gluon has no interpreter): available() says no, the standalone forward refuses
in one line, and ELSA's plan takes the core only where the host says it can (16-bit, no bias, more than SHORT_N
rows, no tile override), with its 128-row CTA and its key tile.
GPU (`-m gpu`, sm_90 with triton 3.6): the standalone forward against float64 -- float16 and bfloat16, D 64 and
128, causal (bottom-right for Nq != Nk) and not, ragged lengths, grouped-query and multi-query K/V, ping-pong on
and off, the natural-log LSE -- and ELSA with phase 1 on the core: several partitions merged by phase 2 and the
single-partition forward that writes out and lse itself, forward and gradients.

Tolerances (relative RMS against float64 on the same rounded inputs): float16 1.5e-3, bfloat16 4e-3, as the
Triton core's tests (tests/test_flash_core.py): a 1 % error in the softmax scale moves the output by 0.7-1.2 %.
"""
import pytest
import torch

from kernels import _gluon_core as gc
from kernels.elsa import config as elsa_config
from kernels.elsa import elsa_attention
from kernels.elsa import host as elsa_host
from kernels.reference import reference_attention

TOL = {torch.float16: 1.5e-3, torch.bfloat16: 4e-3}
LSE_TOL = 1e-4     # absolute, natural log: fp32 statistics of 16-bit scores


def _rel_rms(out, ref) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))


def _inputs(b, hq, hkv, nq, nk, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(device, dtype)
            for shape in ((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, d))]


def test_not_available_on_the_cpu():
    q, k, v = _inputs(1, 1, 1, 8, 8, 64, torch.float16, "cpu")
    assert not gc.available(q, k, v)
    with pytest.raises(ValueError, match="gluon_core: needs triton") as err:
        gc.gluon_fwd(q, k, v)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("d", gc.HEAD_DIMS)
def test_elsa_plan_takes_the_core_only_where_it_can(d):
    plan = elsa_config.plan_forward(8192, 8192, 8, d, torch.float16, 132, "", False, False, True, True)
    assert plan.gluon and not plan.warp_specialize
    assert (plan.block_m, plan.block_n, plan.num_stages) == (gc.CTA_ROWS, *gc.TILES[d])
    assert plan.width % plan.block_n == 0 and plan.parts >= 2
    for args in [(8192, 8192, 8, d, torch.float16, 132, "", False, True, True, True),     # a bias
                 (8192, 8192, 8, d, torch.float32, 132, "", False, False, True, True),    # float32
                 (512, 8192, 8, d, torch.float16, 132, "", False, False, True, True),     # short rows
                 (4096, 2048, 8, d, torch.float16, 132, "", False, False, True, True),    # too little work
                 (8192, 8192, 8, d, torch.float16, 132, "", False, False, True, False)]:  # the host says no
        assert not elsa_config.plan_forward(*args).gluon, args
    override = elsa_config.canonical_config({"fwd": {"BLOCK_N": 64}}, torch.float16, d)
    assert not elsa_config.plan_forward(8192, 8192, 8, d, torch.float16, 132, override, False, False, True,
                                        True).gluon


# (B, Hq, Hkv, Nq, Nk, D, causal): whole and ragged tiles, GQA / MQA, Nq != Nk both ways (bottom-right causal,
# the first rows of Nq > Nk seeing no key)
GPU_CASES = [
    (1, 4, 4, 4096, 4096, 128, False),
    (1, 4, 4, 4096, 4096, 128, True),
    (2, 4, 2, 1000, 1000, 64, False),
    (2, 4, 2, 777, 777, 64, True),
    (1, 8, 1, 300, 2000, 128, True),
    (1, 2, 2, 1000, 300, 64, True),
    (1, 2, 2, 130, 4000, 128, False),
]


def _need_core(device):
    q, k, v = _inputs(1, 1, 1, 8, 8, 64, torch.float16, device)
    if not gc.available(q, k, v):
        pytest.skip(f"the Gluon core needs sm_90 and triton {gc.GLUON_VERSION}")


@pytest.mark.gpu
@pytest.mark.parametrize("pingpong", [True, False], ids=["pingpong", "no-pingpong"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "b{}h{}-{}n{}-{}d{}{}".format(*c[:6], "c" if c[6] else ""))
def test_gpu_matches_float64(case, dtype, pingpong):
    _need_core("cuda")
    b, hq, hkv, nq, nk, d, causal = case
    q, k, v = _inputs(b, hq, hkv, nq, nk, d, dtype, "cuda")
    out, lse = gc.gluon_fwd(q, k, v, causal, pingpong=pingpong, return_lse=True)
    ref = reference_attention(q, k, v, causal=causal)
    assert torch.isfinite(out).all()
    err = _rel_rms(out, ref)
    assert err <= TOL[dtype], f"rel RMS {err:.2e} > {TOL[dtype]:.1e}"
    scores = (q.double() @ k.double().repeat_interleave(hq // hkv, 1).transpose(-1, -2)) / d ** 0.5
    if causal:
        i = torch.arange(nq, device="cuda")[:, None]
        j = torch.arange(nk, device="cuda")[None, :]
        scores = scores.masked_fill(j > i + nk - nq, float("-inf"))
    ref_lse = torch.logsumexp(scores, -1)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    assert (lse.double() - ref_lse)[seen].abs().max().item() <= LSE_TOL


@pytest.mark.gpu
def test_gpu_rejects_a_one_percent_scale_error():
    """The bound is tight enough to see a 1 % error in the softmax scale."""
    _need_core("cuda")
    q, k, v = _inputs(1, 4, 4, 2048, 2048, 128, torch.float16, "cuda")
    ref = reference_attention(q, k, v)
    assert _rel_rms(gc.gluon_fwd(q, k, v), ref) <= TOL[torch.float16]
    assert _rel_rms(gc.gluon_fwd(q, k, v, scale=1.01 / 128 ** 0.5), ref) > TOL[torch.float16]


@pytest.mark.gpu
@pytest.mark.parametrize("batch, n, causal", [(1, 8192, False), (1, 8192, True), (4, 2048, False), (4, 3000, True)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_elsa_phase1_on_the_core(batch, n, causal, dtype):
    """ELSA through the core: partitions merged by phase 2 (8192) or, with enough row blocks to fill the GPU,
    one partition written by phase 1 itself (2048, 3000), forward and gradients against float64."""
    _need_core("cuda")
    q, k, v = (t.requires_grad_() for t in _inputs(batch, 8, 2, n, n, 128, dtype, "cuda"))
    plan = elsa_host.forward_plan(q, k, v, None, causal, 128 ** -0.5, "tf32x3", "", True)
    assert plan.plan.gluon
    assert (plan.plan.parts >= 2) == (n >= elsa_config.LONG_N)
    out = elsa_attention(q, k, v, causal=causal)
    ref = reference_attention(q, k, v, causal=causal)
    assert _rel_rms(out, ref) <= TOL[dtype]
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g.double())
    for name, got, want in zip("qkv", grads, ref_grads):
        err = _rel_rms(got, want)
        assert err <= 2 * TOL[dtype], f"d{name}: rel RMS {err:.2e}"


@pytest.mark.gpu
def test_gpu_elsa_on_the_core_compiled_and_graphed():
    """ELSA with phase 1 on the core under torch.compile(fullgraph=True), forward and backward, equal to eager; and
    a CUDA graph of its forward replays it on new inputs copied into the captured ones."""
    _need_core("cuda")
    torch._dynamo.reset()
    q, k, v = (t.requires_grad_() for t in _inputs(1, 8, 8, 4096, 4096, 128, torch.float16, "cuda"))
    assert elsa_host.forward_plan(q, k, v, None, False, 128 ** -0.5, "tf32x3", "", True).plan.gluon
    eager = torch.autograd.grad(elsa_attention(q, k, v).float().square().sum(), (q, k, v))
    compiled = torch.compile(lambda q, k, v: elsa_attention(q, k, v).float().square().sum(), fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(got, eager):
        assert _rel_rms(a, b) <= 1e-3
    static = [t.detach().clone() for t in (q, k, v)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            elsa_attention(*static)                 # warm-up: compile, fill the plan cache
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = elsa_attention(*static)
    fresh = _inputs(1, 8, 8, 4096, 4096, 128, torch.float16, "cuda", seed=1)
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert _rel_rms(out, reference_attention(*fresh)) <= TOL[torch.float16]
