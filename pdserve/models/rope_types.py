"""RoPE variants pdserve implements; torch-free, so reading a config.json never imports torch."""

SUPPORTED_TYPES = ("default", "linear", "llama3")
