"""What the decoder reads from a release folder: its text configuration (the tokenizer's pad id
where config.json names none), and where a bundle keeps the tokenizer's files."""

from __future__ import annotations

from pathlib import Path

from .contract import TextConfig, read_text_config

TOKENIZER_DIR = "tokenizer"


def tokenizer_pad(source: Path) -> int | None:
    """The tokenizer's pad token id, when config.json names none (read from tokenizer.json)."""
    import json

    try:
        conf = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
        tok = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    pad = conf.get("pad_token")
    pad = pad.get("content") if isinstance(pad, dict) else pad
    for t in tok.get("added_tokens", []):
        if t.get("content") == pad:
            return int(t["id"])
    return None


def release_config(source: Path) -> TextConfig:
    """The release's text configuration, its pad token from the tokenizer when config.json names none;
    shards carrying a layer the configuration does not name are refused (``IntegrityError``)."""
    from ..errors import IntegrityError
    from ..sources.layers import stray_layers
    from .contract import LM

    text = read_text_config(source, tokenizer_pad(source))
    stray = stray_layers(source, LM, len(text.layer_types))
    if stray:
        raise IntegrityError(f"{Path(source) / 'config.json'}: names {len(text.layer_types)} decoder layers; the shards "
                             f"carry {stray[0]}" + (f" (+{len(stray) - 1} more)" if len(stray) > 1 else ""))
    return text
