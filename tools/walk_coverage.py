"""Which kernels a real load launches that a prebuild's walk did not find (GPU machine).

    python tools/walk_coverage.py [--dump DIR] ARTIFACT [ARTIFACT ...]

For each artifact, in empty caches: the walk (`runtime/prebuild.walk`) for this GPU, then a real
load that notes every generated kernel launch the walk did not find. Prints the counts and, for
the first few misses, whether the walk knew the kernel's source (then the walk's signature beside
the load's: what differs) or not (then the first lines of the source: which kernel kind).
Every miss is a kernel built at load, one at a time, after the parallel prebuild. With --dump,
DIR/<artifact>/ gets each missed kernel's source (`missed-<digest>.py`) and the walk's sources of
the same kind (`walk-<digest>.py`), to diff.
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile
import time
import traceback


def main(paths: list[str], dump: str | None = None) -> None:
    os.environ["NIMBLE_CACHE_DIR"] = tempfile.mkdtemp()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
    import torch

    import nimble
    from nimble.formats import read_artifact
    from nimble.runtime import prebuild
    from nimble.runtime.base.claimed import walking
    from nimble.runtime.kernels import binaries, generated

    device = torch.device("cuda", 0)
    missed: dict[tuple, str] = {}
    stacks: dict[tuple, str] = {}  # where in nimble each missed launch came from
    found: dict = {}
    launch = generated.Generated.launch

    def noting(self, grid, args, constants):
        if not walking():
            key = (self.digest, binaries.specialisation(args, constants))
            if key not in found and key not in missed:
                missed[key] = self.source
                stacks[key] = " < ".join(f"{f.name}:{f.lineno}" for f in reversed(traceback.extract_stack()[-14:-1]))
        return launch(self, grid, args, constants)

    generated.Generated.launch = noting
    for path in paths:
        found.clear()
        missed.clear()
        found.update(prebuild.walk(read_artifact(path), prebuild.local_target(device), device))
        by_source = collections.defaultdict(list)
        for source, signature in found:
            by_source[source].append(signature)
        t = time.perf_counter()
        exe = nimble.load(path, "cuda")
        fallbacks = list(exe.stats.kernel_fallbacks)
        exe.close()
        print(f"{path}: walk found {len(found)}, the load launched {len(missed)} more "
              f"({len({s for s, _ in missed if s not in by_source})} of unknown source); load {time.perf_counter() - t:.1f} s")
        for line in fallbacks[:6]:
            print(f"  fell back: {line}")
        kinds = collections.Counter(_kind(text) for text in missed.values())
        for kind, n in kinds.most_common(6):
            print(f"  {n} missed of kind: {kind}")
        if dump:
            _dump(os.path.join(dump, os.path.basename(path)), missed, found)
        for (source, signature), text in list(missed.items())[:4]:
            print(f"  missed k{source}: {signature[:240]}")
            print(f"    launched from: {stacks[(source, signature)]}")
            if source in by_source:
                print(f"    the walk's:  {by_source[source][0][:240]}")
            else:
                print("    source: " + " | ".join(line.strip() for line in text.splitlines()[:6])[:400])


def _dump(folder: str, missed: dict, found: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    kinds = {_kind(text) for text in missed.values()}
    for (source, _), text in missed.items():
        with open(os.path.join(folder, f"missed-{source}.py"), "w") as f:
            f.write(text)
    for (source, _), (kernel, _, _) in found.items():
        if _kind(kernel.source) in kinds:
            with open(os.path.join(folder, f"walk-{source}.py"), "w") as f:
                f.write(kernel.source)


def _kind(text: str) -> str:
    """A kernel's kind, by its parameter list (`def kernel(out_ptr, w_ptr, in0_ptr, x0_ptr, ...`)."""
    for line in text.splitlines():
        if line.startswith("def kernel("):
            return line[len("def kernel("):][:70]
    return "?"


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["--dump"]:
        main(argv[2:], argv[1])
    else:
        main(argv)
