"""`tools/train_step_memory.py` on the CPU: the plan's part of a step's memory, from a small net."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_memory_tool_reports_the_arena_and_the_computed_results_of_a_step():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "train_step_memory.py"), "--model", "resnet18_small",
                           "--batch", "4", "--size", "32", "--device", "cpu"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"plan: arena (\d+) MiB \(lower bound (\d+), every buffer apart (\d+)\); computed results (\d+) "
                      r"MiB, at most (\d+) live at once, (\d+) as the sum of each stream's most; (\d+) streams", done.stdout)
    assert found, done.stdout
    arena, bound, apart, computed, live, per_stream, streams = map(int, found.groups())
    assert bound <= arena <= apart and live <= per_stream <= computed and computed >= 42  # its weight gradients alone: 42.6 MiB
    assert "computed by aten::convolution_backward.default" in done.stdout
