"""The decoder's layer count, which a release states three ways: ``config.json``'s
``num_hidden_layers``, its ``layer_types``, and the layers its shards carry. Where they disagree
the export would build one count and transformers (the gate's reference) another: refused before
any work, naming ``config.json``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .safetensors import read_header, shard_files


def layer_count_problems(raw: dict[str, Any]) -> list[str]:
    """``num_hidden_layers`` against ``layer_types`` (of ``text_config`` where there is one)."""
    t = raw.get("text_config", raw) if isinstance(raw, dict) else {}
    n, types = t.get("num_hidden_layers"), t.get("layer_types")
    if n is None or not isinstance(types, list):
        return []
    if not isinstance(n, int) or isinstance(n, bool) or n != len(types):
        return [f"num_hidden_layers {n!r} beside {len(types)} layer_types"]
    return []


def stray_layers(folder: Path, prefix: str, layers: int) -> list[str]:
    """Tensors the shards carry for a layer at or past ``layers`` (named ``{prefix}layers.N.``)."""
    pattern = re.compile(re.escape(prefix) + r"layers\.(\d+)\.")
    out = []
    for shard in shard_files(folder):
        for name in read_header(Path(folder) / shard)["header"]:
            m = pattern.match(name)
            if m and int(m.group(1)) >= layers:
                out.append(name)
    return sorted(out)
