"""publish: dist/ -> one Hub commit with a model card written from the records, proven by commit.

Against a loopback fake of the Hub's write side (tests/fakehub.py ``FakeHubRepos``): the upload,
a download by the published commit that passes ``sha256sum -c``, a repo that holds other files,
and the faults (no token, a dist whose sums do not match, a connection dropped mid-upload, a
transcript of other assets). The card's every figure is checked against the records, and that
checker is shown to catch one changed digit."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clef_flash.cli import app

runner = CliRunner()
REPO = "someone/tiny-mac-release"


def _cli(args, hub=None, token: str | None = "hf_fake_token", timeout: int = 180):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", HF_HOME=str(Path(args[1]).parent / "hf-home"))
    if hub is not None:
        env["HF_ENDPOINT"] = hub.endpoint
    if token:
        env["HF_TOKEN"] = token
    exe = Path(sys.executable).parent / "clef-export"
    return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture()
def dist(whole_dist, tmp_path) -> Path:
    d = tmp_path / "dist"
    shutil.copytree(whole_dist["dist"], d)
    return d


# ---------------------------------------------------------------- the card, against the records


def _tables(card: str) -> list[list[list[str]]]:
    """Every Markdown table as rows of cells (the separator row dropped); ragged rows fail."""
    tables, cur = [], None
    for line in card.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if cur is None:
                cur = [cells]
            elif set("".join(cells)) <= set("-:"):
                continue
            else:
                assert len(cells) == len(cur[0]), line
                cur.append(cells)
        elif cur is not None:
            tables.append(cur)
            cur = None
    return tables


def _close(cell: str, value, digits: int = 4) -> bool:
    if value is None:
        return cell == "n/a"
    if isinstance(value, float):
        return abs(float(cell) - value) <= 0.5 * 10 ** (1 - digits) * abs(value) + 1e-300
    return cell == str(value)


def check_card_against_records(card: str, dist: Path, transcript: dict) -> int:
    """Raises AssertionError at the first figure of the card that its records do not give; returns
    how many figures were checked."""
    from huggingface_hub import ModelCard

    mc = ModelCard(card)
    assert mc.data.license == "apache-2.0" and "synthetic" in mc.data.tags and "decision-backbone" in mc.data.tags
    sums = dict(reversed(line.split("  ", 1)) for line in (dist / "SHA256SUMS").read_text().splitlines())
    records = {p.parent.name: json.loads(p.read_text()) for p in dist.glob("*/build-record.json")}
    manifests = {p.parent.name: json.loads(p.read_text()) for p in dist.glob("*/metadata.json")}
    assert mc.data.base_model == next(iter(records.values()))["source"]["release"]["clef_finetune"]["base_model"]
    n = 0
    tables = _tables(card)
    for t in tables:
        head = t[0]
        for row in t[1:]:
            if head == ["file", "bytes", "sha256"]:
                name = row[0].strip("`")
                assert int(row[1]) == (dist / name).stat().st_size and row[2].strip("`") == sums[name], row
                n += 2
            elif head[:2] == ["function", "records"]:
                (b, r), = [(b, r) for b, r in records.items() if row[0] in r["verify"].get("max_abs_dp", {})]
                v = r["verify"]
                assert int(row[1]) == v["records_per_function"][row[0]]
                assert _close(row[2], v["max_abs_dp"][row[0]]) and _close(row[3], v["bars"]["max_abs_dp"]), row
                assert _close(row[4], v["max_abs_dlogit"][row[0]]) and _close(row[5], v["bars"]["max_abs_dlogit"]), row
                assert row[6] == v["argmax"][row[0]]
                n += 6
            elif head[:3] == ["record", "tokens", "calls"]:
                (v,) = [r["verify"] for r in records.values() if row[0] in r["verify"].get("records", {})]
                rec = v["records"][row[0]]
                assert int(row[1]) == rec["tokens"] and int(row[2]) == rec["calls"], row
                assert _close(row[3], rec["rel_max_abs_d"]) and _close(row[4], v["bars"]["rel_max_abs_d"]), row
                assert _close(row[5], rec["min_row_cosine"], 9) and _close(row[6], v["bars"]["min_row_cosine"], 9), row
                n += 6
            elif head == ["figure", "value"]:
                s = transcript["summary"]
                key = {"requests checked": s["checked"], "requests that do not fit": s["does_not_fit"],
                       "questions": s["questions"], "argmax equal": s["argmax_equal"], "answers equal": s["answers_equal"],
                       "near ties": s["near_ties"], "max \\|d p\\|": s["max_abs_dp"], "bar (max)": s["bar"],
                       "mean \\|d p\\|": s["mean_abs_dp"], "bar (mean)": s["mean_bar"],
                       "backbone weights": s["backbone"]["weights"], "backbone compute": s["backbone"]["compute"],
                       "backbone hidden rows, relative max \\|d\\|": s["backbone"]["hidden_rel_max_abs_d"]}
                assert _close(row[1], key[row[0]]), row
                n += 1
            elif head == ["input", "sha256", "pinned for"]:
                for b in row[2].split(", "):
                    f = records[b]["source"]["files"][row[0].strip("`")]
                    assert row[1].strip("`") == (f["sha256"] if isinstance(f, dict) else f), row
                    n += 1
            elif head == ["", "name", "shape", "dtype"]:
                (m,) = [m for m in manifests.values() if m["kind"] == "decision-backbone"]
                spec = m["interface"][{"input": "inputs", "state": "states", "output": "outputs"}[row[0]]][row[1]]
                assert row[2] == str(spec["shape"]) and row[3] == spec["dtype"], row
                n += 2
            elif head[0] == "tool":
                for b, cell in zip(head[1:], row[1:]):
                    assert cell == str(records[b.strip("`")]["environment"].get(row[0], "")), row
                    n += 1
    return n


def test_card_figures_are_the_records_and_a_changed_digit_is_caught(whole_dist):
    from clef_flash.release.card import model_card, read_dist
    from clef_flash.release.publish import check_dist, load_check

    d = check_dist(whole_dist["dist"])
    transcript = load_check(whole_dist["check"], d)
    card = model_card(d, transcript)
    assert card == model_card(read_dist(whole_dist["dist"]), transcript), "the card is a function of the records"
    n = check_card_against_records(card, whole_dist["dist"], transcript)
    assert n > 100, n
    assert "NOTICE:" in card and "Copyright nobody" in card and "## How a host calls each bundle" in card
    # the checker catches one changed digit in a gate figure
    v = next(json.loads(p.read_text()) for p in whole_dist["dist"].glob("*/build-record.json")
             if "max_abs_dp" in json.loads(p.read_text())["verify"])["verify"]
    shown = f"{v['max_abs_dp']['t512']:.4g}"
    changed = shown[:-1] + ("1" if shown[-1] != "1" else "2")
    bad = card.replace(f"| t512 | {v['records_per_function']['t512']} | {shown} |",
                       f"| t512 | {v['records_per_function']['t512']} | {changed} |")
    assert bad != card
    with pytest.raises(AssertionError):
        check_card_against_records(bad, whole_dist["dist"], transcript)


def test_dry_run_prints_the_plan_and_the_card_and_sends_nothing(dist, whole_dist):
    res = runner.invoke(app, ["publish", str(dist), "--repo", REPO, "--check", str(whole_dist["check"]), "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)
    listed = (dist / "SHA256SUMS").read_text().splitlines()
    assert plan["dry_run"] is True and len(plan["files"]) == len(listed) + 2
    assert [f["path"] for f in plan["files"]][-2:] == ["SHA256SUMS", "README.md"]
    assert plan["card"].startswith("---\n") and "## Proof" in plan["card"]
    assert not (dist / "publish-record.json").exists()


# ---------------------------------------------------------------- the upload, against a loopback Hub


def test_publish_one_commit_beside_other_files_then_download_by_commit(dist, whole_dist, tmp_path):
    from huggingface_hub import snapshot_download

    from .fakehub import FakeHubRepos

    with FakeHubRepos() as hub:
        hub.create(REPO, files={"notes.txt": b"the maintainers' own file\n", "README.md": b"an old card\n"})
        before = hub.commits(REPO)
        r = _cli(["publish", dist, "--repo", REPO, "--check", whole_dist["check"], "--json"], hub)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout)
        after = hub.commits(REPO)
        assert after[:-1] == before and after[-1] == out["commit"], "one commit, on top of the repo's own"
        files = hub.files(REPO, out["commit"])
        assert files["notes.txt"] == b"the maintainers' own file\n", "only our files change"
        record = json.loads((dist / "publish-record.json").read_text())
        assert record["commit"] == out["commit"] and record["repo"] == REPO
        for name, digest in record["files"].items():
            import hashlib

            assert hashlib.sha256(files[name]).hexdigest() == digest, name
        assert "hf_fake_token" not in r.stdout + r.stderr + (dist / "publish-record.json").read_text()
        # a fresh download by the published commit passes sha256sum -c; the card parses
        got = Path(snapshot_download(REPO, revision=out["commit"], local_dir=tmp_path / "down", endpoint=hub.endpoint,
                                     token="hf_fake_token"))
        assert subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=got).returncode == 0
        from clef_flash.gate import check_artifact

        kinds = {json.loads((m).read_text())["kind"] for m in got.glob("*/metadata.json")}
        assert kinds == {"decision-head", "decision-backbone"}
        for meta in got.glob("*/metadata.json"):
            assert check_artifact(meta.parent)["files"] >= 4
        transcript = json.loads(Path(whole_dist["check"]).read_text())
        assert check_card_against_records((got / "README.md").read_text(), got, transcript) > 100
        # publishing the same dist again changes nothing and makes no empty commit
        r = _cli(["publish", dist, "--repo", REPO, "--json"], hub)
        assert r.returncode == 0, r.stderr[-3000:]
        assert hub.commits(REPO)[-1] == json.loads(r.stdout)["commit"]


def test_no_token_and_a_bad_dist_send_nothing(dist, whole_dist):
    from .fakehub import FakeHubRepos

    with FakeHubRepos() as hub:
        r = _cli(["publish", dist, "--repo", REPO], hub, token=None)
        assert r.returncode == 2 and "no Hub token" in r.stderr, r.stderr
        head = next(dist.glob("*_head_*"))
        mlirb = next(head.glob("*.aimodel/main.mlirb"))
        data = bytearray(mlirb.read_bytes())
        data[len(data) // 2] ^= 1
        mlirb.write_bytes(bytes(data))
        r = _cli(["publish", dist, "--repo", REPO], hub)
        assert r.returncode == 3 and "main.mlirb" in r.stderr and "nothing was sent" in r.stderr, r.stderr
        data[len(data) // 2] ^= 1
        mlirb.write_bytes(bytes(data))  # restored
        (dist / "extra.txt").write_text("not listed")
        r = _cli(["publish", dist, "--repo", REPO], hub)
        assert r.returncode == 3 and "extra.txt" in r.stderr and "not listed" in r.stderr, r.stderr
        assert hub.requests == [] and REPO not in hub.repos
        assert "Traceback" not in r.stderr


def test_transcripts_of_other_assets_or_failing_are_refused(dist, whole_dist, tmp_path):
    t = json.loads(Path(whole_dist["check"]).read_text())
    other = dict(t, asset_sha256="0" * 64)
    (tmp_path / "other.json").write_text(json.dumps(other))
    res = runner.invoke(app, ["publish", str(dist), "--repo", REPO, "--check", str(tmp_path / "other.json"), "--dry-run"])
    assert res.exit_code == 3 and "not in" in res.output
    bb = json.loads(json.dumps(t))
    bb["summary"]["backbone"]["asset_sha256"] = "1" * 64
    (tmp_path / "bb.json").write_text(json.dumps(bb))
    res = runner.invoke(app, ["publish", str(dist), "--repo", REPO, "--check", str(tmp_path / "bb.json"), "--dry-run"])
    assert res.exit_code == 3 and "backbone asset" in res.output
    failed = json.loads(json.dumps(t))
    failed["summary"]["ok"] = False
    (tmp_path / "failed.json").write_text(json.dumps(failed))
    res = runner.invoke(app, ["publish", str(dist), "--repo", REPO, "--check", str(tmp_path / "failed.json"), "--dry-run"])
    assert res.exit_code == 4 and "did not pass" in res.output


def test_connection_dropped_mid_upload_leaves_no_commit_and_the_rerun_lands(dist):
    from .fakehub import FakeHubRepos

    with FakeHubRepos() as hub:
        hub.faults.add("reset-upload")
        r = _cli(["publish", dist, "--repo", REPO], hub)
        assert r.returncode == 6, r.stderr[-2000:]
        lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
        assert len(lines) == 1 and REPO in lines[0] and "nothing was committed" in lines[0], r.stderr[-2000:]
        assert "Traceback" not in r.stderr
        assert len(hub.commits(REPO)) == 1, "the repo was created, nothing committed"
        assert not (dist / "publish-record.json").exists()
        hub.faults.clear()
        hub.faults.add("reset-commit")  # cut again, at the commit itself this time
        r = _cli(["publish", dist, "--repo", REPO], hub)
        assert r.returncode == 6 and len(hub.commits(REPO)) == 1, r.stderr[-2000:]
        hub.faults.clear()
        r = _cli(["publish", dist, "--repo", REPO, "--json"], hub)
        assert r.returncode == 0, r.stderr[-2000:]
        assert len(hub.commits(REPO)) == 2 and json.loads(r.stdout)["commit"] == hub.commits(REPO)[-1]


def test_a_failed_read_back_says_the_commit_is_on_the_hub(dist):
    """The commit landed, reading it back failed: the error names that commit and says it is on the
    Hub, not "nothing was committed"; no publish record is written."""
    from .fakehub import FakeHubRepos

    with FakeHubRepos() as hub:
        hub.faults.add("500-paths-info")
        r = _cli(["publish", dist, "--repo", REPO], hub)
        assert r.returncode == 6, r.stderr[-2000:]
        lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
        commit = hub.commits(REPO)[-1]
        assert len(hub.commits(REPO)) == 2, "the commit landed"
        assert len(lines) == 1 and f"commit {commit} is on the Hub" in lines[0], r.stderr[-2000:]
        assert "nothing was committed" not in r.stderr and "Traceback" not in r.stderr
        assert not (dist / "publish-record.json").exists()
