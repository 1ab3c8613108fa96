"""Before any cell trains: the environment record, checkpoints, the dataset, the hardware probe, named
targets and the memory estimate (rules environment, model_checkpoint, dataset, probe, plan)."""
