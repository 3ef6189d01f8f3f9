"""A release folder opened to answer: what ``release`` writes (or a published repo downloaded by
commit), every file checked against its ``SHA256SUMS`` first, its bundles found by kind and
checked to come from one release, the tokenizer and the lm_head table located."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import IntegrityError, UsageError
from ..digest import read_sums
from ..layout import HOST_DIR, MANIFEST_FILE, SUMS_FILE, TABLE_FILE

KINDS = {"decision-head": "head", "decision-backbone": "backbone", "vision-tower": "vision"}
PUBLISHED = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)@(?P<commit>[0-9a-f]{40})$")


def head_order(q_pad: int, o_pad: int, buckets) -> tuple[int, int]:
    """The order a host tries heads in: narrower pads first (the wide pads cost 1.6-3.4x a call at
    the same tokens, measured: docs/host.md), then shorter buckets."""
    return q_pad * o_pad, max(buckets)


@dataclass(frozen=True)
class ShippedHead:
    """One head bundle of a release: its asset, its pads and its functions by bucket."""

    bundle: Path
    manifest: Any  # its format's manifest model
    fmt: Any  # head.backends' module
    asset: Path
    q_pad: int
    o_pad: int
    names: dict[int, str]  # bucket (tokens) -> function name

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self.names))

    def bucket_for(self, tokens: int, questions: int, options: int) -> int | None:
        """The smallest of its buckets a record of this size runs in; None when it does not fit."""
        if questions > self.q_pad or options > self.o_pad:
            return None
        return next((b for b in self.buckets if tokens <= b), None)

    @property
    def cost(self) -> tuple[int, int]:
        return head_order(self.q_pad, self.o_pad, self.names)


@dataclass(frozen=True)
class Dist:
    root: Path
    sums: dict[str, str]  # relative path -> sha256, as SHA256SUMS lists them
    heads: tuple[ShippedHead, ...]  # cheapest first (``ShippedHead.cost``)
    backbone: Any  # backbone.shipped.ShippedBackbone
    vision: Any | None  # vision.shipped.ShippedVision
    table: Path
    tokenizer: Path

    @property
    def head(self) -> ShippedHead:
        """The release's first head (the one that says which release it is)."""
        return self.heads[0]

    def digests(self) -> dict[str, str]:
        """Each bundle's manifest sha256 (what ``/health`` reports)."""
        return {name: digest for name, digest in self.sums.items() if name.count("/") == 1 and name.endswith("/" + MANIFEST_FILE)}


def check_sums(root: Path, sums: dict[str, str], log=lambda msg: None) -> None:
    """Every listed file present with its sha256, and every file of a bundle or host/ listed."""
    from ..digest import sha256_file

    folders = {name.split("/")[0] for name in sums if "/" in name}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if (p.is_file() or p.is_symlink()) and rel.split("/")[0] in folders and rel not in sums:
            raise IntegrityError(f"{p}: not listed in {root / SUMS_FILE}")
    log(f"checking {len(sums)} files against {SUMS_FILE}")
    for name, want in sorted(sums.items()):
        path = root / name
        if not path.is_file():  # a Hub cache's snapshot holds links to its blobs: their bytes are hashed
            raise IntegrityError(f"{path}: listed in {SUMS_FILE} but missing")
        if sha256_file(path) != want:
            raise IntegrityError(f"{path}: sha256 differs from {SUMS_FILE}'s")


def download(spec: str, cache: Path | None, log=lambda msg: None) -> Path:
    """A published release (``OWNER/NAME@COMMIT``) downloaded by that commit."""
    from huggingface_hub import snapshot_download

    from ..sources.fetch import hub_errors

    m = PUBLISHED.match(spec)
    if m is None:
        raise UsageError(f"{spec}: not a folder, nor OWNER/NAME@COMMIT (a 40-hex commit)")
    repo, commit = m.group("repo"), m.group("commit")
    log(f"downloading {repo}@{commit[:12]}")
    with hub_errors(repo, commit, spec):
        return Path(snapshot_download(repo, revision=commit, cache_dir=str(cache) if cache else None))


def _bundles(root: Path, sums: dict[str, str]) -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {"head": [], "backbone": [], "vision": []}
    for name in sorted(sums):
        parts = name.split("/")
        if len(parts) == 2 and parts[1] == MANIFEST_FILE:
            meta = root / name
            try:
                kind = json.loads(meta.read_text(encoding="utf-8")).get("kind")
            except (ValueError, AttributeError):
                raise IntegrityError(f"{meta}: not a readable manifest") from None
            if kind in KINDS:
                found[KINDS[kind]].append(meta.parent)
    if not found["head"]:
        raise UsageError(f"{root}: answering needs a head bundle; the release has none")
    for model in ("backbone",):
        if len(found[model]) != 1:
            why = "none" if not found[model] else f"{len(found[model])} ({', '.join(p.name for p in found[model])})"
            raise UsageError(f"{root}: answering needs one {model} bundle; the release has {why}")
    if len(found["vision"]) > 1:
        raise UsageError(f"{root}: {len(found['vision'])} vision bundles; answering takes one")
    return found


def _one_release(root: Path, heads: tuple[ShippedHead, ...], backbone, vision, table_meta: dict[str, Any]) -> None:
    """The bundles and the table name one release: its id and revision, and one sha256 per file."""
    origin = {h.bundle.name: (h.manifest.head.source.hf_id, h.manifest.head.source.revision) for h in heads}
    origin["backbone"] = (backbone.manifest.source.hf_id, backbone.manifest.source.revision)
    if vision is not None:
        origin["vision"] = (vision.manifest.source.hf_id, vision.manifest.source.revision)
    t = table_meta.get("source", {})
    origin["lm_head table"] = (t.get("hf_id"), t.get("revision"))
    if len(set(origin.values())) != 1:
        raise IntegrityError(f"{root}: bundles of different releases: " + ", ".join(f"{k} {a}@{b}" for k, (a, b) in origin.items()))
    files: dict[str, tuple[str, str]] = {}
    named = [("backbone", backbone.manifest.source.files)] + ([("vision", vision.manifest.source.files)] if vision else [])
    named.append(("lm_head table", {t.get("file"): t.get("sha256")}))
    for who, listed in named:
        for name, digest in listed.items():
            if name in files and files[name][1] != digest:
                raise IntegrityError(f"{root}: bundles of different releases: the {who} was built from a {name} with "
                                     f"sha256 {digest[:12]}…, the {files[name][0]} from {files[name][1][:12]}…")
            files.setdefault(name, (who, digest))


def open_dist(spec: str | Path, cache: Path | None = None, log=lambda msg: None) -> Dist:
    """The release folder (or ``OWNER/NAME@COMMIT``) checked and opened; ``IntegrityError`` (exit 3)
    naming the first file that fails, ``UsageError`` when it cannot answer (no decoder)."""
    root = Path(spec)
    if not root.is_dir():
        if PUBLISHED.match(str(spec)) is None:
            raise UsageError(f"{spec}: release folder not found (or name a published one as OWNER/NAME@COMMIT)")
        root = download(str(spec), cache, log)
    sums = read_sums(root)
    check_sums(root, sums, log)
    return open_checked(root, sums)


def open_checked(root: Path, sums: dict[str, str]) -> Dist:
    """A release folder whose files ``sums`` lists, already checked (``release`` writing its vectors)."""
    from ..backbone.shipped import read_backbone
    from ..sources.lm_head import SIDECAR_FILE
    from ..vision.shipped import read_vision

    found = _bundles(root, sums)
    heads = tuple(sorted((_read_head(b) for b in found["head"]), key=lambda h: h.cost))
    widths = {_head_hidden(h.manifest) for h in heads}
    if len(widths) != 1:
        raise IntegrityError(f"{root}: head bundles that take hidden rows of different widths ({sorted(widths)})")
    backbone = read_backbone(found["backbone"][0], widths.pop(), hashed=False)
    vision = read_vision(found["vision"][0], backbone.manifest.language.hidden_size) if found["vision"] else None
    table = root / HOST_DIR / TABLE_FILE
    if not table.is_file():
        raise IntegrityError(f"{table}: missing; the host reads each option's lm_head rows from it")
    table_meta = json.loads((root / HOST_DIR / SIDECAR_FILE).read_text(encoding="utf-8"))
    if list(table_meta.get("shape", [])) [1:] != [backbone.manifest.language.hidden_size]:
        raise IntegrityError(f"{table}: rows of {table_meta.get('shape')} values; the decoder's are "
                             f"{backbone.manifest.language.hidden_size} wide")
    _one_release(root, heads, backbone, vision, table_meta)
    tokenizer = backbone.bundle / "tokenizer" / "tokenizer.json"
    if not tokenizer.is_file():
        raise IntegrityError(f"{tokenizer}: missing; the host's encoder reads it")
    return Dist(root=root, sums=sums, heads=heads, backbone=backbone, vision=vision, table=table, tokenizer=tokenizer)


def _read_head(bundle: Path) -> ShippedHead:
    from ..gate.artifact import check_bundle
    from ..manifest import pads

    manifest, fmt, asset, checks = check_bundle(bundle)
    bad = [f"{n}: {d}" for n, ok, d in checks if not ok]
    if bad:
        raise IntegrityError(f"{bundle}: {bad[0]}")
    q_pad, o_pad = pads(manifest.head)
    return ShippedHead(bundle=bundle, manifest=manifest, fmt=fmt, asset=asset, q_pad=q_pad, o_pad=o_pad,
                       names={b: name for name, b in manifest.head.buckets})


def _head_hidden(manifest) -> int:
    """The width of the hidden rows the head takes, from its manifest's ``hidden`` input ("[T, H] f32")."""
    return int(manifest.head.inputs["hidden"].split(",")[1].split("]")[0])
