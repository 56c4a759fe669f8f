"""The command line of the tools in scripts/: their parser (Parser: a usage error is one line, exit 2) and value types,
so a bad value is refused before any work starts, not met as a traceback once the measuring is done (an output path
under a file, a negative count, "abc" for a list of head dims)."""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from kernels._common import HEAD_DIMS

EXIT_NO_GPU = 3     # a tool that needs a GPU, run on a machine without one: the CLI's exit code for the same


class Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line ("error: argument --dims: ..."), exit 2, as the CLI's;
    --help still prints the whole usage."""

    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _number(kind, text: str, positive: bool):
    noun = "integer" if kind is int else "number"
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an' if kind is int else 'a'} {noun}") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise argparse.ArgumentTypeError(f"{text!r}: need a {'positive' if positive else 'non-negative'} {noun}")
    return value


def positive_int(text: str) -> int:
    return _number(int, text, True)


def non_negative_int(text: str) -> int:
    return _number(int, text, False)


def positive_float(text: str) -> float:
    return _number(float, text, True)


def non_negative_float(text: str) -> float:
    return _number(float, text, False)


def int_list(text: str) -> tuple[int, ...]:
    """A comma list of positive integers, at least one ("64,128")."""
    items = [x for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: need a comma list of positive integers")
    try:
        return tuple(positive_int(x.strip()) for x in items)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: need a comma list of positive integers") from None


def head_dims(text: str) -> tuple[int, ...]:
    """A comma list of head dims the kernels take (kernels._common.HEAD_DIMS: multiples of 8 from 16 to 256)."""
    dims = int_list(text)
    if not set(dims) <= set(HEAD_DIMS):
        raise argparse.ArgumentTypeError(f"{text}: head dims are multiples of 8 from {HEAD_DIMS[0]} to {HEAD_DIMS[-1]}")
    return dims


def head_dim(text: str) -> int:
    """One head dim the kernels take."""
    dims = head_dims(text)
    if len(dims) != 1:
        raise argparse.ArgumentTypeError(f"{text}: need one head dim")
    return dims[0]


def name_list(text: str) -> tuple[str, ...]:
    """A comma list of names, at least one (which names are allowed is the tool's to check)."""
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: need a comma list of at least one name")
    return items


def _creatable_dir(path: Path) -> str | None:
    """Why a folder cannot be made at path (None: it exists as one, or can be made)."""
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                return f"{part} is a file, not a folder"
            if not os.access(part, os.W_OK | os.X_OK):
                return f"{part} is not writable"
            return None
    return None


def output_file(text: str) -> Path:
    """A file to write: not a folder, in a folder that exists."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: a folder, not a file")
    problem = _creatable_dir(path.parent)
    if problem or not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: cannot be written ({problem or f'no folder {path.parent}'})")
    return path


def output_dir(text: str) -> Path:
    """A folder to write into: one that exists or can be made."""
    path = Path(text)
    problem = _creatable_dir(path)
    if problem:
        raise argparse.ArgumentTypeError(f"{text}: cannot be written ({problem})")
    return path
