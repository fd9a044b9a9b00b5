"""Small data sets shipped inside the package (nothing is downloaded at run time).

``digits.npz``: the 8x8 handwritten digits, 1,797 images with pixels 0..16 and labels 0..9;
the test set of "Optical Recognition of Handwritten Digits" by E. Alpaydin and C. Kaynak,
UCI Machine Learning Repository, https://doi.org/10.24432/C50P49, licensed CC BY 4.0.
"""

from __future__ import annotations

from importlib import resources

import numpy as np
import torch


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The 8x8 digits as ``(images, labels)``.

    Returns:
        ``images``: float32 ``(1797, 1, 8, 8)`` scaled to [0, 1]; ``labels``: int64 ``(1797,)``.

    Example:
        >>> x, y = load_digits()
        >>> tuple(x.shape), int(y.max())
        ((1797, 1, 8, 8), 9)
    """
    with resources.files(__name__).joinpath("digits.npz").open("rb") as f:
        arrays = np.load(f)
        images, labels = arrays["images"], arrays["labels"]
    x = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)
    return x, torch.from_numpy(labels.astype(np.int64))
