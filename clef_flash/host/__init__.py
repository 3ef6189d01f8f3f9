"""The host: a release's shipped assets answering SystemOne requests with no author code, no torch
and no transformers (``encode``: the prompt; ``requests``: a body checked, its image decoded;
``dist``: a release folder opened; ``model``: one request through tokenizer, decoder, tower, table
and head; ``answer`` and ``server``: the two ways in; ``vectors``: the conformance file a port in
another language proves itself against).

How it works: docs/modules.md."""
