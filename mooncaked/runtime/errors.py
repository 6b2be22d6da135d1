"""Errors shared across the package that say what kind of failure happened, not where."""

from __future__ import annotations


class StartupError(Exception):
    """A configuration or load error found while starting (a bad value, a missing file, a model that cannot be
    loaded): restarting the process cannot fix it, so it exits with status 2 and is not restarted."""
