"""Packages are found here, not listed: every folder with an __init__.py under each root, named
by its import name (core/ is `nimble`). pyproject.toml holds everything else."""

from pathlib import Path

from setuptools import setup

ROOTS = {"nimble": "core", "nimble.formats": "formats", "nimble.cli": "nimble_cli"}


def packages() -> list[str]:
    here = Path(__file__).resolve().parent
    found = []
    for name, folder in ROOTS.items():
        for init in sorted((here / folder).rglob("__init__.py")):
            found.append(".".join((name, *init.parent.relative_to(here / folder).parts)))
    return found


setup(packages=packages(), package_dir=ROOTS)
