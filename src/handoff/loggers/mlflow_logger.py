"""MLflow (`pip install 'handoff[mlflow]'`, mlflow-skinny): a run in a file store under
out_dir/mlruns, or wherever MLFLOW_TRACKING_URI points.

The experiment is MLFLOW_EXPERIMENT_NAME or 'handoff', the run is named after out_dir; the
config goes in as params ('actor.lr'), each metric with its step, text as artifacts. MLflow 3
keeps its file store only behind MLFLOW_ALLOW_FILE_STORE=true (it prefers a database, which
mlflow-skinny cannot open), so that is set for our own out_dir/mlruns.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from handoff.config import dotted
from handoff.loggers.base import missing_package, numeric_items

MAX_BATCH = 1000   # metrics per log_batch call (MLflow's limit)


class MlflowLogger:
    def __init__(self, out_dir: Path):
        try:
            from mlflow import MlflowClient
            from mlflow.entities import Metric, Param
        except ImportError:
            raise missing_package("mlflow", "mlflow-skinny") from None
        self._metric, self._param = Metric, Param
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (out_dir / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "handoff"
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(name))
        self.run_id = self.client.create_run(experiment_id,
                                             run_name=out_dir.resolve().name).info.run_id

    def log_config(self, config: dict) -> None:
        params = [self._param(k, str(v)) for k, v in dotted(config).items()]
        for i in range(0, len(params), 100):   # MLflow takes 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log_metrics(self, row: dict, step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(k, float(v), now, step) for k, v in numeric_items(row).items()]
        for i in range(0, len(metrics), MAX_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + MAX_BATCH])

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.client.log_text(self.run_id, text, f"{tag}/step_{step:06d}.md")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
