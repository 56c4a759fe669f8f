"""A Workload is what the measurement loop times: a prepared, zero-argument call plus its bookkeeping.

Builders (attention points in ``attnbench.backends``, whole models in ``attnbench.models``) allocate
inputs once and return a Workload; ``attnbench.measure`` only ever sees these, so timing, L2 flushing
and memory accounting are the same for every backend and every kind of cell.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Workload:
    run: Callable[[], object]                    # the timed call (fwd, bwd, fwd+bwd, a model step…)
    prepare: Callable[[], None] | None = None    # untimed work before every timed call (e.g. the forward that bwd needs)
    flops: float | None = None                   # useful FLOPs of one run, for TFLOP/s (None: not meaningful)
    input_bytes: int = 0                         # bytes the inputs hold (a record: the peak is measured above
                                                 # all memory resident before the call, measure.peak_memory_mb)
    release: Callable[[], None] | None = None    # drop references so memory can be freed after the point
    info: dict = field(default_factory=dict)     # anything worth recording (e.g. the SDPA backend actually forced)
