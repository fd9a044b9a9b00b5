"""Python bytecodes per training step, fitdp against the floor loop, by file.

Run: python tools/bytecodes.py [--json out.json] [--quick]

What the tiny MLP's overhead is made of (bench/overhead.py reads about 1.09x the floor loop
on the 2-core CPU, where valgrind counts the same instructions, tools/instructions.py). The
count is exact and the same on every machine with the same Python and torch: ``sys.settrace``
with opcode events counts every bytecode each loop runs, for two epoch lengths, so the per-fit
cost drops out (``(B(n2) - B(n1)) / (n2 - n1)``). Each count is split into fitdp's own code,
torch's and the rest (the standard library), with fitdp's largest functions listed: where a
change to the step path adds or removes Python, it shows here first.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import fitdp_loop, hand_loop, mlp  # noqa: E402 - bench/common.py's loops

SIZES, BATCH = [32, 64, 64, 10], 32  # bench/overhead.py's tiny MLP


def where(path: str) -> str:
    """``fitdp/...``, ``torch`` or ``other`` for a code object's file."""
    parts = Path(path).parts
    if "fitdp" in parts:
        return "/".join(parts[parts.index("fitdp"):])
    return "torch" if "torch" in parts else "other"


def count(loop: Callable[[], None]) -> collections.Counter[tuple[str, str]]:
    """Bytecodes run by one call of ``loop``, by (file, function)."""
    counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        if event == "opcode":
            counts[(where(frame.f_code.co_filename), frame.f_code.co_name)] += 1
        return tracer

    sys.settrace(tracer)
    try:
        loop()
    finally:
        sys.settrace(None)
    return counts


def per_step(kind: str, n1: int, n2: int) -> collections.Counter[tuple[str, str]]:
    """Bytecodes per step of one loop (``fitdp`` or ``hand``), from epochs of n1 and n2 steps."""
    runs = []
    for n in (n1, n2):
        torch.manual_seed(0)
        x, y = torch.randn(n * BATCH, SIZES[0]), torch.randint(0, SIZES[-1], (n * BATCH,))
        net = mlp(SIZES)
        loop = (fitdp_loop(copy.deepcopy(net), x, y, BATCH, ["cpu"]) if kind == "fitdp"
                else hand_loop(copy.deepcopy(net), x, y, BATCH))
        loop()  # warm-up: first-call work (the first batch's checks) is not counted
        runs.append(count(loop))
    keys = set(runs[0]) | set(runs[1])
    return collections.Counter({k: (runs[1][k] - runs[0][k]) / (n2 - n1) for k in keys})


def split(counts: collections.Counter[tuple[str, str]]) -> dict[str, float]:
    parts = {"fitdp": 0.0, "torch": 0.0, "other": 0.0}
    for (path, _), n in counts.items():
        parts["fitdp" if path.startswith("fitdp") else path] += n
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="shorter epochs (same counts)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    n1, n2 = (4, 8) if args.quick else (20, 40)
    fitdp, hand = per_step("fitdp", n1, n2), per_step("hand", n1, n2)
    parts = {"fitdp": split(fitdp), "hand": split(hand)}
    print(f"{'bytecodes per step, tiny MLP':<30} {'fitdp':>8} {'floor loop':>11}")
    for part, label in (("fitdp", "fitdp's code"), ("torch", "torch's code"),
                        ("other", "the rest (the loop, stdlib)")):
        print(f"{label:<30} {parts['fitdp'][part]:8.0f} {parts['hand'][part]:11.0f}")
    totals = {k: sum(v.values()) for k, v in parts.items()}
    print(f"{'all':<30} {totals['fitdp']:8.0f} {totals['hand']:11.0f}  "
          f"ratio {totals['fitdp'] / totals['hand']:.3f}")
    top = [(f"{path}:{name}", n) for (path, name), n in fitdp.most_common()
           if path.startswith("fitdp") and n > 0][:12]
    print("fitdp's largest functions per step: " + ", ".join(f"{k} {n:.0f}" for k, n in top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": [n1, n2], "parts": parts, "totals": totals,
                       "ratio": totals["fitdp"] / totals["hand"], "fitdp_top": dict(top)},
                      f, indent=2)


if __name__ == "__main__":
    main()
