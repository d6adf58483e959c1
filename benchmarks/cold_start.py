"""Load to first inference on a GPU machine: cold (empty caches), warm, and with a kernel pack.

    python benchmarks/cold_start.py --out DIR [--models resnet50 densenet121 bert-base ...] [--artifacts A.nimble ...]
                                    [--modes source,warm,pack] [--work W] [--profile]
                                    [--peers resnet50 ...] [--peer-modes compile,aoti]
                                    [--set KEY=VALUE ...] [--tune off|cached|full]

--models takes any model of the peers suite (`peers.py`: torchvision's, the samples, vit_b_16,
swin_t, bert-base, gpt2), traced at batch 1 and compiled into --work (a new temporary folder by
default; a model compiled there before is used again). --profile also writes a cProfile of each
row (DIR/MODEL.MODE.prof.txt; its times then include the profiler's cost). --set and --tune load
nimble's rows with those settings and that tuning mode (to measure what a setting costs a load).

Each row is one fresh process (`python -c` of this file's `child`), timed from after `import
torch` and CUDA's start to the first inference's result on the host:

- source: empty `NIMBLE_CACHE_DIR` and `TRITON_CACHE_DIR`; the load finds its kernels (a prebuild's
  walk) and builds them all at once on the machine's cores;
- warm: a second process on the caches `source` left;
- pack: empty caches, `nimble.load(..., kernels=PACK)` with the pack `nimble compile --gpu-arch`
  built with no GPU visible (`CUDA_VISIBLE_DEVICES=` for the --models built here; packs built
  on the CPU builder are passed with --artifacts A.nimble, the pack beside each). Its outputs on the stored sample input are compared with `source`'s.

With --peers, beside them: torch.compile(mode="reduce-overhead") first call with an empty Inductor
and Triton cache, then with its portable cache (`torch.compiler.save_cache_artifacts` in the cold
process, `load_cache_artifacts` in a fresh one with empty caches), and AOTInductor
(`aoti_compile_and_package` once, then `aoti_load_package` in a fresh process).

Writes DIR/cold_start.json (GPU, versions, date) after every row, so a run stopped by its time
limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def child(mode: str, artifact: str, pack: str, save: str, profile: str = "") -> dict:
    t0 = time.perf_counter()
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    started = time.perf_counter()
    import nimble
    from nimble.runtime.kernels import generated

    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    from nimble.runtime.base.settings import Settings

    changed = os.environ.get("COLD_START_SET", "").split()  # --set, --tune: passed through the environment
    exe = nimble.load(artifact, "cuda", kernels=pack if mode == "pack" else None,
                      tune=os.environ.get("COLD_START_TUNE", "cached"), settings=Settings.parse(changed) if changed else None)
    art = exe.artifact
    sample = [t.to("cuda") for t in art.sample_inputs]
    outs = exe.run(*sample)
    torch.cuda.synchronize()
    first = [o.float().cpu() for o in outs]
    done = time.perf_counter()
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(100)
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
        Path(profile).write_text(text.getvalue())
    torch.save(first, save)
    p = exe.stats.prebuilt
    return {"mode": mode, "load_to_first_s": round(done - started, 3), "cuda_start_s": round(started - t0, 3),
            "stages": {k: round(v, 3) for k, v in exe.stats.seconds.items()},
            "kernels": None if p is None else {"found": p.found, "cached": p.cached, "from_pack": p.from_pack,
                                               "built": p.built, "failed": len(p.failed), "seconds": round(p.seconds, 3),
                                               "walked": p.walked,
                                               "stages": {k: round(v, 3) for k, v in p.stages.items()}},
            "built_at_first_launch": exe.stats.kernels_generated,
            "compiled_at_launch": generated.STATS.compiled,
            "recalled": exe.stats.kernel_binaries_recalled,
            "choice": exe.stats.choice, "tuning": exe.stats.tuning, "tuning_ms": exe.stats.tuning_ms,
            "tuning_s": {k: round(v, 3) for k, v in exe.stats.tuning_seconds.items()}}


def peer_child(mode: str, model: str, batch: int, save: str) -> dict:
    import torch
    import torchvision

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    m = getattr(torchvision.models, model)().eval().cuda()
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    started = time.perf_counter()
    with torch.no_grad():
        if mode.startswith("aoti"):
            if mode == "aoti-build":
                ep = torch.export.export(m, (x,))
                torch._inductor.aoti_compile_and_package(ep, package_path=save)
            else:
                runner = torch._inductor.aoti_load_package(save)
                runner(x)
        else:
            if mode == "compile-warm":
                torch.compiler.load_cache_artifacts(Path(save).read_bytes())
            f = torch.compile(m, mode="reduce-overhead")
            f(x)
            if mode == "compile-cold":
                got = torch.compiler.save_cache_artifacts()
                if got is not None:
                    Path(save).write_bytes(got[0])
    torch.cuda.synchronize()
    return {"mode": mode, "load_to_first_s": round(time.perf_counter() - started, 3)}


def fresh(args: list[str], caches: dict, timeout: int = 560) -> dict:
    env = dict(os.environ, **caches)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-X", "faulthandler", str(HERE), *args], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        text = r.stderr or r.stdout
        fatal = text.find("Fatal Python error")  # a crash: faulthandler's stack, not its module list, says where
        return {"error": text[fatal:fatal + 2000] if fatal >= 0 else text[-600:], "exit": r.returncode,
                "process_s": round(time.perf_counter() - t, 2)}
    got = json.loads(lines[-1][7:])
    got["process_s"] = round(time.perf_counter() - t, 2)
    got["stderr"] = [ln for ln in r.stderr.splitlines() if ln.startswith("nimble:")][:5]
    return got


def export(model: str, folder: Path, pack: bool) -> Path:
    """A model of the peers suite (torchvision, the samples, vision transformers, BERT-base, GPT-2)
    at batch 1, traced and compiled with its kernel pack, no GPU visible; one compiled before in
    `folder` is used as it is."""
    import torch

    out = folder / f"{model}.nimble"
    if out.exists() and (Path(f"{out}.kernels").exists() or not pack):
        return out
    sys.path.insert(0, str(HERE.parent))
    from peers import make_inputs

    from nimble.frontend import quiet_torchscript

    m, xs = make_inputs(model, 1)
    script = folder / f"{model}.pt"
    with quiet_torchscript(), torch.no_grad():
        torch.jit.trace(m, tuple(xs), check_trace=False).save(script)
    inputs = [a for x in xs for a in ("--shape", "x".join(map(str, x.shape)), "--dtype", str(x.dtype).removeprefix("torch."))]
    cmd = [sys.executable, "-c", "from nimble_cli.entry import main; main()", "compile", str(script), *inputs, "-o", str(out),
           "--device", "cpu"] + (["--gpu-arch", "sm_90"] if pack else [])
    t = time.perf_counter()
    r = subprocess.run(cmd, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"compile of {model} failed: {r.stderr[-800:]}")
    print(f"compiled {model} with its pack in {time.perf_counter() - t:.1f} s (no GPU visible)", flush=True)
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("child", "peer"):
        got = child(*sys.argv[2:7]) if sys.argv[1] == "child" else peer_child(sys.argv[2], sys.argv[3],
                                                                                int(sys.argv[4]), sys.argv[5])
        print("RESULT " + json.dumps(got), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", nargs="*", default=[])
    ap.add_argument("--artifacts", nargs="*", default=[])
    ap.add_argument("--peers", nargs="*", default=[], help="torchvision models to time the peers on")
    ap.add_argument("--modes", default="source,warm,pack")
    ap.add_argument("--peer-modes", default="compile,aoti", help="the peers to time: compile, aoti or both")
    ap.add_argument("--work", type=Path, help="where the models are compiled (default a new temporary folder); "
                    "a model compiled there by an earlier run is used again")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="load settings for nimble's rows (`Settings.parse`), as `nimble bench --set` takes them")
    ap.add_argument("--tune", default="cached", choices=["off", "cached", "full"], help="nimble's rows' tuning")
    ap.add_argument("--profile", action="store_true", help="also run each row under cProfile: DIR/MODEL.MODE.prof.txt "
                    "(the 100 functions with the most cumulative time, then the 40 with the most own time; the row's seconds include the profiler's cost)")
    a = ap.parse_args()
    import torch

    a.out.mkdir(parents=True, exist_ok=True)
    work = a.work or Path(tempfile.mkdtemp(prefix="cold_start_"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": str(datetime.date.today()),
            "cores": len(os.sched_getaffinity(0))}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass

    def save() -> None:  # after every row: a run stopped by its time limit keeps what it measured
        (a.out / "cold_start.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    os.environ.update(COLD_START_SET=" ".join(a.set), COLD_START_TUNE=a.tune)  # the children inherit them
    meta.update({"set": a.set, "tune": a.tune})
    paths = [Path(p) for p in a.artifacts] + [export(m, work, True) for m in a.models]
    for path in paths:
        with tempfile.TemporaryDirectory() as c1, tempfile.TemporaryDirectory() as c2:
            caches = {"NIMBLE_CACHE_DIR": c1, "TRITON_CACHE_DIR": c2}
            row = {"model": path.stem, "artifact_bytes": path.stat().st_size}
            pack = Path(f"{path}.kernels")
            row["pack_bytes"] = pack.stat().st_size if pack.exists() else None
            def prof(mode: str, stem: str = path.stem) -> str:
                return str(a.out / f"{stem}.{mode}.prof.txt") if a.profile else ""
            for mode in a.modes.split(","):
                if mode == "pack" and not pack.exists():
                    continue
                if mode == "pack":
                    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
                        row[mode] = fresh(["child", mode, str(path), str(pack), str(work / f"{path.stem}.{mode}.pt"), prof(mode)],
                                          {"NIMBLE_CACHE_DIR": d1, "TRITON_CACHE_DIR": d2})
                else:
                    row[mode] = fresh(["child", mode, str(path), "", str(work / f"{path.stem}.{mode}.pt"), prof(mode)], caches)
                print(path.stem, mode, json.dumps(row[mode]), flush=True)
            if (work / f"{path.stem}.pack.pt").exists() and (work / f"{path.stem}.source.pt").exists():
                a_, b_ = torch.load(work / f"{path.stem}.pack.pt"), torch.load(work / f"{path.stem}.source.pt")
                row["pack_vs_source_max_abs"] = max(float((x - y).abs().max()) for x, y in zip(a_, b_))
                print(path.stem, "pack vs source max abs", row["pack_vs_source_max_abs"], flush=True)
            rows.append(row)
            save()
    if a.peers:
        for model in a.peers:
            row = {"model": f"{model} (peers)"}
            blob = str(work / f"{model}.megacache")
            for mode in ("compile-cold", "compile-warm") if "compile" in a.peer_modes.split(",") else ():
                with tempfile.TemporaryDirectory() as c1:  # empty caches each; the warm one loads the cold one's blob
                    caches = {"TORCHINDUCTOR_CACHE_DIR": c1 + "/i", "TRITON_CACHE_DIR": c1 + "/t"}
                    row[mode] = fresh(["peer", mode, model, "1", blob], caches)
            pkg = str(work / f"{model}.pt2")
            for mode in ("aoti-build", "aoti-load") if "aoti" in a.peer_modes.split(",") else ():
                with tempfile.TemporaryDirectory() as c1:  # the load on empty caches, as on a fresh machine
                    caches = {"TORCHINDUCTOR_CACHE_DIR": c1 + "/i", "TRITON_CACHE_DIR": c1 + "/t"}
                    row[mode] = fresh(["peer", mode, model, "1", pkg], caches)
            print(json.dumps(row), flush=True)
            rows.append(row)
            save()
    save()
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
