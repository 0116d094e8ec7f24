"""Prefill worker: runs prompts, hands their KV to decode workers."""
