"""A fake NVML reader with scripted states, so the clean-GPU check and the noise verdicts are testable on a CPU."""
from __future__ import annotations

import os

GB = 1024 ** 3


def gpu_state(util=0.0, free_gb=79.0, total_gb=80.0, pids=(), reasons=0x1, clock=1980, max_clock=1980,
              name="NVIDIA H100 80GB HBM3", uuid="GPU-00000000-fake-0000-0000-000000000000"):
    return {"name": name, "uuid": uuid, "util_pct": float(util), "mem_used": (total_gb - free_gb) * GB,
            "mem_free": free_gb * GB, "mem_total": total_gb * GB, "temp_c": 33, "sm_clock_mhz": clock,
            "sm_clock_max_mhz": max_clock, "power_mw": 72000, "power_limit_mw": 700000,
            "clock_event_mask": reasons, "processes": [(p, 500 * 2**20) for p in pids]}


class FakeReader:
    """`states[i]` is a list of dicts for GPU i; each read() advances, staying on the last one."""

    def __init__(self, states: list[list[dict]]):
        self.states = states
        self.calls = [0] * len(states)

    def device_count(self):
        return len(self.states)

    def read(self, index):
        seq = self.states[index]
        state = seq[min(self.calls[index], len(seq) - 1)]
        self.calls[index] += 1
        return dict(state)


OWN_PID = os.getpid()
