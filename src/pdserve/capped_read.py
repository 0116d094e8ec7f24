"""A file named on the command line, read up to a size: `pdserve plan --trace /dev/zero` (or `--profile`) read
until memory ran out. At most `cap + 1` bytes are read, so a pipe (`/dev/stdin`) is read as a file is."""

from __future__ import annotations

from pathlib import Path


def read_capped(path: Path, cap: int, flag: str, why: str) -> bytes:
    """The bytes of `path`, or a ValueError naming the flag, the cap and `why` it is where it is."""
    with path.open("rb") as f:
        data = f.read(cap + 1)
    if len(data) > cap:
        raise ValueError(f"{flag} {path} is over {cap:,} bytes, the most it may be ({why})")
    return data
