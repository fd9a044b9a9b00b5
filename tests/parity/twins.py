"""Twin models for the parity tests: a fitdp `Model` and, when Keras 3 is installed, a Keras
model with the same weights, loss and optimizer, run on the same tiny data."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

import fitdp


def data(n: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`n` samples of 4 features, 3 classes, and sample weights in [0.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    w = torch.rand(n, generator=g) + 0.5
    return x, y, w


def linear(seed: int = 0, out: int = 3) -> nn.Linear:
    """The network both twins start from."""
    g = torch.Generator().manual_seed(seed)
    net = nn.Linear(4, out)
    with torch.no_grad():
        net.weight.copy_(torch.randn(out, 4, generator=g) * 0.5)
        net.bias.copy_(torch.randn(out, generator=g) * 0.1)
    return net


def fitdp_model(net: nn.Module | None = None, lr: float = 0.1, metrics: bool = True
                ) -> fitdp.Model:
    """SGD, cross-entropy on logits, and Keras's "accuracy" as micro-averaged accuracy."""
    model = fitdp.Model(copy.deepcopy(net if net is not None else linear()))
    model.compile("sgd", "cross_entropy", lr=lr, metrics={
        "accuracy": MulticlassAccuracy(num_classes=3, average="micro")} if metrics else None)
    return model


def keras_model(keras: Any, net: nn.Linear | None = None, lr: float = 0.1,
                metrics: bool = True) -> Any:
    """The Keras twin of `fitdp_model`: one Dense layer holding the same weights."""
    net = net if net is not None else linear()
    model = keras.Sequential([keras.Input((net.in_features,)),
                              keras.layers.Dense(net.out_features)])
    copy_dense(model.layers[0], net)
    model.compile(optimizer=keras.optimizers.SGD(lr),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"] if metrics else None)
    return model


def copy_dense(layer: Any, net: nn.Linear) -> None:
    """torch's `(out, in)` weight is Keras's `(in, out)` kernel."""
    layer.set_weights([net.weight.detach().numpy().T, net.bias.detach().numpy()])


def keras_weights(model: Any) -> list[np.ndarray]:
    """The twin's weights in torch's layout, to compare with `fitdp.Model.get_weights()`."""
    kernel, bias = model.layers[0].get_weights()
    return [kernel.T, bias]


def same_weights(model: fitdp.Model, keras_twin: Any, atol: float = 1e-6) -> bool:
    ours = model.get_weights()
    theirs = keras_weights(keras_twin)
    return all(np.allclose(ours[k].numpy(), t, atol=atol)
               for k, t in zip(("weight", "bias"), theirs))


def np_(*tensors: torch.Tensor) -> list[np.ndarray]:
    return [t.numpy() for t in tensors]


def close(ours: dict[str, list[float]], theirs: dict[str, list[float]], keys: list[str],
          rtol: float = 1e-5) -> None:
    """History values of `keys` agree (Keras computes in float32, fitdp sums in float64)."""
    for key in keys:
        assert len(ours[key]) == len(theirs[key]), (key, ours[key], theirs[key])
        np.testing.assert_allclose(ours[key], theirs[key], rtol=rtol, atol=1e-6, err_msg=key)


def cross_entropy(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-sample losses of `net` (the hand computations)."""
    with torch.no_grad():
        return nn.functional.cross_entropy(net(x), y, reduction="none")
