"""`tools/train_step_ab.py` on the CPU: a step with every joint pass beside one without those named,
the same first loss, and one line for a pass that does not exist."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import train_step_ab  # noqa: E402
from tests.models import TinyViT  # noqa: E402
from tests.runtime.test_train_step import batch  # noqa: E402


def test_a_step_without_stack_views_copies_more_and_gives_the_same_loss(capsys):
    """`compare` (what `main` runs on a torchvision model, which CI does not install) on the tests'
    small vision transformer."""
    torch.manual_seed(0)
    x, y = batch(2, 16)
    train_step_ab.compare(TinyViT(), x, y, "fp32", train_step_ab.variants(["stack_views"]), 1, 1)
    out = capsys.readouterr().out
    clones = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(.+?): prepared .* (\d+) clones", out, re.M)}
    assert clones["without stack_views"] > clones["all passes"]
    assert "first losses differ by 0.0e+00" in out
    assert len(re.findall(r"ms per step", out)) == 2


def test_an_unknown_pass_is_one_line_naming_the_passes():
    with pytest.raises(SystemExit) as exit_:
        train_step_ab.main(["--without", "no_such_pass", "--device", "cpu"])
    assert str(exit_.value).startswith("train_step_ab.py: no joint pass named no_such_pass; the passes are ")
    assert "step_attention" in str(exit_.value)


def test_step_attention_and_roll_kernel_name_the_runtime_s_kernels_not_passes():
    from nimble import train

    chosen = train_step_ab.variants(["step_attention"])
    assert chosen == {"all passes": (train.JOINT_PASSES, ("step_attention", "roll_kernel")),
                      "without step_attention": (train.JOINT_PASSES, ("roll_kernel",))}
    assert train_step_ab.variants(["roll_kernel"])["without roll_kernel"] == (train.JOINT_PASSES, ("step_attention",))
