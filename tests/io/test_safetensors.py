import json
import struct

import numpy as np
import pytest

from q27py.errors import CheckpointError
from q27py.io.safetensors import SafetensorsFile, bf16_to_f32, f32_to_bf16, write_safetensors


def test_bf16_round_trip_and_rounding():
    x = np.array([1.0, -2.5, 3.1415926, 1e-30, 65504.0, -0.0], dtype=np.float32)
    back = bf16_to_f32(f32_to_bf16(x))
    # bf16 keeps 8 bits of mantissa: relative error <= 2^-9
    assert np.all(np.abs(back - x) <= np.abs(x) * 2.0**-9)
    # exactly representable values survive unchanged
    assert back[0] == 1.0 and back[1] == -2.5
    # round to nearest even at a tie: 1 + 2^-8 lies between 1 and 1 + 2^-7 -> 1
    assert bf16_to_f32(f32_to_bf16(np.array([1 + 2.0**-8], np.float32)))[0] == 1.0
    assert np.isnan(bf16_to_f32(f32_to_bf16(np.array([np.nan], np.float32))))[0]


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
def test_write_then_read(tmp_path, dtype):
    rng = np.random.default_rng(0)
    tensors = {"a.weight": rng.standard_normal((3, 5)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float32),
               "ids": np.arange(4, dtype=np.int64)}
    path = tmp_path / "m.safetensors"
    write_safetensors(path, tensors, dtype=dtype, metadata={"format": "pt"})
    f = SafetensorsFile(path)
    assert set(f.tensors) == set(tensors)
    assert f.metadata == {"format": "pt"}
    tol = {"BF16": 2.0**-8, "F16": 1e-3, "F32": 0}[dtype]
    for name in ("a.weight", "b"):
        got = f.get(name)
        assert got.shape == tensors[name].shape
        assert np.allclose(got, tensors[name], rtol=tol, atol=tol)
    assert np.array_equal(f.raw("ids"), tensors["ids"])
    f.close()


def _write_raw(path, header: dict, data: bytes):
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def test_truncated_file_is_named(tmp_path):
    p = tmp_path / "t.safetensors"
    _write_raw(p, {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    with pytest.raises(CheckpointError, match="'x'.*truncated"):
        SafetensorsFile(p)


def test_shape_and_offsets_must_agree(tmp_path):
    p = tmp_path / "t.safetensors"
    _write_raw(p, {"x": {"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}}, b"\0" * 16)
    with pytest.raises(CheckpointError, match="'x'"):
        SafetensorsFile(p)


def test_garbage_header(tmp_path):
    p = tmp_path / "t.safetensors"
    p.write_bytes(struct.pack("<Q", 10) + b"not json!!")
    with pytest.raises(CheckpointError, match="corrupt"):
        SafetensorsFile(p)
    p.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="truncated"):
        SafetensorsFile(p)
