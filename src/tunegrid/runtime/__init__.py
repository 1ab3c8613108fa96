"""Runtime helpers every room may use: atomic file writes, the run folder's files, the lifeline that ties a
worker to its supervisor, how a worker starts, which devices a cell's job uses and the memory meter.

They know nothing of a study's words: standard library only at import (torch only inside the memory meter's
calls), and no import of any other tunegrid module.
"""
