"""docs/design.md's walk of one batch is checked against a real fit (issue 18 item 5: the page
described ``load_data_batch``/``forward``/``backward`` long after ``Session`` stopped taking
that path). Every ``file.py:function`` the walk names must exist and run during a two-replica
fit, and the frames the page lists at the optimizer step must be on that stack, in the
page's order (issue 30 item 9: the hops, not the exact depth, so a helper added between two
hops does not fail the page)."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

import fitdp

ROOT = Path(fitdp.__file__).resolve().parent
PAGE = Path(__file__).resolve().parents[1] / "docs" / "design.md"
HOP = re.compile(r"`((?:[a-z_]+/)+[a-z_]+\.py):([A-Za-z_][\w.]*)")


def walk_section() -> str:
    text = PAGE.read_text()
    start = text.index("## How one batch travels")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def page_stack() -> list[str]:
    block = re.search(r"```text\n(.*?)```", walk_section(), re.S)
    assert block, "the walk has a ```text block: the stack at the optimizer step"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def fitdp_frame(frame) -> str | None:
    path = Path(frame.f_code.co_filename)
    if ROOT not in path.parents:
        return None
    name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
    return f"{path.relative_to(ROOT).as_posix()}:{name}"


def record_fit(width: int) -> tuple[set[str], list[str]]:
    """Every fitdp function a two-replica fit calls (on every thread), and the fitdp frames
    on the stack when the optimizer takes the fit's last step."""
    called: set[str] = set()
    stack: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            where = fitdp_frame(frame)
            if where is not None:
                called.add(where)

    optimizer_class = torch.optim.SGD
    original = optimizer_class.step

    def step(self, *args, **kwargs):
        stack.clear()  # keep the last step's: every batch after the first takes it
        frame = sys._getframe(1)
        while frame is not None:
            where = fitdp_frame(frame)
            if where is not None:
                stack.append(where)
            frame = frame.f_back
        stack.reverse()
        return original(self, *args, **kwargs)

    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 3)))
    model.compile(optimizer="sgd", loss="cross_entropy", lr=0.1,
                  metrics=[MulticlassAccuracy(num_classes=3)])
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    optimizer_class.step = step
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        model.fit(x, y, batch_size=32, epochs=1, devices=["cpu", "cpu"], verbose=0)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        optimizer_class.step = original
        model.close()
    return called, stack


def test_every_hop_the_walk_names_runs_in_a_fit():
    called, _ = record_fit(8)
    hops = sorted({(f, name) for f, name in HOP.findall(walk_section())})
    assert hops, "the walk names its hops as `file.py:function`"
    missing = []
    for f, name in hops:
        if not (ROOT / f).exists():
            missing.append(f"{f} (no such file)")
        elif not any(c == f"{f}:{name}" or c.startswith(f"{f}:{name}.") for c in called):
            missing.append(f"{f}:{name}")
    assert missing == [], "named on the page but not run by a two-replica fit"


def test_the_pages_frames_at_the_optimizer_step_are_on_the_codes_stack_in_order():
    _, stack = record_fit(8)
    frames = page_stack()
    assert frames, "the walk lists the frames at the optimizer step"
    missing = [f for f in frames if f not in stack]
    assert missing == [], f"listed on the page but not on the stack {stack}"
    assert [f for f in stack if f in frames] == frames, "the page's frames are out of order"
