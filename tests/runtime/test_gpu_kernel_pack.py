"""A kernel pack built with no GPU visible, loaded on the GPU (`runtime/kernels/pack.py`,
`runtime/prebuild.py`): every kernel its walk found comes from the pack on an empty cache, and the
outputs equal a load that built its kernels from source. Each step is a fresh process with its
own nimble and Triton cache folders. Run with `pytest -m gpu`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

BUILD = """
import sys, torch
from pathlib import Path
from nimble.formats import read_artifact
from nimble.runtime import prebuild
from nimble.runtime.kernels import aot
assert not torch.cuda.is_available()  # built as on the CPU builder
arch, sms = int(sys.argv[2]), int(sys.argv[3])
prebuild.ahead(read_artifact(sys.argv[1]), [aot.Target(arch, sms)], Path(sys.argv[4]))
"""

LOAD = """
import json, sys, torch
import nimble
from nimble.runtime.kernels import generated
exe = nimble.load(sys.argv[1], device="cuda", kernels=sys.argv[2] or None)
outs = exe.run(*exe.artifact.sample_inputs)
torch.save([o.float().cpu() for o in outs], sys.argv[3])
p = exe.stats.prebuilt
print(json.dumps({"found": p.found, "from_pack": p.from_pack, "built": p.built, "cached": p.cached,
                  "notes": p.notes, "walked": p.walked, "compiled_at_launch": generated.STATS.compiled}))
"""


def _unwalked(pack: Path) -> None:
    """Rewrite `pack`'s manifest without the plan it was walked from: a load then walks."""
    from nimble.runtime.kernels import pack as packs

    data = pack.read_bytes()
    start = len(packs.MAGIC) + 8 + int.from_bytes(data[len(packs.MAGIC):len(packs.MAGIC) + 8], "little")
    head = json.loads(data[len(packs.MAGIC) + 8:start])
    del head["plan"]
    body = json.dumps(head, sort_keys=True).encode()
    pack.write_bytes(packs.MAGIC + len(body).to_bytes(8, "little") + body + data[start:])


def _env(folder: Path, **more) -> dict:
    root = Path(__file__).resolve().parents[2]
    return dict(os.environ, NIMBLE_CACHE_DIR=str(folder / "nimble"), TRITON_CACHE_DIR=str(folder / "triton"),
                PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH", "")])), **more)


def _run(script: str, args: list, env: dict) -> str:
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=500, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("name, walk", [("mobilenet", False), ("inception", False), ("mobilenet", True)])
def test_a_pack_built_without_a_gpu_serves_every_kernel_and_agrees_with_source(sample_artifacts, tmp_path, name, walk):
    """A pack walked from the artifact's plan on this GPU's architecture and multiprocessors spares
    the load its walk (`walk=False`); one that does not say so is walked (`walk=True`). Either way
    no kernel is compiled at load."""
    import torch

    props = torch.cuda.get_device_properties(0)
    pack = tmp_path / f"{name}.nimble.kernels"
    _run(BUILD, [sample_artifacts[name], props.major * 10 + props.minor, props.multi_processor_count, pack],
         _env(tmp_path / "builder", CUDA_VISIBLE_DEVICES=""))
    if walk:
        _unwalked(pack)
    packed = json.loads(_run(LOAD, [sample_artifacts[name], pack, tmp_path / "packed.pt"],
                             _env(tmp_path / "fresh")).strip().splitlines()[-1])
    source = json.loads(_run(LOAD, [sample_artifacts[name], "", tmp_path / "source.pt"],
                             _env(tmp_path / "other")).strip().splitlines()[-1])
    assert packed["walked"] == walk and packed["built"] == 0 and packed["compiled_at_launch"] == 0, packed
    if walk:
        assert packed["found"] > 0 and packed["from_pack"] == packed["found"], packed
    else:  # found: the pack's kernels; taken: those the load launched
        assert 0 < packed["from_pack"] <= packed["found"], packed
    assert source["from_pack"] == 0 and source["built"] == source["found"] > 0, source
    assert source["compiled_at_launch"] == 0, source
    for a, b in zip(torch.load(tmp_path / "packed.pt"), torch.load(tmp_path / "source.pt")):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)  # two loads tune apart: TF32 may round apart
