"""Which drawn run promises what: the one place that reads the docs' promises.

A drawn run D is compared with up to two uninterrupted references, both without activation
checkpointing: U, on D's first placement (devices, work loads, ranks), and R, on one device
in one process over the same global batches. Each rule below quotes the sentence of docs/ it
stands on; where the docs promise nothing (dropout masks on other replica layouts, say), no
comparison is made.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness_runs import Run


@dataclass(frozen=True)
class Promise:
    """Bitwise (``exact``) or within ``rtol``/``atol``; ``why`` quotes the docs."""

    exact: bool
    why: str
    rtol: float = 0.0
    atol: float = 0.0


# devices.md, "The update does not depend on the devices": "the update equals the one a single
# device makes on the whole batch, whatever the device count and the work loads, up to float
# rounding" (its example checks atol=1e-6; the suite's equivalence tests rtol=1e-5 as well).
ROUNDING = {"rtol": 1e-5, "atol": 1e-6}

REPRODUCIBLE = Promise(True, "reproducible.md: 'They are bitwise equal (torch.equal) for any "
                       "devices list and any work_load_list; any world size under torchrun with "
                       "the same global batch; a resume on another device list, from a "
                       "checkpoint taken right after an optimizer step; with grad_accum_steps, "
                       "grad_clip_norm, dropout and shuffling.'")
SAME_PLACEMENT = Promise(True, "checkpoints.md: 'The final weights equal those of an "
                         "uninterrupted run bit for bit when the resumed run uses the same "
                         "devices and work_load_list ... it runs on the CPU'; devices.md: 'With "
                         "a seed, a run gives the same weights bit for bit on any device list, "
                         "CPU replicas with Dropout included, and so does a resumed run'; "
                         "distributed.md: 'Resume with the same world size and devices for a "
                         "bitwise-exact continuation.'")
OTHER_DEVICES = Promise(False, "checkpoints.md: 'resuming on other devices works and ends "
                        "close, not bitwise equal' (close: float rounding, devices.md)",
                        **ROUNDING)
ONE_DEVICE = Promise(False, "devices.md: 'the update equals the one a single device makes on "
                     "the whole batch, whatever the device count and the work loads, up to "
                     "float rounding'; distributed.md: 'For mean-reduced losses the update "
                     "equals the one a single device would make on that whole global batch.'",
                     **ROUNDING)
CHECKPOINTING = Promise(False, "precision.md (activation checkpointing): 'Training gives the "
                        "same weights as without (the tests compare both, on one and two CPU "
                        "replicas)' (its example: atol=1e-6)", **ROUNDING)
REFUSAL = ("checkpoints.md: 'Every entry is checked before any is loaded (... the run "
           "position, the data position against this fit's data ...). A checkpoint of another "
           "model or of other data is a CheckpointError ... and either changes nothing: "
           "weights, optimizer state and global_step stay as they were.'")


def _weaker(a: Promise, b: Promise) -> Promise:
    """Both promises hold: the looser one is what can be checked."""
    if a.exact and b.exact:
        return a
    loose = [p for p in (a, b) if not p.exact]
    return Promise(False, " + ".join(p.why for p in (a, b)),
                   max(p.rtol for p in loose), max(p.atol for p in loose))


def _draws_or_normalises(run: Run) -> bool:
    """Dropout masks and BatchNorm's per-slice statistics depend on the replica layout
    (devices.md: 'BatchNorm normalises each slice with that slice's statistics ... the update
    differs from a single device's'); only the reproducible mode removes that."""
    return run.randomness != "none"


def _same_batches_as_one_process(run: Run) -> bool:
    """Under torchrun, DataLoaders and BucketIterators hand each rank whole batches
    round-robin (distributed.md): a BucketIterator (or group_by_length) of half the batch
    groups other rows, and padding cut per batch makes other shapes, so those are not one
    process's batches."""
    return run.ranks == 1 or not (run.varlen or run.kind in ("buckets", "grouped"))


def against_uninterrupted(run: Run) -> Promise | None:
    """D against U (D's first placement, uninterrupted, no activation checkpointing)."""
    if run.reproducible:
        return REPRODUCIBLE
    stop = run.stop
    moved = stop is not None and (stop.devices, stop.loads, stop.ranks) != (
        run.devices, run.loads, run.ranks)
    if moved and (_draws_or_normalises(run) or not _same_batches_as_one_process(run)):
        return None  # other masks, slices or batches after the move: nothing is promised
    promise = OTHER_DEVICES if moved else SAME_PLACEMENT
    return _weaker(promise, CHECKPOINTING) if run.checkpointing else promise


def against_one_device(run: Run) -> Promise | None:
    """U against R (one device, one process); None where U is R or nothing is promised."""
    if (run.devices, run.ranks) == (1, 1):
        return None
    if run.reproducible:
        return REPRODUCIBLE
    if _draws_or_normalises(run) or not _same_batches_as_one_process(run):
        return None
    return ONE_DEVICE


CHECKPOINTING_REFUSAL = ("precision.md: 'On several CPU replicas that generator is shared by the "
                         "replicas' threads ... so there fit refuses, before any step, blocks "
                         "holding a dropout layer with p > 0, naming them'; issue 37 item 5 asks "
                         "the same of blocks that draw through a function (or exactness)")


BATCHNORM_ROW_REFUSAL = ("devices.md: 'A fit that would hand a training BatchNorm1d one row (a "
                         "work_load_list that gives a device one row of a batch, or a last "
                         "batch that does) is refused before anything changes'; issue 37 item "
                         "7: a one-row tail micro-batch too")


REGROUPED_REFUSAL = ("data.md: 'A checkpoint taken in the middle of a grouped epoch resumes "
                     "exactly ..., and only with the same batch_size and grouping: another one "
                     "would group the rows into other batches, and is a CheckpointError naming "
                     "both' (another world size gives each rank another batch size)")


def may_refuse(run: Run) -> dict[str, str]:
    """The refusals the docs allow ``fit`` of the drawn run (or its resume) before any step:
    a fragment of the ``ValueError``'s or ``CheckpointError``'s message -> the docs'
    sentence (empty: none may refuse)."""
    allowed = {}
    several = run.devices > 1 or (run.stop is not None and run.stop.devices > 1)
    if run.checkpointing and run.randomness in ("dropout", "functional") and several:
        allowed["activation_checkpointing"] = CHECKPOINTING_REFUSAL
    if run.randomness == "batchnorm":
        allowed["cannot normalise one row"] = BATCHNORM_ROW_REFUSAL
    if run.kind == "grouped" and run.stop is not None and run.stop.ranks != run.ranks:
        allowed["another order of the same rows"] = REGROUPED_REFUSAL
    return allowed


def refuses(run: Run) -> str | None:
    """The docs' sentence when the drawn resume must be refused, else None."""
    return REFUSAL if run.stop is not None and run.stop.short else None
