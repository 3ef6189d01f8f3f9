"""The shared export engine under the three models: weights streamed from the release and quantized,
shards read once past the page cache, the lowered export and the converter's hooks, the asset's weights
read back, and a bundle read against its manifest and release. It knows no model."""
