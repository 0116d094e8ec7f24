"""What an engine is asked to run: one request's identity, prompt and sampling, whichever worker role runs it
(the worker's gRPC request, converted once)."""

from __future__ import annotations

from dataclasses import dataclass, field

import llguidance

from pdserve.protocol.sampling import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    request_id: str  # the router's key for the request: unique while it runs here
    prompt: list[int]
    sampling: SamplingParams
    cache_salt: bytes = b""  # the prefix cache shares blocks only between requests with the same salt (a tenant's)
    # The prompt's last tokens are this request's own output from before its stream moved (penalties count them).
    resumed_output_tokens: int = 0
    tenant: str = ""  # whose it is: a waiting queue takes each tenant's prompts in turn (engine/fair_queue.py)
    priority: int = 0  # higher first in a waiting queue
    # The output constraint's grammar compiled against the worker's vocabulary (AsyncEngine.prepare, off the engine
    # thread): the engine copies it, where one evicted from the worker's compiled grammars meanwhile would be
    # compiled again on the engine thread, holding every stream. Worker-local: never sent.
    grammar: llguidance.LLMatcher | None = field(default=None, compare=False, repr=False)
