"""attnbench: a clean-GPU benchmark harness and results matrix for attention kernels."""
__version__ = "0.1.0"
