"""The author's model for a release too big to hold (the 9B: 18 GB of bf16, 36 GB in fp32): what the
author's ``ClefModel`` reads of ``Qwen3_5ForConditionalGeneration`` on a text request, with nothing
held but one layer's weights.

``ClefModel.forward`` reads two things of its backbone (facts of the author's code): the text
model, ``backbone.model.language_model``, called with ``input_ids`` and ``attention_mask``, whose
``last_hidden_state`` goes to the head; and ``backbone.get_output_embeddings().weight``, which the
head indexes by each option's token ids (``weight[ids].mean(0)``). Here the text model is
transformers' own ``Qwen3_5TextModel`` with its layers' weights read from the release where each
is called (``backbone.reference.StreamedTextModel``: the build gate's reference), and the weight is
the release's ``lm_head`` read row by row from the file. The author's ``systemone`` runs unchanged
on top. Images are not taken (the multimodal model is not streamed)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from ..backbone.contract import LM
from ..errors import UsageError

STREAMS = ("auto", "on", "off")
# a backbone past this many parameters is streamed by default (``check-release --stream auto``):
# in fp32 it would hold 4 GiB and more, where the build's whole budget is 1.5 GB
STREAM_PARAMETERS = 1_000_000_000



class FileRows:
    """``weight[ids]``: rows of a 16-bit [V, H] tensor in a safetensors file, read when indexed and
    widened to ``dtype``; nothing else of the table is read."""

    def __init__(self, path: Path, info, dtype: torch.dtype, device: torch.device):
        self.info, self.dtype, self.device = info, dtype, device
        self.shape = tuple(info.shape)
        self._bytes = np.memmap(path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))

    def __getitem__(self, ids) -> torch.Tensor:
        from ..engine.streamed_weights import as_f32

        index = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64).reshape(-1)
        rows = self._bytes.reshape(self.shape[0], -1)[index]
        values = as_f32(np.ascontiguousarray(rows).reshape(-1), self.info.dtype).reshape(len(index), self.shape[1])
        return torch.from_numpy(values).to(device=self.device, dtype=self.dtype)


class _TextModel(torch.nn.Module):
    def __init__(self, streamed, log):
        super().__init__()
        from ..progress import slow_progress

        self.streamed = streamed
        self.records = 0
        layers = len(streamed.model.layers)
        self._step = None
        # minutes a record at 9B on a CPU: a line with what is left, layer by layer
        self._progress = lambda: slow_progress(f"reference: request {self.records}", log)
        for i, layer in enumerate(streamed.model.layers):
            layer.register_forward_hook(lambda _m, _a, _o, i=i: self._step(i + 1, layers) if self._step else None)

    def forward(self, input_ids, attention_mask=None, use_cache=False, return_dict=True, **media):
        if media:
            from ..sources.reference import WHY_NO_IMAGES

            raise ValueError(WHY_NO_IMAGES)
        if input_ids.shape[0] != 1 or (attention_mask is not None and not bool(attention_mask.all())):
            raise ValueError("the streamed model answers one record at a time, unpadded (systemone's one request)")
        self.records += 1
        self._step = self._progress()
        embeds = self.streamed.embed(input_ids[0].cpu().numpy())
        from ..backbone.held_weights import in_blocks

        try:
            # each linear by row blocks of its weight read from the release (the same dot products)
            with torch.no_grad(), in_blocks():
                out = self.streamed.model(inputs_embeds=embeds[None], use_cache=False)
        finally:
            self._step = None
        return SimpleNamespace(last_hidden_state=out.last_hidden_state)


class StreamedBackbone(torch.nn.Module):
    """What ``ClefModel`` reads of ``Qwen3_5ForConditionalGeneration``, streamed (see the module)."""

    def __init__(self, release: Path, dtype: torch.dtype, device: str, log=lambda msg: None):
        super().__init__()
        from ..backbone.reference import StreamedTextModel

        streamed = StreamedTextModel(Path(release), dtype=dtype, device=device, narrow=True)
        self.model = torch.nn.Module()
        self.model.language_model = _TextModel(streamed, log)
        infos = streamed.infos
        table = _lm_head_info(Path(release), infos)
        self._table = SimpleNamespace(weight=FileRows(Path(release) / table.file, table, dtype, torch.device(device)))
        self.config = SimpleNamespace(use_cache=False, image_token_id=None)
        self.parameter_count = sum(int(np.prod(t.shape)) for t in infos.values()) + int(np.prod(table.shape))

    def get_output_embeddings(self):
        return self._table


def _lm_head_info(release: Path, infos: dict):
    """The release's ``lm_head.weight`` (its output embeddings), or the input ones where tied."""
    from transformers import Qwen3_5Config

    from ..engine.streamed_weights import locate

    config = Qwen3_5Config.from_pretrained(release)
    embed = infos[f"{LM}embed_tokens.weight"]
    if getattr(config, "tie_word_embeddings", False) or getattr(config.text_config, "tie_word_embeddings", False):
        return embed
    return locate(release, {"lm_head.weight": embed.shape})["lm_head.weight"]


def streams(release: Path, stream: str) -> bool:
    """Whether the author's model runs streamed: ``on``, or ``auto`` for a release past
    ``STREAM_PARAMETERS`` (counted from its safetensors headers, nothing loaded)."""
    from ..sources.safetensors import read_header, shard_files

    if stream not in STREAMS:
        raise UsageError(f"--stream must be one of {', '.join(STREAMS)}, got {stream!r}")
    if stream != "auto":
        return stream == "on"
    count = 0
    for shard in shard_files(release):
        for info in read_header(release / shard)["header"].values():
            count += int(np.prod(info["shape"], dtype=np.int64))
    return count > STREAM_PARAMETERS
