"""Per-GPU tuning data (tuning.json): the hybrid's crossover length and optional tile configs.

Written by a GPU run of ``scripts/tune.py --kernel cron_root`` (it updates the entry of the GPU it ran on: the
crossovers of its "cross" section, and tile configs that beat the current ones); read once per process and device.
"""
from __future__ import annotations

import functools
import json
import pathlib

import torch

TUNING_FILE = pathlib.Path(__file__).with_name("tuning.json")


@functools.lru_cache(maxsize=None)
def table() -> dict:
    return json.loads(TUNING_FILE.read_text())


def device_name(device: torch.device) -> str | None:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


@functools.lru_cache(maxsize=None)
def gpu_entry(name: str | None) -> dict:
    """The tuning entry of a GPU name ({} when none is stored)."""
    return dict(table()["gpus"].get(name, {})) if name else {}


def crossover_for(name: str | None, train: bool | None = None) -> int:
    """The hybrid's crossover for a GPU name (None or not listed: the default).

    train=False / True picks the forward-only / fwd+bwd crossover where the GPU's entry stores one
    ("crossover_fwd", "crossover_fwdbwd": they differ because the backward adds three launches of host cost);
    otherwise, and for train=None, the entry's "crossover" (the larger of the two).
    """
    entry = gpu_entry(name)
    key = {None: None, False: "crossover_fwd", True: "crossover_fwdbwd"}[train]
    if key and entry.get(key) is not None:
        return int(entry[key])
    return int(entry["crossover"]) if "crossover" in entry else int(table()["default"]["crossover"])


def tuned_configs(name: str | None, dim_bucket: int) -> dict:
    """Stored tile configs {kernel: {BLOCK_*: ..., num_warps: ...}} for a GPU name and head-dim bucket."""
    return gpu_entry(name).get("configs", {}).get(str(dim_bucket), {})
