"""Smoke test for the benchmarks in bench/: they run and print their ratio lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_checkpoint_bench_quick_runs(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "checkpoint.py"), "--quick", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "save ratio (fitdp / bare torch.save):" in proc.stdout
    assert "save ratio (fitdp / torch.save + fsync):" in proc.stdout
    assert "copy_to bandwidth ratio (copy_to / memcpy):" in proc.stdout
    numbers = json.loads(out.read_text())
    assert numbers["save_ratio"] > 0 and numbers["copy_bandwidth_ratio"] > 0


def quick(script: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``bench/script --quick [args]``, which must succeed."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--quick", *args],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.distributed  # launches 2-rank gloo jobs on 127.0.0.1 under torchrun
def test_distributed_bench_quick_runs() -> None:
    proc = quick("distributed.py")
    for case in ("(a) fitdp, torchrun 2 ranks", "(b) hand DDP loop", "(d) fitdp, 1 process"):
        row = [line for line in proc.stdout.splitlines() if line.startswith(case)]
        assert row and "FAILED" not in row[0], proc.stdout
    assert "target (a) >= 1.0x (b), median of the rounds' ratios:" in proc.stdout


@pytest.mark.distributed  # launches 2-rank gloo jobs on 127.0.0.1 under torchrun
def test_sharding_bench_measures_fit_under_both_strategies(tmp_path: Path) -> None:
    """bench/sharding.py counted fitdp's engines driven by hand, not Model.fit's ranks."""
    out = tmp_path / "sharding.json"
    proc = quick("sharding.py", "--json", str(out), timeout=240)
    numbers = json.loads(out.read_text())
    ddp, fsdp = numbers["rows"]["ddp"], numbers["rows"]["fsdp"]
    assert ddp["steps"] == fsdp["steps"] == 3  # one callback call per fit step
    # ddp holds 4 + 4 + 8 bytes per parameter; fsdp half of that on each of 2 ranks
    assert sum(ddp["bytes"].values()) == 16 * ddp["params"]
    for per_rank in fsdp["bytes_per_rank"]:
        assert abs(sum(per_rank.values()) - 8 * ddp["params"]) < 0.01 * 8 * ddp["params"]
    assert "fsdp / ddp memory per rank: 0.50x" in proc.stdout


def test_save_stall_pairs_each_rounds_blocks() -> None:
    """bench/checkpoint.py read one unpaired median of 7 rounds (0.17, 0.93, 2.9 in three
    runs): the stall is now async - none and sync - none of the same round, round 0 left out."""
    from bench import save_stall  # noqa: PLC0415

    blocks = save_stall.schedule(2)
    assert blocks == ["none", "async", "sync", "async", "sync", "none", "sync", "none", "async"]
    base = {"none": 1.0, "async": 1.1, "sync": 2.0}  # + drift: 0.01 s per block, warm-up 0.5
    seconds = [base[k] + (0.5 if i < 3 else 0.01 * i) for i, k in enumerate(blocks)]
    res = save_stall.analyse({"blocks": blocks, "seconds": seconds, "call_s": [0.001] * 9,
                              "fence_s": [0.002] * 9, "end_wait_s": [0.0] * 9,
                              "steps_per_block": 4})
    # round 1: none at 5, async at 3, sync at 4; round 2: none at 7, async at 8, sync at 6
    asyn = [1.1 + 0.03 - 1.0 - 0.05, 1.1 + 0.08 - 1.0 - 0.07]
    sync = [2.0 + 0.04 - 1.0 - 0.05, 2.0 + 0.06 - 1.0 - 0.07]
    assert res["lost_s"] == pytest.approx(asyn) and res["sync_cost_s"] == pytest.approx(sync)
    assert res["ratio"] == pytest.approx((asyn[0] + asyn[1]) / (sync[0] + sync[1]))
    assert res["direct_quartiles_s"][1] == pytest.approx(0.003)


@pytest.mark.distributed  # 2-rank gloo jobs on 127.0.0.1 under torchrun
def test_save_stall_bench_runs_on_every_path(tmp_path: Path) -> None:
    out = tmp_path / "stall.json"
    quick("save_stall.py", "--json", str(out), timeout=300)
    paths = json.loads(out.read_text())["paths"]
    assert sorted(paths) == ["ddp", "fsdp", "one"]
    for res in paths.values():  # 3 blocks in each of the warm-up and 2 rounds, all timed
        assert len(res["seconds"]) == len(res["fence_s"]) == 9 and len(res["lost_s"]) == 2
        assert res["bytes"] > 0  # the saves wrote a checkpoint (fsdp: a folder of shards)


def test_run_all_quick_writes_page_and_charts(tmp_path: Path) -> None:
    # distributed.py has its own smoke test above: leave its torchrun launches out here.
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--out", str(tmp_path),
         "--only", "overhead,checkpoint,bucketing"],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=420,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "ratio" in proc.stdout and "load average" in proc.stdout
    page = (tmp_path / "benchmarks.md").read_text()
    assert "python bench/run.py --quick" in page and "distributed" in page
    assert "```python" not in page  # tests/test_docs.py would run it
    charts = sorted((tmp_path / "img").glob("*.png"))
    assert charts, page
    for chart in charts:  # every chart is on the page, by a relative link
        assert f"](img/{chart.name})" in page


def test_the_benchmarks_page_ends_with_the_first_gpu_runs_checklist():
    """docs/benchmarks.md is generated: the checklist lives in bench/report.py, so a
    regenerated page keeps it, and the page in docs/ holds it as generated."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import report  # noqa: PLC0415
    finally:
        sys.path.remove(str(ROOT / "bench"))
    checklist = "\n".join(report.GPU_CHECKLIST).rstrip() + "\n"
    assert report.page("x", "now", [], [], [], quick=False).endswith(checklist)
    assert (ROOT / "docs" / "benchmarks.md").read_text().endswith(checklist)


def test_instruction_rows_hold_fitdp_to_the_hand_loops_count():
    """bench/instructions.py's rows: the ratio is fitdp's count over the hand loop's, held to
    its target (a count 20% over the floor loop's misses), and a run without valgrind says why
    instead of giving rows."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import summary  # noqa: PLC0415
    finally:
        sys.path.remove(str(ROOT / "bench"))
    data = {"cases": {"tiny": {"fitdp": 1.2e6, "hand": 1e6, "ratio": 1.2, "target": 1.05},
                      "replicas_128": {"fitdp": 4.9e6, "hand": 5e6, "ratio": 0.98,
                                       "target": 1.05}},
            "steps": {"tiny": [5, 25], "replicas_128": [20, 100]}}
    rows, detail = summary.instructions(data)
    assert [r.result for r in rows] == ["MISS", "PASS"]
    assert detail.rows[0][1:3] == ["1,200,000", "1,000,000"]
    with pytest.raises(ValueError, match="valgrind"):
        summary.instructions({"skipped": "valgrind not on PATH"})



def test_huggingface_bench_quick_runs(tmp_path: Path) -> None:
    out = tmp_path / "hf.json"
    proc = quick("huggingface.py", "--json", str(out), timeout=300)
    assert "tiny BERT fit overhead:" in proc.stdout
    numbers = json.loads(out.read_text())
    assert numbers["overhead"]["ratio"] > 0
    # exact (no timing): the error loss_items removes is there without it, gone with it
    errors = numbers["items_error"]
    assert errors["2 steps, loss_items=None"] > 1e-3
    assert errors["2 steps, loss_items=causal_lm"] < 1e-5
