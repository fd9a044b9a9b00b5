"""MLflowLogger writes a fit to a real MLflow tracking store, read back with MLflow's own
client (issue 32 item 4)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

import fitdp
from fitdp.callbacks import Callback, LambdaCallback, MLflowLogger
from fitdp.saving.checkpoint import load_checkpoint

G = torch.Generator().manual_seed(0)
X, Y = torch.randn(64, 6, generator=G), torch.randint(0, 3, (64,), generator=G)


@pytest.fixture
def store(tmp_path, monkeypatch) -> str:
    """A folder tracking store (MLflow 3 keeps it behind this switch; a sqlite store needs
    sqlalchemy, which mlflow-skinny does not bring)."""
    pytest.importorskip("mlflow")  # the mlflow extra (a base install skips)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return (tmp_path / "mlruns").as_uri()


def make() -> fitdp.Model:
    torch.manual_seed(0)
    model = fitdp.Model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)))
    model.compile("adam", lr=0.01, metrics={"acc": MulticlassAccuracy(num_classes=3)})
    return model


def the_run(uri: str, experiment: str = "fitdp"):
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1
    return client, runs[0]


def test_params_metrics_and_the_final_checkpoint_read_back_equal_the_history(store, tmp_path):
    model = make()
    logger = MLflowLogger(store, experiment_name="digits", run_name="mlp", update_freq=2,
                          tags={"team": "fitdp"})
    history = model.fit(X, Y, batch_size=8, epochs=3, validation_data=(X[:16], Y[:16]),
                        verbose=0, callbacks=[logger])
    client, run = the_run(store, "digits")
    assert run.info.run_name == "mlp" and run.info.status == "FINISHED"
    assert run.data.tags["team"] == "fitdp"
    params = run.data.params
    assert params["compile.optimizer"] == "adam" and params["compile.lr"] == "0.01"
    assert params["optimizer.class"] == "Adam" and params["optimizer.betas"] == "[0.9, 0.999]"
    assert params["fit.epochs"] == "3" and params["fit.batch_size"] == "8"
    assert params["compile.metrics"] == "{acc: MulticlassAccuracy}"
    for key, values in history.history.items():  # loss, acc, val_loss, val_acc, lr
        logged = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in logged] == [0, 1, 2], key
        assert [m.value for m in logged] == values, key  # the very floats History holds
    batch = client.get_metric_history(run.info.run_id, "batch/loss")
    assert [m.step for m in batch] == list(range(2, 25, 2))  # every 2nd of 24 steps
    folder = client.download_artifacts(run.info.run_id, "checkpoints", str(tmp_path))
    saved = load_checkpoint(f"{folder}/final.ckpt")
    assert saved["run"]["global_step"] == 24
    for k, v in model.module.state_dict().items():
        assert torch.equal(saved["module"][k], v), k


class Interrupt(Callback):
    def on_train_batch_end(self, batch, logs=None):
        if self.model.global_step == 10:
            raise KeyboardInterrupt


def test_a_resumed_fit_logs_into_the_run_it_resumes(store, tmp_path):
    """The run's id is in the checkpoint: the epochs after the resume continue its curves."""
    from fitdp.callbacks import BackupAndRestore

    backup = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        make().fit(X, Y, batch_size=8, epochs=3, verbose=0, callbacks=[
            MLflowLogger(store), BackupAndRestore(backup, save_freq=1), Interrupt()])
    history = make().fit(X, Y, batch_size=8, epochs=3, verbose=0, callbacks=[
        MLflowLogger(store), BackupAndRestore(backup, save_freq=1)])
    client, run = the_run(store)
    logged = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in logged] == [0, 1, 2]
    assert [m.value for m in logged][1:] == history.history["loss"][1:]


def test_a_failed_fit_marks_its_run_failed(store):
    """Regression (issue 37): a fit that raised left its MLflow run RUNNING; MLflow's own
    clients (``mlflow.start_run`` as a context) end a run whose block raised as FAILED."""
    class Boom(Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        make().fit(X, Y, epochs=3, verbose=0, callbacks=[MLflowLogger(store), Boom()])
    _, run = the_run(store)
    assert run.info.status == "FAILED"


def test_a_malformed_tracking_uri_is_refused_before_a_folder_is_made(tmp_path, monkeypatch):
    """Regression (issue 37): "not a uri://x" was read as a folder store and made."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"tracking_uri.*got 'not a uri://x'.*Fix:"):
        MLflowLogger("not a uri://x")
    assert list(tmp_path.iterdir()) == []


def test_only_the_main_process_logs(store):
    """A rank other than 0 (as torchrun's rank 1 sees itself) makes no run and logs nothing."""
    def rank_1(logs):
        model.is_main_process = False  # (fit sets it from the ranks before the callbacks)

    model = make()
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0,
              callbacks=[LambdaCallback(on_train_begin=rank_1), MLflowLogger(store)])
    from mlflow import MlflowClient

    assert MlflowClient(store).get_experiment_by_name("fitdp") is None


@pytest.mark.parametrize("kwargs, match", [
    ({"tracking_uri": 123}, r"^MLflowLogger\(tracking_uri=\.\.\.\): got 123 of type int; "
                            r"expected None \(MLflow's default\), a tracking URI.*Fix:"),
    ({"tracking_uri": ""}, r"^MLflowLogger\(tracking_uri=\.\.\.\): got '' of type str"),
    ({"experiment_name": None}, r"^MLflowLogger\(experiment_name=\.\.\.\): got None"),
    ({"run_name": 5}, r"^MLflowLogger\(run_name=\.\.\.\): got 5; expected a non-empty "
                      r"string or None"),
    ({"log_checkpoint": "yes"}, r"^MLflowLogger\(log_checkpoint=\.\.\.\)"),
    ({"tags": ["a"]}, r"^MLflowLogger\(tags=\.\.\.\)"),
])
def test_bad_arguments_are_type_errors_naming_them(kwargs, match):
    with pytest.raises(TypeError, match=match):
        MLflowLogger(**kwargs)


def test_a_bad_update_freq_names_the_logger():
    with pytest.raises(ValueError, match=r"^MLflowLogger\(update_freq=\.\.\.\): got 'step'"):
        MLflowLogger(update_freq="step")


def test_importing_fitdp_does_not_import_mlflow():
    code = "import sys, fitdp.callbacks; fitdp.callbacks.MLflowLogger(); " \
           "print('mlflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"
