"""The chaos run's clients: greedy requests over a fixed set of prompts, Poisson arrivals, and what each got.

Every request is greedy with `ignore_eos`, so its right answer is known in advance: the tokens the same cluster
gave the same prompt before any fault (the reference). A request ends one of three ways: a final message (it
completed, with the right output or not), a gRPC status (it failed), or neither (lost: the stream ended without a
final message, or never ended).
"""

from __future__ import annotations

import asyncio
import random
import uuid
from dataclasses import dataclass, field

import grpc

from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc

REQUEST_ID_PREFIX = "chaos-"  # every request the load sends has an id starting with this


@dataclass
class Outcome:
    request_id: str
    prompt: int  # index into the prompt set
    tokens: list[int] = field(default_factory=list)
    finished: bool = False  # a message with a finish reason came
    status: str = ""  # the gRPC status code's name when the call failed
    error: str = ""
    ended: bool = False  # the call returned, one way or another


def prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(length)] for _ in range(count)]


class Load:
    """Sends requests on one channel's stub and keeps every outcome, in the order sent."""

    def __init__(self, stub: generate_pb2_grpc.GenerationStub, prompt_set: list[list[int]], max_tokens: int) -> None:
        self.stub = stub
        self.prompts = prompt_set
        self.max_tokens = max_tokens
        self.outcomes: list[Outcome] = []
        self.tasks: list[asyncio.Task[None]] = []
        self._tag = uuid.uuid4().hex[:8]

    def send(self, prompt: int) -> Outcome:
        outcome = Outcome(f"{REQUEST_ID_PREFIX}{self._tag}-{len(self.outcomes)}", prompt)
        self.outcomes.append(outcome)
        self.tasks.append(asyncio.create_task(self._stream(outcome)))
        return outcome

    async def reference(self) -> list[list[int]]:
        """Each prompt once, all at once, before any fault: the tokens every later request must equal."""
        sent = [self.send(i) for i in range(len(self.prompts))]
        await asyncio.gather(*self.tasks)
        bad = [o for o in sent if not o.finished]
        if bad:
            raise RuntimeError(f"the fault-free reference requests failed: {bad[0].status} {bad[0].error}")
        self.outcomes, self.tasks = [], []
        return [o.tokens for o in sent]

    async def poisson(self, rate: float, stop: asyncio.Event, rng: random.Random) -> None:
        """Requests at `rate` per second (exponential gaps) over the prompt set, until `stop` is set."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), rng.expovariate(rate))
            except TimeoutError:
                self.send(rng.randrange(len(self.prompts)))

    async def settle(self, timeout_s: float) -> None:
        """Waits for every request sent to end, up to `timeout_s`; the ones still open are cancelled (lost)."""
        pending = [t for t in self.tasks if not t.done()]
        if pending:
            _, still = await asyncio.wait(pending, timeout=timeout_s)
            for t in still:
                t.cancel()
            await asyncio.gather(*still, return_exceptions=True)

    async def _stream(self, outcome: Outcome) -> None:
        request = pb.GenerateRequest(
            request_id=outcome.request_id,
            prompt_token_ids=self.prompts[outcome.prompt],
            sampling=pb.SamplingParams(max_tokens=self.max_tokens, ignore_eos=True),
        )
        try:
            async for msg in self.stub.Generate(request):  # no deadline: a hang must show as a hang
                outcome.tokens += msg.token_ids
                outcome.finished |= msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        except grpc.aio.AioRpcError as e:
            outcome.status, outcome.error = e.code().name, e.details() or ""
        outcome.ended = True
