"""The `nimble` command. Each subcommand lives in its own module; torch is imported lazily."""

from __future__ import annotations

import typer

from nimble import __version__

from .compile import compile_command
from .inspect import inspect_command
from .run import run_command
from .bench import bench_command

app = typer.Typer(
    name="nimble",
    help="Ahead-of-time multi-stream scheduling and packaging for static PyTorch models.\n\n"
         "Start with: nimble compile MODEL.pt --shape 1x3x224x224",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"nimble {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Ahead-of-time multi-stream scheduling and packaging for static PyTorch models."""


app.command("compile")(compile_command)
app.command("inspect")(inspect_command)
app.command("run")(run_command)
app.command("bench")(bench_command)


def main() -> None:
    app()
