"""Move pdfleet modules and rewrite every reference to them, reproducibly.

The moves are listed in ``MOVES`` (old dotted name -> new dotted name). For
each one whose old file still exists the file is moved with ``git mv``; then
every reference in the tree is rewritten: imports (relative ones inside the
packages are made absolute, renamed, and made relative again with
``tools/relative_imports.py``), dotted names in strings (``mock.patch``
targets, ``python -m`` lines, import-linter contracts) and file paths in docs
(``engine/llm_engine.py``). Re-running it is a no-op once done, and after a
merge it rewrites whatever the merged side still names the old way:

    .venv/bin/python -P tools/move_modules.py
    .venv/bin/ruff check --fix . && .venv/bin/ruff format .

A merge conflict inside a moved file is settled in the new file; then re-run.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import relative_imports

ROOT = relative_imports.ROOT

# The engine loop (one request's way from the API to the step and back) in one
# sub-package, beside core/ (the scheduler) and worker/ (the model runner).
MOVES = {
    "pdfleet.engine.async_engine": "pdfleet.engine.loop.async_engine",
    "pdfleet.engine.llm_engine": "pdfleet.engine.loop.llm_engine",
    "pdfleet.engine.engine_core": "pdfleet.engine.loop.engine_core",
    "pdfleet.engine.output_processor": "pdfleet.engine.loop.output_processor",
    "pdfleet.engine.detokenizer": "pdfleet.engine.loop.detokenizer",
}
NEW_PACKAGES = {
    "pdfleet.engine.loop": (
        '"""The engine loop: the asyncio front (``async_engine``), text in and\n'
        "``RequestOutput``s out (``llm_engine``), one step of schedule, run and\n"
        'update (``engine_core``), detokenization and stops (``output_processor``,\n``detokenizer``)."""\n'
    ),
}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".txt", ".cfg", ".ini", ".sh", ".json"}
SKIP_DIRS = ("tools/",)
_FROM_REL = re.compile(r"from\s+(\.+[\w.]*)")


def path_of(dotted: str) -> Path:
    """The file of a dotted pdfleet module (``pdfleet.engine.x`` -> ``engine/x.py``)."""
    return Path(*dotted.split(".")[1:]).with_suffix(".py")


def exists(dotted: str) -> bool:
    """Whether ``dotted`` names a module or package of the tree."""
    file = ROOT / path_of(dotted)
    return file.is_file() or (file.with_suffix("") / "__init__.py").is_file()


def resolve(package: list[str], level: int, module: str | None) -> str:
    base = package[: len(package) - (level - 1)]
    return ".".join(base + (module.split(".") if module else []))


def absolute_imports(path: Path, source: str, old_package: list[str] | None) -> str:
    """``source`` with its relative pdfleet imports written absolute. In a moved
    file (``old_package``: where it was) a relative import that names nothing
    from the new place is read from the old one: the file's own imports at the
    move, and what a merge brings in from the other side's old file after."""
    tree = ast.parse(source, filename=str(path))
    lines = source.splitlines(keepends=True)
    current = relative_imports.package_of(path.relative_to(ROOT))
    edits: list[tuple[int, int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            target = resolve(current, node.level, node.module)
            if old_package is not None and not exists(target):
                target = resolve(old_package, node.level, node.module)
            line = lines[node.lineno - 1]
            match = _FROM_REL.match(line, node.col_offset)
            if match is None:
                raise ValueError(f"{path}:{node.lineno}: cannot find the relative module")
            edits.append((node.lineno - 1, match.start(1), match.group(1), target))
    for index, start, old, new in sorted(edits, reverse=True):
        line = lines[index]
        lines[index] = line[:start] + new + line[start + len(old) :]
    return "".join(lines)


def rename_references(text: str) -> str:
    for old, new in MOVES.items():
        text = re.sub(rf"(?<![\w.]){re.escape(old)}(?!\w)", new, text)
        old_path, new_path = path_of(old).as_posix(), path_of(new).as_posix()
        text = re.sub(rf"(?<![\w/.]){re.escape(old_path)}(?!\w)", new_path, text)
    return text


def tracked_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [ROOT / line for line in out.splitlines() if line]


def main() -> int:
    for package, doc in NEW_PACKAGES.items():
        init = ROOT / path_of(package).with_suffix("") / "__init__.py"
        if not init.exists():
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text(doc)
            subprocess.run(["git", "add", str(init)], cwd=ROOT, check=True)
    for old, new in MOVES.items():
        src, dst = ROOT / path_of(old), ROOT / path_of(new)
        if src.exists() and not dst.exists():
            subprocess.run(["git", "mv", str(src), str(dst)], cwd=ROOT, check=True)
            print(f"moved {src.relative_to(ROOT)} -> {dst.relative_to(ROOT)}")
        elif src.exists():
            print(f"both {src.relative_to(ROOT)} and {dst.relative_to(ROOT)} exist: merge by hand")
            return 1
    old_packages = {path_of(new): old.split(".")[:-1] for old, new in MOVES.items()}
    changed = 0
    for path in tracked_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(SKIP_DIRS) or path.suffix not in TEXT_SUFFIXES or not path.is_file():
            continue
        text = path.read_text()
        new = text
        if path.suffix == ".py" and rel.split("/", 1)[0] in relative_imports.PACKAGES:
            new = absolute_imports(path, new, old_packages.get(path.relative_to(ROOT)))
        new = rename_references(new)
        if path.suffix == ".py" and rel.split("/", 1)[0] in relative_imports.PACKAGES:
            new, _bare = relative_imports.rewrite(path, new)
        if new != text:
            path.write_text(new)
            changed += 1
            print(f"rewrote {rel}")
    print(f"{changed} files rewritten; now: ruff check --fix . && ruff format .")
    return 0


if __name__ == "__main__":
    sys.exit(main())
