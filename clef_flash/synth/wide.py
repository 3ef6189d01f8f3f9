"""A synthetic release at real width, written streamed: the 9B's Qwen3.5 text configuration (all
32 layers, or a slice of them), random bf16 weights, sharded safetensors with an index, written
tensor by tensor in row blocks (bounded memory at any size), beside the head's files at the real
head configuration, clef-finetune's ``CLEF_FINETUNE.json`` and the byte-level tokenizer.

How it works: docs/modules.md."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..bundle import check_output_path, output_lock, staged_dir
from ..errors import UsageError
from ..progress import plural

# Qwen3.5-9B's text configuration (SOURCE: the release's config.json text_config)
TEXT_9B: dict[str, Any] = {
    "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "attn_output_gate": True,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "pad_token_id": 248044,
    "eos_token_id": 248046, "model_type": "qwen3_5_text",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
}
SIZES = {"9b": TEXT_9B}
TINY_VISION: dict[str, Any] = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
SHARD_BYTES = 2 << 30  # shards of at most 2 GiB, as save_pretrained's max_shard_size would cut them
_BLOCK = 1 << 24  # values generated at a time (64 MB of fp32)


def text_config(size: str, layers: int | None = None) -> dict[str, Any]:
    if size not in SIZES:
        raise UsageError(f"--size must be one of {', '.join(SIZES)}, got {size!r}")
    text = json.loads(json.dumps(SIZES[size]))
    if layers is not None:
        if not 1 <= layers <= text["num_hidden_layers"]:
            raise UsageError(f"--layers must be 1 … {text['num_hidden_layers']}, got {layers}")
        text["layer_types"] = text["layer_types"][:layers]
        text["num_hidden_layers"] = layers
    return text


def _bf16(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits, rounded to nearest even."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _values(name: str, shape: tuple[int, ...], rng: np.random.Generator, n: int) -> np.ndarray:
    """n values of a tensor the way a trained checkpoint roughly looks (matrices of std 0.02)."""
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, n)).astype(np.float32)
    if name.endswith("dt_bias"):
        return rng.uniform(0.5, 1.5, n).astype(np.float32)
    if name.startswith("model.visual.") and len(shape) == 1:  # LayerNorm scales near 1, small biases
        return ((1.0 if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith("norm.weight")
                 else 0.0) + 0.05 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)
    if len(shape) == 1:  # zero-centred norm scales: the model multiplies by 1 + w
        return (0.05 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)
    if name.endswith("conv1d.weight"):
        return 0.2 * rng.standard_normal(n, dtype=np.float32)
    return 0.02 * rng.standard_normal(n, dtype=np.float32)


def _plan_shards(tensors: dict[str, tuple[int, ...]]) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name in tensors:
        nbytes = int(np.prod(tensors[name])) * 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_shard(path: Path, names: list[str], tensors: dict[str, tuple[int, ...]], rng: np.random.Generator) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name in names:
        nbytes = int(np.prod(tensors[name])) * 2
        header[name] = {"dtype": "BF16", "shape": list(tensors[name]), "data_offsets": [at, at + nbytes]}
        at += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for name in names:
            total = int(np.prod(tensors[name]))
            for start in range(0, total, _BLOCK):
                n = min(_BLOCK, total - start)
                fh.write(_bf16(_values(name, tensors[name], rng, n)).tobytes())


def write_wide_release(out: Path, *, size: str, layers: int | None, seed: int, author_code: Path,
                       overwrite: bool = False, log: Callable[[str], None] = lambda m: None,
                       tower: Callable[[dict], tuple[dict, dict, dict]] | None = None) -> Path:
    """The release folder (see the module); pin it with ``clef-export pin``."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3_5Config

    from ..sources.author import AUTHOR_SHA256, load_author_module, read_verified
    from ..digest import sha256_bytes
    from ..sources.pins import CODE_FILE, CONFIG_FILE, WEIGHTS_FILE
    from .release import RELEASE_PROVENANCE, RELEASE_TINY_MARKER, _config, byte_tokenizer, synth_state
    from ..backbone.contract import text_config as parse_text
    from ..backbone.contract import weight_names
    from ..sources.safetensors import INDEX_FILE

    text = text_config(size, layers)
    out = Path(out)
    check_output_path(out, overwrite)
    code = read_verified(Path(author_code), AUTHOR_SHA256, "refusing to copy it")
    module = load_author_module(Path(author_code), AUTHOR_SHA256)
    name, head_config = _config("real")
    head_config.pop("dropout", None)
    if head_config["hidden_size"] != text["hidden_size"]:
        raise UsageError(f"the real head's hidden size {head_config['hidden_size']} is not the {size}'s {text['hidden_size']}")
    tokenizer = byte_tokenizer()
    # ``tower(text)``: (vision_config, its tensors, preprocessor_config.json) of a tower to write too
    # (``vision.synth.wide_tower``); else config.json names a tiny tower whose weights are not written
    vision_config, tower_tensors, preprocessor = tower(text) if tower else ({**TINY_VISION, "out_hidden_size": text["hidden_size"]}, {}, None)
    from .release import SPECIAL_TOKENS

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}  # the markers are this tokenizer's ids
    config = Qwen3_5Config(text_config=text, vision_config=vision_config, tie_word_embeddings=False,
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    cfg = parse_text(config.to_dict(), "config.json")
    tensors = dict(sorted(weight_names(cfg).items()))
    tensors.update(sorted(tower_tensors.items()))
    tensors["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    rng = np.random.default_rng([seed, 20])
    with output_lock(out), staged_dir(out, overwrite) as tmp:
        (tmp / CODE_FILE).write_bytes(code)
        (tmp / CONFIG_FILE).write_text(json.dumps(head_config, indent=2, sort_keys=True) + "\n")
        with torch.random.fork_rng(devices=[]):
            save_file(synth_state({**head_config, "dropout": 0.0}, seed, module), str(tmp / WEIGHTS_FILE),
                      metadata={"format": "pt"})
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if preprocessor is not None:
            (tmp / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2, sort_keys=True) + "\n")
        shards = _plan_shards(tensors)
        weight_map = {}
        for i, names in enumerate(shards, 1):
            shard = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            log(f"writing {shard}: {plural(len(names), 'tensor')}")
            _write_shard(tmp / shard, names, tensors, rng)
            weight_map.update({n: shard for n in names})
        total = sum(int(np.prod(s)) * 2 for s in tensors.values())
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2, sort_keys=True) + "\n")
        (tmp / RELEASE_PROVENANCE).write_text(json.dumps({
            "tool": "clef-export synth-release --size (clef-finetune's release layout, random weights)",
            "base_model": f"synthetic/qwen3_5-{size}" + (f"-{layers}-layers" if layers else ""),
            "checkpoint": f"synthetic-seed{seed}", "dtype": "bfloat16", "head_dtype": "bfloat16",
            "joint_schema_model_sha256": sha256_bytes(code), "train_config": {"config": name, "seed": seed},
        }, indent=2, sort_keys=True) + "\n")
        (tmp / RELEASE_TINY_MARKER).write_text("A random model for tests and benchmarks: its answers mean nothing.\n")
    return out
