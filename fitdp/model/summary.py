"""``Model.summary()``'s table: layers, output shapes and parameter counts, Keras style."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fitdp.data.batch import tree_map
from fitdp.data.sources.convert import as_tensors
from fitdp.executor.replica import call_module

UNKNOWN = "?"  # no example batch ran through the layer (Keras: an unbuilt layer)
MULTIPLE = "multiple"  # called more than once with different output shapes (Keras's word)


@dataclass
class _Row:
    """One layer of the table."""

    name: str
    kind: str
    depth: int
    params: int
    trainable: bool | None  # None: the layer has no parameters
    shapes: list[str] = field(default_factory=list)

    @property
    def shape(self) -> str:
        unique = list(dict.fromkeys(self.shapes))
        return UNKNOWN if not unique else unique[0] if len(unique) == 1 else MULTIPLE


def summarize(module: nn.Module, example: Any = None, *, expand_nested: bool = False,
              show_trainable: bool = False, line_length: int = 80,
              per_sample: bool = False) -> str:
    """The summary table of ``module`` (see ``Model.summary``); ``per_sample``: the example
    is one row standing for any batch, whose axis shows as ``None``."""
    rows = _rows(module, expand_nested)
    if example is not None:
        _record_shapes(module, rows, example)
    if per_sample:
        for _, row in rows:
            row.shapes = [re.sub(r"\(1(?=[,)])", "(None", shape) for shape in row.shapes]
    widths = _widths(line_length, show_trainable)
    title = type(module).__name__
    lines = [f'Model: "{title}"', "_" * line_length]
    header = ["Layer (type)", "Output Shape", "Param #"] + (["Trainable"] if show_trainable
                                                            else [])
    lines += [_line(header, widths), "=" * line_length]
    for _, row in rows:
        cells = [f"{'  ' * row.depth}{row.name} ({row.kind})", row.shape, f"{row.params:,}"]
        if show_trainable:
            cells.append("-" if row.trainable is None else "Y" if row.trainable else "N")
        lines.append(_line(cells, widths))
    lines.append("=" * line_length)
    trainable, frozen = count_parameters(module)
    sizes = _byte_sizes(module)
    lines += [f"Total params: {trainable + frozen:,} ({_bytes(sum(sizes))})",
              f"Trainable params: {trainable:,} ({_bytes(sizes[0])})",
              f"Non-trainable params: {frozen:,} ({_bytes(sizes[1])})"]
    if example is None:
        lines.append("Output shapes: pass an example batch, e.g. model.summary(x[:2]), or "
                     "input_shape=(...)")
    lines.append("_" * line_length)
    return "\n".join(lines)


def zeros_of(input_shape: Any) -> Any:
    """One float32 row of zeros per input shape (Keras's ``input_shape``, no batch axis).

    Raises:
        TypeError: not a shape, or a tuple/list/dict of shapes.

    Example:
        >>> zeros_of((3,)).shape, [t.shape for t in zeros_of([(2,), (4, 5)])]
        (torch.Size([1, 3]), [torch.Size([1, 2]), torch.Size([1, 4, 5])])
    """
    if isinstance(input_shape, (tuple, list)) and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in input_shape):
        return torch.zeros(1, *input_shape)
    if isinstance(input_shape, dict) and input_shape:
        return {k: zeros_of(v) for k, v in input_shape.items()}
    if isinstance(input_shape, (tuple, list)) and input_shape:
        return type(input_shape)(zeros_of(v) for v in input_shape)
    raise TypeError(f"summary(input_shape=...): got {input_shape!r}; expected one sample's "
                    f"shape without the batch axis, e.g. (784,), or a tuple/list or dict of "
                    f"shapes for several inputs. Fix: pass x=<an example batch> instead.")


def count_parameters(module: nn.Module) -> tuple[int, int]:
    """``(trainable, non-trainable)`` element counts: parameters with ``requires_grad``, and
    frozen parameters plus floating-point buffers (BatchNorm's running statistics, which
    Keras counts as non-trainable weights). A shared tensor counts once."""
    trainable, frozen = _split(module)
    return sum(t.numel() for t in trainable), sum(t.numel() for t in frozen)


def _split(module: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    params: list[torch.Tensor] = list(module.parameters())  # a shared one comes once
    trainable = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    frozen += [b for b in module.buffers() if b.is_floating_point()]
    return trainable, frozen


def _byte_sizes(module: nn.Module) -> tuple[int, int]:
    trainable, frozen = _split(module)
    return (sum(t.numel() * t.element_size() for t in trainable),
            sum(t.numel() * t.element_size() for t in frozen))


def _rows(module: nn.Module, expand_nested: bool) -> list[tuple[nn.Module, _Row]]:
    """The layers shown: the module's children (all descendants with ``expand_nested``);
    a module without children is its own one row."""
    def walk(parent: nn.Module, depth: int) -> list[tuple[nn.Module, _Row]]:
        found = []
        for name, child in parent.named_children():
            found.append((child, _row(name, child, depth)))
            if expand_nested:
                found += walk(child, depth + 1)
        return found

    rows = walk(module, 0)
    return rows or [(module, _row(type(module).__name__.lower(), module, 0))]


def _row(name: str, layer: nn.Module, depth: int) -> _Row:
    trainable, frozen = count_parameters(layer)
    flags = {p.requires_grad for p in layer.parameters()}
    return _Row(name, type(layer).__name__, depth, trainable + frozen,
               None if not flags else all(flags))


def _record_shapes(module: nn.Module, rows: list[tuple[nn.Module, _Row]], example: Any) -> None:
    """Run ``example`` through ``module`` once (eval mode, no gradients) and record each
    shown layer's output shapes; every layer's train/eval mode is given back."""
    inputs = _inputs(module, example)
    modes = {m: m.training for m in module.modules()}
    handles = [layer.register_forward_hook(_recorder(row)) for layer, row in rows]
    try:
        module.eval()
        with torch.no_grad():
            call_module(module, inputs)
    finally:
        for handle in handles:
            handle.remove()
        for m, training in modes.items():
            m.training = training


def _recorder(row: _Row) -> Callable[..., None]:
    def hook(layer: nn.Module, args: Any, output: Any) -> None:
        row.shapes.append(describe_shape(output))
    return hook


def _inputs(module: nn.Module, example: Any) -> Any:
    """The example as tensors on the module's device (numpy float64 becomes float32)."""
    tensors = as_tensors(example, "example")
    device = next((t.device for t in [*module.parameters(), *module.buffers()]), None)
    return tensors if device is None else tree_map(lambda t: t.to(device), tensors)


def describe_shape(output: Any) -> str:
    """``(2, 64)`` for a tensor; lists and dicts of those for several outputs.

    Example:
        >>> describe_shape((torch.zeros(2, 3), {"h": torch.zeros(2, 5)}))
        '[(2, 3), {h: (2, 5)}]'
    """
    if isinstance(output, torch.Tensor):
        return str(tuple(output.shape)).replace(",)", ")")
    if isinstance(output, dict):
        return "{" + ", ".join(f"{k}: {describe_shape(v)}" for k, v in output.items()) + "}"
    if isinstance(output, (tuple, list)):
        return "[" + ", ".join(describe_shape(v) for v in output) + "]"
    return type(output).__name__


def _widths(line_length: int, show_trainable: bool) -> list[int]:
    """Column widths in Keras's proportions (0.45 / 0.30 / 0.25 of the line)."""
    cuts = [0.45, 0.75, 1.0] if not show_trainable else [0.40, 0.65, 0.85, 1.0]
    ends = [int(line_length * c) for c in cuts]
    return [end - start for start, end in zip([0, *ends[:-1]], ends)]


def _line(cells: list[str], widths: list[int]) -> str:
    """One row: each cell cut to its column (a space kept between columns)."""
    return "".join((" " + cell)[: width - 1].ljust(width)
                   for cell, width in zip(cells, widths)).rstrip()


def _bytes(n: int) -> str:
    """Keras's size format: ``4.04 KB``."""
    size, unit = float(n), 0
    while size >= 1024 and unit < 3:
        size, unit = size / 1024, unit + 1
    return f"{size:.2f} {('B', 'KB', 'MB', 'GB')[unit]}"
