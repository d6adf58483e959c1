"""`nimble run`: load an artifact, capture it, and run one inference."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Optional

import typer

from .common import (check_pack, describe_kernels, progress, DebugOption, DeviceOption, JsonOption, KernelsOption, MaxMemoryOption, TuneOption, console,
                     early_checks, literal, print_json, user_errors, writable)

RUN_SCHEMA_VERSION = 2  # 2: `wrote`


def run_command(
    artifact: Path = typer.Argument(..., metavar="ARTIFACT", help="A .nimble artifact written by nimble compile."),
    inputs: Optional[list[str]] = typer.Option(None, "--input", "-i", help="NAME=FILE.npy or NAME=FILE.safetensors "
                                               "(or just FILE for a one-input model). Repeat per input."),
    random: bool = typer.Option(False, "--random", help="Run on random inputs of the right shapes."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write the outputs here: a .safetensors file "
                                          "(every output, by name) or a .npy file (a model with one output)."),
    device: DeviceOption = "auto",
    check: bool = typer.Option(False, "--check", help="Run the artifact's stored sample input and compare with the "
                               "stored reference outputs; exit 3 on a mismatch."),
    rtol: Optional[float] = typer.Option(None, "--rtol", help="Relative tolerance for --check (default 1e-2 on "
                                         "CUDA, where convolutions run in TF32; 1e-4 on the CPU). For an fp16 or "
                                         "bf16 artifact, the relative L2 error each output may have against the "
                                         "float32 model (default: the one it was compiled with)."),
    atol: Optional[float] = typer.Option(None, "--atol", help="Absolute tolerance for --check (default 1e-3 on "
                                         "CUDA, 1e-5 on the CPU)."),
    tune: TuneOption = "cached",
    kernels: KernelsOption = None,
    max_memory: MaxMemoryOption = None,
    json_out: JsonOption = False,
    debug: DebugOption = False,
) -> None:
    """Run one inference, optionally checking it against the stored reference.

    With no --input or --random, it uses the artifact's stored sample input.

    Example: nimble run sample_models/inception.nimble --check
    """
    with user_errors(debug, json_out):
        from nimble.errors import UsageError
        from nimble.model_files import check_artifact_file

        budget = early_checks(device=device, tune=tune, max_memory=max_memory)
        check_pack(kernels)
        check_artifact_file(artifact)
        from nimble.runtime.base.compare import MismatchError, compare, default_tolerance, l2_tolerance
        from nimble.runtime.opening import load

        given = {"the artifact": artifact, **{f"--input {item}": item.partition("=")[2] or item for item in inputs or []}}
        writable(output, "--output", given)
        if output is not None and output.suffix.lower() not in (".safetensors", ".npy"):
            raise UsageError(f"--output {output}: nimble writes .safetensors (every output, by name) or .npy (a "
                             "model with one output); give the file one of those suffixes")
        for name, value in (("--rtol", rtol), ("--atol", atol)):
            if value is not None and not 0 <= value < math.inf:
                raise UsageError(f"{name} {value}: a tolerance is a finite number of at least 0")
        if check and (inputs or random):
            raise UsageError("--check runs the stored sample input; leave out --input and --random")
        if inputs and random:
            raise UsageError("give --input files or --random, not both")
        with progress(f"loading {artifact.name}"):
            t = time.perf_counter()
            exe = load(artifact, device, tune=tune, max_memory=budget, kernels=kernels)
        if exe.notice:
            console.print(f"[yellow]note:[/] {exe.notice}")
        g = exe.graph
        if inputs:
            xs = read_inputs(inputs, g)
        elif random:
            from nimble.pipeline import sample_inputs

            xs = sample_inputs([g.values[i].spec for i in g.inputs], seed=int(time.time()))
        else:
            xs = exe.artifact.sample_inputs
        outs = exe.run(*[x.to(exe.device) for x in xs])
        first = time.perf_counter() - t
        report = {"schema_version": RUN_SCHEMA_VERSION, "artifact": str(artifact), "device": str(exe.device),
                  "load_seconds": round(exe.stats.seconds["total"], 4), "first_inference_seconds": round(first, 4),
                  "outputs": [_describe(g.values[o].name, t) for o, t in zip(g.outputs, outs)], "check": None,
                  "kernels": None if exe.stats.prebuilt is None else exe.stats.prebuilt.document()}
        result = None
        if check:
            rt, at = default_tolerance(exe.device)
            result = compare(outs, exe.artifact.sample_outputs, rtol if rtol is not None else rt,
                             atol if atol is not None else at, l2_tolerance(exe.artifact, rtol))
            report["check"] = result.document()
            if result.passed and hasattr(exe, "check_rows"):  # every batch size, on rows that differ
                exe.check_rows(rtol, atol)
        report["wrote"] = None
        if output is not None and (result is None or result.passed):  # a failed check writes nothing
            report["wrote"] = _write_outputs(output, {g.values[o].name: t.cpu() for o, t in zip(g.outputs, outs)})
        if json_out and (result is None or result.passed):  # else the error's document carries it
            print_json(report)
        console.print(f"{literal(artifact.name)} on {exe.device}: loaded in {exe.stats.seconds['total']:.2f} s, "
                      f"first inference after {first:.2f} s")
        if describe_kernels(report["kernels"]):
            console.print(f"  {describe_kernels(report['kernels'])}")
        for o in report["outputs"]:
            console.print(f"  {literal(o['name'])}: {o['dtype']}{o['shape']} min {o['min']:.4g} max {o['max']:.4g} "
                          f"mean {o['mean']:.4g}")
        if output is not None and (result is None or result.passed):
            console.print(f"  wrote {literal(output)}")
        if result is not None:
            console.print(f"  check: {result.describe()}")
            if not result.passed:
                error = MismatchError(f"outputs differ from the stored reference beyond the tolerance; "
                                      f"--rtol {result.passing_rtol} would accept them"
                                      + (f" ({output} was not written)" if output is not None else ""))
                error.document = report  # what --json prints beside the error
                raise error


def _write_outputs(path: Path, named: dict) -> dict:
    """The outputs in `path`: safetensors by name, or one array in NumPy's .npy format."""
    import io

    import numpy as np

    from nimble.errors import UsageError
    from nimble.fileio import write_atomic
    from nimble.formats.tensors import save

    if path.suffix.lower() == ".npy":
        if len(named) != 1:
            raise UsageError(f"--output {path}: a .npy file holds one array and the model has {len(named)} outputs "
                             f"({', '.join(named)}); write a .safetensors file instead")
        (tensor,) = named.values()
        if str(tensor.dtype) == "torch.bfloat16":
            raise UsageError(f"--output {path}: NumPy has no bfloat16, the output's dtype; write a .safetensors file")
        buffer = io.BytesIO()
        np.save(buffer, tensor.numpy())
        write_atomic(path, buffer.getvalue())
        return {"path": str(path), "format": "npy", "tensors": list(named)}
    write_atomic(path, save(named))
    return {"path": str(path), "format": "safetensors", "tensors": list(named)}


def _describe(name: str, t) -> dict:
    f = (t.abs() if t.is_complex() else t).detach().float()  # complex outputs: their magnitudes
    return {"name": name, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
            "min": f.min().item() if f.numel() else 0.0, "max": f.max().item() if f.numel() else 0.0,
            "mean": f.mean().item() if f.numel() else 0.0}


def _read_tensor(item: str, path: Path, name: str):
    """One input tensor from a .npy or .safetensors file, its header checked before anything is
    allocated: a numeric dtype, and a shape the file's bytes really hold."""
    import numpy as np
    import torch

    from nimble.errors import ArtifactError, ModelError, UsageError
    from nimble.formats import tensors

    bad = f"--input {item}: {path}"
    if path.suffix == ".npy":
        try:
            with open(path, "rb") as f:
                version = np.lib.format.read_magic(f)
                if version not in ((1, 0), (2, 0)):
                    raise ValueError(f"unsupported .npy version {version}")
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, fortran, dtype = read(f)
                body = os.fstat(f.fileno()).st_size - f.tell()
        except Exception as e:  # numpy parses the header as Python literals: any failure means a bad file
            raise ModelError(f"{bad} is not a readable .npy file ({type(e).__name__}: {e})") from None
        if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in "biufc":
            raise ModelError(f"{bad} holds {dtype} values; nimble takes numbers and booleans")
        if math.prod(shape) * dtype.itemsize != body:
            raise ModelError(f"{bad} declares {list(shape)} {dtype} ({math.prod(shape) * dtype.itemsize} bytes) but "
                             f"holds {body} bytes of data")
        try:
            array = np.load(path, allow_pickle=False)
            return torch.from_numpy(np.ascontiguousarray(array))
        except (ValueError, OSError, TypeError) as e:
            raise ModelError(f"{bad} could not be read ({e})") from None
    if path.suffix == ".safetensors":
        import safetensors.torch

        data = path.read_bytes()
        try:
            found = tensors.read_header(data, str(path))  # dtypes known, byte ranges exact, header capped
            loaded = safetensors.torch.load(data)
        except ArtifactError as e:
            raise ModelError(f"--input {item}: {e}") from None
        except Exception as e:  # safetensors' own error for anything the header check let through
            raise ModelError(f"{bad} could not be read ({type(e).__name__}: {e})") from None
        if name not in found and len(found) != 1:
            raise ModelError(f"{bad} holds {', '.join(found) or 'no tensors'}, not '{name}'")
        return loaded.get(name, next(iter(loaded.values())))
    raise UsageError(f"--input {item}: use a .npy or .safetensors file")


def read_inputs(items: list[str], graph) -> list:
    """Tensors for each graph input from NAME=FILE arguments (.npy or .safetensors)."""
    from nimble.errors import ModelError, UsageError

    names = [graph.values[i].name for i in graph.inputs]
    given: dict[str, object] = {}
    for item in items:
        name, sep, file = item.partition("=")
        if not sep:
            if len(names) != 1:
                raise UsageError(f"--input {item}: this model has inputs {', '.join(names)}; write NAME=FILE")
            name, file = names[0], item
        if name not in names:
            raise UsageError(f"--input {item}: the model has no input '{name}' (inputs: {', '.join(names)})")
        if name in given:
            raise UsageError(f"--input {item}: input '{name}' is given twice; give each input once")
        path = Path(file)
        if not path.exists():
            raise ModelError(f"--input {item}: {path}: no such file")
        if not path.is_file():
            raise ModelError(f"--input {item}: {path} is not a regular file (a folder, FIFO or device); give a "
                             ".npy or .safetensors file")
        given[name] = _read_tensor(item, path, name)
    missing = [n for n in names if n not in given]
    if missing:
        raise UsageError(f"no --input for {', '.join(missing)}; give one per model input, or use --random")
    return [given[n] for n in names]
