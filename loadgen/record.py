"""What the client saw of one request: when it was sent, when each streamed message came, how it ended."""

from __future__ import annotations

from dataclasses import dataclass, field

OK = "OK"
REJECTED = "RESOURCE_EXHAUSTED"  # shed by the router's admission
EMPTY_STREAM = "EMPTY_STREAM"  # ended OK without a token: failed, as vLLM counts a stream with no valid chunk
CLIENT_ERROR = "CLIENT_ERROR"  # the client could not read the answer (a malformed event): failed, the run goes on
CANCELLED = "CANCELLED"  # in flight when loadgen was interrupted (Ctrl-C): loadgen's cancel, not the server's failure


@dataclass
class RequestRecord:
    request_id: str
    # Prompt tokens: the server's own count where its answer says (usage.prompt_tokens, as vLLM takes it), else the
    # workload's. A chat prompt is the ids' text, which the server tokenizes anew inside its chat template.
    input_len: int
    output_len: int  # asked for (max_tokens with ignore_eos)
    scheduled_s: float  # planned send time, from the run's start
    # Actual send time, from the run's start: its message built, when its latencies' clock starts (sent_clock); later
    # than planned when the concurrency bound held it or loadgen ran late.
    start_s: float = 0.0
    # How long the in-flight bound (--max-concurrency or loadgen's default) held it back before its send: not in
    # its latencies, which start at the send; start_s - scheduled_s - wait_s is loadgen's own lateness.
    wait_s: float = 0.0
    status: str = OK  # a gRPC status code name
    error: str = ""
    error_s: float | None = None  # a request that did not complete: from its send to its error (a shed: its refusal)
    # time.perf_counter() at its send, the 0 of message_times_s and error_s: the backend's, once its message is built
    # (as vLLM's timer starts), else the client's as the bound let it go. A clock reading, in no result.
    sent_clock: float = 0.0
    message_times_s: list[float] = field(default_factory=list)  # from its send to each streamed message
    message_tokens: list[int] = field(default_factory=list)  # tokens in each streamed message
    # The server's own count of the tokens it streamed, where its messages do not say (an OpenAI stream's usage:
    # its chunks are counted one token each, and each stays one ITL gap, as vLLM times them).
    reported_tokens: int | None = None

    @property
    def output_tokens(self) -> int:
        return sum(self.message_tokens) if self.reported_tokens is None else self.reported_tokens

    @property
    def completed(self) -> bool:
        return self.status == OK
