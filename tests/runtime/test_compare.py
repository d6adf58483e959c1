"""The output check can fail: an output smaller than atol throughout (random weights can make one
1e-9) is also held to rtol by its relative L2 error, where atol alone would pass anything."""

import torch

from nimble.runtime.base.compare import compare

from ..cli.test_cli import invoke
from ..conftest import save_script


def test_a_tiny_output_is_compared_by_relative_error():
    ref = torch.randn(64) * 1e-9
    wrong = compare([ref * 2], [ref], 1e-4, 1e-5)
    assert wrong.max_abs <= 1e-5 and not wrong.passed and wrong.tiny == (0,)
    assert "compared by relative L2 error" in wrong.describe() and wrong.passing_rtol == "1e0"
    assert compare([ref * (1 + 1e-7)], [ref], 1e-4, 1e-5).passed
    normal = compare([torch.ones(4) * 2], [torch.ones(4)], 1e-4, 1e-5)
    assert normal.tiny == () and not normal.passed


def test_run_check_catches_wrong_values_in_a_model_with_tiny_outputs(tmp_path):
    from nimble.formats import read_artifact, write_artifact

    class Tiny(torch.nn.Module):
        def forward(self, x):
            return torch.sigmoid(x) * 1e-9

    out = tmp_path / "tiny.nimble"
    assert invoke("compile", save_script(tmp_path, Tiny(), "tiny"), "-s", "4x8", "--device", "cpu", "-o", out).exit_code == 0
    art = read_artifact(out)
    art.sample_outputs = [t * 2 for t in art.sample_outputs]  # off by 100 %, yet within atol everywhere
    write_artifact(tmp_path / "wrong.nimble", art)
    result = invoke("run", tmp_path / "wrong.nimble", "--check", "--device", "cpu")
    assert result.exit_code == 3 and "relative L2 error" in result.stderr
