"""What the metrics of a module that computes its own loss read: its logits class-last, per
token, the ignored (-100) positions dropped and a causal LM's pairs shifted.

A Hugging Face model's logits are ``(batch, length, classes)`` for a token classifier or an
LM: class last, where torchmetrics (and torch's losses) read the classes on axis 1. Read as
they are, a metric either fails or, when the padded length equals the number of classes,
takes the length axis for the classes and gives a wrong number without a word. The layout
is not guessed from the shapes: ``compile(loss=None)`` means the model's own outputs, which
follow transformers' convention (class last), and ``loss_items`` (or the model's head) says
whether its loss shifts the labels. So metrics see what the model's loss sees: every
(position, label) pair that the loss averages over, as rows ``(pairs, classes)`` and
``(pairs,)``.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric

from fitdp.compiled.own_loss import IGNORE_INDEX


class TokenView:
    """Per-token logits and labels as one row per labelled position (decided at compile).

    Args:
        shift: the model's loss shifts its labels (a causal LM: ``logits[:, :-1]`` against
            ``labels[:, 1:]``, as transformers' ``ForCausalLMLoss``; the last position's
            logits are then paired with -100).

    Example:
        >>> view = TokenView(shift=False)
        >>> logits, labels = view(torch.zeros(2, 3, 5), torch.tensor([[1, 2, -100]] * 2))
        >>> tuple(logits.shape), labels.tolist()
        ((6, 5), [1, 2, -100, 1, 2, -100])
        >>> tuple(t.shape for t in view.kept(None, logits, labels))
        ((4, 5), (4,))
    """

    def __init__(self, shift: bool) -> None:
        self.shift = shift

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits`` and ``labels`` as pairs: per-token ones (labels of rank >= 2, the logits
        one axis more, class last) flattened (and shifted); row ones (a sequence classifier)
        as they are.

        Raises:
            ValueError: per-token labels whose shape is not the logits' but the last axis.
        """
        if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor) or (
                labels.dim() < 2 or logits.dim() != labels.dim() + 1
                or labels.is_floating_point()):
            return logits, labels
        if logits.shape[:-1] != labels.shape:
            raise ValueError(
                f"metrics: got per-token labels of shape {tuple(labels.shape)} and logits of "
                f"shape {tuple(logits.shape)}; expected the logits to be the labels' shape "
                f"plus a last axis of classes (transformers' layout, which compile(loss=None) "
                f"reads). Fix: pad the labels to the inputs' length (-100 where there is no "
                f"label), as DataCollatorForTokenClassification does; a module of your own "
                f"that puts the classes on axis 1 returns logits.transpose(1, -1) instead.")
        if self.shift:
            # labels[:, 1:] against logits[:, :-1], written as the labels moved one position
            # left with -100 after the last: the logits stay whole, so the rows below are a
            # view of them, not a copy (an LM's logits are batch x length x vocabulary).
            labels = torch.cat([labels[:, 1:], labels.new_full(
                (labels.shape[0], 1, *labels.shape[2:]), IGNORE_INDEX)], 1)
        return logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)

    @staticmethod
    def kept(metric: Metric | None, logits: torch.Tensor, labels: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs whose label is not -100, unless ``metric`` ignores -100 itself (its
        ``ignore_index``: no boolean indexing, which waits for the device on CUDA)."""
        if getattr(metric, "ignore_index", None) == IGNORE_INDEX or labels.dim() != 1 \
                or labels.is_floating_point():
            return logits, labels
        keep = labels != IGNORE_INDEX
        return logits[keep], labels[keep]
