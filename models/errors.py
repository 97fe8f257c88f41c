"""Errors raised while building a model or pouring weights into it."""

from __future__ import annotations


class WeightLoadError(ValueError):
    """A checkpoint does not fit the model: missing, unexpected or mis-shaped weights,
    or a weight file that cannot be read. The message names the weight and/or file."""


class UnsupportedArchitectureError(ValueError):
    """`config.json` names an architecture that the registry does not know."""
