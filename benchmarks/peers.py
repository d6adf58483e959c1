"""nimble against torch.compile on a GPU: two figures per variant, batch 1 and 8, fp32, every output checked.

    python benchmarks/peers.py --out DIR [--models resnet50 inception_v3 ...] [--batches 1 8]
    python benchmarks/peers.py --report DIR/peers_*.json --out benchmarks/results   # merge, no GPU
    python benchmarks/peers.py --precision fp16|bf16 --out DIR [--models ...] [--batches 1 8]

Per model and batch, in one process, it times: eager PyTorch; torch.compile(mode="reduce-overhead")
with its compile time; nimble as it was before fused ops (`--no-fuse`, `--tune off`: one aten op
per op, contiguous layout, the planned streams); and nimble (fused ops, layout and streams timed at
load). Each variant gets two figures, as medians:

- GPU-bound: 50 back-to-back calls between two CUDA events, per call (median of 15 such runs);
- latency: copy the input in (nimble) or pass it (the others), run, synchronize (median of 200).

Also recorded: kernels per inference (kernel nodes in nimble's captured CUDA graph), nimble's
load-time choice and the timings behind it, its load breakdown, load to first inference with an
empty and a warm kernel and tuning cache (in a fresh process, after `import torch`), and parity
with eager of every variant and of nimble under every layout and stream choice forced (TF32
tolerances).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

TORCHVISION = {"resnet50": 224, "inception_v3": 299, "googlenet": 224, "mobilenet_v2": 224,
               "efficientnet_b0": 224, "squeezenet1_1": 224, "densenet121": 224}
VISION_TRANSFORMERS = {"vit_b_16": 224, "swin_t": 224}  # torchvision's, random weights
VARIANTS = ("eager", "torch_compile", "nimble_unfused", "nimble")
MODELS = [*TORCHVISION, "inception", "nasnet", "resnet", "mobilenet", "transformer", *VISION_TRANSFORMERS,
          "bert-base", "gpt2"]  # the default sweep


def make_model(name: str):
    import torch

    if name in TORCHVISION:
        import torchvision

        from frontend_parity import MODELS

        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(weights=None, **MODELS[name][1]).eval()
        return model, [(3, TORCHVISION[name], TORCHVISION[name])]
    from sample_models.build import MODELS as SAMPLES, build_module

    if name in SAMPLES:
        return build_module(name), [s[1:] for s in SAMPLES[name][1]]
    import torchvision  # any other torchvision classification model (sweep.py's), 224 px

    torch.manual_seed(0)
    size = VISION_TRANSFORMERS.get(name, 224)
    return torchvision.models.get_model(name, weights=None).eval(), [(3, size, size)]


HUGGING_FACE = ("bert-base", "gpt2")  # hf_trust.py's: real configurations, random weights, 128 tokens


def make_inputs(name: str, batch: int):
    """(the model, its inputs at `batch` on the CPU): random images, or for the Hugging Face
    models token ids and a mask that pads the last 16 positions."""
    import torch

    if name in HUGGING_FACE:
        from hf_trust import ByName, build

        model, (ids, mask), _ = build(name)
        return ByName(model, tuples=True), [ids.repeat(batch, 1), mask.repeat(batch, 1)]
    model, shapes = make_model(name)
    torch.manual_seed(1)
    return model, [torch.randn(batch, *s) for s in shapes]


def gpu_bound_ms(call, calls: int = 50, repeats: int = 15) -> float:
    import torch

    from nimble.runtime.base.timing import gpu_ms

    return gpu_ms(call, torch.device("cuda"), calls, repeats, warmup=10)



def torch_compile(module, xs, row: dict, record, mode: str = "reduce-overhead", variant: str = "torch_compile"):
    """torch.compile(mode=`mode`) of `module`: its first three calls (the compile) timed into
    row[f"{variant}_s"], then `record`ed as `variant`; (the compiled module, its last output)."""
    import torch

    torch._dynamo.reset()
    compiled = torch.compile(module, mode=mode)
    t = time.perf_counter()
    for _ in range(3):
        out = compiled(*xs)
    torch.cuda.synchronize()
    row[f"{variant}_s"] = time.perf_counter() - t
    record(variant, lambda: compiled(*xs))
    return compiled, out


def kernels_per_inference(art, choice, tmp: Path, **kwargs) -> int:
    from nimble.runtime.executable import Executable
    from nimble.runtime.base.streams import count_kernels

    dump = tmp / "graph.dot"
    Executable(art, "cuda", choice=choice, graph_dump=str(dump), **kwargs)
    return count_kernels(dump)


PROBE = """
import sys, time
import torch
from nimble.runtime.opening import load
t = time.perf_counter()
exe = load(sys.argv[1], "cuda")
x = torch.randn(exe.input_buffers[0].shape, device="cuda")
exe(x)
torch.cuda.synchronize()
print(time.perf_counter() - t, exe.stats.choice, exe.stats.tuning)
"""


def first_inference_s(path: Path, cache: Path) -> dict:
    """Load to first inference in a fresh process (after import torch): empty caches, then warm."""
    env = dict(os.environ, NIMBLE_CACHE_DIR=str(cache / "nimble"), TRITON_CACHE_DIR=str(cache / "triton"))
    out = {}
    for label in ("cold", "warm"):
        text = subprocess.run([sys.executable, "-c", PROBE, str(path)], env=env, capture_output=True, text=True,
                              check=True).stdout.split()
        out[label] = float(text[0])
    return out


PASS_LISTS = ("REWRITES", "LAYOUT", "FUSION")  # the pipeline's lists `--without` may take a pass from


def known_pass(name: str) -> str:
    """`name`, if a pass of the pipeline's lists is called that (`--without`); else exit saying so."""
    from nimble import pipeline

    known = [p.__name__ for attr in PASS_LISTS for p in getattr(pipeline, attr)]
    if name not in known:
        raise SystemExit(f"--without {name}: no such pass; the pipeline's passes are {', '.join(known)}")
    return name


@contextlib.contextmanager
def without_pass(name: str):
    """The pipeline running every pass but the one called `name`, inside the block."""
    from unittest import mock

    from nimble import pipeline

    with contextlib.ExitStack() as stack:
        for attr in PASS_LISTS:
            kept = tuple(p for p in getattr(pipeline, attr) if p.__name__ != name)
            stack.enter_context(mock.patch.object(pipeline, attr, kept))
        yield


def setting(text: str):
    """`--set NAME=VALUE` (a runtime setting, `nimble/runtime/base/settings.py`): the Settings it
    names on top of the defaults. Its measured choices are cached under a key of their own."""
    from nimble.errors import UsageError
    from nimble.runtime.base.settings import Settings

    try:
        return Settings.parse([text])
    except UsageError as e:
        raise SystemExit(f"--set {e}") from None


def bench_one(name: str, batch: int, tmp: Path, without: tuple[str, ...] = (), settings: tuple = ()) -> dict:
    """One model at fp32, every variant in this process. Also, compiled and tuned as `nimble`:
    `without` each pass named (the variant `nimble_without_<pass>`), and loaded under each of
    `settings` (`Settings`, from `setting`: the variant `nimble_set_<what it changes>`)."""
    import torch

    from nimble.formats import read_artifact, write_artifact
    from nimble.frontend import quiet_torchscript
    from nimble.pipeline import compile_model
    from nimble.runtime.tune import choices as tuning
    from nimble.runtime.base.compare import compare
    from nimble.runtime.executable import Executable
    from nimble.specs import input_specs

    model, xs_cpu = make_inputs(name, batch)
    xs = [x.cuda() for x in xs_cpu]
    row: dict = {"model": name, "batch": batch, "gpu_bound_ms": {}, "latency_ms": {}, "check": {}}

    def record(variant, call, sync_call=None):
        row["gpu_bound_ms"][variant] = gpu_bound_ms(call)
        row["latency_ms"][variant] = report.median_ms(sync_call or call)

    with torch.no_grad():
        gpu_model = model.cuda()
        ref = gpu_model(*xs)
        ref = [ref] if isinstance(ref, torch.Tensor) else list(ref)
        record("eager", lambda: gpu_model(*xs))
        with quiet_torchscript():
            traced = torch.jit.trace(model.cpu(), tuple(xs_cpu))
            pt = tmp / f"{name}_{batch}.pt"
            torch.jit.save(traced, str(pt))
        compiled, out = torch_compile(model.cuda(), xs, row, record)
        out = [out] if isinstance(out, torch.Tensor) else list(out)
        row["check"]["torch_compile"] = compare([o.clone() for o in out], ref, 1e-2, 1e-3).max_rel
        del compiled
        torch._dynamo.reset()

    specs = input_specs(["x".join(map(str, x.shape)) for x in xs_cpu],
                        [str(x.dtype).removeprefix("torch.") for x in xs_cpu])
    variants = [("nimble_unfused", False, None, None), ("nimble", True, None, None),
                *((f"nimble_without_{p}", True, lambda p=p: without_pass(p), None) for p in without),
                *((f"nimble_set_{s.describe()}", True, None, s) for s in settings)]
    for variant, fuse, context, chosen in variants:
        extra = variant != "nimble" and fuse
        with context() if context else contextlib.nullcontext():
            c = compile_model(pt, specs, device="cpu", streams="auto", fuse=fuse)
            path = tmp / f"{name}_{batch}_{variant}.nimble"
            write_artifact(path, c.artifact())
            art = read_artifact(path)
            exe = Executable(art, "cuda", tune="off" if not fuse else "full", settings=chosen)
            row["check"][variant] = compare(exe.run(*xs), ref, 1e-2, 1e-3).max_rel
            record(variant, exe.replay, lambda: exe(*xs, copy=False))
            row.setdefault("ops", {})[variant] = len(c.graph.ops)
            row.setdefault("compile_s", {})[variant] = sum(c.seconds.values())
            choice = exe.choice if fuse else tuning.Choice()
            row.setdefault("kernels", {})[variant] = kernels_per_inference(art, choice, tmp, settings=chosen)
            row.setdefault("load_s", {})[variant] = exe.stats.seconds.get("total")  # in this process, after the others
            if extra:
                row.setdefault("choice_of", {})[variant] = exe.stats.choice
            elif fuse:
                row["choice"], row["tuning_ms"] = exe.stats.choice, exe.stats.tuning_ms
                row["load_breakdown_s"] = exe.stats.seconds
                row["kernel_fallbacks"] = exe.stats.kernel_fallbacks
                row["streams"] = c.schedule.num_streams
                for forced in tuning.candidates(art.graph, art.schedule.num_streams):
                    other = Executable(art, "cuda", choice=forced)
                    row["check"][f"nimble[{forced.describe()}]"] = compare([o.clone() for o in other.run(*xs)], ref,
                                                                           1e-2, 1e-3).max_rel
                    del other
                if name == "inception_v3" and batch == 1:
                    row["first_inference_s"] = first_inference_s(path, tmp / "probe-cache")
            exe = None  # its memory goes before the next variant loads
            torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def bench_reduced(name: str, batch: int, precision: str, tmp: Path, agreement_inputs: int = 256,
                  make=None) -> dict:
    """One model at fp16 or bf16: eager and torch.compile(mode="reduce-overhead") on the module
    cast whole, and nimble compiled with --precision (inputs and outputs in the reduced dtype, as
    the cast module has them; the default tolerance, else --tolerance 1e-2), beside nimble at
    fp32. Each variant's relative L2 error against the fp32 module; for a classifier, the top-1
    agreement with it over `agreement_inputs` random inputs (in batches of `batch`). `make(name,
    batch)` builds the model and its inputs (default `make_inputs`)."""
    import torch

    from nimble.errors import MismatchError
    from nimble.formats import read_artifact, write_artifact
    from nimble.frontend import quiet_torchscript
    from nimble.pipeline import compile_model
    from nimble.runtime.base.compare import relative_l2
    from nimble.runtime.executable import Executable
    from nimble.specs import input_specs

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    model, xs_cpu = (make or make_inputs)(name, batch)

    def lower(x):  # token ids and masks stay integers
        return x.to(dtype) if x.is_floating_point() else x

    xs, low_xs = [x.cuda() for x in xs_cpu], [lower(x.cuda()) for x in xs_cpu]
    row: dict = {"model": name, "batch": batch, "precision": precision, "gpu_bound_ms": {}, "latency_ms": {},
                 "rel_l2": {}, "top1_agreement": {}}

    def record(variant, call, sync_call=None):
        row["gpu_bound_ms"][variant] = gpu_bound_ms(call)
        row["latency_ms"][variant] = report.median_ms(sync_call or call)

    def first(out):
        return out if isinstance(out, torch.Tensor) else out[0]

    # a classifier's top-1 over random images; a language model's (Hugging Face) over its tokens' positions
    agree_xs = [xs_cpu] if name in HUGGING_FACE else \
        [[torch.randn(*x.shape, generator=torch.Generator().manual_seed(100 + k)) for x in xs_cpu]
         for k in range(max(1, agreement_inputs // batch))]
    with torch.no_grad():
        with quiet_torchscript():
            pt = tmp / f"{name}_{batch}.pt"
            torch.jit.save(torch.jit.trace(model.cpu(), tuple(xs_cpu)), str(pt))
        fp32 = model.cuda()
        ref = first(fp32(*xs)).float()
        ref_top1 = [first(fp32(*[x.cuda() for x in ax])).argmax(-1) for ax in agree_xs]
        half = model.cuda().to(dtype)
        record("eager", lambda: half(*low_xs))
        compiled, out = torch_compile(half, low_xs, row, record)
        row["rel_l2"]["torch_compile"] = relative_l2(first(out).float(), ref)
        row["top1_agreement"]["torch_compile"] = sum(
            (first(compiled(*[lower(x.cuda()) for x in ax])).argmax(-1) == r).float().mean().item()
            for ax, r in zip(agree_xs, ref_top1)) / len(agree_xs)
        compiled = half = None  # its graphs go before nimble loads
        torch._dynamo.reset()
        model = model.float()

    specs = input_specs(["x".join(map(str, x.shape)) for x in xs_cpu],
                        [str(x.dtype).removeprefix("torch.") for x in xs_cpu])
    for variant, options in (("nimble_fp32", {}), ("nimble", {"precision": precision, "io_dtype": "reduced"})):
        t = time.perf_counter()
        # the default tolerance, else a search for what 1e-2 needs, else float32 inputs and outputs too
        tries = [options] if not options else [options, {**options, "tolerance": 1e-2},
                                               {**options, "tolerance": 1e-2, "io_dtype": "model"}]
        for k, given_options in enumerate(tries):
            try:
                # the check (and the precision search's runs) on the GPU: minutes on a CPU at batch 8
                c = compile_model(pt, specs, device="cuda" if given_options else "cpu", **given_options)
                break
            except MismatchError as e:
                row.setdefault("compile_errors", []).append(str(e))
                if k == len(tries) - 1:
                    raise
        options = given_options
        if options:
            row["compile_options"] = {k: v for k, v in options.items() if k != "precision"}
        row.setdefault("compile_s", {})[variant] = time.perf_counter() - t
        path = tmp / f"{name}_{batch}_{variant}.nimble"
        write_artifact(path, c.artifact())
        exe = Executable(read_artifact(path), "cuda", tune="full")
        given = low_xs if options.get("io_dtype") == "reduced" else xs
        row["rel_l2"][variant] = relative_l2(first(exe.run(*given)).float(), ref)
        record(variant, exe.replay, lambda: exe(*given, copy=False))
        row["top1_agreement"][variant] = sum(
            (first(exe.run(*[x.cuda().to(g.dtype) for x, g in zip(ax, given)])).argmax(-1) == r).float().mean().item()
            for ax, r in zip(agree_xs, ref_top1)) / len(agree_xs)
        row.setdefault("choice", {})[variant] = exe.stats.choice
        row.setdefault("weights_bytes", {})[variant] = exe.stats.weight_bytes
        row.setdefault("arena_bytes", {})[variant] = exe.memory.arena_bytes
        if options:
            kept = c.precision["fp32_ops"]
            row["fp32_ops"] = len(kept)
            row["fp32_ops_searched"] = sum(o["why"] == "kept" for o in kept)
            row["floating_ops"] = c.precision["floating_ops"]
        exe.close()  # its memory goes back to the device before the next variant loads
    print(json.dumps(row), flush=True)
    return row


def summary_reduced(rows: list[dict], meta: dict) -> str:
    head = ["model", "batch", "precision", "torch.compile GPU-bound", "nimble GPU-bound", "ratio",
            "torch.compile latency", "nimble latency", "ratio", "nimble fp32 GPU-bound", "fp32 / reduced",
            "ops in fp32 (searched)", "nimble options", "rel L2 nimble", "rel L2 torch.compile", "top-1 nimble", "top-1 torch.compile"]
    lines = [f"Reduced precision on {meta['gpu']}, torch {meta['torch']}, {meta['date']}. Command: "
             f"`{meta['command']}`. torch.compile(mode=\"reduce-overhead\") and eager run the module cast whole; "
             "nimble runs its --precision artifact with --io-dtype reduced (the same half inputs). Milliseconds "
             "per inference, medians, one process. GPU-bound: 50 back-to-back calls between CUDA events (median "
             "of 15); latency: copy in, run, synchronize (median of 200). ratio = nimble / torch.compile (target "
             "0.9 GPU-bound). rel L2 = relative L2 error of the first output against the fp32 module; top-1 = "
             "agreement of the argmax with the fp32 module over 256 random inputs.", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in sorted(rows, key=lambda r: (r["model"], r["precision"], r["batch"])):
        g, lat = r["gpu_bound_ms"], r["latency_ms"]
        cells = [r["model"], str(r["batch"]), r["precision"], f"{g['torch_compile']:.3f}", f"{g['nimble']:.3f}",
                 f"{g['nimble'] / g['torch_compile']:.2f}", f"{lat['torch_compile']:.3f}", f"{lat['nimble']:.3f}",
                 f"{lat['nimble'] / lat['torch_compile']:.2f}", f"{g['nimble_fp32']:.3f}",
                 f"{g['nimble_fp32'] / g['nimble']:.2f}",
                 f"{r['fp32_ops']} of {r['floating_ops']} ({r['fp32_ops_searched']})",
                 ", ".join(f"{k} {v}" for k, v in r.get("compile_options", {}).items()),
                 f"{r['rel_l2']['nimble']:.1e}", f"{r['rel_l2']['torch_compile']:.1e}",
                 f"{r['top1_agreement']['nimble']:.3f}", f"{r['top1_agreement']['torch_compile']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary(rows: list[dict], meta: dict) -> str:
    head = ["model", "batch", "torch.compile GPU-bound", "nimble GPU-bound", "ratio", "torch.compile latency",
            "nimble latency", "ratio", "eager GPU-bound", "unfused GPU-bound", "unfused latency", "kernels (unfused)",
            "kernels", "choice", "max rel err"]
    lines = [f"nimble against torch.compile on {meta['gpu']}, torch {meta['torch']}, {meta['date']}. Command: "
             f"`{meta['command']}`. fp32 (TF32 convolutions, PyTorch's default). Milliseconds per inference, "
             "medians, all variants in one process. GPU-bound: 50 back-to-back calls between CUDA events "
             "(median of 15); latency: copy in, run, synchronize (median of 200). ratio = nimble / torch.compile "
             "(targets: GPU-bound at most 0.9, latency at most 0.8). unfused = nimble before fused ops "
             "(--no-fuse, --tune off). kernels = kernel nodes in nimble's captured CUDA graph. choice = the "
             "layout and streams nimble's load-time tuning picked. max rel err = the worst output of every "
             "variant and every forced nimble choice against eager.", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in sorted(rows, key=lambda r: (r["model"], r["batch"])):
        g, lat = r["gpu_bound_ms"], r["latency_ms"]
        cells = [r["model"], str(r["batch"]), f"{g['torch_compile']:.3f}", f"{g['nimble']:.3f}",
                 f"{g['nimble'] / g['torch_compile']:.2f}", f"{lat['torch_compile']:.3f}", f"{lat['nimble']:.3f}",
                 f"{lat['nimble'] / lat['torch_compile']:.2f}", f"{g['eager']:.3f}", f"{g['nimble_unfused']:.3f}",
                 f"{lat['nimble_unfused']:.3f}", str(r["kernels"]["nimble_unfused"]), str(r["kernels"]["nimble"]),
                 r.get("choice", "-"), f"{max(r['check'].values()):.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    extra = [r for r in rows if "first_inference_s" in r]
    for r in extra:
        f = r["first_inference_s"]
        lines.append(f"\nLoad to first inference, {r['model']} batch {r['batch']}, fresh process after import torch: "
                     f"{f['cold']:.2f} s with empty kernel and tuning caches, {f['warm']:.2f} s warm. "
                     f"torch.compile's first three calls took {r['torch_compile_s']:.1f} s in the benchmark process.")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tag", default="run")
    parser.add_argument("--report", type=Path, nargs="*", help="merge these JSON files into a markdown table")
    parser.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp32")
    parser.add_argument("--without", nargs="*", default=[], metavar="PASS",
                        help="fp32: also time nimble compiled without each named pass (a pipeline pass's "
                             "function name), in the same process, as the variant nimble_without_PASS")
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                        help="fp32: also time nimble loaded under this runtime setting (nimble/runtime/base/"
                             "settings.py; as cudnn_slower_outside=1.03), in the same process, a variant each")
    args = parser.parse_args()
    args.without = [known_pass(p) for p in args.without]
    args.set = [setting(t) for t in args.set]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        docs = [json.loads(p.read_text()) for p in args.report]
        latest = {(r["model"], r["batch"], r.get("precision", "fp32")): r for d in docs for r in d["rows"]}
        rows = list(latest.values())  # later runs win
        meta = docs[0]["meta"]
        meta["command"] = " ; ".join(d["meta"]["command"] for d in docs)
        reduced = sorted({r["precision"] for r in rows if "precision" in r})
        if reduced and len(reduced) + any("precision" not in r for r in rows) > 1:
            print("--report: give the JSON of one precision at a time", file=sys.stderr)
            return 2
        text = summary_reduced(rows, meta) if reduced else summary(rows, meta)
        name = f"peers_{reduced[0]}" if reduced else "peers"
        report.write(args.out, name, text, {"meta": meta, "rows": rows})
        print(text)
        return 0
    import torch

    torch.backends.cudnn.benchmark = False
    meta = report.gpu_meta("peers.py")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            for batch in args.batches:
                try:
                    rows.append(bench_one(name, batch, Path(tmp), tuple(args.without), tuple(args.set)) if args.precision == "fp32" else
                                bench_reduced(name, batch, args.precision, Path(tmp)))
                except Exception as e:  # record and go on: one model's failure is a result too
                    print(f"{name} batch {batch}: FAILED {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                report.write(args.out, f"peers_{args.tag}", doc={"meta": meta, "rows": rows})
    if args.precision != "fp32" and rows:
        report.write(args.out, f"peers_{args.precision}_{args.tag}", summary_reduced(rows, meta),
                     {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
