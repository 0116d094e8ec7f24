"""One worker's measured speed and limits, as `pdserve profile` writes it and the simulator reads it.

The prefill curve and decode step line are the router's own `PerfProfile`; beside it are the terms the
simulator needs and the router does not: the decode step's growth with the context it attends over (also in
`perf`, where the router prices a batch's reported context; the simulator follows contexts as they grow), a
later prefill chunk's reads of the prompt's earlier chunks from the cache, and what an engine step costs beside
the model runner. The raw points stay in the file so a fit can be checked or redone.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pdserve.capped_read import read_capped
from pdserve.protocol.perf_profile import PerfProfile, kv_transfer_s

MAX_PROFILE_BYTES = 2**20  # `pdserve profile` writes about 3 KB: a file 300 times that is no profile
FORMAT_VERSION = 2  # 2: the chunk context term and the step overhead
_COUNTS = ("max_num_seqs", "max_num_batched_tokens", "long_prefill_chunk")  # 0 would never run a step


@dataclass(frozen=True)
class HardwareProfile:
    perf: PerfProfile
    decode_per_context_token_s: float  # per token of KV a decode step attends over, the whole batch summed
    prefill_per_context_token_s: float  # per (new token x cached token) a later chunk of a prompt reads back
    step_overhead_s: float  # an engine step's scheduling, sampling and outputs, beside the runner
    kv_bytes_per_token: int
    kv_capacity_tokens: int  # tokens of KV one worker holds
    transfer_gbps: float  # KV transfer between two workers, GB = 1e9 bytes; 0: its bytes cost nothing measurable
    transfer_latency_s: float = 0.0  # what a transfer costs besides its bytes (the hand-shake, the ack)
    # What a request's first token waits for outside any engine thread on an idle cluster: the router, its
    # RPCs, the hand-off's rendezvous, the relay. Pure latency (no worker is held). `pdserve profile` cannot
    # see it (no cluster); scripts/validate_planner.py --calibrate measures it.
    serving_latency_s: float = 0.0
    # Its spread over those requests, the 5th, 10th, ..., 95th percentiles in seconds (serving_latency.py): the
    # simulator draws each request's latency from them. Empty: it adds the median to every request.
    serving_latency_quantiles_s: list[float] = field(default_factory=list)
    # Where the workers share one host's cores with each other and with the serving stack (`pdserve up` on a
    # CPU): those cores, the CPU seconds a request costs outside every engine thread (router, RPCs, the token
    # relay, the client), and the cores kept busy regardless of requests (idle processes, other programs).
    # 0 cores: each worker has its own device and cores, as pods or GPUs do. scripts/validate_planner.py
    # --calibrate measures them on the local cluster.
    shared_cores: int = 0
    serving_cpu_s: float = 0.0
    background_cores: float = 0.0
    # A worker's RPC loop runs in the engine's process and takes turns with its engine thread for the
    # interpreter lock, so its work lengthens the engine's steps: per prompt on the prefill worker (the call,
    # the hand-off), per token streamed on the decode (or colocated) worker. --calibrate measures them too.
    prefill_loop_s: float = 0.0
    decode_loop_per_token_s: float = 0.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_chunk: int = 512
    # Whether prefill workers run a prompt that fits one step ahead of a longer prompt's remaining chunks, as
    # pdserve's do (cluster/worker_spec.py, engine/short_first.py); False: first come, first served, as they did
    # before. Colocated workers run theirs in order either way.
    short_prompts_first: bool = True
    meta: dict[str, Any] = field(default_factory=dict)  # model, device, dtype, backend, threads
    points: dict[str, list[list[float]]] = field(default_factory=dict)  # the raw measurements

    def __post_init__(self) -> None:
        """A hand-edited or cut profile is refused naming the field: a string, NaN or negative cost would break, or
        silently skew, every simulation after (read as an SLO no split meets), a 0-token chunk would never end a
        prompt, and a prompt that costs nothing leaves no rate to bound."""
        for f in fields(self):
            value, kind = getattr(self, f.name), str(f.type)
            if kind == "bool" and not isinstance(value, bool):
                raise ValueError(f"{f.name} must be true or false, got {value!r}")
            if kind.startswith("dict") and not isinstance(value, dict):
                raise ValueError(f"{f.name} must be a JSON object, got {value!r}")
            number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            if kind in ("float", "int") and not (number and value >= 0 and (kind == "float" or value == int(value))):
                whole = "whole " if kind == "int" else ""
                raise ValueError(f"{f.name} must be a finite {whole}number >= 0, got {value!r}")
        for name in _COUNTS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        perf = asdict(self.perf)
        if bad := next(((k, v) for k, v in perf.items() if not 0 <= v < math.inf), None):
            raise ValueError(f"perf.{bad[0]} must be a finite number >= 0, got {bad[1]!r}")
        if not perf["prefill_per_token_s"] + perf["prefill_per_token2_s"] > 0:
            raise ValueError("perf.prefill_per_token_s: a prompt's tokens must cost time (both per-token terms are 0)")
        context = self.meta.get("context_tokens", 1)  # a profile older than the field has none
        if isinstance(context, bool) or not isinstance(context, int) or context < 1:
            raise ValueError(f"meta.context_tokens must be a whole number >= 1, got {context!r}")
        q = self.serving_latency_quantiles_s
        latencies = isinstance(q, list) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in q)
        if not (latencies and all(0 <= v < math.inf for v in q) and q == sorted(q)):
            raise ValueError(f"serving_latency_quantiles_s must be finite seconds >= 0 in ascending order, got {q!r}")

    def transfer_s(self, tokens: int) -> float:
        return kv_transfer_s(tokens, self.kv_bytes_per_token, self.transfer_gbps, self.transfer_latency_s)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["perf"] = self.perf.to_dict()
        return {"version": FORMAT_VERSION, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HardwareProfile:
        if not isinstance(d, dict):  # a list read as "cannot convert dictionary update sequence element #0 ..."
            raise ValueError(f"it must be a JSON object, got {type(d).__name__}")
        d = dict(d)
        if d.pop("version", FORMAT_VERSION) != FORMAT_VERSION:
            raise ValueError(f"profile format version must be {FORMAT_VERSION}; profile again with pdserve profile")
        if not isinstance(d.get("perf", {}), dict):
            raise ValueError(f"perf must be a JSON object, got {d['perf']!r}")
        return cls(**{**d, "perf": PerfProfile.from_dict(d["perf"])})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: Path) -> HardwareProfile:
        text = read_capped(path, MAX_PROFILE_BYTES, "--profile", "pdserve profile writes about 3 KB")
        try:
            return cls.from_dict(json.loads(text))
        except KeyError as e:  # its text alone is the key's name: "... profile: 'perf'"
            raise ValueError(f"{path} is not a pdserve profile: it has no {e.args[0]!r} key") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path} is not a pdserve profile: {e}") from None
