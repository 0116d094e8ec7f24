"""The control messages of a transfer: the header that opens it and the status that closes it.

Both are int64 tensors, so nothing is pickled. Strings (model fingerprint, dtype) travel as 64-bit hashes: the
header has a fixed size, and the receiver keeps it posted between transfers without knowing what comes next.

The header's last two words are an HMAC-SHA256 (first 128 bits) of the rest, keyed with the cluster secret: it
binds the request (its tag, random per request) to the layout and block count, so a peer that does not hold the
secret cannot aim blocks at another request's pending receive. A header that fails it is drained and refused
(FORGED) without touching the receive its tag names, which still takes the real transfer.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, fields

import torch

from pdserve.protocol.compatibility import KV_WIRE_VERSION
from pdserve.transfer.base import PeerLostError
from pdserve.transfer.layout import KVLayout

_MAGIC = 0x7064_4B56  # "pdKV"
MAX_SEGMENTS = 8
HEADER_LEN = 24
# Past any model's: a header beyond them is a protocol error, never a drain sized by the sender's word alone.
MAX_LAYERS = 1024
MAX_BLOCK_BYTES = 64 * 2**20
MAX_BLOCKS = 2**24
MAX_TIMEOUT_MS = 86_400_000
_MAC_AT = HEADER_LEN - 2  # two int64 words: 128 bits of HMAC-SHA256
STATUS_LEN = 2  # code, detail

# Status codes: the blocks are in place, or why the receiver refused the transfer.
OK, LAYOUT, NOT_EXPECTED, BLOCK_COUNT, FORGED = range(5)


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


# Dtype names a receiver can recover from their hash, to name the sender's dtype in a mismatch.
_KNOWN_DTYPES = {_hash64(n): n for n in ("float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "float8_e5m2")}


def check_tag(tag: int) -> None:
    """The tag travels in an int64 header field."""
    if not 0 <= tag < 2**63:
        raise ValueError(f"tag must lie in [0, 2**63), got {tag}")


def block_bytes(layout: KVLayout) -> int:
    """Bytes one block adds to a data message: its keys (or values) in one layer."""
    return layout.layer_block_bytes // 2


def layout_mask(names: list[str]) -> int:
    """The differing KVLayout fields as a bit mask, to fit a status detail."""
    return sum(1 << i for i, f in enumerate(fields(KVLayout)) if f.name in names)


def layout_fields(mask: int) -> list[str]:
    return [f.name for i, f in enumerate(fields(KVLayout)) if mask >> i & 1]


@dataclass(frozen=True)
class Header:
    tag: int
    num_blocks: int
    fingerprint_hash: int
    dtype_hash: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_bytes: int  # of one block in one data message: lets the receiver drain a transfer it rejects
    timeout_ms: int
    segments: tuple[int, ...]  # block counts of the consecutive spans each layer's keys (values) are sent in
    authentic: bool = True  # on a decoded header: its MAC verified under the receiver's secret

    @classmethod
    def for_transfer(
        cls, tag: int, num_blocks: int, layout: KVLayout, timeout_s: float, segments: tuple[int, ...]
    ) -> Header:
        return cls(
            tag=tag,
            num_blocks=num_blocks,
            fingerprint_hash=_hash64(layout.model_fingerprint),
            dtype_hash=_hash64(layout.dtype),
            block_size=layout.block_size,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            block_bytes=block_bytes(layout),
            timeout_ms=int(timeout_s * 1000),
            segments=segments,
        )

    def encode(self, secret: bytes = b"") -> torch.Tensor:
        t = torch.zeros(HEADER_LEN, dtype=torch.int64)
        values = [_MAGIC, KV_WIRE_VERSION, self.tag, self.num_blocks, self.fingerprint_hash, self.dtype_hash]
        values += [self.block_size, self.num_layers, self.num_kv_heads, self.head_dim, self.block_bytes]
        values += [self.timeout_ms, len(self.segments), *self.segments]
        t[: len(values)] = torch.tensor(values, dtype=torch.int64)
        t[_MAC_AT:] = torch.tensor(_mac(secret, t[:_MAC_AT].tolist()), dtype=torch.int64)
        return t

    @classmethod
    def decode(cls, t: torch.Tensor, secret: bytes = b"") -> Header:
        v = t.tolist()
        authentic = hmac.compare_digest(_mac_bytes(secret, v[:_MAC_AT]), _words_bytes(v[_MAC_AT:]))
        if v[0] != _MAGIC or v[1] != KV_WIRE_VERSION:
            raise PeerLostError(
                f"protocol error: header magic/version {v[0]:#x}/{v[1]}, want {_MAGIC:#x}/{KV_WIRE_VERSION}"
            )
        num_segments = v[12]
        segments = tuple(v[13 : 13 + num_segments]) if 0 < num_segments <= MAX_SEGMENTS else ()
        if not segments or min(segments) < 1 or sum(segments) != v[3]:
            raise PeerLostError(f"protocol error: segments {v[12:]} do not split {v[3]} blocks")
        tag, num_blocks, fingerprint_hash, dtype_hash, block_size, num_layers, num_kv_heads, head_dim = v[2:10]
        sizes = (
            ("num_layers", num_layers, MAX_LAYERS),
            ("block_bytes", v[10], MAX_BLOCK_BYTES),
            ("num_blocks", num_blocks, MAX_BLOCKS),
            ("timeout_ms", v[11], MAX_TIMEOUT_MS),
        )
        for name, value, most in sizes:
            if not 0 < value <= most:
                raise PeerLostError(f"protocol error: header {name} {value} outside 1..{most}")
        return cls(
            tag,
            num_blocks,
            fingerprint_hash,
            dtype_hash,
            block_size,
            num_layers,
            num_kv_heads,
            head_dim,
            block_bytes=v[10],
            timeout_ms=v[11],
            segments=segments,
            authentic=authentic,
        )

    def layout(self, mine: KVLayout) -> KVLayout:
        """The sender's layout as far as the hashes tell: strings that hash like ours are ours."""
        fingerprint = mine.model_fingerprint
        if _hash64(fingerprint) != self.fingerprint_hash:
            fingerprint = f"<another fingerprint, hash {self.fingerprint_hash & (2**64 - 1):016x}>"
        dtype = mine.dtype
        if _hash64(dtype) != self.dtype_hash:
            dtype = _KNOWN_DTYPES.get(self.dtype_hash, "<other dtype>")
        return KVLayout(fingerprint, dtype, self.block_size, self.num_layers, self.num_kv_heads, self.head_dim)


def _words_bytes(words: list[int]) -> bytes:
    return b"".join(w.to_bytes(8, "little", signed=True) for w in words)


def _mac_bytes(secret: bytes, words: list[int]) -> bytes:
    return hmac.new(secret, _words_bytes(words), hashlib.sha256).digest()[:16]


def _mac(secret: bytes, words: list[int]) -> list[int]:
    mac = _mac_bytes(secret, words)
    return [int.from_bytes(mac[i : i + 8], "little", signed=True) for i in (0, 8)]
