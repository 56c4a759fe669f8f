"""ELSA: exact softmax attention as a two-pass parallel scan over key partitions (Triton).

Phase 1 writes one (m, z, s) monoid summary per (query row, key partition) to global memory; phase 2,
a separate launch, merges them and writes out = s / z. See NOTES.md and shared/specs/elsa.md.
The public function calls the torch.library ops attnbench::elsa / elsa_fwd / elsa_bwd (ops.py).
"""
from functools import partial

from .._common import check_precision
from .attention import HEAD_DIMS, PRECISIONS, elsa_attention, elsa_attention_qkvpacked
from .trace import trace_launches

BACKENDS = {
    "elsa": dict(
        fn=elsa_attention,
        dtypes=("float32", "float16", "bfloat16"),
        cpu_dtypes=("float32", "float16"),        # bf16 is wrong under the Triton CPU interpreter
        modes=("fwd", "bwd", "fwdbwd"),
        causal=(False, True),
        head_dims=HEAD_DIMS,
        gqa=True,                                 # K/V with fewer heads than q, read in place
        cross=True,                               # Nq != Nk (causal: bottom-right aligned)
        devices=("cuda", "cpu"),
        options={"precision": "tf32x3"},
        check_options=partial(check_precision, "elsa"),   # the options' own check, without a tensor
        description="ELSA two-pass parallel scan: phase-1 partition summaries (m,z,s) in HBM, "
                    "phase-2 merge; exact recompute backward (float32 dots: tf32x3 by default); "
                    "grouped-query K/V, Nq != Nk (bottom-right causal), head dims 16-256",
    ),
}

__all__ = ["elsa_attention", "elsa_attention_qkvpacked", "trace_launches", "BACKENDS", "PRECISIONS", "HEAD_DIMS"]
