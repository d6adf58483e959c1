"""Parity of fused artifacts under every load-time choice, forced each way, on a GPU.

    python tools/parity_choices.py --out DIR [--models resnet50 ...] [--batches 1 8]

For each model (the torchvision models of peers.py and the sample models) and batch: trace it,
compile it with fused ops on the CPU, then load it on CUDA once per candidate of
`tuning.candidates` (layout x streams x convolution algorithms x cuDNN fusion), forced, and
compare each output with eager PyTorch on the GPU (TF32 tolerances: rtol 1e-2, atol 1e-3).
Writes parity_choices.md and .json to DIR.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # report.py, peers.py: the benchmarks'
import report

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import MODELS, make_model  # noqa: E402


def check(name: str, batch: int, tmp: Path) -> dict:
    import torch

    from nimble.formats import read_artifact, write_artifact
    from nimble.frontend import quiet_torchscript
    from nimble.pipeline import compile_model
    from nimble.runtime.tune import choices as tuning
    from nimble.runtime.base.compare import compare
    from nimble.runtime.executable import Executable
    from nimble.specs import input_specs

    model, shapes = make_model(name)
    torch.manual_seed(1)
    xs_cpu = [torch.randn(batch, *s) for s in shapes]
    xs = [x.cuda() for x in xs_cpu]
    with torch.no_grad():
        ref = model.cuda()(*xs)
        ref = [ref] if isinstance(ref, torch.Tensor) else list(ref)
    with quiet_torchscript():
        pt = tmp / f"{name}.pt"
        torch.jit.save(torch.jit.trace(model.cpu(), tuple(xs_cpu)), str(pt))
    compiled = compile_model(pt, input_specs(["x".join(map(str, x.shape)) for x in xs_cpu]), device="cpu")
    path = tmp / f"{name}.nimble"
    write_artifact(path, compiled.artifact())
    art = read_artifact(path)
    row = {"model": name, "batch": batch, "fused_ops": sum(op.target == "nimble::fused" for op in art.graph.ops),
           "choices": {}}
    for choice in tuning.candidates(art.graph, art.schedule.num_streams):
        exe = Executable(art, "cuda", choice=choice)
        result = compare(exe.run(*xs), ref, 1e-2, 1e-3)
        row["choices"][choice.describe()] = {"passed": result.passed, "max_rel": result.max_rel,
                                             "interpreted": len(exe.stats.kernel_fallbacks)}
        del exe
        torch.cuda.empty_cache()
    row["passed"] = all(c["passed"] for c in row["choices"].values())
    print(json.dumps({k: row[k] for k in ("model", "batch", "passed")} | {"choices": len(row["choices"])}),
          flush=True)
    return row


def write(out: Path, meta: dict, rows: list[dict]) -> None:
    lines = [f"Parity of fused artifacts under every load-time choice forced, on {meta['gpu']}, torch "
             f"{meta['torch']}, {meta['date']}. Command: `{meta['command']}`. Each choice's outputs against eager "
             "PyTorch on the GPU, rtol 1e-2, atol 1e-3 (TF32).", "",
             "| model | batch | fused ops | choices | all pass | worst max rel | fused ops interpreted |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch']} | - | - | no: {r['error'][:80]} | - | - |")
            continue
        c = r["choices"].values()
        lines.append(f"| {r['model']} | {r['batch']} | {r['fused_ops']} | {len(r['choices'])} | "
                     f"{'yes' if r['passed'] else 'NO'} | {max(x['max_rel'] for x in c):.1e} | "
                     f"{max(x['interpreted'] for x in c)} |")
    report.write(out, "parity_choices", lines, {"meta": meta, "rows": rows})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    meta = report.gpu_meta("parity_choices.py")
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            for batch in args.batches:
                try:
                    rows.append(check(name, batch, Path(tmp)))
                except Exception as e:  # one model's failure is a result too
                    rows.append({"model": name, "batch": batch, "passed": False, "error": f"{type(e).__name__}: {e}"})
                    print(f"{name} batch {batch}: FAILED {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                write(args.out, meta, rows)  # after every row: a run cut short keeps what it measured
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
