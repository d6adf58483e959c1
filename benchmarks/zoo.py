"""A coverage sweep of torchvision's models on the CPU, through both frontends (a trace to
TorchScript, and torch.export to `.pt2`): every classification model, the segmentation, video and
detection models, and (`--groups samples`) the bundled sample models.

    python benchmarks/zoo.py [--groups classification segmentation video detection samples]
                             [--models resnet18 ...] [--frontends torchscript export]
                             [--timeout 300] [--require-ok] [--out benchmarks/results]
    python benchmarks/zoo.py --groups timm transformers --machine "the H100 box" --out DIR
    python benchmarks/zoo.py --batch-sizes 1,2,4 --frontends torchscript --out DIR  # multi-batch artifacts

The second form sweeps third-party models where those libraries are installed (the GPU box has
them): timm models that compute "same" padding from the input size in Python, and timm's
transformers; Hugging Face BERT, DistilBERT, GPT-2 and ViT from small random configs.

torchvision on a CPU-only machine: the registry's wheels are CUDA builds, and pairing one with a
CPU torch fails at import on its C++ op registrations. Install the CPU build that pairs with your
torch, keeping your torch (torch 2.13 pairs with torchvision 0.28): `python tools/model_libraries.py`.
Where a CUDA build is installed anyway, this script declares the operators that torchvision could
not load before importing it: nms and roi_align with their real schemas and Python CPU implementations (detection models call
them), the others as placeholders that no model here calls. The nimble subprocesses do the same.

Per model (random weights, eval mode, batch 1, 224x224 images, 8x112x112 clips for video, larger
where a model needs it): write it both ways, then in subprocesses with a timeout run `nimble
compile --device cpu` and `nimble run --check --device cpu`. A segmentation model returns a dict
and is traced with strict=False; a detection model is wrapped to take one image batch and return
the first image's boxes, labels and scores. Each model is classified as ok, clean error (exit 1 to
3 with one line), mismatch (exit 3), crash (a traceback or a signal) or timeout, with compile
seconds and op counts, and whether the two frontends lowered the same op kinds and counts. Models
too large for a 2-core CPU are listed as skipped. Writes zoo.md and zoo.json (rows are written
after every model).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import importlib
import importlib.util
import json
import logging
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    from . import report  # imported as benchmarks.zoo (the tests)
except ImportError:
    import report  # run as a script

import torch

ROOT = Path(__file__).resolve().parents[1]
SKIP = {  # too large for a 2-core CPU builder (hundreds of millions of parameters, or minutes per run)
    "vit_h_14", "vit_l_16", "vit_l_32", "regnet_y_128gf", "regnet_y_32gf", "regnet_y_16gf",
    "efficientnet_v2_l", "efficientnet_b7", "efficientnet_b6", "convnext_large", "swin_v2_b", "swin_b",
    "regnet_x_32gf", "swin3d_b", "swin3d_s", "mvit_v1_b", "mvit_v2_s",
}
SHAPES = {"classification": (1, 3, 224, 224), "segmentation": (1, 3, 224, 224), "video": (1, 3, 8, 112, 112),
          "detection": (1, 3, 224, 224), "samples": (), "timm": (), "transformers": ()}  # () : the model's own
SHAPE = {"inception_v3": (1, 3, 299, 299), "s3d": (1, 3, 16, 224, 224)}  # models that need a larger input
# Third-party zoos, where installed (the GPU box has both): timm models that pad "same" from the
# input size in Python (tf_*, NASNet) and timm's own transformers; Hugging Face encoders and a
# decoder from small random configs, on int64 token ids and an attention mask.
TIMM = ["tf_efficientnet_b0", "tf_mobilenetv3_large_100", "nasnetalarge", "vit_small_patch16_224",
        "deit_tiny_patch16_224", "convnext_tiny", "resnet50d", "regnety_016", "swin_tiny_patch4_window7_224"]
HUGGING_FACE = ["bert", "distilbert", "gpt2", "vit"]
THIRD_PARTY = {"timm": TIMM, "transformers": HUGGING_FACE}
LABEL = {"torchscript": "TorchScript", "export": ".pt2"}
# nimble in a subprocess, as a user runs it; for detection models (which call torchvision's operators)
# after torchvision is imported here, its operators declared first where it cannot load them (a CPU
# torch). That import takes about 2 s, so only detection models pay it in their compile wall time.
NIMBLE_ALONE = [sys.executable, "-c", "from nimble.cli.entry import main; main()"]
NIMBLE = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import zoo; "
          "zoo.import_torchvision(); from nimble.cli.entry import main; main()"]


_DETECTION_OPS = {  # the torchvision operators detection models call, with their real schemas
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align": "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
                 "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
}


def _nms(dets, scores, iou_threshold: float):
    """torchvision's greedy non-maximum suppression, on the CPU in Python."""
    x1, y1, x2, y2 = dets.unbind(1)
    areas = (x2 - x1) * (y2 - y1)
    order, keep = scores.argsort(descending=True), []
    alive = torch.ones(len(dets), dtype=torch.bool)
    for i in order.tolist():
        if not alive[i]:
            continue
        keep.append(i)
        w = (torch.minimum(x2, x2[i]) - torch.maximum(x1, x1[i])).clamp(min=0)
        h = (torch.minimum(y2, y2[i]) - torch.maximum(y1, y1[i])).clamp(min=0)
        inter = w * h
        alive &= inter / (areas + areas[i] - inter) <= iou_threshold
    return torch.tensor(keep, dtype=torch.long)


def _has_ops() -> bool:
    return True


def import_torchvision():
    """torchvision; beside a CPU torch, whose C++ operators it cannot load, first declare each
    operator it registers fakes for: nms and roi_align (what detection models call) with their real
    schemas and CPU implementations in Python, so that detection models trace, and their
    TorchScript files load in any process that called this first. Once per process."""
    if "torchvision.models" in sys.modules:
        return sys.modules["torchvision"]
    lib = None
    for _ in range(100):
        try:
            import torchvision

            if lib is not None:
                from torchvision.ops.roi_align import _roi_align

                lib.impl("roi_align", _roi_align, "CPU")
                for name, module in list(sys.modules.items()):  # the two operators are there now
                    if name.startswith("torchvision") and hasattr(module, "_has_ops"):
                        module._has_ops = _has_ops
                import_torchvision.lib = lib  # the declarations live as long as the library object
            return torchvision
        except RuntimeError as e:
            m = re.search(r"torchvision::(\w+) does not exist", str(e))
            if m is None:
                raise
            for name in [k for k in sys.modules if k.startswith("torchvision")]:
                del sys.modules[name]
            if lib is None:
                lib = torch.library.Library("torchvision", "DEF")
                for schema in _DETECTION_OPS.values():
                    lib.define(schema)
                lib.impl("nms", _nms, "CPU")
            if m.group(1) not in _DETECTION_OPS:
                lib.define(f"{m.group(1)}(Tensor[] args) -> Tensor")
    raise RuntimeError("could not import torchvision")


def outcome(proc: subprocess.CompletedProcess | None, timeout: bool) -> tuple[str, str]:
    if timeout:
        return "timeout", ""
    err = proc.stderr.strip()
    last = re.sub(r"\S*/site-packages/", "", err.splitlines()[-1]) if err else ""  # torchvision/...py:12
    if proc.returncode == 0:
        return "ok", ""
    if "Traceback" in err or proc.returncode < 0 or "internal error" in err:
        return "crash", last[:300]
    if proc.returncode == 3:
        return "mismatch", last[:300]
    return "clean error", last[:300]


def build(torchvision, group: str, name: str, frontends: list[str], tmp: Path) -> tuple[dict, list[int]]:
    """The model written once per frontend: {frontend: path or 'not traceable/exportable: ...'}."""
    shape = list(SHAPE.get(name, SHAPES[group]))
    dtypes = None
    if group == "samples":
        from build import TOKEN_MODELS, build_module, example_inputs

        model, xs = build_module(name), example_inputs(name)
        shapes, dtypes = [list(x.shape) for x in xs], (TOKEN_MODELS[name][2] if name in TOKEN_MODELS else None)
    elif group == "timm":
        import timm

        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False).eval()
        shapes = [[1, *model.pretrained_cfg["input_size"]]]
        xs = tuple(torch.randn(*s) for s in shapes)
    elif group == "transformers":
        model, exported, xs = hugging_face(name)
        shapes, dtypes = [list(x.shape) for x in xs], [str(x.dtype).removeprefix("torch.") for x in xs]
    else:
        kwargs = {"aux_logits": False, "init_weights": False} if name in ("inception_v3", "googlenet") else {}
        if group == "segmentation":
            kwargs = {"weights_backbone": None, "aux_loss": False}
        if group == "detection":
            kwargs = {"weights_backbone": None}
        torch.manual_seed(0)
        model, shapes = torchvision.models.get_model(name, weights=None, **kwargs).eval(), [shape]
        if group == "detection":
            model = Detections(model)
        xs = tuple(torch.randn(*s) for s in shapes)
    files: dict = {}
    if group != "transformers":
        exported = model
    if "torchscript" in frontends:
        try:
            with torch.no_grad():
                traced = torch.jit.trace(model, xs, check_trace=False, strict=group not in ("segmentation", "detection"))
            torch.jit.save(traced, str(tmp / f"{name}.pt"))
            files["torchscript"] = tmp / f"{name}.pt"
        except Exception as e:  # the model itself does not trace: not nimble's failure, but recorded
            files["torchscript"] = f"not traceable: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if "export" in frontends:
        try:
            t = time.perf_counter()
            program = torch.export.export(exported, xs)
            torch.export.save(program, str(tmp / f"{name}.pt2"))
            files["export"] = tmp / f"{name}.pt2"
            files["export_seconds"] = round(time.perf_counter() - t, 2)
        except Exception as e:
            files["export"] = f"not exportable: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    files["dtypes"] = dtypes
    return files, shapes


class HuggingFace(torch.nn.Module):
    """A Hugging Face model called on its inputs by name (GPT-2's second positional argument is its
    cache, not the mask). As traced: returning tuples (a trace takes no ModelOutput); as exported:
    returning its ModelOutput, which nimble reads back by importing transformers."""

    def __init__(self, model, names: tuple[str, ...], tuples: bool):
        super().__init__()
        self.model, self.names, self.tuples = model, names, tuples

    def forward(self, *xs):
        return self.model(**dict(zip(self.names, xs)), return_dict=not self.tuples)


def hugging_face(name: str) -> tuple[torch.nn.Module, torch.nn.Module, tuple]:
    """A small random Hugging Face model, wrapped to trace and to export, and its inputs."""
    import transformers as hf

    torch.manual_seed(0)
    small = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
    if name == "vit":
        model, xs = hf.ViTModel(hf.ViTConfig(image_size=64, patch_size=16, **small)), (torch.randn(1, 3, 64, 64),)
    else:
        ids = torch.randint(0, 1000, (1, 16))
        mask = torch.ones(1, 16, dtype=torch.long)
        mask[:, 12:] = 0
        xs = (ids, mask)
        if name == "bert":
            model = hf.BertModel(hf.BertConfig(vocab_size=1000, **small))
        elif name == "distilbert":
            model = hf.DistilBertModel(hf.DistilBertConfig(vocab_size=1000, dim=64, n_layers=2, n_heads=4,
                                                           hidden_dim=128))
        else:
            model = hf.GPT2Model(hf.GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, use_cache=False))
    names = ("pixel_values",) if name == "vit" else ("input_ids", "attention_mask")
    model = model.eval()
    return HuggingFace(model, names, True).eval(), HuggingFace(model, names, False).eval(), xs


class Detections(torch.nn.Module):
    """A detection model as deployed from a trace: a batch of one image in, its boxes, labels and
    scores (and masks or keypoints) out. (torchvision's own interface, lists of images in and of
    dicts out, does not trace.)"""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, images):
        return tuple(self.model(list(images))[0].values())


def check_one(path: Path, shapes: list | None, timeout: float, tmp: Path, dtypes: list | None = None,
              nimble: list | None = None, batch_sizes: str | None = None) -> dict:
    """compile (--json, for the op list; `--batch-sizes` where given) then run --check, each in a
    subprocess."""
    row: dict = {}
    art = tmp / f"{path.name}.nimble"
    nimble = nimble or NIMBLE
    cmd = [*nimble, "compile", str(path), "--device", "cpu", "-o", str(art), "--json"]
    cmd += ["--batch-sizes", batch_sizes] if batch_sizes else []
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
        row["pipeline_s"] = float(m.group(2)) if m else None  # the stages, without process start and imports
        if status == "ok":
            row["targets"] = [op["target"] for op in json.loads(proc.stdout)["ops"]]
    row["status"], row["message"] = ("compile " + status, line) if status != "ok" else ("compiled", "")
    if status == "ok":
        try:
            proc = subprocess.run([*nimble, "run", str(art), "--check", "--device", "cpu"], capture_output=True,
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


def build_apart(group: str, name: str, frontends: list[str], tmp: Path, timeout: float) -> tuple[dict, list]:
    """build() in a fresh process: a process that has exported many models can fail to trace the
    next one (all twelve detection models did, after the 95 models before them)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--build", group, name, str(tmp), "--frontends", *frontends]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["the build process failed"])[-1])
    built = json.loads(lines[-1])
    return {k: Path(v["path"]) if isinstance(v, dict) else v for k, v in built["files"].items()}, built["shapes"]


def sweep_one(torchvision, group: str, name: str, frontends: list[str], timeout: float, tmp: Path,
              batch_sizes: str | None = None) -> dict:
    row: dict = {"model": name, "group": group}
    if name in SKIP:
        row["status"] = "skipped (too large for a 2-core CPU)"
        return row
    try:
        files, shapes = build_apart(group, name, frontends, tmp, timeout)
    except Exception as e:  # the model cannot even be built
        row["status"] = f"not built: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        return row
    for frontend in frontends:
        path = files[frontend]
        if isinstance(path, str):
            row[frontend] = {"status": path.split(":")[0], "message": path.split(": ", 1)[1]}
            continue
        row[frontend] = check_one(path, shapes if frontend == "torchscript" else None, timeout, tmp, files["dtypes"],
                                  NIMBLE if group == "detection" else NIMBLE_ALONE, batch_sizes)
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
    zoo = ", ".join(f"{k} {v}" for k, v in meta.get("libraries", {}).items()) \
        or (f"torchvision {meta['torchvision']}" if meta["torchvision"] != "-" else "bundled sample")
    lines = [f"{zoo} models ({', '.join(meta['groups'])}) on {meta.get('machine', 'the CPU builder')}, "
             f"torch {meta['torch']}, {meta['date']}. Command: `{meta['command']}`. "
             f"{'Batch sizes ' + meta['batch_sizes'] if meta.get('batch_sizes') else 'Batch 1'}, random weights; "
             "per frontend, compile --device cpu, then run --check --device cpu, each in a subprocess with a "
             f"{meta['timeout']:.0f} s timeout.", "", "Summary: " + "; ".join(summary) + ".", "",
             "| group | model | " + " | ".join(f"{LABEL[f]} | ops (lowered / fused) | compile wall s | pipeline s"
                                               for f in frontends)
             + (" | same op kinds" if len(frontends) == 2 else "") + " | message |",
             "|" + " --- |" * (3 + 4 * len(frontends) + (len(frontends) == 2))]
    for r in rows:
        cells = [r.get("group", ""), r["model"]]
        message = ""
        for f in frontends:
            x = r.get(f, {"status": r["status"]})
            cells += [x["status"], f"{x.get('lowered_ops') or '-'} / {x.get('ops') or '-'}", str(x.get("compile_wall_s", "-")),
                      str(x.get("pipeline_s") or "-")]
            if x.get("message"):
                message += f"{LABEL[f]}: {x['message']} "
        if len(frontends) == 2:
            cells.append({True: "yes", False: "no"}.get(r.get("same_op_kinds"), "-"))
        cells.append(message.strip().replace("|", "/"))
        lines.append("| " + " | ".join(cells) + " |")
    report.write(out, "zoo", lines, {"meta": meta, "rows": rows})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", nargs="*", default=["classification", "segmentation", "video", "detection"],
                        choices=list(SHAPES))
    parser.add_argument("--models", nargs="*", help="only these models (of the chosen groups)")
    parser.add_argument("--frontends", nargs="*", default=["torchscript", "export"], choices=["torchscript", "export"])
    parser.add_argument("--require-ok", action="store_true", help="exit 1 unless every model passes in every frontend "
                        "with the same op kinds and counts in both (for CI)")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--jobs", type=int, default=1, help="models swept at once, each in processes of its own "
                        "(compile times are then shared-machine times)")
    parser.add_argument("--batch-sizes", help="compile each model with --batch-sizes (e.g. 1,2,4): the multi-batch "
                        "artifact's row-by-row proof and checks, model by model")
    parser.add_argument("--machine", default="the CPU builder", help="where this runs, for the table's header")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--build", nargs=3, metavar=("GROUP", "MODEL", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error("--jobs takes 1 or more")
    import warnings

    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)  # a model that fails to export logs its whole graph
    if args.build:  # one model, written in this fresh process (build_apart)
        group, name, folder = args.build
        if group == "samples":
            sys.path.insert(0, str(ROOT / "sample_models"))
        files, shapes = build(import_torchvision() if group not in THIRD_PARTY and group != "samples" else None,
                              group, name, args.frontends, Path(folder))
        print(json.dumps({"files": {k: {"path": str(v)} if isinstance(v, Path) else v for k, v in files.items()},
                          "shapes": shapes}))
        return 0

    if args.groups == ["samples"]:
        sys.path.insert(0, str(ROOT / "sample_models"))
        from build import MODELS, TOKEN_MODELS

        torchvision, work = None, [("samples", n) for n in [*MODELS, *TOKEN_MODELS] if not args.models or n in args.models]
    elif set(args.groups) <= set(THIRD_PARTY):
        for g in args.groups:
            if importlib.util.find_spec(g) is None:
                parser.error(f"--groups {g} needs the {g} package installed")
        torchvision, work = None, [(g, n) for g in args.groups for n in THIRD_PARTY[g] if not args.models or n in args.models]
    else:
        torchvision = import_torchvision()
        modules = {"classification": torchvision.models, "segmentation": torchvision.models.segmentation,
                   "video": torchvision.models.video, "detection": torchvision.models.detection}
        work = [(g, n) for g in args.groups if g != "samples"
                for n in sorted(set(torchvision.models.list_models(module=modules[g])))
                if not args.models or n in args.models]
    libraries = {g: importlib.import_module(g).__version__ for g in args.groups if g in THIRD_PARTY}
    meta = {"torch": torch.__version__, "torchvision": torchvision.__version__ if torchvision else "-",
            "libraries": libraries, "machine": args.machine,
            "date": str(datetime.date.today()), "timeout": args.timeout, "groups": args.groups,
            "frontends": args.frontends, "batch_sizes": args.batch_sizes,
            "command": "python benchmarks/zoo.py " + shlex.join(sys.argv[1:])}
    rows = []
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        def one(item: tuple[int, tuple[str, str]]) -> dict:  # each model in a folder of its own, removed after it
            k, (group, name) = item
            folder = Path(tmp) / str(k)
            folder.mkdir()
            try:
                return sweep_one(torchvision, group, name, args.frontends, args.timeout, folder, args.batch_sizes)
            finally:
                shutil.rmtree(folder, ignore_errors=True)

        for row in pool.map(one, enumerate(work)):  # in the models' order
            rows.append(row)
            print(json.dumps(row), flush=True)
            write(args.out, meta, rows)
    failed = [f"{r['model']} ({f}: {r[f]['status']})" for r in rows for f in args.frontends
              if f in r and r[f]["status"] != "ok"] + [r["model"] for r in rows if r["status"].startswith("not built")]
    failed += [f"{r['model']} (the frontends' op kinds differ)" for r in rows if r.get("same_op_kinds") is False]
    if args.require_ok and failed:
        print(f"zoo: not ok: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
