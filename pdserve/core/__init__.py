"""Torch-free accounting every service shares: the block pool, the prefix cache's hash chain,
requests and sampling specs, the model config. Imports nothing above it (no model, engine,
metrics, service or generated protobuf code), so the router and tests use it without torch."""
