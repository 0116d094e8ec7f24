"""Where routers learn which workers exist: an in-process registry, or Redis for several routers."""
