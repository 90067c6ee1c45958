"""The real tokenizers, and transformers' as the reference, loaded once per session."""

from __future__ import annotations

from typing import Any

import pytest

from kvguard.tokens.tokenizer import PoolTokenizer
from tests.conftest import model_dir


@pytest.fixture(scope="session")
def qwen() -> PoolTokenizer:
    return PoolTokenizer.load(model_dir("qwen"))


@pytest.fixture(scope="session")
def qwen_hf() -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir("qwen"))


@pytest.fixture(scope="session")
def llama() -> PoolTokenizer:
    return PoolTokenizer.load(model_dir("llama3.2"))


@pytest.fixture(scope="session")
def llama_hf() -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir("llama3.2"))
