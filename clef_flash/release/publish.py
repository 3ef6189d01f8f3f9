"""Publish a release's ``dist/`` to the Hub in one commit, with a model card, and prove the upload.

How it works: docs/modules.md."""

from __future__ import annotations

import contextlib
import json
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .card import BACKBONE_KIND, HEAD_KIND, Dist, model_card, read_dist
from ..digest import sha256_bytes, sha256_file
from ..errors import IntegrityError, NumericError, RemoteError, UsageError
from ..layout import SUMS_FILE
from ..progress import plural

CARD = "README.md"
PUBLISH_RECORD = "publish-record.json"  # written into dist/ after the upload; never uploaded
REPO_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$"


@dataclass(frozen=True)
class PublishConfig:
    dist: Path
    repo: str
    revision: str = "main"
    private: bool = False
    check: Path | None = None  # a check-release transcript of these assets
    dry_run: bool = False


def check_dist(dist: Path) -> Dist:
    """``dist/`` read, every file checked against SHA256SUMS; ``IntegrityError`` naming the first
    file that differs, is missing, or is there without being listed."""
    dist = Path(dist)
    if not dist.is_dir():
        raise UsageError(f"{dist}: not a folder (a release's dist/, from `clef-export release`)")
    d = read_dist(dist)
    for name, want in sorted(d.sums.items()):
        path = dist / name
        if path.is_symlink() or not path.is_file():
            raise IntegrityError(f"{path}: listed in {SUMS_FILE} but {'a symlink' if path.is_symlink() else 'missing'}")
        got = sha256_file(path)
        if got != want:
            raise IntegrityError(f"{path}: sha256 {got[:12]}… differs from {SUMS_FILE}'s {want[:12]}…; nothing was sent")
    for path in sorted(dist.rglob("*")):
        rel = path.relative_to(dist).as_posix()
        if (path.is_file() or path.is_symlink()) and rel not in d.sums and rel not in (SUMS_FILE, PUBLISH_RECORD):
            raise IntegrityError(f"{path}: not listed in {SUMS_FILE}; nothing was sent")
    for name in d.sums:
        if name in (CARD, PUBLISH_RECORD) or not re.match(r"^[A-Za-z0-9._/-]+$", name):
            raise IntegrityError(f"{dist / name}: a name publish cannot upload beside its card and record")
    return d


def load_check(path: Path, dist: Dist) -> dict[str, Any]:
    """A check-release transcript that passed, of this dist's head asset (and backbone asset)."""
    path = Path(path)
    try:
        t = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{path}: not found") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: not JSON ({exc})") from None
    if not isinstance(t, dict) or t.get("command") != "check-release" or not isinstance(t.get("summary"), dict):
        raise UsageError(f"{path}: not a check-release transcript (`clef-export check-release --transcript`)")
    if not t["summary"].get("ok") or t.get("red"):
        raise NumericError(f"{path}: check-release did not pass (ok={t['summary'].get('ok')}, red={t.get('red')}); "
                           "a release is published with a passing proof or none")
    assets = {b.kind: set() for b in dist.bundles}
    for b in dist.bundles:
        assets[b.kind].add(b.manifest.get("export", {}).get("main_mlirb", {}).get("sha256"))
    if t.get("asset_sha256") not in assets.get(HEAD_KIND, set()):
        raise IntegrityError(f"{path}: checked a head asset with sha256 {str(t.get('asset_sha256'))[:12]}…, "
                             f"which is not in {dist.folder}")
    bb = t["summary"].get("backbone")
    if bb and bb.get("asset_sha256") not in assets.get(BACKBONE_KIND, set()):
        raise IntegrityError(f"{path}: checked a backbone asset with sha256 {str(bb.get('asset_sha256'))[:12]}…, "
                             f"which is not in {dist.folder}")
    return t


def plan(cfg: PublishConfig) -> tuple[Dist, str, dict[str, Any]]:
    """What would be sent: the checked dist, the card, and the plan as JSON."""
    if not re.match(REPO_RE, cfg.repo or ""):
        raise UsageError(f"--repo {cfg.repo!r}: expected OWNER/NAME")
    d = check_dist(cfg.dist)
    transcript = load_check(cfg.check, d) if cfg.check is not None else None
    card = model_card(d, transcript)
    files = [{"path": n, "bytes": d.sizes[n], "sha256": s} for n, s in sorted(d.sums.items())]
    files.append({"path": SUMS_FILE, "bytes": (d.folder / SUMS_FILE).stat().st_size, "sha256": sha256_file(d.folder / SUMS_FILE)})
    files.append({"path": CARD, "bytes": len(card.encode()), "sha256": sha256_bytes(card.encode())})
    out = {"repo": cfg.repo, "revision": cfg.revision, "private": cfg.private, "dist": str(d.folder),
           "files": files, "bytes": sum(f["bytes"] for f in files),
           "check": None if cfg.check is None else str(cfg.check)}
    return d, card, out


@contextlib.contextmanager
def remote_errors(repo: str, what: str, state: str = "nothing was committed"):
    """huggingface_hub's failures as one line naming the repo and what is on the Hub now (``state``:
    before the commit, nothing, since the Hub commits all or nothing; after it, that commit)."""
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    from ..sources.fetch import _cause

    try:
        yield
    except RepositoryNotFoundError:
        raise RemoteError(f"{repo}: repository not found, or the token may not write to it ({what})") from None
    except HfHubHTTPError as exc:
        code = getattr(getattr(exc, "response", None), "status_code", "?")
        hint = "; the token was refused" if code in (401, 403) else ""
        raise RemoteError(f"{repo}: {what} failed (HTTP {code}{hint}); {state}") from None
    except (IntegrityError, UsageError):
        raise
    except Exception as exc:  # connection dropped, timeout, malformed answer
        raise RemoteError(f"{repo}: {what} failed ({_cause(exc)}); {state}") from None


def publish(cfg: PublishConfig, log=lambda msg: None) -> dict[str, Any]:
    """The plan, or (not ``dry_run``) the upload in one commit, proven, with its record."""
    from ..bundle import atomic_write_bytes

    d, card, out = plan(cfg)
    if cfg.dry_run:
        return {**out, "dry_run": True, "card": card}
    from huggingface_hub import CommitOperationAdd, HfApi, get_token, hf_hub_download

    if not get_token():
        raise UsageError("no Hub token: set HF_TOKEN or run `hf auth login`; nothing was sent")
    if not sys.stderr.isatty():  # the library's byte bars on a terminal; plain lines (ours) otherwise
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    api = HfApi()
    with remote_errors(cfg.repo, "creating the repository", "nothing was committed; run publish again"):
        url = api.create_repo(cfg.repo, private=cfg.private, exist_ok=True, repo_type="model")
        if cfg.revision != "main":
            api.create_branch(cfg.repo, branch=cfg.revision, exist_ok=True)
    log(f"{url}: uploading {plural(len(out['files']), 'file')} ({out['bytes']:,} bytes) in one commit")
    ops = [CommitOperationAdd(path_in_repo=n, path_or_fileobj=str(d.folder / n)) for n in sorted(d.sums)]
    ops.append(CommitOperationAdd(path_in_repo=SUMS_FILE, path_or_fileobj=str(d.folder / SUMS_FILE)))
    ops.append(CommitOperationAdd(path_in_repo=CARD, path_or_fileobj=card.encode()))
    with remote_errors(cfg.repo, "the upload", "nothing was committed; run publish again"):
        info = api.create_commit(cfg.repo, operations=ops, revision=cfg.revision,
                                 commit_message=f"clef-export publish: {', '.join(b.name for b in d.bundles)}",
                                 commit_description=f"{plural(len(ops), 'file')}, {out['bytes']:,} bytes; {SUMS_FILE} lists them")
    commit = info.oid
    log(f"committed {commit}; reading it back")
    want = {f["path"]: f["sha256"] for f in out["files"]}
    on_hub = (f"commit {commit} is on the Hub ({cfg.revision}) but was not proven, and {PUBLISH_RECORD} was not "
              f"written; check it with `clef-export publish` again (a new commit) or revert it on the Hub")
    with remote_errors(cfg.repo, f"reading back commit {commit[:12]}", on_hub), \
            tempfile.TemporaryDirectory(prefix="clef-publish-") as tmp:
        for name in (SUMS_FILE, CARD):
            got = sha256_file(Path(hf_hub_download(cfg.repo, name, revision=commit, cache_dir=tmp)))
            if got != want[name]:
                raise IntegrityError(f"{cfg.repo}@{commit[:12]}/{name}: sha256 {got[:12]}… is not what was sent "
                                     f"({want[name][:12]}…); {on_hub}")
        remote = {f.path: f for f in api.get_paths_info(cfg.repo, sorted(want), revision=commit)}
    from ..sources.pinning import git_blob_sha1

    for name, digest in sorted(want.items()):
        f = remote.get(name)
        lfs = getattr(getattr(f, "lfs", None), "sha256", None)
        same = f is not None and (lfs == digest if lfs else f.blob_id == git_blob_sha1((d.folder / name).read_bytes()
                                                                                         if name != CARD else card.encode()))
        if not same:
            raise IntegrityError(f"{cfg.repo}@{commit[:12]}/{name}: {'missing' if f is None else 'differs from what was sent'}; "
                                 f"{on_hub}")
    record = {"repo": cfg.repo, "revision": cfg.revision, "commit": commit, "commit_url": info.commit_url,
              "files": want, "check": out["check"]}
    atomic_write_bytes(d.folder / PUBLISH_RECORD, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode())
    log(f"proved: {plural(len(want), 'file')} at {commit} match what was sent; {PUBLISH_RECORD} written")
    return {**out, "commit": commit, "commit_url": info.commit_url, "record": str(d.folder / PUBLISH_RECORD)}
