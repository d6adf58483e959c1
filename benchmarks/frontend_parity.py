"""Frontend parity on torchvision models: trace, lower, run the op list, compare with the model.

    python benchmarks/frontend_parity.py [--device cuda] [--out benchmarks/results]

Each model is traced at batch 1, fp32, in eval mode (random weights: no downloads), saved as
TorchScript, lowered by nimble, and its op list run eagerly on --device with TF32 off. The output
is compared with the TorchScript module on the CPU. Prints a markdown table of op counts and
errors and writes it (and JSON) to --out.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
import time
from pathlib import Path

import report

import torch

from nimble import frontend
from nimble.ops import arguments
from nimble.runtime.placed import reference
from nimble.runtime.base.compare import compare
from nimble.ir import TensorSpec
from nimble.pipeline import rewrite

MODELS = {
    "resnet50": (224, {}),
    "inception_v3": (299, {"aux_logits": True, "init_weights": True}),
    "googlenet": (224, {"aux_logits": False, "init_weights": True}),
    "mobilenet_v2": (224, {}),
    "efficientnet_b0": (224, {}),
    "squeezenet1_1": (224, {}),
    "densenet121": (224, {}),
}


def check_model(name: str, device: str, workdir: Path, rtol: float = 1e-3) -> dict:
    import torchvision

    size, kwargs = MODELS[name]
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None, **kwargs).eval()
    x = torch.randn(1, 3, size, size)
    path = workdir / f"{name}.pt"
    with frontend.quiet_torchscript(), torch.no_grad():
        torch.jit.save(torch.jit.trace(model, x), str(path))
    t = time.perf_counter()
    lowered = rewrite(frontend.lower(frontend.load_module(path), [TensorSpec(tuple(x.shape), "float32")], name))
    lower_s = time.perf_counter() - t
    with frontend.quiet_torchscript(), torch.no_grad():
        expected = arguments.flatten_result(lowered.module(x))
    got = reference.run(lowered.graph, lowered.weights, [x], device)
    result = compare(got, expected, rtol=rtol, atol=0)
    kinds: dict[str, int] = {}
    for op in lowered.graph.ops:
        short = op.target.split("::")[1].split(".")[0]
        kinds[short] = kinds.get(short, 0) + 1
    return {"model": name, "ops": len(lowered.graph.ops), "weights": len(lowered.weights),
            "max_abs": result.max_abs, "max_rel": result.max_rel, "passed": result.max_rel <= rtol,
            "lower_s": round(lower_s, 3), "op_kinds": kinds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    args = parser.parse_args()
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            rows.append(check_model(name, args.device, Path(tmp)))
            r = rows[-1]
            print(f"{name}: {r['ops']} ops, max rel error {r['max_rel']:.2e}", file=sys.stderr)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    header = (f"Frontend parity on torchvision models; run on {args.device} ({gpu}), torch {torch.__version__}, "
              f"{datetime.date.today()}, `python benchmarks/frontend_parity.py --device {args.device}`. "
              "Batch 1, fp32, TF32 off, random weights; error relative to each output's largest magnitude.")
    table = [header, "", "| model | ops | weights | max abs error | max rel error | within 1e-3 | lower (s) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    table += [f"| {r['model']} | {r['ops']} | {r['weights']} | {r['max_abs']:.2e} | {r['max_rel']:.2e} | "
              f"{'yes' if r['passed'] else 'NO'} | {r['lower_s']} |" for r in rows]
    print("\n".join(table))
    report.write(args.out, "frontend_parity", table, {"device": args.device, "gpu": gpu, "torch": torch.__version__,
                                                      "date": str(datetime.date.today()), "rows": rows})
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
