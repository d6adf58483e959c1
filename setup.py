"""Packages are found here, not listed: every folder with an __init__.py under each root, named
by its import name (core/ is `nimble`). pyproject.toml holds everything else.

An editable install (`pip install -e .`) maps `nimble` to core/ through a finder that setuptools
appends to `sys.meta_path`, after the path finder; so Python started in a folder holding a clone
named `nimble` took that folder for a namespace package and `nimble.Nimble` did not exist. Here the
finder goes first: an installed nimble is the one imported, from any folder."""

from pathlib import Path

from setuptools import setup
from setuptools.command import editable_wheel

ROOTS = {"nimble": "core", "nimble.formats": "formats", "nimble.cli": "nimble_cli"}


def packages() -> list[str]:
    here = Path(__file__).resolve().parent
    found = []
    for name, folder in ROOTS.items():
        for init in sorted((here / folder).rglob("__init__.py")):
            found.append(".".join((name, *init.parent.relative_to(here / folder).parts)))
    return found


def _finder_first(template):
    def finder(*args, **kwargs):
        return template(*args, **kwargs).replace("sys.meta_path.append(_EditableFinder)",
                                                 "sys.meta_path.insert(0, _EditableFinder)")
    return finder


if hasattr(editable_wheel, "_finder_template"):  # setuptools >= 64; elsewhere its own finder, unchanged
    editable_wheel._finder_template = _finder_first(editable_wheel._finder_template)

setup(packages=packages(), package_dir=ROOTS)
