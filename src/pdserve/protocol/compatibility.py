"""What a worker tells routers, through its registry entry, of the protocols it speaks beyond the internal proto:
the optional request features it honours, and its KV transfer header's version. Routers of any build then place
each request where every worker it reaches serves it as asked, while a rollout runs two builds side by side.

Protobuf drops a field its reader does not know: a worker of a build before a feature would serve a request that
asks for it as if it had not (an output constraint ignored, its caller told OK). And a decode worker refuses a KV
header of another version, losing every hand-off pending on that pair (transfer/wire.py).
"""

from __future__ import annotations

from pdserve.protocol.sampling import SamplingParams

OUTPUT_CONSTRAINT = "output_constraint"  # SamplingParams json_schema, json_object, regex
WORKER_FEATURES = (OUTPUT_CONSTRAINT,)  # what this build's workers honour
KV_WIRE_VERSION = 3  # the KV transfer header's layout; a decode worker takes only its own
UNSAID_KV_WIRE_VERSION = 3  # what a worker too old to say speaks: every build since the header's MAC (fee4495)


def needed_features(sampling: SamplingParams) -> frozenset[str]:
    """The worker features a request with these settings needs."""
    return frozenset({OUTPUT_CONSTRAINT}) if sampling.constraint is not None else frozenset()
