"""Hugging Face BERT-base and GPT-2 (their real configurations, random weights) through nimble on
a GPU, as a user runs them: traced to TorchScript and exported to `.pt2`, `nimble compile --device
cuda`, `nimble run --check --device cuda`, then a load on GPU memory pre-filled with garbage ids
(`nimble.load(verify=True)`) and a call with an out-of-range id, which must be refused in one
line and leave the process's CUDA context working.

    python benchmarks/hf_trust.py --out benchmarks/results   (needs transformers and a GPU)
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import report
import torch

ROOT = Path(__file__).resolve().parents[1]
NIMBLE = [sys.executable, "-c", "from nimble.cli.entry import main; main()"]
SEQUENCE = 128


class ByName(torch.nn.Module):
    """The model called on (ids, mask) by name; tuples when traced, its ModelOutput when exported."""

    def __init__(self, model, tuples: bool):
        super().__init__()
        self.model, self.tuples = model, tuples

    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask, return_dict=not self.tuples)


def build(name: str):
    import transformers as hf

    torch.manual_seed(0)
    model = (hf.BertModel(hf.BertConfig()) if name == "bert-base" else hf.GPT2Model(hf.GPT2Config(use_cache=False))).eval()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, SEQUENCE))
    mask = torch.ones(1, SEQUENCE, dtype=torch.long)
    mask[:, SEQUENCE - 16:] = 0
    return model, (ids, mask), vocab


def nimble(*args, timeout=600) -> tuple[int, str, float]:
    t = time.perf_counter()
    r = subprocess.run([*NIMBLE, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    return r.returncode, (r.stdout + r.stderr).strip(), time.perf_counter() - t


GARBAGE_LOAD = """
import sys, torch, nimble
junk = torch.full((2**28,), -(2**62), dtype=torch.int64, device="cuda")
del junk  # 2 GiB of huge ids left in the caching allocator for the input buffers to reuse
exe = nimble.load(sys.argv[1], device="cuda", verify=True)
ids, mask = (t.cuda() for t in exe.artifact.sample_inputs)
try:
    exe(ids + int(sys.argv[2]), mask)
    print("ACCEPTED an out-of-range id")
except nimble.ShapeError as e:
    print("refused:", e)
exe(ids, mask)
torch.cuda.synchronize()
print("context ok")
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name in ("bert-base", "gpt2"):
            model, xs, vocab = build(name)
            files = {}
            with torch.no_grad():
                torch.jit.save(torch.jit.trace(ByName(model, True), xs, check_trace=False), str(tmp / f"{name}.pt"))
            files["TorchScript"] = tmp / f"{name}.pt"
            torch.export.save(torch.export.export(ByName(model, False), xs), str(tmp / f"{name}.pt2"))
            files[".pt2"] = tmp / f"{name}.pt2"
            for frontend, path in files.items():
                art = tmp / f"{name}-{frontend.strip('.')}.nimble"
                shapes = [] if frontend == ".pt2" else ["-s", f"1x{SEQUENCE}", "-s", f"1x{SEQUENCE}", "--dtype", "int64"]
                code, out, compile_s = nimble("compile", path, *shapes, "--device", "cuda", "-o", art)
                row = {"model": name, "frontend": frontend, "compile": "ok" if code == 0 else out.splitlines()[-1],
                       "compile_s": round(compile_s, 1)}
                if code == 0:
                    code, out, _ = nimble("run", art, "--check", "--device", "cuda", "--json")
                    row["run --check"] = "passed" if code == 0 else out.splitlines()[-1]
                    r = subprocess.run([sys.executable, "-c", textwrap.dedent(GARBAGE_LOAD), str(art), str(vocab)],
                                       capture_output=True, text=True, timeout=600)
                    lines = (r.stdout + r.stderr).strip().splitlines()
                    row["garbage-filled load, verify"] = "ok" if r.returncode == 0 and "context ok" in lines else lines[-1]
                    row["out-of-range id"] = next((ln for ln in lines if ln.startswith(("refused", "ACCEPTED"))), "-")
                rows.append(row)
                ok = ok and row["compile"] == "ok" and row.get("run --check") == "passed" \
                    and row.get("garbage-filled load, verify") == "ok" and row["out-of-range id"].startswith("refused")
                print(json.dumps(row), flush=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    import transformers

    head = (f"Hugging Face models through nimble on {gpu}, torch {torch.__version__}, transformers "
            f"{transformers.__version__}, {datetime.date.today()}. Command: `python benchmarks/hf_trust.py`. "
            f"Real configurations (BERT-base, GPT-2 small), random weights, batch 1, {SEQUENCE} tokens with the last "
            "16 masked, int64 ids.\n\n")
    keys = list(rows[0])
    text = head + "\n".join(report.table(keys, [[r.get(k, "-") for k in keys] for r in rows])) + "\n"
    report.write(args.out, "hf_trust", text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
