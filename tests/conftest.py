"""Test-session set-up: Triton runs in its interpreter on CPU (must precede any kernel import)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
