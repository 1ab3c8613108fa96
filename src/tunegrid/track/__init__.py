"""MLflow: the store, the experiment, each cell's run and each invocation's run. The only wing that imports mlflow."""
