"""A lean GGUF reader: tensor infos and data, and the scalar metadata (arrays: their keys only).

`gguf.GGUFReader` parses every metadata value into numpy parts, including tokenizer vocabularies
of hundreds of thousands of strings, which takes tens of seconds for a model like Gemma 3
(262k tokens). Loading weights needs only the tensors and a scalar or two, so here arrays are
skipped (strings by walking their lengths, fixed-size items by count × size) and tensor data is
a view into one memmap of the file, shaped as `gguf.GGUFReader` shapes it, so that
`gguf.quants.dequantize(t.data, t.tensor_type)` works on either.

Torch-free; little-endian GGUF v2 and v3 only (what llama.cpp writes on every common host).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFType,
    GGUFValueType,
    Keys,
)
from gguf.quants import quant_shape_to_byte_shape

from treadle.model.source import ModelLoadError

SUPPORTED_VERSIONS = (2, 3)

# Scalar value types, little-endian.
_SCALARS: dict[GGUFValueType, struct.Struct] = {t: struct.Struct(f) for t, f in {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}.items()}

# Tensor types whose data gguf's reader exposes as elements; all others as uint8 rows of blocks.
_ELEMENT_DTYPES: dict[GGMLQuantizationType, type[np.generic]] = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # uint64 dims as stored (innermost first), like gguf's ReaderTensor.shape
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # a view of the file's memmap, shaped like gguf's ReaderTensor.data


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]  # scalar and string values; arrays are skipped
    array_keys: frozenset[str]  # the skipped arrays' keys: what a file holds, if not its values
    tensors: list[GGUFTensor]
    alignment: int
    data_offset: int


class _Cursor:
    """Reads little-endian values from `buf`; any read past its end raises ModelLoadError."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{str(self.path)!r} is not a valid GGUF file: {what}")

    def unpack(self, fmt: struct.Struct) -> Any:
        try:
            (value,) = fmt.unpack_from(self.buf, self.pos)
        except struct.error:
            raise self.fail(f"truncated at byte {self.pos}") from None
        self.pos += fmt.size
        return value

    def skip(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise self.fail(f"truncated at byte {self.pos}")
        self.pos += n

    def string(self) -> str:
        n = self.unpack(_U64)
        start = self.pos
        self.skip(n)
        try:
            return str(self.buf[start:start + n], "utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"invalid UTF-8 string at byte {start}") from None

    def skip_strings(self, count: int) -> None:
        # A vocabulary has ~10^5 strings: walk the lengths only, never building the strings.
        buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
        try:
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
        except struct.error:
            raise self.fail(f"truncated at byte {pos}") from None
        if pos > len(buf):
            raise self.fail(f"truncated at byte {len(buf)}")
        self.pos = pos

    def value_type(self) -> GGUFValueType:
        raw = self.unpack(_U32)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.fail(f"unknown value type {raw} at byte {self.pos - 4}") from None

    def value(self, vtype: GGUFValueType) -> Any:
        """The value of a scalar or string; for an array, skips it and returns None."""
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype != GGUFValueType.ARRAY:
            return self.unpack(_SCALARS[vtype])
        item_type, count = self.value_type(), self.unpack(_U64)
        if item_type == GGUFValueType.STRING:
            self.skip_strings(count)
        elif item_type == GGUFValueType.ARRAY:
            for _ in range(count):  # nested arrays: rare and short
                self.value(GGUFValueType.ARRAY)
        else:
            self.skip(count * _SCALARS[item_type].size)
        return None


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse `path`'s header, scalar metadata and tensor infos; tensor data stays on disk
    (memory-mapped). Raises ModelLoadError for a file that is not a readable GGUF."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ModelLoadError(f"cannot read {str(path)!r}: {e}") from e
    if size < 24:  # magic, version, tensor count, kv count
        raise ModelLoadError(f"{str(path)!r} is not a valid GGUF file: only {size} bytes")
    # Copy-on-write: the tensors' pages are the file's (served in place, shared with the page
    # cache) and writable as numpy and torch want them; nothing writes to them.
    file = np.memmap(path, dtype=np.uint8, mode="c")
    cur = _Cursor(memoryview(file), path)

    if cur.unpack(_U32) != GGUF_MAGIC:
        raise cur.fail("bad magic (expected b'GGUF')")
    version = cur.unpack(_U32)
    if version not in SUPPORTED_VERSIONS:
        raise cur.fail(f"version {version} (supported: little-endian "
                       f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
    tensor_count, kv_count = cur.unpack(_U64), cur.unpack(_U64)

    metadata: dict[str, Any] = {}
    array_keys = set()
    for _ in range(kv_count):
        key = cur.string()
        vtype = cur.value_type()
        value = cur.value(vtype)
        if vtype == GGUFValueType.ARRAY:
            array_keys.add(key)
        else:
            metadata[key] = value

    infos = []
    for _ in range(tensor_count):
        name = cur.string()
        n_dims = cur.unpack(_U32)
        start = cur.pos
        cur.skip(8 * n_dims)
        dims = np.frombuffer(cur.buf, dtype="<u8", count=n_dims, offset=start)
        raw_type = cur.unpack(_U32)
        offset = cur.unpack(_U64)
        try:
            ttype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise cur.fail(f"tensor {name!r} has unknown type {raw_type}") from None
        infos.append((name, dims, ttype, offset))

    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment

    tensors = []
    seen: set[str] = set()
    for name, dims, ttype, offset in infos:
        if name in seen:
            raise cur.fail(f"tensor {name!r} appears twice")
        seen.add(name)
        n_elements = int(np.prod(dims))
        block_size, type_size = GGML_QUANT_SIZES[ttype]
        n_bytes = n_elements * type_size // block_size
        begin = data_start + offset
        if begin + n_bytes > size:
            raise cur.fail(f"tensor {name!r} ends at byte {begin + n_bytes}, past the end "
                           f"of the file ({size} bytes)")
        np_shape = tuple(int(d) for d in reversed(dims.tolist()))
        dtype = _ELEMENT_DTYPES.get(ttype)
        if dtype is None:
            try:
                np_shape = quant_shape_to_byte_shape(np_shape, ttype)
            except ValueError as e:
                raise cur.fail(f"tensor {name!r}: {e}") from None
            dtype = np.uint8
        data = file[begin:begin + n_bytes].view(dtype).reshape(np_shape)
        tensors.append(GGUFTensor(name, ttype, dims, n_elements, n_bytes, begin, data))
    return GGUFFile(path, version, metadata, frozenset(array_keys), tensors, alignment,
                    data_start)


def is_lora_adapter(file: GGUFFile) -> bool:
    """Whether `file` is a LoRA adapter as llama.cpp marks one (convert_lora_to_gguf.py)."""
    return (file.metadata.get(Keys.General.TYPE) == GGUFType.ADAPTER
            and file.metadata.get(Keys.Adapter.TYPE) == "lora")
