"""Compares two runs' outcomes under a `Promise`, and a refused resume under the refusal
rule."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from harness_promises import Promise, against_one_device, against_uninterrupted, may_refuse, refuses
from harness_runner import uninterrupted
from harness_runs import Run


def _differences(got: Any, want: Any, promise: Promise, where: str) -> list[str]:
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            return [f"{where}: {got!r} against {want!r}"]
        if promise.exact:
            same = torch.equal(got, want)
        else:
            same = torch.allclose(got.double(), want.double(), rtol=promise.rtol,
                                  atol=promise.atol)
        if same:
            return []
        gap = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
        return [f"{where}: max difference {gap:.3g}"]
    if isinstance(want, dict):
        if not isinstance(got, dict) or got.keys() != want.keys():
            return [f"{where}: keys {sorted(got) if isinstance(got, dict) else got!r} "
                    f"against {sorted(want)}"]
        return [d for k in want for d in _differences(got[k], want[k], promise, f"{where}.{k}")]
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return [f"{where}: {got!r} against {want!r}"]
        return [d for i, (g, w) in enumerate(zip(got, want))
                for d in _differences(g, w, promise, f"{where}[{i}]")]
    if isinstance(want, float) and not promise.exact:
        close = abs(got - want) <= promise.atol + promise.rtol * abs(want)
        return [] if close else [f"{where}: {got!r} against {want!r}"]
    return [] if got == want else [f"{where}: {got!r} against {want!r}"]


def assert_kept(promise: Promise, got: dict[str, Any], want: dict[str, Any], run: Run,
                reference: str) -> None:
    """Every compared entry (weights, optimizer state, step, History, evaluate) as promised."""
    found = _differences(got, want, promise, "")
    if found:
        kind = "bitwise" if promise.exact else f"rtol={promise.rtol}, atol={promise.atol}"
        raise AssertionError(
            f"{run!r}\ndiffers from {reference} ({kind}; {promise.why}):\n  "
            + "\n  ".join(found[:12]))


def assert_refused(got: dict[str, Any], run: Run, why: str) -> None:
    """The resume onto too-short data raised a clear error and moved nothing."""
    assert got["clear"], (
        f"{run!r}\nresumed onto data too short for the checkpoint's position without a clear "
        f"refusal (got {got['refusal']}, global_step {got['step']}); {why}")
    assert got["unchanged"] and got["step"] == 0, (
        f"{run!r}\nthe refused resume moved the model ({got['refusal']})")


def judge(run: Run, drawn: dict[str, Any], on_placement: dict[str, Any] | None = None) -> None:
    """Holds ``drawn`` (the outcome of ``run``) to every promise that applies.
    ``on_placement``: the uninterrupted run on ``run``'s first placement without activation
    checkpointing, when already run (under torchrun); else it is run here when needed."""
    why = refuses(run)
    if why:
        assert_refused(drawn, run, why)
        return
    plain = replace(run, stop=None, checkpointing=False)
    if on_placement is None and not (run.stop or run.checkpointing):
        on_placement = drawn  # the drawn run is that run
    promise = against_uninterrupted(run)
    if promise and (run.stop or run.checkpointing):
        on_placement = on_placement or uninterrupted(plain)
        assert_kept(promise, _common(drawn, on_placement), _common(on_placement, drawn), run,
                    "the uninterrupted run on its first devices and ranks")
    promise = against_one_device(run)
    if promise:
        on_placement = on_placement or uninterrupted(plain)
        one = uninterrupted(replace(plain, devices=1, loads=None, ranks=1))
        assert_kept(promise, _common(on_placement, one), _common(one, on_placement), run,
                    "the uninterrupted run on one device in one process")


def _common(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """``evaluate`` is run in one process only: compared where both sides have it."""
    return {k: v for k, v in a.items() if k in b or k != "evaluate"}


def assert_refusal_allowed(run: Run, error: Exception) -> None:
    """A ``fit`` of ``run`` raised ``error``: only a refusal the docs allow passes."""
    if not any(fragment in str(error) for fragment in may_refuse(run)):
        raise AssertionError(f"{run!r}\nfit raised {error!r}") from error
