"""`treadle generate` as a user runs it: a real subprocess on the default model."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.default_model


def treadle(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "treadle.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_answers_through_the_chat_template():
    result = treadle("generate", "What is the capital of France?", "--dtype", "float32",
                     "--quantization", "none", "--max-tokens", "16")
    assert result.returncode == 0, result.stderr
    # The float path's greedy answer, also checked token for token against transformers in
    # test_default_model.py. (Served as stored, the Q8_0 LM head tips a near tie between "The"
    # and "L": 25.33 against 25.24 in float.)
    assert result.stdout.strip() == "The capital of France is Paris."


def test_bad_model_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    result = treadle("generate", "hi", "--model", str(missing))
    assert result.returncode == 2
    assert str(missing) in result.stderr and "does not exist" in result.stderr
