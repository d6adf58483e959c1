"""What kind of file a command was handed, told before any loader reads it, and before torch is
imported (which takes seconds): for `compile`, a TorchScript archive or a torch.export program goes
on, and a nimble artifact, an ONNX model, a missing path or a folder gets one line that says what
to pass instead; for the other commands, the artifact must be a file."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

from .errors import ArtifactError, ModelError, UnsupportedError

SAVE_HINT = ("save the model with torch.export.save(torch.export.export(model, example_inputs), 'model.pt2') "
             "(or, deprecated, torch.jit.save(torch.jit.trace(model, example_inputs), 'model.pt'))")
_ARTIFACT = {"manifest.json", "graph.json", "schedule.json"}  # members every .nimble artifact has


def check_model_file(path: str | os.PathLike) -> frozenset[str] | None:
    """Refuse, in one line, a path that is no model nimble reads. Returns the names of its
    members where it is a zip (the loaders need not read its directory again), else None."""
    path = Path(path)
    if not path.exists():
        raise ModelError(f"{path}: no such file; pass a model saved with torch.export.save (.pt2) or torch.jit.save "
                         "(.pt)")
    if not path.is_file():
        raise ModelError(f"{path} is not a file; pass a model saved with torch.export.save (.pt2) or torch.jit.save "
                         "(.pt)")
    if path.suffix.lower() == ".onnx":
        raise UnsupportedError(f"{path} is an ONNX model; nimble compiles PyTorch models: {SAVE_HINT}")
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as z:
                names = set(z.namelist())
        except (zipfile.BadZipFile, OSError, ValueError) as e:  # an end record with a broken directory
            raise ModelError(f"{path} is a damaged zip archive ({e}); {SAVE_HINT}") from None
        if _ARTIFACT <= names:
            raise ModelError(f"{path} is a nimble artifact, compiled already: run it with nimble run or nimble "
                             "bench, or look inside with nimble inspect; compile takes the model itself")
        return frozenset(names)
    return None


MAX_REPOSITORY = 256  # artifacts one folder may hold for `nimble serve`


def repository(paths: list[Path]) -> list[Path]:
    """`nimble serve`'s artifacts: each path as given, or, for a folder (a model repository), the
    `.nimble` files directly inside it in name order (no subfolders, no other files). A folder
    with none, or with more than MAX_REPOSITORY, is refused in one line."""
    found: list[Path] = []
    for path in map(Path, paths):
        if not path.is_dir():
            found.append(path)
            continue
        inside = sorted(p for p in path.iterdir() if p.name.endswith(".nimble") and p.is_file())
        if not inside:
            raise ArtifactError(f"{path} is a folder with no .nimble artifacts in it; put the artifacts nimble compile "
                                "wrote there, or pass them one by one")
        if len(inside) > MAX_REPOSITORY:
            raise ArtifactError(f"{path} holds {len(inside)} artifacts, over the {MAX_REPOSITORY} one server takes; "
                                "split them over several servers")
        found += inside
    return found


def check_artifact_file(path: str | os.PathLike) -> None:
    """Refuse a missing artifact or a folder, in one line."""
    path = Path(path)
    if path.is_dir():
        raise ArtifactError(f"{path} is a folder; pass a .nimble artifact written by nimble compile")
    if not path.is_file():
        raise ArtifactError(f"{path}: no such file; pass a .nimble artifact written by nimble compile")
