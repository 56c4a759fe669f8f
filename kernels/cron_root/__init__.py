"""Cron Root attention: O(N sqrt N) causal sparse attention (local window + strided anchors + relay block
means in one online softmax), in Triton, forward and backward, as torch.library ops (attnbench::cron_root_fwd,
attnbench::cron_root_bwd). See NOTES.md and reference.py.

Backends for attnbench:
  cron_root         the Triton kernel
  cron_root_hybrid  SDPA causal (dense) below the per-GPU crossover length, cron_root from it
  flex_cron_root    the same pattern through compiled FlexAttention (the peer a compiler gives you)
Also: CronRootMultiheadAttention (a drop-in for nn.MultiheadAttention in causal self-attention) and
get_gpu_info().
"""
from functools import partial

from .._common import HEAD_DIMS
from .attention import check_options, cron_root_attention
from .flex import flex_cron_root
from .hybrid import check_options as check_hybrid_options, cron_root_hybrid, cron_root_hybrid_reference
from .module import CronRootMultiheadAttention
from .reference import RELAY_THRESHOLD, cron_root_mask, cron_root_reference, uses_relay, window
from .tuning import crossover_for, get_gpu_info

__all__ = ["cron_root_attention", "cron_root_hybrid", "flex_cron_root", "CronRootMultiheadAttention",
           "get_gpu_info", "cron_root_reference", "cron_root_hybrid_reference", "cron_root_mask", "crossover_for",
           "uses_relay", "window", "RELAY_THRESHOLD", "BACKENDS"]

_ALL = ("float32", "float16", "bfloat16")
_MODES = ("fwd", "bwd", "fwdbwd")
_OPTIONS = {"relay_threshold": RELAY_THRESHOLD, "precision": "tf32x3"}

BACKENDS = {
    "cron_root": dict(
        fn=cron_root_attention, dtypes=_ALL, cpu_dtypes=("float32", "float16"), modes=_MODES, causal=(True,),
        head_dims=HEAD_DIMS, gqa=True, devices=("cuda", "cpu"), options=dict(_OPTIONS),
        check_options=partial(check_options, "cron_root"),
        description="Cron Root O(N√N) causal sparse attention (local √N window + strided anchors + relay "
                    "block means, one softmax), Triton fwd+bwd, grouped K/V read in place; relay only for "
                    "N > relay_threshold",
        reference=cron_root_reference),
    "cron_root_hybrid": dict(
        fn=cron_root_hybrid, dtypes=_ALL, cpu_dtypes=("float32", "float16"), modes=_MODES, causal=(True,),
        head_dims=HEAD_DIMS, gqa=True, devices=("cuda", "cpu"), options={"crossover": None, **_OPTIONS},
        check_options=check_hybrid_options,
        description="DENSE SDPA causal for N < crossover (per GPU in tuning.json; default 1536), Cron Root sparse "
                    "from it on: two different functions, its reference follows the same switch",
        reference=cron_root_hybrid_reference),
    "flex_cron_root": dict(
        fn=flex_cron_root, dtypes=_ALL, modes=_MODES, causal=(True,), head_dims=HEAD_DIMS, devices=("cuda",),
        options={"relay_threshold": RELAY_THRESHOLD}, check_options=partial(check_options, "flex_cron_root"),
        description="The Cron Root pattern through compiled FlexAttention (relay means appended to K/V, "
                    "mask_mod over N + R keys); compile excluded after the first call",
        reference=cron_root_reference),
}
