"""The backbone: a Qwen3.5 text decoder exported as one chunked function with Core AI states.

Pipeline: release ``config.json`` -> ``contract.TextConfig`` (names, shapes, states) -> ``weights``
(the release's bf16 tensors streamed once into an fp16 scratch file, memory-mapped) ->
``graph.DecoderChunk`` (torch only) -> ``export`` (torch.export, decompositions, coreai-torch,
a streamed save) -> ``manifest`` -> ``gate`` (the saved asset, chunk by chunk through ``host``,
against transformers' own text model in fp32).
"""
