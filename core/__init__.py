"""nimble: ahead-of-time multi-stream scheduling, memory planning and packaging for static
PyTorch models.

The public API is imported lazily, so that `import nimble` (and `nimble --help`) does not pay
for importing torch.
"""

from importlib import import_module

__version__ = "0.1.0"

_API = {
    "Nimble": "api",
    "compile_model": "pipeline",
    "load": "runtime",
    "Executable": "runtime",
    "Group": "runtime",
    "Compiled": "pipeline",
    "input_specs": "specs",
    "NimbleError": "errors",
    "ModelError": "errors",
    "ShapeError": "errors",
    "UnsupportedError": "errors",
    "UsageError": "errors",
    "ArtifactError": "errors",
    "ExecutionError": "errors",
    "CaptureError": "errors",
    "MismatchError": "errors",
    "NimbleWarning": "errors",
    "TrainStep": "train",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        return getattr(import_module(f"{__name__}.{_API[name]}"), name)
    raise AttributeError(f"module 'nimble' has no attribute {name!r}")
