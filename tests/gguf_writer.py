"""A minimal GGUF (v3) writer for tests: llama metadata, F32 and Q8_0 tensors, and the
raw parts (`header`, `kv`, `tensor_info`) to craft broken files with.

Only what the tests need: it writes the files llama.cpp's ``convert_hf_to_gguf`` would
write for a tiny llama checkpoint (names ``blk.{i}.*``, q/k rows permuted, tokenizer in
``tokenizer.ggml.*`` metadata).
"""

import struct

import numpy as np

ALIGN = 32
F32, Q8_0 = 0, 8
U32, I32, F32V, BOOL, STRING, ARRAY, U64, F64V = 4, 5, 6, 7, 8, 9, 10, 12


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(v) -> bytes:
    if isinstance(v, np.float64):  # before float: np.float64 is one
        return struct.pack("<I", F64V) + struct.pack("<d", v)
    if isinstance(v, bool):
        return struct.pack("<I", BOOL) + struct.pack("<?", v)
    if isinstance(v, int):
        return struct.pack("<I", U32) + struct.pack("<I", v)
    if isinstance(v, float):
        return struct.pack("<I", F32V) + struct.pack("<f", v)
    if isinstance(v, str):
        return struct.pack("<I", STRING) + _string(v)
    if isinstance(v, list):
        if all(isinstance(x, str) for x in v):
            body = b"".join(_string(x) for x in v)
            return struct.pack("<IIQ", ARRAY, STRING, len(v)) + body
        body = b"".join(struct.pack("<i", x) for x in v)
        return struct.pack("<IIQ", ARRAY, I32, len(v)) + body
    raise TypeError(type(v))


def q8_0(x: np.ndarray) -> bytes:
    """Q8_0 blocks along rows: fp16 scale + 32 int8 per block."""
    blocks = x.astype(np.float32).reshape(-1, 32)
    d = np.abs(blocks).max(axis=1) / 127.0
    q = np.round(blocks / np.where(d == 0, 1, d)[:, None]).astype(np.int8)
    out = np.zeros(len(blocks), dtype=[("d", "<f2"), ("q", "i1", 32)])
    out["d"], out["q"] = d.astype(np.float16), q
    return out.tobytes()


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row interleaving for rotary embeddings."""
    rows = w.shape[0]
    return (
        w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def tensor_info(name: str, dims, kind: int, offset: int) -> bytes:
    """One tensor's entry in the header: ``dims`` fastest first, as GGUF lists them."""
    return (
        _string(name)
        + struct.pack("<I", len(dims))
        + b"".join(struct.pack("<Q", d) for d in dims)
        + struct.pack("<IQ", kind, offset)
    )


def header(
    n_tensors: int, n_kv: int, kv: bytes = b"", infos: bytes = b"", version: int = 3
) -> bytes:
    """A GGUF header from raw parts, padded to `ALIGN` (counts need not match: tests
    craft broken files with it)."""
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + kv + infos
    return head + b"\0" * (-len(head) % ALIGN)


def kv(key: str, value) -> bytes:
    """One metadata entry (key and typed value) as the header holds it."""
    return _string(key) + _value(value)


def write_gguf(path, metadata: dict, tensors: dict, quantize=()) -> None:
    """Write ``tensors`` (name -> float32 array, row-major); names in ``quantize`` as
    Q8_0."""
    infos, blobs, offset = [], [], 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        kind = Q8_0 if name in quantize else F32
        data = q8_0(arr) if kind == Q8_0 else arr.tobytes()
        dims = list(reversed(arr.shape))  # GGUF lists the fastest dimension first
        infos.append(tensor_info(name, dims, kind, offset))
        pad = -len(data) % ALIGN
        blobs.append(data + b"\0" * pad)
        offset += len(data) + pad
    entries = b"".join(kv(k, v) for k, v in metadata.items())
    with open(path, "wb") as f:
        f.write(header(len(tensors), len(metadata), entries, b"".join(infos)))
        for b in blobs:
            f.write(b)
