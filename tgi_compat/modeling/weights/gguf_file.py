"""A lean GGUF (v2/v3) reader: metadata and tensor locations in milliseconds.

gguf.GGUFReader builds a numpy view for every one of the ~150k tokenizer strings, which takes
3-15 s on a small model; we only walk past the big arrays. Tensor bytes stay memory-mapped, and
the gguf package still supplies the quantization tables and the reference dequantizer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_SCALARS = {  # GGUF value type -> struct format
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9
# Arrays longer than this are skipped (tokenizer vocab/merges); the tokenizer reads them itself.
_MAX_ARRAY_LEN = 1024


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    type_name: str  # GGMLQuantizationType name: F32, Q4_1, ...
    shape: tuple[int, ...]  # torch order (GGUF stores dims fastest-first)
    data: np.ndarray  # raw bytes, memory-mapped


class GGUFFile:
    def __init__(self, path: str):
        self.path = path
        self._buf = np.memmap(path, dtype=np.uint8, mode="r")
        self._pos = 0
        if bytes(self._buf[:4]) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        self._pos = 4
        version = self._scalar(4)
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version} in {path}")
        num_tensors, num_fields = self._scalar(10), self._scalar(10)
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            value = self._value(self._scalar(4))
            if value is not _SKIPPED:
                self.fields[key] = value
        self.tensors = self._tensor_infos(num_tensors)

    def _tensor_infos(self, num_tensors: int) -> list[GGUFTensorInfo]:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        raw = []
        for _ in range(num_tensors):
            name = self._string()
            dims = [self._scalar(10) for _ in range(self._scalar(4))]
            raw.append((name, GGMLQuantizationType(self._scalar(4)), dims, self._scalar(10)))
        alignment = int(self.fields.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        tensors = []
        for name, qtype, dims, offset in raw:
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            num_bytes = int(np.prod(dims)) // block_size * type_size
            start = data_start + offset
            shape = tuple(reversed(dims))
            tensors.append(GGUFTensorInfo(name, qtype.name, shape, self._buf[start : start + num_bytes]))
        return tensors

    def _scalar(self, value_type: int) -> Any:
        fmt = _SCALARS[value_type]
        (value,) = struct.unpack_from(fmt, self._buf.data, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar(10)
        text = bytes(self._buf[self._pos : self._pos + length]).decode("utf-8", errors="replace")
        self._pos += length
        return text

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type != _ARRAY:
            return self._scalar(value_type)
        item_type, count = self._scalar(4), self._scalar(10)
        if item_type == _STRING:
            if count > _MAX_ARRAY_LEN:
                for _ in range(count):  # walk past without decoding
                    self._pos += 8 + struct.unpack_from("<Q", self._buf.data, self._pos)[0]
                return _SKIPPED
            return [self._string() for _ in range(count)]
        if item_type == _ARRAY:
            return [self._value(_ARRAY) for _ in range(count)]
        itemsize = np.dtype(_NUMPY[item_type]).itemsize
        start, self._pos = self._pos, self._pos + count * itemsize
        if count > _MAX_ARRAY_LEN:
            return _SKIPPED
        return np.frombuffer(self._buf[start : self._pos].tobytes(), dtype=_NUMPY[item_type]).tolist()


_SKIPPED = object()
