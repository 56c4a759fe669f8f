"""Per-GPU tuning data (tuning.json): the hybrid's crossover length and optional tile configs, and
get_gpu_info() (what is known about this GPU).

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
    ("crossover_fwd", "crossover_fwdbwd": they differ because the backward's three launches cost Cron Root more at
    short lengths than flash's);
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


def get_gpu_info(device=None) -> dict:
    """What Cron Root knows about a CUDA device (default: the current one): its name, SM count, compute
    capability, and the hybrid's crossovers stored for it in tuning.json (None where nothing is stored; ``note``
    then names the default the hybrid uses). Never raises: without CUDA, ``cuda_available`` is False, ``note``
    says so and the other fields are empty."""
    info = dict(cuda_available=False, gpu_name=None, sm_count=0, compute_capability=None, crossover_fwd=None,
                crossover_fwdbwd=None, crossover=None, note="")
    try:
        if not torch.cuda.is_available():
            info["note"] = ("no CUDA device (torch.cuda.is_available() is False): Cron Root runs on the CPU only "
                            "through the Triton interpreter")
            return info
        info["cuda_available"] = True
        props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device)
    except Exception as exc:      # a broken driver or a bad device argument is reported, not raised
        info["note"] = f"no CUDA device information: {type(exc).__name__}: {exc}".splitlines()[0]
        return info
    entry = gpu_entry(props.name)
    info.update(gpu_name=props.name, sm_count=props.multi_processor_count,
                compute_capability=f"{props.major}.{props.minor}")
    if "crossover" in entry:
        info.update(crossover=crossover_for(props.name), crossover_fwd=crossover_for(props.name, False),
                    crossover_fwdbwd=crossover_for(props.name, True))
        info["note"] = f"crossovers measured on this GPU ({entry.get('crossover_workload', 'see tuning.json')})"
    else:
        info["note"] = (f"no crossover stored for {props.name!r} in tuning.json: cron_root_hybrid uses the default "
                        f"{crossover_for(None)} (the original's threshold, not a measurement)")
    return info
