"""Keras 3 (torch backend) ``model.fit`` per step against the hand loop of bench/overhead.py.

Run: python bench/keras_peer.py [--repeats 7] [--json out.json] [--quick]

The peer row of the overhead comparison: the same two cases as bench/overhead.py (tiny MLP
32-64-64-10 at batch 32, MLP 784-512-512-10 at batch 256), the same data (torch tensors),
Adam at 1e-3, cross-entropy on logits, one torch thread, ``jit_compile=False`` (Keras's
default on the torch backend). Each epoch is one ``model.fit(..., epochs=1)`` call, as in
overhead.py, interleaved with an epoch of the hand loop in this same process, so the ratio
Keras / hand does not depend on load that differs between processes. Keras keeps its own
optimizer (Keras ops, not ``torch.optim``) and its own data adapter: that is what a Keras
user runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from collections.abc import Callable

os.environ["KERAS_BACKEND"] = "torch"  # before keras is imported: the backend is read once

import torch  # noqa: E402

torch.set_num_threads(1)  # before keras builds anything

import keras  # noqa: E402
from overhead import compare, hand_loop, mlp  # noqa: E402  (bench/ is sys.path[0])

CASES = [  # name (as in overhead.py), sizes, batch size, samples
    ("tiny MLP 32-64-64-10, batch 32", [32, 64, 64, 10], 32, 32 * 200),
    ("MLP 784-512-512-10, batch 256", [784, 512, 512, 10], 256, 256 * 20),
]


def keras_mlp(sizes: list[int]) -> keras.Model:
    layers = [keras.layers.Dense(n, activation="relu") for n in sizes[1:-1]]
    model = keras.Sequential([keras.Input((sizes[0],)), *layers, keras.layers.Dense(sizes[-1])])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    return model


def keras_loop(sizes: list[int], x: torch.Tensor, y: torch.Tensor, bs: int
               ) -> Callable[[], None]:
    """One epoch of ``Model.fit`` per call, shuffled as the hand loop is."""
    model = keras_mlp(sizes)

    def epoch() -> None:
        model.fit(x, y, batch_size=bs, epochs=1, shuffle=True, verbose=0)

    return epoch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
    if keras.backend.backend() != "torch":
        raise RuntimeError(f"keras runs on {keras.backend.backend()!r}, expected 'torch'; "
                           "unset KERAS_BACKEND or set it to torch")
    load = os.getloadavg()
    print(f"keras {keras.__version__} (torch backend), torch {torch.__version__}, 1 thread; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'case (keras vs hand loop)':<46} {'keras':>12}  {'hand':>12}")
    results: dict[str, object] = {"keras": keras.__version__, "backend": "torch",
                                  "loadavg": list(load)}
    cases: dict[str, dict[str, float]] = {}
    for name, sizes, bs, n in CASES:
        torch.manual_seed(0)
        x, y = torch.randn(n, sizes[0]), torch.randint(0, 10, (n,))
        cases[name] = compare(name, keras_loop(sizes, x, y, bs),
                              hand_loop(copy.deepcopy(mlp(sizes)), x, y, bs, "cpu"),
                              n // bs, args.repeats, sync=False)
    results["cases"] = cases
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
