"""The inference engine: paged KV cache, continuous batching, sampling."""
