"""The LoRA adapters a server serves by name (`--lora-modules`, and those loaded live through
/v1/load_lora_adapter): each name's LoRARequest, and its requests in flight, so an adapter in
use is not unloaded. An adapter is a PEFT folder or a GGUF LoRA file (llama.cpp's); here only
that it is one, the engine checks the rest when a request names it.

One instance serves both frontends (the launcher's), so an adapter loaded over REST is one gRPC
calls can name, and one in use by either is not unloaded. A key bound to adapters
(server/auth.py) sees only those: to it any other is not served."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from treadle.config import APIKey, ModelConfig, ServerConfig
from treadle.core.lora_request import MAX_LORA_NAME_CHARS, LoRARequest
from treadle.model.gguf_file import is_lora_adapter, read_gguf
from treadle.model.source import ModelLoadError
from treadle.server.auth import may_use_adapter
from treadle.server.openai.errors import APIError


class LoraAdapters:
    def __init__(self, modules: tuple[str, ...], enabled: bool, max_adapters: int) -> None:
        """`modules`: name=path pairs; `max_adapters`: most served at once (max_cpu_loras)."""
        self.enabled = enabled
        self.max_adapters = max_adapters
        self.by_name: dict[str, LoRARequest] = {}
        self.in_flight: Counter[str] = Counter()
        self.next_id = 1
        for module in modules:
            name, _, path = module.partition("=")
            self.load(name, path)

    @classmethod
    def served(cls, config: ServerConfig, model: ModelConfig) -> LoraAdapters:
        """The server's `--lora-modules`, within the model's LoRA settings."""
        return cls(config.lora_modules, model.enable_lora, model.max_cpu_loras)

    def get(self, name: str, key: APIKey | None = None) -> LoRARequest | None:
        """The adapter `name`, as the caller with `key` sees it (None: no keys): None where it
        is not served or the key is bound to other adapters."""
        return self.by_name.get(name) if may_use_adapter(key, name) else None

    def names(self, key: APIKey | None = None) -> list[str]:
        """The adapters the caller with `key` sees."""
        return [name for name in self.by_name if may_use_adapter(key, name)]

    @contextmanager
    def in_use(self, name: str) -> Iterator[None]:
        """The adapter counted in use (not to be unloaded) meanwhile."""
        self.in_flight[name] += 1
        try:
            yield
        finally:
            self.in_flight[name] -= 1

    def load(self, name: str, path: str) -> LoRARequest:
        """APIError (400, 409) for an adapter that cannot be added (vLLM's messages)."""
        if not self.enabled:
            raise APIError(400, "LoRA adapters are not enabled (--enable-lora)")
        if not name or len(name) > MAX_LORA_NAME_CHARS:
            raise APIError(400, f"lora_name must be 1 to {MAX_LORA_NAME_CHARS} characters",
                           param="lora_name")
        if name in self.by_name:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.",
                           param="lora_name")
        if len(self.by_name) >= self.max_adapters:
            raise APIError(409, f"{self.max_adapters} adapters are loaded already "
                           "(max_cpu_loras): unload one first")
        check_adapter_files(path)
        lora = LoRARequest(name, self.next_id, str(path))
        self.next_id += 1
        self.by_name[name] = lora
        return lora

    def unload(self, name: str) -> None:
        if name not in self.by_name:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.",
                           param="lora_name", code="model_not_found")
        if self.in_flight[name]:
            raise APIError(409, f"The lora adapter '{name}' is in use by "
                           f"{self.in_flight[name]} requests")
        del self.by_name[name]


def check_adapter_files(path: str) -> None:
    """APIError 400 unless `path` is a GGUF LoRA file or a folder with adapter_config.json."""
    if not Path(path).is_file():
        if not (Path(path) / "adapter_config.json").is_file():
            raise APIError(400, f"{path!r} is neither a GGUF LoRA file nor a folder with "
                           "adapter_config.json", param="lora_path")
        return
    try:
        adapter = is_lora_adapter(read_gguf(path))
    except ModelLoadError as e:
        raise APIError(400, f"{path!r} is not a GGUF LoRA file: {e}", param="lora_path") from e
    if not adapter:
        raise APIError(400, f"{path!r} is a GGUF file but not a LoRA adapter (llama.cpp's "
                       "general.type adapter, adapter.type lora)", param="lora_path")
