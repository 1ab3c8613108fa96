"""tunegrid: find out why an LLM fine-tune fails and which setting fixes it.

The package root is the room of the shared words and types every stage speaks: the grid's axes and outcomes
(vocabulary), what each precision and quantization means (plans), the named hardware targets (targets), a cell's
outcome typed (outcome), where an activation is measured (sites) and how quantities are written (units).

The rooms beside it: tunegrid.runtime (runtime helpers), tunegrid.study (the study itself), tunegrid.recipes (a
user's recipe, in and out), then the stages prepare, cell, track, review and run, and the command line (cli);
tests/house/test_architecture.py holds which room may import which.
"""

__version__ = "0.1.0"
