"""The training loop: one optimizer step under the cell's precision, its instruments and records, the heartbeat,
the resume state, the ranks of a distributed cell and how a failure is named."""
