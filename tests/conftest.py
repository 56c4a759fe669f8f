"""Test set-up: CPU runs Triton kernels through the interpreter; `-m gpu` runs on a CUDA device.

TRITON_INTERPRET must be set before triton is imported anywhere, hence here, at collection time.
"""
import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Subprocesses (the CLI tests) import this checkout, whatever is installed: the repo root leads PYTHONPATH (after
# tests/interpreter_site on a machine without CUDA, below, which holds only a sitecustomize).
_REPO = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH")) if p)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # the interpreter's speed-ups (that file says which and why), here and in every process the tests start
    _INTERPRETER_SITE = Path(__file__).resolve().parent / "interpreter_site"
    os.environ["PYTHONPATH"] = os.pathsep.join((str(_INTERPRETER_SITE), os.environ["PYTHONPATH"]))
    _spec = importlib.util.spec_from_file_location("interpreter_speed_ups", _INTERPRETER_SITE / "sitecustomize.py")
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))


# pytest's default selection runs on a CUDA machine too, where the Triton interpreter is off (above) and host
# tensors handed to CQSA stream through the GPU. A test of the CPU path is marked `cpu_only` (its GPU twin is a
# `gpu`-marked test), or `cpu_only("host_inputs")` for CQSA's host inputs, and skipped there for that reason.
CPU_ONLY_REASONS = {
    "interpreter": "CPU tensors need the Triton interpreter, which is on only where CUDA is absent",
    "host_inputs": "host inputs stream through the GPU where there is one: the CPU engine's test",
}


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        cpu_only = item.get_closest_marker("cpu_only")
        if cpu_only is not None:
            kind = cpu_only.args[0] if cpu_only.args else "interpreter"
            if kind not in CPU_ONLY_REASONS:
                raise pytest.UsageError(f"{item.nodeid}: cpu_only({kind!r}): the kinds are "
                                        f"{sorted(CPU_ONLY_REASONS)}")
            if HAS_CUDA:
                item.add_marker(pytest.mark.skip(reason=CPU_ONLY_REASONS[kind]))


@pytest.fixture
def device():
    """The device kernel tests run on: CUDA when present, else CPU (Triton interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
