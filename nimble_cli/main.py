"""The `nimble` command. Each subcommand lives in its own module; torch is imported lazily. The
console script enters through entry.py, which handles interrupts."""

from __future__ import annotations

import typer

from nimble import __version__

from .compile import compile_command
from .inspect import inspect_command
from .run import run_command
from .bench import bench_command
from .serve import serve_command

def _flags_without_type() -> None:
    """Typer 0.2x prints `<bool>` beside every on/off flag (--json <bool>), which reads as if the
    flag took a value. Show no type for flags; other options keep theirs."""
    option = getattr(getattr(typer, "core", None), "TyperOption", None)
    shown = getattr(option, "display_type_rich", None)
    if shown is None or getattr(shown, "nimble", False):
        return

    def display_type_rich(self, ctx):
        return None if getattr(self, "is_flag", False) and not getattr(self, "metavar", None) else shown(self, ctx)

    display_type_rich.nimble = True
    option.display_type_rich = display_type_rich


_flags_without_type()

app = typer.Typer(
    rich_markup_mode="markdown",  # help paragraphs reflow to the terminal's width
    name="nimble",
    help="Ahead-of-time multi-stream scheduling and packaging for static PyTorch models.\n\n"
         "Start with: nimble compile MODEL.pt --shape 1x3x224x224\n\n"
         "Exit codes, for every command: 0 ok; 1 bad input (a missing or corrupt file, a shape the model "
         "rejects, an unsupported op, out of memory); 2 usage (a malformed or missing option, a wrong number "
         "of --shape); 3 outputs mismatched (compile's check, run --check); 130 interrupted. With --json, "
         "a failure prints {\"error\": {kind, message, op, source, exit_code}} on stdout (schemas/ in the "
         "repository holds the JSON Schema of every document).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            torch = version("torch")  # without importing torch, which takes seconds
        except PackageNotFoundError:
            torch = "not installed"
        typer.echo(f"nimble {__version__} (torch {torch})")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the nimble and torch versions and exit.")) -> None:
    """Ahead-of-time multi-stream scheduling and packaging for static PyTorch models."""


app.command("compile")(compile_command)
app.command("inspect")(inspect_command)
app.command("run")(run_command)
app.command("bench")(bench_command)
app.command("serve")(serve_command)
