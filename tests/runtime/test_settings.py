"""Load-time settings are one frozen value (`runtime/base/settings.py`): parsed from NAME=VALUE
with one clear line for anything else, part of every cache key where they differ from the
defaults, and current for the kernels only while a load that was given them runs."""

from __future__ import annotations

import dataclasses

import pytest

from nimble.errors import UsageError
from nimble.runtime.base import settings
from nimble.runtime.base.settings import DEFAULT, Settings


def test_the_defaults_digest_to_nothing_and_a_change_to_a_key_of_its_own():
    assert DEFAULT.digest() == "" and DEFAULT.describe() == "defaults"
    one, other = Settings(gemm_slower=1.1), Settings(gemm_slower=1.2)
    assert one.digest() and one.digest() != other.digest()
    assert one.changed() == {"gemm_slower": 1.1} and one.describe() == "gemm_slower=1.1"
    assert Settings(gemm_slower=1.1).digest() == one.digest()  # the same settings, the same key


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.gemm_kernel = False


@pytest.mark.parametrize("texts, message", [
    (["gemm_slowr=1.1"], "names no setting"),
    (["gemm_slower"], "names no setting"),
    (["gemm_slower=fast"], "Python literal"),
    (["gemm_kernel=1"], "True or False"),
    (["max_views=-1"], "whole number"),
    (["max_views=2.5"], "whole number"),
    (["gemm_slower=float('nan')"], "Python literal"),
    (["gemm_slower='1'"], "a number"),
])
def test_a_bad_setting_is_one_line_saying_what_to_write(texts, message):
    with pytest.raises(UsageError, match=message) as e:
        Settings.parse(texts)
    assert "\n" not in str(e.value)


def test_parse_builds_on_the_defaults():
    s = Settings.parse(["mean_pairs=False", " cudnn_slower_outside = 1.03 "])
    assert s == dataclasses.replace(DEFAULT, mean_pairs=False, cudnn_slower_outside=1.03)


def test_using_makes_them_current_only_inside_the_block():
    chosen = Settings(input_pairs=False)
    assert settings.current() is DEFAULT
    with settings.using(chosen):
        assert settings.current() is chosen
        with settings.using(None):  # None leaves them
            assert settings.current() is chosen
    assert settings.current() is DEFAULT


def test_a_load_keeps_its_settings_and_the_kernels_see_them_while_it_runs(tmp_path, monkeypatch):
    """On the CPU too: the placed ops run under the load's settings, and nothing outside it changes."""
    import torch

    from nimble.pipeline import compile_model
    from nimble.runtime.executable import Executable
    from nimble.runtime.placed import run as placement
    from nimble.specs import input_specs

    seen = []
    real = placement.PlacedRun.call

    def spy(self, p, args, kwargs):
        seen.append(settings.current())
        return real(self, p, args, kwargs)

    monkeypatch.setattr(placement.PlacedRun, "call", spy)
    model = torch.jit.trace(torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()).eval(), torch.randn(2, 8))
    torch.jit.save(model, str(tmp_path / "m.pt"))
    art = compile_model(tmp_path / "m.pt", input_specs(["2x8"]), device="cpu").artifact()
    chosen = Settings(gemm_kernel=False)
    exe = Executable(art, "cpu", settings=chosen)
    exe(torch.randn(2, 8))
    assert exe.settings is chosen and seen and all(s is chosen for s in seen)
    assert settings.current() is DEFAULT
    assert Executable(art, "cpu").settings is DEFAULT
