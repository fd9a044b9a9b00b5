"""Test tiers: tests marked ``requires_cuda`` run wherever a CUDA GPU is present.

Hypothesis profiles: "ci" (the default) draws few examples in a fixed order, so a CI run is
stable; ``pytest --hypothesis-profile=long`` draws many, randomly (docs/design.md, "The
equivalence harness"). Tests that set ``max_examples`` themselves keep their count.

``shared_ranks``: the tests marked ``ranks_script(SCRIPT)`` read that rank script's run in
one 2-rank torchrun job for all the collected ones (tests/distributed/shared_worker.py).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True,
                          database=None, suppress_health_check=_SLOW_OK)
settings.register_profile("long", max_examples=300, deadline=None, database=None,
                          suppress_health_check=_SLOW_OK)
settings.load_profile("ci")  # --hypothesis-profile=NAME loads NAME after this


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (the CUDA tier)")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)


@dataclass(frozen=True)
class RankRun:
    """One script's part of the shared job: its exit code (rank 0's, else rank 1's where
    rank 0's was 0), both ranks' output (rank 0's first) and the folder it was given."""

    code: object
    output: str
    out: Path


@pytest.fixture(scope="session")
def shared_ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                 ) -> Callable[[str], RankRun]:
    """``shared_ranks(SCRIPT)``: that script's run (``SCRIPT *ARGS OUT``, the mark's
    arguments), every collected test's ``ranks_script`` run in one torchrun job, started at
    the first call (a torchrun start is ~15 s of CPU)."""
    marks = {(m.args[0], tuple(m.args[1:])) for item in request.session.items
             for m in item.iter_markers("ranks_script")}
    scripts = dict(sorted(marks))
    assert len(scripts) == len(marks), f"a rank script marked with two argument lists: {marks}"
    names = {s: Path(s).stem for s in scripts}
    assert len(set(names.values())) == len(names), f"two rank scripts of one name: {marks}"
    root = tmp_path_factory.mktemp("ranks")
    runs: dict[str, RankRun] = {}

    def run(script: str) -> RankRun:
        if not runs:
            sys.path.insert(0, str(Path(__file__).parent / "distributed"))
            from test_distributed import launch  # noqa: PLC0415

            worker = str(Path(__file__).parent / "distributed" / "shared_worker.py")
            jobs = root / "jobs.json"
            jobs.write_text(json.dumps([
                {"argv": [s, *args, str(root / names[s])], "log": str(root / f"{names[s]}.log")}
                for s, args in scripts.items()]))
            _, output, _ = launch("", root, script=[worker, str(jobs)],
                                  limit=120 + 60 * len(scripts))
            for s, n in names.items():
                logs = [(root / f"{n}.log.rank{r}") for r in (0, 1)]
                texts = [f.read_text() if f.exists() else "" for f in logs]
                codes = [t.rsplit("exit code ", 1)[-1].strip() if "exit code " in t
                         else f"none (no exit code in {f}); the job:\n{output[-3000:]}"
                         for f, t in zip(logs, texts)]
                runs[s] = RankRun(next((c for c in codes if c != "0"), 0), "".join(texts),
                                  root / n)
        assert script in runs, f"{script} has no ranks_script mark on a collected test"
        return runs[script]

    return run
