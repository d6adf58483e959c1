"""Nothing lost on the user's side: no command overwrites its own input, kills leave no debris,
files get the mode a plain write gives, every bad shape or option is one line, one dtype table,
help that reads right, one-line logs in CI, and artifacts whose bytes do not depend on the
thread count."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nimble.cli.main import app
from nimble.dtypes import BY_NAME, UNSTORABLE
from nimble.fileio import atomic_file, remove_stale_temps, write_atomic

from ..conftest import SAMPLES, save_script

runner = CliRunner()
SHAPE = "1x3x32x32"


def invoke(*args, **kwargs):
    return runner.invoke(app, [str(a) for a in args], **kwargs)


def one_line(result, code: int) -> str:
    assert result.exit_code == code, (result.exit_code, result.stderr)
    lines = [line for line in result.stderr.strip().splitlines() if line.strip() and not line.startswith("... ")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    folder = tmp_path_factory.mktemp("art")
    result = invoke("compile", SAMPLES / "resnet.pt", "--shape", SHAPE, "--device", "cpu", "-o", folder / "a.nimble")
    assert result.exit_code == 0, result.stderr
    return folder / "a.nimble"


# ------------------------------------------------------------------------------ nothing lost
def test_no_command_overwrites_its_own_input(tmp_path, artifact):
    model = tmp_path / "victim.pt"
    shutil.copy(SAMPLES / "resnet.pt", model)
    before = model.read_bytes()
    (tmp_path / "link.pt").symlink_to(model)
    disguised = tmp_path / "m.nimble"  # a TorchScript file whose default output is itself
    shutil.copy(SAMPLES / "resnet.pt", disguised)
    art = tmp_path / "a.nimble"
    shutil.copy(artifact, art)
    cases = [
        ("compile", model, "--shape", SHAPE, "-o", model),
        ("compile", model, "--shape", SHAPE, "-o", tmp_path / "link.pt"),  # the same file, reached another way
        ("compile", model, "--shape", SHAPE, "-o", tmp_path / "sub" / ".." / "victim.pt"),
        ("compile", disguised, "--shape", SHAPE),
        ("compile", model, "--shape", SHAPE, "-o", tmp_path / "x.nimble", "--dot", model),
        ("run", art, "--device", "cpu", "-o", art),
        ("bench", art, "--device", "cpu", "--export-times", art),
        ("inspect", art, "--dot", art),
    ]
    (tmp_path / "sub").mkdir()
    for case in cases:
        line = one_line(invoke(*case), 2)
        assert "itself" in line, line
    assert model.read_bytes() == before and disguised.read_bytes() == before
    assert art.read_bytes() == artifact.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.nimble", "link.pt", "m.nimble", "sub", "victim.pt"]


def test_an_unwritable_output_folder_is_refused_before_any_work(tmp_path, monkeypatch):
    out = tmp_path / "locked" / "m.nimble"
    out.parent.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(out.parent) else real(p, mode, **kw))
    t = time.perf_counter()
    line = one_line(invoke("compile", SAMPLES / "inception.pt", "--shape", "1x3x224x224", "-o", out), 2)
    assert "not writable" in line and str(out) in line and time.perf_counter() - t < 5


def _start(args, **kwargs):
    return subprocess.Popen([sys.executable, "-c", "from nimble.cli.entry import main; main()", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _wait_until_the_entry_point_handles_signals(proc) -> None:
    """Until the child's SIGTERM handler is installed (`entry.main`'s first step; Linux's
    /proc/PID/status lists caught signals). Before that the interpreter is still starting (its
    `site` import alone took over 50 ms in a venv holding a CUDA torch), where no program's
    handler can run yet."""
    status = Path(f"/proc/{proc.pid}/status")
    deadline = time.monotonic() + 30
    while status.exists() and time.monotonic() < deadline and proc.poll() is None:
        caught = next((line.split()[1] for line in status.read_text().splitlines() if line.startswith("SigCgt:")), "0")
        if int(caught, 16) >> (signal.SIGTERM - 1) & 1:
            return
        time.sleep(0.002)


@pytest.mark.parametrize("signum,delay", [(signal.SIGTERM, 1.5), (signal.SIGINT, 0.05), (signal.SIGTERM, 0.05)])
def test_a_signal_ends_the_command_in_one_line_with_nothing_left(tmp_path, signum, delay):
    """SIGTERM is handled like Ctrl-C, also in the first instant after the entry point starts,
    while the command still loads."""
    out = tmp_path / "out"
    out.mkdir()
    proc = _start(["compile", SAMPLES / "nasnet.pt", "--shape", "16x3x224x224", "--device", "cpu",
                   "-o", out / "n.nimble"], cwd=tmp_path, env={**os.environ, "NIMBLE_MAX_INPUT_BYTES": str(2**34)})
    _wait_until_the_entry_point_handles_signals(proc)
    time.sleep(delay)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the command finished before the signal arrived")
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "interrupted"
    assert list(out.iterdir()) in ([], [out / "n.nimble"])


TYPER_INTERRUPTED = """
import typer
from nimble.cli import entry, interrupts, main

app = typer.Typer()


@app.command()
def compile(path: str):  # an interrupt before the command's own handling: typer ends it in 130, silently
    interrupts.interrupted = True
    raise KeyboardInterrupt


main.app = app
entry.main()
"""


def test_an_interrupt_that_typer_ends_still_says_so_in_one_line():
    """A signal that lands while typer parses the arguments reaches typer's own handler, which
    exits with status 130 and prints nothing (1 in 7 of a loaded machine's SIGINTs 0.05 s in, once
    the entry point's handler was there); the entry point says the one line."""
    proc = subprocess.run([sys.executable, "-c", TYPER_INTERRUPTED, "x"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130 and proc.stderr.strip().splitlines() == ["interrupted"], proc.stderr


WRITER = """
import sys, time
from nimble.fileio import atomic_file
with atomic_file(sys.argv[1]) as f:
    f.write(b"x" * 4096)
    f.flush()
    print("writing", flush=True)
    time.sleep(60)
"""


def test_a_kill_while_writing_leaves_no_temp_file(tmp_path):
    target = tmp_path / "big.nimble"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.kill()
    proc.wait()
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_files_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".a.nimble.nimble-{dead.stdout.strip()}-0123abcd.tmp"
    mine = tmp_path / f".b.nimble.nimble-{os.getpid()}-0123abcd.tmp"
    other = tmp_path / ".notes.tmp"
    for p in (stale, mine, other):
        p.write_bytes(b"partial")
    remove_stale_temps(tmp_path)
    assert not stale.exists() and mine.exists() and other.exists()


def test_written_files_get_the_umask_mode_and_overwrites_keep_theirs(tmp_path):
    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "new", b"1")
        assert (tmp_path / "new").stat().st_mode & 0o777 == 0o640
        (tmp_path / "shared").write_bytes(b"0")
        os.chmod(tmp_path / "shared", 0o644)
        write_atomic(tmp_path / "shared", b"1")
        assert (tmp_path / "shared").stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(old)
    with pytest.raises(KeyboardInterrupt):
        with atomic_file(tmp_path / "shared") as f:
            f.write(b"2")
            raise KeyboardInterrupt
    assert (tmp_path / "shared").read_bytes() == b"1" and sorted(p.name for p in tmp_path.iterdir()) == ["new", "shared"]


def test_run_check_writes_no_output_on_a_mismatch(tmp_path, artifact):
    from nimble.formats import read_artifact, write_artifact

    art = read_artifact(artifact)
    art.sample_outputs = [t + 1 for t in art.sample_outputs]
    write_artifact(tmp_path / "wrong.nimble", art)
    out = tmp_path / "out.safetensors"
    result = invoke("run", tmp_path / "wrong.nimble", "--check", "--device", "cpu", "-o", out)
    assert result.exit_code == 3 and "Traceback" not in result.stderr
    assert "was not written" in result.stderr.strip().splitlines()[-1] and not out.exists()


# ------------------------------------------------------------------------------ shapes and options
@pytest.mark.parametrize("shape,match", [
    ("1x\u00b2x224x224", "not a shape"), ("1x\u0663x4", "not a shape"),
    ("99999999999999999999x3x224x224", "over the limit"), ("100000x3x224x224", "over the limit"),
    ("0x3x224x224", "at least 1"), ("1x-3", "not a shape"),
])
def test_bad_shapes_are_usage_errors(shape, match):
    assert match in one_line(invoke("compile", SAMPLES / "resnet.pt", "--shape", shape, "--device", "cpu"), 2)


def test_the_input_limit_can_be_raised(tmp_path):
    line = one_line(invoke("compile", SAMPLES / "resnet.pt", "--shape", SHAPE, "-o", tmp_path / "a.nimble",
                           env={"NIMBLE_MAX_INPUT_BYTES": "1000"}), 2)
    assert "NIMBLE_MAX_INPUT_BYTES" in line
    result = invoke("compile", SAMPLES / "resnet.pt", "--shape", SHAPE, "-o", tmp_path / "a.nimble", "--device", "cpu",
                    env={"NIMBLE_MAX_INPUT_BYTES": "100000"})
    assert result.exit_code == 0, result.stderr


@pytest.mark.parametrize("flag", ["--rtol", "--atol"])
def test_negative_tolerances_are_refused(artifact, flag):
    assert "at least 0" in one_line(invoke("run", artifact, "--check", "--device", "cpu", flag, "-1"), 2)


def test_running_out_of_memory_in_the_check_is_one_line(tmp_path, monkeypatch):
    from nimble.runtime.placed import reference

    def exhausted(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(reference, "run", exhausted)
    line = one_line(invoke("compile", SAMPLES / "resnet.pt", "--shape", SHAPE, "--device", "cpu",
                           "-o", tmp_path / "a.nimble"), 1)
    assert "ran out of memory" in line and "smaller batch" in line and not (tmp_path / "a.nimble").exists()


def test_a_folder_and_a_truncated_file_are_named_as_such(tmp_path, artifact):
    assert "is a folder" in one_line(invoke("run", tmp_path, "--device", "cpu"), 1)
    cut = tmp_path / "cut.nimble"
    cut.write_bytes(artifact.read_bytes()[:5000])
    assert "truncated" in one_line(invoke("run", cut, "--device", "cpu"), 1)


# ------------------------------------------------------------------------------ dtypes
def test_one_table_covers_every_torch_dtype():
    names = {str(getattr(torch, n)).removeprefix("torch.") for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    assert names <= set(BY_NAME) | set(UNSTORABLE), sorted(names - set(BY_NAME) - set(UNSTORABLE))
    from nimble.formats import tensors
    from nimble.ir import ITEMSIZE
    from nimble.ops import types

    assert set(ITEMSIZE) == set(types.DTYPES) == set(tensors.DTYPES_TORCH) == set(BY_NAME)
    assert all(getattr(torch, n).itemsize == d.itemsize for n, d in BY_NAME.items())


class ComplexWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, dtype=torch.complex128))

    def forward(self, x):
        return x + self.w.real.float()


class Doubler(torch.nn.Module):
    def forward(self, x):
        return x * 2


def test_an_unstorable_weight_dtype_is_refused_before_any_work(tmp_path):
    path = save_script(tmp_path, ComplexWeight(), "c128")
    line = one_line(invoke("compile", path, "--shape", "4", "--device", "cpu", "-o", tmp_path / "c.nimble"), 1)
    assert "weight 'w'" in line and "complex128" in line and "complex64" in line
    assert not (tmp_path / "c.nimble").exists()
    assert "complex128" in one_line(invoke("compile", path, "--shape", "4", "--dtype", "complex128"), 2)


def test_complex_inputs_get_sample_data(tmp_path):
    path = save_script(tmp_path, Doubler(), "doubler")
    result = invoke("compile", path, "--shape", "3x4", "--dtype", "complex64", "--device", "cpu", "-o", tmp_path / "d.nimble")
    assert result.exit_code == 0, result.stderr
    assert invoke("run", tmp_path / "d.nimble", "--check", "--device", "cpu").exit_code == 0
    from nimble.runtime.base.compare import compare

    z = torch.ones(3, dtype=torch.complex64)
    assert not compare([z * 1j], [z], 1e-4, 1e-5).passed  # imaginary parts count


# ------------------------------------------------------------------------------ help and logs
@pytest.mark.parametrize("command,argument", [("compile", "MODEL"), ("run", "ARTIFACT"), ("bench", "ARTIFACT"),
                                              ("inspect", "ARTIFACT")])
def test_help_shows_no_bool_and_names_the_argument(command, argument):
    text = invoke(command, "--help", env={"COLUMNS": "200"}).stdout
    usage = next(line for line in text.splitlines() if "Usage:" in line)
    assert argument in usage and "<bool>" not in text and "{model}" not in text.lower().replace(argument.lower(), "")


def test_help_paragraphs_reflow_to_the_terminal():
    text = invoke("compile", "--help", env={"COLUMNS": "250"}).stdout
    assert any("the weights, and a reference input and output" in line for line in text.splitlines())


def test_logs_off_a_terminal_keep_each_message_on_one_line(tmp_path):
    deep = tmp_path / ("a-rather-long-folder-name-" * 4)
    deep.mkdir()
    proc = subprocess.run([sys.executable, "-c", "from nimble.cli.entry import main; main()", "compile",
                           str(SAMPLES / "resnet.pt"), "--shape", SHAPE, "--device", "cpu", "-o", str(deep / "r.nimble")],
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    assert any(line.strip() == f"wrote {deep / 'r.nimble'} ({line.split('(')[-1]}" for line in proc.stderr.splitlines()
               if line.strip().startswith("wrote"))


def test_version_names_nimble_and_torch():
    result = invoke("--version")
    assert result.exit_code == 0 and result.stdout.startswith("nimble ") and f"torch {torch.__version__.split('+')[0]}" in result.stdout


# ------------------------------------------------------------------------------ determinism
def test_artifact_bytes_do_not_depend_on_the_thread_count(tmp_path):
    outs = []
    for threads in ("1", "2", "3"):
        out = tmp_path / f"t{threads}.nimble"
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        proc = subprocess.run([sys.executable, "-c", "from nimble.cli.entry import main; main()", "compile",
                               str(SAMPLES / "inception.pt"), "--shape", "2x3x96x96", "--device", "cpu", "-o", str(out)],
                              capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] == outs[2]


def test_what_fails_after_an_interrupt_is_the_interrupt(monkeypatch):
    """An interrupt that lands inside an import can leave a C extension half loaded; the next
    import of it fails ('cannot load module more than once per process', seen once in a fresh
    venv). After a SIGINT or SIGTERM such a failure ends the command as interrupted (130), not
    as an internal error; without one, it is still reported as nimble's fault."""
    import typer

    from nimble.cli import common, interrupts

    def failing():
        with common.user_errors(False):
            raise ImportError("cannot load module more than once per process")

    with pytest.raises(typer.Exit) as ended:
        failing()
    assert ended.value.exit_code == 1
    monkeypatch.setattr(interrupts, "interrupted", True)
    with pytest.raises(typer.Exit) as ended:
        failing()
    assert ended.value.exit_code == 130
