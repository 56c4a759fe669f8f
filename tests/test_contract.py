"""The kernel contract (kernels/_common.py, shared/DESIGN.md), checked once for every registered kernel backend:
the same input checks with one-line errors, the default scale, grouped-query K/V, queries != keys (bottom-right
causal), a head dim that needs padding, torch.compile(fullgraph=True) forward and backward, and the one
forward-only error. Each kernel's own test file goes deeper (sizes, dtypes, tiles, options)."""
import math

import pytest
import torch

from attnbench.backends import KERNEL_PACKAGES, get_backend
from kernels._common import ForwardOnlyError, HEAD_DIMS, block_d, check_inputs, tile_config
from kernels.reference import reference_attention

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
BACKENDS = [get_backend(name) for name in KERNEL_PACKAGES]
RUNNABLE = [b for b in BACKENDS if DEVICE in b.devices]


def _dtype(backend) -> torch.dtype:
    dtypes = backend.cpu_dtypes if DEVICE == "cpu" and backend.cpu_dtypes else backend.dtypes
    return torch.float32 if "float32" in dtypes else torch.float16


def _tol(dtype) -> float:
    # relative RMS error against float64: float32 (tf32x3 dots) lands near 1e-6; float16 inputs near 1e-3.
    # Both bounds sit well under the ~1e-2 that a 1-2 % error in a constant (the scale, say) produces.
    return 2e-5 if dtype == torch.float32 else 4e-3


def _rel_rms(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))


def _inputs(b, hq, hkv, nq, nk, d, dtype, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(b, hkv, nk, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(b, hkv, nk, d, generator=g).to(DEVICE, dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _causal(backend) -> bool:
    return True if backend.causal == (True,) else False


def _self_attention(backend) -> bool:
    return backend.name.startswith(("cron_root", "flex_cron_root"))


def _reference(backend, q, k, v, causal):
    if backend.reference is not None:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return backend.reference(q.double(), k.double(), v.double(), causal=causal)
    return reference_attention(q, k, v, causal=causal)


# --- the shared checks ----------------------------------------------------------------------------------

def _bad_cases(dtype):
    q, k, v = _inputs(1, 4, 2, 32, 32, 32, dtype)
    return [
        ("not a tensor", dict(q=q.tolist()), "q must be a torch.Tensor"),
        ("3-D q", dict(q=q[0]), "4-D"),
        ("dtypes differ", dict(k=k.double()), "one dtype"),
        ("batch differs", dict(k=torch.cat([k, k]), v=torch.cat([v, v])), "batch"),
        ("k, v shapes differ", dict(v=v[:, :1]), "same shape"),
        ("heads not a multiple", dict(q=torch.cat([q, q[:, :1]], 1)), "5 heads"),
        ("head dim not a multiple of 8", dict(q=q[..., :20], k=k[..., :20], v=v[..., :20]), "head dim 20"),
        ("head dim above 256", dict(q=q.repeat(1, 1, 1, 9)[..., :264], k=k.repeat(1, 1, 1, 9)[..., :264],
                                    v=v.repeat(1, 1, 1, 9)[..., :264]), "head dim 264"),
        ("causal not a bool", dict(causal="yes"), "causal must be a bool"),
        ("scale zero", dict(scale=0.0), "scale"),
        ("scale negative", dict(scale=-0.5), "scale"),
        ("scale nan", dict(scale=float("nan")), "scale"),
    ], (q, k, v)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_bad_input_is_one_line_naming_the_problem(backend):
    if DEVICE not in backend.devices:
        pytest.skip(f"{backend.name} runs on {backend.devices} only")
    dtype = _dtype(backend)
    cases, (q, k, v) = _bad_cases(dtype)
    for label, change, needle in cases:
        args = dict(q=q, k=k, v=v, causal=_causal(backend), scale=None)
        args.update(change)
        with pytest.raises(ValueError) as exc:
            backend.fn(args.pop("q"), args.pop("k"), args.pop("v"), **args)
        msg = str(exc.value)
        assert "\n" not in msg, f"{backend.name}, {label}: error is not one line: {msg!r}"
        assert needle in msg, f"{backend.name}, {label}: {msg!r} does not name {needle!r}"


@pytest.mark.parametrize("backend", [b for b in BACKENDS if "cpu" in b.devices and "bfloat16" in b.dtypes],
                         ids=lambda b: b.name)
def test_bfloat16_on_the_cpu_is_computed_right_or_refused_in_one_line(backend):
    """The Triton interpreter computes bf16 wrongly: a kernel that would hand it bf16 tensors refuses them (one
    line); one whose registry entry takes bf16 on the CPU (PASA converts it to float16 first) computes it right."""
    if HAS_CUDA:
        pytest.skip("the CPU interpreter's case")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 24, 32, generator=g).bfloat16() for _ in range(3))
    causal = _causal(backend)
    if "bfloat16" in (backend.cpu_dtypes or backend.dtypes):
        out = backend.fn(q, k, v, causal=causal)
        assert out.dtype == torch.bfloat16 and _rel_rms(out, _reference(backend, q, k, v, causal)) < 1.2e-2
        return
    with pytest.raises(ValueError) as exc:
        backend.fn(q, k, v, causal=causal)
    assert str(exc.value) == (f"{backend.name}: bfloat16 needs a CUDA device (the Triton CPU interpreter computes "
                              "bf16 wrongly)")


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.options], ids=lambda b: b.name)
def test_options_check_without_a_tensor_agrees_with_the_call(backend):
    # the harness checks a matrix's kernel_options at load time with check_options; a value it refuses must be
    # the value the call refuses, with the same message (and the defaults must pass)
    assert backend.check_options is not None
    backend.check_options(**backend.options)
    causal = _causal(backend)
    q, k, v = _inputs(1, 2, 2, 16, 16, 32, _dtype(backend))
    for option in backend.options:
        with pytest.raises(ValueError) as refused:
            backend.check_options(**{**backend.options, option: "x"})
        assert option in str(refused.value) and "'x'" in str(refused.value)
        if DEVICE in backend.devices:
            with pytest.raises(ValueError) as called:
                backend.fn(q, k, v, causal=causal, **{option: "x"})
            assert str(called.value) == str(refused.value)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if _self_attention(b)], ids=lambda b: b.name)
def test_self_attention_kernels_refuse_other_lengths_and_non_causal(backend):
    if DEVICE not in backend.devices:
        pytest.skip(f"{backend.name} runs on {backend.devices} only")
    q, k, v = _inputs(1, 2, 2, 24, 40, 32, _dtype(backend))
    with pytest.raises(ValueError, match="query length 24 differs from key length 40"):
        backend.fn(q, k, v, causal=True)
    q, k, v = _inputs(1, 2, 2, 32, 32, 32, _dtype(backend))
    with pytest.raises(ValueError, match="causal=False is not supported"):
        backend.fn(q, k, v, causal=False)


@pytest.mark.parametrize("backend", RUNNABLE, ids=lambda b: b.name)
def test_default_scale_is_one_over_sqrt_d(backend):
    dtype = _dtype(backend)
    q, k, v = _inputs(1, 2, 2, 40, 40, 32, dtype)
    causal = _causal(backend)
    with torch.no_grad():
        default = backend.fn(q, k, v, causal=causal)
        explicit = backend.fn(q, k, v, causal=causal, scale=1 / math.sqrt(32))
        off = backend.fn(q, k, v, causal=causal, scale=1.02 / math.sqrt(32))
    assert _rel_rms(default, explicit) <= _tol(dtype) / 4
    assert _rel_rms(off, explicit) > _tol(dtype), "a 2 % change of the scale must be visible"


def _shapes(backend):
    """(B, Hq, Hkv, Nq, Nk, D) cases: grouped-query and multi-query K/V, a padded head dim, and for kernels that
    are not self-attention a query length different from the key length (both ways). The first case has two batch
    entries (a K/V head's offset counts the batch with Hkv heads, not Hq); the others one, which halves their
    interpreted work."""
    cases = [(2, 4, 2, 48, 48, 40), (1, 3, 1, 37, 37, 24)]
    if not _self_attention(backend):
        cases += [(1, 4, 2, 19, 53, 40), (1, 2, 2, 53, 19, 32)]
    return cases


@pytest.mark.parametrize("backend", RUNNABLE, ids=lambda b: b.name)
def test_gqa_cross_lengths_and_padded_head_dims_match_float64(backend):
    dtype = _dtype(backend)
    causal_modes = backend.causal
    train = "bwd" in backend.modes
    for i, (b, hq, hkv, nq, nk, d) in enumerate(_shapes(backend)):
        for causal in causal_modes:
            q, k, v = _inputs(b, hq, hkv, nq, nk, d, dtype, grad=train, seed=i)
            out = backend.fn(q, k, v, causal=causal)
            ref = _reference(backend, q, k, v, causal)
            where = f"{backend.name} B={b} Hq={hq} Hkv={hkv} Nq={nq} Nk={nk} D={d} causal={causal}"
            assert out.shape == q.shape and out.dtype == q.dtype, where
            err = _rel_rms(out, ref)
            assert err <= _tol(dtype), f"{where}: forward rel. RMS error {err:.2e}"
            if not train:
                continue
            do = torch.randn_like(out)
            grads = torch.autograd.grad(out, (q, k, v), do)
            refs = torch.autograd.grad(ref, (q, k, v), do.double())
            for name, gr, rf in zip("qkv", grads, refs):
                assert gr.shape == rf.shape, f"{where}: d{name} shape {tuple(gr.shape)}"
                err = _rel_rms(gr, rf)
                assert err <= 2 * _tol(dtype), f"{where}: d{name} rel. RMS error {err:.2e}"


@pytest.mark.parametrize("backend", RUNNABLE, ids=lambda b: b.name)
def test_compiles_fullgraph_forward_and_backward_like_eager(backend):
    torch._dynamo.reset()
    dtype = _dtype(backend)
    causal = _causal(backend)
    train = "bwd" in backend.modes

    def attend(q, k, v):
        return backend.fn(q, k, v, causal=causal) * 2.0

    compiled = torch.compile(attend, fullgraph=True, backend="inductor" if HAS_CUDA else "aot_eager")
    q, k, v = _inputs(1, 4, 2, 40, 40, 32, dtype, grad=train)
    out_c, out_e = compiled(q, k, v), attend(q, k, v)
    assert _rel_rms(out_c, out_e) <= _tol(dtype) / 4
    if train:
        do = torch.randn_like(out_e)
        g_c = torch.autograd.grad(out_c, (q, k, v), do)
        g_e = torch.autograd.grad(out_e, (q, k, v), do)
        for gc, ge in zip(g_c, g_e):
            assert _rel_rms(gc, ge) <= _tol(dtype) / 4


@pytest.mark.parametrize("backend", [b for b in RUNNABLE if "bwd" not in b.modes], ids=lambda b: b.name)
def test_forward_only_kernels_refuse_backward_with_the_one_error(backend):
    q, k, v = _inputs(1, 2, 2, 32, 32, 32, _dtype(backend), grad=True)
    out = backend.fn(q, k, v, causal=_causal(backend))
    with pytest.raises(ForwardOnlyError, match=f"{backend.name}: backward is not supported"):
        out.sum().backward()


# --- the helpers themselves ------------------------------------------------------------------------------

def test_head_dims_are_the_multiples_of_8_from_16_to_256_padded_to_powers_of_two():
    assert HEAD_DIMS[0] == 16 and HEAD_DIMS[-1] == 256 and all(d % 8 == 0 for d in HEAD_DIMS)
    assert len(HEAD_DIMS) == 31
    assert [block_d(d) for d in (16, 24, 32, 40, 64, 72, 80, 96, 128, 136, 256)] == \
        [16, 32, 32, 64, 64, 128, 128, 128, 128, 256, 256]


def test_shape_reports_group_and_bottom_right_offset():
    q, k, v = _inputs(2, 6, 2, 10, 25, 16, torch.float32)
    s = check_inputs("x", q, k, v, causal=True, scale=None)
    assert (s.batch, s.heads_q, s.heads_kv, s.len_q, s.len_kv, s.head_dim) == (2, 6, 2, 10, 25, 16)
    assert s.group == 3 and s.causal_offset == 15


def test_tile_config_merges_and_rejects_unknown_parts_and_values():
    defaults = {"fwd": {"BLOCK_M": 64, "num_warps": 4}, "bwd": {"BLOCK_N": 32}}
    assert tile_config("x", defaults, None) is defaults
    merged = tile_config("x", defaults, {"fwd": {"num_warps": 8}})
    assert merged == {"fwd": {"BLOCK_M": 64, "num_warps": 8}, "bwd": {"BLOCK_N": 32}}
    assert defaults["fwd"]["num_warps"] == 4
    for bad, needle in (({"fwdd": {}}, "part 'fwdd' unknown"), ({"fwd": {"BLOCK_K": 1}}, "no parameter 'BLOCK_K'"),
                        ({"fwd": {"BLOCK_M": 0}}, "positive int"), ({"fwd": {"BLOCK_M": True}}, "positive int"),
                        ([1], "must be a dict")):
        with pytest.raises(ValueError, match=needle):
            tile_config("x", defaults, bad)
