"""compile=True with buckets: what one fit costs eager, compiled with a cold inductor cache,
and compiled with a warm one (a second process on the same ``TORCHINDUCTOR_CACHE_DIR``).

A token tagger without an RNN (dynamo does not trace ``nn.GRU``: there compile gains nothing)
on 160 sequences, 4 buckets of batch 16: 12 steps an epoch, 8 input shapes (each bucket's full
batch and its last one). Each mode runs in its own process, one thread; a mode's first fit
pays the compilation, its second fit is the steady state.

    PYTHONPATH=. python bench/compile_buckets.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one(mode: str) -> None:
    """One mode's two fits, printed as one line."""
    sys.path.insert(0, str(ROOT))
    import torch  # noqa: PLC0415 - in the child process only
    from torch import nn  # noqa: PLC0415

    import fitdp  # noqa: PLC0415

    torch.set_num_threads(1)
    torch.manual_seed(0)
    seqs = [torch.randint(1, 50, (int(n),)) for n in torch.randint(3, 30, (160,))]

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 16, padding_idx=0)
            self.mix = nn.Linear(16, 16)
            self.head = nn.Linear(16, 3)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.mix(self.emb(tokens)))).transpose(1, 2)

    it = fitdp.BucketIterator(seqs, [s % 3 for s in seqs], batch_size=16, buckets=[8, 16, 24, 30],
                              seed=0)
    model = fitdp.Model(Tagger())
    model.compile(optimizer="adam", loss="cross_entropy", compile=mode != "eager")
    start = time.perf_counter()
    model.fit(it, epochs=1, devices=["cpu"], verbose=0)
    first = time.perf_counter()
    model.fit(it, epochs=1, devices=["cpu"], verbose=0)
    second = time.perf_counter()
    steps = it.num_batches
    print(f"| {mode:<5} | {steps} | {first - start:8.2f} | {(second - first) / steps * 1e3:7.2f} |",
          flush=True)


def main() -> None:
    print(f"load average before: {os.getloadavg()}")
    print("| mode  | steps | first fit s | steady ms/step |\n|---|---|---|---|")
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for mode in ("eager", "cold", "warm"):
            subprocess.run([sys.executable, __file__, mode], env=env, check=True, timeout=900)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        one(sys.argv[1])
    else:
        main()
