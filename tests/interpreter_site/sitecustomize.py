"""Four speed-ups of the Triton CPU interpreter for the tests, where its kernel runs are most of the suite's time.
None changes what a kernel computes. tests/conftest.py applies them to the tests' own process and, on a machine
without CUDA, puts this folder first on the PYTHONPATH of the processes they start (the scripts and the CLI), where
Python runs this file at start-up. Where a Triton's interpreter is built differently, it is left as it is.

- **The language is swapped once a launch.** The interpreter swaps triton.language's builtins for interpreted ones
  when a launch begins (and puts them back when it ends), and repeats the swap at every call of a jit helper inside
  the launch, where it finds the builtins swapped already and sets the same closures again. Our kernels call helpers
  in their inner loops, so that repeat was about a third of a CPU kernel test's time. Here a helper's call skips it
  when every language module the helper sees (triton.language, triton.language.core) is swapped already in this
  launch. (The interpreter never puts back a helper's own swap, so a module it swapped stays swapped to the launch's
  end, and beyond, with or without this.)
- **Each numpy dtype looked up once.** The interpreter maps a Triton dtype to its numpy one by building a table of
  twenty entries at every call (a splat, a cast, a load: about a twentieth of a kernel test). The map is fixed, so
  its answer per element type is kept.
- **Each block type's fields worked out once.** Every interpreted operation makes the block types of its results,
  and each construction unwraps the shape, checks its powers of two and formats the type's name (about a fifth of an
  ELSA kernel test). A block type's fields are fixed by its element type and shape, so they are kept per pair and
  shared by the types built from it (nothing changes a block type's fields once built); the first construction of
  a pair runs Triton's own code, and so does any pair that cannot be a key and any subclass (Gluon's).
- **No int32 overflow checks.** The interpreter checks every 32-bit integer add, subtract and multiply for overflow
  (about a quarter of the rest). A GPU build makes no such check outside debug mode, and at the sizes a CPU test
  runs (N <= 256) no index comes near 2**31: the kernels' offsets that can are 64-bit, and the GPU tests run those
  at sizes where they matter.
"""
import dataclasses
import importlib.abc
import importlib.machinery
import sys


def _swap_the_language_once_a_launch(interpreter) -> None:
    swap, empty_scope = interpreter._patch_lang, interpreter._LangPatchScope
    languages = (interpreter.tl, interpreter.tl.core)
    swapped = set()         # ids of the language modules swapped in the running launch (empty between launches)
    sees = {}               # jit function -> ids of the language modules among its globals

    def seen(fn):
        if fn not in sees:
            sees[fn] = {id(v) for v in fn.__globals__.values() if any(v is lang for lang in languages)}
        return sees[fn]

    def swap_once(fn):
        if swapped and seen(fn) <= swapped:
            return empty_scope()
        launch_begins = not swapped
        scope = swap(fn)
        swapped.update(seen(fn))
        if launch_begins:
            restore = scope.restore

            def restore_and_end():
                swapped.clear()
                restore()
            scope.restore = restore_and_end
        return scope

    interpreter._patch_lang = swap_once


def _each_numpy_dtype_looked_up_once(interpreter) -> None:
    lookup = interpreter._get_np_dtype
    known = {}

    def np_dtype(tt_dtype):
        # a block's numpy dtype is its element type's; a pointer's (uint64) is found before the table is built
        key = tt_dtype.element_ty if tt_dtype.is_block() else tt_dtype
        if key.is_ptr():
            return lookup(key)
        found = known.get(key)
        if found is None:
            found = known[key] = lookup(key)
        return found

    interpreter._get_np_dtype = np_dtype


def _block_types_built_once(interpreter) -> None:
    block_type = sys.modules.get("triton.language.core").block_type
    build = block_type.__init__
    known = {}          # (element type's name, shape) -> the fields the constructor set from them, all of them

    def init(self, element_ty, shape):
        try:        # a subclass's own fields are not this constructor's (Gluon's distributed_type): Triton's
            key = (element_ty.name, tuple(shape)) if type(self) is block_type else None
            fields = known.get(key)
        except (TypeError, AttributeError):         # a pair that cannot be a key
            key = fields = None
        if fields is None:                          # Triton's own constructor (and its errors)
            build(self, element_ty, shape)
            if key is not None:
                known[key] = dict(vars(self))
            return
        self.__dict__.update(fields)
        self.element_ty = element_ty

    init.__name__, init.triton_init = "init_once_a_shape", build
    block_type.__init__ = init


def _no_overflow_checks(interpreter) -> None:
    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


def speed_up(interpreter) -> None:
    """The speed-ups on the module triton.runtime.interpreter, each where this Triton has what it changes; once (a
    pytest-xdist worker starts with this file run at start-up, then its conftest.py runs it again)."""
    if getattr(interpreter, "_sped_up_for_the_tests", False):
        return
    interpreter._sped_up_for_the_tests = True
    for one in (_swap_the_language_once_a_launch, _each_numpy_dtype_looked_up_once, _block_types_built_once,
                _no_overflow_checks):
        try:
            one(interpreter)
        except (AttributeError, TypeError):
            pass


class _OnImport(importlib.abc.MetaPathFinder):
    """Speeds the interpreter up as its module is imported, not before: importing triton here would make its own jit
    functions compiled ones in a process that sets TRITON_INTERPRET after start-up (scripts/tune.py --device cpu)."""

    def find_spec(self, name, path, target=None):
        if name != INTERPRETER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and hasattr(spec.loader, "exec_module"):
            exec_module = spec.loader.exec_module

            def exec_and_speed_up(module):
                exec_module(module)
                speed_up(module)
            spec.loader.exec_module = exec_and_speed_up
        return spec


INTERPRETER = "triton.runtime.interpreter"
if INTERPRETER in sys.modules:
    speed_up(sys.modules[INTERPRETER])
elif not any(type(finder).__name__ == "_OnImport" for finder in sys.meta_path):
    sys.meta_path.insert(0, _OnImport())
