"""The reference side of ``check-release``: the author's own model, end to end, from a release folder.

How it works: docs/modules.md."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..errors import IntegrityError, ToolchainError, UsageError

WHY_NO_IMAGES = "the author's model is streamed a layer at a time (check-release --stream): text requests only"

TRANSFORMERS_MIN = (5, 10, 2)
EXTRA = "pip install 'clef-export[reference]'"
DTYPES = ("float32", "bfloat16")
DEVICES = ("cpu", "cuda", "mps")


def import_reference() -> None:
    """transformers >= 5.10.2 (Qwen3_5ForConditionalGeneration) and accelerate (``device_map``),
    or one line saying what to install (exit 5)."""
    import importlib

    missing = []
    for name in ("transformers", "accelerate"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ToolchainError(f"check-release needs {' and '.join(missing)} (transformers >= 5.10.2, accelerate), "
                             f"which are not installed: {EXTRA}")
    import transformers

    version = tuple(int(x) for x in transformers.__version__.split(".")[:3] if x.isdigit())
    if version < TRANSFORMERS_MIN or not hasattr(transformers, "Qwen3_5ForConditionalGeneration"):
        raise ToolchainError(f"check-release needs transformers >= 5.10.2 (Qwen3_5ForConditionalGeneration); "
                             f"found {transformers.__version__}: {EXTRA}")


@dataclass
class Seen:
    """What the author's head was called with for one request, and what it returned."""

    hidden: np.ndarray  # [L, H] f32, the backbone's last hidden rows of the real tokens
    ids: np.ndarray  # [L] int64
    record: Any  # the author's EncodedRecord
    probs: list[np.ndarray]  # per question, the author's unrounded probabilities (f32 softmax of its logits)
    image_rows: np.ndarray | None = None  # [N, hidden] f32: the tower's rows transformers put at the image's tokens


def image_text_processor(release: Path, tokenizer: Any):
    """transformers' ``Qwen3VLProcessor`` over the release's tokenizer and its image processor (the
    PIL backend), without the video processor (its class needs torchvision): images only."""
    import json
    import warnings

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    class ImageTextProcessor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None  # images only: the video processor's class is not importable here
            return super().check_argument_for_proper_class(argument_name, argument)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("videos"):
                raise UsageError("requests with videos are not supported (images only)")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # min_pixels / max_pixels per call: deprecated, still honoured
                return super().__call__(*args, **kwargs)

    from .image_processor import image_processor_settings

    raw, path = image_processor_settings(Path(release))
    try:
        image = Qwen2VLImageProcessorPil(**{k: v for k, v in raw.items() if k not in ("image_processor_type", "processor_class")})
    except (ValueError, TypeError) as exc:
        raise IntegrityError(f"{path}: not a Qwen2-VL image processor configuration ({str(exc).splitlines()[0][:160]})") from None
    return ImageTextProcessor(image_processor=image, tokenizer=tokenizer, video_processor=None)


class TextProcessor(SimpleNamespace):
    """What ``systemone`` needs of the processor for a text-only request: ``.tokenizer``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - images are refused earlier
        raise UsageError("requests with images or videos are not supported by check-release (text only)")


class Reference:
    """The author's model of one release folder on one device, answering requests with ``systemone``."""

    def __init__(self, release: Path, module: Any, config: Any, state: dict[str, Any], *, device: str, dtype: str,
                 streamed: Any = None, log=lambda msg: None):
        """``streamed``: a stand-in for the backbone that holds one decoder layer's weights at a time
        (``check.streamed_reference.StreamedBackbone``: text requests only), or None: transformers'
        whole model, as the author loads it."""
        import torch
        from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration
        from transformers.utils import logging as hf_logging

        from .author import build_head

        if dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if device not in DEVICES:
            raise UsageError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device cuda: torch sees no CUDA device here")
        if device == "mps" and not torch.backends.mps.is_available():
            raise UsageError("--device mps: torch sees no MPS device here")
        hf_logging.set_verbosity_error()  # the kernels' fallback notices are not the user's business
        hf_logging.disable_progress_bar()
        self.module = module
        self.device = device
        torch_dtype = getattr(torch, dtype)
        release = Path(release)
        self.streamed = streamed is not None
        try:
            backbone = streamed if self.streamed else \
                Qwen3_5ForConditionalGeneration.from_pretrained(release, dtype=torch_dtype, device_map={"": device})
        except (OSError, ValueError, KeyError) as exc:
            raise IntegrityError(f"{release}: cannot load the backbone with Qwen3_5ForConditionalGeneration "
                                 f"({str(exc).splitlines()[0][:200]})") from None
        backbone.config.use_cache = False
        head = build_head(module, config, state, torch_dtype, release / "joint_head.safetensors").to(device)
        try:
            tokenizer = AutoTokenizer.from_pretrained(release)
        except (OSError, ValueError) as exc:
            raise IntegrityError(f"{release}: cannot load the tokenizer ({str(exc).splitlines()[0][:200]})") from None
        if tokenizer.pad_token_id is None:
            raise IntegrityError(f"{release}: the tokenizer has no pad token (systemone pads with it)")
        from .image_processor import processor_files

        self.images = bool(processor_files(release)) and not self.streamed
        self.processor = image_text_processor(release, tokenizer) if self.images else TextProcessor(tokenizer=tokenizer)
        if self.images and getattr(backbone.config, "image_token_id", None) != self.processor.image_token_id:
            # the model puts the tower's rows where config.json's id stands; the processor writes the tokenizer's
            raise IntegrityError(f"{release / 'config.json'}: image_token_id {getattr(backbone.config, 'image_token_id', None)} "
                                 f"is not the tokenizer's <|image_pad|> ({self.processor.image_token_id})")
        self.model = module.ClefModel(backbone, head).eval()
        self.head = head
        self._seen: list[tuple[tuple, Any]] = []
        self._tower: list[Any] = []
        head.register_forward_hook(lambda _m, args, out: self._seen.append((args, out)))
        if self.streamed:
            self.why_no_images = WHY_NO_IMAGES
            log(f"reference: {release.name} backbone streamed a layer at a time ({backbone.parameter_count:,} parameters: "
                f"transformers' own text model, one layer's weights read where it runs), {dtype} on {device}")
        else:
            backbone.model.visual.register_forward_hook(lambda _m, args, out: self._tower.append(out.pooler_output))
            log(f"reference: {release.name} backbone {type(backbone).__name__} ({sum(p.numel() for p in backbone.parameters()):,} "
                f"parameters), {dtype} on {device}")

    def encode(self, request: dict[str, Any]) -> Any:
        """The author's ``encode_record`` exactly as ``systemone`` calls it (an image: through the processor)."""
        return self.module.encode_record(self.processor.tokenizer, request, processor=self.processor)

    def answer(self, request: dict[str, Any]) -> tuple[dict[str, Any], Seen]:
        """The author's ``systemone`` response, and what its head saw and said."""
        self._seen.clear()
        self._tower.clear()
        response = self.module.systemone(self.model, self.processor, request)
        if len(self._seen) != 1:
            raise RuntimeError(f"the author's head ran {len(self._seen)} times for one request")
        (hidden, input_ids, mask, records, _table), logits = self._seen[0]
        self._seen.clear()
        length = int(mask[0].sum().item())
        seen = Seen(
            hidden=hidden[0, :length].float().cpu().numpy(),
            ids=input_ids[0, :length].cpu().numpy(),
            record=records[0],
            # systemone's own conversion: question_logits.float().softmax(-1)
            probs=[q.float().softmax(-1).cpu().numpy() for q in logits[0]],
            image_rows=self._tower[0].float().cpu().numpy() if self._tower else None,
        )
        self._tower.clear()
        return response, seen

