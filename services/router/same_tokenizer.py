"""Which workers a router places on by tokenizer: the ids it tokenized a prompt into are other text to a worker of
another vocabulary, and the ids such a worker streams back are detokenized here as garbage (a model of another
vocabulary rolled out under routers still running the old one)."""

from __future__ import annotations

from pdserve.registry.base import WorkerState


def of_tokenizer(workers: list[WorkerState], tokenizer: str) -> list[WorkerState]:
    """The workers of `tokenizer` (a Tokenizer.digest), and those too old to say; all of them for "" (unchecked)."""
    if not tokenizer:
        return workers
    return [w for w in workers if w.tokenizer in ("", tokenizer)]


def other_tokenizers(workers: list[WorkerState], tokenizer: str) -> str | None:
    """Why no worker serves a router of `tokenizer` when some run another, else None."""
    others = sorted({w.tokenizer for w in workers if w.tokenizer not in ("", tokenizer)}) if tokenizer else []
    if not others:
        return None
    return (
        f"no live worker runs this router's tokenizer ({tokenizer}); others run {', '.join(others)}: a model of "
        "another vocabulary needs routers started with its --model too"
    )
