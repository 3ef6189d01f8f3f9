"""``clef-export pin``: write a pins file from what authenticates the bytes, never from trust in
what happens to be on disk.

How it works: docs/modules.md."""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
from pathlib import Path
from typing import Any

from .author import check_author_trusted
from ..bundle import atomic_write_json, check_output_path
from ..digest import sha256_bytes, sha256_file
from ..errors import IntegrityError, UsageError
from .lm_head import INDEX_FILE, SINGLE_FILE, TENSOR as LM_HEAD
from .safetensors import read_header
from ..layout import LICENSE_FILES, PROCESSOR_FILES
from .pins import CODE_FILE, HEAD_FILES, HEX40, Pins
from ..progress import plural

PROVENANCE_FILE = "CLEF_FINETUNE.json"
BACKBONE_CONFIG = "config.json"
# the tokenizer files a backbone bundle ships (those the release has)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json")
# the image processor's configuration, which a vision build reads (the release has it when it has a tower)
TINY_MARKER = "TINY_RANDOM_MODEL.txt"
# what the release record keeps of CLEF_FINETUNE.json
PROVENANCE_KEYS = ("tool", "base_model", "checkpoint", "dtype", "head_dtype", "joint_schema_model_sha256")


def git_blob_sha1(data: bytes) -> str:
    """The id git gives a file's bytes: sha1 of ``blob <size>\\0`` + the bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _safetensors_keys(path: Path) -> set[str]:
    """The tensor names in a safetensors file's header (no tensor data read)."""
    return set(read_header(path)["header"])


def lm_head_shard(index: dict[str, Any] | None, where: str) -> str | None:
    """The shard an index names for ``lm_head.weight``; None when the release ties its embeddings."""
    if index is None:
        return None
    try:
        shard = index["weight_map"].get(LM_HEAD)
    except (AttributeError, KeyError, TypeError):
        raise IntegrityError(f"{where}: no weight_map in {INDEX_FILE}") from None
    if shard is not None and (not isinstance(shard, str) or "/" in shard or shard.startswith(".")):
        raise IntegrityError(f"{where}: {INDEX_FILE} names {shard!r} for {LM_HEAD}")
    return shard


def _name(folder: Path, name: str | None) -> str:
    raw = name if name is not None else folder.resolve().name
    clean = re.sub(r"[^A-Za-z0-9_]+", "_", raw).strip("_")
    if not clean or (name is not None and clean != name):
        raise UsageError(f"--name {raw!r}: letters, digits and _ only")
    return clean


def _write(pins: Pins, out: Path, overwrite: bool) -> Pins:
    check_output_path(out, overwrite)
    atomic_write_json(out, pins.model_dump(mode="json"))
    return pins


# ---------------------------------------------------------------- a local release folder


def pin_local(folder: Path, out: Path | None = None, *, name: str | None = None, trust_author: str | None = None,
              overwrite: bool = False, log=lambda msg: None) -> tuple[Pins, Path]:
    """Pins of a local release folder (default output: ``FOLDER/pins.json``)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"{folder}: release folder not found")
    out = Path(out) if out is not None else folder / "pins.json"
    check_output_path(out, overwrite)  # before hashing gigabytes; checked again right before writing
    release_name = _name(folder, name)
    files: dict[str, str] = {}
    for f in HEAD_FILES:
        if not (folder / f).is_file():
            raise IntegrityError(f"{folder / f}: missing; a release folder holds the head's three files")
        files[f] = sha256_file(folder / f)
    check_author_trusted(folder / CODE_FILE, files[CODE_FILE], trust_author)

    release: dict[str, Any] = {"folder_name": folder.resolve().name, "tiny_random": (folder / TINY_MARKER).is_file()}
    if (folder / PROVENANCE_FILE).is_file():
        files[PROVENANCE_FILE] = sha256_file(folder / PROVENANCE_FILE)
        try:
            facts = json.loads((folder / PROVENANCE_FILE).read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise IntegrityError(f"{folder / PROVENANCE_FILE}: not JSON ({exc})") from None
        release["clef_finetune"] = {k: facts[k] for k in PROVENANCE_KEYS if isinstance(facts, dict) and k in facts}
        said = release["clef_finetune"].get("joint_schema_model_sha256")
        if said is not None and said != files[CODE_FILE]:
            raise IntegrityError(f"{folder / PROVENANCE_FILE}: says joint_schema_model.py has sha256 {str(said)[:12]}…, "
                                 f"the folder's file has {files[CODE_FILE][:12]}…")

    index = None
    if (folder / INDEX_FILE).is_file():
        files[INDEX_FILE] = sha256_file(folder / INDEX_FILE)
        try:
            index = json.loads((folder / INDEX_FILE).read_text(encoding="utf-8"))
        except ValueError as exc:
            raise IntegrityError(f"{folder / INDEX_FILE}: not JSON ({exc})") from None
        shard = lm_head_shard(index, str(folder / INDEX_FILE))
    elif (folder / SINGLE_FILE).is_file():
        shard = SINGLE_FILE if LM_HEAD in _safetensors_keys(folder / SINGLE_FILE) else None
    else:
        shard = None
    if shard is not None:
        if not (folder / shard).is_file():
            raise IntegrityError(f"{folder / shard}: missing (named for {LM_HEAD})")
        read_header(folder / shard)  # its header and extent: a truncated shard is not pinned
        log(f"hashing {shard} ({(folder / shard).stat().st_size:,} bytes) for the lm_head table")
        files[shard] = sha256_file(folder / shard)
        release["lm_head_file"] = shard
    else:
        release["lm_head_file"] = None  # tied embeddings or no checkpoint: lm-head-table will say so
    # the backbone: its config, every shard (a backbone build reads them all) and the tokenizer files
    for f in (BACKBONE_CONFIG, *TOKENIZER_FILES, *PROCESSOR_FILES, *LICENSE_FILES):
        if (folder / f).is_file():
            files[f] = sha256_file(folder / f)
    shards = sorted(set(index["weight_map"].values())) if isinstance(index, dict) and isinstance(index.get("weight_map"), dict) \
        else [SINGLE_FILE] if (folder / SINGLE_FILE).is_file() else []
    for f in shards:
        if f in files:
            continue
        if not isinstance(f, str) or "/" in f or f.startswith(".") or not (folder / f).is_file():
            raise IntegrityError(f"{folder / INDEX_FILE}: names shard {f!r}, which the folder does not hold")
        read_header(folder / f)
        log(f"hashing {f} ({(folder / f).stat().st_size:,} bytes) for the backbone")
        files[f] = sha256_file(folder / f)
    pins = Pins(hf_id=f"local/{release_name}", revision=None, origin="local", name=release_name,
                files=dict(sorted(files.items())), release=release,
                trusted_author_sha256=trust_author if trust_author and trust_author == files[CODE_FILE] else None,
                note=f"local release folder {folder.resolve().name}, pinned by clef-export pin")
    return _write(pins, out, overwrite), out


# ---------------------------------------------------------------- a Hub commit


def pin_hub(hf_id: str, revision: str, out: Path, *, name: str | None = None, trust_author: str | None = None,
            overwrite: bool = False, log=lambda msg: None) -> Pins:
    """Pins of a Hub repo at one commit, from the Hub's own metadata (honours ``HF_ENDPOINT``)."""
    if not re.match(HEX40, revision or ""):
        raise UsageError(f"--revision {revision!r}: pin a commit (40 lowercase hex), not a branch or tag that moves")
    if name is not None:
        _name(Path(name), name)
    out = Path(out)
    check_output_path(out, overwrite)
    where = f"{hf_id}@{revision[:12]}"
    infos = _paths_info(hf_id, revision, [*HEAD_FILES, INDEX_FILE, SINGLE_FILE, BACKBONE_CONFIG, *TOKENIZER_FILES, *PROCESSOR_FILES,
                                                    *LICENSE_FILES],
                        where)
    files: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="clef-pin-") as cache:
        def small(path: str) -> bytes:
            return _small_file(hf_id, revision, path, infos[path], Path(cache), where)

        for f in HEAD_FILES:
            if f not in infos:
                raise IntegrityError(f"{where}/{f}: not in the repo at that commit")
            files[f] = _lfs_sha256(infos[f]) or sha256_bytes(small(f))
        check_author_trusted(Path(f"{where}/{CODE_FILE}"), files[CODE_FILE], trust_author)
        shard = None
        if INDEX_FILE in infos:
            data = small(INDEX_FILE)
            files[INDEX_FILE] = sha256_bytes(data)
            try:
                index = json.loads(data)
            except ValueError as exc:
                raise IntegrityError(f"{where}/{INDEX_FILE}: not JSON ({exc})") from None
            shard = lm_head_shard(index, f"{where}/{INDEX_FILE}")
            shards = sorted({s for s in index.get("weight_map", {}).values() if isinstance(s, str)})
            bad = [s for s in shards if "/" in s or s.startswith(".")]
            if bad:
                raise IntegrityError(f"{where}/{INDEX_FILE}: names shard {bad[0]!r}")
            wanted = [s for s in shards if s not in infos]
            if wanted:
                infos.update(_paths_info(hf_id, revision, wanted, where))
            for s in shards:  # the backbone's shards: LFS files, pinned by their LFS sha256
                if s not in infos:
                    raise IntegrityError(f"{where}/{s}: named in {INDEX_FILE} but not in the repo")
                files[s] = _lfs_sha256(infos[s]) or sha256_bytes(small(s))
        elif SINGLE_FILE in infos:
            shard = SINGLE_FILE  # its header is not read here: lm-head-table checks the tensor is there
        if shard is not None and shard not in files:
            if shard not in infos:
                raise IntegrityError(f"{where}/{shard}: named for {LM_HEAD} but not in the repo")
            files[shard] = _lfs_sha256(infos[shard]) or sha256_bytes(small(shard))
        for f in (BACKBONE_CONFIG, *TOKENIZER_FILES, *PROCESSOR_FILES, *LICENSE_FILES):  # small git files: blob sha1 checked
            if f in infos:
                files[f] = _lfs_sha256(infos[f]) or sha256_bytes(small(f))
    log(f"pinned {plural(len(files), 'file')} of {where}")
    pins = Pins(hf_id=hf_id, revision=revision, origin="hub", name=name, files=dict(sorted(files.items())),
                trusted_author_sha256=trust_author if trust_author and trust_author == files[CODE_FILE] else None,
                note=f"pinned by clef-export pin from the Hub's metadata at {revision}")
    return _write(pins, out, overwrite)


def _paths_info(hf_id: str, revision: str, paths: list[str], where: str) -> dict[str, Any]:
    from huggingface_hub import HfApi

    from .fetch import hub_errors

    with hub_errors(hf_id, revision, where, "the Hub's file metadata"):
        found = HfApi().get_paths_info(hf_id, paths, revision=revision)
    return {f.path: f for f in found if hasattr(f, "blob_id")}


def _lfs_sha256(info: Any) -> str | None:
    lfs = getattr(info, "lfs", None)
    sha = getattr(lfs, "sha256", None) if lfs is not None else None
    if sha is not None and not re.match(r"^[0-9a-f]{64}$", sha):
        raise IntegrityError(f"{info.path}: the Hub gives an LFS oid that is not a sha256: {sha!r}")
    return sha


def _small_file(hf_id: str, revision: str, path: str, info: Any, cache: Path, where: str) -> bytes:
    """A small (git) file downloaded by commit, returned only when its git blob sha1 is the Hub's."""
    from .fetch import download_file

    data = download_file(hf_id, path, revision, f"{where}/{path}", cache, None).read_bytes()
    actual = git_blob_sha1(data)
    if actual != info.blob_id:
        raise IntegrityError(f"{where}/{path}: git blob sha1 {actual[:12]}… differs from the Hub's {info.blob_id[:12]}…; "
                             f"nothing written")
    return data
