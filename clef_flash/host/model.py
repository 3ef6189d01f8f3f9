"""One release answering requests from its shipped assets alone: the host's encoder, the tower asset
for an image, the decoder asset in chunks with its states, the lm_head table's rows, the head
asset, and the SystemOne answers. No torch, no transformers, no author code: a test holds it.

``ClefHost`` is entered once (each asset loaded once) and answers one request at a time."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..backbone.manifest import functions_of
from .dist import Dist
from .encode import Encoded, PromptTokenizer, encode
from .requests import Image, RequestError, check_body, read_image

STAGES = ("encode", "vision", "decoder", "head", "host")


def usage(input_tokens: int) -> dict[str, int]:
    """A response's usage: the author's two counts, and Workers AI's total (a decision writes no token)."""
    return {"input_tokens": input_tokens, "output_tokens": 0, "total_tokens": input_tokens}


@dataclass(frozen=True)
class HeadCall:
    index: int  # in ``ClefHost.heads``
    bucket: int  # tokens
    function: str
    bundle: str  # the head bundle's name


def _limits(h) -> str:
    return f"{h.bundle.name}: {h.q_pad} questions, {h.o_pad} options, {max(h.buckets)} tokens"


@dataclass
class Answered:
    response: dict[str, Any]  # the SystemOne response: model, answers, usage
    encoded: Encoded
    seconds: dict[str, float] = field(default_factory=dict)  # per STAGES
    bucket: str = ""  # the head function that ran
    decoder: str = ""  # the decoder function that ran (the first whose slots hold the record)
    head: str = ""  # the head bundle it is in
    logits: np.ndarray | None = None  # the head's [O] output, unrounded
    steps: dict[str, Any] | None = None  # keep=True: each step's arrays (host-vectors.jsonl)


class ClefHost:
    def __init__(self, dist: Dist, engine: str = "auto", device: str = "auto"):
        """``engine``: the decoder's (``backbone.executor.choose_engine``: auto, coreai, torch), chosen
        here, before any asset loads; ``device``: the torch engine's."""
        from ..backbone.executor import choose_engine
        from ..sources.lm_head import open_table

        self.dist = dist
        bb = dist.backbone
        self.choice = choose_engine(bb.bundle, bb.manifest, engine, device)
        self.device = device
        self.engine = None  # backbone.executor.EngineInfo, once entered
        self.heads = dist.heads  # cheapest first: a request runs in the first that fits it
        self.tokenizer = PromptTokenizer(dist.tokenizer)
        self.table = open_table(dist.table)
        # what the widest head takes: a request past it is refused, naming the limit
        self.q_pad = max(h.q_pad for h in self.heads)
        self.o_pad = max(h.o_pad for h in self.heads)
        self.buckets = tuple(sorted({b for h in self.heads for b in h.buckets}))
        self._stack: contextlib.AsyncExitStack | None = None
        self._functions = functions_of(dist.backbone.manifest)

    async def __aenter__(self) -> "ClefHost":
        from ..backbone.runtime import runner as decoder_runner

        stack = contextlib.AsyncExitStack()
        await stack.__aenter__()
        try:
            bb = self.dist.backbone.manifest
            shapes = {n: tuple(int(x) for x in spec.shape) for n, spec in bb.interface.states.items()}
            dtype = next(iter(bb.interface.states.values())).dtype
            self._torch = None
            if self.choice.engine == "torch":
                import asyncio

                from ..backbone.executor import open_torch_decoder

                b = self.dist.backbone  # its files were checked against SHA256SUMS: the blobs' places are checked here
                self._torch = await asyncio.to_thread(open_torch_decoder, b.bundle, b.asset, b.manifest, self.device, False)
                self.engine = self._torch.info
            else:
                from ..backbone.executor import EngineInfo

                self._decoder, self._new_states = await stack.enter_async_context(
                    decoder_runner(self.dist.backbone.asset, self._functions, shapes, dtype, bb.language.prefill_chunk))
                self.engine = EngineInfo("coreai", "cpu", bb.export.compute)
            self._heads = [await stack.enter_async_context(h.fmt.runner(h.asset, sorted(h.names.values()))) for h in self.heads]
            self._tower = None
            if self.dist.vision is not None:
                from ..vision.runtime import runner as tower_runner

                self._tower, _ = await stack.enter_async_context(tower_runner(self.dist.vision.asset, self.dist.vision.cfg))
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return self

    async def __aexit__(self, *exc) -> None:
        if self._stack is not None:
            await self._stack.aclose()
            self._stack = None

    def prepare(self, body: Any, base: Path | None = None) -> tuple[Encoded, Any, Image | None, "HeadCall"]:
        """The request checked, its image prepared and its prompt encoded, before any asset runs:
        (encoded, the image's prepared patches or None, the image, the head and bucket it runs in)."""
        from ..head.host import HostInputError, check_fits
        from .encode import options_of

        check_body(body)
        # the schema's limits said before anything is tokenized: a client sending too many is told which
        questions = body["questions"]
        if len(questions) > self.q_pad:
            raise RequestError("questions", f"{len(questions)} questions; at most {self.q_pad} a request (this release's widest head)", 422)
        options = sum(len(options_of(q)) for q in questions.values())
        if options > self.o_pad:
            raise RequestError("questions", f"{options} options; at most {self.o_pad} in all a request (this release's widest head)", 422)
        image = read_image(body, base)
        prepared, tokens = None, None
        if image is not None:
            prepared = self._prepare_image(image)
            tokens = prepared.grid.tokens
        try:
            enc = encode(self.tokenizer, body, image_tokens=tokens)
        except ValueError as exc:
            raise RequestError("questions", str(exc), 422) from None
        try:
            check_fits(len(enc.ids), enc.questions, q_pad=self.q_pad, o_pad=self.o_pad, buckets=self.buckets)
        except HostInputError as exc:
            schema = len(enc.questions) > self.q_pad or sum(len(q.option_spans) for q in enc.questions) > self.o_pad
            raise RequestError("questions" if schema else "state", str(exc), 422) from None
        too_long = self.dist.backbone.does_not_fit(len(enc.ids))
        if too_long:
            raise RequestError("state", too_long, 422)
        return enc, prepared, image, self.head_for(len(enc.ids), len(enc.questions), options)

    def head_for(self, tokens: int, questions: int, options: int) -> "HeadCall":
        """The first head (cheapest first) and its smallest bucket that take a record of this size."""
        for i, h in enumerate(self.heads):
            bucket = h.bucket_for(tokens, questions, options)
            if bucket is not None:
                return HeadCall(index=i, bucket=bucket, function=h.names[bucket], bundle=h.bundle.name)
        raise RequestError("questions", f"{tokens} tokens with {questions} questions and {options} options: no head "
                           f"of this release takes them together ({', '.join(_limits(h) for h in self.heads)})", 422)

    def _prepare_image(self, image: Image):
        from ..vision.host import choose_bucket
        from ..vision.preprocess import pixel_patches
        from ..vision.shipped import PreparedImage, pixel_bounds

        vision, bb = self.dist.vision, self.dist.backbone.manifest
        if vision is None:
            raise RequestError("images", "this release has no vision bundle: it answers text requests only", 422)
        if bb.interface.vision is None:
            raise RequestError("images", f"{self.dist.backbone.bundle.name} is a text-only decoder", 422)
        try:
            patches, grid = pixel_patches(image.pil, vision.pre, **pixel_bounds(image.media_kwargs))
        except (ValueError, TypeError) as exc:
            raise RequestError("media_kwargs", str(exc), 400) from None
        bucket = choose_bucket(grid.tokens, vision.buckets)
        if bucket is None:
            raise RequestError("images[0]", f"{grid.tokens} vision tokens ({grid.merged[0]} x {grid.merged[1]}) exceed the "
                               f"vision asset's cap of {vision.cap} (media_kwargs max_pixels bounds an image)", 422)
        if grid.tokens > bb.interface.vision.image_rows:
            raise RequestError("images[0]", f"{grid.tokens} vision tokens exceed the decoder's "
                               f"{bb.interface.vision.image_rows} image rows", 422)
        return PreparedImage(file=Path(image.source), patches=patches, grid=grid, bucket=bucket)

    async def answer(self, body: Any, base: Path | None = None, keep: bool = False,
                     on_layer: Callable[[int, int], None] | None = None) -> Answered:
        """One request answered (``RequestError`` before any asset runs when it cannot be);
        ``keep``: each step's arrays kept in ``steps``; ``on_layer(done, layers)`` after each decoder
        layer on the torch engine (a 9B request takes minutes on a CPU: its progress)."""
        from ..backbone.contract import fitting
        from ..backbone.host import ImageSpan, image_ids, image_inputs, run_record
        from ..head.host import answers, head_inputs, question_probs

        import asyncio

        t0 = time.perf_counter()
        # parsing an image and tokenizing a state are CPU work: off the event loop, so a server
        # answers /health and reads other bodies meanwhile
        enc, prepared, _image, call = await asyncio.to_thread(self.prepare, body, base)
        seconds = {"encode": time.perf_counter() - t0}
        t = time.perf_counter()
        span = None
        if prepared is not None:
            rows = (await self._tower(prepared.patches, prepared.grid, prepared.bucket))[0]
            span = ImageSpan(start=enc.image.start, rows=rows, grid=prepared.grid.merged)
        seconds["vision"] = time.perf_counter() - t
        t = time.perf_counter()
        lang, vision = self.dist.backbone.manifest.language, self.dist.backbone.manifest.interface.vision
        ids = np.asarray(enc.ids, dtype=np.int64)
        extra = None
        if vision is not None:
            dtype = np.float32 if vision.embeds_dtype == "fp32" else np.float16
            extra = image_inputs(vision.image_rows, lang.hidden_size, dtype, span)
        sent = image_ids(ids, span, lang.vocab_size) if span is not None else ids
        if self._torch is not None:  # off the event loop: a server keeps answering /health meanwhile
            layers = len(lang.layer_types)
            tick = (lambda i: on_layer(i + 1, layers)) if on_layer is not None else None
            hidden = await asyncio.to_thread(self._torch.rows, sent, extra, tick)
        else:
            hidden = await run_record(self._decoder, self._new_states, sent, lang.prefill_chunk, lang.pad_token_id, None, extra)
        seconds["decoder"] = time.perf_counter() - t
        decoder = fitting(self._functions, len(sent), lang.prefill_chunk).name  # the rule both engines follow
        t = time.perf_counter()
        h = self.heads[call.index]
        hi = head_inputs(hidden, ids, enc.questions, self.table, call.bucket, q_pad=h.q_pad, o_pad=h.o_pad, buckets=h.buckets)
        logits = await self._heads[call.index](call.function, hi.arrays)
        seconds["head"] = time.perf_counter() - t
        t = time.perf_counter()
        probs = question_probs(logits, hi.layout)
        response = {"model": body["model"], "answers": answers(body["questions"], enc.questions, probs),
                    "usage": usage(len(enc.ids))}
        seconds["host"] = time.perf_counter() - t
        steps = None
        if keep:
            steps = {"patches": None if prepared is None else prepared.patches, "grid": None if prepared is None else prepared.grid,
                     "image_rows": None if span is None else span.rows, "hidden": hidden, "head_inputs": hi.arrays,
                     "probabilities": probs}
        return Answered(response=response, encoded=enc, seconds=seconds, bucket=call.function, head=call.bundle, decoder=decoder,
                        logits=np.asarray(logits, np.float32)[: hi.options], steps=steps)
