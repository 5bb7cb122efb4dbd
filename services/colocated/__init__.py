"""The colocated baseline: prefill and decode in one process and one loop, the chapter's engine."""
