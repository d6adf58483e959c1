"""A coverage sweep of torchvision's models on the CPU (TorchScript frontend): every
classification model, the segmentation models and the video models.

    python benchmarks/zoo.py [--groups classification segmentation video] [--models resnet18 ...]
                             [--timeout 300] [--out benchmarks/results]

torchvision on a CPU-only machine: the registry's wheels are CUDA builds, and pairing one with a
CPU torch fails at import on its C++ op registrations. Install the version that pairs with your
torch without dependencies, so pip keeps your torch (torch 2.13 pairs with torchvision 0.28):

    pip install --no-deps torchvision==0.28.0 pillow

This script then declares the missing `torchvision::` operators before importing it (no
classification model calls them).

Per model (random weights, eval mode, batch 1, 224x224 images, 8x112x112 clips for video; a
segmentation model returns a dict, so it is traced with strict=False): trace it to TorchScript,
then in subprocesses with a timeout run `nimble compile --device cpu` and `nimble run --check
--device cpu`. Each model is classified as ok, clean error (exit 1 to 3 with one line), mismatch
(exit 3), crash (a traceback or a signal) or timeout, with compile seconds and op counts. Models
too large for a 2-core CPU are listed as skipped. Writes zoo.md and zoo.json (rows are written
after every model).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = {  # too large for a 2-core CPU builder (hundreds of millions of parameters, or minutes per run)
    "vit_h_14", "vit_l_16", "vit_l_32", "regnet_y_128gf", "regnet_y_32gf", "regnet_y_16gf",
    "efficientnet_v2_l", "efficientnet_b7", "efficientnet_b6", "convnext_large", "swin_v2_b", "swin_b",
    "regnet_x_32gf", "swin3d_b", "swin3d_s", "mvit_v1_b", "mvit_v2_s",
}
SHAPES = {"classification": (1, 3, 224, 224), "segmentation": (1, 3, 224, 224), "video": (1, 3, 8, 112, 112),
          "samples": ()}  # the bundled sample models, at their own shapes
LABEL = {"torchscript": "TorchScript", "export": ".pt2"}
RESOLUTION = {"inception_v3": 299}
NIMBLE = [sys.executable, "-c", "from nimble.cli.entry import main; main()"]


def import_torchvision():
    """torchvision beside a CPU torch: declare each C++ operator it registers fakes for. Once per
    process: a later call returns the module already imported."""
    import torch

    if "torchvision.models" in sys.modules:
        return sys.modules["torchvision"]

    lib = torch.library.Library("torchvision", "DEF")
    for _ in range(100):
        try:
            import torchvision

            import_torchvision.lib = lib  # the declarations live as long as the library object
            return torchvision
        except RuntimeError as e:
            m = re.search(r"torchvision::(\w+) does not exist", str(e))
            if m is None:
                raise
            for name in [k for k in sys.modules if k.startswith("torchvision")]:
                del sys.modules[name]
            lib.define(f"{m.group(1)}(Tensor[] args) -> Tensor")
    raise RuntimeError("could not import torchvision")


def outcome(proc: subprocess.CompletedProcess | None, timeout: bool) -> tuple[str, str]:
    if timeout:
        return "timeout", ""
    err = proc.stderr.strip()
    last = err.splitlines()[-1] if err else ""
    if proc.returncode == 0:
        return "ok", ""
    if "Traceback" in err or proc.returncode < 0 or "internal error" in err:
        return "crash", last[:300]
    if proc.returncode == 3:
        return "mismatch", last[:300]
    return "clean error", last[:300]


def build(torchvision, group: str, name: str, frontends: list[str], tmp: Path) -> tuple[dict, list[int]]:
    """The model written once per frontend: {frontend: path or 'not traceable/exportable: ...'}."""
    import torch

    shape = list(SHAPES[group])
    if name in RESOLUTION:
        shape[-2:] = [RESOLUTION[name]] * 2
    dtypes = None
    if group == "samples":
        from build import TOKEN_MODELS, build_module, example_inputs

        model, xs = build_module(name), example_inputs(name)
        shapes, dtypes = [list(x.shape) for x in xs], (TOKEN_MODELS[name][2] if name in TOKEN_MODELS else None)
    else:
        kwargs = {"aux_logits": False, "init_weights": False} if name in ("inception_v3", "googlenet") else {}
        if group == "segmentation":
            kwargs = {"weights_backbone": None, "aux_loss": False}
        torch.manual_seed(0)
        model, shapes = torchvision.models.get_model(name, weights=None, **kwargs).eval(), [shape]
        xs = tuple(torch.randn(*s) for s in shapes)
    files: dict = {}
    if "torchscript" in frontends:
        try:
            with torch.no_grad():
                traced = torch.jit.trace(model, xs, check_trace=False, strict=group != "segmentation")
            torch.jit.save(traced, str(tmp / f"{name}.pt"))
            files["torchscript"] = tmp / f"{name}.pt"
        except Exception as e:  # the model itself does not trace: not nimble's failure, but recorded
            files["torchscript"] = f"not traceable: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if "export" in frontends:
        try:
            t = time.perf_counter()
            program = torch.export.export(model, xs)
            torch.export.save(program, str(tmp / f"{name}.pt2"))
            files["export"] = tmp / f"{name}.pt2"
            files["export_seconds"] = round(time.perf_counter() - t, 2)
        except Exception as e:
            files["export"] = f"not exportable: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    files["dtypes"] = dtypes
    return files, shapes


def check_one(path: Path, shapes: list | None, timeout: float, tmp: Path, dtypes: list | None = None) -> dict:
    """compile (--json, for the op list) then run --check, each in a subprocess."""
    row: dict = {}
    art = tmp / f"{path.name}.nimble"
    cmd = [*NIMBLE, "compile", str(path), "--device", "cpu", "-o", str(art), "--json"]
    for s in shapes or []:
        cmd += ["--shape", "x".join(map(str, s))]
    for d in (dtypes or []) if shapes else []:
        cmd += ["--dtype", d]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        status, line = outcome(proc, False)
    except subprocess.TimeoutExpired:
        proc, (status, line) = None, outcome(None, True)
    row["compile_wall_s"] = round(time.perf_counter() - t, 2)
    if proc is not None:
        m = re.search(r": (\d+) ops,", proc.stderr)
        row["ops"] = int(m.group(1)) if m else None
        m = re.search(r"fusion: (\d+) lowered ops", proc.stderr)
        row["lowered_ops"] = int(m.group(1)) if m else row.get("ops")
        m = re.search(r"time: (.*?); total ([\d.]+) s", proc.stderr)
        row["compile_stages"] = m.group(1) if m else None
        if status == "ok":
            row["targets"] = [op["target"] for op in json.loads(proc.stdout)["ops"]]
    row["status"], row["message"] = ("compile " + status, line) if status != "ok" else ("compiled", "")
    if status == "ok":
        try:
            proc = subprocess.run([*NIMBLE, "run", str(art), "--check", "--device", "cpu"], capture_output=True,
                                  text=True, timeout=timeout)
            status, line = outcome(proc, False)
        except subprocess.TimeoutExpired:
            status, line = outcome(None, True)
        row["status"], row["message"] = ("ok", "") if status == "ok" else ("run --check " + status, line)
    return row


def op_kinds(targets: list[str]) -> dict[str, int]:
    """Op counts by kind, up to naming: the frontends spell a few ops differently (TorchScript's
    traced `_convolution` is `convolution`, a scripted or exported one `conv2d`; `norm` is
    `linalg_vector_norm` and `transpose` can be `swapaxes` in an exported graph)."""
    same = {"_convolution": "conv", "convolution": "conv", "conv1d": "conv", "conv2d": "conv", "conv3d": "conv",
            "swapaxes": "transpose", "swapdims": "transpose", "linalg_vector_norm": "norm"}
    counts: dict[str, int] = {}
    for t in targets:
        short = t.split("::")[1].split(".")[0].rstrip("_")
        counts[same.get(short, short)] = counts.get(same.get(short, short), 0) + 1
    return dict(sorted(counts.items()))


def sweep_one(torchvision, group: str, name: str, frontends: list[str], timeout: float, tmp: Path) -> dict:
    row: dict = {"model": name, "group": group}
    if name in SKIP:
        row["status"] = "skipped (too large for a 2-core CPU)"
        return row
    try:
        files, shapes = build(torchvision, group, name, frontends, tmp)
    except Exception as e:  # the model cannot even be built
        row["status"] = f"not built: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return row
    for frontend in frontends:
        path = files[frontend]
        if isinstance(path, str):
            row[frontend] = {"status": path.split(":")[0], "message": path.split(": ", 1)[1]}
            continue
        row[frontend] = check_one(path, shapes if frontend == "torchscript" else None, timeout, tmp, files["dtypes"])
        if frontend == "export":
            row[frontend]["export_seconds"] = files.get("export_seconds")
    done = [row[f] for f in frontends if "targets" in row[f]]
    if len(done) == 2:
        row["same_op_kinds"] = op_kinds(done[0]["targets"]) == op_kinds(done[1]["targets"])
    for f in frontends:
        row[f].pop("targets", None)
    row["status"] = row[frontends[0]]["status"]
    return row


def write(out: Path, meta: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "zoo.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    frontends = meta["frontends"]
    summary = []
    for f in frontends:
        counts: dict[str, int] = {}
        for r in rows:
            key = (r[f]["status"] if f in r else r["status"]).split(":")[0].split(" (")[0]
            counts[key] = counts.get(key, 0) + 1
        summary.append(f"{LABEL[f]}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    both = [r for r in rows if "same_op_kinds" in r]
    if both:
        summary.append(f"same op kinds and counts in both frontends: {sum(r['same_op_kinds'] for r in both)} of "
                       f"{len(both)} compiled by both")
    lines = [f"torchvision {meta['torchvision']} models ({', '.join(meta['groups'])}) on the CPU builder, "
             f"torch {meta['torch']}, {meta['date']}. Command: `{meta['command']}`. Batch 1, random weights; "
             "per frontend, compile --device cpu, then run --check --device cpu, each in a subprocess with a "
             f"{meta['timeout']:.0f} s timeout.", "", "Summary: " + "; ".join(summary) + ".", "",
             "| group | model | " + " | ".join(f"{LABEL[f]} | ops (lowered / fused) | compile wall s" for f in frontends)
             + (" | same op kinds" if len(frontends) == 2 else "") + " | message |",
             "|" + " --- |" * (3 + 3 * len(frontends) + (len(frontends) == 2))]
    for r in rows:
        cells = [r.get("group", ""), r["model"]]
        message = ""
        for f in frontends:
            x = r.get(f, {"status": r["status"]})
            cells += [x["status"], f"{x.get('lowered_ops') or '-'} / {x.get('ops') or '-'}", str(x.get("compile_wall_s", "-"))]
            if x.get("message"):
                message += f"{LABEL[f]}: {x['message']} "
        if len(frontends) == 2:
            cells.append({True: "yes", False: "no"}.get(r.get("same_op_kinds"), "-"))
        cells.append(message.strip().replace("|", "/"))
        lines.append("| " + " | ".join(cells) + " |")
    (out / "zoo.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", nargs="*", default=["classification", "segmentation", "video"], choices=list(SHAPES))
    parser.add_argument("--models", nargs="*", help="only these models (of the chosen groups)")
    parser.add_argument("--frontends", nargs="*", default=["torchscript", "export"], choices=["torchscript", "export"])
    parser.add_argument("--require-ok", action="store_true", help="exit 1 unless every model passes in every frontend "
                        "(for CI)")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    import warnings

    warnings.simplefilter("ignore")
    import torch

    if args.groups == ["samples"]:
        sys.path.insert(0, str(ROOT / "sample_models"))
        from build import MODELS, TOKEN_MODELS

        torchvision, work = None, [("samples", n) for n in [*MODELS, *TOKEN_MODELS] if not args.models or n in args.models]
    else:
        torchvision = import_torchvision()
        modules = {"classification": torchvision.models, "segmentation": torchvision.models.segmentation,
                   "video": torchvision.models.video}
        work = [(g, n) for g in args.groups if g != "samples"
                for n in sorted(torchvision.models.list_models(module=modules[g])) if not args.models or n in args.models]
    meta = {"torch": torch.__version__, "torchvision": torchvision.__version__ if torchvision else "-",
            "date": str(datetime.date.today()), "timeout": args.timeout, "groups": args.groups,
            "frontends": args.frontends,
            "command": "python benchmarks/zoo.py " + " ".join(sys.argv[1:])}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for group, name in work:
            rows.append(sweep_one(torchvision, group, name, args.frontends, args.timeout, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
            write(args.out, meta, rows)
            for p in Path(tmp).iterdir():
                p.unlink()
    failed = [f"{r['model']} ({f}: {r[f]['status']})" for r in rows for f in args.frontends
              if f in r and r[f]["status"] != "ok"] + [r["model"] for r in rows if r["status"].startswith("not built")]
    if args.require_ok and failed:
        print(f"zoo: not ok: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
