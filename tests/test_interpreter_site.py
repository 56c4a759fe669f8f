"""tests/interpreter_site: the Triton interpreter's speed-ups are in effect in the tests' process and in the processes
they start, where a script sets TRITON_INTERPRET itself too (its own jit functions stay interpreted). A Triton whose
interpreter is built differently would leave them off without a word, and the CPU suite would take about twice as long:
these fail then."""
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cpu_only

STATE = ("from triton.runtime import interpreter; print(interpreter._patch_lang.__name__, "
         "interpreter._get_np_dtype.__name__, interpreter.tl.core.block_type.__init__.__name__, "
         "interpreter.interpreter_builder.options.sanitize_overflow)")


def test_in_the_tests_process():
    from triton.runtime import interpreter

    assert interpreter._patch_lang.__name__ == "swap_once"
    assert interpreter._get_np_dtype.__name__ == "np_dtype"
    assert interpreter.tl.core.block_type.__init__.__name__ == "init_once_a_shape"
    assert interpreter.interpreter_builder.options.sanitize_overflow is False


def test_in_a_script_that_sets_triton_interpret_itself():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import os; os.environ['TRITON_INTERPRET'] = '1'; import torch; import kernels._flash_core as core; "
            f"{STATE}; print(type(core.init_state).__name__, type(core.tl.zeros).__name__)")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = ["swap_once", "np_dtype", "init_once_a_shape", "False", "InterpretedFunction", "InterpretedFunction"]
    assert proc.stdout.split() == want, proc.stdout


def test_block_types_kept_per_shape_are_the_ones_triton_builds():
    """A block type built from the kept fields has the fields Triton's own constructor gives it, for plain, pointer
    and constexpr-wrapped shapes; a shape Triton refuses is still refused."""
    from triton.language import core

    own = core.block_type.__init__.triton_init
    for element in (core.float16, core.int32, core.pointer_type(core.float32)):
        for shape in ([16], [4, 32], [core.constexpr(8), core.constexpr(64)]):
            core.block_type(element, shape)                 # kept now, if no earlier test built it
            kept, built = core.block_type(element, shape), object.__new__(core.block_type)
            own(built, element, shape)
            assert kept.element_ty is element and kept == built
            assert (kept.shape, kept.numel, kept.name) == (built.shape, built.numel, built.name)
            assert kept.numel == math.prod(int(getattr(s, "value", s)) for s in shape)
    with pytest.raises(ValueError, match="power of 2"):
        core.block_type(core.float32, [3])
    with pytest.raises(TypeError, match="0d block_type"):
        core.block_type(core.float32, [])
