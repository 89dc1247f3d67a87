from __future__ import annotations

import pytest

from serve_app.config.settings import DEFAULT_MODEL_DIR


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The tiny model's tokenizer (`make test` builds the model before running the suite)."""
    from transformers import AutoTokenizer

    assert (DEFAULT_MODEL_DIR / "tokenizer.json").exists(), "run `make test` (it builds the tiny model)"
    return AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
