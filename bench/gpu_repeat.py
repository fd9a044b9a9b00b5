"""The repeat part of ``bench/gpu.py``: the two-replica CUDA tier tests, four more times each
(five with the tier's own run), to catch a missing stream ordering that shows only now and
then. Runs pytest in this process and records every outcome as it comes, so a part stopped
at its time limit keeps the counts it had."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gpu_parts import Ctx, Result

ROOT = Path(__file__).resolve().parents[1]
TIMES = 4  # runs on top of the tier's own
SELECT = "2replicas"  # the parametrize id of devices=["cuda:0", "cuda:0"] (cuda_helpers)


def repeat_args(times: int = TIMES) -> list[str]:
    """pytest's arguments: tests/cuda ``times`` over (``--keep-duplicates`` collects each
    copy), only the two-replica tests."""
    return ["-m", "requires_cuda", "-k", SELECT, "--keep-duplicates", "-q",
            "-p", "no:cacheprovider", *[str(ROOT / "tests" / "cuda")] * times]


class Outcomes:
    """A pytest plugin: each test's passes, failures and skips, saved after every test."""

    def __init__(self, res: Result, deadline: float) -> None:
        self.res, self.deadline = res, deadline
        self.counts: dict[str, dict[str, int]] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when != "call" and not (report.failed or report.skipped):
            return
        kind = "failed" if report.failed else "skipped" if report.skipped else "passed"
        per = self.counts.setdefault(report.nodeid, {"passed": 0, "failed": 0, "skipped": 0})
        per[kind] += 1
        self.res.numbers["per_test"] = self.counts
        self.res.save()

    def pytest_runtest_setup(self, item: Any) -> None:
        import pytest  # noqa: PLC0415

        if time.perf_counter() > self.deadline:
            pytest.exit("repeat: out of time", returncode=0)


def repeat_part(ctx: Ctx, res: Result) -> None:
    """The two-replica tier tests ``TIMES`` more times: how many runs passed, per test."""
    import pytest  # noqa: PLC0415

    plugin = Outcomes(res, ctx.deadline - 5)
    code = pytest.main(repeat_args(), plugins=[plugin])
    runs = [sum(c.values()) for c in plugin.counts.values()]
    failed = {name: c["failed"] for name, c in plugin.counts.items() if c["failed"]}
    passed = sum(c["passed"] for c in plugin.counts.values())
    skipped = sum(c["skipped"] for c in plugin.counts.values())
    res.numbers.update(exit_code=int(code), tests=len(plugin.counts), passed=passed,
                       skipped=skipped, failed_tests=failed)
    least = min(runs) if runs else 0
    value = (f"{len(plugin.counts)} tests, {least}-{max(runs) if runs else 0} runs each: "
             f"{passed} passed, {sum(failed.values())} failed, {skipped} skipped")
    res.row(f"2-replica tier tests x{TIMES} more (plus the tier's run)", value,
            "every run passes", (not failed and least >= TIMES) if ctx.cuda else None)
    res.rows += [[f"  failed: {name} ({n}x)", "", "", ""] for name, n in list(failed.items())[:10]]
