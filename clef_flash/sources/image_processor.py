"""A release's image processor settings, in either layout: the older ``preprocessor_config.json``
(the settings alone), or ``processor_config.json`` as transformers 5's ``save_pretrained`` writes it
(clef-finetune's make-tiny, every merged fine-tune), the settings under ``"image_processor"`` beside a
``"video_processor"``. The vision build, its gate and the reference all read them here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..bundle import read_json
from ..errors import IntegrityError
from ..layout import PREPROCESSOR_CONFIG, PROCESSOR_CONFIG, PROCESSOR_FILES

IMAGE_PROCESSOR = "image_processor"  # its key in processor_config.json


def processor_files(folder: Path) -> list[str]:
    """The image processor's files the release holds (either layout, or both)."""
    return [f for f in PROCESSOR_FILES if (Path(folder) / f).is_file()]


def image_processor_settings(folder: Path) -> tuple[dict[str, Any], str]:
    """The release's image processor settings and where they were read (for errors): the older
    ``preprocessor_config.json`` where present, else ``processor_config.json``'s ``"image_processor"``.
    Both present and disagreeing is an ``IntegrityError`` naming both; neither, one naming both."""
    folder = Path(folder)
    found = processor_files(folder)
    if not found:
        raise IntegrityError(f"{folder / PREPROCESSOR_CONFIG}: missing, and no {PROCESSOR_CONFIG} either (a release "
                             f"with a vision tower ships its image processor's settings in one of them)")
    read: dict[str, tuple[dict[str, Any], str]] = {}
    for name in found:
        raw = read_json(folder / name)
        if name == PROCESSOR_CONFIG:
            raw = raw.get(IMAGE_PROCESSOR) if isinstance(raw, dict) else None
            if not isinstance(raw, dict):
                raise IntegrityError(f"{folder / name}: no \"{IMAGE_PROCESSOR}\" object (the image processor's settings)")
            read[name] = (raw, f"{folder / name} ({IMAGE_PROCESSOR})")
        else:
            read[name] = (raw if isinstance(raw, dict) else {}, str(folder / name))
    if len(read) == 2:
        (a, _), (b, _) = read[PREPROCESSOR_CONFIG], read[PROCESSOR_CONFIG]
        keys = sorted(k for k in set(a) | set(b) if k not in ("processor_class",) and a.get(k) != b.get(k))
        if keys:
            raise IntegrityError(f"{folder / PREPROCESSOR_CONFIG} and {folder / PROCESSOR_CONFIG}: disagree on "
                                 f"{keys[0]} ({a.get(keys[0])!r} against {b.get(keys[0])!r}); keep one of them")
    return read[found[0]]
