"""The memory budget (`--max-memory`, `nimble.load(..., max_memory=)`) and `close()`, on the CPU.
The GPU footprint by kind is checked in test_gpu_runtime.py."""

import pytest
import torch

import nimble
from nimble.errors import UsageError
from nimble.specs import parse_bytes

from ..cli.test_cli import invoke
from ..conftest import SAMPLES


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("m") / "r.nimble"
    assert invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32", "--device", "cpu", "-o", out).exit_code == 0
    return out


def test_sizes_parse_in_the_units_people_write():
    assert parse_bytes("4GiB") == 4 * 2**30 and parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9 and parse_bytes("1.5gib") == 3 * 2**29 and parse_bytes("1000") == 1000
    for bad in ("", "lots", "-1GB", "0", "4 parsecs", "1e9"):
        with pytest.raises(UsageError, match="give a size such as 4GiB"):
            parse_bytes(bad)


def test_a_bad_budget_is_refused_before_loading(artifact):
    result = invoke("run", artifact, "--device", "cpu", "--max-memory", "lots")
    assert result.exit_code == 2 and "--max-memory 'lots'" in result.stderr


def test_a_budget_below_the_plan_is_refused_in_one_line_before_allocating(artifact):
    for command in ("run", "bench"):
        result = invoke(command, artifact, "--device", "cpu", "--max-memory", "100KiB")
        assert result.exit_code == 1, result.stderr
        assert "above the memory budget of 0.1 MiB; nothing was allocated" in result.stderr
    assert invoke("run", artifact, "--device", "cpu", "--max-memory", "1GiB").exit_code == 0


def test_close_and_the_context_manager_give_the_artifact_up(artifact):
    x = torch.randn(1, 3, 32, 32)
    with nimble.load(artifact, device="cpu") as exe:
        want = exe(x)
    with pytest.raises(UsageError, match="r.nimble was closed; load it again"):
        exe(x)
    with pytest.raises(UsageError, match="closed"):
        exe.replay()
    exe.close()  # twice is fine
    again = nimble.load(artifact, device="cpu")
    torch.testing.assert_close(again(x), want)


def test_inspect_loads_only_when_asked_and_checks_the_device_first(artifact):
    result = invoke("inspect", artifact, "--no-ops", "--device", "cpu")
    assert result.exit_code == 0 and "holds its weights, arena and inputs as planned" in result.stdout
    assert "holds its weights" not in invoke("inspect", artifact, "--no-ops").stdout
    result = invoke("inspect", artifact, "--device", "gpu")
    assert result.exit_code == 2 and "--device 'gpu'" in result.stderr


def test_a_budget_that_is_no_number_of_bytes_is_refused(artifact):
    for bad in (0, -5, 1.5, "1GiB", True):
        with pytest.raises(UsageError, match="max_memory must be a positive number of bytes"):
            nimble.load(artifact, device="cpu", max_memory=bad)
