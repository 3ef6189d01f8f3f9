"""The 9B's vision tower for a synthetic release at real width (``synth-release --size 9b --vision``):
its configuration, its tensors' names and shapes, and the image processor's configuration.
``backbone.synth.write_wide_release`` writes them beside the text decoder (random bf16)."""

from __future__ import annotations

from typing import Any

# Qwen3.5-9B's vision tower (SOURCE: the release's config.json vision_config)
VISION_9B: dict[str, Any] = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                             "num_position_embeddings": 2304, "out_hidden_size": 4096, "patch_size": 16,
                             "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
                             "hidden_act": "gelu_pytorch_tanh"}


def wide_tower(text: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[int, ...]], dict[str, Any]]:
    """(vision_config, tensor name -> shape, preprocessor_config.json) for ``text``'s hidden size."""
    from .release import PREPROCESSOR
    from ..vision.contract import vision_config, weight_names

    conf = {**VISION_9B, "out_hidden_size": text["hidden_size"],
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"}}
    return conf, weight_names(vision_config({"vision_config": conf}, "vision_config")), dict(PREPROCESSOR)
