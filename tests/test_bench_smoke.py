"""The benchmarks run: each script's ``--quick`` mode as a subprocess (through ``python -m
bench --quick``, which also writes the page), and the GPU checks' dry run on the CPU. The
numbers of a quick run mean nothing: these tests check what each run measured and wrote,
never how fast anything was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# The run behind every test starts torchrun jobs (2 gloo ranks on 127.0.0.1, bounded in time).
pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("overhead", "replicas", "distributed", "checkpoint", "bucketing", "reproducible",
           "hf_sizes")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both commands at once (smoke runs share the cores: their timing does not matter)."""
    tmp = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    commands = {
        "all": [sys.executable, "-m", "bench", "--quick", "--jobs", "3", "--out",
                str(tmp / "docs"), "--keep", str(tmp / "json")],
        "gpu": [sys.executable, "-m", "bench", "--gpu", "--quick", "--json",
                str(tmp / "gpu.json")],
    }
    procs = {k: subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
             for k, cmd in commands.items()}
    try:
        output = {k: p.communicate(timeout=400)[0] for k, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
    return {"tmp": tmp, "output": output, "codes": {k: p.returncode for k, p in procs.items()}}


def rows(runs: dict[str, Any], script: str) -> dict[str, dict[str, Any]]:
    data = json.loads((runs["tmp"] / "json" / f"{script}.json").read_text())
    assert data["quick"] and data["machine"]["torch"]
    return {r["case"]: r for r in data["rows"]}


def test_every_benchmark_runs_and_the_report_writes_the_page(runs):
    assert runs["codes"]["all"] == 0, runs["output"]["all"][-6000:]
    page = (runs["tmp"] / "docs" / "benchmarks.md").read_text()
    assert "python -m bench --quick" in page and "```python" not in page  # test_docs runs those
    for script in SCRIPTS:
        assert f"## {script}\n" in page and f"python bench/{script}.py" in page
        assert f"](img/{script}.png)" in page
        assert (runs["tmp"] / "docs" / "img" / f"{script}.png").exists()


def test_the_page_in_docs_ends_with_the_checklist_the_writer_writes(runs):
    """docs/benchmarks.md is generated: the first-GPU-run checklist lives in the writer, so a
    regenerated page keeps it, and the page in docs/ holds it as generated."""
    heading = "## First GPU run: checklist"
    fresh = (runs["tmp"] / "docs" / "benchmarks.md").read_text()
    kept = (ROOT / "docs" / "benchmarks.md").read_text()
    assert heading in kept and kept[kept.index(heading):] == fresh[fresh.index(heading):]


def test_overhead_measures_the_cases_of_the_issue(runs):
    got = rows(runs, "overhead")
    for case in ("MLP 32-64-64-10, batch 32", "MLP 784-512-512-10, batch 256",
                 "CNN 2 conv + linear, 28x28, batch 64",
                 "tiny BERT classifier (Hugging Face), batch 32",
                 "import fitdp on top of torch + torchmetrics (s, CPU)",
                 "EMA(decay=0.999), MLP 784-512-512-10"):
        assert got[case]["ratio"] > 0 and got[case]["target"] is not None, case
    assert got["MLP 32-64-64-10, batch 32"]["target"] == 1.10
    assert any(case.startswith("peak MiB, BERT") for case in got)


def test_replicas_compares_two_replicas_with_the_hand_loop_and_one_replica(runs):
    got = rows(runs, "replicas")
    wide = "MLP 1024-1024-1024-10, batch 256: 2 replicas"
    assert got[f"{wide}, speed vs the hand 2-thread loop"]["target"] == 0.95
    assert got[f"{wide}, speed vs 1 replica"]["target"] == 1.4
    assert any(case.startswith("peak RSS per extra CPU replica") for case in got)


def test_distributed_runs_every_engine_and_fsdp_holds_half_per_rank(runs):
    got = rows(runs, "distributed")
    for kind in ("fitdp, 2 ranks", "fitdp strategy='fsdp', 2 ranks",
                 "fitdp strategy='zero1', 2 ranks", "fitdp, 2 ranks x 2 CPU replicas"):
        assert got[f"MLP 784-512-512-10, global batch 256: {kind}"]["value"] > 0
    # DDP holds 4 + 4 + 8 bytes per parameter on each rank, FSDP2 half of that on each of two
    sharding = got["bytes the optimizer steps per rank (params, grads, Adam): fsdp"]
    params = 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
    assert sharding["ref_value"] * 2**20 == 16 * params
    assert sharding["ratio"] == pytest.approx(0.5, abs=0.01)
    # zero1: Adam's 8 bytes per parameter, split by whole parameters (rank 0 holds the
    # 784x512 weight's, 0.6 of them)
    state = got["optimizer state bytes per rank (Adam's moments): zero1"]
    assert state["ref_value"] * 2**20 == 8 * params
    assert state["value"] * 2**20 == 8 * (784 * 512) and state["verdict"] == "PASS"


def test_checkpoint_pairs_the_stall_blocks_of_each_round(runs):
    got = rows(runs, "checkpoint")
    assert {r["section"] for r in got.values()} == {"save", "stall", "copy"}
    stall = json.loads((runs["tmp"] / "json" / "checkpoint.json").read_text())["extra"]
    blocks = stall["stall_one"]  # rounds 0 (warm-up), 1, 2: each kind once, the order rotating
    assert blocks["blocks"] == ["none", "async", "sync", "async", "sync", "none", "sync",
                                "none", "async"]
    assert len(blocks["seconds"]) == 9 and len(blocks["lost_s"]) == len(blocks["cost_s"]) == 2


def test_bucketing_compares_the_four_strategies_and_bucket_memory(runs):
    got = rows(runs, "bucketing")
    for reference, target in (("(a) pad all to 256", 2.0), ("(c) length-grouped sampler", 0.97)):
        row = got[f"GRU, real tokens/s: (d) BucketIterator vs {reference}"]
        assert row["ratio"] > 0 and row["target"] == target
    assert sum(r["section"] == "memory" for r in got.values()) == 2


def test_reproducible_compares_the_mode_with_the_ordinary_step(runs):
    """Issue 31: the mode's cost against the ordinary step on the same fit, with its memory
    (the quick run: the two-replica pair at micro_batch_size=8)."""
    got = rows(runs, "reproducible")
    case = "CNN, batch 64, 2 replica(s): micro_batch_size=8"
    assert got[f"{case}, time per step"]["ratio"] > 0
    assert got[f"{case}, peak memory above the start"]["reference"] == "ordinary step"


def test_hf_sizes_compares_fitdp_with_the_hand_loop_and_the_peers_alone_and_on_ranks(runs):
    """Issue 38: the real-size rows (the quick run: a tiny GPT-2): step time and peak memory
    against the hand loop (the targets), HF Trainer and Lightning where installed, the
    reproducible mode's cost, checkpoint times, and "ddp"/"fsdp" on 2 ranks."""
    data = json.loads((runs["tmp"] / "json" / "hf_sizes.json").read_text())
    got = {(r["section"], r["case"], r["reference"]): r for r in data["rows"]}
    one, two = "GPT-2 124M, batch 4x128", "GPT-2 124M, batch 4x128, 2 ranks"
    assert got[(one, "step time", "hand loop")]["target"] == 1.03
    assert got[(one, "peak memory added by training", "hand loop")]["target"] == 1.10
    assert got[(one, "reproducible mode (one micro-batch per device): step time", "fitdp")][
        "target"] == 1.25
    for what in ("save", "load"):
        assert got[(one, f"checkpoint {what} (model and optimizer)", f"torch.{what}")][
            "value"] > 0
    for strategy in ("ddp", "fsdp"):
        for what in ("step time", "peak memory per rank"):
            assert got[(two, f"{strategy}: {what}", "hand DDP loop, 2 ranks")]["ratio"] > 0
    peers = {r["reference"] for r in data["rows"] if r["case"] == "step time"}
    assert peers >= {"hand loop"} and peers <= {"hand loop", "HF Trainer", "Lightning"}


def test_gpu_checks_dry_run_on_the_cpu(runs):
    assert runs["codes"]["gpu"] == 0, runs["output"]["gpu"][-6000:]
    parts = json.loads((runs["tmp"] / "gpu.json").read_text())["parts"]
    assert list(parts) == ["tier", "speed", "syncs", "replicas", "precision", "compile"]
    for name, part in parts.items():
        assert part["status"] == "ok" and part["rows"], (name, part)
        assert all(r["note"] != "FAILED" for r in part["rows"]), (name, part["rows"])
    verdicts = {r["case"]: r["verdict"] for part in parts.values() for r in part["rows"]}
    assert verdicts["16-mixed on the CPU: refused"] == "PASS"  # CUDA only, as documented
    for mode, seen in (("True", "['None']"), ("'reduce-overhead'", "['reduce-overhead']")):
        for replicas in (1, 2):  # fitdp's compile= mode reaches torch.compile, no recompile
            label = f"compile={mode}, {replicas} replica(s)"
            assert verdicts[f"{label}: mode torch.compile got: {seen}"] == "PASS"
            assert verdicts[f"{label}: recompiles after epoch 1"] == "PASS"
