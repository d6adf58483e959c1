"""Reading a torch.export archive (`.pt2`, saved with `torch.export.save`) into an ExportedProgram,
on the CPU, with one-line errors.

torch's archive reader can run code that a crafted archive carries (pickled constants, size
expressions it evaluates). `load_program` first checks the archive's members
(`archive.check_archive`), then lets torch read it with its unrestricted unpicklers unreachable
(`archive.unpicklers_blocked`). A program whose outputs are a library's dataclass loads once that
library registered it: nimble imports the module that defines it, for a short list of libraries.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import typing
import zipfile
from pathlib import Path

import torch

from ..errors import ModelError, first_line
from .archive import check_archive, unpicklers_blocked

HINT = "save it with torch.export.save(torch.export.export(model, example_inputs), path)"


def is_program(path: str | os.PathLike, names: frozenset[str] | None = None) -> bool:
    """A zip that holds an exported program (the PT2 archive of torch.export.save). `names`: its
    members, where `check_model_file` read them already."""
    if names is None:
        try:
            with zipfile.ZipFile(path) as z:
                names = frozenset(z.namelist())
        except (OSError, zipfile.BadZipFile):
            return False
    return any(n.endswith("archive_format") or n.endswith("serialized_exported_program.json") for n in names)


@contextlib.contextmanager
def _cached_type_hints():
    """torch's archive reader asks typing.get_type_hints about the same few schema dataclasses once
    per serialized object: 11,000 times and 1.1 s of a 2.5 s load for vit_b_32. While it reads,
    each answer is computed once (and handed out as a copy)."""
    original, cache = typing.get_type_hints, {}

    def cached(obj, globalns=None, localns=None, include_extras=False):
        key = (obj, id(globalns), id(localns), include_extras)
        try:
            hints = cache.get(key)
        except TypeError:  # an unhashable object
            return original(obj, globalns, localns, include_extras)
        if hints is None:
            hints = cache[key] = original(obj, globalns, localns, include_extras)
        return dict(hints)

    typing.get_type_hints = cached
    try:
        yield
    finally:
        typing.get_type_hints = original


def load_program(path: str | os.PathLike) -> torch.export.ExportedProgram:
    """Load a `.pt2` archive on the CPU; one-line ModelError on any defect. A program whose outputs
    are a library's dataclass (a Hugging Face ModelOutput) loads once that library registered the
    class with torch's pytree: nimble imports it, for the libraries in OUTPUT_LIBRARIES only."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: {'not a file' if path.exists() else 'no such file'}; pass a program saved "
                         "with torch.export.save")
    if not is_program(path):
        raise ModelError(f"{path} is not a torch.export archive; {HINT}")
    check_archive(path)
    for attempt in range(2):
        try:
            with unpicklers_blocked(), _cached_type_hints(), _logged_errors() as logged:
                return torch.export.load(str(path))
        except Exception as e:  # a refused pickle, a malformed graph, an unknown op...
            cause = logged[-1] if logged else e  # torch logs the real error and raises a generic one
            if isinstance(cause, ModelError):  # an unpickler that was asked for
                raise ModelError(f"{path}: {cause}") from e
            if "Weights only load failed" in str(cause):
                raise ModelError(f"{path} holds a pickle with objects other than tensors; nimble refuses it, "
                                 f"since unpickling it could run code. {HINT}") from e
            unknown = _UNREGISTERED.search(str(cause))
            if unknown is None or attempt:
                raise ModelError(f"{path} could not be loaded as an exported program ({first_line(cause)}); "
                                 f"{HINT}") from e
            _import_output_library(path, unknown.group(1))


OUTPUT_LIBRARIES = ("transformers", "torchvision", "timm", "diffusers")  # imported to load their output types
# The modules of those libraries that define output types: importing one defines model classes
# and registers them, and runs nothing else (a library's command-line or hub modules are refused).
_OUTPUT_MODULES = re.compile(r"transformers\.modeling_outputs|transformers\.models\.\w+\.modeling_\w+"
                             r"|torchvision\.models(\.\w+)*|timm\.models(\.\w+)*|diffusers\.models(\.\w+)*"
                             r"|diffusers\.pipelines\.\w+\.pipeline_output")
_UNREGISTERED = re.compile(r"Deserializing ([\w.]+) in pytree is not registered")


def _import_output_library(path: Path, type_name: str) -> None:
    module = type_name.rpartition(".")[0]
    library = module.split(".")[0]
    if library not in OUTPUT_LIBRARIES:
        raise ModelError(f"{path} returns a {type_name}, a type torch cannot read back until its library "
                         f"registers it, and nimble imports only {', '.join(OUTPUT_LIBRARIES)}; export the "
                         "model returning tensors, or tuples, lists or dicts of them")
    if module != library and not _OUTPUT_MODULES.fullmatch(module):
        raise ModelError(f"{path} returns a {type_name}; nimble imports only the modules of {library} that define "
                         f"models and their outputs, not {module}; export the model returning tensors")
    try:
        importlib.import_module(module)
    except Exception as e:
        raise ModelError(f"{path} returns a {type_name}, and {module} could not be imported to read it "
                         f"({first_line(e)}); install {library}") from None


@contextlib.contextmanager
def _logged_errors():
    """The exceptions torch.export logs while it loads (with their tracebacks, on stderr), kept
    for the one-line error instead."""
    logger, caught = logging.getLogger("torch.export"), []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.exc_info and record.exc_info[1] is not None:
                caught.append(record.exc_info[1])

    handlers, propagate = logger.handlers, logger.propagate  # torch's own handler prints them
    logger.handlers, logger.propagate = [Keep()], False
    try:
        yield caught
    finally:
        logger.handlers, logger.propagate = handlers, propagate
