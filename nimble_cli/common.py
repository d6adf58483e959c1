"""What every command shares: the options they all take (defined once), the stderr console,
one-line errors, exit codes."""

from __future__ import annotations

import contextlib
import json
import re
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from . import interrupts

# Human-readable output goes to stderr (rich honours NO_COLOR); stdout is for --json alone. When
# stderr is not a terminal (a CI log, a pipe), each message stays on one line, so grep finds it.
console = Console(stderr=True, highlight=False, soft_wrap=not sys.stderr.isatty())

# C0 and C1 controls, DEL, and the Unicode format characters that reorder or hide text
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def literal(text) -> str:
    """Text from a file or a model, for rich to print as it is: control characters appear
    escaped (so no terminal escape sequence reaches the terminal) and markup is not interpreted."""
    return escape(_UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256
                                   else f"\\u{ord(m.group()):04x}", str(text)))


def interrupt(json_out: bool) -> typer.Exit:
    """The end of an interrupted command: one line, and exit status 130."""
    console.print("interrupted")
    interrupts.reported = True
    if json_out:
        print_json(error_document("Interrupted", "interrupted", 130))
    return typer.Exit(130)


@contextlib.contextmanager
def user_errors(debug: bool, json_out: bool = False):
    """Turn a NimbleError into one line on stderr and its exit code; anything else into one
    line that asks for --debug. With --debug, the traceback comes too. With --json, stdout also
    gets the error as a JSON document (`error_document`)."""
    from nimble.errors import NimbleError, first_line

    def fail(kind: str, message: str, code: int, label: str = "error", report: dict | None = None) -> typer.Exit:
        console.print(f"[bold red]{label}:[/] {literal(message)}", soft_wrap=True)
        if json_out:
            print_json(error_document(kind, message, code) | ({"report": report} if report else {}))
        return typer.Exit(code)

    try:
        yield
    except NimbleError as e:
        if debug:
            traceback.print_exc()
        raise fail(type(e).__name__, str(e), e.exit_code, report=getattr(e, "document", None)) from None
    except OSError as e:  # the file system said no: permissions, a full disk, a path that vanished
        if debug:
            traceback.print_exc()
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        raise fail("OSError", f"{e.strerror or str(e)}{where}", 1) from None
    except KeyboardInterrupt:
        raise interrupt(json_out) from None
    except (typer.Exit, typer.Abort):
        raise
    except Exception as e:  # a bug in nimble: still one line, unless --debug
        if debug:
            traceback.print_exc()
        if interrupts.interrupted:  # the signal broke what failed here (an import it cut short, say): it is the interrupt
            raise interrupt(json_out) from None
        raise fail("InternalError", f"{type(e).__name__}: {first_line(e)} (rerun with --debug for the traceback, "
                   "and please report it)", 1, "internal error") from None


@contextlib.contextmanager
def progress(label: str):
    """Tell the user what is happening: a spinner on a terminal; where stderr is not one (a CI
    log), one `... <stage>` line per stage, passes left out, so that a log shows where a long
    command is. Yields `update(text)`."""
    if console.is_terminal:
        with console.status(label, spinner="dots") as status:
            yield status.update
        return

    def say(text: str) -> None:
        if ": pass " not in text:
            console.print(f"... {literal(text)}", soft_wrap=True)

    say(label)
    yield say


def describe_kernels(found: dict | None) -> str | None:
    """'31 kernels found before the first op: 0 from the cache, 31 from the pack, 0 built here
    (2.83 s)', from a load's `kernels` document; None where none were looked for."""
    if found is None or not found["found"]:
        return None
    return (f"{found['found']} kernels found before the first op: {found['cached']} from the cache, "
            f"{found['from_pack']} from the pack, {found['built']} built here ({found['seconds']:.2f} s)")


def check_pack(path: Path | None) -> None:
    """--kernels names a readable file (what it holds is checked at load, where a pack that does
    not check is a miss, never an error)."""
    if path is not None and not path.is_file():
        from nimble.errors import UsageError

        raise UsageError(f"--kernels {path}: no such file; `nimble compile --gpu-arch sm_90` writes MODEL.nimble.kernels "
                         "beside the artifact")


def early_checks(device: str | None = None, tune: str | None = None, streams: str | None = None,
                 max_memory: str | None = None) -> int | None:
    """The option values a command can refuse before it imports torch (seconds on a GPU machine), in
    the words the later checks use. Returns --max-memory in bytes (None without it)."""
    from nimble.specs import check_device_name, check_tune_mode, parse_bytes, parse_streams

    if device is not None:
        check_device_name(device)
    if tune is not None:
        check_tune_mode(tune)
    if streams is not None:
        parse_streams(streams)
    return parse_bytes(max_memory) if max_memory is not None else None


ERROR_SCHEMA_VERSION = 1
_OP = re.compile(r"\b((?:aten|nimble|prim|torchvision)::[\w.]+)")  # the first op a message names
_SOURCE = re.compile(r" at ([^\s(),;]+:\d+)")


def error_document(kind: str, message: str, exit_code: int) -> dict:
    """What `--json` prints on stdout when a command fails: the error's class, its one-line
    message, the op and the model's source line where the message names them, and the exit code.
    A command that had a result when it failed (`run --check` that mismatched) adds it as `report`."""
    op, source = _OP.search(message), _SOURCE.search(message)
    return {"schema_version": ERROR_SCHEMA_VERSION,
            "error": {"kind": kind, "message": message, "op": op.group(1) if op else None,
                      "source": source.group(1) if source else None, "exit_code": exit_code}}


def writable(path, option: str, inputs: dict | None = None):
    """Fail fast, before any work, with a usage error (exit 2): when an output's folder does not
    exist or cannot be written, when the output exists and is not a regular file (a folder, a
    device, a FIFO, a socket, a link loop), or when it is one of the command's own `inputs`
    (label -> path, or a list of paths), reached by the same path or another (a link, `..`)."""
    import os
    import stat
    import tempfile
    from pathlib import Path

    from nimble.errors import UsageError
    from nimble.fileio import same_file

    if path is None:
        return path
    path = Path(path)
    folder = path.parent
    if not folder.is_dir():
        raise UsageError(f"{option} {path}: folder {folder} does not exist")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:  # a link loop, a name too long, a path through a file
        raise UsageError(f"{option} {path}: {e.strerror or e}; give a new file name or a regular file") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise UsageError(f"{option} {path} is a folder; give a file name")
    if mode is not None and not stat.S_ISREG(mode):
        raise UsageError(f"{option} {path} is not a regular file (a device, FIFO or socket); nimble writes only new "
                         "or regular files, so give another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: folder {folder} is not writable")
    try:  # what the permission bits do not tell: /proc, a read-only or full file system
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise UsageError(f"{option} {path}: new files cannot be created in folder {folder} (the system says: "
                         f"{e.strerror or e}; /proc, /sys and read-only or full disks do this); choose a folder on a "
                         "writable disk") from None
    for label, others in (inputs or {}).items():
        for other in others if isinstance(others, list) else [others]:
            if other is not None and same_file(path, other):
                raise UsageError(f"{option} {path} is {label} itself; writing it would destroy the input, so "
                                 "choose another path")
    return path


def footprint_line(f: dict) -> str:
    """A load's GPU footprint (`runtime/base/footprint.py`, as a document) in one line."""
    kinds = ", ".join(f"{label} {human_bytes(f[k])}" for k, label in (
        ("weights", "weights"), ("arena", "arena"), ("inputs", "inputs"), ("outside_arena", "results outside the arena"),
        ("pool_free", "graph-pool workspaces and slack"),
        ("other_allocated", "other (cuBLAS and cuDNN graph workspaces)"), ("cached", "cached")))
    streams = len(f["pool_segments_per_stream"])
    return (f"GPU footprint: {human_bytes(f['growth'])} grown by the load = {kinds}; the graph pool has "
            f"{sum(f['pool_segments_per_stream'].values())} segment(s) over {streams} stream(s)")


def print_json(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    sys.stdout.flush()


def human_bytes(n: int) -> str:
    if n < 0:
        return "-" + human_bytes(-n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


TUNE_HELP = ("How to choose, on CUDA, the layout (NCHW or channels_last), the streams (as planned, or one), "
             "cuDNN's convolution algorithms and whether convolutions use cuDNN's fused kernels: cached "
             "(default) times the candidates once per artifact, GPU and torch version and keeps the choice in "
             "~/.cache/nimble/tuning.json (or $NIMBLE_CACHE_DIR); full times them again; off takes NCHW, the "
             "planned streams, cuDNN's heuristics and its fused kernels. Under every mode, cuDNN plans and "
             "generated kernels' per-call choices stay kept in cudnn_plans.json and kernel_choices.json there.")


# Options every command that takes them takes alike: `debug: DebugOption = False`.
DebugOption = Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout, on success and on "
                                          "failure alike (schemas/ holds their JSON Schemas); messages stay on "
                                          "stderr.")]
DeviceOption = Annotated[str, typer.Option("--device", metavar="auto|cuda|cpu",
                                           help="Where the model runs (compile: where the lowered op list is "
                                                "checked against the model): auto (CUDA if present, else the "
                                                "CPU), cuda or cpu.")]
TuneOption = Annotated[str, typer.Option("--tune", metavar="cached|full|off", help=TUNE_HELP)]
KernelsOption = Annotated[Optional[Path], typer.Option(
    "--kernels", metavar="PACK", help="A kernel pack you trust (`nimble compile --gpu-arch` writes MODEL.nimble.kernels): "
    "its prebuilt kernels run instead of being built at load. Naming a pack trusts its machine code as you trust a "
    "program you run; a pack for another GPU, Triton or nimble is not used (one line says why). With "
    "NIMBLE_KERNEL_KEY set, a pack must be signed with that key, and the signed pack beside the artifact is used "
    "without --kernels.")]
MaxMemoryOption = Annotated[Optional[str], typer.Option(
    "--max-memory", metavar="SIZE", help="Refuse to load if the artifact would hold more than SIZE (4GiB, 512MiB, 2GB "
    "or bytes) on the device: checked against its weights, arena and inputs before anything is allocated, and on "
    "CUDA against the whole footprint once loaded.")]


def describe_precision(record: dict | None) -> str:
    """'float16 (inputs and outputs float32); 3 of 61 ops in float32: 3 by rule (softmax 1,
    layer_norm 2), none searched; tolerance 1e-2 relative L2'."""
    if record is None:
        return "float32"
    kept = record["fp32_ops"]
    by_rule: dict[str, int] = {}
    for o in kept:
        if o["why"] == "policy":
            short = o["target"].split("::")[-1].split(".")[0]
            by_rule[short] = by_rule.get(short, 0) + 1
    searched = [o["op"] for o in kept if o["why"] == "kept"]
    rule = ", ".join(f"{k} {n}" for k, n in sorted(by_rule.items()))
    io = "inputs and outputs float32" if record["io"] == "model" else f"inputs and outputs {record['dtype']}"
    found = (f"{len(searched)} kept by the search ({', '.join(searched[:6])}{', ...' if len(searched) > 6 else ''})"
             if searched else ("none needed by the search" if record["searched"] else "no search"))
    return (f"{record['dtype']} ({io}); {len(kept)} of {record['floating_ops']} ops in float32: "
            f"{sum(by_rule.values())} by rule{f' ({rule})' if rule else ''}, {found}; "
            f"tolerance {record['tolerance']:g} relative L2")


def describe_batches(plans: dict) -> str:
    """'1 (arena 6.9 MiB, 2 streams), 8 (arena 55.2 MiB, 1 stream)' for batch -> (graph, schedule,
    memory plan); the call at a batch size between two runs the larger one, padded."""
    return ", ".join(f"{b} (arena {human_bytes(m.arena_bytes)}, {s.num_streams} stream{'s' * (s.num_streams != 1)})"
                     for b, (_, s, m) in sorted(plans.items()))
