"""What logs, errors and spans may show of a value that can carry a credential or a request's content."""

from __future__ import annotations

from urllib.parse import unquote_plus

from pdserve.errors import InvalidRequestError


def recorded_text(error: BaseException) -> str:
    """`error`'s text as a span or a log line keeps it: less what of the request its caller's answer quotes
    (InvalidRequestError.recorded)."""
    return error.recorded if isinstance(error, InvalidRequestError) else str(error)


def redacted_url(url: str) -> str:
    """The URL as a log or an error may show it: everything before its last `@` (its user part, where a password
    goes, itself free to hold `@`) and the value of any query key naming a password, however encoded (redis-py
    decodes the names: `%70assword`), replaced by `***`, however malformed the URL. A stray `@` elsewhere hides
    more than it must, never less."""
    head, sep, rest = url.partition("//")
    if not sep:
        head, rest = "", url
    if "@" in rest:
        rest = "***" + rest[rest.rindex("@") :]
    base, mark, query = (head + sep + rest).partition("?")
    fields = [f.partition("=") for f in query.split("&")] if mark else []
    hidden = [f"{k}{eq}***" if "password" in unquote_plus(k).lower() else f"{k}{eq}{v}" for k, eq, v in fields]
    return base + mark + "&".join(hidden)


def has_password(url: str) -> bool:
    """Whether the URL itself carries a password, where redis-py reads one: its user part (`user:password@`,
    `:password@`, up to the last `@`) or a query key naming a password."""
    _, sep, rest = url.partition("//")
    rest = rest if sep else url
    base, _, query = rest.partition("?")
    if "@" in base and ":" in base[: base.rindex("@")]:
        return True
    fields = [f.partition("=") for f in query.split("&")] if query else []
    return any("password" in unquote_plus(k).lower() and v for k, _, v in fields)
