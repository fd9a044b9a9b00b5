"""``python -m bench --gpu`` runs end to end on the CPU (``--dry-run``), up to the CUDA-only
calls: every part, the tier, the table and the JSON; its runner kills a part's whole process
group at the part's limit; the tier's counts come from pytest's JUnit report. Not in the CUDA
tier: it checks the script wherever the tests run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import cuda_helpers
import gpu

ROOT = cuda_helpers.TESTS.parent


def test_dry_run_runs_every_part(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "bench", "--gpu", "--dry-run", "--json",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["machine"]["gpu"].startswith("none") and report["machine"]["torch"]
    assert list(report["parts"]) == ["tier", "repeat", "speed", "syncs", "replicas",
                                     "precision", "compile"]
    for name, part in report["parts"].items():
        assert part["status"] == "ok", (name, part)
        assert part["rows"], name
        assert all(row[-1] != "FAILED" for row in part["rows"]), (name, part["rows"])
    tier = report["parts"]["tier"]["numbers"]
    assert tier["skipped"] > 0 and tier["passed"] == tier["failed"] == 0  # no GPU: all skip
    verdicts = {row[0]: row[-1] for row in report["parts"]["precision"]["rows"]}
    assert verdicts["16-mixed on the CPU"] == "met"  # refused, as documented
    compiled = report["parts"]["compile"]["numbers"]
    for mode, seen in ((True, ["None"]), ("reduce-overhead", ["reduce-overhead"])):
        for replicas in ("1 replica", "2 replicas"):
            label = f"compile={mode!r} on {replicas}"
            # fitdp's compile= mode reaches torch.compile (the bench's own options once
            # replaced "reduce-overhead" by fitdp's explicit mode=None)
            assert compiled[label]["modes_seen"] == seen, (label, compiled[label])
            assert compiled[label]["recompiles_after_first_epoch"] == 0
            assert compiled[label]["graphs_first_epoch"] == compiled[label]["shapes"] > 0
    syncs = report["parts"]["syncs"]["numbers"]
    for label in ("a metric with its defaults (MulticlassAccuracy(n))",
                  "work_load_list='auto', 2 replicas"):
        assert syncs[label]["steps"] > 0, label
    replicas = report["parts"]["replicas"]["numbers"]
    for label in ("host time, 1 replica on one device", "host time, 2 replicas on one device"):
        assert replicas[label]["host_ms"] > 0 and replicas[label]["step_ms"] > 0, label
    assert report["parts"]["repeat"]["numbers"]["exit_code"] in (0, 5)  # all skip here
    assert "part       measure" in proc.stdout and "numbers in" in proc.stdout


def test_the_part_budgets_fit_the_total_with_room_for_start_up() -> None:
    """The budgets once added up to 515 s against a 470 s total: the last part (compile,
    after a cold compile) would run out of time. Within 8 minutes with room to start."""
    assert set(gpu.BUDGET_S) == {"tier", *gpu.PARTS}
    assert sum(gpu.BUDGET_S.values()) <= gpu.TOTAL_S <= 480 - 45


def test_part_process_writes_its_rows(tmp_path: Path) -> None:
    """What a part's own process (started by the GPU run) leaves for the table."""
    out = tmp_path / "replicas.json"
    assert gpu.main(["--part", "replicas", "--device", "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    # two replicas agree; timing and host time have no target
    assert [r[-1] for r in rows] == ["met", "", "", ""]


def test_child_and_what_it_started_are_killed_at_the_limit(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild"
    script = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
              "'import time; time.sleep(60)']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    child = gpu.Child([sys.executable, "-c", script])
    while not pid_file.exists() or not pid_file.read_text():
        time.sleep(0.05)
    status, seconds = child.finish(timeout=0.5)
    assert status.startswith("timed out"), status
    assert seconds < 30
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped counts as gone)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def test_tier_counts_come_from_the_junit_report(tmp_path: Path) -> None:
    """pytest's JUnit XML: a module that cannot be imported is a testcase whose error says
    "collection failure"; outside tests/cuda it is listed, not counted as a failed test."""
    xml = tmp_path / "tier.xml"
    xml.write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="2" skipped="1">'
        '<testcase classname="tests.cuda.test_a" name="test_ok"/>'
        '<testcase classname="tests.cuda.test_a" name="test_bad"><failure message="x"/>'
        '</testcase><testcase classname="tests.cuda.test_b" name="test_err"><error/>'
        '</testcase><testcase classname="tests.cuda.test_b" name="test_skip"><skipped/>'
        '</testcase><testcase classname="" name="tests.test_docs">'
        '<error message="collection failure"/></testcase></testsuite></testsuites>')
    res = gpu.tier_result(xml, "exit code 1")
    assert res.rows[0][1:] == ["1 passed, 2 failed, 1 skipped", "all pass", "MISSED"]
    assert res.numbers["failed_tests"] == ["tests.cuda.test_a::test_bad",
                                           "tests.cuda.test_b::test_err"]
    assert res.numbers["not_collected"] == ["tests.test_docs"]
    assert res.rows[-1][1:] == ["1 module(s)", "", ""]
    missing = gpu.tier_result(tmp_path / "none.xml", "timed out after 170 s")
    assert missing.rows == [["CUDA tier", "no report (timed out after 170 s)", "all pass",
                             "FAILED"]]
