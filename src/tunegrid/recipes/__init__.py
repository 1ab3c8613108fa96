"""A user's training recipe (axolotl, TRL, Transformers): read into a study around it, key by key, and a cell of
that study written back as the recipe with only its changed keys (the fix as a diff).

A study file with a `base:` key is expanded from its recipe when the study loads, so this room stays light: no
torch at import (the checkpoint's linear layers are read on the meta device only when a recipe asks for
all-linear).
"""
