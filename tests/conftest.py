"""Test-session set-up.

1. Triton runs in its interpreter on CPU (must precede any kernel import).
2. Hypothesis draws the same examples on every run (`derandomize`), so `make test` passes or fails the same way
   each time; `HYPOTHESIS_PROFILE=explore make test` draws new ones to hunt for bugs (pin what it finds with
   `@example`).
"""

import os

from hypothesis import settings

os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile("repeatable", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))
