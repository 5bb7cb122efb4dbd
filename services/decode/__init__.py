"""The decode service: owns a paged KV pool, accepts KV only under a lease, decodes in batches."""
