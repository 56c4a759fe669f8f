"""Stream-CQSA: exact attention as independent cyclic-quorum subsequence tasks (arXiv:2604.20819).

``cqsa_attention(q, k, v, causal=False, scale=None, c=7, itr=1, mem_budget=None)`` computes exact
softmax attention by CQS Divide: c**itr subsequence tasks whose responsibility masks partition the
Nq×Nk score matrix, merged with a log-sum-exp rule. Resident mode batches the tasks into slot waves
(torch.library ops ``attnbench::cqsa_fwd`` / ``attnbench::cqsa_bwd``: torch.compile and CUDA graphs work);
streaming mode (``mem_budget`` or host inputs) schedules them under a memory budget with the OOM
guardrail, eagerly. Grouped-query K/V, Nq != Nk (causal aligned bottom-right) and head dims 16..256 in
steps of 8 are supported. Causal attention is an extension beyond the paper: sorted gather keeps tokens
in global order, so the causal mask composes with the responsibility mask.
"""
from .._common import HEAD_DIMS
from .attention import cqsa_attention
from .checks import check_options
from .distributed import cqsa_attention_distributed
from .divide import INTEREST_SETS, balanced_layout, build_tasks, coverage_counts, is_difference_set, owner, refine

BACKENDS = {
    "cqsa": dict(
        fn=cqsa_attention,
        dtypes=("float32", "float16", "bfloat16"),
        cpu_dtypes=("float32", "float16"),       # the Triton CPU interpreter gets bf16 wrong
        modes=("fwd", "bwd", "fwdbwd"),
        causal=(False, True),
        head_dims=HEAD_DIMS,
        gqa=True,                                # K/V with fewer heads than q, read in place
        cross=True,                              # Nq != Nk (causal: bottom-right aligned)
        devices=("cuda", "cpu"),
        options={"c": 7, "itr": 1, "mem_budget": None},
        check_options=check_options,
        eager_only_options=("mem_budget",),      # set, the call streams: eager, never captured in a graph
        description="Stream-CQSA: exact attention as c**itr CQS subsequence tasks merged by log-sum-exp "
                    "(resident slot waves; mem_budget, bytes, streams the tasks under that budget, eagerly)",
    ),
}

__all__ = ["cqsa_attention", "cqsa_attention_distributed", "BACKENDS", "INTEREST_SETS", "balanced_layout",
           "build_tasks", "coverage_counts", "is_difference_set", "owner", "refine"]
