"""The host's lexical table: the backbone's ``lm_head.weight`` as raw fp16, row-major, no header.

How it works: docs/modules.md."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np

from .author import read_verified
from ..bundle import atomic_write_json, check_free_space, check_output_path, output_lock, staged_files
from ..errors import IntegrityError, NumericError, OutputError, UsageError
from ..digest import sha256_file
from .pins import Pins
from .safetensors import INDEX_FILE, SINGLE_FILE

TENSOR = "lm_head.weight"
NO_LM_HEAD = "the release ties its embeddings to lm_head or has none; there is no table to write"
TABLE_FILE = "lm_head_fp16.bin"
SIDECAR_FILE = "lm_head_fp16.json"


_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}


def _to_fp16(raw: bytearray, dtype: str) -> np.ndarray:
    """Raw little-endian values -> fp16 with numpy and ml_dtypes (no torch: its libraries alone
    would add ~300 MB of resident pages); out-of-range values become inf, reported by row."""
    if dtype == "BF16":
        import ml_dtypes

        with np.errstate(over="ignore", invalid="ignore"):
            return np.frombuffer(raw, dtype=ml_dtypes.bfloat16).astype(np.float16)
    if dtype == "F16":
        return np.frombuffer(raw, dtype="<f2").astype(np.float16)
    else:
        wide = np.frombuffer(raw, dtype="<f4")
    with np.errstate(over="ignore", invalid="ignore"):
        return wide.astype(np.float16)


def _tensor_location(path: Path) -> tuple[str, int]:
    """dtype and absolute byte offset of ``lm_head.weight``'s data, from the safetensors header."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    info = header[TENSOR]
    if info["dtype"] not in _ITEMSIZE:
        raise IntegrityError(f"{path}: {TENSOR} has dtype {info['dtype']}; expected BF16, F16 or F32")
    return info["dtype"], 8 + n + int(info["data_offsets"][0])


def _pinned(pins: Pins, pins_path: Path, name: str) -> str:
    if name not in pins.files:
        raise IntegrityError(f"{pins_path}: {name} is not pinned; add its sha256 before it can be read")
    return pins.files[name]


def _locate(name: str, source: Path | None, pins: Pins) -> Path:
    if source is not None:
        return Path(source) / name
    if pins.revision is None:
        raise UsageError(f"{pins.hf_id}: a local release; pass --source with its folder")
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(pins.hf_id, name, revision=pins.revision))


def _header(path: Path) -> tuple[list[int], str, int]:
    """Shape, dtype and absolute data offset of ``lm_head.weight``, from the safetensors header
    (checked by the library itself first)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            if TENSOR not in f.keys():
                raise IntegrityError(f"{path}: has no tensor {TENSOR}: {NO_LM_HEAD}")
            shape = list(f.get_slice(TENSOR).get_shape())
    except SafetensorError as exc:
        raise IntegrityError(f"{path}: corrupt safetensors ({exc})") from None
    if len(shape) != 2:
        raise IntegrityError(f"{path}: {TENSOR} has shape {shape}, expected [vocab, hidden]")
    dtype, base = _tensor_location(path)
    return shape, dtype, base


def lm_head_table(source: Path | None, pins: Pins, pins_path: Path, out: Path, *, block_rows: int = 2048,
                  sample_rows: int = 64, overwrite: bool = False, log=lambda msg: None) -> dict[str, Any]:
    """``lm_head.weight`` of the pinned checkpoint as ``out/lm_head_fp16.bin`` with its sidecar.

    Everything that can be checked is checked before a byte is written (pins, the shard's sha256,
    its header, the output folder, free space); both files then land together or not at all
    (``bundle.staged_files``), and a write error names the file."""
    out = Path(out)
    table_path, sidecar_path = out / TABLE_FILE, out / SIDECAR_FILE
    if out.exists() or out.is_symlink():
        for p in (table_path, sidecar_path):
            check_output_path(p, overwrite)
    else:
        check_output_path(out, overwrite=False)
    index_sha = None
    if (pins.release or {}).get("lm_head_file", "") is None:  # `pin` looked, and found no lm_head.weight
        raise IntegrityError(f"{pins_path}: {TENSOR} is in none of the release's checkpoint files: {NO_LM_HEAD}")
    if INDEX_FILE in pins.files or SINGLE_FILE not in pins.files:
        index_sha = _pinned(pins, pins_path, INDEX_FILE)  # before any download: unpinned bytes are never read
        index_path = _locate(INDEX_FILE, source, pins)
        try:
            index = json.loads(read_verified(index_path, index_sha))
            weight_map = index["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise IntegrityError(f"{index_path}: not a safetensors index (no weight_map)") from None
        shard = weight_map.get(TENSOR) if isinstance(weight_map, dict) else None
        if shard is None:
            raise IntegrityError(f"{index_path}: no weight_map entry for {TENSOR}: {NO_LM_HEAD}")
    else:
        shard = SINGLE_FILE  # one checkpoint file, no index (clef-finetune make-tiny)
    shard_sha = _pinned(pins, pins_path, shard)
    shard_path = _locate(shard, source, pins)
    t0 = time.perf_counter()
    actual = sha256_file(shard_path)
    if actual != shard_sha:
        raise IntegrityError(f"{shard_path}: sha256 mismatch (expected {shard_sha[:12]}…, got {actual[:12]}…)")
    t_hash = time.perf_counter() - t0
    (rows, hidden), dtype, base = _header(shard_path)
    size = rows * hidden * 2
    check_free_space(out / TABLE_FILE, size + (64 << 10), "the table")  # the table, its sidecar, a folder entry or two

    digest = hashlib.sha256()
    t0 = time.perf_counter()
    with output_lock(out), staged_files(out, (TABLE_FILE, SIDECAR_FILE), overwrite) as tmp:
        log(f"{TENSOR} [{rows}, {hidden}] {dtype} -> {table_path}")
        try:
            picks = _write_table(shard_path, tmp / TABLE_FILE, rows, hidden, dtype, base, block_rows, sample_rows, digest)
        except OSError as exc:
            raise OutputError(f"{table_path}: cannot write the table ({exc.strerror or exc})") from None
        seconds = time.perf_counter() - t0
        sidecar = {
            "shape": [rows, hidden],
            "dtype": "float16",
            "layout": f"raw fp16, row-major, no header; row t at byte offset t x {hidden * 2}",
            "bytes": size,
            "sha256": digest.hexdigest(),
            "source": {"hf_id": pins.hf_id, "revision": pins.revision, "synthetic": pins.synthetic,
                       "file": shard, "tensor": TENSOR, "sha256": shard_sha, "index_sha256": index_sha},
            "read_back": {"method": "numpy.memmap of the written file vs the shard's rows cast to fp16, bitwise",
                          "rows_checked": len(picks), "ok": True},
        }
        try:
            atomic_write_json(tmp / SIDECAR_FILE, sidecar)
        except OSError as exc:
            raise OutputError(f"{sidecar_path}: cannot write the sidecar ({exc.strerror or exc})") from None
    log(f"{size:,} bytes in {seconds:.1f} s ({size / max(seconds, 1e-9) / 1e9:.2f} GB/s); shard hashed in {t_hash:.1f} s")
    return {**sidecar, "seconds": seconds, "hash_seconds": t_hash, "table": str(table_path)}


def _write_table(shard_path: Path, dest: Path, rows: int, hidden: int, dtype: str, base: int, block_rows: int,
                 sample_rows: int, digest) -> list[int]:
    """The rows cast to fp16, written in blocks and hashed as written, then read back through a
    second path (a memmap of ``dest`` against the shard's rows); returns the rows checked."""
    row_bytes = hidden * _ITEMSIZE[dtype]
    # plain reads of one block at a time: an mmap of the shard would count all 2 GB as resident
    from ..progress import progress

    with open(shard_path, "rb", buffering=0) as src, open(dest, "wb") as fh, \
            progress(f"{TENSOR} -> fp16", rows, "rows") as tick:
        for r0 in range(0, rows, block_rows):
            n = min(block_rows, rows - r0)
            tick(n)
            raw = bytearray(os.pread(src.fileno(), n * row_bytes, base + r0 * row_bytes))
            if len(raw) != n * row_bytes:
                raise IntegrityError(f"{shard_path}: truncated at row {r0}")
            half = _to_fp16(raw, dtype).reshape(n, hidden)
            bad = ~np.isfinite(half).all(axis=1)
            if bool(bad.any()):
                row = r0 + int(np.flatnonzero(bad)[0])
                raise NumericError(f"{shard_path}: {TENSOR} row {row} does not fit fp16 (|x| > 65504 or not finite)")
            data = half.tobytes()
            digest.update(data)
            fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    mm = np.memmap(dest, dtype=np.float16, mode="r", shape=(rows, hidden))
    rng = np.random.default_rng(0)
    picks = sorted({0, rows - 1, *rng.integers(0, rows, size=max(0, sample_rows - 2)).tolist()})
    with open(shard_path, "rb", buffering=0) as src:
        for r in picks:
            want = _to_fp16(bytearray(os.pread(src.fileno(), row_bytes, base + r * row_bytes)), dtype)
            if not np.array_equal(mm[r].view(np.uint16), want.view(np.uint16)):
                raise IntegrityError(f"{dest}: read-back of row {r} differs from {shard_path}")
    del mm
    return picks


def open_table(path: Path) -> np.memmap:
    """The table as a read-only ``numpy.memmap``, shaped from its sidecar."""
    path = Path(path)
    meta = json.loads((path.parent / SIDECAR_FILE).read_text())
    return np.memmap(path, dtype=np.float16, mode="r", shape=tuple(meta["shape"]))
