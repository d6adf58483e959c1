"""Where the GPU time goes: nimble against torch.compile(mode="reduce-overhead"), kernel by kernel,
per op class. Run on a GPU machine.

    python tools/kernel_diff.py --models resnet50 densenet121 --batches 8 [--precision fp16] --out DIR

torch.profiler records the CUDA kernels of REPS inferences of each, in one process:

- nimble: its op list is issued op by op on its streams (the kernels its CUDA graph replays), each
  op inside a `record_function` range named by its id. The profiler's correlation id ties each
  kernel to the launch call that made it, and the launch call lies inside one op's range: so each
  kernel maps to the op, or the fused group, that launched it. Its class comes from that op,
  refined by the kernel's name inside a fused convolution or GEMM (the cuDNN or cuBLAS kernel is
  the convolution or GEMM, a generated kernel after it the epilogue; a generated kernel of an op
  that launched no library kernel computed the convolution itself: depthwise, pooled and 1x1
  kernels, input and prologue pairs among them).
- torch.compile: its CUDA graph replays; each kernel is classed by its name (Inductor names its
  Triton kernels after the ops it fused: `triton_poi_fused_add_relu_3`, `triton_per_fused__softmax_1`).

It prints, per op class (convolution, GEMM, epilogue, normalisation, softmax or attention,
concatenation and copy, pooling, reduction, other), the kernel time per inference of each and the
difference, the ten nimble ops that take the most kernel time, the nimble ops that launch more
than one kernel (with the kernels' names: where a kernel might go), and for each class where
nimble loses, the ops (by kind) that launch nimble's kernels of that class. Kernel times are the sum of
kernel durations: they do not count the gaps between kernels or the overlap of streams, which the
GPU-bound figures of `peers.py` do.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # report.py, peers.py: the benchmarks'
import report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

REPS = 20
CLASSES = ("convolution", "GEMM", "epilogue", "normalisation", "softmax or attention", "concatenation and copy",
           "pooling", "reduction", "other")
_OP_CLASS = {  # aten op name -> class, for nimble's ops
    **{k: "convolution" for k in ("convolution", "_convolution", "conv2d", "conv1d", "conv3d", "conv_transpose2d")},
    **{k: "GEMM" for k in ("mm", "addmm", "bmm", "matmul", "linear", "baddbmm", "einsum")},
    **{k: "normalisation" for k in ("layer_norm", "native_layer_norm", "batch_norm", "group_norm", "native_group_norm",
                                   "_native_batch_norm_legit_no_training", "instance_norm", "rms_norm")},
    **{k: "softmax or attention" for k in ("softmax", "_softmax", "log_softmax", "_log_softmax",
                                          "scaled_dot_product_attention")},
    **{k: "concatenation and copy" for k in ("cat", "stack", "clone", "contiguous", "copy", "_to_copy", "to",
                                            "reshape", "permute", "transpose", "expand", "repeat", "pad",
                                            "constant_pad_nd", "index_select", "gather", "embedding")},
    **{k: "pooling" for k in ("max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "max_pool2d_with_indices",
                             "adaptive_max_pool2d", "avg_pool1d", "max_pool1d")},
    **{k: "reduction" for k in ("mean", "sum", "amax", "amin", "max", "min", "var", "std", "norm", "logsumexp",
                               "argmax", "cumsum")},
}


def by_name(kernel: str) -> str:
    """The op class of a kernel from its name alone (torch.compile's, and ATen's)."""
    k = kernel.lower()
    if k.startswith("triton_"):  # Inductor's: poi(ntwise), red(uction), per(sistent reduction)
        if k.startswith("triton_poi"):  # batch norm applied as a pointwise epilogue is an epilogue
            return "concatenation and copy" if "_cat" in k else "epilogue"
        if "softmax" in k:
            return "softmax or attention"
        if "norm" in k or "var_mean" in k:
            return "normalisation"
        return "pooling" if "pool" in k else "reduction"
    if k.startswith("nvjet"):  # cuBLASLt's Hopper GEMMs
        return "GEMM"
    if any(w in k for w in ("softmax", "flash", "fmha", "attention", "sdpa")):
        return "softmax or attention"
    if any(w in k for w in ("fprop", "conv", "winograd", "implicit", "cudnn", "fft")):
        return "convolution"
    if any(w in k for w in ("gemm", "gemv", "cublas", "cutlass", "splitk", "matmul")):
        return "GEMM"
    if any(w in k for w in ("norm", "welford")):
        return "normalisation"
    if any(w in k for w in ("catarray", "copy", "transpose", "nchwtonhwc", "nhwctonchw", "memcpy", "memset",
                            "permute")):
        return "concatenation and copy"
    if "pool" in k:
        return "pooling"
    if "reduce" in k:
        return "reduction"
    if any(w in k for w in ("elementwise", "functor", "kernel")):
        return "epilogue"
    return "other"


def generated(kernel: str) -> bool:
    """Whether `kernel` is one nimble generated (Triton), not a library's (cuDNN, cuBLAS, ATen). The
    profiler names a kernel that Triton's static launcher ran `Kernel`."""
    return kernel.lower().startswith(("triton", "kernel"))


def nimble_class(op, kernel: str, computes_convolution: bool = False) -> str:
    """The class of `kernel`, launched by nimble's `op`. A generated kernel of a fused op led by a
    convolution is its epilogue (of a product, its bias), unless `computes_convolution`: the op launched
    no library kernel, so it computed the convolution or product too (depthwise, 1x1, `gemm.py`'s)."""
    from nimble.ops import fusion

    if fusion.is_fused(op):
        lead = fusion.body_of(op)[0][0].split("::")[-1].split(".")[0]
        named = by_name(kernel)
        if _OP_CLASS.get(lead) == "convolution":
            if generated(kernel) and computes_convolution:
                return "convolution"
            return "epilogue" if named in ("epilogue", "concatenation and copy") else "convolution"
        return "epilogue"
    short = op.target.split("::")[-1].split(".")[0]
    cls = _OP_CLASS.get(short)
    if cls in ("convolution", "GEMM"):  # cuDNN names many convolution kernels *gemm*
        named, own = by_name(kernel), generated(kernel) and computes_convolution
        return named if named in ("epilogue", "concatenation and copy") and not own else cls
    return cls or by_name(kernel)


def kernels_of(trace_file: Path) -> tuple[list[dict], dict[int, tuple[int, float]], list[dict]]:
    """(kernels and device copies, launch call by correlation id -> (thread, ts), annotations)."""
    doc = json.loads(trace_file.read_text())
    kernels, launches, ranges = [], {}, []
    for e in doc.get("traceEvents", []):
        cat, args = e.get("cat", ""), e.get("args") or {}
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append({"name": e.get("name", ""), "dur": float(e.get("dur", 0.0)),
                            "corr": args.get("correlation"), "ts": float(e.get("ts", 0.0))})
        elif cat in ("cuda_runtime", "cuda_driver") and args.get("correlation") is not None:
            launches[args["correlation"]] = (e.get("tid"), float(e.get("ts", 0.0)))
        elif cat == "user_annotation" and str(e.get("name", "")).startswith("nimble op "):
            ranges.append({"tid": e.get("tid"), "start": float(e["ts"]), "end": float(e["ts"]) + float(e["dur"]),
                           "op": int(e["name"].split()[-1])})
    return kernels, launches, ranges


def ops_with_several_kernels(ours: list[dict], owner: list, reps: int = REPS) -> list[dict]:
    """The ops that launch more than one kernel per inference, most kernels first: each with its
    kernels per inference and their names (a split sum's reduction, a workspace-clearing kernel,
    an epilogue apart: where a kernel might go). `owner[i]` is the op that launched `ours[i]`, None
    where unknown; `ours` holds `reps` inferences."""
    names: dict = defaultdict(Counter)
    for k, op in zip(ours, owner):
        if op is not None:
            names[op][k["name"][:90]] += 1
    several = [{"op": op, "kernels": sum(c.values()) // reps,
                "names": {n: count // reps for n, count in c.most_common()}} for op, c in names.items()]
    return sorted((r for r in several if r["kernels"] > 1), key=lambda r: (-r["kernels"], r["op"]))


def profile(run, folder: Path, tag: str) -> Path:
    import torch
    from torch.profiler import ProfilerActivity

    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(REPS):
            run()
        torch.cuda.synchronize()
    path = folder / f"{tag}.json"
    prof.export_chrome_trace(str(path))
    return path


def replay_gaps(kernels: list[dict]) -> dict:
    """How a run of REPS back-to-back CUDA graph replays spends its span: kernel time, and the idle
    time before each kernel (time when no kernel of the graph ran), per inference, with the
    kernels that waited longest."""
    ks = sorted(kernels, key=lambda k: k["ts"])
    if not ks:
        return {}
    waited: dict = defaultdict(lambda: [0.0, 0])
    idle, end = 0.0, ks[0]["ts"]
    for k in ks:
        gap = max(0.0, k["ts"] - end)
        idle += gap
        w = waited[k["name"][:90]]
        w[0] += gap / 1000 / REPS
        w[1] += 1
        end = max(end, k["ts"] + k["dur"])
    span = end - ks[0]["ts"]
    return {"kernels": len(ks) // REPS, "span_ms": span / 1000 / REPS, "idle_ms": idle / 1000 / REPS,
            "idle_per_kernel_us": idle / len(ks),
            "waits": [{"kernel": n, "idle_ms": ms, "count": c // REPS}
                      for n, (ms, c) in sorted(waited.items(), key=lambda kv: -kv[1][0])[:8]]}


def attribute(exe, folder: Path, tag: str) -> tuple[list[dict], list[int | None]]:
    """The kernels of REPS inferences of `exe`, issued op by op on its streams, and the op that
    launched each (its index in `exe.graph.ops`; None where unknown): each op runs inside a
    `record_function` range, and a kernel's launch call lies inside one op's range."""
    import torch

    def around(step):
        def labelled(i: int) -> None:
            with torch.profiler.record_function(f"nimble op {i}"):
                step(i)
        return labelled

    ours, launches, ranges = kernels_of(profile(lambda: exe._issue(validate=True, around=around), folder, tag))
    by_tid: dict = defaultdict(list)
    for r in sorted(ranges, key=lambda r: r["start"]):
        by_tid[r["tid"]].append(r)
    starts = {tid: [r["start"] for r in rs] for tid, rs in by_tid.items()}

    def op_of(corr) -> int | None:
        if corr not in launches:
            return None
        tid, ts = launches[corr]
        rs = by_tid.get(tid, [])
        k = bisect.bisect_right(starts.get(tid, []), ts) - 1
        while k >= 0 and rs[k]["end"] < ts:
            k -= 1
        return rs[k]["op"] if k >= 0 and rs[k]["start"] <= ts <= rs[k]["end"] else None

    return ours, [op_of(k["corr"]) for k in ours]


def diff_one(name: str, batch: int, precision: str, tmp: Path, force: str | None = None) -> dict:
    import torch

    from nimble.formats import read_artifact, write_artifact
    from nimble.frontend import quiet_torchscript
    from nimble.pipeline import compile_model
    from nimble.runtime.executable import Executable
    from nimble.specs import input_specs
    from nimble.runtime.tune.choices import choice_of
    from peers import make_inputs

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    model, xs_cpu = make_inputs(name, batch)
    with quiet_torchscript():
        pt = tmp / f"{name}_{batch}.pt"
        torch.jit.save(torch.jit.trace(model.eval(), tuple(xs_cpu), check_trace=False), str(pt))
    xs = [x.cuda().to(dtype) if x.is_floating_point() else x.cuda() for x in xs_cpu]
    row = {"model": name, "batch": batch, "precision": precision}
    with torch.no_grad():
        cast = model.cuda().to(dtype)
        torch._dynamo.reset()
        compiled = torch.compile(cast, mode="reduce-overhead")
        for _ in range(3):
            compiled(*xs)
        theirs, _, _ = kernels_of(profile(lambda: compiled(*xs), tmp, f"{name}_{batch}_tc"))
        row["torch_compile_replay"] = replay_gaps(theirs)
        compiled = cast = None  # its graphs go before nimble loads
        torch._dynamo.reset()

    options = {} if precision == "fp32" else {"precision": precision, "io_dtype": "reduced", "device": "cuda"}
    specs = input_specs(["x".join(map(str, x.shape)) for x in xs_cpu],
                        [str(x.dtype).removeprefix("torch.") for x in xs_cpu])
    c = compile_model(pt, specs, **({"device": "cpu"} | options))
    path = tmp / f"{name}_{batch}.nimble"
    write_artifact(path, c.artifact())
    forced = {"choice": choice_of(force)} if force else {"tune": "full"}
    exe = Executable(read_artifact(path), "cuda", **forced)
    exe.run(*xs)
    g = exe.graph
    row["nimble_replay"] = replay_gaps(kernels_of(profile(exe.replay, tmp, f"{name}_{batch}_replay"))[0])

    ours, owner = attribute(exe, tmp, f"{name}_{batch}_nimble")
    per_class = {cls: {"torch_compile_ms": 0.0, "nimble_ms": 0.0, "torch_compile_kernels": 0, "nimble_kernels": 0}
                 for cls in CLASSES}
    # a library kernel (cuDNN, cuBLAS) that nimble launched for a known op has that op's class in
    # torch.compile's graph too: names alone do not tell cuDNN's *gemm* convolutions from GEMMs
    learned = {}
    for k, op in zip(ours, owner):
        if op is not None and not generated(k["name"]):
            learned[k["name"]] = nimble_class(g.ops[op], k["name"])
    with_library = {op for k, op in zip(ours, owner) if not generated(k["name"])}
    names: dict = defaultdict(float)
    for k in theirs:
        cls = learned.get(k["name"]) or by_name(k["name"])
        per_class[cls]["torch_compile_ms"] += k["dur"] / 1000 / REPS
        per_class[cls]["torch_compile_kernels"] += 1
        names[(cls, k["name"][:90])] += k["dur"] / 1000 / REPS
    row["torch_compile_top_kernels"] = [{"class": c, "kernel": n, "ms": ms}
                                        for (c, n), ms in sorted(names.items(), key=lambda kv: -kv[1])[:12]]
    from nimble.runtime.trace import op_label

    per_op: dict = defaultdict(float)
    by_label: dict = defaultdict(lambda: [0.0, 0])  # (class, op label) -> nimble's ms and kernels
    our_names: dict = defaultdict(lambda: [0.0, 0])
    unmapped = 0
    for k, op in zip(ours, owner):
        if op is None:
            unmapped += 1
            cls = by_name(k["name"])
        else:
            cls = nimble_class(g.ops[op], k["name"], computes_convolution=op not in with_library)
            per_op[op] += k["dur"] / 1000 / REPS
            labelled = by_label[(cls, op_label(g.ops[op]))]
            labelled[0] += k["dur"] / 1000 / REPS
            labelled[1] += 1
        named = our_names[(cls, k["name"][:90])]
        named[0] += k["dur"] / 1000 / REPS
        named[1] += 1
        per_class[cls]["nimble_ms"] += k["dur"] / 1000 / REPS
        per_class[cls]["nimble_kernels"] += 1
    for cls in per_class.values():
        cls["torch_compile_kernels"] //= REPS
        cls["nimble_kernels"] //= REPS
    row["nimble_top_kernels"] = [{"class": c, "kernel": n, "ms": ms, "count": count // REPS}
                                 for (c, n), (ms, count) in sorted(our_names.items(), key=lambda kv: -kv[1][0])[:12]]
    row["classes"] = per_class
    losing = [c for c, v in per_class.items() if v["nimble_ms"] > v["torch_compile_ms"]]
    row["losing_class_ops"] = {c: [{"op": label, "kernels": n // REPS, "ms": ms}
                                   for (cls, label), (ms, n) in sorted(by_label.items(), key=lambda kv: -kv[1][0])
                                   if cls == c][:8] for c in losing}
    row["unmapped_kernels"] = unmapped // REPS
    row["several_kernels"] = [r | {"label": op_label(g.ops[r["op"]]), "value": g.values[g.ops[r["op"]].outputs[0]].name}
                              for r in ops_with_several_kernels(ours, owner)]
    row["choice"] = exe.stats.choice
    row["top_ops"] = [{"op": i, "label": op_label(g.ops[i]), "value": g.values[g.ops[i].outputs[0]].name,
                       "ms": ms} for i, ms in sorted(per_op.items(), key=lambda kv: -kv[1])[:10]]
    exe.close()
    print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict], meta: dict) -> list[str]:
    lines = [f"Kernel time per inference by op class, nimble against torch.compile(mode=\"reduce-overhead\"), "
             f"{meta['gpu']}, torch {meta['torch']}, {meta['date']}, TF32 convolutions and full fp32 matmul (as "
             f"peers.py). Command: `{meta['command']}`. Sum of kernel "
             f"durations over {REPS} inferences, per inference, in ms (gaps and stream overlap not counted). "
             "diff = nimble - torch.compile: where nimble loses, positive.", ""]
    for r in rows:
        lines += [f"### {r['model']}, batch {r['batch']}, {r['precision']} (nimble runs as: {r['choice']})", "",
                  *report.table(["class", "torch.compile ms", "nimble ms", "diff ms", "torch.compile kernels",
                                 "nimble kernels"],
                                [[cls, f"{v['torch_compile_ms']:.3f}", f"{v['nimble_ms']:.3f}",
                                  f"{v['nimble_ms'] - v['torch_compile_ms']:+.3f}", v["torch_compile_kernels"],
                                  v["nimble_kernels"]] for cls, v in r["classes"].items()
                                 if v["torch_compile_kernels"] or v["nimble_kernels"]]
                                + [["all", f"{sum(v['torch_compile_ms'] for v in r['classes'].values()):.3f}",
                                    f"{sum(v['nimble_ms'] for v in r['classes'].values()):.3f}",
                                    f"{sum(v['nimble_ms'] - v['torch_compile_ms'] for v in r['classes'].values()):+.3f}",
                                    sum(v["torch_compile_kernels"] for v in r["classes"].values()),
                                    sum(v["nimble_kernels"] for v in r["classes"].values())]]),
                  "", "nimble's ten costliest ops: " + "; ".join(f"{o['value']} {o['label']} {o['ms']:.3f} ms"
                                                                 for o in r["top_ops"]),
                  "", f"nimble's ops launching more than one kernel ({len(r.get('several_kernels', []))}): "
                  + "; ".join(f"{o['value']} {o['label']} {o['kernels']} kernels ("
                      + ", ".join(f"`{n}` x{c}" for n, c in o["names"].items()) + ")"
                      for o in r.get("several_kernels", [])[:12]),
                  "", *[f"nimble's ops launching its {cls} kernels (a class where it loses): " + "; ".join(
                      f"{o['op']} {o['kernels']} kernels {o['ms']:.3f} ms" for o in ops)
                        for cls, ops in r.get("losing_class_ops", {}).items()],
                  "", "torch.compile's costliest kernels: " + "; ".join(
                      f"`{k['kernel']}` ({k['class']}) {k['ms']:.3f} ms" for k in r["torch_compile_top_kernels"][:8]),
                  "", "nimble's costliest kernels: " + "; ".join(
                      f"`{k['kernel']}` ({k['class']}, {k['count']} per inference) {k['ms']:.3f} ms"
                      for k in r.get("nimble_top_kernels", [])[:8]),
                  "", *[f"{who} CUDA graph replay: {p['kernels']} kernels, span {p['span_ms']:.3f} ms, of which idle "
                        f"{p['idle_ms']:.3f} ms ({p['idle_per_kernel_us']:.1f} us before each kernel); longest waits "
                        "before: " + "; ".join(f"`{w['kernel']}` ({w['count']}) {w['idle_ms']:.3f} ms"
                                               for w in p["waits"][:5])
                        for who, p in (("torch.compile's", r.get("torch_compile_replay")),
                                       ("nimble's", r.get("nimble_replay"))) if p],
                  ""]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet50"])
    parser.add_argument("--batches", nargs="+", type=int, default=[8])
    parser.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp32")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tag", default="run")
    parser.add_argument("--choice", help="run nimble as this choice instead of tuning: LAYOUT,STREAMS,ALGORITHMS,"
                                         "CONVOLUTIONS[,GEMM_BIAS[,PROLOGUES]] (e.g. channels_last,planned,benchmark,"
                                         "split or contiguous,serial,heuristic,cudnn-fused,separate or "
                                         "'channels_last,planned,heuristic,cudnn-fused,epilogue,in depthwise')")
    args = parser.parse_args()
    if args.choice:  # refused before minutes of compiling, not run under a name it does not have
        from nimble.runtime.tune.choices import choice_of

        if choice_of(args.choice) is None:
            parser.error(f"--choice {args.choice!r} is no load-time choice; see --help for the fields")
    import torch

    # PyTorch's defaults, as peers.py runs: TF32 convolutions, full fp32 matmul (the tables up to
    # 2026-11-24 turned TF32 on for matmul too, so their GEMM rows are not peers.py's)
    torch.backends.cudnn.allow_tf32 = True
    meta = report.gpu_meta("kernel_diff.py")
    rows = report.each_row(args.models, args.batches,
                           lambda name, batch, tmp: diff_one(name, batch, args.precision, tmp, args.choice))
    report.write(args.out, f"kernel_diff_{args.tag}", table(rows, meta), {"meta": meta, "rows": rows})
    print("\n".join(table(rows, meta)))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
