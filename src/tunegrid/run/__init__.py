"""Processes: the supervisor of a cell and its ranks (and its reading of what the ranks left), the warm worker,
the lifeline that ties children to their owner, the Snakefile hooks and the run's closing glance, and the
MLflow/Chromium servers. The only wing that starts subprocesses."""
