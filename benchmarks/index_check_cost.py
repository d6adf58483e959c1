"""What the host-side range check of token ids costs a call (`runtime/placed/indices.py`).

For the bundled bert sample and Hugging Face BERT-base (random weights, 128 tokens), one process
loads the artifact on CUDA and times `exe(ids, mask)` (latency: copy in, replay, synchronize)
with the check, and with the check's plan emptied, for ids that live on the GPU and on the CPU.
Medians of 500 calls after 50, alternating the variants in blocks of 50.

    python benchmarks/index_check_cost.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

import report
import torch
from hf_trust import ByName

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def artifacts(tmp: Path) -> dict[str, Path]:
    from nimble.formats import write_artifact
    from nimble.pipeline import compile_model
    from nimble.specs import input_specs

    out = {}
    c = compile_model(ROOT / "sample_models" / "bert.pt", input_specs(["1x16", "1x16"], ["int64"]), device="cuda")
    write_artifact(tmp / "bert.nimble", c.artifact())
    out["bert sample (16 tokens)"] = tmp / "bert.nimble"
    try:
        import transformers as hf
    except ImportError:
        return out

    torch.manual_seed(0)
    model = ByName(hf.BertModel(hf.BertConfig()).eval(), tuples=True)  # as hf_trust.py traces it
    xs = (torch.randint(0, 30522, (1, 128)), torch.ones(1, 128, dtype=torch.long))
    with torch.no_grad():
        torch.jit.save(torch.jit.trace(model, xs, check_trace=False), str(tmp / "bert_base.pt"))
    c = compile_model(tmp / "bert_base.pt", input_specs(["1x128", "1x128"], ["int64"]), device="cuda")
    write_artifact(tmp / "bert_base.nimble", c.artifact())
    out["HF BERT-base (128 tokens)"] = tmp / "bert_base.nimble"
    return out


def latency_ms(call, blocks: int = 10, per_block: int = 50) -> list[float]:
    samples = []
    for _ in range(per_block):
        call()
    torch.cuda.synchronize()
    for _ in range(blocks):
        for _ in range(per_block):
            t = time.perf_counter()
            call()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - t) * 1000)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import nimble

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in artifacts(Path(tmp)).items():
            exe = nimble.load(path, device="cuda")
            checked = exe._indices.inputs
            for where in ("cuda", "cpu"):
                xs = [x.to(where) for x in exe.artifact.sample_inputs]
                times: dict[str, list[float]] = {"checked": [], "unchecked": []}
                for _ in range(5):  # alternate, so drift hits both alike
                    for variant in times:
                        exe._indices.inputs = checked if variant == "checked" else {}
                        times[variant] += latency_ms(lambda: exe(*xs, copy=False), blocks=2)
                exe._indices.inputs = checked
                a, b = statistics.median(times["checked"]), statistics.median(times["unchecked"])
                rows.append([name, f"ids on {where}", f"{a:.4f}", f"{b:.4f}", f"{(a - b) * 1000:.1f}"])
                print(rows[-1], flush=True)
    head = (f"Host range check of token ids, on {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"{datetime.date.today()}, batch 1, fp32. Command: `python benchmarks/index_check_cost.py`. Latency "
            "= copy in, replay, synchronize; median of 500 calls per variant, in one process.")
    lines = [head, "", *report.table(["model", "inputs", "checked ms", "unchecked ms", "cost us"], rows)]
    print("\n".join(lines))
    report.write(args.out, "index_check_cost", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
