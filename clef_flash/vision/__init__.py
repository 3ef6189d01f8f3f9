"""The vision tower: a release's ``model.visual.*`` exported as one Core AI asset with one static
function per patch-count bucket, so an image of any aspect ratio up to the cap runs at its native grid.

Pipeline: the release's ``config.json`` ``vision_config`` and ``preprocessor_config.json`` ->
``contract`` (names, shapes, buckets) -> ``preprocess`` (numpy + Pillow: the author's processor's
resize, rescale, normalise and patch order, bit for bit) -> ``host`` (the grid-derived tensors
transformers computes from ``grid_thw`` in its forward, computed here and fed as inputs; padding to
the bucket) -> ``graph.VisionTower`` (torch only, static shapes) -> ``export`` (streamed weights, one
dynamic trace specialised per bucket) -> ``gate`` (the saved asset against transformers'
``Qwen3_5VisionModel`` in fp32, per image).
"""
