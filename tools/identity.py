"""Byte identity of artifacts across a change that must not change behaviour (a refactor).

Every bundled sample model is compiled through both frontends (its TorchScript file, and a
`.pt2` exported once and shared by both sides) by the code at a base git ref and by the working
tree, on this machine, and every member of each artifact (the manifest too) is compared byte for
byte.

    python tools/identity.py --base HEAD~1        # exit 1 on any difference
    python tools/identity.py --emit out.json      # this tree's digests only
    python tools/identity.py --base REF --ignore-pass-log  # a change that adds or renames passes

The base side runs in a subprocess from a package tree assembled out of `git worktree` (nimble's
three source folders under one `nimble` package), so the installed editable package does not
shadow it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WITHOUT_PASS_LOG = "manifest.json without its pass log"


def member_digests(path: Path) -> dict[str, str]:
    """sha256 of each member. (A `.pt2` export is not byte-reproducible, and the manifest holds the
    source file's hash, so both sides compile one shared `.pt2` file.)"""
    out = {}
    with zipfile.ZipFile(path) as z:
        for name in sorted(z.namelist()):
            out[name] = hashlib.sha256(z.read(name)).hexdigest()
            if name == "manifest.json":  # and without the pass log, which names the passes that ran
                manifest = {k: v for k, v in json.loads(z.read(name)).items() if k != "passes"}
                out[WITHOUT_PASS_LOG] = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    return out


def programs(folder: Path) -> dict[str, Path]:
    """Export every sample model to `.pt2` once, into `folder` (reused if already there)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from sample_models.build import MODELS, TOKEN_MODELS, build_module, example_inputs

    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in [*MODELS, *TOKEN_MODELS]:
        path = folder / f"{name}.pt2"
        if not path.exists():
            torch.export.save(torch.export.export(build_module(name), example_inputs(name)), str(path))
        out[name] = path
    return out


def emit(programs_dir: Path, out_dir: Path) -> dict[str, dict[str, str]]:
    """Compile every sample through both frontends with the `nimble` this process imports."""
    sys.path.insert(0, str(ROOT))
    from sample_models.build import MODELS, TOKEN_MODELS

    from nimble.formats import write_artifact
    from nimble.pipeline import compile_model
    from nimble.specs import input_specs

    out_dir.mkdir(parents=True, exist_ok=True)
    result = {}
    shapes = {n: (m[1], None) for n, m in MODELS.items()} | {n: (m[1], m[2]) for n, m in TOKEN_MODELS.items()}
    for name, (dims, dtypes) in shapes.items():
        for frontend, source, specs in (
                ("torchscript", ROOT / "sample_models" / f"{name}.pt",
                 input_specs(["x".join(map(str, s)) for s in dims], dtypes)),
                ("export", programs_dir / f"{name}.pt2", None)):
            path = out_dir / f"{name}-{frontend}.nimble"
            write_artifact(path, compile_model(source, specs, device="cpu").artifact())
            result[f"{name} ({frontend})"] = member_digests(path)
    return result


def base_tree(ref: str, work: Path) -> Path:
    """The package tree of `ref`: nimble/ = core/, nimble/formats = formats/, nimble/cli = nimble_cli/."""
    checkout = work / "checkout"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(checkout), ref], check=True,
                   capture_output=True)
    package = work / "site" / "nimble"
    shutil.copytree(checkout / "core", package)
    shutil.copytree(checkout / "formats", package / "formats")
    shutil.copytree(checkout / "nimble_cli", package / "cli")
    return work / "site"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="git ref to compare the working tree with")
    parser.add_argument("--ignore-pass-log", action="store_true",
                        help="compare the manifest without its pass log (a change to the pass list itself)")
    parser.add_argument("--emit", type=Path, help=argparse.SUPPRESS)  # write this side's digests here
    parser.add_argument("--programs", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        programs_dir = args.programs or tmp / "programs"
        programs(programs_dir)
        if args.emit:
            args.emit.write_text(json.dumps(emit(programs_dir, tmp / "out"), indent=1))
            return 0
        if not args.base:
            parser.error("give --base REF (or --emit FILE)")
        site = base_tree(args.base, tmp)
        try:
            env = dict(os.environ, PYTHONPATH=str(site))
            subprocess.run([sys.executable, __file__, "--emit", str(tmp / "base.json"), "--programs", str(programs_dir)],
                           check=True, env=env, cwd=tmp)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmp / "checkout")],
                           capture_output=True)
        base = json.loads((tmp / "base.json").read_text())
        now = emit(programs_dir, tmp / "now")
    differ = []
    for artifact in sorted(set(base) | set(now)):
        b, n = base.get(artifact, {}), now.get(artifact, {})
        members = sorted(m for m in set(b) | set(n) if b.get(m) != n.get(m)
                         and not (args.ignore_pass_log and m == "manifest.json"))
        print(f"{artifact}: {'identical' if not members else 'DIFFERS in ' + ', '.join(members)}")
        differ += members
    print(f"{len(now)} artifacts, {'all byte-identical' if not differ else f'{len(differ)} members differ'} "
          f"against {args.base}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
