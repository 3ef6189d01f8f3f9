"""Synthetic releases (random weights, fixed seeds, labelled as such) for tests and benchmarks: the tiny
release and the head snapshot (``release``), the real-width decoder (``wide``) and its tower (``tower``).
Above the models: it writes every model's files."""
