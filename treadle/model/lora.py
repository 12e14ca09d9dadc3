"""LoRA adapters over the base model's linear layers, never merged into them (quantized bases
stay quantized, and every adapter shares one copy of the base).

An adapter, a PEFT folder (adapter_config.json + adapter_model.safetensors) or a GGUF LoRA file
as llama.cpp's convert_lora_to_gguf.py writes it, becomes, per targeted module, A [in, r] and
B [r, out] with the scale folded into B. The runner keeps up to `max_loras` adapters in device
slots; each wrapped layer stacks its parts' (q/k/v, gate/up) A and B per slot, B
block-diagonal, so one fused layer adds x·A·B per row with two matmuls.
On CPU an adapter's rows, where it has few in the step (decode rows), take the native
`lora_add` (x·A·B row by row, by each row's slot), also inside the fused decoder; an adapter's
many rows are a segment (the SGMV idea): matmuls over its rows only, on views of x and y where
the rows are one run (a prefill chunk), else on gathered rows. Base rows pay nothing.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import safetensors
import torch
from gguf.constants import GGMLQuantizationType, Keys
from gguf.quants import dequantize
from safetensors import safe_open
from safetensors.torch import load_file

from treadle.model.family import ModelSpec
from treadle.model.gguf_file import GGUFTensor, is_lora_adapter, read_gguf
from treadle.model.layers import LoraBatch
from treadle.model.linear import Linear, QuantizedLinear
from treadle.model.loader import hf_name_for_gguf
from treadle.model.registry import family_of
from treadle.model.source import ModelLoadError

# Most rows of one adapter in a step that the native lora_add serves; more are a segment's
# matmuls (docs/decisions.md: the two cross between 16 and 32 rows).
NATIVE_MAX_ROWS = 16

# PEFT's module names → the fused layer that serves them and the part's index in it.
MODULE_LAYERS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2),
                 "o_proj": ("o", 0), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
                 "down_proj": ("down", 0)}

# What convert_lora_to_gguf.py writes (--outtype f32, f16, bf16, q8_0).
GGUF_LORA_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                             GGMLQuantizationType.BF16, GGMLQuantizationType.Q8_0})

# The general.architecture llama.cpp writes for a variant, where it is not the variant's name
# (it converts Mistral and Mixtral as "llama").
LLAMA_CPP_ARCHITECTURES = {"mistral": "llama", "mixtral": "llama", "gemma3_text": "gemma3",
                           "qwen3_moe": "qwen3moe"}


class LoraError(ValueError):
    """An adapter this engine cannot serve, or cannot find."""


@dataclass
class LoraAdapter:
    """One adapter's weights, the scale folded into B: (layer, module) → (A [in, r], B [r, out])."""

    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def lora_scale(config: dict) -> float:
    """alpha / r, or alpha / sqrt(r) with rsLoRA (PEFT's rule)."""
    r, alpha = config["r"], config.get("lora_alpha", 8)
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def adapter_config(path: str | Path, max_rank: int) -> dict:
    """A PEFT LoRA folder's config, refused (LoraError) where the adapter needs what this engine
    does not do: checked when a request names the adapter, before its weights load."""
    folder = Path(path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise LoraError(f"{folder} holds no adapter_config.json and adapter_model.safetensors")
    try:
        config = json.loads(config_file.read_text())
        int(config["r"])
    except (ValueError, KeyError, TypeError) as e:
        raise LoraError(f"adapter {folder}: unreadable adapter_config.json ({e})") from e
    unsupported = {"peft_type": config.get("peft_type", "LORA") != "LORA",
                   "use_dora": bool(config.get("use_dora")),
                   "modules_to_save": bool(config.get("modules_to_save")),
                   "bias": config.get("bias", "none") != "none",
                   "rank_pattern": bool(config.get("rank_pattern")),
                   "alpha_pattern": bool(config.get("alpha_pattern")),
                   "layers_to_transform": config.get("layers_to_transform") is not None,
                   # Our bases store [out, in] as nn.Linear does: GPT-2's Conv1D layout is not one.
                   "fan_in_fan_out": bool(config.get("fan_in_fan_out"))}
    refused = [name for name, bad in unsupported.items() if bad]
    if refused:
        raise LoraError(f"adapter {folder}: {', '.join(refused)} not supported")
    rank = int(config["r"])
    if not 0 < rank <= max_rank:
        raise LoraError(f"adapter {folder}: rank {rank} is above max_lora_rank {max_rank}")
    return config


def served_module(path: str | Path, name: str, in_features: int, out_features: int,
                  rank: int, shapes: dict[str, tuple[int, ...]]) -> tuple[int, str]:
    """The (layer, module) of a LoRA pair on the base weight `name` (its Hugging Face name,
    e.g. model.layers.3.self_attn.q_proj), checked against the model's weights' `shapes`
    (`ModelSpec.expected_shapes`): a layer's attention or dense feed-forward projection (not a
    mixture of experts' experts), of its shape."""
    parts = name.split(".")
    shape = shapes.get(f"{name}.weight")
    if (len(parts) != 5 or parts[:2] != ["model", "layers"] or parts[-1] not in MODULE_LAYERS
            or shape is None):
        raise LoraError(f"adapter {path}: {name!r} is not a module LoRA serves on this model "
                        f"(a layer's {', '.join(MODULE_LAYERS)}; no experts)")
    if (in_features, out_features) != (shape[1], shape[0]):
        raise LoraError(f"adapter {path}: {name!r} is {in_features} → {rank} → {out_features}, "
                        f"this model's {shape[1]} → r → {shape[0]} (an adapter of another "
                        "base model?)")
    return int(parts[2]), parts[-1]


# (layer, module) → (the safetensors names of its lora_A and lora_B)
PEFTPairs = dict[tuple[int, str], tuple[str, str]]


def peft_adapter_tensors(path: str | Path, max_rank: int, spec: ModelSpec
                         ) -> tuple[dict, PEFTPairs]:
    """A PEFT LoRA folder's config and its A/B pairs by module, checked against `spec` and
    `max_rank` (see `adapter_config`); LoraError for what this engine cannot serve. Reads the
    safetensors header only."""
    folder = Path(path)
    config = adapter_config(folder, max_rank)
    rank = int(config["r"])
    try:
        with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
            names = f.keys()  # a list: the handle itself is not iterable
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in names}
    except (OSError, safetensors.SafetensorError) as e:
        raise LoraError(f"adapter {folder}: unreadable adapter_model.safetensors ({e})") from e
    pairs: PEFTPairs = {}
    weight_shapes = spec.expected_shapes()
    for a_name, a_shape in shapes.items():
        if ".lora_A." not in a_name:
            if ".lora_B." not in a_name:
                raise LoraError(f"adapter {folder}: tensor {a_name} is not a LoRA A or B matrix")
            continue
        b_name = a_name.replace(".lora_A.", ".lora_B.")
        b_shape = shapes.get(b_name)
        if b_shape is None:
            raise LoraError(f"adapter {folder}: {a_name} lacks its lora_B")
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != rank or b_shape[1] != rank:
            raise LoraError(f"adapter {folder}: {a_name} and its lora_B are {list(a_shape)} and "
                            f"{list(b_shape)}, not [r={rank}, in] and [out, r={rank}]")
        base_name = a_name.split(".lora_A.")[0].removeprefix("base_model.model.")
        key = served_module(folder, base_name, a_shape[1], b_shape[0], rank, weight_shapes)
        pairs[key] = (a_name, b_name)
    if not pairs:
        raise LoraError(f"adapter {folder} holds no LoRA matrices")
    return config, pairs


def load_peft_adapter(path: str | Path, max_rank: int, spec: ModelSpec) -> LoraAdapter:
    """A PEFT LoRA folder's weights (see `peft_adapter_tensors` for what is refused)."""
    config, pairs = peft_adapter_tensors(path, max_rank, spec)
    scale = lora_scale(config)
    tensors = load_file(str(Path(path) / "adapter_model.safetensors"))
    adapter = LoraAdapter(int(config["r"]))
    for key, (a_name, b_name) in pairs.items():
        adapter.weights[key] = (tensors[a_name].float().t().contiguous(),
                                (tensors[b_name].float() * scale).t().contiguous())
    return adapter


def check_adapter(path: str | Path, max_rank: int, spec: ModelSpec) -> None:
    """Refuse (LoraError) an adapter this engine cannot serve on `spec`'s model, reading no
    weights: a file is a GGUF LoRA adapter, a folder PEFT's."""
    if Path(path).is_file():
        gguf_adapter_tensors(path, max_rank, spec)
    else:
        peft_adapter_tensors(path, max_rank, spec)


def load_adapter(path: str | Path, max_rank: int, spec: ModelSpec) -> LoraAdapter:
    """A GGUF LoRA file's or a PEFT folder's weights (see `check_adapter`)."""
    if Path(path).is_file():
        return load_gguf_adapter(path, max_rank, spec)
    return load_peft_adapter(path, max_rank, spec)


# (layer, module) → (the base weight's Hugging Face name, lora_a, lora_b)
GGUFPairs = dict[tuple[int, str], tuple[str, GGUFTensor, GGUFTensor]]


def gguf_adapter_tensors(path: str | Path, max_rank: int, spec: ModelSpec
                         ) -> tuple[float, GGUFPairs]:
    """A GGUF LoRA file's alpha and its lora_a/lora_b pairs by module, checked against `spec`
    as llama.cpp checks them (type, architecture, names, shapes) and against `max_rank`;
    LoraError for what this engine cannot serve. Reads the header only."""
    try:
        file = read_gguf(path)
    except ModelLoadError as e:
        raise LoraError(str(e)) from e
    if not is_lora_adapter(file):
        raise LoraError(f"{path} is not a LoRA adapter (general.type "
                        f"{file.metadata.get(Keys.General.TYPE)!r}, adapter.type "
                        f"{file.metadata.get(Keys.Adapter.TYPE)!r})")
    if Keys.Adapter.ALORA_INVOCATION_TOKENS in file.array_keys:
        raise LoraError(f"adapter {path}: activated LoRA ({Keys.Adapter.ALORA_INVOCATION_TOKENS}) "
                        "not supported")
    architecture = file.metadata.get(Keys.General.ARCHITECTURE)
    served = LLAMA_CPP_ARCHITECTURES.get(spec.architecture, spec.architecture)
    if architecture != served:
        raise LoraError(f"adapter {path} is for a {architecture!r} model, not this "
                        f"{served!r} one")
    halves: dict[str, dict[str, GGUFTensor]] = {}
    for t in file.tensors:
        base_name, _, half = t.name.rpartition(".")
        if half not in ("lora_a", "lora_b"):
            # llama.cpp skips the norms mergekit adds; serving without them would not be the
            # adapter, so they are refused like PEFT's modules_to_save.
            raise LoraError(f"adapter {path}: tensor {t.name!r} is not a lora_a or lora_b matrix")
        halves.setdefault(base_name, {})[half] = t
    family, weight_shapes = family_of(spec), spec.expected_shapes()
    pairs: GGUFPairs = {}
    for base_name, pair in halves.items():
        if len(pair) != 2:
            raise LoraError(f"adapter {path}: {base_name!r} lacks its "
                            f"{'lora_b' if 'lora_a' in pair else 'lora_a'}")
        try:
            hf_name = hf_name_for_gguf(base_name, family)
        except ModelLoadError:
            hf_name = base_name
        a, b = pair["lora_a"], pair["lora_b"]
        for t in (a, b):
            if t.tensor_type not in GGUF_LORA_TYPES or len(t.shape) != 2:
                raise LoraError(f"adapter {path}: tensor {t.name!r} is a {len(t.shape)}-D "
                                f"{t.tensor_type.name}; LoRA matrices are 2-D "
                                f"{', '.join(sorted(q.name for q in GGUF_LORA_TYPES))}")
        # ggml's dims, innermost first: lora_a is [in, r], lora_b [r, out].
        (a_in, a_rank), (b_rank, b_out) = (map(int, a.shape), map(int, b.shape))
        if a_rank != b_rank:
            raise LoraError(f"adapter {path}: {base_name!r} has lora_a of rank {a_rank} and "
                            f"lora_b of rank {b_rank}")
        key = served_module(path, hf_name.removesuffix(".weight"), a_in, b_out, a_rank,
                            weight_shapes)
        if not 0 < a_rank <= max_rank:
            raise LoraError(f"adapter {path}: rank {a_rank} is above max_lora_rank {max_rank}")
        pairs[key] = (hf_name, a, b)
    if not pairs:
        raise LoraError(f"adapter {path} holds no LoRA matrices")
    return float(file.metadata.get(Keys.Adapter.LORA_ALPHA, 0.0)), pairs


def load_gguf_adapter(path: str | Path, max_rank: int, spec: ModelSpec) -> LoraAdapter:
    """A GGUF LoRA file's weights (see `gguf_adapter_tensors` for what is refused), dequantized;
    the scale is llama.cpp's, alpha / r (1 where alpha is 0 or absent)."""
    alpha, pairs = gguf_adapter_tensors(path, max_rank, spec)
    fix = family_of(spec).gguf_fix
    adapter = LoraAdapter(max(int(a.shape[1]) for _, a, _ in pairs.values()))
    for key, (hf_name, a, b) in pairs.items():
        rank = int(a.shape[1])
        a_rows = dequantize(a.data, a.tensor_type).reshape(rank, -1)
        b_rows = dequantize(b.data, b.tensor_type).reshape(-1, rank)
        if fix is not None:  # B's rows are the base weight's: llama.cpp permuted q/k alike
            b_rows = fix(hf_name, b_rows, spec, True)
        scale = alpha / rank if alpha else 1.0
        adapter.weights[key] = (torch.from_numpy(np.ascontiguousarray(a_rows.T, np.float32)),
                                torch.from_numpy(np.ascontiguousarray(b_rows.T * scale,
                                                                      np.float32)))
    return adapter


class LoraLinear:
    """A base layer plus, per slot, its parts' A stacked along the rank axis [in, parts·R] and
    B block-diagonal [parts·R, out] (zeros where a part or a slot has no adapter)."""

    def __init__(self, base: Linear | QuantizedLinear, part_sizes: list[int], in_features: int,
                 max_loras: int, max_rank: int, dtype: torch.dtype, batch: LoraBatch) -> None:
        self.base = base
        self.batch = batch
        self.max_rank = max_rank
        self.offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes) + 1)]
        width = len(part_sizes) * max_rank
        self.a = torch.zeros(max_loras, in_features, width, dtype=dtype)
        self.b = torch.zeros(max_loras, width, self.offsets[-1], dtype=dtype)

    def __getattr__(self, name: str):  # sizes, bytes, max_gemv_rows: the base layer's
        return getattr(self.base, name)

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        for i, ab in enumerate(parts):
            if ab is None:
                continue
            a, b = ab
            r, ranks = a.shape[1], slice(i * self.max_rank, i * self.max_rank + a.shape[1])
            self.a[slot, :, ranks] = a.to(self.a.dtype)
            self.b[slot, ranks, self.offsets[i]:self.offsets[i] + b.shape[1]] = \
                b[:r].to(self.b.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.batch.native_slots is not None:
            self.batch.kernels.lora_add(y, x.contiguous(), self.a, self.b,
                                        self.batch.native_slots, self.offsets, self.max_rank)
        for slot, rows in self.batch.segments:
            a, b = self.a[slot].to(x.dtype), self.b[slot].to(x.dtype)  # --lora-dtype's
            if isinstance(rows, slice):  # one run of rows: views, added in place
                low, out = x[rows] @ a, y[rows]
                # Part by part: B's off-diagonal blocks are zeros.
                for p, (start, end) in enumerate(itertools.pairwise(self.offsets)):
                    ranks = slice(p * self.max_rank, (p + 1) * self.max_rank)
                    out[:, start:end].addmm_(low[:, ranks], b[ranks, start:end])
            else:
                y = y.index_add(0, rows, (x[rows] @ a) @ b)
        return y


class LoraSlots:
    """The runner's adapters: loaded ones kept by id (at most `max_cpu_loras`, least recently
    used dropped), up to `max_loras` of them in the layers' slots. A slot holds a copy of its
    adapter's weights, so dropping the loaded adapter leaves its slot valid."""

    def __init__(self, spec: ModelSpec, layers: list[dict], max_loras: int, max_rank: int,
                 max_cpu_loras: int, dtype: torch.dtype) -> None:
        self.spec = spec
        self.batch = LoraBatch()
        self.dtype = dtype
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.layers: list[dict[str, LoraLinear]] = []
        for layer in layers:
            wrapped = {}
            for name, (part_sizes, in_features) in layer_shapes(spec).items():
                base = layer.get(name)
                if base is None:  # a mixture of experts' feed-forward: not targeted
                    continue
                if type(base) not in (Linear, QuantizedLinear):
                    raise LoraError("LoRA serves plain linear layers only (no tensor "
                                    "parallelism)")
                wrapped[name] = layer[name] = LoraLinear(
                    base, part_sizes, in_features, max_loras, max_rank, dtype, self.batch)
            self.layers.append(wrapped)
        self.adapters: OrderedDict[int, LoraAdapter] = OrderedDict()
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id → slot, LRU first
        # Cold adapters load on this thread while steps run (one at a time: one disk read).
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self.loading: tuple[int, Future] | None = None

    def ready(self, lora_id: int, path: str) -> bool:
        """Whether the adapter can join the next step without loading in it; if not, its load
        starts in the background (when none is under way) and a later call says True."""
        if lora_id in self.slot_of or lora_id in self.adapters:
            return True
        if self.loading is not None and self.loading[1].done():
            loaded_id, future = self.loading
            self.loading = None
            if future.exception() is None:
                self._keep(loaded_id, future.result())
            if loaded_id == lora_id:  # failed: the step that takes it loads again, and fails
                return True
        if self.loading is None:
            self.loading = (lora_id, self.loader.submit(load_adapter, path, self.max_rank,
                                                        self.spec))
        return False

    def _keep(self, lora_id: int, adapter: LoraAdapter) -> None:
        self.adapters[lora_id] = adapter
        if len(self.adapters) > self.max_cpu_loras:
            self.adapters.popitem(last=False)

    def adapter(self, lora_id: int, path: str) -> LoraAdapter:
        if lora_id not in self.adapters:
            self._keep(lora_id, load_adapter(path, self.max_rank, self.spec))
        self.adapters.move_to_end(lora_id)
        return self.adapters[lora_id]

    def slot(self, lora_id: int, path: str, in_step: set[int]) -> int:
        """The adapter's slot, loading it into one not used this step if it has none."""
        if lora_id in self.slot_of:
            self.slot_of.move_to_end(lora_id)
            if lora_id in self.adapters:
                self.adapters.move_to_end(lora_id)
            return self.slot_of[lora_id]
        adapter = self.adapter(lora_id, path)
        free = set(range(self.max_loras)) - set(self.slot_of.values())
        if free:
            slot = min(free)
        else:
            victim = next((i for i in self.slot_of if i not in in_step), None)
            if victim is None:
                raise LoraError(f"a step may use at most max_loras={self.max_loras} adapters")
            slot = self.slot_of.pop(victim)
        for i, wrapped in enumerate(self.layers):
            for name, layer in wrapped.items():
                modules = [m for m, (n, _) in MODULE_LAYERS.items() if n == name]
                layer.set_slot(slot, [adapter.weights.get((i, m)) for m in modules])
        self.slot_of[lora_id] = slot
        return slot

    def set_rows(self, row_adapters: list[tuple[int, str] | None], device: torch.device) -> None:
        """This step's segments: each token row's adapter (id, path), None for the base."""
        ids = {a[0]: a[1] for a in row_adapters if a is not None}
        native = (self.batch.kernels is not None and device.type == "cpu"
                  and self.dtype in (torch.float32, torch.bfloat16))
        segments, slots, native_slots = [], {}, [-1] * len(row_adapters)
        for lora_id, path in ids.items():
            slot = slots[lora_id] = self.slot(lora_id, path, set(ids))
            rows = [i for i, a in enumerate(row_adapters) if a is not None and a[0] == lora_id]
            rest = []  # rows outside runs longer than NATIVE_MAX_ROWS (prefill chunks)
            for run in runs(rows):
                if len(run) > NATIVE_MAX_ROWS:
                    segments.append((slot, slice(run[0], run[-1] + 1)))
                else:
                    rest += run
            if not rest:
                continue
            if native and len(rest) <= NATIVE_MAX_ROWS:
                for i in rest:
                    native_slots[i] = slot
            elif rest[-1] - rest[0] + 1 == len(rest):
                segments.append((slot, slice(rest[0], rest[-1] + 1)))
            else:
                segments.append((slot, torch.tensor(rest, dtype=torch.long, device=device)))
        self.batch.segments = segments
        self.batch.native_slots = (torch.tensor(native_slots, dtype=torch.long)
                                   if max(native_slots, default=-1) >= 0 else None)
        self.batch.row_slots = None if not ids else torch.tensor(
            [-1 if a is None else slots[a[0]] for a in row_adapters], dtype=torch.long)


def runs(rows: list[int]) -> list[list[int]]:
    """Sorted row indices split where they skip one: each run a slice of the step's rows."""
    if not rows:
        return []
    split = [i for i in range(1, len(rows)) if rows[i] != rows[i - 1] + 1]
    return [rows[start:end] for start, end in zip([0, *split], [*split, len(rows)], strict=True)]


def layer_shapes(spec: ModelSpec) -> dict[str, tuple[list[int], int]]:
    """Each fused layer's parts' output sizes and its input size."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    hidden, inter = spec.hidden_size, spec.intermediate_size
    return {"qkv": ([q, kv, kv], hidden), "o": ([hidden], q),
            "gate_up": ([inter, inter], hidden), "down": ([hidden], inter)}
