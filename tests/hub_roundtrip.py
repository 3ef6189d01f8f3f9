"""``make check``'s last step: publish a dist/ to a loopback fake Hub, download it back by the
published commit into a fresh folder, and check what came back like a user would.

    python -m tests.hub_roundtrip DIST [--check TRANSCRIPT.json]

publish (one commit, the card, publish-record.json) -> snapshot_download by that commit ->
``sha256sum -c SHA256SUMS`` there -> ``clef-export verify-artifact`` on every bundle downloaded.
Exits non-zero at the first step that fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .fakehub import FakeHubRepos


def main(argv: list[str]) -> int:
    dist, extra = Path(argv[0]), argv[1:]
    exe = str(Path(sys.executable).parent / "clef-export")
    with FakeHubRepos() as hub, tempfile.TemporaryDirectory(prefix="clef-roundtrip-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env.update(HF_ENDPOINT=hub.endpoint, HF_TOKEN="hf_loopback", HF_HUB_DISABLE_XET="1", HF_HOME=f"{tmp}/hf",
                   HF_HUB_DISABLE_TELEMETRY="1")
        repo = "loopback/tiny-release"
        r = subprocess.run([exe, "publish", str(dist), "--repo", repo, *extra, "--json"], env=env, stdout=subprocess.PIPE, text=True)
        if r.returncode:
            return r.returncode
        commit = json.loads(r.stdout)["commit"]
        from huggingface_hub import snapshot_download

        got = Path(snapshot_download(repo, revision=commit, local_dir=f"{tmp}/download", endpoint=hub.endpoint,
                                     token="hf_loopback"))
        print(f"downloaded {repo}@{commit} into a fresh folder", file=sys.stderr)
        if subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=got).returncode:
            return 3
        for meta in sorted(got.glob("*/metadata.json")):
            if subprocess.run([exe, "verify-artifact", str(meta.parent)], env=env).returncode:
                return 3
        print(f"round trip ok: SHA256SUMS and every bundle's manifest check at {commit}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
