"""Refuse, before any rank starts, a program that would start its ranks twice.

Tensor-parallel ranks are ``spawn``ed processes (a fork would inherit the
engine's threads and CUDA state). A spawned process imports the program's
main file again, as ``__mp_main__``, before it runs its rank: whatever the
file does at its top level runs again there. A script that creates
``LLM(..., tensor_parallel_size=2)`` at its top level, without an
``if __name__ == "__main__":`` guard, would start the engine again in each
rank, where multiprocessing refuses it ("bootstrapping phase"); the ranks die
and the first process only learned it at the end of the rendezvous timeout.
:func:`check_main_guard` sees it at once from the call stack and the file's
syntax tree.
"""

from __future__ import annotations

import ast
import sys
from types import FrameType


class MainGuardMissing(ValueError):
    """The engine is created by top-level code of a main file that has no guard."""


def _is_main_test(node: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either side)."""
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1):
        return False
    if not isinstance(node.ops[0], ast.Eq):
        return False
    sides = [node.left, node.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    mains = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(mains) == 1


def line_is_guarded(source: str, line: int) -> bool:
    """Whether ``line`` of a module's ``source`` does not run when the module is
    imported: it lies in the body of an ``if __name__ == "__main__":`` block, or
    inside a function (which runs only when called)."""

    def walk(node: ast.AST) -> bool:
        for child in ast.iter_child_nodes(node):
            start = getattr(child, "lineno", None)
            if start is None or not start <= line <= (getattr(child, "end_lineno", None) or start):
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                return True
            if (
                isinstance(child, ast.If)
                and _is_main_test(child.test)
                and any(b.lineno <= line <= (b.end_lineno or b.lineno) for b in child.body)
            ):
                return True
            return walk(child)
        return False

    return walk(ast.parse(source))


def _main_module_frame(frame: FrameType | None) -> FrameType | None:
    """The frame running the main file's top-level code, if the call comes from it."""
    main = sys.modules.get("__main__")
    while frame is not None:
        if (
            frame.f_code.co_name == "<module>"
            and main is not None
            and (frame.f_globals is vars(main))
        ):
            return frame
        frame = frame.f_back
    return None


def check_main_guard(what: str = "tensor_parallel_size > 1") -> None:
    """Raise :class:`MainGuardMissing` when the caller's main file creates the engine
    at its top level without an ``if __name__ == "__main__":`` guard (spawned ranks
    would run that code again). Interactive sessions, ``python -c`` and files whose
    source cannot be read pass: spawn does not re-run them, or nothing can be told."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return
    frame = _main_module_frame(sys._getframe(1))
    if frame is None:
        return
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        guarded = line_is_guarded(source, frame.f_lineno)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return
    if guarded:
        return
    raise MainGuardMissing(
        f"{path}, line {frame.f_lineno}: the engine is created at the file's top level, and "
        f"with {what} its ranks are new processes that import this file again (Python's "
        "'spawn'), so they would run this line again. Put the code that creates the engine "
        'under `if __name__ == "__main__":` (e.g. in a main() function called from there); '
        "see docs/parallelism.md"
    )
