"""Maps the top-level folders onto the ``pdfleet.*`` namespace.

``engine/`` -> ``pdfleet.engine``, ``kernels/`` -> ``pdfleet.kernels``,
``operator/`` -> ``pdfleet.operator``. ``operator/`` never has an ``__init__.py``
(it would shadow the stdlib ``operator`` module when the repository root is on
``sys.path``), so packages are discovered from the folders that hold Python
files rather than from ``__init__.py`` markers.
"""

import os

from setuptools import setup

FOLDERS = {"engine": "pdfleet.engine", "kernels": "pdfleet.kernels", "operator": "pdfleet.operator"}


def discover() -> tuple[list[str], dict[str, str]]:
    packages: list[str] = []
    package_dir: dict[str, str] = {}
    for folder, name in FOLDERS.items():
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = sorted(
                d for d in dirnames if d != "__pycache__" and not d.startswith(".")
            )
            if not any(f.endswith(".py") for f in filenames):
                continue
            rel = os.path.relpath(dirpath, folder)
            pkg = name if rel == "." else name + "." + rel.replace(os.sep, ".")
            packages.append(pkg)
            package_dir[pkg] = dirpath
    return packages, package_dir


packages, package_dir = discover()
setup(packages=packages, package_dir=package_dir)
