"""treadle.model.gguf_file against gguf's own reader, and on broken files."""

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from treadle.model.gguf_file import read_gguf
from treadle.model.source import ModelLoadError, default_model_path

Q = gguf.GGMLQuantizationType


def assert_same_as_gguf(path: Path) -> None:
    ours, theirs = read_gguf(path), gguf.GGUFReader(str(path))
    assert ours.alignment == theirs.alignment
    assert ours.data_offset == theirs.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type, a.name
        assert a.shape.tolist() == b.shape.tolist(), a.name
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes,
                                                            b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert a.data.tobytes() == b.data.tobytes(), a.name
    scalars = {k: f.contents() for k, f in theirs.fields.items()
               if not k.startswith("GGUF.") and f.types[0] != gguf.GGUFValueType.ARRAY}
    assert ours.metadata == scalars


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_token_list(["<s>", "", "héllo", "x" * 300])
    writer.add_array("test.ints", [1, 2, 3])
    writer.add_uint32("test.u32", 7)
    writer.add_float32("test.f32", 0.5)
    writer.add_bool("test.flag", True)
    writer.add_string("test.text", "ünïcode")
    for name, qtype, shape in [("a", Q.F32, (3, 5)), ("b", Q.F16, (7,)), ("c", Q.Q8_0, (4, 64)),
                               ("d", Q.Q4_0, (2, 3, 32)), ("e", Q.F32, (1,))]:
        array = rng.standard_normal(shape).astype(np.float32)
        data = quantize(array, qtype) if qtype != Q.F16 else array.astype(np.float16)
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_gguf_matches_gguf_reader(tiny_gguf: Path) -> None:
    assert_same_as_gguf(tiny_gguf)
    f = read_gguf(tiny_gguf)
    assert f.alignment == 64 and f.data_offset % 64 == 0
    assert f.metadata["test.text"] == "ünïcode" and "tokenizer.ggml.tokens" not in f.metadata
    c = next(t for t in f.tensors if t.name == "c")
    assert dequantize(c.data, c.tensor_type).shape == (4, 64)


@pytest.mark.default_model
def test_default_model_matches_gguf_reader() -> None:
    assert_same_as_gguf(default_model_path())


@pytest.mark.parametrize("cut", [0, 3, 20, 40, 200, None])  # None: inside the last tensor
def test_truncated_file_raises(tiny_gguf: Path, tmp_path: Path, cut: int | None) -> None:
    if cut is None:
        last = read_gguf(tiny_gguf).tensors[-1]
        cut = last.data_offset + last.n_bytes - 1  # the writer pads after it: cut into it
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(tiny_gguf.read_bytes()[:cut])
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        read_gguf(broken)


def test_bad_magic_raises(tiny_gguf: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGML" + tiny_gguf.read_bytes()[4:])
    with pytest.raises(ModelLoadError, match="bad magic"):
        read_gguf(broken)


def test_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="cannot read"):
        read_gguf(tmp_path / "absent.gguf")
