"""Write the project's image requests: a few small images drawn here (shapes and gradients, no
photographs, nothing anyone else made), several aspect ratios, one over the vision asset's cap of
1,024 tokens and the same one bounded by its request's media_kwargs, and
``conversion/requests-images.jsonl`` naming them by paths relative to it.

    python conversion/scripts/make_images.py

Deterministic: the same bytes on every run (Pillow's PNG writer, no timestamps).
"""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent.parent
IMAGES = HERE / "images"

# name -> (width, height, what is drawn); tokens at the processor's patch 16, merge 2, 256^2 px minimum
SPECS = {
    "wide-banner.png": (512, 128, "a banner: three boxes"),  # 4 x 16 = 64 tokens
    "screenshot.png": (640, 480, "a window with a red error bar"),  # 15 x 20 = 300
    "receipt-tall.png": (200, 600, "a tall receipt of lines"),  # 19 x 6 = 114
    "icon-small.png": (100, 80, "a small icon, scaled up to the minimum"),  # 9 x 7 = 63 -> 64 pixels min: 72
    "poster-large.png": (1600, 1000, "a large poster: over the cap of 1,024 tokens"),  # 31 x 50 = 1,550
}


def draw(name: str, w: int, h: int) -> Image.Image:
    im = Image.new("RGB", (w, h), (240, 240, 236))
    d = ImageDraw.Draw(im)
    for y in range(0, h, 4):  # a soft vertical gradient: every patch differs from its neighbours
        shade = 200 + (55 * y) // max(h - 1, 1)
        d.line([(0, y), (w, y)], fill=(shade, shade - 10, 230))
    if name.startswith("wide"):
        for i, c in enumerate(((220, 60, 60), (60, 160, 80), (60, 90, 200))):
            d.rectangle([20 + i * 165, 24, 150 + i * 165, 104], fill=c)
    elif name.startswith("screenshot"):
        d.rectangle([40, 40, 600, 440], fill=(255, 255, 255), outline=(30, 30, 30), width=3)
        d.rectangle([40, 40, 600, 80], fill=(200, 40, 40))
        for i in range(8):
            d.line([(70, 120 + 36 * i), (70 + 60 * (i % 5 + 3), 120 + 36 * i)], fill=(40, 40, 40), width=6)
    elif name.startswith("receipt"):
        for i in range(26):
            d.line([(16, 20 + 22 * i), (16 + 7 * ((i * 37) % 24), 20 + 22 * i)], fill=(20, 20, 20), width=4)
    elif name.startswith("icon"):
        d.ellipse([14, 8, 86, 72], fill=(250, 190, 30), outline=(90, 60, 0), width=3)
    else:
        for i in range(12):
            d.ellipse([60 + 120 * i, 100 + 60 * (i % 5), 200 + 120 * i, 400 + 60 * (i % 5)],
                      fill=((37 * i) % 255, (91 * i) % 255, 160))
    return im


REQUESTS = [
    ("image-banner", "wide-banner.png", None, "Is this banner an advertisement?"),
    ("image-screenshot", "screenshot.png", None, "Does the screenshot show an error?"),
    ("image-receipt", "receipt-tall.png", None, "Is this a receipt?"),
    ("image-icon", "icon-small.png", None, "Is this an icon?"),
    ("image-poster-over-cap", "poster-large.png", None, "Is this a poster?"),
    ("image-poster-bounded", "poster-large.png", {"max_pixels": 1024 * 32 * 32}, "Is this a poster?"),
]


def main() -> None:
    IMAGES.mkdir(exist_ok=True)
    for name, (w, h, _) in SPECS.items():
        draw(name, w, h).save(IMAGES / name, optimize=True)
    lines = []
    for rid, image, kwargs, question in REQUESTS:
        body = {"id": rid, "model": "clef-flash", "state": f"A user attached {SPECS[image][2]}.",
                "images": [f"images/{image}"],
                "questions": {"kind": {"type": "noul", "instructions": question},
                              "route": {"type": "choice", "instructions": "Who handles it?",
                                        "criteria": {"support": "A problem to fix.", "sales": "A purchase.",
                                                     "none": None}}}}
        if kwargs:
            body["media_kwargs"] = kwargs
        lines.append(json.dumps(body))
    (HERE / "requests-images.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
