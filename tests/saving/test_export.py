"""Tests for fitdp.saving.export: export_module / load_predictor round trips, eval, errors."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import fitdp
from fitdp.saving.export import InputSpec, Predictor, export_module, load_predictor

REPO = Path(__file__).resolve().parents[2]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn(self.conv(x))))
        return self.fc(h.flatten(1))


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 4)
        self.b = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x) + self.b(y), self.a(x).sum(-1)


class DictInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 4)
        self.fc = nn.Linear(4 + 2, 1)

    def forward(self, tokens: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.emb(tokens).mean(1), extra], dim=-1))


class FixedBatch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(4, -1)  # batch size hard-coded: cannot be exported as dynamic


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # Python branch on a tensor value
            return x * 2
        return x


def _inputs(kind: str, n: int) -> object:
    g = torch.Generator().manual_seed(n)
    if kind == "mlp":
        return torch.randn(n, 6, generator=g)
    if kind == "cnn":
        return torch.randn(n, 1, 8, 8, generator=g)
    if kind == "tuple":
        return (torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g))
    tokens = torch.randint(0, 20, (n, 7), generator=g)
    return {"tokens": tokens, "extra": torch.randn(n, 2, generator=g)}


def _call(fn: object, inputs: object) -> object:
    if isinstance(inputs, dict):
        return fn(**inputs)
    return fn(*inputs) if isinstance(inputs, tuple) else fn(inputs)


def _assert_close(got: object, want: object) -> None:
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)


MODELS = {"mlp": MLP, "cnn": CNN, "tuple": TwoInputs, "dict": DictInputs}


def _build(kind: str) -> nn.Module:
    """A seeded model in train mode whose BatchNorm has non-trivial running stats."""
    torch.manual_seed(1)
    module = MODELS[kind]()
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                m.weight.uniform_(0.5, 1.5)
    return module.train()


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[nn.Module, Path]]:
    """Each model exported once (from a batch of 4) for the whole file: export costs ~1 s."""
    folder = tmp_path_factory.mktemp("export")
    out = {}
    for kind in MODELS:
        module = _build(kind)
        path = folder / f"{kind}.pt2"
        export_module(module, path, _inputs(kind, 4))
        out[kind] = (module, path)
    return out


@pytest.mark.parametrize("kind", list(MODELS))
def test_outputs_equal_eval_mode_for_other_batch_sizes(exported: dict, kind: str) -> None:
    module, path = exported[kind]
    predict = load_predictor(path)
    reference = copy.deepcopy(module).eval()
    for n in (1, 3, 17):
        inputs = _inputs(kind, n)
        with torch.no_grad():
            _assert_close(_call(predict, inputs), _call(reference, inputs))


@pytest.mark.parametrize("kind", list(MODELS))
def test_caller_module_keeps_train_mode_and_weights(exported: dict, kind: str) -> None:
    module, _ = exported[kind]
    assert all(m.training for m in module.modules())
    fresh = _build(kind)
    for (name, a), (_, b) in zip(module.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name


def test_dropout_off_and_batchnorm_uses_running_stats(exported: dict) -> None:
    module, path = exported["cnn"]
    predict = load_predictor(path)
    x = _inputs("cnn", 6)
    with torch.no_grad():
        # On copies: a train-mode forward updates the running stats even under no_grad.
        train_out = copy.deepcopy(module)(x)  # batch statistics + dropout
        no_dropout = copy.deepcopy(module)
        no_dropout.drop.eval()
        batch_stats_out = no_dropout(x)  # batch statistics only
    out = predict(x)
    assert not torch.allclose(out, train_out, atol=1e-3)
    assert not torch.allclose(out, batch_stats_out, atol=1e-3)
    torch.testing.assert_close(predict(x), out, atol=0, rtol=0)  # deterministic: Dropout off
    assert not out.requires_grad  # served under no_grad


def test_batch_one_example_still_gives_dynamic_batch(tmp_path: Path) -> None:
    # torch.export specializes a size-1 dim to a constant; export must still accept batch 5.
    module = _build("cnn")
    export_module(module, tmp_path / "one.pt2", _inputs("cnn", 1))
    predict = load_predictor(tmp_path / "one.pt2")
    assert predict.input_spec == [InputSpec("x", (None, 1, 8, 8), torch.float32)]
    for n in (1, 5):
        x = _inputs("cnn", n)
        with torch.no_grad():
            _assert_close(predict(x), copy.deepcopy(module).eval()(x))


def test_input_spec_and_repr(exported: dict) -> None:
    tup = load_predictor(exported["tuple"][1])
    assert [s.name for s in tup.input_spec] == ["x", "y"]
    assert [s.shape for s in tup.input_spec] == [(None, 5), (None, 3)]
    kw = load_predictor(exported["dict"][1])
    assert {s.name: (s.shape, s.dtype, s.keyword) for s in kw.input_spec} == {
        "tokens": ((None, 7), torch.int64, True),
        "extra": ((None, 2), torch.float32, True),
    }
    assert "x: [batch, 5] float32" in repr(tup) and "tuple.pt2" in repr(tup)
    assert isinstance(tup, Predictor)


def test_overwrites_atomically_without_leftovers(tmp_path: Path) -> None:
    path = tmp_path / "m.pt2"
    path.write_bytes(b"old")
    export_module(MLP(), path, _inputs("mlp", 2))
    assert os.listdir(tmp_path) == ["m.pt2"]
    assert load_predictor(path)(_inputs("mlp", 3)).shape == (3, 3)


def test_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.pt2"
    path.write_bytes(b"old")

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(torch.export, "save", disk_full)
    with pytest.raises(OSError, match="disk full"):
        export_module(MLP(), path, _inputs("mlp", 2))
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["m.pt2"]


@pytest.mark.parametrize(
    "bad, match",
    [
        (3, "example_inputs must be a tensor, a tuple/list.*got int"),
        ([torch.zeros(2, 5), "y"], r"example_inputs\[1\] must be a tensor, got str"),
        ((), r"TwoInputs.forward failed on example_inputs \(\): TypeError"),
        (torch.tensor(1.0), r"example_inputs\[0\] has shape \[\]: no batch dim"),
    ],
)
def test_bad_example_inputs_type(tmp_path: Path, bad: object, match: str) -> None:
    error = ValueError if isinstance(bad, (tuple, torch.Tensor)) else TypeError
    with pytest.raises(error, match=match):
        export_module(TwoInputs(), tmp_path / "m.pt2", bad)
    assert not list(tmp_path.iterdir())


def test_mismatched_batch_sizes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"disagree on the batch size: \[0\]: \[4, 5\], \[1\]"):
        export_module(TwoInputs(), tmp_path / "m.pt2", (torch.zeros(4, 5), torch.zeros(3, 3)))


def test_example_that_forward_rejects(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="MLP.forward failed on example_inputs"):
        export_module(MLP(), tmp_path / "m.pt2", torch.zeros(4, 7))


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_module(MLP(), tmp_path / "nope" / "m.pt2", torch.zeros(2, 6))


def test_batch_size_fixed_in_forward_says_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="treats the batch size as a constant.*-1") as info:
        export_module(FixedBatch(), tmp_path / "m.pt2", torch.zeros(4, 6))
    assert info.value.__cause__ is not None


def test_data_dependent_control_flow_says_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="could not trace DataDependent.forward.*cond") as info:
        export_module(DataDependent(), tmp_path / "m.pt2", torch.zeros(4, 6))
    assert info.value.__cause__ is not None
    assert not list(tmp_path.iterdir())


def test_load_missing_and_foreign_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.pt2"):
        load_predictor(tmp_path / "missing.pt2")
    text = tmp_path / "notes.pt2"
    text.write_text("hello")
    with pytest.raises(ValueError, match="notes.pt2.*not a torch.export program"):
        load_predictor(text)
    ckpt = tmp_path / "weights.pt"
    torch.save(MLP().state_dict(), ckpt)
    with pytest.raises(ValueError, match="weights.pt' is not a torch.export program .a torch.save"):
        load_predictor(ckpt)


def test_predictor_rejects_wrong_inputs(exported: dict) -> None:
    predict = load_predictor(exported["tuple"][1])
    with pytest.raises(TypeError, match=r"expects \(x: \[batch, 5\] float32, y: .*1 positional"):
        predict(torch.zeros(2, 5))
    with pytest.raises(TypeError, match="input y: .* needs a tensor, got list"):
        predict(torch.zeros(2, 5), [[0.0] * 3] * 2)
    with pytest.raises(ValueError, match=r"'y' got \[2, 4\].*expected y: \[batch, 3\]"):
        predict(torch.zeros(2, 5), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="float64"):
        predict(torch.zeros(2, 5), torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="disagree on the batch size"):
        predict(torch.zeros(2, 5), torch.zeros(3, 3))


def test_loads_in_fresh_process_without_model_class(exported: dict, tmp_path: Path) -> None:
    cases = {}
    for kind, (module, path) in exported.items():
        inputs = _inputs(kind, 5)
        with torch.no_grad():
            cases[kind] = (str(path), inputs, _call(copy.deepcopy(module).eval(), inputs))
    torch.save(cases, tmp_path / "cases.pt")
    script = textwrap.dedent(
        """
        import sys, torch
        from fitdp.saving import export
        cases = torch.load(sys.argv[1])
        for kind, (path, inputs, want) in cases.items():
            for fn in (export.load_predictor(path), torch.export.load(path).module()):
                if isinstance(inputs, dict):
                    got = fn(**inputs)
                else:
                    got = fn(*inputs) if isinstance(inputs, tuple) else fn(inputs)
                got, want_ = (got, want) if isinstance(got, tuple) else ((got,), (want,))
                for g, w in zip(got, want_):
                    torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
        assert not any("test_export" in m for m in sys.modules), "model module was imported"
        print("ok", len(cases))
        """
    )
    paths = [str(REPO), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "cases.pt")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok 4"


def test_onnx_from_the_same_program(exported: dict, tmp_path: Path) -> None:
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    predict = load_predictor(exported["cnn"][1])
    torch.onnx.export(predict.program, f=str(tmp_path / "cnn.onnx"), dynamo=True)
    session = ort.InferenceSession(str(tmp_path / "cnn.onnx"))
    x = _inputs("cnn", 5)
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    torch.testing.assert_close(torch.from_numpy(got), predict(x), atol=1e-5, rtol=1e-5)


def test_bf16_mixed_model_exports_in_its_training_precision(tmp_path: Path) -> None:
    """Regression: the predictor of a bf16-mixed model ran in fp32 and differed from predict
    by up to 1.3e-2; export(precision="bf16-mixed") runs forward under autocast as predict
    does, and a bad precision is named."""
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    y = torch.randint(0, 4, (64,))
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    model = fitdp.Model(net)
    model.compile(optimizer="adam", loss="cross_entropy", precision="bf16-mixed")
    model.fit(x, y, epochs=1, batch_size=16, devices=["cpu"], verbose=0)
    preds = model.predict(x, batch_size=64).float()
    model.export(tmp_path / "mixed.pt2", x[:8], precision="bf16-mixed")
    model.export(tmp_path / "fp32.pt2", x[:8])
    mixed = fitdp.load_predictor(tmp_path / "mixed.pt2")(x).float()
    fp32 = fitdp.load_predictor(tmp_path / "fp32.pt2")(x).float()
    assert (mixed - preds).abs().max() <= 1e-6
    assert (fp32 - preds).abs().max() > 1e-3  # the default is fp32, as docs/export.md says
    with pytest.raises(ValueError, match=r"precision: got 'bf16'.*one of '32', 'bf16-mixed'"):
        model.export(tmp_path / "bad.pt2", x[:8], precision="bf16")
