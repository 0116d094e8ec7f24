"""What routers admitted, shed and finished, for `pdserve autoscale`: cumulative counts, so every reader takes
differences over its own window (the arrival rate, the mean prompt and output lengths) and no reader resets them."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass
class AdmittedTotals:
    requests: int = 0
    prompt_tokens: int = 0
    max_tokens: int = 0  # what admission charged for output: the most the load may ask for
    finished: int = 0  # requests that ran to their end (a stop, EOS or max_tokens)
    completion_tokens: int = 0  # what those generated: the output length the load really asks for
    # Requests admission turned away for the cluster's load (not a key's quota), and their prompts: with the
    # admitted ones, the load the clients offered, which an overloaded cluster's admitted rate alone never shows.
    shed: int = 0
    shed_prompt_tokens: int = 0

    def add(self, prompt_tokens: int, max_tokens: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.max_tokens += max_tokens

    def turned_away(self, prompt_tokens: int) -> None:
        self.shed += 1
        self.shed_prompt_tokens += prompt_tokens

    def finish(self, completion_tokens: int) -> None:
        self.finished += 1
        self.completion_tokens += completion_tokens

    def since(self, earlier: AdmittedTotals) -> AdmittedTotals:
        return AdmittedTotals(*(getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)))

    def merge(self, more: AdmittedTotals) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(more, f.name))

    def copy(self) -> AdmittedTotals:
        return replace(self)
