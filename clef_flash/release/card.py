"""The model card of a release's ``dist/``, written from its records alone.

dist/ (SHA256SUMS, each bundle's metadata.json and build-record.json, host/lm_head_fp16.json, the
release's LICENSE / NOTICE) [+ a check-release transcript] -> ``README.md``: Hub front matter
(licence, base model, tags), what the release is, its files, how it was built, the proof, how a
host calls each bundle, the licence. Nothing in it is typed by hand: every figure comes from a
record, so a card can be checked against them (``tests/test_publish.py`` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..bundle import read_json
from ..errors import IntegrityError
from ..digest import read_sums
from ..layout import LICENSE_FILES, SUMS_FILE

HEAD_KIND, BACKBONE_KIND, VISION_KIND = "decision-head", "decision-backbone", "vision-tower"
TABLE_SIDECAR = "host/lm_head_fp16.json"


def fig(x: Any, digits: int = 4) -> str:
    """A measured figure as the card prints it: ``digits`` significant digits (the test reads them back)."""
    return "n/a" if x is None else f"{x:.{digits}g}" if isinstance(x, float) else str(x)


@dataclass(frozen=True)
class Bundle:
    name: str
    kind: str
    manifest: dict[str, Any]
    record: dict[str, Any]


@dataclass(frozen=True)
class Dist:
    folder: Path
    sums: dict[str, str]  # file -> sha256, as SHA256SUMS lists them
    sizes: dict[str, int]
    bundles: tuple[Bundle, ...]
    licence: tuple[str, ...]  # LICENSE / NOTICE files at the top of dist/
    table: dict[str, Any] | None  # host/lm_head_fp16.json


def _json(path: Path) -> dict[str, Any]:
    return read_json(path)


def read_dist(dist: Path) -> Dist:
    """The records of a dist/ (SHA256SUMS is read, not checked: ``publish`` checks it first)."""
    dist = Path(dist)
    sums = read_sums(dist)
    bundles = []
    for name in sorted({n.split("/", 1)[0] for n in sums if n.endswith("/metadata.json") and n.count("/") == 1}):
        manifest = _json(dist / name / "metadata.json")
        if manifest.get("kind") not in (HEAD_KIND, BACKBONE_KIND, VISION_KIND):
            continue
        bundles.append(Bundle(name, manifest["kind"], manifest, _json(dist / name / "build-record.json")))
    if not bundles:
        raise IntegrityError(f"{dist}: no bundle (a folder with metadata.json) is listed in {SUMS_FILE}")
    table = _json(dist / TABLE_SIDECAR) if TABLE_SIDECAR in sums else None
    return Dist(dist, sums, {n: (dist / n).stat().st_size for n in sums}, tuple(bundles),
                tuple(f for f in LICENSE_FILES if f in sums), table)


def spdx(dist: Dist) -> str:
    """The licence id for the front matter, from the release's own LICENSE text."""
    texts = [(dist.folder / f).read_text(encoding="utf-8", errors="replace") for f in dist.licence if f.startswith("LICENSE")]
    if not texts:
        return "unknown"
    text = " ".join(texts[0].split())
    if "Apache License" in text and "Version 2.0" in text:
        return "apache-2.0"
    if "MIT License" in text or "Permission is hereby granted, free of charge" in text:
        return "mit"
    return "other"


def _source(b: Bundle) -> dict[str, Any]:
    return b.record.get("source", {})


def _release_facts(b: Bundle) -> dict[str, Any]:
    return _source(b).get("release") or {}


def check_summary(transcript: dict[str, Any]) -> dict[str, Any]:
    return transcript.get("summary", {})


def model_card(dist: Dist, transcript: dict[str, Any] | None = None) -> str:
    """The card's Markdown, front matter first."""
    from huggingface_hub import ModelCardData

    first = dist.bundles[0]
    src = _source(first)
    facts = _release_facts(first)
    finetune = facts.get("clef_finetune") or {}
    synthetic = any(_source(b).get("synthetic") or _release_facts(b).get("tiny_random") for b in dist.bundles)
    base = finetune.get("base_model") or (src.get("hf_id") if src.get("origin") == "hub" else None)
    kinds = sorted({b.kind for b in dist.bundles})
    formats = sorted({b.record.get("parameters", {}).get("recipe", {}).get("format") for b in dist.bundles} - {None})
    tags = ["clef", "core-ai", *formats, *kinds] + (["synthetic"] if synthetic else [])
    data = ModelCardData(license=spdx(dist), base_model=base, tags=tags, library_name="clef-export")
    release = src.get("hf_id", "?")
    out = ["---", data.to_yaml(), "---", ""]
    out += [f"# {release}: Core AI assets", ""]
    what = "a fine-tune's complete Mac release: " if BACKBONE_KIND in kinds else ""
    out += [f"Apple Core AI assets of the Clef decision model `{release}`, {what}built and proven on Linux by "
            "clef-export. " + ("**Synthetic: random weights, for testing the toolchain; it decides nothing.**"
                               if synthetic else ""), ""]
    for b in dist.bundles:
        role = {HEAD_KIND: "the joint schema head: hidden rows -> one logit per allowed option of each question",
                BACKBONE_KIND: "the Qwen3.5 decoder with states: token ids (and an image's rows) -> the final-norm hidden rows",
                VISION_KIND: "the vision tower: an image's patches at its native grid -> one row per vision token"}[b.kind]
        out.append(f"- `{b.name}/` ({b.kind}): {role}")
    if dist.table is not None:
        out.append(f"- `host/lm_head_fp16.bin`: the lm_head rows in fp16 {dist.table['shape']}, the lexical table the host reads")
    if "host/host-vectors.jsonl" in dist.sums:
        out.append("- `host/host-vectors.jsonl`: what each host step gives for a few requests (token ids, spans, head "
                   "inputs' digests, hidden rows, logits, answers), for a host in another language to prove itself against; "
                   "`clef-export answer DIST --vectors` checks the Python host")
    out += ["", "## Files", "", "| file | bytes | sha256 |", "|---|---|---|"]
    out += [f"| `{n}` | {dist.sizes[n]} | `{d}` |" for n, d in sorted(dist.sums.items())]
    out += ["", f"`{SUMS_FILE}` lists them; `sha256sum -c {SUMS_FILE}` checks a download.", ""]
    out += _built(dist)
    out += _proof(dist, transcript)
    out += _host(dist)
    out += _licence(dist)
    return "\n".join(out).rstrip() + "\n"


def _built(dist: Dist) -> list[str]:
    first = dist.bundles[0]
    src = _source(first)
    out = ["## How it was built", ""]
    if src.get("origin") == "hub" or src.get("revision"):
        out.append(f"From `{src.get('hf_id')}` at commit `{src.get('revision')}` on the Hub.")
    else:
        folder = _release_facts(first).get("folder_name")
        out.append(f"From a local release folder (`{folder}`), pinned by sha256 as `{src.get('hf_id')}`.")
    finetune = _release_facts(first).get("clef_finetune") or {}
    if finetune:
        out += ["", "What the release's `CLEF_FINETUNE.json` says:", "", "| key | value |", "|---|---|"]
        out += [f"| {k} | `{v}` |" for k, v in finetune.items()]
    inputs: dict[str, tuple[str, list[str]]] = {}
    for b in dist.bundles:
        for f, v in sorted(_source(b).get("files", {}).items()):
            digest = v["sha256"] if isinstance(v, dict) else v
            inputs.setdefault(f, (digest, []))[1].append(b.name)
    out += ["", "Every input, checked against its pin before use:", "", "| input | sha256 | pinned for |", "|---|---|---|"]
    out += [f"| `{f}` | `{d}` | {', '.join(names)} |" for f, (d, names) in sorted(inputs.items())]
    out += ["", "| bundle | recipe | command | parameters |", "|---|---|---|---|"]
    for b in dist.bundles:
        p = b.record.get("parameters", {})
        r = p.get("recipe", {})
        keys = ("weights", "block", "fp16_layers", "plan", "compute", "chunk", "context", "buckets", "q_pad", "o_pad", "format")
        compressed_only = ("block", "fp16_layers", "plan")
        params = ", ".join(f"{k} {r[k]}" for k in keys if r.get(k) is not None
                           and not (k in compressed_only and r.get("weights", "fp16") == "fp16"))
        out.append(f"| `{b.name}` | `{p.get('recipe_file')}` | {b.record.get('tool', {}).get('command')} | {params} |")
    envs = [b.record.get("environment", {}) for b in dist.bundles]
    tools = sorted({k for e in envs for k in e})
    out += ["", "| tool | " + " | ".join(f"`{b.name}`" for b in dist.bundles) + " |",
            "|---|" + "---|" * len(dist.bundles)]
    out += [f"| {t} | " + " | ".join(str(e.get(t, "")) for e in envs) + " |" for t in tools]
    return out + [""]


def _rows_table(title: str, columns: tuple[str, ...], results: dict[str, dict[str, Any]], bars: dict[str, Any],
               red: dict[str, float] | None, red_lead: str, red_tail: str) -> list[str]:
    """A Core AI model's gate rows: its own columns (the first names the row; the rest are keys of each
    result), relative max |d| and min row cosine against their bars, then its red arms' figures."""
    out = [title, "", "| " + " | ".join(columns) + " | relative max \\|d\\| | bar | min row cosine | bar |",
           "|" + "---|" * (len(columns) + 4)]
    for name, r in results.items():
        own = "".join(f" {r[k]} |" for k in columns[1:])
        out.append(f"| {name} |{own} {fig(r['rel_max_abs_d'])} | {fig(bars.get('rel_max_abs_d'))} | "
                   f"{fig(r['min_row_cosine'], 9)} | {fig(bars.get('min_row_cosine'), 9)} |")
    if red:
        out += ["", red_lead + ", ".join(f"{k} {fig(x)}" for k, x in red.items()) + red_tail]
    return out


def _proof(dist: Dist, transcript: dict[str, Any] | None) -> list[str]:
    out = ["## Proof", "", "Each bundle's gate ran on the saved asset through the Core AI runtime (Linux CPU) at build time.", ""]
    for b in dist.bundles:
        v = b.record.get("verify", {})
        bars = v.get("bars", {})
        if b.kind == HEAD_KIND:
            out += [f"`{b.name}` against the author's `JointSchemaHead` (fp32):", "",
                    "| function | records | max \\|d p\\| | bar | max \\|d logit\\| | bar | argmax |", "|---|---|---|---|---|---|---|"]
            for fn in v.get("max_abs_dp", {}):
                out.append(f"| {fn} | {v['records_per_function'][fn]} | {fig(v['max_abs_dp'][fn])} | {fig(bars.get('max_abs_dp'))} | "
                           f"{fig(v['max_abs_dlogit'][fn])} | {fig(bars.get('max_abs_dlogit'))} | {v['argmax'][fn]} |")
        elif b.kind == VISION_KIND:
            out += _rows_table(f"`{b.name}` (compute {v.get('compute')}) on seeded images of a non-square aspect, one per "
                               "bucket it ran, against transformers' `Qwen3_5VisionModel` (fp32):",
                               ("image", "function", "tokens"), v.get("images", {}),
                               bars, v.get("red"), "Red arm (patches in raster order, not the processor's merge order): ",
                               " relative max |d|, far over the bar.")
        else:
            out += _rows_table(f"`{b.name}` (compute {v.get('compute')}) chunk by chunk with its states, against "
                               "transformers' text model of the release (fp32, one full forward per record):",
                               ("record", "tokens", "calls"), v.get("records", {}),
                               bars, v.get("red"), "Red arms (the gate must see them): ", " relative max |d|, each far over the bar.")
            c = (b.manifest.get("export") or {}).get("compression")
            if c:
                q = v.get("quantization") or {}
                plan = c.get("plan")
                out += ["", f"Precision: weights int{c['bits']} (symmetric, per block of {c['block']} along each linear's "
                        f"input axis, fp16 scales) on {c['compressed_tensors']} decoder linears; kept fp16: layers "
                        f"{c['fp16_layers'] or 'none'}" + (f", chosen by the plan `{plan['file']}`{' (chosen at build time, shipped in the bundle)' if plan.get('shipped') else ''} (sha256 `{plan['sha256'][:16]}`, "
                        f"budget max |d p| {fig(plan['budget_dp'])})" if plan else "") + "; the embedding, conv1d and norms fp16. "
                        f"main.mlirb is {fig(c['mlirb_over_implied'])} x the scheme's bytes.",
                        "", "The rows above are the asset against torch eager on its own dequantized weights (read back from "
                        "main.mlirb): the runtime's exactness. The quantization's own cost, the asset against the uncompressed "
                        f"release: relative max |d| {fig(q.get('rel_max_abs_d'))}, min row cosine {fig(q.get('min_row_cosine'), 9)}."]
                if c.get("experimental"):
                    out += ["", f"**Experimental: int{c['bits']} weights, not yet proven on a trained model's end-to-end gate.**"]
        out += ["", "Checks: " + ", ".join(f"{k} {'✓' if ok else '✗'}" for k, ok in v.get("checks", {}).items()), ""]
    if transcript is not None:
        s = check_summary(transcript)
        out += ["### The whole model, request by request (`check-release`)", "",
                "The release's tokenizer -> the backbone asset -> the head asset -> answers, against the author's "
                "`systemone()` on the project's requests:" if s.get("backbone") else
                "Hidden rows from transformers -> the head asset -> answers, against the author's `systemone()`:", "",
                "| figure | value |", "|---|---|"]
        rows = [("requests checked", s.get("checked")), ("requests that do not fit", s.get("does_not_fit")),
                ("questions", s.get("questions")), ("argmax equal", s.get("argmax_equal")),
                ("answers equal", s.get("answers_equal")), ("near ties", s.get("near_ties")),
                ("max |d p|", s.get("max_abs_dp")), ("bar (max)", s.get("bar")),
                ("mean |d p|", s.get("mean_abs_dp")), ("bar (mean)", s.get("mean_bar"))]
        if s.get("backbone"):
            rows += [("backbone weights", s["backbone"].get("weights", "fp16")), ("backbone compute", s["backbone"].get("compute")),
                     ("backbone hidden rows, relative max |d|", s["backbone"].get("hidden_rel_max_abs_d"))]
        im = s.get("images") or {}
        if im.get("requests"):
            rows += [("image requests checked", im.get("requests")), ("of them through the vision asset", im.get("through_vision")),
                     ("image requests, max |d p| at the native grid", im.get("max_abs_dp")),
                     ("the published port's square tile (448^2), its own max |d p|", im.get("port_square_tile_max_abs_dp")),
                     ("vision rows, relative max |d|", im.get("vision_rel_max_abs_d"))]
        out += [f"| {k.replace('|', chr(92) + '|')} | {fig(x)} |" for k, x in rows]
        out += ["", f"Bar: {transcript.get('bar', {}).get('reason', '')}", ""]
    return out


def _host(dist: Dist) -> list[str]:
    out = ["## How a host calls each bundle", ""]
    for b in dist.bundles:
        m = b.manifest
        if b.kind == HEAD_KIND:
            h = m["head"]
            out += [f"`{b.name}`: functions {', '.join(h['functions'])}; inputs in this order:", "",
                    "| input | shape, dtype |", "|---|---|"]
            out += [f"| {n} | {h['inputs'][n]} |" for n in h["input_order"]]
            out += ["", f"Output: {', '.join(f'{k} {v}' for k, v in h['outputs'].items())}. Padding: {h['host_pad_rule']}. "
                    f"Softmax: {h['softmax']}. Lexical rows: {h['lexical']}.", ""]
        elif b.kind == VISION_KIND:
            i, pre = m["interface"], m["preprocess"]
            out += [f"`{b.name}`: functions {', '.join(f['name'] for f in i['functions'])} (buckets of "
                    f"{', '.join(str(x) for x in i['buckets'])} vision tokens; cap {i['cap_tokens']}); inputs in this order: "
                    f"{', '.join(i['input_order'])}; output image_embeds.", "",
                    f"Preprocessing (the host's, numpy + Pillow): {pre['rule']}; mean {pre['image_mean']}, std {pre['image_std']}, "
                    f"{pre['min_pixels']} … {pre['max_pixels']} pixels.", "", f"Call: {i['host_call']}.", ""]
        else:
            i, lang = m["interface"], m["language"]
            images = i.get("vision")
            out += [f"`{b.name}`: function `{i['function']}`; prefill chunk {lang['prefill_chunk']}, context "
                    f"{lang['max_context']}, pad token {lang['pad_token_id']}, "
                    + (f"one image of up to {images['image_rows']} rows a request." if images else "text only."), "",
                    "| | name | shape | dtype |", "|---|---|---|---|"]
            out += [f"| input | {n} | {i['inputs'][n]['shape']} | {i['inputs'][n]['dtype']} |" for n in i["input_order"]]
            out += [f"| state | {n} | {i['states'][n]['shape']} | {i['states'][n]['dtype']} |" for n in i["state_order"]]
            out += [f"| output | {n} | {o['shape']} | {o['dtype']} |" for n, o in i["outputs"].items()]
            out += ["", f"Host loop: {i['host_loop']}.", ""]
            short = i.get("short_functions") or []
            if short:
                out += ["Shorter functions on the same weights: " + ", ".join(f"`{f['function']}` ({f['context']:,} slots)" for f in short)
                        + f". A record runs in the first function whose slots hold its chunks (`{i['function']}` last); their "
                        "states are the ones above with the caches' slot axis at that function's context.", ""]
            if images:
                out += [f"Image inputs: {images['rule']}.", ""]
    heads = [b.name for b in sorted(dist.bundles, key=_head_order) if b.kind == HEAD_KIND]
    if len(heads) > 1:
        out += [f"Several heads: a request runs in the first of {', '.join(f'`{h}`' for h in heads)} whose pads "
                "and buckets take it (narrower pads first, then shorter buckets), in its smallest bucket.", ""]
    return out


def _head_order(b) -> tuple[int, int]:
    """The order a host tries head bundles in (``host.dist.head_order``), from a manifest's JSON."""
    from ..host.dist import head_order
    from ..manifest import pads_of_rule

    if b.kind != HEAD_KIND:
        return 0, 0
    return head_order(*pads_of_rule(b.manifest["head"]["host_pad_rule"]), [t for _, t in b.manifest["head"]["buckets"]])


def _licence(dist: Dist) -> list[str]:
    out = ["## Licence", ""]
    if not dist.licence:
        return out + ["The release carries no LICENSE or NOTICE file; ask its author under which terms it may be used."]
    out.append("The release's own " + " and ".join(f"`{f}`" for f in dist.licence) + " ship beside the bundles.")
    for f in dist.licence:
        if f.startswith("NOTICE"):
            text = (dist.folder / f).read_text(encoding="utf-8", errors="replace").rstrip()
            out += ["", f"{f}:", "", "```", text.replace("```", "'''"), "```"]
    return out
