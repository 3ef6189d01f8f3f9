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

from ..sources.author import AUTHOR_SHA256, build_head, read_verified
from ..bundle import atomic_write_json, check_output_path, output_lock, staged_dir
from ..layout import PREPROCESSOR_CONFIG, PROCESSOR_FILES
from ..head.contract import CONFIGS
from ..digest import sha256_bytes, sha256_file
from ..sources.pins import CODE_FILE, CONFIG_FILE, WEIGHTS_FILE, Pins

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

    from ..sources.author import load_author_module

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

    from ..sources.lm_head import INDEX_FILE, TENSOR

    first, second = LM_HEAD_SHARDS
    save_file({"model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}, str(folder / first),
              metadata={"format": "pt", "synthetic": "true"})
    save_file({TENSOR: synth_lm_head(vocab, hidden, seed)}, str(folder / second), metadata={"format": "pt", "synthetic": "true"})
    index = {"metadata": {"total_size": (vocab * hidden + hidden) * 2, "synthetic": True},
             "weight_map": {TENSOR: second, "model.norm.weight": first}}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return {name: sha256_file(folder / name) for name in (INDEX_FILE, first, second)}


def _config_model(config: dict):
    from ..sources.author import HeadConfig

    return HeadConfig.model_validate(config)


# The files a clef-finetune release folder holds besides the head's (the backbone itself is not
# needed to export or check the head: config.json says what it is, model.safetensors carries
# the embeddings and lm_head.weight the host's lexical table comes from).
RELEASE_PROVENANCE = "CLEF_FINETUNE.json"
RELEASE_TINY_MARKER = "TINY_RANDOM_MODEL.txt"


def write_release(out: Path, *, config_name: str | dict, seed: int, author_code: Path, vocab: int = 512,
                  layout: str = "single", backbone: str = "stub", overwrite: bool = False, variant: str = "tiny",
                  processor_file: str = PREPROCESSOR_CONFIG, tokenizer: str = "bytes") -> Path:
    """A release folder in clef-finetune's layout, with random weights: ``config.json``, the
    backbone's ``model.safetensors`` (``single``; ``sharded`` with an index; ``tied``: no
    ``lm_head.weight``), the head's three files as ``merge`` writes them (the author's unmodified
    file, ``joint_head_config.json`` without ``dropout``), ``CLEF_FINETUNE.json`` and the
    tiny-random marker. No pins: ``clef-export pin`` makes them. ``CLEF_FINETUNE.json`` names this
    writer as its tool: nothing here claims to be clef-finetune's output.

    ``backbone="stub"`` writes only the tensors the head's export needs (embeddings, final norm,
    lm_head); ``backbone="qwen3_5"`` writes a real tiny ``Qwen3_5ForConditionalGeneration`` and a
    byte-level tokenizer (``write_qwen3_5_backbone``; needs transformers), so the author's own
    model answers requests from the folder (``check-release``), with its image processor's settings in
    ``processor_file``: ``preprocessor_config.json`` (the older layout) or ``processor_config.json``
    (transformers 5's, as make-tiny writes it), and ``tokenizer``: ``bytes`` (a token a byte) or
    ``words`` (``words_tokenizer``: about a token a word; ``vocab`` at least ``WORDS_VOCAB``)."""
    import torch
    from safetensors.torch import save_file

    from ..sources.author import load_author_module

    if layout not in ("single", "sharded", "tied"):
        raise ValueError(f"layout must be single, sharded or tied, got {layout!r}")
    if backbone not in ("stub", "qwen3_5"):
        raise ValueError(f"backbone must be stub or qwen3_5, got {backbone!r}")
    if processor_file not in PROCESSOR_FILES:
        raise ValueError(f"processor_file must be one of {', '.join(PROCESSOR_FILES)}, got {processor_file!r}")
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {', '.join(TOKENIZERS)}, got {tokenizer!r}")
    if backbone == "qwen3_5" and layout != "single":
        raise ValueError("a qwen3_5 backbone is written as one model.safetensors with lm_head.weight (layout single)")
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
    tensors = {"model.language_model.embed_tokens.weight": embed,
               "model.language_model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    if layout != "tied":
        tensors["lm_head.weight"] = synth_lm_head(vocab, hidden, seed)
    with output_lock(out), staged_dir(out, overwrite) as tmp:
        (tmp / CODE_FILE).write_bytes(code)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        meta = {"format": "pt"}
        if backbone == "qwen3_5":
            text, shard = VARIANTS[variant]
            write_qwen3_5_backbone(tmp, hidden=hidden, vocab=vocab, seed=seed, text=text, max_shard_size=shard,
                                   processor_file=processor_file, tokenizer=tokenizer)
        elif layout == "sharded":
            from ..sources.lm_head import INDEX_FILE

            shards = {"model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if k != "lm_head.weight"},
                      "model-00002-of-00002.safetensors": {"lm_head.weight": tensors["lm_head.weight"]}}
            for shard, part in shards.items():
                save_file(part, str(tmp / shard), metadata=meta)
            index = {"metadata": {"total_size": sum(t.numel() * 2 for t in tensors.values())},
                     "weight_map": {k: shard for shard, part in shards.items() for k in part}}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        else:
            save_file(tensors, str(tmp / "model.safetensors"), metadata=meta)
        if backbone == "stub":
            (tmp / "config.json").write_text(json.dumps({
                "architectures": ["Qwen3_5ForConditionalGeneration"],
                "text_config": {"hidden_size": hidden, "vocab_size": vocab, "tie_word_embeddings": layout == "tied"},
                "tie_word_embeddings": layout == "tied",
            }, indent=2, sort_keys=True) + "\n")
        (tmp / RELEASE_PROVENANCE).write_text(json.dumps({
            "tool": "clef-export synth (clef-finetune's release layout, random weights)",
            "base_model": "synthetic/tiny-qwen3_5" if backbone == "qwen3_5" else "synthetic/tiny-backbone",
            "checkpoint": f"synthetic-seed{seed}",
            "dtype": "bfloat16",
            "head_dtype": "bfloat16",
            "joint_schema_model_sha256": sha256_bytes(code),
            "train_config": {"config": name, "seed": seed},
        }, indent=2, sort_keys=True) + "\n")
        (tmp / RELEASE_TINY_MARKER).write_text("A tiny random model for tests: its answers mean nothing.\n")
    return out


# ---------------------------------------------------------------- a real tiny backbone

# clef-finetune make-tiny's head configuration (its joint_head_config.json has no dropout key)
MAKE_TINY_HEAD: dict[str, int] = {"hidden_size": 64, "width": 32, "routing_layers": 1, "layers": 1, "heads": 2,
                                  "feedforward": 64}
# Qwen's chat, thinking and vision markers: the author's prompt uses them, so each is one token
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>", "<think>", "</think>")
# dimensions of the final norm scaled up, as real backbones have a few outlier dimensions in
# their last hidden rows (large norms are what fp32 host code has to survive)
OUTLIER_DIMS = (3, 17, 41)
OUTLIER_SCALE = 24.0


def byte_tokenizer():
    """A byte-level tokenizer: one token per UTF-8 byte (256 ids), then the special tokens.
    Token counts are byte counts, so a request's encoded length is easy to aim at."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


# Qwen's pre-tokenizer split (its tokenizer.json's regex): words, single digits, punctuation runs, newlines
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
# the words the ``words`` tokenizer is trained on: what requests and the clients' instructions say
CORPUS_WORDS = (
    "the a an of to and or in on for with by from as at is are was be not no yes true false this that these those "
    "it its which what who how why when where does do did has have had can should would must may will all any each "
    "every one two three four five first last next more most less least only also than then there their they we "
    "you your our us he she his her them if else answer answers question questions query document documents doc "
    "chunk chunks text state schema field fields option options allowed type score scores choice noul relevant "
    "relevance irrelevant essential background information needed need contains use using judge given scale "
    "number retrieved context retrieval augmented pipeline filtering proposition instruction instructions "
    "criteria decide decision jointly complete read exactly must each paragraph paragraphs screen screening "
    "customer order parcel refund ticket team billing shipping returns delivery charges desk leg cracked "
    "arrived crushed wants card declined twice escalate today severity low mid high critical calm upset "
    "message first second label labels image banner photo kind rate rating model evaluate evaluation data "
    "topic related depends depend on contains needs without with about between against into over under "
    "good bad best worst new old large small long short time day week year people user users system"
).split()


def qwen_style_bpe(corpus: list[str], vocab_size: int, special_tokens: list[str]):
    """A byte-level BPE with merges as Qwen's is built (its split regex, NFC, byte-level), trained on
    ``corpus``: deterministic for one corpus (a ``tokenizers.Tokenizer``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_SPLIT), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok


def words_tokenizer():
    """``qwen_style_bpe`` trained on seeded sentences of ``CORPUS_WORDS``, the special tokens added:
    about a token a common word, as a real tokenizer spends, so a tiny release takes the clients' real
    requests (64 questions) within 16,384 tokens; the same ids on every machine."""
    import random

    from transformers import PreTrainedTokenizerFast

    rng = random.Random(20261207)
    punct = [" ", " ", " ", " ", ", ", ". ", ": ", "? ", "\n", " (", ") ", "\"", "_", "-", "{", "}", "[", "]"]
    corpus = ["".join(rng.choice(CORPUS_WORDS) + rng.choice(punct) + (str(rng.randrange(100)) if rng.random() < 0.05 else "")
                      for _ in range(60)) for _ in range(3000)]
    tok = qwen_style_bpe(corpus, WORDS_VOCAB - len(SPECIAL_TOKENS), [])
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


WORDS_VOCAB = 1024  # the words tokenizer's ids, special tokens included
TOKENIZERS = {"bytes": byte_tokenizer, "words": words_tokenizer}


# Another Qwen3.5 text configuration than make-tiny's, for the backbone's tests: other widths and
# head counts, grouped linear-attention heads of unequal key / value sizes, a conv kernel of 3, half
# the head dimension rotary, five layers in another pattern; written as two shards with an index.
OTHER_TEXT: dict = {"hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 5,
                    "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention",
                                    "linear_attention"],
                    "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32, "linear_key_head_dim": 8,
                    "linear_value_head_dim": 12, "linear_num_key_heads": 2, "linear_num_value_heads": 6,
                    "linear_conv_kernel_dim": 3,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5}}
OTHER_HEAD: dict[str, int] = {**{"hidden_size": 96, "width": 32, "routing_layers": 1, "layers": 1, "heads": 2,
                                 "feedforward": 64}}
VARIANTS = {"tiny": (None, None), "other": (OTHER_TEXT, "200KB")}
# Qwen3.5's image processor configuration (patch 16, merge 2, two frames, mean = std = 0.5, bicubic,
# 256^2 ... 4096^2 pixels), as a release ships it beside its tower
PREPROCESSOR: dict = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
                      "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                      "image_std": [0.5, 0.5, 0.5], "resample": 3, "do_resize": True, "do_rescale": True,
                      "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
                      "size": {"shortest_edge": 256 * 256, "longest_edge": 4096 * 4096}}


# the video processor's settings make-tiny's processor_config.json carries beside the image one's
# (not read: videos are refused)
VIDEO_PROCESSOR: dict = {"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16, "temporal_patch_size": 2,
                         "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "fps": 2,
                         "size": {"shortest_edge": 131072, "longest_edge": 786432}}


def write_qwen3_5_backbone(folder: Path, *, hidden: int, vocab: int, seed: int, text: dict | None = None,
                           max_shard_size: str | None = None, processor_file: str = PREPROCESSOR_CONFIG,
                           tokenizer: str = "bytes") -> None:
    """A tiny ``Qwen3_5ForConditionalGeneration`` (3 linear-attention layers + 1 full-attention
    layer, a one-block vision tower, untied lm_head) stored bf16 as one ``model.safetensors``, with
    ``config.json``, ``generation_config.json`` and the tokenizer files, seeded. ``text`` replaces
    parts of the text configuration; ``max_shard_size`` writes shards and an index."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    if hidden % 16:
        raise ValueError(f"a tiny Qwen3.5 backbone needs a hidden size divisible by 16, got {hidden}")
    tokenizer = TOKENIZERS[tokenizer]()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    if vocab <= max(ids.values()):
        raise ValueError(f"vocab {vocab} is smaller than the tokenizer's {max(ids.values()) + 1} ids")
    config = Qwen3_5Config(
        text_config={"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden,
                     "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hidden // 4,
                     "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
                     "linear_num_value_heads": 4, "max_position_embeddings": 32768, "tie_word_embeddings": False,
                     "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"], **(text or {})},
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": hidden, "num_position_embeddings": 64},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        norm = model.model.language_model.norm.weight
        for d in OUTLIER_DIMS:
            if d < hidden:
                norm[d] = norm[d] + OUTLIER_SCALE
    model.to(torch.bfloat16).save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer.save_pretrained(folder)
    write_processor_settings(Path(folder), processor_file)


def write_processor_settings(folder: Path, processor_file: str) -> None:
    """``PREPROCESSOR`` as ``preprocessor_config.json``, or under ``"image_processor"`` of a
    ``processor_config.json`` beside a video processor's settings (transformers 5's layout)."""
    if processor_file == PREPROCESSOR_CONFIG:
        data = PREPROCESSOR
    else:
        image = {k: v for k, v in PREPROCESSOR.items() if k != "processor_class"}
        data = {"processor_class": PREPROCESSOR["processor_class"], "image_processor": image, "video_processor": VIDEO_PROCESSOR}
    (folder / processor_file).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
