"""Session-scoped models for the model and engine tests (loading SmolLM2 or converting it takes seconds)."""

from __future__ import annotations

from typing import Any

import pytest

from mooncaked.model.frontend import EMBEDDED_SMOLLM2, embedded_smollm2_path
from mooncaked.model.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model(EMBEDDED_SMOLLM2)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer() -> Any:
    transformers = pytest.importorskip("transformers")
    path = embedded_smollm2_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
