"""Triton attention kernels shipped with attnbench, usable on their own.

Every kernel follows one contract: ``attn(q, k, v, causal=False, scale=None, **options)`` with
q, k, v of shape [B, H, N, D], returning [B, H, N, D]; gradients flow through autograd.

Each kernel package exports ``BACKENDS``: a dict mapping a backend name to its capabilities
(see ``attnbench.backends``), so the harness can register it without the kernels importing the harness.
"""
