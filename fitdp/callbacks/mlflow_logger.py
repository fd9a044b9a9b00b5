"""`MLflowLogger`: a fit's parameters, metrics and final checkpoint in an MLflow tracking store."""

from __future__ import annotations

import inspect
import os
import re
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from fitdp.callbacks.base import Callback
from fitdp.callbacks.tensorboard import check_update_freq
from fitdp.checks import check_folder, fail

_MAX_PARAM = 500  # characters of a parameter's value kept (MLflow takes up to 6000)


class MLflowLogger(Callback):
    """Logs a fit to MLflow: parameters, metrics every epoch (and every N batches), and the
    final checkpoint as an artifact. Only the main process logs (rank 0 under torchrun).

    The run is made at the first thing logged, in the experiment ``experiment_name`` (made
    when missing). Its parameters: ``compile.<arg>`` for what ``compile`` was given
    (``model.get_compile_config()``), ``optimizer.<key>`` for the optimizer's class and first
    parameter group (``lr``, ``betas``, ``weight_decay``, ...), ``fit.<key>`` for ``epochs``,
    ``batch_size`` and ``steps``. Each epoch's logs go under their History names (``loss``,
    ``val_loss``, ``lr``, ...) with the epoch as MLflow's step; batch logs (``update_freq``
    "batch" or N) as ``batch/<key>`` with ``model.global_step`` as the step. When ``fit``
    ends, the model is saved with ``model.save`` (a checkpoint ``fit(resume=...)`` and
    ``model.load`` read) and logged as ``checkpoints/final.ckpt``, and the run is marked
    finished. A resumed fit logs into the run it resumes (its id is in the checkpoint).

    ``mlflow`` is imported when training begins, not with fitdp (``pip install
    "fitdp[mlflow]"``: ``mlflow-skinny``, the client alone). A local store: a tracking URI
    ``sqlite:///mlflow.db`` (needs ``sqlalchemy``, which the full ``mlflow`` package brings)
    or a folder (``file:...``; MLflow 3 asks for ``MLFLOW_ALLOW_FILE_STORE=true``); or a
    tracking server's ``http://...``.

    Args:
        tracking_uri: the MLflow tracking URI (a path is read as a folder store); None:
            MLflow's own default (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``).
        experiment_name: the experiment the run belongs to.
        run_name: the run's name; None lets MLflow pick one.
        update_freq: "epoch" (epoch logs only), "batch" or an int N (also every N training
            batches), as for ``TensorBoard``.
        log_checkpoint: log the final checkpoint as an artifact (not with
            ``strategy="fsdp"``, whose checkpoints every rank writes).
        tags: tags of the run.

    Raises:
        ImportError: ``mlflow`` is not installed (when training begins).
        TypeError, ValueError: an argument of the wrong type or value, by name.

    Example:
        >>> MLflowLogger("sqlite:///runs/mlflow.db", run_name="mlp-adam")  # doctest: +ELLIPSIS
        <fitdp.callbacks.mlflow_logger.MLflowLogger object at ...>
    """

    def __init__(self, tracking_uri: str | os.PathLike[str] | None = None,
                 experiment_name: str = "fitdp", run_name: str | None = None, *,
                 update_freq: str | int = "epoch", log_checkpoint: bool = True,
                 tags: Mapping[str, str] | None = None) -> None:
        super().__init__()
        if tracking_uri is not None and (not isinstance(tracking_uri, (str, os.PathLike))
                                         or not os.fspath(tracking_uri)):
            fail("MLflowLogger(tracking_uri=...)",
                 f"{tracking_uri!r} of type {type(tracking_uri).__name__}", "None (MLflow's "
                 "default), a tracking URI such as 'sqlite:///mlflow.db' or "
                 "'http://host:5000', or a folder path", "pass the URI as a string, e.g. "
                 "tracking_uri='sqlite:///mlflow.db'", error=TypeError, described=True)
        for name, value in (("experiment_name", experiment_name), ("run_name", run_name)):
            if not (isinstance(value, str) and value) and not (name == "run_name"
                                                               and value is None):
                fail(f"MLflowLogger({name}=...)", value, "a non-empty string"
                     + (" or None" if name == "run_name" else ""), error=TypeError)
        if not isinstance(log_checkpoint, bool):
            fail("MLflowLogger(log_checkpoint=...)", log_checkpoint, "True or False",
                 error=TypeError)
        if tags is not None and not (isinstance(tags, Mapping) and all(
                isinstance(k, str) for k in tags)):
            fail("MLflowLogger(tags=...)", tags, "a dict of str -> str, or None",
                 error=TypeError)
        self.tracking_uri = None if tracking_uri is None else _check_uri(os.fspath(tracking_uri))
        self.experiment_name, self.run_name = experiment_name, run_name
        self.update_freq = check_update_freq(update_freq, "MLflowLogger")
        self.log_checkpoint = log_checkpoint
        self.tags = {k: str(v) for k, v in (tags or {}).items()}
        self.needs_batch_logs = self.update_freq != "epoch"
        self.run_id: str | None = None  # the MLflow run logged into (saved in checkpoints)
        self._client: Any = None
        self._batches = 0
        self._params_logged = False

    @property
    def state_key(self) -> str:
        """`MLflowLogger[<experiment_name>]`."""
        return f"MLflowLogger[{self.experiment_name}]"

    def on_train_begin(self, logs: dict[str, float] | None = None) -> None:
        self._batches, self._params_logged = 0, False
        if self._is_main_process():
            try:
                from mlflow import MlflowClient
            except ImportError as e:
                raise ImportError('MLflowLogger needs the `mlflow` package, which is not '
                                  'installed. Install it with `pip install "fitdp[mlflow]"` '
                                  '(or `pip install mlflow`).') from e
            self._client = MlflowClient(self.tracking_uri)

    def _run(self) -> str | None:
        """The run's id, made (with its parameters logged) on first use; None off rank 0."""
        client = self._client
        if client is None:
            return None
        if self.run_id is not None and not self._params_logged and self._exists(self.run_id):
            self._params_logged = True  # a resumed fit: its parameters are logged already
        if self.run_id is None or not self._params_logged:
            found = client.get_experiment_by_name(self.experiment_name)
            experiment = (found.experiment_id if found is not None
                          else client.create_experiment(self.experiment_name))
            self.run_id = client.create_run(experiment, run_name=self.run_name,
                                            tags=self.tags).info.run_id
        if not self._params_logged:
            self._params_logged = True
            self._log(params=self._params())
        return self.run_id

    def _exists(self, run_id: str) -> bool:
        """Whether the run a resumed fit names is in this store (else a new run is made)."""
        from mlflow.exceptions import MlflowException

        try:
            return self._client.get_run(run_id).info.lifecycle_stage == "active"
        except MlflowException:
            return False

    def _params(self) -> dict[str, str]:
        model = self.model
        params = {f"compile.{k}": _as_param(v) for k, v in model.get_compile_config().items()}
        optimizer = model.optimizer
        if optimizer is not None:
            params["optimizer.class"] = type(optimizer).__name__
            group = optimizer.param_groups[0]
            params.update({f"optimizer.{k}": _as_param(v) for k, v in group.items()
                           if k != "params" and isinstance(v, (bool, int, float, str, tuple))})
        params.update({f"fit.{k}": _as_param(v) for k, v in self.params.items()
                       if k in ("epochs", "batch_size", "steps") and v is not None})
        return params

    def _log(self, metrics: Mapping[str, float] | None = None, step: int = 0,
             params: Mapping[str, str] | None = None) -> None:
        from mlflow.entities import Metric, Param

        now = int(time.time() * 1000)
        self._client.log_batch(
            self.run_id, metrics=[Metric(k, float(v), now, step)
                                  for k, v in (metrics or {}).items()],
            params=[Param(k, v) for k, v in (params or {}).items()])

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        if self.update_freq == "epoch":
            return
        self._batches += 1
        if self._batches % int(self.update_freq) or not logs or self._run() is None:
            return
        self._log({f"batch/{k}": v for k, v in logs.items()}, int(self.model.global_step))

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        if self._run() is not None and logs:
            self._log(logs, epoch)

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        run_id = self._run()
        if run_id is None:
            return
        if self.log_checkpoint and not self.model.shards_weights:
            with tempfile.TemporaryDirectory(prefix="fitdp-mlflow-") as folder:
                path = os.path.join(folder, "final.ckpt")
                self.model.save(path)
                self._client.log_artifact(run_id, path, "checkpoints")
        self._client.set_terminated(run_id, status="FINISHED")
        self._client = None

    def on_exception(self, exception: BaseException) -> None:
        """A fit that fails marks its run FAILED (KILLED for Ctrl-C and SIGTERM), as MLflow's
        own clients do, so the store shows no run left RUNNING."""
        client, self._client = self._client, None
        if client is None or self.run_id is None or not self._params_logged:
            return
        failed = isinstance(exception, Exception)
        client.set_terminated(self.run_id, status="FAILED" if failed else "KILLED")

    def state_dict(self) -> dict[str, Any]:
        """The run's id, so a resumed fit logs into the same run, and the batch count."""
        return {"run_id": self.run_id, "batches": self._batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.run_id = state.get("run_id")
        self._batches = int(state.get("batches", 0))


def _check_uri(uri: str) -> str:
    """A tracking URI whose scheme (before ``://``) is a URI scheme, or a folder path that
    can be made: ``"not a uri://x"`` would be read as a folder and made."""
    scheme, sep, _ = uri.partition("://")
    if sep and not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        fail("MLflowLogger(tracking_uri=...)", uri, "a tracking URI with a scheme such as "
             "'sqlite:///mlflow.db', 'file:///runs/mlruns' or 'http://host:5000', or a "
             "folder path", "check the scheme before '://' (letters, digits, '+', '-', "
             "'.')")
    if not sep and not uri.startswith(("file:", "databricks")):
        check_folder("MLflowLogger(tracking_uri=...)", uri)
    return uri


def _as_param(value: Any) -> str:
    """A parameter's value as MLflow keeps it: text (a class or function by its name, a
    dict by its keys), cut to ``_MAX_PARAM`` characters."""
    if inspect.isclass(value) or inspect.isfunction(value):
        text = value.__qualname__
    elif isinstance(value, Mapping):
        text = "{" + ", ".join(f"{k}: {_as_param(v)}" for k, v in value.items()) + "}"
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(_as_param(v) for v in value) + "]"
    elif value is None or isinstance(value, (bool, int, float, str)):
        text = str(value)
    else:
        text = type(value).__name__
    return text[:_MAX_PARAM]
