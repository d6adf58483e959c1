"""What a `.pt2` archive may hold before torch's reader opens it: data, never code.

torch's PT2 reader (`torch.export.load`) runs code a crafted archive carries in three ways:
- constants whose config names an `opaque_obj_*` path are read with plain `pickle.loads`, and
  `custom_obj_*` ones with `torch._C._pickle_load_obj` (the TorchScript unpickler), for every entry
  of `data/constants/*_constants_config.json`, used by the graph or not;
- weights and constants marked `use_pickle`, legacy `data/weights/<model>.pt` files and the sample
  inputs go through `torch.load`;
- every symbolic size's `expr_str` in `models/<model>.json` goes through `sympy.sympify`, which
  evaluates it as Python.

`check_archive` reads the zip's directory and its small JSON members only, and refuses, in one line
naming the member, anything but the kinds a program needs: the model JSON, its weight and
constant configs, raw tensor payloads, the sample inputs and the version files. Config entries must
be raw tensors (no pickle, no objects), sizes must be plain arithmetic over size symbols, and node
targets must be operators. `unpicklers_blocked` then keeps the unrestricted unpicklers unreachable
while torch reads the archive; `torch.load` itself is forced to its weights-only unpickler, which
builds tensors and plain containers only (that is how the sample inputs are read).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import zipfile
from pathlib import PurePosixPath

from ..errors import ModelError

MAX_MEMBERS = 100_000
MAX_JSON_BYTES = 256 * 2**20  # the model JSON of a large transformer is tens of MB
MAX_VERSION_BYTES = 4096
# Members relative to the archive's root folder: pattern -> what it is.
_MEMBERS = (
    (re.compile(r"archive_format|archive_version|byteorder|version|\.data/version|\.data/serialization_id"),
     "version"),
    (re.compile(r"models/[\w.-]+\.json"), "model"),
    (re.compile(r"data/weights/[\w.-]+_weights_config\.json"), "config"),
    (re.compile(r"data/constants/[\w.-]+_constants_config\.json"), "config"),
    (re.compile(r"data/weights/weight_\d+"), "payload"),
    (re.compile(r"data/constants/tensor_\d+"), "payload"),
    (re.compile(r"data/sample_inputs/[\w.-]+\.pt"), "sample inputs"),
    (re.compile(r"extra/[\w.-]+"), "extra"),  # read by torch as text only
)
_PAYLOAD_PREFIX = {"weights": "weight_", "constants": "tensor_"}
# A size expression as torch writes it (sympy's srepr: "Mul(Integer(4), Symbol('s77', positive=True,
# integer=True))", or plain "s0 + 1"): sympy names, size symbols, numbers and arithmetic. No
# attribute, subscript, dunder or other name can appear, so evaluating it builds a sympy expression only.
_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_]\w*)|'(?P<text>[A-Za-z_]\w*)'|(?P<number>\d+)|(?P<punct>[(),=+\-*/%]))")
_SYMBOL = re.compile(r"[a-z]\d+")
_SIZE_NAMES = frozenset({
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv", "CeilToInt", "FloorToInt",
    "CeilDiv", "LShift", "RShift", "PowByNatural", "IntTrueDiv", "TruncToInt", "Max", "Min", "Abs", "Identity",
    "Symbol", "Integer", "Rational", "Add", "Mul", "Pow", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not",
    "StrictLessThan", "LessThan", "StrictGreaterThan", "GreaterThan", "Equality", "Unequality", "True", "False",
    "positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite", "zero", "nonzero",
    "even", "odd", "rational", "commutative", "extended_real", "infinite",
})
_TARGET = re.compile(r"(torch\.ops\.\w+\.\w+(\.\w+)?|_operator\.\w+|math\.\w+)")


def check_archive(path: str | os.PathLike) -> None:
    """Raise ModelError naming the first member or entry of the `.pt2` at `path` that is not plain
    program data (see the module docstring)."""
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            if len(infos) > MAX_MEMBERS:
                raise ModelError(f"{path} has {len(infos)} members; a program has far fewer (at most {MAX_MEMBERS})")
            root = _root(path, infos)
            payloads: dict[str, set[str]] = {"weights": set(), "constants": set()}
            for info in infos:
                kind = _kind(path, info, root)
                member = info.filename[len(root):]
                if kind == "payload":
                    payloads[member.split("/")[1]].add(member.rsplit("/", 1)[1])
                elif kind in ("model", "config"):
                    doc = _json(path, z, info)
                    if kind == "model":
                        _check_model(path, info.filename, doc)
                    else:
                        _check_config(path, info.filename, doc, member.split("/")[1])
                elif kind == "version" and info.file_size > MAX_VERSION_BYTES:
                    raise ModelError(f"{path}: member {info.filename} is {info.file_size} bytes; a version file is "
                                     "a few bytes")
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise ModelError(f"{path} is not a readable torch.export archive ({e}); save it with "
                         "torch.export.save") from None


def _root(path, infos) -> str:
    roots = {i.filename.split("/", 1)[0] for i in infos}
    if len(roots) != 1 or not infos or "/" not in infos[0].filename:
        raise ModelError(f"{path}: a torch.export archive keeps every member under one folder; this one does not")
    return roots.pop() + "/"


def _kind(path, info: zipfile.ZipInfo, root: str) -> str:
    name = info.filename
    member = name[len(root):]
    if info.is_dir():
        return "folder"
    if ".." in PurePosixPath(name).parts or name.startswith("/") or "\\" in name:
        raise ModelError(f"{path}: member {name!r} points outside the archive")
    if info.compress_type != zipfile.ZIP_STORED:  # torch stores every member; a compressed one could be a bomb
        raise ModelError(f"{path}: member {name} is compressed; torch.export.save stores members uncompressed")
    for pattern, kind in _MEMBERS:
        if pattern.fullmatch(member):
            return kind
    if member.startswith(("data/aotinductor/", "data/executorch/", "data/mtia/", "data/xl_model_weights/")):
        raise ModelError(f"{path}: member {name} belongs to a compiled package (AOTInductor, ExecuTorch); nimble "
                         "compiles exported programs only: save one with torch.export.save")
    if member.startswith(("data/weights/", "data/constants/")) and member.endswith(".pt"):
        raise ModelError(f"{path}: member {name} holds pickled weights (torch's legacy archive layout), which could "
                         "run code when read; nimble refuses it. Save the program again with this torch's "
                         "torch.export.save")
    raise ModelError(f"{path}: member {name} is not part of an exported program (nimble reads only its JSON "
                     "graph, tensor payloads, sample inputs and version files); save the program with "
                     "torch.export.save")


def _json(path, z: zipfile.ZipFile, info: zipfile.ZipInfo):
    if info.file_size > MAX_JSON_BYTES:
        raise ModelError(f"{path}: member {info.filename} is {info.file_size} bytes; nimble reads JSON members of "
                         f"at most {MAX_JSON_BYTES // 2**20} MiB")
    try:
        return json.loads(z.read(info))
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: member {info.filename} is not valid JSON ({type(e).__name__}); save the program "
                         "again with torch.export.save") from None


def _check_config(path, member: str, doc, folder: str) -> None:
    """Every entry of a weights or constants config is a raw tensor payload, never a pickle."""
    entries = doc.get("config") if isinstance(doc, dict) else None
    if not isinstance(entries, dict):
        raise ModelError(f"{path}: member {member} is not a payload config (no 'config' table)")
    for name, entry in entries.items():
        where = f"{path}: entry {name!r} of {member}"
        if not isinstance(entry, dict) or not isinstance(entry.get("path_name"), str):
            raise ModelError(f"{where} is malformed")
        file = entry["path_name"]
        if entry.get("use_pickle") is not False or not re.fullmatch(_PAYLOAD_PREFIX[folder] + r"\d+", file) \
                or not isinstance(entry.get("tensor_meta"), dict):
            what = "an object (custom_obj_/opaque_obj_)" if file.startswith(("custom_obj", "opaque_obj")) else \
                "a pickle" if entry.get("use_pickle") else f"a payload of kind {file!r}"
            raise ModelError(f"{where} is {what}, which torch would unpickle and which could run code; nimble "
                             "takes programs whose weights and constants are plain tensors")


def _check_model(path, member: str, doc) -> None:
    """Size expressions are arithmetic over size symbols; node targets are operators."""
    stack = [doc]
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            expr = obj.get("expr_str")
            if expr is not None and not _plain_size(expr):
                raise ModelError(f"{path}: member {member} has the size expression {str(expr)[:80]!r}, which is "
                                 "not arithmetic over sizes; torch would evaluate it as Python. nimble refuses it")
            target = obj.get("target")
            if isinstance(target, str) and "inputs" in obj and not _TARGET.fullmatch(target):
                raise ModelError(f"{path}: member {member} calls {target[:80]!r}, which is not an operator; "
                                 "nimble takes programs of aten operators")
            stack.extend(obj.values())
        elif isinstance(obj, list):
            stack.extend(obj)


def _plain_size(expr) -> bool:
    if not isinstance(expr, str) or len(expr) > 10_000 or "__" in expr:
        return False
    at = 0
    while at < len(expr.rstrip()):
        m = _TOKEN.match(expr, at)
        if m is None or m.end() == at:
            return False
        name = m.group("name") or m.group("text")
        if name is not None and name not in _SIZE_NAMES and not _SYMBOL.fullmatch(name):
            return False
        at = m.end()
    return True


def _refused(what: str):
    def refuse(*args, **kwargs):
        raise ModelError(f"the archive asked torch to unpickle {what}, which could run code; nimble refuses it")
    return refuse


@contextlib.contextmanager
def unpicklers_blocked():
    """While torch reads an archive: `pickle.loads` and TorchScript's object unpickler raise, and
    every `torch.load` uses the weights-only unpickler, whatever it asks for."""
    import torch
    from torch.export.pt2_archive import _package

    old_env = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    old_pickle, old_obj = getattr(_package, "pickle", None), getattr(torch._C, "_pickle_load_obj", None)
    blocked = type("BlockedPickle", (), {"loads": staticmethod(_refused("an object")),
                                         "load": staticmethod(_refused("an object")),
                                         "Unpickler": staticmethod(_refused("an object"))})
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    _package.pickle = blocked
    torch._C._pickle_load_obj = _refused("a TorchScript object")
    try:
        yield
    finally:
        torch._C._pickle_load_obj = old_obj
        if old_pickle is None:  # this torch's archive reader has no `pickle` of its own
            del _package.pickle
        else:
            _package.pickle = old_pickle
        if old_env is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = old_env


__all__ = ["check_archive", "unpicklers_blocked"]
