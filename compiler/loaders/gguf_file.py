"""A GGUF file's metadata and tensor table, read in one pass with struct; tensors are byte views of one memory map.

gguf's GGUFReader makes a numpy view of every metadata part: ~10 s for SmolLM2's 49k-token vocabulary and 49k
merges, on every compile. This reads the same file in well under a second.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# The fixed-size value types of GGUF's metadata (gguf.GGUFValueType): struct format per type id.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands (truncated, another format, an unknown type)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # ggml order: innermost dimension first
    tensor_type: GGMLQuantizationType
    data_offset: int  # from the start of the file
    n_bytes: int
    data: np.ndarray  # uint8 view of the memory map, [outer dims reversed..., bytes per row]; empty if truncated


class GGUFFile:
    """`fields`: metadata key -> value (int, float, bool, str, or a list of them); `tensors`: in file order."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except ValueError as err:  # numpy cannot map an empty file
            raise GGUFFormatError(str(err)) from None
        self._buf = memoryview(self._map)
        self._pos = 0
        if bytes(self._take(4)) != _MAGIC:
            raise GGUFFormatError("no GGUF magic at the start of the file")
        version = self._scalar(4)
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} (only 2 and 3, little-endian, are read)")
        n_tensors, n_fields = self._scalar(10), self._scalar(10)
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar(4))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(name, dims, kind, data_start + offset) for name, dims, kind, offset in infos]

    def release(self) -> None:
        """Give the pages of the map this process touched back to the page cache (MADV_DONTNEED: they stay
        cached, and views into the map stay valid, read again on their next access), so reading tensor by
        tensor keeps about one tensor resident instead of the whole file."""
        self._map._mmap.madvise(mmap.MADV_DONTNEED)  # pylint: disable=protected-access

    def _take(self, n: int) -> memoryview:
        end = self._pos + n
        if end > len(self._buf):
            raise GGUFFormatError(f"the metadata ends past the end of the file (byte {end} of {len(self._buf)})")
        view = self._buf[self._pos:end]
        self._pos = end
        return view

    def _scalar(self, kind: int):
        fmt = _SCALAR.get(kind)
        if fmt is None:
            raise GGUFFormatError(f"unknown metadata value type {kind}")
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return bytes(self._take(self._scalar(10))).decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            return self._scalar(kind)
        item_kind, count = self._scalar(4), self._scalar(10)
        if item_kind == _STRING:
            return [self._string() for _ in range(count)]
        if item_kind == _ARRAY:
            return [self._value(_ARRAY) for _ in range(count)]
        dtype = _NUMPY.get(item_kind)
        if dtype is None:
            raise GGUFFormatError(f"unknown metadata array type {item_kind}")
        width = np.dtype(dtype).itemsize
        return np.frombuffer(self._take(width * count), dtype=dtype).tolist()

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._scalar(10) for _ in range(self._scalar(4)))
        return name, dims, self._scalar(4), self._scalar(10)

    def _tensor(self, name: str, dims: tuple[int, ...], kind: int, offset: int) -> GGUFTensor:
        try:
            tensor_type = GGMLQuantizationType(kind)
            block, type_size = GGML_QUANT_SIZES[tensor_type]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"tensor {name} has an unknown ggml type {kind}") from None
        n_elements = int(np.prod(dims, dtype=np.int64))
        if n_elements % block:
            raise GGUFFormatError(f"tensor {name} has {n_elements} values, not whole {tensor_type.name} blocks")
        n_bytes = n_elements // block * type_size
        data = self._map[offset:offset + n_bytes]
        if data.size == n_bytes:  # a truncated file is reported by the caller, which knows what to advise
            data = data.reshape(tuple(reversed(dims[1:])) + (dims[0] // block * type_size,))
        return GGUFTensor(name, dims, tensor_type, offset, n_bytes, data)
