"""The torch half of serving: the model runner, the schedulers that feed it, the paged KV cache,
chunked and prefix-cached prefill, sampling, and the loop that runs the steps."""
