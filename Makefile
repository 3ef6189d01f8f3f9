# clef-export entry points. Every target sets up what it needs and is a no-op when nothing changed.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
AUTHOR := .cache/author/joint_schema_model.py
SYNTH := .cache/synth/real-seed0
RECIPE := conversion/head_bucket_fp16w32.toml
# what a release ships: the Core AI asset and the Core ML package for macOS 15 / 26
RELEASE_RECIPES := $(RECIPE) conversion/head_bucket_fp16w32_mlpackage.toml
BUNDLE := build/clef_flash_head_bucket_fp16w32
SOURCES := $(wildcard clef_flash/*.py clef_flash/*/*.py) $(RECIPE)
# REAL=1: the pinned Cloudflare/clef-flash files from the HF cache (run `make fetch` first, online).
ifeq ($(REAL),1)
SRC_DEPS :=
SRC_ARGS := --pins manifests/clef-flash.source.json
else
SRC_DEPS := $(SYNTH)/pins.json
SRC_ARGS := --source $(SYNTH) --pins $(SYNTH)/pins.json
endif

.PHONY: setup finetune-env build test test-fast verify bench bench-plan bench-serve bench-backbone bench-head-calls bench-wide bench-identity bench-9b bench-9b-run bench-slice-int8 bench-vision vision crosscheck-coreai-opt artifact fetch check backbone compressed wheel clean

setup: $(STAMP) $(AUTHOR)

# torch first, pinned: the CPU build on disk, never a multi-GB download.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip 'setuptools>=77'
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,reference]'
	touch $@

# The author's joint_schema_model.py, from the clef-finetune wheel, sha256-checked. Never committed.
$(AUTHOR): $(STAMP)
	$(BIN)/clef-export author-code --out $@

# A synthetic snapshot at the real head configuration (random bf16 weights, seed 0).
$(SYNTH)/pins.json: $(AUTHOR) clef_flash/synth/release.py | $(STAMP)
	$(BIN)/clef-export synth $(SYNTH) --config real --seed 0 --author-code $(AUTHOR) --overwrite

$(BUNDLE)/metadata.json: $(SRC_DEPS) $(SOURCES)
	$(BIN)/clef-export build $(RECIPE) $(SRC_ARGS) --out build --overwrite

build: setup $(BUNDLE)/metadata.json

verify: build
	$(BIN)/clef-export verify $(BUNDLE) $(SRC_ARGS)

fetch: setup
	$(BIN)/clef-export fetch

# check-release on a tiny random release (real tiny Qwen3.5 backbone, byte-level tokenizer):
# the author's systemone vs the exported head on the project's requests (conversion/requests.jsonl)
TINY_REL := .cache/tiny-release
TINY_OUT := build/tiny-release
TINY_BUNDLE := $(TINY_OUT)/tiny_release_head_bucket_fp16w32
$(TINY_REL)/pins.json: $(AUTHOR) clef_flash/synth/release.py | $(STAMP)
	$(BIN)/clef-export synth-release $(TINY_REL) --seed 0 --author-code $(AUTHOR) --overwrite
	$(BIN)/clef-export pin $(TINY_REL) --name tiny_release --overwrite

$(TINY_BUNDLE)/metadata.json: $(TINY_REL)/pins.json $(SOURCES)
	$(BIN)/clef-export build $(RECIPE) --source $(TINY_REL) --out $(TINY_OUT) --overwrite

# the tiny release's backbone, both recipes (fp16 compute as Macs run it; fp32 compute, provable here),
# each gated against transformers' own text model chunk by chunk
BACKBONE_RECIPES := conversion/backbone_pf64_fp16w32.toml conversion/backbone_pf64_fp16.toml
TINY_BACKBONES := $(TINY_OUT)/tiny_release_decode_fp16w32_pf64/metadata.json $(TINY_OUT)/tiny_release_decode_fp16_pf64/metadata.json
$(TINY_OUT)/tiny_release_decode_%_pf64/metadata.json: $(TINY_REL)/pins.json $(SOURCES) conversion/backbone_pf64_%.toml
	$(BIN)/clef-export build conversion/backbone_pf64_$*.toml --source $(TINY_REL) --out $(TINY_OUT) --overwrite

backbone: setup $(TINY_BACKBONES)

# the compressed backbones of the tiny release (issue 29): int8 (fp16 compute), int8w32 (fp32
# compute, provable), int4 (experimental), each gated in two parts; a weight plan for the release's
# own weights; check-release through the int8w32 asset against the published port's bar (0.02)
COMPRESSED := int8w32 int8 int4
TINY_COMPRESSED := $(foreach c,$(COMPRESSED),$(TINY_OUT)/tiny_release_decode_$(c)_pf64/metadata.json)
compressed: setup $(TINY_BUNDLE)/metadata.json $(TINY_COMPRESSED)
	$(BIN)/clef-export plan-weights $(TINY_REL) --recipe conversion/backbone_pf64_int8.toml --out $(TINY_OUT)/plan-int8.json --overwrite
	$(BIN)/clef-export check-release $(TINY_REL) --bundle $(TINY_BUNDLE) --backbone $(TINY_OUT)/tiny_release_decode_int8w32_pf64 --transcript $(TINY_OUT)/check-release-int8w32.json

# the whole model on the tiny release: the head alone, then tokenizer -> backbone asset -> head asset
# (fp32 compute on every request; fp16 compute, slow on the Linux CPU runtime, on the first four),
# the project's image requests through the vision asset and the backbone's image inputs (and their red arm),
# the red arm that must fail (exit 4), the backbone's gate, the whole Mac release in one dist/, and its
# publish to a loopback Hub, downloaded back by the commit and checked; then the dist/ answering the request
# sets through `answer` and `serve` (clef-evals' own client), equal, within check-release's bars
TINY_B32 := $(TINY_OUT)/tiny_release_decode_fp16w32_pf64
TINY_B16 := $(TINY_OUT)/tiny_release_decode_fp16_pf64
TINY_V32 := $(TINY_OUT)/tiny_release_vision_fp16w32
check: setup $(TINY_BUNDLE)/metadata.json $(TINY_BACKBONES) $(TINY_V32)/metadata.json
	$(BIN)/clef-export check-release $(TINY_REL) --bundle $(TINY_BUNDLE) --transcript $(TINY_OUT)/check-release.json
	$(BIN)/clef-export check-release $(TINY_REL) --bundle $(TINY_BUNDLE) --backbone $(TINY_B32) --vision $(TINY_V32) --requests conversion/requests-images.jsonl --transcript $(TINY_OUT)/check-release-images.json
	$(BIN)/clef-export check-release $(TINY_REL) --bundle $(TINY_BUNDLE) --backbone $(TINY_B32) --vision $(TINY_V32) --requests conversion/requests-images.jsonl --red image > /dev/null 2>&1; test $$? -eq 4
	$(BIN)/clef-export check-release $(TINY_REL) --bundle $(TINY_BUNDLE) --backbone $(TINY_B32) --transcript $(TINY_OUT)/check-release-fp16w32.json
	head -n 4 conversion/requests.jsonl > $(TINY_OUT)/requests-4.jsonl
	$(BIN)/clef-export check-release $(TINY_REL) --bundle $(TINY_BUNDLE) --backbone $(TINY_B16) --requests $(TINY_OUT)/requests-4.jsonl --transcript $(TINY_OUT)/check-release-fp16.json
	$(BIN)/clef-export check-release $(TINY_REL) --bundle $(TINY_BUNDLE) --backbone $(TINY_B32) --red state > /dev/null 2>&1; test $$? -eq 4
	$(BIN)/clef-export verify $(TINY_B32) --source $(TINY_REL)
	$(BIN)/clef-export release $(RECIPE) conversion/head_wide_fp16w32.toml conversion/backbone_pf64_fp16w32.toml conversion/vision_fp16w32.toml --source $(TINY_REL) --dist $(TINY_OUT)/dist --overwrite
	$(BIN)/python -m tests.hub_roundtrip $(TINY_OUT)/dist --check $(TINY_OUT)/check-release-fp16w32.json
	$(BIN)/clef-export answer $(TINY_OUT)/dist --vectors
	$(BIN)/python -m tests.host_roundtrip $(TINY_OUT)/dist --check $(TINY_OUT)/check-release-fp16w32.json --check $(TINY_OUT)/check-release-images.json

# build -> verify -> AOT where xcrun coreai-build exists -> dist/ with SHA256SUMS
artifact: setup $(SRC_DEPS)
	$(BIN)/clef-export release $(RELEASE_RECIPES) $(SRC_ARGS) --dist dist --overwrite

# clef-finetune's own environment, apart from ours (its torch from the registry, with torchvision): the
# tests write releases with its `make-tiny`, the way fine-tunes look. About 2 minutes and 5.5 GB once.
FINETUNE_ENV := .cache/finetune-env
$(FINETUNE_ENV)/.installed:
	$(PY) -m venv $(FINETUNE_ENV)
	$(FINETUNE_ENV)/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1 clef-finetune==0.1.0
	touch $@

finetune-env: $(FINETUNE_ENV)/.installed

# the whole suite, both tiers (what CI runs). Two workers (pytest-xdist), a file to each at a time
# (a file's fixtures built once): the suite keeps about one of two cores busy alone (measured 52%),
# 1,179 s in one process, 765 s in two. JOBS=1 for one process; more workers hold more memory each.
JOBS ?= 2
test: setup finetune-env
	CLEF_AUTHOR_CODE=$(AUTHOR) CLEF_FINETUNE=$(FINETUNE_ENV)/bin/clef-finetune $(BIN)/python -m pytest -q -ra -n $(JOBS) --dist loadfile

# the inner loop: the tiny-configuration tier only (plumbing and edges), no real-size end to end
test-fast: setup finetune-env
	CLEF_AUTHOR_CODE=$(AUTHOR) CLEF_FINETUNE=$(FINETUNE_ENV)/bin/clef-finetune $(BIN)/python -m pytest -q -ra -n $(JOBS) --dist loadfile -m "not real"

bench: build bench-backbone
	$(BIN)/python benchmarks/bench.py --source $(SYNTH) --pins $(SYNTH)/pins.json

# the backbone build at the tiny configuration and at a real-width slice of the 9B (4 layers,
# vocab 248,320: 5.9 GB of random bf16 written streamed; about 20 GB of free disk in all)
SLICE := .cache/slice-9b-4
$(SLICE)/pins.json: $(AUTHOR) clef_flash/synth/wide.py | $(STAMP)
	$(BIN)/clef-export synth-release $(SLICE) --size 9b --layers 4 --seed 0 --author-code $(AUTHOR) --overwrite
	$(BIN)/clef-export pin $(SLICE) --name slice_9b --overwrite

bench-backbone: setup $(TINY_REL)/pins.json $(SLICE)/pins.json
	$(BIN)/python benchmarks/bench_backbone.py --tiny $(TINY_REL) --slice $(SLICE) --work build

# main.mlirb of the streamed route against the converter's own route (weights copied in memory), at the slice
bench-identity: setup $(SLICE)/pins.json
	$(BIN)/python benchmarks/bench_identity.py --slice $(SLICE) --compute fp16 --work build

# the whole 9B in one run: the synthetic release written streamed, the cp floor, both recipes built
# and verified at full size (descriptor, every weight streamed), the slice beside it; about 55 GB of
# free disk and 20 minutes. Not part of `make test` or `make bench`.
bench-9b: setup $(SLICE)/pins.json
	$(BIN)/python benchmarks/bench_9b.py --slice $(SLICE)

# the synthetic 9B proven and answering (issue 61): `release` of the head and the int8 decoder (its gate's
# numeric check through the torch engine), `answer` of a 1,000-token request, `serve`'s start-up and one
# request, each watched (wall, peak memory); first the torch engine against the runtime on the real-width
# slice: benchmarks/results/9b-run-latest.json; about 80 GB of disk
bench-9b-run: setup $(SLICE)/pins.json
	$(BIN)/python benchmarks/bench_9b_run.py --slice $(SLICE)

# the int8w32 asset of the real-width slice through gate (a) (the runtime against torch eager on its
# own dequantized weights) and (b) (the quantization against the release), and plan-weights at the
# slice (wall and memory, watched): benchmarks/results/slice-int8-latest.json
# plan-weights: the one-pass ranking against the exhaustive one on a make-tiny release, every project
# request; the slice at the recipe's budget and a tight one, the 9B projected (issue 47)
MAKE_TINY := .cache/make-tiny-0
$(MAKE_TINY)/pins.json: $(FINETUNE_ENV)/.installed | $(STAMP)
	rm -rf $(MAKE_TINY)
	$(FINETUNE_ENV)/bin/clef-finetune make-tiny $(MAKE_TINY) --seed 0
	$(BIN)/clef-export pin $(MAKE_TINY) --name make_tiny_0 --overwrite

bench-plan: setup $(MAKE_TINY)/pins.json $(SLICE)/pins.json
	$(BIN)/python benchmarks/bench_plan.py --tiny $(MAKE_TINY) --slice $(SLICE)

bench-slice-int8: setup $(SLICE)/pins.json
	$(BIN)/python benchmarks/bench_slice_int8.py --slice $(SLICE)

# the vision tower of the tiny release, both recipes, each gated against transformers' tower (issue 30)
TINY_VISION := $(TINY_OUT)/tiny_release_vision_fp16w32/metadata.json $(TINY_OUT)/tiny_release_vision_fp16/metadata.json
$(TINY_OUT)/tiny_release_vision_%/metadata.json: $(TINY_REL)/pins.json $(SOURCES) conversion/vision_%.toml
	$(BIN)/clef-export build conversion/vision_$*.toml --source $(TINY_REL) --out $(TINY_OUT) --overwrite

vision: setup $(TINY_VISION)

# the vision tower at real shape (the 9B's tower, random bf16, beside a 4-layer text slice): build
# and gate watched, one call per bucket timed: benchmarks/results/vision-latest.json
VISION_REL := .cache/synth-9b-vision
$(VISION_REL)/pins.json: $(AUTHOR) clef_flash/synth/wide.py | $(STAMP)
	$(BIN)/clef-export synth-release $(VISION_REL) --size 9b --layers 4 --vision --seed 0 --author-code $(AUTHOR) --overwrite
	$(BIN)/clef-export pin $(VISION_REL) --name synth_9b_vision --overwrite

# answer and serve on the tiny release's dist/ (make check builds it): the time split per request, the
# server's overhead, 16 clef-evals clients x 50 requests, memory over 1,000 requests
bench-serve: setup
	test -f $(TINY_OUT)/dist/SHA256SUMS || $(MAKE) check
	$(BIN)/python benchmarks/bench_serve.py --dist $(TINY_OUT)/dist --name tiny
	$(BIN)/python benchmarks/bench_head_calls.py $(TINY_OUT)/dist/*_head_*_fp16w32 --name tiny

# what the wide shapes cost a request (issue 59): a 16-question request on the published head alone with
# the decoder at 4,096 tokens, on both heads at 4,096, and on the walkthrough's dist (both heads, 16,384);
# a 64-question request split by stage
bench-wide: setup
	test -f $(TINY_OUT)/dist/SHA256SUMS || $(MAKE) check
	sed -e 's/^context = 16384/context = 4096/' -e '/^long_record = /d' -e '/^short_contexts = /d' conversion/backbone_pf64_fp16w32.toml > $(TINY_OUT)/backbone_4096.toml
	sed -e '/^short_contexts = /d' conversion/backbone_pf64_fp16w32.toml > $(TINY_OUT)/backbone_16384_only.toml
	$(BIN)/clef-export release $(RECIPE) $(TINY_OUT)/backbone_4096.toml --source $(TINY_REL) --dist $(TINY_OUT)/dist-4096 --overwrite
	$(BIN)/clef-export release $(RECIPE) conversion/head_wide_fp16w32.toml $(TINY_OUT)/backbone_4096.toml --source $(TINY_REL) --dist $(TINY_OUT)/dist-both-4096 --overwrite
	$(BIN)/clef-export release $(RECIPE) conversion/head_wide_fp16w32.toml $(TINY_OUT)/backbone_16384_only.toml --source $(TINY_REL) --dist $(TINY_OUT)/dist-both-16384-only --overwrite
	$(BIN)/python benchmarks/bench_wide.py --dist $(TINY_OUT)/dist-4096 $(TINY_OUT)/dist-both-4096 $(TINY_OUT)/dist-both-16384-only $(TINY_OUT)/dist --name tiny

# the head's cost per call at each function size (issue 59): the published head and the wide one at the
# real head configuration (synthetic weights); the tiny release's in bench-serve
HEADS_REAL := build/heads-real
bench-head-calls: setup $(SYNTH)/pins.json
	$(BIN)/clef-export build conversion/head_bucket_fp16w32.toml $(SRC_ARGS) --out $(HEADS_REAL) --overwrite
	$(BIN)/clef-export build conversion/head_wide_fp16w32.toml $(SRC_ARGS) --out $(HEADS_REAL) --overwrite
	$(BIN)/python benchmarks/bench_head_calls.py $(HEADS_REAL)/clef_flash_head_bucket_fp16w32 $(HEADS_REAL)/clef_flash_head_wide_fp16w32 --name real-width --calls 3

bench-vision: setup $(VISION_REL)/pins.json
	$(BIN)/python benchmarks/bench_vision.py --release $(VISION_REL)

# our int8 / int4 per-block codes against coreai-opt's own quantizer on the same weights (coreai-opt
# is not a dependency: installed with --no-deps into .cache/coreai-opt, torchao beside it)
COREAI_OPT := .cache/coreai-opt
$(COREAI_OPT)/.installed: | $(STAMP)
	$(BIN)/python -m pip install -q --no-deps --target $(COREAI_OPT) coreai-opt==0.3.0 torchao==0.18.0
	touch $@

crosscheck-coreai-opt: setup $(TINY_REL)/pins.json $(COREAI_OPT)/.installed
	PYTHONPATH=$(COREAI_OPT) $(BIN)/python benchmarks/crosscheck_coreai_opt.py --tiny $(TINY_REL)

# the installable wheel (recipes, pins and schemas inside; never the author's code) -> wheelhouse/
wheel: setup
	rm -rf wheelhouse
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w wheelhouse .
	@ls -l wheelhouse/*.whl

clean:
	rm -rf build dist wheelhouse .cache .pytest_cache
