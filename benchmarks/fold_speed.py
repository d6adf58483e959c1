"""Do the load's memory savings cost speed? Each artifact loaded in one process, `--tune off`
(the planned streams), on CUDA: as nimble loads it; with the planned streams not folded onto fewer
CUDA streams (`plan/capped.fold`); with results outside the arena kept to the end of capture rather
than released after their last reader (`streams.release_plan`); with max pooling left to
PyTorch (which allocates its result and int64 indices, then copies) rather than the generated
kernel (`reductions.max_pool2d`); and with every weight and input buffer allocated on its own
rather than packed into one allocation per group (`regions.pack`).

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
    from nimble.plan import capped
    from nimble.runtime.placed import placement
    from nimble.runtime.base import regions, streams
    from nimble.runtime.base.timing import gpu_ms

    folded, release, pack, pool = capped.fold, streams.release_plan, regions.pack, placement.SUBSTITUTES.copy()

    def one_by_one(tensors, device, memory_format=torch.preserve_format, blank=None):
        return {**{k: t.to(device).contiguous(memory_format=memory_format) if memory_format == torch.channels_last
                   else t.to(device) for k, t in tensors.items()},
                **{k: torch.empty(n, dtype=torch.uint8, device=device) for k, n in (blank or {}).items()}}

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GPU-bound ms, --tune off")
    for path in sys.argv[1:]:
        for variant in ("as loaded", "unfolded", "kept", "PyTorch pooling", "unpacked") * 2:
            capped.fold = folded if variant != "unfolded" else (lambda order, stream_of, waits, cap=None: list(stream_of))
            streams.release_plan = release if variant != "kept" else (lambda graph, order, stream_of: {})
            regions.pack = pack if variant != "unpacked" else one_by_one
            placement.SUBSTITUTES.clear()
            placement.SUBSTITUTES.update(pool)
            if variant == "PyTorch pooling":
                del placement.SUBSTITUTES["aten::max_pool2d.default"]
            torch.cuda.empty_cache()
            with nimble.load(path, device="cuda", tune="off") as exe:
                f = exe.stats.footprint
                ms = gpu_ms(exe.replay, torch.device("cuda"), 50, 15, warmup=10)
                print(f"{Path(path).name} {variant}: {len(set(exe._stream_of))} CUDA streams, {ms:.4f} ms, pool "
                      f"{sum(f.pool_segments_per_stream.values())} segments {(f.pool_free + f.outside_arena) / 2**20:.1f} "
                      f"MiB, other {f.other_allocated / 2**20:.1f} MiB, growth {f.growth / 2**20:.1f} MiB", flush=True)
    capped.fold, streams.release_plan, regions.pack = folded, release, pack
    return 0


if __name__ == "__main__":
    sys.exit(main())
