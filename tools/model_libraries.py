"""Install timm, torchvision and transformers beside the torch that is installed, never replacing it.

    python tools/model_libraries.py [--dry-run] [--find-links DIR] [--libraries transformers timm torchvision]

A plain `pip install timm transformers` may swap a CPU torch for a CUDA build of another version
(gigabytes), and the registry's torchvision is a CUDA build that fails at import beside a CPU
torch (`operator torchvision::nms does not exist`). So this:

1. holds torch where it is with a constraints file (`torch==<installed version>`);
2. takes the torchvision that pairs with it (torch 2.N pairs with torchvision 0.(N+15)): for a CPU
   torch, the CPU build from PyTorch's CPU index, asked once with a short timeout, so that an
   unreachable index costs seconds, not minutes of retries; a `--find-links` folder of wheels is
   tried first;
3. installs transformers, and timm where torchvision is there (timm imports it), under the same
   constraints;
4. checks the result: torch unchanged, torchvision's C++ ops loaded, each library imported.

Exit 0 when every library asked for works; 1 with one line per library that could not be had and
why (transformers alone serves BERT and GPT-2; timm needs torchvision).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

CPU_INDEX = os.environ.get("NIMBLE_CPU_INDEX", "https://download.pytorch.org/whl/cpu")


def torch_build() -> tuple[str, bool]:
    """(installed torch version, e.g. 2.13.0+cpu; whether it is a CPU build)."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda or '')"],
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0], len(out) == 1


def torchvision_for(torch_version: str) -> str:
    """The torchvision release that pairs with a torch release: 2.N.x -> 0.(N+15).x."""
    major, minor, patch = (torch_version.split("+")[0].split(".") + ["0"])[:3]
    if major != "2":
        raise SystemExit(f"torch {torch_version}: this script pairs torch 2.x only")
    return f"0.{int(minor) + 15}.{patch}"


def reachable(url: str, timeout: float = 5.0) -> str | None:
    """None if `url` answers within `timeout` seconds, else why not."""
    try:
        urllib.request.urlopen(url, timeout=timeout).close()
        return None
    except (urllib.error.URLError, OSError, ValueError) as e:
        return str(getattr(e, "reason", e))


def pip(args: list[str], dry_run: bool) -> bool:
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *args]
    print("  $", " ".join(cmd), flush=True)
    return dry_run or subprocess.run(cmd).returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--libraries", nargs="+", default=["transformers", "torchvision", "timm"],
                        choices=["transformers", "torchvision", "timm"])
    parser.add_argument("--find-links", help="a folder of wheels to try first (torchvision's CPU build, say)")
    parser.add_argument("--dry-run", action="store_true", help="say what would be installed, install nothing")
    args = parser.parse_args()
    version, cpu = torch_build()
    vision = torchvision_for(version)
    wanted = set(args.libraries) | ({"torchvision"} if "timm" in args.libraries else set())
    print(f"torch {version} ({'CPU' if cpu else 'CUDA'} build) is kept; torchvision {vision} pairs with it")
    missing: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        constraints = os.path.join(tmp, "constraints.txt")
        with open(constraints, "w") as f:
            f.write(f"torch=={version}\n")
        links = ["--find-links", args.find_links] if args.find_links else []
        if "torchvision" in wanted:
            if cpu:  # the registry's torchvision is a CUDA build: the CPU index's, or a local wheel
                why = reachable(CPU_INDEX + "/torchvision/")
                sources = links + ([] if why else ["--extra-index-url", CPU_INDEX])
                if not links and why:
                    missing["torchvision"] = (f"PyTorch's CPU index ({CPU_INDEX}) is unreachable ({why}), and the "
                                              "registry's torchvision is a CUDA build that fails beside a CPU torch; "
                                              "pass --find-links with a folder holding "
                                              f"torchvision-{vision}+cpu, or retry where the index is reachable")
                elif not pip(["--no-deps", "--retries", "1", "--timeout", "15", *sources,
                              f"torchvision=={vision}+cpu" if not links else f"torchvision=={vision}",
                              "pillow"], args.dry_run):
                    missing["torchvision"] = f"pip could not install torchvision {vision} for a CPU torch"
            elif not pip(["-c", constraints, *links, f"torchvision=={vision}"], args.dry_run):
                missing["torchvision"] = f"pip could not install torchvision {vision} beside torch {version}"
        with open(constraints, "a") as f:
            if "torchvision" not in missing and "torchvision" in wanted and not args.dry_run:
                installed = subprocess.run([sys.executable, "-c", "import torchvision; print(torchvision.__version__)"],
                                           capture_output=True, text=True).stdout.strip()
                if installed:
                    f.write(f"torchvision=={installed}\n")
        if "transformers" in wanted and not pip(["-c", constraints, *links, "transformers"], args.dry_run):
            missing["transformers"] = "pip could not install transformers beside this torch"
        if "timm" in wanted:
            if "torchvision" in missing:
                missing["timm"] = "timm imports torchvision, which could not be had (above)"
            elif not pip(["-c", constraints, *links, "timm"], args.dry_run):
                missing["timm"] = "pip could not install timm beside this torch"
    if not args.dry_run:
        now, _ = torch_build()
        if now != version:
            print(f"error: torch changed from {version} to {now}; reinstall torch=={version}", file=sys.stderr)
            return 1
        checks = {"torchvision": "import torch, torchvision; torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)",
                  "transformers": "import transformers.modeling_outputs", "timm": "import timm; timm.create_model('resnet18')"}
        for lib in sorted(wanted - set(missing)):
            done = subprocess.run([sys.executable, "-c", checks[lib]], capture_output=True, text=True)
            if done.returncode != 0:
                missing[lib] = f"installed but does not import: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
    for lib, why in missing.items():
        print(f"{lib}: not installed: {why}", file=sys.stderr)
    ok = [lib for lib in sorted(wanted) if lib not in missing]
    print(f"{'would install' if args.dry_run else 'working'}: {', '.join(ok) or 'nothing'}; torch {version} kept")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
