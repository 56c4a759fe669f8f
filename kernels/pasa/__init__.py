"""PASA: FlashAttention with online pseudo-average shifting, overflow-free in fp16 (arXiv:2503.01873).

Forward only, Triton, as torch.library ops (``ops``). ``pasa_attention`` is the kernel; ``fa16_attention``
is the partially low-precision FlashAttention (fp16 scores, no shift) the paper shows overflowing; ``beta``
solves the paper's optimal-accuracy condition; ``emulate`` is a PyTorch model of the kernel's roundings.
"""
from kernels._common import HEAD_DIMS
from kernels.pasa.attention import check_options, fa16_attention, pasa_attention
from kernels.pasa.beta import default_beta, solve_beta

# gqa: K/V with fewer heads than q, read in place; cross: Nq != Nk (causal: bottom-right aligned)
_COMMON = dict(dtypes=("float16", "bfloat16"), modes=("fwd",), causal=(False, True), head_dims=HEAD_DIMS,
               gqa=True, cross=True, devices=("cuda", "cpu"))

BACKENDS = {
    "pasa": dict(fn=pasa_attention, options={"beta": None, "state_dtype": "fp16", "variant": None},
                 check_options=check_options,
                 description="PASA: fp16 scores and fp16 softmax state, K shifted by its block pseudo-average "
                             "(no fp16 overflow); forward only, bf16 converted to fp16",
                 **_COMMON),
    "fa16": dict(fn=fa16_attention, options={},
                 description="FA16-FP32 comparator: unscaled QKᵀ rounded to fp16 (overflows past 65504), "
                             "fp32 softmax; forward only, bf16 converted to fp16",
                 **_COMMON),
}

__all__ = ["BACKENDS", "pasa_attention", "fa16_attention", "solve_beta", "default_beta"]
