"""Pages of docs/ that are generated from the code, so that they cannot drift from it:
docs/supported-ops.md from the allowlist (`core/ops/allowlist.py`).

    python tools/gen_docs.py           # rewrite them
    python tools/gen_docs.py --check   # exit 1 if one is out of date (tests run this check)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def supported_ops() -> str:
    from nimble.ops.allowlist import SUPPORTED, TRAINING_ONLY

    lines = ["# Supported ops", "",
             "Generated from `core/ops/allowlist.py` by `tools/gen_docs.py`; do not edit by hand.", "",
             "Device ops are checked against this allowlist (all overloads of each aten name); anything else is",
             "rejected at compile time with its name and source line. `prim` host ops are folded away.", ""]
    for group, names in SUPPORTED.items():
        lines.append(f"- **{group}**: " + ", ".join(f"`{n}`" for n in names))
    lines += ["", "Training only (`prepare(..., training=True)`; inference graphs never contain them): "
              + ", ".join(f"`{n}`" for n in TRAINING_ONLY) + "."]
    return "\n".join(lines) + "\n"


PAGES = {"docs/supported-ops.md": supported_ops}


def main() -> int:
    stale = []
    for page, make in PAGES.items():
        text, path = make(), ROOT / page
        if "--check" in sys.argv:
            if not path.exists() or path.read_text() != text:
                stale.append(page)
        else:
            path.write_text(text)
    for page in stale:
        print(f"{page} is out of date: run python tools/gen_docs.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
