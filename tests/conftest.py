"""Shared fixtures: models are loaded once per session; references come from HF generate."""

import pytest

from shared.model_loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    """The tiny random-weight Llama (fp32, fixed seed)."""
    return load_model("tiny")


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """SmolLM2-135M-Instruct in fp32, from the converted cache."""
    return load_model("smollm2")
