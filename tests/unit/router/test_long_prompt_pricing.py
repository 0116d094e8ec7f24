"""A long prompt, or one after a long cached prefix, priced as the worker runs it: in chunks, each new token
attending to every token before it (the profile's fit, perf_profile.py), not as a short prompt's curve stretched."""

from __future__ import annotations

import pytest

from pdserve.config import RouterConfig
from pdserve.protocol.perf_profile import PerfProfile
from services.router.load_tracker import LoadTracker
from services.router.predictor import Predictor
from tests.unit.router.router_builder import worker

# Round numbers near what smollm2-135m measured on 2 CPU cores: a 512-token chunk ~1 s, ~3 s after 3.5k tokens.
CHUNKED = PerfProfile(0.02, 1.5e-3, 5e-7, 0.06, 4e-3)


@pytest.mark.parametrize("method", ["own_ttft_s", "offer_ttft_s"])
def test_a_prompt_after_a_cached_prefix_pays_for_reading_it(method: str) -> None:
    """The last 512 tokens of a 4096-token prompt whose first 3584 are cached cost one chunk at depth: more than a
    512-token prompt alone, less than the whole prompt."""
    pred = Predictor(RouterConfig(), LoadTracker())
    w = worker("p0", profile=CHUNKED)
    price = getattr(pred, method)
    tail, alone, whole = price(w, 4096, 3584), price(w, 512, 0), price(w, 4096, 0)
    assert tail - alone == pytest.approx(5e-7 * 2 * 512 * 3584)
    assert alone < tail < whole
