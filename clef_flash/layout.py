"""File names that several stages write or read: one place, no imports.

A bundle folder holds ``<name><suffix>`` (the asset), ``metadata.json`` (the manifest) and
``build-record.json`` (provenance); a release folder adds ``SHA256SUMS``.
"""

from __future__ import annotations

MANIFEST_FILE = "metadata.json"
RECORD_FILE = "build-record.json"
SUMS_FILE = "SHA256SUMS"
# the licence and notice a release carries: pinned when present, shipped at the top of a release's dist/
LICENSE_FILES = ("LICENSE", "LICENSE.txt", "LICENSE.md", "NOTICE", "NOTICE.txt", "NOTICE.md")
# a release's image processor settings: the older file alone, or transformers 5's processor file
# with them under "image_processor" beside a "video_processor" (vision.contract reads either)
PREPROCESSOR_CONFIG = "preprocessor_config.json"
PROCESSOR_CONFIG = "processor_config.json"
PROCESSOR_FILES = (PREPROCESSOR_CONFIG, PROCESSOR_CONFIG)
# a release with a decoder: the lm_head table and its sidecar, and the host conformance vectors
HOST_DIR = "host"
TABLE_FILE = "lm_head_fp16.bin"
VECTORS_FILE = "host-vectors.jsonl"
