"""A PyTorch model of the Triton PASA forward, rounding where the kernel rounds (spec §7 D's emulation).

It exists to check the kernel (same windows, same block order, same fp16 roundings up to the order of
fp32 summations) and to explore the precision allocation on the CPU without the Triton interpreter.
Everything is computed in float32 and rounded to the state format exactly where the kernel rounds (an
fp16 operation is an fp32 operation rounded once). Both main-loop variants are modelled, and the Gluon core's
fp16 state with its exponent in float16 arithmetic (``exponent="fp16"``). Forward only; vectorised over batch,
heads, rows.

What it cannot model is the order of the kernel's fp32 sums (the two GEMMs, ȳ, ℓ's row sum): that belongs to
the tensor cores, or to NumPy and the CPU in the Triton interpreter. Two orders of one sum of n terms differ by
at most ~n·2⁻²⁴·Σ|terms|, far below half an fp16 ulp, so the following fp16 rounding agrees except near a
rounding boundary, where it moves by one ulp. ``sum_order`` makes that visible: "torch" (the default) sums as
torch does on this machine, "permuted" sums every reduction in a seeded random order of its terms, "float64"
sums exactly (float64, rounded once to float32). ``tests/test_pasa.py`` bounds the kernel's distance from this
model by the arithmetic and checks the same bound between the orders, so it holds on any CPU.
"tensor_cores" (CUDA tensors only) computes the matmuls as the GPU kernels do, float16 operands on the tensor cores
with float32 accumulation (``torch.mm(out_dtype=float32)``): their sums are not those of any order of exact fp32
additions (a CPU's), and the Gluon core's fp16 state, whose exponent rounds the frame to float16, turns the
difference into a kernel-vs-model distance of ~0.6 of the model's own error on biased inputs over several windows,
against 0.02–0.04 with the tensor cores' sums (results/dev/pasa/fp16_exponent_on_the_core_h200.json).
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import torch

from kernels._common import LOG2E, PASA_M_INIT as M_INIT, block_d
from kernels.pasa.attention import DEFAULT_CONFIGS, DEFAULT_VARIANT, VARIANTS
from kernels.pasa.beta import default_beta, ideal_invariance, shift_entries



def _rounder(state_dtype: str):
    if state_dtype == "fp16":
        return lambda t: t.half().float()
    if state_dtype in ("fp32", "exact"):
        return lambda t: t
    raise ValueError(f"state_dtype must be 'fp16', 'fp32' or 'exact', got {state_dtype!r}")


def kv_windows(n_keys: int, block_n: int):
    """(start, first_new_key) for each KV block: the last, ragged block reuses the window [N − n, N)
    and masks the keys an earlier block already covered (spec §3), so every window has n real keys
    whenever N ≥ n; with N < n the single window is zero-padded."""
    t_c = math.ceil(n_keys / block_n)
    return [(min(j * block_n, max(n_keys - block_n, 0)), j * block_n) for j in range(t_c)]


SUM_ORDERS = ("torch", "permuted", "float64", "tensor_cores")
EXPONENTS = ("fp32", "fp16")
LOG2E_F16 = 1.4423828125              # fp16(log2 e): the fp16 exponent's constant
# sm_90's ex2.approx.f16 (MUFU.EX2.F16), measured on the H200 for every float16 argument: never above 2^x rounded to
# nearest, one ulp below it for 19,416 of the 63,488 finite arguments; this file's bit i (little-endian bit order)
# marks float16 bit pattern i as one of those
EX2_F16_TABLE = Path(__file__).with_name("ex2_approx_f16_sm90.bin")


@functools.lru_cache(maxsize=1)
def _ex2_f16_below() -> torch.Tensor:
    bits = np.unpackbits(np.fromfile(EX2_F16_TABLE, dtype=np.uint8), bitorder="little")
    if bits.size != 65536:
        raise RuntimeError(f"{EX2_F16_TABLE}: {bits.size} bits, expected 65536 (one per float16 bit pattern)")
    return torch.from_numpy(bits.astype(bool))


def ex2_f16_sm90(x: torch.Tensor) -> torch.Tensor:
    """2^x of float16 values x as sm_90's ex2.approx.f16 computes it, bit for bit (float16 out): 2^x rounded to
    nearest, one ulp lower where the measured table says so (in the bit patterns: results are >= 0)."""
    x = x.to(torch.float16)
    nearest = torch.exp2(x.double()).to(torch.float16)
    below = _ex2_f16_below().to(x.device)[x.view(torch.int16).long() & 0xFFFF]
    return torch.where(below, (nearest.view(torch.int16) - 1).view(torch.float16), nearest)


def _tensor_core_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (broadcast batch dims) on the tensor cores: operands float16 values, sums and result float32."""
    a16, b16 = a.half(), b.half()
    if not (torch.equal(a16.float(), a) and torch.equal(b16.float(), b)):
        raise ValueError("sum_order='tensor_cores': a matmul operand holds values float16 cannot")
    batch = torch.broadcast_shapes(a16.shape[:-2], b16.shape[:-2])
    left = a16.expand(*batch, *a16.shape[-2:]).reshape(-1, *a16.shape[-2:])
    right = b16.expand(*batch, *b16.shape[-2:]).reshape(-1, *b16.shape[-2:])
    out = torch.stack([torch.mm(x, y, out_dtype=torch.float32) for x, y in zip(left, right)])
    return out.reshape(*batch, a16.shape[-2], b16.shape[-1])


def _reductions(sum_order: str, work: torch.dtype, device, seed: int):
    """(matmul, rowsum) computing the fp32 reductions in the asked order (module docstring)."""
    if sum_order not in SUM_ORDERS:
        raise ValueError(f"sum_order must be one of {', '.join(SUM_ORDERS)}, got {sum_order!r}")
    if sum_order == "torch" or work == torch.float64:
        return (lambda a, b: a @ b), (lambda x: x.sum(-1))
    if sum_order == "float64":
        return (lambda a, b: (a.double() @ b.double()).to(work)), (lambda x: x.double().sum(-1).to(work))
    if sum_order == "tensor_cores":
        if torch.device(device).type != "cuda":
            raise ValueError(f"sum_order='tensor_cores' needs CUDA tensors (got {device})")
        return _tensor_core_matmul, (lambda x: x.sum(-1))
    gen = torch.Generator().manual_seed(seed)

    def perm(n):
        return torch.randperm(n, generator=gen).to(device)

    def matmul(a, b):
        p = perm(a.shape[-1])
        return a[..., p] @ b[..., p, :]

    def rowsum(x):
        return x[..., perm(x.shape[-1])].sum(-1)

    return matmul, rowsum


def pasa_emulate(q, k, v, causal=False, scale=None, beta=None, block_n=None, block_m=None, state_dtype="fp16",
                 round_ybar=False, variant=None, sum_order="torch", order_seed=0, invariance=None, exponent="fp32"):
    """Algorithm 1 (spec §3) with the kernel's roundings; returns float32 [B, Hq, Nq, D] (float64 if exact).

    q [B, Hq, Nq, D], k, v [B, Hkv, Nk, D] as the kernel takes them: grouped-query K/V, causal aligned
    bottom-right when Nq != Nk, a row that sees no key gives 0. ``block_n`` (the window n) and ``block_m``
    (the query tile: causal tiles skip the blocks past their last row) default to the kernel's tiles.

    ``variant`` is the kernel's main loop (``kernels.pasa.attention.VARIANTS``; None: the default):
    - "ref", Algorithm 1 as written: P̂ = fp16(e^{Ŝ−μ}), ŝ = fp16(ΣP̂), fp16(P̂V), then ℓ = α·ℓ + γ·ŝ and
      A = α·A + γ·PV in fp16 operations (each product and sum rounded). As the kernel really computes it:
      μ comes out of tl.max as fp32, so Ŝ − μ, μ + δ_cur and the running max before its final cast are
      fp32 (exact differences of fp16 values), not rounded to fp16;
    - "fused": μ, G, δ_cur, δ_prev, m_new = fp16(max(fp16(μ + δ_cur), fp16(m + δ_prev))) and α first, then
      P = fp16(2^{fma(Ŝ, log2 e, −(m_new − δ_cur)·log2 e)}) (γ folded in), ℓ = fp16(α·ℓ + ΣP) and
      A = fp16(α·A + P·V) with the sums in fp32: one rounding per block for ℓ and for A.

    ``exponent`` (the "fused" loop with the fp16 state only): "fp32", P's exponent as above; "fp16", as the Gluon core's
    fp16 state computes it, in float16 arithmetic: F = fp16(m_new − δ_cur), P = ex2(fp16(fp16(Ŝ − F)·L)) with L =
    fp16(log2 e) and ex2 sm_90's ex2.approx.f16 (``ex2_f16_sm90``).

    ``state_dtype="exact"`` rounds nothing and computes in float64 with the unrounded λM: Algorithm 1
    is then exact, so it must equal dense softmax attention to ~1e-13 (the spec's §7 D gate).

    ``round_ybar=True`` rounds the local pseudo-average ȳ to the state format before use, as the
    released NPU code stores it; the kernel keeps ȳ in fp32 (see ``kernels.pasa.kernel``), and this
    switch shows why: on biased inputs the rounding error of ȳ, times c ≈ 63.5, dominates.

    ``sum_order``: the order of the fp32 sums (module docstring; ``order_seed`` seeds "permuted").
    ``invariance``: the recovery constant c; None is the kernel's c = β/(1 − β) (a test gives another to see
    what an error in c would do).
    """
    variant = DEFAULT_VARIANT if variant is None else variant
    fused = VARIANTS[variant]
    if exponent not in EXPONENTS:
        raise ValueError(f"exponent must be one of {', '.join(EXPONENTS)}, got {exponent!r}")
    if exponent == "fp16" and not (fused and state_dtype == "fp16"):
        raise ValueError(f"exponent='fp16' is the fused loop's in the fp16 state (got variant={variant!r}, "
                         f"state_dtype={state_dtype!r})")
    tiles = DEFAULT_CONFIGS["pasa"][block_d(q.shape[-1])]["fwd"]
    block_n = tiles["BLOCK_N"] if block_n is None else block_n
    block_m = tiles["BLOCK_M"] if block_m is None else block_m
    rs = _rounder(state_dtype)
    exact = state_dtype == "exact"
    r16 = rs if exact else (lambda t: t.half().float())
    work = torch.float64 if exact else torch.float32
    q, k, v = (t.to(work) if exact else t.to(torch.float16).float() for t in (q, k, v))
    bsz, heads, n_q, d = q.shape
    n_k = k.shape[2]
    group = heads // k.shape[1]          # grouped-query K/V: query head h reads kv head h // group
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    shift_causal = n_k - n_q             # bottom-right causal: row i sees keys j <= i + n_k − n_q
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    beta = default_beta(block_n, scale) if beta is None else float(beta)
    dev = q.device
    log2e = torch.tensor(LOG2E, device=dev, dtype=work)   # the kernel's constant, as an fp32 operand

    def exp(x):          # e^x as the kernel evaluates it: ex2(x·log2 e), the product rounded to fp32
        return torch.exp2(x * log2e)

    def exp_fma(s, off):  # ex2(fma(s, log2 e, −off·log2 e)): the product is exact in float64, one rounding
        arg = s.double() * log2e.double() - (off * log2e).double()[..., None]
        return torch.exp2(arg.to(work))

    matmul, rowsum = _reductions(sum_order, work, dev, order_seed)
    c = ideal_invariance(beta) if invariance is None else float(invariance)
    c = rs(torch.tensor(c, device=dev, dtype=work))
    if exact:
        diag, off = scale * (1.0 - beta / block_n), -scale * beta / block_n
    else:
        diag, off = shift_entries(beta, block_n, scale, "fp16")
    shift = (torch.full((block_n, block_n), off, device=dev, dtype=work)
             + torch.eye(block_n, device=dev, dtype=work) * (diag - off))

    rows = torch.arange(n_q, device=dev)
    m = torch.full((bsz, heads, n_q), M_INIT, device=dev, dtype=work)
    ell = torch.zeros(bsz, heads, n_q, device=dev, dtype=work)
    acc = torch.zeros(bsz, heads, n_q, d, device=dev, dtype=work)
    g = torch.zeros(bsz, heads, n_q, device=dev, dtype=work)
    for j, (start, first_new) in enumerate(kv_windows(n_k, block_n)):
        keys = torch.arange(start, start + block_n, device=dev)
        real = keys < n_k
        k_win = torch.zeros(bsz, heads, block_n, d, device=dev, dtype=work)
        v_win = torch.zeros(bsz, heads, block_n, d, device=dev, dtype=work)
        k_win[:, :, real] = k[:, :, keys[real]]
        v_win[:, :, real] = v[:, :, keys[real]]
        k_shift = r16(matmul(shift, k_win))                            # ② K̃ = fp16(M·K), fp32 accumulation
        s32 = matmul(q, k_shift.transpose(-1, -2))                     # scaled and shifted logits, fp32
        ybar32 = rowsum(s32) / block_n                                 # ③ local pseudo-average, from fp32
        if round_ybar:
            ybar32 = rs(ybar32)
        visible = (real & (keys >= first_new))[None, :].expand(n_q, -1)
        if causal:
            visible = visible & (keys[None, :] <= rows[:, None] + shift_causal)
        s = rs(r16(s32)).masked_fill(~visible, float("-inf"))          # the fp16 score tile
        mu = torch.clamp(s.amax(-1), min=M_INIT)                      # a max of fp16 values: exact

        # global recovery (eq 15) and the frame corrections (③), in the state format
        g_old = rs(ybar32) if j == 0 else g
        g_new = rs(g_old + rs((ybar32 - g_old) / (j + 1)))
        d_cur = rs(c * rs(ybar32 - g_new))
        d_prev = rs(c * rs(g_old - g_new))
        cand_old = rs(m + d_prev)
        if fused:   # ④ with γ inside the exponent; ℓ and A rounded once per block (α·ℓ, α·A exact in fp32)
            m_new = torch.maximum(rs(mu + d_cur), cand_old)
            alpha = rs(exp(cand_old - m_new))
            frame = torch.clamp(m_new - d_cur, min=M_INIT)
            if exponent == "fp16":
                arg = r16(r16(s - r16(frame)[..., None]) * LOG2E_F16)
                p = ex2_f16_sm90(arg).float()
            else:
                p = rs(exp_fma(s, frame))
            ell_new = rs(alpha * ell + rowsum(p))
            acc_new = rs(alpha[..., None] * acc + matmul(r16(p), v_win))
        else:       # ④ as written: the local softmax, then γ on the rounded ŝ and P̂·V
            p = rs(exp(s - mu[..., None]))
            s_sum = rs(rowsum(p))
            pv = rs(matmul(r16(p), v_win))
            cand_new = mu + d_cur
            m_new = torch.maximum(cand_new, cand_old)
            alpha = rs(exp(cand_old - m_new))
            gamma = rs(exp(cand_new - m_new))
            ell_new = rs(rs(alpha * ell) + rs(gamma * s_sum))
            acc_new = rs(rs(alpha[..., None] * acc) + rs(gamma[..., None] * pv))
            m_new = rs(m_new)

        # the kernel visits block j only for query tiles that can see it (causal skips the rest)
        if causal:
            tile_end = (rows // block_m + 1) * block_m
            seen = (j * block_n < tile_end + shift_causal)
        else:
            seen = torch.ones(n_q, dtype=torch.bool, device=dev)
        m = torch.where(seen, m_new, m)
        ell = torch.where(seen, ell_new, ell)
        g = torch.where(seen, g_new, g)
        acc = torch.where(seen[:, None], acc_new, acc)
    return torch.where(ell[..., None] == 0, 0.0, rs(acc / ell[..., None]))   # a row that saw no key: 0
