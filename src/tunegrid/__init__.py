"""tunegrid: find out why an LLM fine-tune fails and which setting fixes it."""

__version__ = "0.1.0"
