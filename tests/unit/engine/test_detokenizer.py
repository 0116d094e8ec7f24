from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pdserve.engine.byte_tokenizer import build_byte_tokenizer
from pdserve.engine.detokenizer import IncrementalDetokenizer

TOKENIZER = build_byte_tokenizer()
EOS = 2


def _ids(text: str) -> list[int]:
    return TOKENIZER.encode(text).ids


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    """Feed `ids` `chunk` at a time, then flush unless stopped; returns every delta."""
    deltas = [detok.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", ["hello world", "héllo wörld", "日本語のテキスト", "emoji 🙂👍🏽 done", "é"])
@pytest.mark.parametrize("prompt", ["", "a prompt 世界 "])
def test_deltas_concatenate_to_the_decoded_output(text: str, prompt: str) -> None:
    output_ids = _ids(text)
    detok = IncrementalDetokenizer(TOKENIZER, _ids(prompt))
    deltas = _stream(detok, output_ids)
    assert "".join(deltas) == TOKENIZER.decode(output_ids) == text
    assert detok.text == text
    assert not any("\ufffd" in d for d in deltas)
    assert not detok.stopped


def test_a_character_is_emitted_when_its_last_byte_arrives() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, [])
    first, *rest = _ids("世")
    assert detok.step([first]) == ""
    assert detok.step(rest[:-1]) == ""
    assert detok.step(rest[-1:]) == "世"


def test_special_tokens_are_skipped_unless_asked_for() -> None:
    ids = [*_ids("hi"), EOS]
    assert "".join(_stream(IncrementalDetokenizer(TOKENIZER, [], skip_special_tokens=True), ids)) == "hi"
    kept = "".join(_stream(IncrementalDetokenizer(TOKENIZER, [], skip_special_tokens=False), ids))
    assert kept == "hi<|im_end|>"


def test_first_token_is_spaced_as_in_context() -> None:
    # SentencePiece-style: "▁world" decodes to "world" alone but to " world" after other text.
    tokenizer = Tokenizer(models.WordLevel({"▁hello": 0, "▁world": 1, "<unk>": 2}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    prompt, output = tokenizer.encode("hello").ids, tokenizer.encode("world").ids
    assert tokenizer.decode(output) == "world"
    deltas = _stream(IncrementalDetokenizer(tokenizer, prompt), output)
    assert "".join(deltas) == tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)) :] == " world"


def test_stop_string_spanning_tokens_is_cut_and_never_emitted() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, [], stop=("STOP",))
    deltas = []
    for token in _ids("Hello STOP there"):
        deltas.append(detok.step([token]))
        assert "S" not in "".join(deltas)
        if detok.stopped:
            break
    assert detok.stopped
    assert "".join(deltas) == detok.text == "Hello "
    assert detok.step(_ids(" more")) == "" and detok.flush() == ""
    assert detok.text == "Hello "


def test_false_start_is_released_and_true_stop_is_not() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, [], stop=("abc",))
    emitted = [detok.step([t]) for t in _ids("abx")]
    # Only what could still begin "abc" is held back, so "abx" goes out as soon as "x" rules it out.
    assert emitted == ["", "", "abx"]
    assert [detok.step([t]) for t in _ids("abc")] == ["", "", ""]
    assert detok.stopped
    assert detok.text == "abx"


def test_multibyte_stop_string() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, [], stop=("世界",))
    deltas = _stream(detok, _ids("hi 世界!"))
    assert detok.stopped
    assert "".join(deltas) == "hi "


def test_earliest_of_several_stop_strings_wins_within_one_step() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, [], stop=("b", "cd"))
    assert detok.step(_ids("xcdb")) == "x"
    assert detok.stopped


def test_flush_releases_a_held_stop_prefix() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, [], stop=("abc",))
    assert "".join(detok.step([t]) for t in _ids("xab")) == "x"
    assert detok.flush() == "ab"
    assert detok.text == "xab"
    assert not detok.stopped


def test_flush_drops_an_incomplete_trailing_character() -> None:
    ids = _ids("ab") + _ids("世")[:2]
    assert TOKENIZER.decode(ids) == "ab\ufffd"
    detok = IncrementalDetokenizer(TOKENIZER, [])
    assert detok.step(ids) == "ab"  # what precedes the incomplete character goes out at once
    assert detok.flush() == ""
    assert detok.text == "ab"


@pytest.mark.parametrize("stop", [(), ("! ",)])
def test_flush_keeps_the_whole_characters_a_token_holds_before_an_incomplete_one(stop: tuple[str, ...]) -> None:
    """Byte-level BPE: SmolLM2's token "ĠðŁ" is a space and the first two bytes of an emoji. Output ending on it
    keeps the space (and a stop string may end with it); only the emoji's bytes are dropped."""
    tokenizer = Tokenizer(models.WordLevel({"Hi!": 0, "ĠðŁ": 1, "Ĳį": 2, "<unk>": 3}, unk_token="<unk>"))
    tokenizer.decoder = decoders.ByteLevel()
    assert tokenizer.decode([0, 1]) == "Hi! \ufffd" and tokenizer.decode([0, 1, 2]) == "Hi! 🐍"
    detok = IncrementalDetokenizer(tokenizer, [], stop=stop)
    assert "".join(_stream(detok, [0, 1])) == ("Hi" if stop else "Hi! ")
    assert detok.stopped == bool(stop)


def test_a_prompt_ending_inside_a_character_is_never_repeated_in_the_output() -> None:
    """A prompt of token ids may stop mid-character; the output is the output's text alone."""
    prompt = _ids("ab") + _ids("é")[:1]
    assert TOKENIZER.decode(prompt) == "ab\ufffd"
    assert "".join(_stream(IncrementalDetokenizer(TOKENIZER, prompt), _ids("ok"))) == "ok"


def test_a_run_of_invalid_bytes_goes_out_as_replacement_characters() -> None:
    """A model looping on a stray continuation byte: its text goes out every few tokens, not held (and redecoded)
    until the run ends, and the whole is what one decode of every token gives."""
    stray = 3 + 0x80  # the byte tokenizer's id for the byte 0x80, never the start of a character
    ids = [stray] * 100 + _ids("ok")
    detok = IncrementalDetokenizer(TOKENIZER, _ids("prompt"))
    deltas = [detok.step([t]) for t in ids]
    assert "".join(deltas[:100]).count("\ufffd") >= 100 - 8
    assert "".join(deltas) + detok.flush() == TOKENIZER.decode(ids) == "\ufffd" * 100 + "ok"


_text = st.text(st.characters(codec="utf-8", exclude_characters="\ufffd"), max_size=40)


_byte_ids = st.lists(st.integers(3, 258), max_size=8)  # any bytes: a prompt of token ids need not be text


@settings(max_examples=300, deadline=None)
@given(prompt=st.one_of(_text.map(_ids), _byte_ids), text=_text, chunk=st.integers(1, 4))
def test_byte_by_byte_streaming_reproduces_any_text(prompt: list[int], text: str, chunk: int) -> None:
    output_ids = _ids(text)
    deltas = _stream(IncrementalDetokenizer(TOKENIZER, prompt), output_ids, chunk)
    # decode, not `text`: hypothesis finds special-token strings such as "<|im_start|>", which are skipped.
    assert "".join(deltas) == TOKENIZER.decode(output_ids)
    assert not any("\ufffd" in d for d in deltas)


_small = st.text(st.sampled_from("abé世"), max_size=12)


@settings(max_examples=300, deadline=None)
@given(text=_small, stop=_small.filter(bool), chunk=st.integers(1, 3))
def test_output_is_the_text_before_the_first_stop(text: str, stop: str, chunk: int) -> None:
    detok = IncrementalDetokenizer(TOKENIZER, [], stop=(stop,))
    emitted = ""
    for i in range(0, len(_ids(text)), chunk):
        emitted += detok.step(_ids(text)[i : i + chunk])
        assert stop not in emitted
        # Nothing emitted may later turn out to be part of the stop string.
        assert text.find(stop) < 0 or len(emitted) <= text.find(stop)
    emitted += detok.flush()
    assert detok.stopped == (stop in text)
    assert emitted == detok.text == (text[: text.find(stop)] if stop in text else text)
