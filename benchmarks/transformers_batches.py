"""Hugging Face BERT-base and GPT-2 (124M) as multi-batch artifacts, as a user makes them: exported
with a dynamic batch dimension (`torch.export.Dim`) and traced, each compiled with
`--batch-sizes`, checked with `run --check` (every batch size, on rows that differ), and, with
`--serve`, served and queried at a batch size between two compiled ones (padded rows).

    python benchmarks/transformers_batches.py [--device cpu|cuda] [--models bert gpt2]
        [--frontends export trace] [--batch-sizes 1,2,4,8,16] [--seq 128] [--serve] [--out DIR]

Random weights from each model's default (base) configuration; inputs are token ids and an
attention mask with padding. Needs transformers. Prints one line per model and frontend, and
writes transformers_batches.md and .json to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from nimble.serve.ingress import free_port  # where the server's own processes take none unasked

from hf_trust import ByName  # the model called on (ids, mask) by name

NIMBLE = [sys.executable, "-c", "from nimble.cli.entry import main; main()"]


def build(name: str):
    import transformers as hf

    torch.manual_seed(0)
    if name == "bert":
        return hf.BertModel(hf.BertConfig()).eval()
    return hf.GPT2Model(hf.GPT2Config(use_cache=False)).eval()


def inputs(batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20000, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for r in range(batch):  # each row padded differently
        mask[r, seq - 1 - (r * 3) % (seq // 2):] = 0
    return ids, mask


def write_models(name: str, frontends: list[str], seq: int, folder: Path) -> dict[str, Path | str]:
    model = build(name)
    xs = inputs(2, seq)
    files: dict[str, Path | str] = {}
    if "export" in frontends:
        batch = torch.export.Dim("batch", min=1, max=1024)
        try:
            program = torch.export.export(ByName(model, False).eval(), xs,
                                          dynamic_shapes=({0: batch}, {0: batch}))
            torch.export.save(program, str(folder / f"{name}.pt2"))
            files["export"] = folder / f"{name}.pt2"
        except Exception as e:
            files["export"] = f"not exportable: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if "trace" in frontends:
        with torch.no_grad():
            traced = torch.jit.trace(ByName(model, True).eval(), xs, strict=False, check_trace=False)
        torch.jit.save(traced, str(folder / f"{name}.pt"))
        files["trace"] = folder / f"{name}.pt"
    return files


def run(cmd: list[str], timeout: float) -> tuple[int, str, float]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stderr, time.perf_counter() - t


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip() and not line.startswith("... ")]
    return lines[-1][:300] if lines else ""


def serve_check(name: str, artifact: Path, device: str, seq: int, rows: int) -> str:
    """Serve the artifact, ask for `rows` rows (between two compiled batch sizes: padded), and
    compare with the model run eagerly on the same rows; returns 'ok ...' or why not."""
    port = free_port()
    log = artifact.with_suffix(".serve.log")
    with open(log, "w") as err:
        proc = subprocess.Popen([*NIMBLE, "serve", str(artifact), "--port", str(port), "--metrics-port",
                                 str(free_port()), "--device", device], stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
    try:
        deadline = time.time() + 600
        while "ready at" not in log.read_text():
            if proc.poll() is not None or time.time() > deadline:
                return f"serve did not start: {last_line(log.read_text())}"
            time.sleep(1)
        model_name = artifact.stem
        meta = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{model_name}", timeout=30))
        ids, mask = inputs(rows, seq, seed=7)
        body = {"inputs": [{"name": meta["inputs"][0]["name"], "datatype": "INT64", "shape": list(ids.shape),
                            "data": ids.reshape(-1).tolist()},
                           {"name": meta["inputs"][1]["name"], "datatype": "INT64", "shape": list(mask.shape),
                            "data": mask.reshape(-1).tolist()}]}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/{model_name}/infer",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        answer = json.load(urllib.request.urlopen(req, timeout=120))
        with torch.no_grad():
            want = build(name)(input_ids=ids, attention_mask=mask).last_hidden_state
        got = next(o for o in answer["outputs"] if o["name"] == "last_hidden_state")
        got = torch.tensor(got["data"], dtype=torch.float32).reshape(got["shape"])
        err = (got - want).abs().max().item()
        names = [o["name"] for o in meta["outputs"]]
        ok = err < 1e-2 if device == "cuda" else err < 1e-3
        return f"{'ok' if ok else 'MISMATCH'}: {rows} rows, max abs error {err:.2e}, outputs {names}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", nargs="+", default=["bert", "gpt2"])
    parser.add_argument("--frontends", nargs="+", default=["export", "trace"])
    parser.add_argument("--batch-sizes", default="1,2,4,8,16")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--serve", action="store_true", help="also serve each exported artifact and query it")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" and torch.cuda.is_available() else "none"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in args.models:
            for frontend, path in write_models(name, args.frontends, args.seq, folder).items():
                row = {"model": name, "frontend": frontend, "batch_sizes": args.batch_sizes}
                if isinstance(path, str):
                    row.update(status="not exportable", message=path)
                    rows.append(row)
                    print(name, frontend, path, flush=True)
                    continue
                artifact = folder / f"{name}_{frontend}.nimble"
                shapes = [] if frontend == "export" else ["-s", f"1x{args.seq}", "-s", f"1x{args.seq}", "--dtype",
                                                          "int64"]
                code, err, secs = run([*NIMBLE, "compile", str(path), *shapes, "--batch-sizes", args.batch_sizes,
                                       "--device", args.device, "-o", str(artifact)], args.timeout)
                row["compile_s"] = round(secs, 1)
                if code != 0:
                    row.update(status="compile failed", message=last_line(err))
                else:
                    code, err, secs = run([*NIMBLE, "run", str(artifact), "--check", "--device", args.device],
                                          args.timeout)
                    row["check_s"] = round(secs, 1)
                    row.update(status="ok" if code == 0 else "check failed", message=last_line(err))
                    if code == 0 and args.serve and frontend == "export":
                        sizes = [int(b) for b in args.batch_sizes.split(",")]
                        between = next((b + 1 for b, c in zip(sizes, sizes[1:]) if c > b + 1), sizes[-1])
                        row["serve"] = serve_check(name, artifact, args.device, args.seq, between)
                rows.append(row)
                print(f"{name} {frontend}: {row['status']} (compile {row.get('compile_s')} s, check "
                      f"{row.get('check_s', '-')} s) {row['message']} {row.get('serve', '')}", flush=True)
    meta = {"date": datetime.date.today().isoformat(), "device": args.device, "gpu": gpu, "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "seq": args.seq,
            "command": " ".join(["python", "benchmarks/transformers_batches.py", *sys.argv[1:]])}
    (args.out / "transformers_batches.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# Hugging Face transformers as multi-batch artifacts ({meta['date']})", "",
             f"`{meta['command']}`: device {args.device} ({gpu}), torch {meta['torch']}, transformers "
             f"{meta['transformers']}, sequence {args.seq}, batch sizes {args.batch_sizes}; random base weights.", "",
             "| model | frontend | status | compile s | check s | serve | message |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['frontend']} | {r['status']} | {r.get('compile_s', '-')} | "
                     f"{r.get('check_s', '-')} | {r.get('serve', '-')} | {r['message'].replace('|', '/')} |")
    (args.out / "transformers_batches.md").write_text("\n".join(lines) + "\n")
    if any(r["status"] != "ok" or r.get("serve", "ok").startswith(("MISMATCH", "serve did not")) for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
