"""The backbone: a Qwen3.5 text decoder exported as one chunked function with Core AI states.

How it works: docs/modules.md."""
