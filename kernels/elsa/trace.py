"""Launch trace for ELSA: records every phase-1 / phase-2 / backward launch while a trace is active.

    from kernels.elsa.trace import trace_launches
    with trace_launches() as events:
        elsa_attention(q, k, v)
    # events: one dict per kernel launch, in launch order

Each event is recorded by the host code at the launch site, with the grid actually passed to the
kernel and the global-memory summary buffers actually passed to it (shape, device, dtype, address),
so `attnbench verify-2pass` can check the structure of a real call: phase 1 writes per-partition
summaries to global memory, and a separate phase-2 launch, whose arguments are those buffers and
not Q/K/V, reduces them. Outside a trace, recording costs one list check per launch.
"""
from __future__ import annotations

import contextlib

_recorders: list[list[dict]] = []
_timing = [0]


@contextlib.contextmanager
def trace_launches(timing: bool = False):
    """Context manager yielding the list that launch events are appended to.

    timing=True (CUDA only) brackets every launch with CUDA events; after the block each event
    carries "ms", the GPU time of that launch (the block synchronises the device on exit).
    """
    events: list[dict] = []
    _recorders.append(events)
    _timing[0] += bool(timing)
    try:
        yield events
    finally:
        _recorders.remove(events)
        _timing[0] -= bool(timing)
        if timing and any("_start" in e for e in events):
            import torch

            torch.cuda.synchronize()
            for e in events:
                start, end = e.pop("_start", None), e.pop("_end", None)
                if start is not None and end is not None:
                    e["ms"] = start.elapsed_time(end)


def active() -> bool:
    return bool(_recorders)


def start_event(device):
    """A recorded CUDA event before a launch when some trace wants timings, else None."""
    if not _timing[0] or device.type != "cuda":
        return None
    import torch

    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def record(start=None, **event) -> None:
    if start is not None:
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record()
        event["_start"], event["_end"] = start, end
    for events in _recorders:
        events.append(dict(event))


def kernel_arg_names(kernel) -> tuple[str, ...]:
    """Argument names of a @triton.jit kernel (what it can read), for the trace."""
    names = getattr(kernel, "arg_names", None)
    if names is None:
        fn = getattr(kernel, "fn", None)
        code = getattr(fn, "__code__", None)
        names = code.co_varnames[:code.co_argcount] if code is not None else ()
    return tuple(names)
