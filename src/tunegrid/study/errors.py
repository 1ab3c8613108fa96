"""The error every bad input becomes: one sentence naming the config key and the fix, never a traceback.

Its own module so that the checks of any wing can raise it without importing the whole config."""

from __future__ import annotations


class ConfigError(ValueError):
    """A study config that cannot run; the message names the key and the fix."""
