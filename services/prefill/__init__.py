"""The prefill service: batched prefill, first token, and the KV push to a decode instance."""
