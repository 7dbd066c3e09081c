"""A script that creates a tensor-parallel engine at its top level, without an
`if __name__ == "__main__":` guard, is refused at once with what to add (its
spawned ranks would import it again and start the engine again)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pdfleet.engine.worker.main_guard import line_is_guarded

SCRIPT = """\
import os
from pdfleet.engine.worker.main_guard import check_main_guard


def main():
    check_main_guard()  # line 6: in a function


class Setup:
    check_main_guard()  # line 10: a class body runs at import


if __name__ == "__main__":
    main()  # line 14
    check_main_guard()  # line 15
else:
    check_main_guard()  # line 17: the else branch runs on import
check_main_guard()  # line 18
if "__main__" == __name__:
    check_main_guard()  # line 20
"""


@pytest.mark.parametrize(
    ("line", "guarded"),
    [(6, True), (10, False), (14, True), (15, True), (17, False), (18, False), (20, True)],
)
def test_lines_under_the_guard_or_in_a_function_are_guarded(line, guarded):
    assert line_is_guarded(SCRIPT, line) is guarded


def run(tmp_path, body: str, timeout: float = 120) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, "-P", str(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        # Were the guard not checked, the first process would wait this long.
        env={**__import__("os").environ, "PDFLEET_TP_RENDEZVOUS_TIMEOUT": "600"},
    )


def test_an_unguarded_tensor_parallel_script_is_refused_at_once_saying_what_to_add(
    tmp_path, tiny_model
):
    out = run(
        tmp_path,
        f"""
        from pdfleet.engine import LLM

        llm = LLM({tiny_model!r}, tensor_parallel_size=2, max_model_len=128)
        """,
    )
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("pdfleet.engine.worker.main_guard.MainGuardMissing:")
    assert "script.py, line 4" in last and "tensor_parallel_size=2" in last
    assert 'if __name__ == "__main__":' in last
    assert "bootstrapping phase" not in out.stderr  # no rank was started


def test_a_guarded_script_passes_the_check(tmp_path):
    out = run(
        tmp_path,
        """
        from pdfleet.engine.worker.main_guard import check_main_guard

        if __name__ == "__main__":
            check_main_guard()
            print("ok")
        """,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    unguarded = run(
        tmp_path,
        "from pdfleet.engine.worker.main_guard import check_main_guard\ncheck_main_guard()\n",
    )
    assert "MainGuardMissing" in unguarded.stderr
