"""The backbone: a Qwen3.5 text decoder exported as one chunked function with Core AI states.

Pipeline: release ``config.json`` -> ``contract.TextConfig`` (names, shapes, states) -> ``weights``
(every tensor located in the shards; large ones laid out over a sparse scratch file, small ones
converted into it) -> ``graph.DecoderChunk`` (torch only) -> ``export`` (torch.export,
decompositions, coreai-torch with placeholders for the large tensors, then ``mlirb.inflate``:
main.mlirb written once, each large tensor converted from the release straight into it) ->
``manifest`` -> ``gate`` (the saved asset, chunk by chunk through ``host``, against transformers'
own text model in fp32).
"""
