"""Before any cell trains: the environment record, checkpoints, the dataset, the hardware probe, the cell's
plan and the memory estimate (rules environment, model_checkpoint, dataset, probe, plan)."""
