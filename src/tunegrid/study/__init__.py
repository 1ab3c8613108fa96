"""The study itself: its file read and checked (schema, defaults, input limits, the data section), its grid of
cells and their axes, the error every bad input becomes, its library stacks and where each of its files lives.

Light: no torch, no transformers at import time (the Snakefile reads this room when it parses). It imports
only the shared words (tunegrid/*.py) and the runtime helpers (tunegrid.runtime).
"""
