"""`nanovllm generate` on the real default model (SmolLM2-135M-Instruct)."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_cli_generate_answers():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanovllm",
            "generate",
            "What is the capital of France?",
            "--max-tokens",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
