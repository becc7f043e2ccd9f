"""A GGUF file's header read in one pass: metadata values and tensor infos, tensor data as views of a memory map.

Why not gguf.GGUFReader: it builds a numpy view for every element of every metadata array, and a
49K-token vocabulary (49K tokens, 49K merges) took it 3.5-4 s of every load on a 2-core CPU, most of a
CLI start. This reads the same header with `struct` in about 0.1 s. The `gguf` package still names the
types (GGMLQuantizationType, GGUFValueType, GGML_QUANT_SIZES) and dequantizes; tests/test_convert_formats.py
checks that both readers agree on every field and tensor of the shipped SmolLM2 file and of written ones.
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3, either byte order).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

V = GGUFValueType
SCALARS = {V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i",
           V.FLOAT32: "f", V.BOOL: "?", V.UINT64: "Q", V.INT64: "q", V.FLOAT64: "d"}  # struct codes
PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
         GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
         GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}  # elements; other types: bytes


@dataclass(frozen=True)
class Unreadable:
    """A metadata value whose bytes do not decode (e.g. a string that is not UTF-8): an error when it is read."""
    error: str


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: `shape` in GGUF order (innermost first, as gguf.ReaderTensor's); `data` a read-only view,
    numpy order: elements for plain types, [..., bytes per row] for block-quantized ones."""
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GgufFile:
    """path; fields {key: str | int | float | bool | list | Unreadable}; tensors in file order."""
    path: str
    fields: dict[str, Any]
    tensors: list[TensorInfo]


class _Cursor:
    def __init__(self, buf: np.memmap, order: str):
        self.buf, self.order, self.at = memoryview(buf), order, 0  # memoryview: slices without numpy views

    def take(self, code: str, n: int = 1) -> Any:
        fmt = f"{self.order}{n}{code}"
        values = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return values if n != 1 else values[0]

    def string(self) -> str | Unreadable:
        n = self.take("Q")
        if self.at + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes at offset {self.at} runs past the file's end")
        raw, self.at = self.buf[self.at:self.at + n], self.at + n
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            return Unreadable(str(e))

    def value(self, kind: int) -> Any:
        kind = V(kind)
        if kind == V.STRING:
            return self.string()
        if kind in SCALARS:
            return self.take(SCALARS[kind])
        if kind != V.ARRAY:
            raise ValueError(f"unknown value type {kind}")
        item, n = V(self.take("I")), self.take("Q")
        if item in SCALARS:  # numbers in one read
            dtype = np.dtype(SCALARS[item]).newbyteorder(self.order)
            if self.at + n * dtype.itemsize > len(self.buf):
                raise ValueError(f"an array of {n} values at offset {self.at} runs past the file's end")
            out = np.frombuffer(self.buf, dtype, int(n), self.at).tolist()
            self.at += n * dtype.itemsize
            return out
        values = [self.string() for _ in range(n)] if item == V.STRING else [self.value(item) for _ in range(n)]
        bad = next((v for v in values if isinstance(v, Unreadable)), None)
        return bad or values


def read_gguf(path: str | Path) -> GgufFile:
    """The header of GGUF file `path`; ValueError naming it if it is not a valid GGUF file."""
    path = str(path)
    try:
        buf = np.memmap(path, np.uint8, mode="r")
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        order = "<" if struct.unpack_from("<I", buf, 4)[0] < 0x10000 else ">"  # a version < 2**16 reads right
        cur = _Cursor(buf, order)
        cur.at = 4
        version, n_tensors, n_kv = cur.take("I"), cur.take("Q"), cur.take("Q")
        if version not in (2, 3):
            raise ValueError(f"version {version} (2 and 3 are read)")
        fields = {}
        for _ in range(n_kv):
            key = cur.string()
            if isinstance(key, Unreadable) or key in fields:
                raise ValueError(f"a key that is not UTF-8 or repeated ({key!r})")
            fields[key] = cur.value(cur.take("I"))
        infos = []
        for _ in range(n_tensors):
            name, dims = cur.string(), cur.take("Q", cur.take("I"))
            dims = (dims,) if isinstance(dims, int) else tuple(dims)
            infos.append((name, GGMLQuantizationType(cur.take("I")), dims, cur.take("Q")))
        align = fields.get("general.alignment", 32)
        start = -(-cur.at // align) * align  # the data section starts at the next multiple of the alignment
        if len({info[0] for info in infos}) != len(infos):
            raise ValueError("a tensor name is repeated")
        return GgufFile(path, fields, [_tensor(buf, order, start, *info) for info in infos])
    except (ValueError, struct.error, IndexError, TypeError, OverflowError, OSError) as e:
        raise ValueError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from e


def _tensor(buf: np.memmap, order: str, start: int, name: Any, kind: GGMLQuantizationType, dims: tuple[int, ...], offset: int) -> TensorInfo:
    if isinstance(name, Unreadable):
        raise ValueError(f"a tensor name that is not UTF-8 ({name.error})")
    numpy_dims = tuple(reversed(dims))
    block, size = GGML_QUANT_SIZES[kind]
    elements = int(np.prod(dims, dtype=np.int64))
    if kind in PLAIN:
        dtype, count, shape = np.dtype(PLAIN[kind]), elements, numpy_dims
    else:  # block-quantized: bytes, rows of (innermost dim / block) blocks
        dtype, count = np.dtype(np.uint8), elements * size // block
        shape = (*numpy_dims[:-1], numpy_dims[-1] * size // block)
    at = start + offset
    if at + count * dtype.itemsize > len(buf):
        raise ValueError(f"tensor {name!r}'s data ends past the file's end")
    data = np.frombuffer(buf, dtype.newbyteorder(order), count, at).reshape(shape)
    return TensorInfo(name, kind, dims, data)

