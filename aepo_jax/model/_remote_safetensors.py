"""A safetensors file in a bucket (gs://), read in place: its header, then one ranged read per tensor (or per block
of its rows), so nothing lands on local disk and a host holds only what it asked for (`_hf_io.load_hf`)."""

from __future__ import annotations

import json
import math
import struct
from typing import Optional

import ml_dtypes
import numpy as np

# The safetensors dtypes and their numpy types (bfloat16 and float8 from ml_dtypes, as jax has them).
_DTYPES = {
  "F64": np.float64,
  "F32": np.float32,
  "F16": np.float16,
  "BF16": ml_dtypes.bfloat16,
  "F8_E4M3": ml_dtypes.float8_e4m3fn,
  "F8_E5M2": ml_dtypes.float8_e5m2,
  "I64": np.int64,
  "I32": np.int32,
  "I16": np.int16,
  "I8": np.int8,
  "U64": np.uint64,
  "U32": np.uint32,
  "U16": np.uint16,
  "U8": np.uint8,
  "BOOL": np.bool_,
}
_MAX_HEADER = 100_000_000  # bytes; safetensors refuses larger headers too


class RemoteSafetensors:
  """A safetensors file in a bucket, read in place: its header when opened, then one ranged read per tensor, so
  the host never holds more than the tensor asked for and nothing lands on local disk. Format: an 8-byte
  little-endian header length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}} (offsets from the
  end of the header), then the data. Offers `keys`, `shape` and `get_tensor`, as `_Reader` uses them."""

  def __init__(self, fname: str):
    import fsspec

    self.fname = fname
    try:
      self._fs, self._path = fsspec.core.url_to_fs(fname)
      size = self._fs.size(self._path)
    except OSError as e:
      self._bad(str(e))
    if size < 8:
      self._bad(f"truncated: {size} bytes, less than the 8-byte header length")
    (n,) = struct.unpack("<Q", self._read(0, 8))
    if n > min(size - 8, _MAX_HEADER):
      self._bad(f"header length {n} does not fit the file's {size} bytes; truncated or not safetensors")
    try:
      header = json.loads(self._read(8, 8 + n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      self._bad(f"its header is not JSON: {e}")
    if not isinstance(header, dict):
      self._bad("its header is not a JSON object")
    header.pop("__metadata__", None)
    self._start, self._tensors, data_end = 8 + n, {}, 0
    for name, info in header.items():
      try:
        dtype = np.dtype(_DTYPES[info["dtype"]])
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
      except (KeyError, TypeError, ValueError):
        self._bad(f"header entry {name!r} is not {{dtype, shape, data_offsets}} of a known dtype: {info}")
      if not 0 <= begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
        self._bad(f"tensor {name!r}: data_offsets {[begin, end]} do not fit {info['dtype']} {list(shape)}")
      self._tensors[name] = (dtype, shape, begin, end)
      data_end = max(data_end, end)
    if self._start + data_end > size:
      self._bad(f"truncated: its header needs {self._start + data_end} bytes, the file has {size}")

  def _bad(self, why: str):
    raise ValueError(f"load_hf: {self.fname} is not a readable safetensors file ({why}); re-download or re-export it.")

  def _read(self, start: int, end: int) -> bytes:
    try:
      data = self._fs.cat_file(self._path, start=start, end=end)
    except OSError as e:
      raise ValueError(f"load_hf: could not read bytes {start}:{end} of {self.fname} ({e}).") from None
    if len(data) != end - start:
      self._bad(f"truncated: bytes {start}:{end} gave {len(data)}")
    return data

  def keys(self):
    return list(self._tensors)

  def shape(self, name: str) -> tuple:
    if name not in self._tensors:
      raise KeyError(f"load_hf: tensor {name!r} is missing from {self.fname} (its header does not list it).")
    return self._tensors[name][1]

  def get_tensor(self, name: str, rows: Optional[tuple] = None) -> np.ndarray:
    """The tensor, or only its rows [lo, hi) along axis 0 (one contiguous byte range either way)."""
    self.shape(name)
    dtype, shape, begin, end = self._tensors[name]
    if rows is not None:
      row_bytes = math.prod(shape[1:]) * dtype.itemsize
      begin, end, shape = begin + rows[0] * row_bytes, begin + rows[1] * row_bytes, (rows[1] - rows[0],) + shape[1:]
    return np.frombuffer(self._read(self._start + begin, self._start + end), dtype).reshape(shape)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return None
