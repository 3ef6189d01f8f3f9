"""A synthetic source snapshot: the head's files at any configuration, random bf16 weights.

The Hub cannot be reached here, so the pipeline runs on a snapshot made by this module: the
author's verified ``joint_schema_model.py``, a ``joint_head_config.json`` and a
``joint_head.safetensors`` of seeded random values stored bf16, plus its own pins file. Everything
built from it says ``synthetic``: it never claims to be the real checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from .author import AUTHOR_SHA256, build_head, read_verified
from .bundle import atomic_write_json, check_output_path, output_lock, staged_dir
from .contract import CONFIGS
from .digest import sha256_bytes, sha256_file
from .pins import CODE_FILE, CONFIG_FILE, WEIGHTS_FILE, Pins

SYNTH_HF_ID = "synthetic/clef-flash-head"


def synth_state(config: dict, seed: int, module=None) -> dict:
    """Seeded random weights for every parameter (norm scales near 1, small biases, fan-in
    scaled matrices, non-zero scalars), so every term of the forward is exercised."""
    import torch

    names_shapes: dict[str, tuple[int, ...]]
    if module is not None:
        with torch.device("meta"):
            head = module.JointSchemaHead(**config)
        names_shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    else:
        raise ValueError("synth_state needs the author's module to know the parameter names")
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name in sorted(names_shapes):
        shape = names_shapes[name]
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        if len(shape) == 0:
            x = 0.5 * x
        elif len(shape) == 1 and name.endswith(".weight"):
            x = 1.0 + 0.1 * x  # LayerNorm scales
        elif len(shape) == 1:
            x = 0.02 * x
        else:
            x = x / math.sqrt(shape[-1])
        state[name] = x.to(torch.bfloat16)
    return state


def _revision(files: dict[str, str]) -> str:
    """A 40-hex stand-in commit for a synthetic snapshot, derived from its files' digests."""
    return hashlib.sha1("".join(f"{k}:{v}\n" for k, v in sorted(files.items())).encode()).hexdigest()


def synth_lm_head(vocab: int, hidden: int, seed: int):
    """A seeded ``lm_head.weight`` [vocab, hidden] in bf16, built in row blocks (bounded memory)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    out = torch.empty((vocab, hidden), dtype=torch.bfloat16)
    for r0 in range(0, vocab, 8192):
        r1 = min(vocab, r0 + 8192)
        out[r0:r1] = (0.02 * torch.randn((r1 - r0, hidden), generator=gen)).to(torch.bfloat16)
    return out


LM_HEAD_SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _config(config_name: str | dict) -> tuple[str, dict]:
    if isinstance(config_name, dict):
        return "custom", dict(config_name)
    if config_name not in CONFIGS:
        raise ValueError(f"unknown config {config_name!r}; expected one of {sorted(CONFIGS)}")
    return config_name, dict(CONFIGS[config_name])


def write_synth(out: Path, *, config_name: str | dict, seed: int, author_code: Path, overwrite: bool = False,
                lm_head_vocab: int | None = None) -> Pins:
    """Write a snapshot-shaped folder and its pins (``pins.json``) atomically; return the pins.
    ``config_name`` names a configuration in ``contract.CONFIGS`` or is the configuration itself."""
    import torch
    from safetensors.torch import save

    from .author import load_author_module

    config_name, config = _config(config_name)
    out = Path(out)
    check_output_path(out, overwrite)
    code = read_verified(Path(author_code), AUTHOR_SHA256, "refusing to copy it")
    module = load_author_module(Path(author_code), AUTHOR_SHA256)
    state = synth_state(config, seed, module)
    # Prove the weights load strictly into the author's class before anything is written.
    build_head(module, _config_model(config), state, torch.float32, out / WEIGHTS_FILE)
    weights = save(state, metadata={"synthetic": "true", "seed": str(seed), "config": config_name})
    config_bytes = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    files = {
        CODE_FILE: sha256_bytes(code),
        CONFIG_FILE: sha256_bytes(config_bytes),
        WEIGHTS_FILE: sha256_bytes(weights),
    }
    revision = _revision(files)
    pins = Pins(
        hf_id=SYNTH_HF_ID,
        revision=revision,
        files=files,
        synthetic=True,
        name="clef_flash",  # bundles of the synthetic head carry the published names
        note=f"SYNTHETIC: random bf16 weights, config {config_name}, seed {seed}; not the real checkpoint",
    )
    with output_lock(out), staged_dir(out, overwrite) as tmp:
        (tmp / CODE_FILE).write_bytes(code)
        (tmp / CONFIG_FILE).write_bytes(config_bytes)
        (tmp / WEIGHTS_FILE).write_bytes(weights)
        if lm_head_vocab:
            files.update(_write_lm_head(tmp, lm_head_vocab, int(config["hidden_size"]), seed))
            revision = _revision(files)
            pins = pins.model_copy(update={"files": dict(sorted(files.items())), "revision": revision})
        atomic_write_json(tmp / "pins.json", pins.model_dump(mode="json"))
    return pins


def _write_lm_head(folder: Path, vocab: int, hidden: int, seed: int) -> dict[str, str]:
    """A backbone-shaped pair of shards and their index; ``lm_head.weight`` in the second."""
    import torch
    from safetensors.torch import save_file

    from .lm_head import INDEX_FILE, TENSOR

    first, second = LM_HEAD_SHARDS
    save_file({"model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}, str(folder / first),
              metadata={"format": "pt", "synthetic": "true"})
    save_file({TENSOR: synth_lm_head(vocab, hidden, seed)}, str(folder / second), metadata={"format": "pt", "synthetic": "true"})
    index = {"metadata": {"total_size": (vocab * hidden + hidden) * 2, "synthetic": True},
             "weight_map": {TENSOR: second, "model.norm.weight": first}}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return {name: sha256_file(folder / name) for name in (INDEX_FILE, first, second)}


def _config_model(config: dict):
    from .author import HeadConfig

    return HeadConfig.model_validate(config)


# The files a clef-finetune release folder holds besides the head's (the backbone itself is not
# needed to export or check the head: config.json says what it is, model.safetensors carries
# the embeddings and lm_head.weight the host's lexical table comes from).
RELEASE_PROVENANCE = "CLEF_FINETUNE.json"
RELEASE_TINY_MARKER = "TINY_RANDOM_MODEL.txt"


def write_release(out: Path, *, config_name: str | dict, seed: int, author_code: Path, vocab: int = 512,
                  layout: str = "single", overwrite: bool = False) -> Path:
    """A release folder in clef-finetune's layout, with random weights: ``config.json``, the
    backbone's ``model.safetensors`` (``single``; ``sharded`` with an index; ``tied``: no
    ``lm_head.weight``), the head's three files as ``merge`` writes them (the author's unmodified
    file, ``joint_head_config.json`` without ``dropout``), ``CLEF_FINETUNE.json`` and the
    tiny-random marker. No pins: ``clef-export pin`` makes them. ``CLEF_FINETUNE.json`` names this
    writer as its tool: nothing here claims to be clef-finetune's output."""
    import torch
    from safetensors.torch import save_file

    from .author import load_author_module

    if layout not in ("single", "sharded", "tied"):
        raise ValueError(f"layout must be single, sharded or tied, got {layout!r}")
    name, config = _config(config_name)
    config.pop("dropout", None)  # clef-finetune writes the constructor's arguments without it
    out = Path(out)
    check_output_path(out, overwrite)
    code = read_verified(Path(author_code), AUTHOR_SHA256, "refusing to copy it")
    module = load_author_module(Path(author_code), AUTHOR_SHA256)
    state = synth_state({**config, "dropout": 0.0}, seed, module)
    hidden = int(config["hidden_size"])
    gen = torch.Generator().manual_seed(seed + 1)
    embed = (torch.randn(vocab, hidden, generator=gen) * 0.02).to(torch.bfloat16)
    backbone = {"model.language_model.embed_tokens.weight": embed,
                "model.language_model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    if layout != "tied":
        backbone["lm_head.weight"] = synth_lm_head(vocab, hidden, seed)
    with output_lock(out), staged_dir(out, overwrite) as tmp:
        (tmp / CODE_FILE).write_bytes(code)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        meta = {"format": "pt"}
        if layout == "sharded":
            from .lm_head import INDEX_FILE

            shards = {"model-00001-of-00002.safetensors": {k: v for k, v in backbone.items() if k != "lm_head.weight"},
                      "model-00002-of-00002.safetensors": {"lm_head.weight": backbone["lm_head.weight"]}}
            for shard, tensors in shards.items():
                save_file(tensors, str(tmp / shard), metadata=meta)
            index = {"metadata": {"total_size": sum(t.numel() * 2 for t in backbone.values())},
                     "weight_map": {k: shard for shard, tensors in shards.items() for k in tensors}}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        else:
            save_file(backbone, str(tmp / "model.safetensors"), metadata=meta)
        (tmp / "config.json").write_text(json.dumps({
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "text_config": {"hidden_size": hidden, "vocab_size": vocab, "tie_word_embeddings": layout == "tied"},
            "tie_word_embeddings": layout == "tied",
        }, indent=2, sort_keys=True) + "\n")
        (tmp / RELEASE_PROVENANCE).write_text(json.dumps({
            "tool": "clef-export synth (clef-finetune's release layout, random weights)",
            "base_model": "synthetic/tiny-backbone",
            "checkpoint": f"synthetic-seed{seed}",
            "dtype": "bfloat16",
            "head_dtype": "bfloat16",
            "joint_schema_model_sha256": sha256_bytes(code),
            "train_config": {"config": name, "seed": seed},
        }, indent=2, sort_keys=True) + "\n")
        (tmp / RELEASE_TINY_MARKER).write_text("A tiny random model for tests: its answers mean nothing.\n")
    return out
