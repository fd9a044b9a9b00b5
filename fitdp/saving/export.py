"""Export a module to one ``torch.export`` ``.pt2`` file and load it back for serving.

Like Caffe2's ``ExtractPredictorNet``: one device's worth of weights in eval mode, dynamic batch.
"""

from __future__ import annotations

import copy
import os
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.export import Dim, ExportedProgram

from fitdp.checks import FitdpWarning, check_path
from fitdp.data.batch import Inputs, axis_of, batch_axis
from fitdp.saving.atomic import atomic_write

_EXPECTED = "a tensor, a tuple/list of tensors (module(*x)) or a dict of tensors (module(**x))"
_BATCH_HINT = "reshape with -1 or x.shape[0], not a number; no Python branches on the batch size"


class InputSpec(NamedTuple):
    """One input of an exported program: name, shape (None where dynamic), dtype.

    Example:
        >>> str(InputSpec("x", (None, 4), torch.float32))
        'x: [batch, 4] float32'
    """

    name: str
    shape: tuple[int | None, ...]
    dtype: torch.dtype | None
    keyword: bool = False

    def __str__(self) -> str:
        dims = ", ".join("batch" if d is None else str(d) for d in self.shape)
        return f"{self.name}: [{dims}] {str(self.dtype).removeprefix('torch.')}"


def export_module(
    module: torch.nn.Module, path: str | os.PathLike[str], example_inputs: Inputs, *,
    autocast_dtype: torch.dtype | None = None, dynamic_shapes: Any = None,
    layout: str | None = None, sequence: bool = False,
) -> None:
    """Write an eval-mode CPU copy of ``module`` to one ``.pt2`` file with a dynamic batch dim
    (and sequence dim, for ``sequence``).

    In the file Dropout is off and BatchNorm uses running stats; ``module`` itself is untouched.

    Args:
        module: the module to export.
        path: the file to write; written atomically (readers never see half a file), through
            the writer checkpoints use (``fitdp.saving.atomic``).
        example_inputs: a tensor, a tuple/list of tensors (``module(*x)``) or a dict of
            tensors (``module(**x)``); the batch axis (dim 0, or ``N`` of ``layout``) is of
            any size >= 1.
        dynamic_shapes: as ``torch.export.export``'s, used as given; None: the batch axis
            of every input dynamic (and the sequence axis, see ``sequence``).
        layout: the data's layout (``"NT"``, time-major ``"TN"``; None: batch first): where
            the batch and sequence axes are.
        sequence: make the ``T`` axis of ``layout`` dynamic too (a model trained on buckets).
            A module that fixes it (``nn.GRU``/``nn.LSTM``: torch.export unrolls them,
            pytorch/pytorch#115092) is exported at the example's length, with a warning.
        autocast_dtype: run forward under CPU ``torch.autocast`` with this dtype, as mixed
            precision training does (``torch.bfloat16`` for ``"bf16-mixed"``); None: fp32.

    Raises:
        TypeError: ``example_inputs`` is not one of the forms above, or ``path`` not a path.
        ValueError: bad batch sizes, forward fails on the inputs or fixes the batch size;
            ``path`` is a folder or a FIFO or another special file.
        RuntimeError: ``torch.export`` cannot trace forward (e.g. data-dependent control flow).
        FileNotFoundError: the folder of ``path`` does not exist.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Dropout(0.1))
        >>> export_module(net, "net.pt2", torch.randn(8, 4))
    """
    path = Path(check_path("path", path))
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot export to {str(path)!r}: its folder does not exist")
    axis = batch_axis(layout)
    args, kwargs = _split_inputs(example_inputs, axis)
    name, given = type(module).__name__, _shapes(args, kwargs)
    check_dynamic_shapes(dynamic_shapes)
    if dynamic_shapes is None:  # torch.export pins sizes 1; two copies of the row keep it
        args = tuple(_for_export(t, axis) for t in args)
        kwargs = {k: _for_export(t, axis) for k, t in kwargs.items()}
    else:
        args, kwargs = tuple(t.detach().cpu() for t in args), {
            k: t.detach().cpu() for k, t in kwargs.items()}
    # Costs one extra copy of the weights (briefly on the module's device) during the export.
    net = copy.deepcopy(module).to("cpu").eval()
    if autocast_dtype is not None:
        # The wrapped forward keeps its signature (torch.export binds inputs by it), and the
        # program records the autocast region: the file casts as training did.
        net.forward = torch.autocast("cpu", dtype=autocast_dtype)(net.forward)  # type: ignore[method-assign]
    # One eager forward (cheap next to tracing) tells a wrong example from an untraceable net.
    try:
        with torch.no_grad():
            net(*args, **kwargs)
    except Exception as err:
        raise ValueError(
            f"{name}.forward failed on example_inputs ({given}): {type(err).__name__}: {err}. "
            "Pass one batch shaped like your data"
        ) from err
    time = (layout or "").find("T") if sequence else -1
    try:
        if dynamic_shapes is not None:
            program = torch.export.export(net, args, kwargs, dynamic_shapes=dynamic_shapes)
        else:
            program = _export_dynamic(net, args, kwargs, axis, time, name)
    except Exception as err:
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()] or [""]
        if "CONSTRAINT_VIOLATION" in str(getattr(err, "error_type", "")):
            why = next((ln[2:] for ln in lines if ln.startswith("- ")), lines[0]).split(". ")[0]
            what, size = (("a dynamic batch dim", "the batch size") if dynamic_shapes is None
                          else ("these dynamic_shapes", "a dynamic size"))
            raise ValueError(
                f"cannot export {name} with {what}: forward treats {size} as a constant "
                f"({why}). Fix: {_BATCH_HINT}"
            ) from err
        raise RuntimeError(
            f"torch.export could not trace {name}.forward ({type(err).__name__}: {lines[0]}). "
            f"Fix: torch.where/torch.cond instead of Python if/loops on tensors; {_BATCH_HINT}"
        ) from err
    with atomic_write(path) as f:  # readers of path see the old file or the new one
        torch.export.save(program, f)


def load_predictor(path: str | os.PathLike[str]) -> Predictor:
    """Load a ``.pt2`` file written by ``model.export`` or ``torch.export.save``.

    Load only files you trust: a ``.pt2`` is a program. ``torch.export.load`` unpickles
    weights the archive marks as pickled with ``weights_only=False``, evaluates its shape
    expressions with sympy, and the graph calls the functions it names (docs/export.md,
    "Loading a .pt2 runs what it holds").

    Args:
        path: the file.

    Returns:
        A :class:`Predictor`, called like the original module.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a ``torch.export`` program, or is a folder, a FIFO or
            another special file.

    Example:
        >>> probs = load_predictor("digits.pt2")(torch.randn(5, 1, 8, 8)).softmax(-1)
    """
    path = Path(check_path("path", path, must_exist=True))
    try:  # checked first: torch.export.load logs a long traceback for files it cannot read
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile:
        names = []
    if not any(n.endswith("/archive_format") for n in names):
        kind = " (a torch.save checkpoint?)" if any(n.endswith("/data.pkl") for n in names) else ""
        raise ValueError(
            f"{str(path)!r} is not a torch.export program{kind}; expected a .pt2 file written "
            "by model.export(...) or torch.export.save"
        )
    try:
        with open(path, "rb") as f:  # a file object: torch wants a .pt2 suffix only on paths
            program = torch.export.load(f)
    except Exception as err:
        raise ValueError(f"{str(path)!r} is not a loadable torch.export program: {err}") from err
    return Predictor(program, name=str(path))


class Predictor:
    """An exported program, called like the module it came from, under ``torch.no_grad()``.

    Args:
        program: the ExportedProgram; kept as ``.program`` (e.g. for ``torch.onnx.export``).
        name: shown in ``repr`` and errors, usually the file path.

    Example:
        >>> predict = load_predictor("digits.pt2")  # predict.input_spec: names, shapes, dtypes
        >>> predict(torch.randn(5, 1, 8, 8)).shape
        torch.Size([5, 10])
    """

    def __init__(self, program: ExportedProgram, name: str = "<program>") -> None:
        self.program, self.name = program, name
        # Already in eval mode as exported; this module refuses .eval()/.train() anyway.
        self._module = program.module()
        self.input_spec = _input_spec(program)
        # Per input, each dynamic dim's symbol: dims of one symbol (the batch) share a size.
        self._symbols = {s.name: syms for s, syms in zip(self.input_spec, _symbols(program))}

    @torch.no_grad()
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._check(args, kwargs)
        return self._module(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Predictor({self.name!r}, inputs=({', '.join(map(str, self.input_spec))}))"

    def _check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise clear errors for inputs that do not match ``input_spec`` (torch's are terse)."""
        positional = [s for s in self.input_spec if not s.keyword]
        keywords = {s.name: s for s in self.input_spec if s.keyword}
        if len(args) != len(positional) or set(kwargs) != set(keywords):
            raise TypeError(
                f"{self.name} expects ({', '.join(map(str, self.input_spec))}); got "
                f"{len(args)} positional input(s) and keyword(s) {sorted(kwargs)}"
            )
        pairs = list(zip(positional, args)) + [(keywords[k], v) for k, v in kwargs.items()]
        pairs = [(s, v) for s, v in pairs if s.dtype is not None]  # skip non-tensor inputs
        for spec, v in pairs:
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"{self.name}: input {spec} needs a tensor, got {type(v).__name__}")
            dims_ok = all(d in (None, n) for d, n in zip(spec.shape, v.shape))
            if v.dtype != spec.dtype or v.dim() != len(spec.shape) or not dims_ok:
                got = f"{list(v.shape)} {v.dtype}"
                raise ValueError(f"{self.name}: {spec.name!r} got {got}, expected {spec}")
        sizes: dict[str, set[int]] = {}  # a dim shared by inputs (the batch): one size
        for spec, v in pairs:
            for symbol, n in zip(self._symbols.get(spec.name, ()), v.shape):
                if symbol is not None:
                    sizes.setdefault(symbol, set()).add(int(n))
        if any(len(n) > 1 for n in sizes.values()):
            shapes = ", ".join(f"{s.name}: {list(v.shape)}" for s, v in pairs)
            raise ValueError(f"{self.name}: inputs disagree on the batch size: {shapes}")


def default_dims(args: tuple[torch.Tensor, ...], kwargs: dict[str, torch.Tensor], axis: int,
                 time: int) -> Any:
    """``dynamic_shapes`` with every input's batch ``axis`` dynamic, and its ``time`` axis
    (>= 0) where it has one besides the batch (lengths ``(N,)`` have none)."""
    batch, seq = Dim("batch"), Dim("seq")

    def dims(t: torch.Tensor) -> dict[int, Any]:
        out = {axis_of(t, axis): batch}
        if 0 <= time < t.dim() and time not in out:
            out[time] = seq
        return out

    return {k: dims(t) for k, t in kwargs.items()} if kwargs else tuple(map(dims, args))


def _export_dynamic(net: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    axis: int, time: int, name: str) -> ExportedProgram:
    """Export with a dynamic batch ``axis`` and (``time`` >= 0) sequence axis; where forward
    fixes the sequence (an RNN), at the example's length with a warning saying so."""
    try:
        return torch.export.export(net, args, kwargs,
                                   dynamic_shapes=default_dims(args, kwargs, axis, time))
    except Exception as err:
        if time < 0 or "(seq)" not in str(err):
            raise
    program = torch.export.export(net, args, kwargs,
                                  dynamic_shapes=default_dims(args, kwargs, axis, -1))
    length = next(t.shape[time] for t in [*args, *kwargs.values()] if t.dim() > time)
    warnings.warn(
        f"export: {name}.forward fixes the sequence length (torch.export unrolls nn.GRU, "
        f"nn.LSTM and nn.RNN over time, pytorch/pytorch#115092), so the program takes "
        f"sequences of length {length} only (any batch). Fix: pad inputs to that length, or "
        f"export one file per bucket length you serve.", FitdpWarning, stacklevel=4)
    return program


def check_dynamic_shapes(dynamic_shapes: Any) -> None:
    """``dynamic_shapes`` of the forms torch.export takes (None, a tuple/list or a dict)."""
    if dynamic_shapes is not None and not isinstance(dynamic_shapes, (tuple, list, Mapping)):
        raise TypeError(
            f"dynamic_shapes: got {type(dynamic_shapes).__name__}; expected None, or as "
            f"torch.export.export takes it: one entry per input (a tuple) or per keyword (a "
            f"dict), each a dict axis -> torch.export.Dim. Fix: e.g. dynamic_shapes=({{0: "
            f"Dim('batch'), 1: Dim('seq')}},)")


def _split_inputs(example_inputs: Any, axis: int = 0) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Validate ``example_inputs`` and return them as ``(args, kwargs)``."""
    x = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    if not isinstance(x, (tuple, list, Mapping)):
        raise TypeError(f"example_inputs must be {_EXPECTED}, got {type(example_inputs).__name__}")
    args, kwargs = ((), dict(x)) if isinstance(x, Mapping) else (tuple(x), {})
    for where, t in list(enumerate(args)) + [(repr(k), t) for k, t in kwargs.items()]:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"example_inputs[{where}] must be a tensor, got {type(t).__name__}")
        if t.dim() == 0 or t.shape[axis_of(t, axis)] == 0:
            raise ValueError(f"example_inputs[{where}] has shape {list(t.shape)}: no batch dim")
    if len({t.shape[axis_of(t, axis)] for t in [*args, *kwargs.values()]}) > 1:
        raise ValueError(f"example_inputs disagree on the batch size: {_shapes(args, kwargs)}")
    return args, kwargs


def _for_export(t: torch.Tensor, axis: int = 0) -> torch.Tensor:
    """CPU copy of one example input, tiled to 2 rows (on the batch ``axis``) if it has 1."""
    # torch.export pins sizes 0 and 1 to constants; two copies of the row keep the batch symbolic.
    a = axis_of(t, axis)
    reps = [2 if d == a else 1 for d in range(t.dim())]
    return (t.repeat(*reps) if t.shape[a] == 1 else t).detach().to("cpu")


def _shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``[key]: shape`` of each input, for error messages."""
    named = list(enumerate(args)) + [(repr(k), v) for k, v in kwargs.items()]
    return ", ".join(f"[{k}]: {list(v.shape)}" for k, v in named)


def _input_spec(program: ExportedProgram) -> list[InputSpec]:
    """Names, shapes and dtypes of the program's user inputs, read from its graph."""
    user = program.graph_signature.user_inputs
    vals = {n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
    # user_inputs are the leaves of (args, kwargs): unflattening their indices finds keywords.
    _, kwargs = program.call_spec.in_spec.unflatten(list(range(len(user))))
    keyword = {i: k for k, i in kwargs.items() if isinstance(i, int)}
    specs = []
    for i, name in enumerate(user):
        val = vals.get(name)
        shape = tuple(d if isinstance(d, int) else None for d in getattr(val, "shape", ()))
        dtype = getattr(val, "dtype", None)  # None: a non-tensor input
        specs.append(InputSpec(keyword.get(i, name), shape, dtype, i in keyword))
    return specs


def _symbols(program: ExportedProgram) -> list[tuple[str | None, ...]]:
    """Each user input's dims as symbols (None where static), in ``_input_spec`` order."""
    vals = {n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
    return [tuple(None if isinstance(d, int) else str(d)
                  for d in getattr(vals.get(name), "shape", ()))
            for name in program.graph_signature.user_inputs]
