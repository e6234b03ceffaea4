"""A safetensors file read one tensor at a time through a memory map whose pages are given back after each read.

The `safetensors` package maps the whole file and keeps every page it touched resident until the file is closed,
so converting a checkpoint tensor by tensor ends with the whole checkpoint counted in the process's memory (an
8B bf16 checkpoint: 16 GB). Here each read returns the pages it touched to the page cache
(madvise MADV_DONTNEED: the file's pages stay cached, only this process's mapping lets go), so what is resident
is bounded by the largest tensor, or by a slice of rows where the reader takes a tensor in slices
(loaders.checkpoint.Rows).

The format: 8 bytes little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}} (and an
optional "__metadata__"), then the data, offsets relative to its start.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import numpy as np

# safetensors dtype -> numpy dtype of the stored values (bf16 as its bit pattern: numpy has no bfloat16)
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_MAX_HEADER = 100 << 20  # the reference implementation's own limit


class SafetensorsFormatError(ValueError):
    """The bytes are not a safetensors file (truncated, another format, offsets past the end)."""


class SafetensorsFile:
    """`names` in file order; `shape(name)`; `float32(name, rows)`: a tensor, or rows of it, converted into an array of
    its own."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsFormatError(f"{size} bytes, shorter than the header length")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise SafetensorsFormatError(f"a header of {n} bytes in a file of {size}")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise SafetensorsFormatError(f"the header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise SafetensorsFormatError("the header is not a JSON object")
        header.pop("__metadata__", None)
        self._start = 8 + n
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            self._entries[name] = self._checked(name, entry, size - self._start)
        self.names = list(self._entries)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size > self._start else None

    @staticmethod
    def _checked(name: str, entry, data_bytes: int) -> tuple[np.dtype, tuple[int, ...], int, int]:
        try:
            dtype, shape, (begin, end) = np.dtype(_DTYPES[entry["dtype"]]), tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsFormatError(f"tensor {name}: an unknown dtype or a malformed entry {entry!r}") from None
        count = int(np.prod(shape, dtype=np.int64))
        if not 0 <= begin <= end <= data_bytes or end - begin != count * dtype.itemsize:
            raise SafetensorsFormatError(f"tensor {name}: bytes {begin}..{end} do not hold {shape} of {entry['dtype']}"
                                         f" within the file's {data_bytes} bytes of data")
        return dtype, shape, begin, end

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def float32(self, name: str, rows: slice = slice(None)) -> np.ndarray:
        """Tensor `name` (its `rows` along the first axis) as a float32 array of its own (bf16, f16 and f32
        widened exactly); the pages read are given back before it returns."""
        dtype, shape, begin, end = self._entries[name]
        stored = self._map[self._start + begin:self._start + end].view(dtype).reshape(shape)[rows]
        if dtype == np.uint16:  # bfloat16: the high half of a float32
            out = stored.astype(np.uint32)
            out <<= 16
            out = out.view(np.float32)
        else:
            out = stored.astype(np.float32)
        self.release()
        return out

    def release(self) -> None:
        """Give the pages this process touched back to the page cache (they stay cached: a re-read is cheap)."""
        if self._map is not None:
            self._map._mmap.madvise(mmap.MADV_DONTNEED)  # pylint: disable=protected-access

    def close(self) -> None:
        self._map = None
