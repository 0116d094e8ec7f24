"""A byte-level BPE tokenizer with no merges: every UTF-8 byte is one token.

It is the tokenizer of the built-in `tiny-random` model. Multi-byte characters span several tokens,
which is what the UTF-8 safety of incremental detokenization has to survive.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_byte_tokenizer() -> Tokenizer:
    """Special tokens take ids 0..2 (EOS is `<|im_end|>`, id 2); the 256 byte symbols follow."""
    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_value)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({sym: len(SPECIAL_TOKENS) + i for i, sym in enumerate(byte_symbols)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def _byte_value(symbol: str) -> int:
    """ByteLevel maps each byte to one printable character; recover the byte for a stable order."""
    return _SYMBOL_TO_BYTE[symbol]


def _bytes_to_unicode() -> dict[int, str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars), strict=True))


_SYMBOL_TO_BYTE = {sym: b for b, sym in _bytes_to_unicode().items()}


def byte_level_bytes(token: str) -> bytes | None:
    """The bytes a byte-level BPE token (its symbols, as the vocabulary spells it) stands for; None when a
    symbol is outside ByteLevel's alphabet."""
    try:
        return bytes(_SYMBOL_TO_BYTE[symbol] for symbol in token)
    except KeyError:
        return None
