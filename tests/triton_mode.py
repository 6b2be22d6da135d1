"""Whether Triton kernels run in the interpreter in this test session (tests/conftest.py decides)."""

import pytest
import triton

IS_INTERPRETED = bool(triton.knobs.runtime.interpret)

needs_triton_interpreter = pytest.mark.skipif(
    not IS_INTERPRETED, reason="Triton compiles for the CUDA device here; tests/gpu/ checks the kernels on it")
