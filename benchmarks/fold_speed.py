"""Do the capture-time memory savings cost speed? Each artifact loaded in one process, `--tune off`
(the planned streams), on CUDA: as nimble loads it; with the planned streams not folded onto fewer
CUDA streams (`streams.fold`); and with results outside the arena kept to the end of capture
rather than released after their last reader (`placement.release_plan`).

    python benchmarks/fold_speed.py ARTIFACT [ARTIFACT ...]

Prints, per artifact and variant (each twice): CUDA streams used, GPU-bound ms (50 back-to-back
replays between CUDA events, median of 15 runs), the graph pool and the footprint."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    import torch

    import nimble
    from nimble.runtime import streams
    from nimble.runtime import executable
    from nimble.runtime.tuning import gpu_ms

    folded, release = streams.fold, executable.release_plan
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GPU-bound ms, --tune off")
    for path in sys.argv[1:]:
        for variant in ("as loaded", "unfolded", "kept", "as loaded", "unfolded", "kept"):
            streams.fold = folded if variant != "unfolded" else (lambda order, stream_of, waits: list(stream_of))
            executable.release_plan = release if variant != "kept" else (lambda graph, order, stream_of: {})
            torch.cuda.empty_cache()
            with nimble.load(path, device="cuda", tune="off") as exe:
                f = exe.stats.footprint
                ms = gpu_ms(exe.replay, torch.device("cuda"), 50, 15, warmup=10)
                print(f"{Path(path).name} {variant}: {len(set(exe._stream_of))} CUDA streams, {ms:.4f} ms, pool "
                      f"{sum(f.pool_segments_per_stream.values())} segments {(f.pool_free + f.outside_arena) / 2**20:.1f} "
                      f"MiB, other {f.other_allocated / 2**20:.1f} MiB, growth {f.growth / 2**20:.1f} MiB", flush=True)
    streams.fold, executable.release_plan = folded, release
    return 0


if __name__ == "__main__":
    sys.exit(main())
