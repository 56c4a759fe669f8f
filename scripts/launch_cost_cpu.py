"""Host cost of the fast launch path's key, and of a whole launch before the launcher, on the CPU (no GPU).

    PYTHONPATH=. python3 scripts/launch_cost_cpu.py

Uses the real Cron Root forward JITFunction (not interpreted: do not set TRITON_INTERPRET) with a fake driver
and a fake CompiledKernel whose launcher does nothing, so "JITFunction.run" and "kernels._launch.launch" are
the host work each does before the launch itself (binding, specialisation and cache lookup vs our key), on
the same argument list: the Cron Root forward's 24 positional arguments + 8 keywords, and ELSA phase 1's
33 + 13 (ELSA itself launches through kernels._launch.Prepared, which builds no key per call). The JIT comparison reaches into triton internals (device_caches, the binder): triton 3.9 only.
Best of 7 repeats; CPU tensors (data_ptr/dtype/get_device cost about what CUDA tensors' do).
"""
from __future__ import annotations

import timeit

import torch

import kernels._launch as L
import kernels.cron_root.attention as cra


def best(f, n=20000, r=7):
    return min(timeit.repeat(f, number=n, repeat=r)) / n * 1e6


class FakeCK:
    function, packed_metadata = 1, 2

    def run(self, *a):
        pass

    def launch_metadata(self, grid, stream, *args):
        return None


def main():
    from triton import knobs
    q, k, v, rk, rv, o = (torch.empty(1, 8, 1024, 64, dtype=torch.float16) for _ in range(6))
    lse = torch.empty(8, 1024)
    cr_args = (q, k, v, rk, rv, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
               8, 1024, 32, 0, 0.18033688011112042)
    cr_kw = dict(HEAD_DIM=64, BLOCK_D=64, PREC="tf32", BLOCK_M=64, BLOCK_N=64, BLOCK_S=64, num_warps=4, num_stages=3)
    sbuf = torch.empty(100 * 66)
    el_args = (q, k, v, q, sbuf, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], 0, 0, 0, 0,
               *o.stride()[:3], 3, 1, 197, 197, 0, 4, 24, 64, 1536, 0.1803)
    el_kw = dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_M=64, BLOCK_N=64, CAUSAL=False, HAS_BIAS=False, FOLD_Q=False,
                 SCALE_IN_EXP=True, DOT_PREC="tf32", FINAL=False, STORE_LSE=True, num_warps=4, num_stages=2)
    L._knobs = knobs
    for name, a, kw in (("cron_root fwd", cr_args, cr_kw), ("elsa phase1", el_args, el_kw)):
        print(f"{name} ({len(a)} positional + {len(kw)} keyword arguments):")
        print(f"  call_key                  {best(lambda: L.call_key(a, kw, 0, None)):.2f} us")
    print(f"_state_key (knob reads)     {best(lambda: L._state_key(None)):.2f} us")

    try:
        from triton.backends.compiler import GPUTarget
        from triton.runtime.driver import driver
        from triton.runtime.jit import compute_cache_key
    except ImportError as exc:
        print("JIT comparison skipped:", exc)
        return

    class FakeDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, d):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    fn, ck, grid = cra.tk._fwd, FakeCK(), (16, 8)
    driver.set_active(FakeDriver())      # for this process only (a script): never reset
    # the fake kernel goes into the JIT's own cache under the key the JIT computes for this call
    kernel_cache, key_cache, _, _, binder = fn.device_caches[0]
    kw = dict(cr_kw, debug=fn.debug or knobs.runtime.debug, instrumentation_mode=knobs.compilation.instrumentation_mode,
              fpsan_homomorphic_casts=knobs.compilation.fpsan_homomorphic_casts)
    _, spec, opts = binder(*cr_args, **kw)
    kernel_cache[compute_cache_key(key_cache, spec, opts)] = ck
    assert fn[grid](*cr_args, **cr_kw) is ck
    L._eligible, L._get_device, L._get_stream = (lambda f: True), (lambda: 0), (lambda d: 0)
    L.set_enabled(True)
    assert L.launch(fn, grid, cr_args, cr_kw) is ck and L.launch(fn, grid, cr_args, cr_kw) is ck
    print("cron_root fwd, all host work before a no-op launcher:")
    print(f"  JITFunction.run           {best(lambda: fn[grid](*cr_args, **cr_kw)):.2f} us")
    print(f"  kernels._launch.launch    {best(lambda: L.launch(fn, grid, cr_args, cr_kw)):.2f} us")


if __name__ == "__main__":
    main()
