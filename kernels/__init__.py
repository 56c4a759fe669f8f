"""Triton attention kernels shipped with attnbench, usable on their own.

Every kernel follows one contract: ``attn(q, k, v, causal=..., scale=None, **options)`` with q [B, Hq, Nq, D]
and k, v [B, Hkv, Nk, D] (grouped-query: Hq a multiple of Hkv), returning [B, Hq, Nq, D]; gradients flow through
autograd, except for the forward-only kernels (PASA and fa16: ForwardOnlyError). causal defaults to False, and
to True for Cron Root, a causal-only pattern (causal=False raises).

Each kernel package exports ``BACKENDS``: a dict mapping a backend name to its capabilities
(see ``attnbench.backends``), so the harness can register it without the kernels importing the harness.
"""

_LAZY = {"patch_timm_attention": "kernels.timm_patch", "patch_timm_attention_train": "kernels.timm_patch"}


def __getattr__(name):
    # Lazy so that `import kernels` stays light (no timm, no Triton) until the drop-in is asked for.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
