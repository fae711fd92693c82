"""Every run of an MLflow experiment as MLflow's own client reads it back: name, status, times,
params, tags, and each metric's whole history as [step, value, timestamp] in step order.

Usage: mlflow_runs.py TRACKING_URI EXPERIMENT  (JSON on stdout; no runs if there is no such
experiment)
"""

import json
import sys

from mlflow.tracking import MlflowClient

uri, name = sys.argv[1], sys.argv[2]
client = MlflowClient(tracking_uri=uri)
experiment = client.get_experiment_by_name(name)
runs = []
if experiment is not None:
    for run in client.search_runs([experiment.experiment_id], max_results=1000):
        metrics = {}
        for key in run.data.metrics:
            history = client.get_metric_history(run.info.run_id, key)
            metrics[key] = sorted([m.step, m.value, m.timestamp] for m in history)
        runs.append(
            {
                "name": run.info.run_name,
                "status": run.info.status,
                "start_time": run.info.start_time,
                "end_time": run.info.end_time,
                "params": run.data.params,
                "tags": run.data.tags,
                "metrics": metrics,
            }
        )
print(json.dumps({"runs": runs}))
