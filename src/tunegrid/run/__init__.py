"""Processes: the supervisor of a cell and its ranks, the warm worker, the lifeline that ties children to
their owner, the Snakefile hooks and the MLflow/Chromium servers. The only wing that starts subprocesses."""
