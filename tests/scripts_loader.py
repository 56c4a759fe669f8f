"""The scripts under scripts/ as modules, for their tests: they are files to run, not an importable package."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """scripts/<name>.py, executed as the module ``<name>_script``."""
    spec = importlib.util.spec_from_file_location(f"{name}_script", SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod       # dataclasses look their module up while the file runs
    spec.loader.exec_module(mod)
    return mod


def exit_code(module, argv: list[str]) -> int:
    """What `python scripts/<name>.py ARGV` exits with (`sys.exit(main())`), from module.main(argv) run in this
    process; an exception escapes, as the traceback a user would see."""
    try:
        return module.main(argv) or 0
    except SystemExit as exit_:
        return exit_.code
