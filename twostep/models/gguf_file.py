"""A GGUF file's metadata and tensor table, read in one pass over a memory map.

The gguf package's GGUFReader builds two numpy views per string of every array it meets: a
49,152-token vocabulary and its merges cost ~6 s before the first weight is touched. This reads the
same format (the gguf package's constants: value types, quantization types and their block sizes)
with struct from one memory map. An array of strings is walked (each length read, to find the next
field) and its strings decoded only when asked for (StringArray): a start-up with the tokenizer
already converted and cached reads a handful of the vocabulary, so the header of the default model
(49,152 tokens and 48,900 merges) takes ~0.05 s, against ~0.17 s decoding every string (a Zen 1;
Qwen2.5's 152k + 151k: ~0.1 s against ~0.5 s). Tensor data are numpy views of the map, as
GGUFReader's: nothing is read until used.
"""
from __future__ import annotations

import hashlib
import mmap
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_SCALARS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
            GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
            GGUFValueType.FLOAT32: "f", GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
            GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?"}
_PLAIN_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]          # ggml order: the fastest-moving dimension first
    n_elements: int
    n_bytes: int
    data: np.ndarray                # a view of the file: plain types as their dtype, blocks as uint8 rows


class StringArray(Sequence):
    """A metadata array of strings, each decoded from the file when asked for; equal to the list of
    the same strings. It reads the file's memory map: list() it to keep, pickle or serialise it."""

    def __init__(self, data: mmap.mmap, starts: list[int]) -> None:
        self._data, self._starts = data, starts      # starts: each string's length field

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self._decode(self._starts[index])

    def __iter__(self) -> Iterator[str]:
        return (self._decode(start) for start in self._starts)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (list, StringArray)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"

    def _decode(self, start: int) -> str:
        n = int.from_bytes(self._data[start:start + 8], "little")
        return self._data[start + 8:start + 8 + n].decode("utf-8", errors="replace")


class GGUFFile:
    """fields: metadata key -> Python value (arrays as lists, of strings as StringArray); tensors:
    the tensor table in file order."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._unpack("<I") != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_fields = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            if key in self.fields:
                raise ValueError(f"duplicate metadata key {key!r}")
            self.fields[key] = self._value(GGUFValueType(self._unpack("<I")))
        self._metadata_end = self._pos
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = int(self.fields.get("general.alignment", 32))
        start = (self._pos + alignment - 1) // alignment * alignment
        buffer = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors = [self._tensor(buffer, start, *info) for info in infos]
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("duplicate tensor names")

    def metadata_digest(self) -> str:
        """A hash of the header and metadata bytes (vocabulary, merges, chat template, ...): the key
        under which what is derived from them (the converted tokenizer) can be cached."""
        return hashlib.sha256(self._map[:self._metadata_end]).hexdigest()[:32]

    def _unpack(self, fmt: str) -> Any:
        if self._pos + struct.calcsize(fmt) > len(self._map):
            raise ValueError("the metadata runs past the end of the file")
        value, = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        if self._pos + n > len(self._map):
            raise ValueError("a string runs past the end of the file")
        text = self._map[self._pos:self._pos + n].decode("utf-8", errors="replace")
        self._pos += n
        return text

    def _strings(self, count: int) -> StringArray:
        """An array of strings (a vocabulary, its merges): where each starts, in one tight loop."""
        m, pos, end, starts, unpack = self._map, self._pos, len(self._map), [], struct.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise ValueError("a string runs past the end of the file")
            n, = unpack("<Q", m, pos)
            starts.append(pos)
            pos += 8 + n
            if pos > end:
                raise ValueError("a string runs past the end of the file")
        self._pos = pos
        return StringArray(m, starts)

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind == GGUFValueType.ARRAY:
            item, count = GGUFValueType(self._unpack("<I")), self._unpack("<Q")
            if item in _SCALARS:                    # one unpack for the whole array
                fmt = f"<{count}{_SCALARS[item]}"
                if self._pos + struct.calcsize(fmt) > len(self._map):
                    raise ValueError("an array runs past the end of the file")
                values = list(struct.unpack_from(fmt, self._map, self._pos))
                self._pos += struct.calcsize(fmt)
                return values
            if item == GGUFValueType.STRING:
                return self._strings(count)
            return [self._value(item) for _ in range(count)]
        if kind in _SCALARS:
            return self._unpack("<" + _SCALARS[kind])
        raise ValueError(f"unknown GGUF value type {kind}")

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
        return name, dims, GGMLQuantizationType(self._unpack("<I")), self._unpack("<Q")

    def _tensor(self, buffer: np.ndarray, start: int, name: str, dims: tuple[int, ...],
                kind: GGMLQuantizationType, offset: int) -> GGUFTensor:
        n_elements = int(np.prod(dims)) if dims else 1
        block, block_bytes = GGML_QUANT_SIZES[kind]
        n_bytes = n_elements * block_bytes // block
        first = start + offset
        if first + n_bytes > buffer.size:
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        raw = buffer[first:first + n_bytes]
        shape = tuple(reversed(dims))
        if kind in _PLAIN_DTYPES:
            data = raw.view(_PLAIN_DTYPES[kind]).reshape(shape)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(shape, kind))
        return GGUFTensor(name, kind, dims, n_elements, n_bytes, data)


REQUIRED = object()


def metadata_field(reader: GGUFFile, key: str, path: str, default: Any = REQUIRED) -> Any:
    """A metadata value as a Python object; a missing required key is a malformed file."""
    value = reader.fields.get(key)
    if value is not None:
        return value
    if default is REQUIRED:
        raise ValueError(f"{path}: GGUF metadata lacks required key {key!r}")
    return default
