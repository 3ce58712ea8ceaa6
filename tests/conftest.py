"""The suite's rules and shared fixtures.

- Triton: without CUDA its kernels run in Triton's CPU interpreter, switched on here (the one
  place), before triton is first imported. On Linux triton is a declared test dependency,
  so a run without it stops at start-up; elsewhere Triton tests skip, saying why.
- GPU: a test that needs CUDA is marked `gpu` (a CUDA parametrization too: the `device` and
  `triton_device` fixtures mark theirs); without CUDA this hook skips it, for one reason.
- Browser: a test that opens a page in headless Chromium is marked `browser`; without Debian's
  `chromium` on PATH this hook skips it.
- Tiny random models in Hugging Face layout (tests/support.py) and transformers' model of
  each, the reference of every engine test.
- The real default model, dense (float32), loaded once for every test file that holds it
  against a reference.
"""

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # must be set before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.support import (  # noqa: E402
    TINY_ARCHS,
    TRITON_DECLARED,
    build_tiny_model,
    has_triton,
    hf_greedy,
    load_hf_model,
)


def pytest_configure(config: pytest.Config) -> None:
    if TRITON_DECLARED and not has_triton():
        raise pytest.UsageError(
            "triton is not installed, and the Triton kernel tests need it: install the test "
            "extra (pip install -e '.[test]'), which declares triton on Linux"
        )


def pytest_runtest_setup(item: pytest.Item) -> None:
    if not HAS_CUDA and item.get_closest_marker("gpu"):
        pytest.skip("marked gpu: needs a CUDA GPU")
    if item.get_closest_marker("browser") and not shutil.which("chromium"):
        pytest.skip("marked browser: needs Debian's chromium on PATH (apt-get install chromium)")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """The test runs on the CPU and, marked gpu, on CUDA."""
    return request.param


@pytest.fixture
def triton_interpreter() -> None:
    """The test runs Triton kernels on the CPU, in Triton's interpreter: a process-wide
    switch, on only where there is no GPU, so on a CUDA machine the test skips."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's CPU interpreter is off: conftest turns it on only without CUDA")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def triton_device(request: pytest.FixtureRequest) -> str:
    """Where the Triton kernels of the test run: on the CPU in Triton's interpreter (see
    `triton_interpreter`), and, marked gpu, compiled on CUDA."""
    if request.param == "cpu":
        request.getfixturevalue("triton_interpreter")
    return request.param


@pytest.fixture(scope="session", params=sorted(TINY_ARCHS))
def tiny_model(request, tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-only"), "llama")


@pytest.fixture(scope="session")
def hf_tiny_model(tiny_model):
    """transformers' float32 model of `tiny_model`."""
    return load_hf_model(tiny_model)


@pytest.fixture(scope="session")
def hf_tiny_llama(tiny_llama):
    """transformers' float32 model of `tiny_llama`."""
    return load_hf_model(tiny_llama)


@pytest.fixture(scope="session")
def greedy_reference(hf_tiny_model) -> Callable[[list[int], int], list[int]]:
    """transformers' greedy continuation of a prompt by `tiny_model`, each computed once."""
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def reference(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            cache[key] = hf_greedy(hf_tiny_model, prompt, max_tokens)
        return cache[key]

    return reference


@pytest.fixture(scope="session")
def default_dense():
    """The real default model (SmolLM2-135M-Instruct) with its weights dequantized to float32
    (weight_format="dense"), on a small KV cache: the CPU default's 2 GiB takes seconds to
    allocate, and no test of it is about the cache's size."""
    from nanovllm import LLM

    return LLM(max_num_seqs=8, max_model_len=1024, weight_format="dense", kv_cache_gib=0.1)
