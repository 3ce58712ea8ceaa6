"""Shared fixtures: tiny random models in Hugging Face layout (built by tests/support.py)."""

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():  # Triton kernels then run in its CPU interpreter; must
    os.environ.setdefault("TRITON_INTERPRET", "1")  # be set before triton is first imported

from tests.support import TINY_ARCHS, build_tiny_model  # noqa: E402


@pytest.fixture(scope="session", params=sorted(TINY_ARCHS))
def tiny_model(request, tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-only"), "llama")
