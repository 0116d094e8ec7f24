"""Decode worker: receives KV, decodes in a running batch, streams tokens."""
