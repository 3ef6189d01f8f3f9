"""The host's lexical table: the backbone's ``lm_head.weight`` as raw fp16, row-major, no header.

``model.safetensors.index.json`` names the shard that holds ``lm_head.weight``; only that shard is
read (fetched by commit when there is no local source), both files checked against their pins.
The table is written in row blocks (memory stays bounded), hashed as it is written, then checked
through a second path (a ``numpy.memmap`` of the output against the shard's rows). A value that
does not fit fp16 is an error naming its row, never a silent inf.

At the real size: ``[248320, 4096]``, 2,034,237,440 bytes, row t at byte offset t x 8192.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

import numpy as np

from .author import read_verified
from .bundle import atomic_write_json, check_output_path
from .errors import IntegrityError, NumericError
from .pins import Pins, sha256_file

INDEX_FILE = "model.safetensors.index.json"
TENSOR = "lm_head.weight"
TABLE_FILE = "lm_head_fp16.bin"
SIDECAR_FILE = "lm_head_fp16.json"


def _pinned(pins: Pins, pins_path: Path, name: str) -> str:
    if name not in pins.files:
        raise IntegrityError(f"{pins_path}: {name} is not pinned; add its sha256 before it can be read")
    return pins.files[name]


def _locate(name: str, source: Path | None, pins: Pins) -> Path:
    if source is not None:
        return Path(source) / name
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(pins.hf_id, name, revision=pins.revision))


def lm_head_table(source: Path | None, pins: Pins, pins_path: Path, out: Path, *, block_rows: int = 2048,
                  sample_rows: int = 64, overwrite: bool = False, log=lambda msg: None) -> dict[str, Any]:
    from safetensors import SafetensorError, safe_open

    import torch

    out = Path(out)
    table_path, sidecar_path = out / TABLE_FILE, out / SIDECAR_FILE
    out.mkdir(parents=True, exist_ok=True)
    for p in (table_path, sidecar_path):
        check_output_path(p, overwrite)
    index_path = _locate(INDEX_FILE, source, pins)
    index_sha = _pinned(pins, pins_path, INDEX_FILE)
    try:
        index = json.loads(read_verified(index_path, index_sha))
        shard = index["weight_map"][TENSOR]
    except (ValueError, KeyError, TypeError):
        raise IntegrityError(f"{index_path}: no weight_map entry for {TENSOR}") from None
    shard_sha = _pinned(pins, pins_path, shard)
    shard_path = _locate(shard, source, pins)
    t0 = time.perf_counter()
    actual = sha256_file(shard_path)
    if actual != shard_sha:
        raise IntegrityError(f"{shard_path}: sha256 mismatch (expected {shard_sha[:12]}…, got {actual[:12]}…)")
    t_hash = time.perf_counter() - t0

    tmp = table_path.with_name(f".{TABLE_FILE}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    digest = hashlib.sha256()
    t0 = time.perf_counter()
    try:
        with safe_open(str(shard_path), framework="pt") as f:
            if TENSOR not in f.keys():
                raise IntegrityError(f"{shard_path}: has no tensor {TENSOR}")
            sl = f.get_slice(TENSOR)
            shape = list(sl.get_shape())
            if len(shape) != 2:
                raise IntegrityError(f"{shard_path}: {TENSOR} has shape {shape}, expected [vocab, hidden]")
            rows, hidden = shape
            log(f"{TENSOR} [{rows}, {hidden}] {sl.get_dtype()} -> {TABLE_FILE}")
            with open(tmp, "wb") as fh:
                for r0 in range(0, rows, block_rows):
                    block = sl[r0 : min(rows, r0 + block_rows)]
                    half = block.to(torch.float16)
                    bad = ~torch.isfinite(half).all(dim=1)
                    if bool(bad.any()):
                        row = r0 + int(torch.nonzero(bad)[0, 0])
                        raise NumericError(f"{shard_path}: {TENSOR} row {row} does not fit fp16 (|x| > 65504 or not finite)")
                    data = half.numpy().tobytes()
                    digest.update(data)
                    fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            # read back through a second path: a memmap of the file against the shard's rows
            mm = np.memmap(tmp, dtype=np.float16, mode="r", shape=(rows, hidden))
            rng = np.random.default_rng(0)
            picks = sorted({0, rows - 1, *rng.integers(0, rows, size=max(0, sample_rows - 2)).tolist()})
            for r in picks:
                want = sl[r : r + 1].to(torch.float16).numpy()[0]
                if not np.array_equal(mm[r].view(np.uint16), want.view(np.uint16)):
                    raise IntegrityError(f"{tmp}: read-back of row {r} differs from {shard_path}")
            del mm
        os.replace(tmp, table_path)
    except SafetensorError as exc:
        raise IntegrityError(f"{shard_path}: corrupt safetensors ({exc})") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    seconds = time.perf_counter() - t0
    size = table_path.stat().st_size
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
    atomic_write_json(sidecar_path, sidecar)
    log(f"{size:,} bytes in {seconds:.1f} s ({size / max(seconds, 1e-9) / 1e9:.2f} GB/s); shard hashed in {t_hash:.1f} s")
    return {**sidecar, "seconds": seconds, "hash_seconds": t_hash, "table": str(table_path)}


def open_table(path: Path) -> np.memmap:
    """The table as a read-only ``numpy.memmap``, shaped from its sidecar."""
    path = Path(path)
    meta = json.loads((path.parent / SIDECAR_FILE).read_text())
    return np.memmap(path, dtype=np.float16, mode="r", shape=tuple(meta["shape"]))
