"""What a command that calls the router adds to a failure the caller's own flags explain: a plaintext client that
cannot connect to a router serving TLS sees only gRPC's "failed to connect ... Socket closed" (a TLS one at a
plaintext router OpenSSL's "WRONG_VERSION_NUMBER"; one at the HTTP API's port "Failed parsing HTTP/2"), and a client
without a key the server's "send metadata `authorization: Bearer KEY`", which names no flag. The server's message
stays as it is for other gRPC callers; only the CLI (`pdserve client`, `pdserve status`, loadgen) says which flag to
pass."""

from __future__ import annotations

from pdserve.rpc.credentials import ClientCredentials

TLS_HINT = "(if the router serves TLS, pass --tls-ca)"
GRPC_PORT_HINT = "(what answered speaks HTTP/1, not gRPC: pass the router's gRPC --port, not its --http-port)"
PLAINTEXT_HINT = "(the router answered without TLS: drop --tls-ca, or serve TLS with its --tls-cert and --tls-key)"
KEY_HINT = "(--api-key or PDSERVE_API_KEY)"


def connection_failed(code: str, details: str) -> bool:
    """The channel reached no server it could talk to; not one that answered, and not nothing listening (connection
    refused), where TLS is no explanation."""
    return code == "UNAVAILABLE" and "failed to connect" in details.lower() and "refused" not in details.lower()


def exit_status(code: str) -> int:
    """A command's exit status when the router refused its call with `code` (a status's name): 2 when the request
    is wrong, so that retrying it as it is can never work (INVALID_ARGUMENT, as for a bad flag), else 1
    (docs/cli.md#exit-status)."""
    return 2 if code == "INVALID_ARGUMENT" else 1


def with_hint(code: str, details: str, credentials: ClientCredentials | None) -> str:
    """`details` and, where the caller passed neither TLS nor a key and that explains `code`, the flag to pass."""
    credentials = credentials or ClientCredentials()
    if connection_failed(code, details) and "Failed parsing HTTP/2" in details:
        return f"{details} {GRPC_PORT_HINT}"  # the OpenAI API's port, or any web server
    if not credentials.tls_ca and connection_failed(code, details):
        return f"{details} {TLS_HINT}"
    if credentials.tls_ca and connection_failed(code, details) and "WRONG_VERSION_NUMBER" in details:
        return f"{details} {PLAINTEXT_HINT}"  # OpenSSL's words for an answer that is no TLS record
    if code == "UNAUTHENTICATED" and not credentials.api_key:
        return f"{details} {KEY_HINT}"
    return details


def rpc_error_line(command: str, code: str, details: str, credentials: ClientCredentials | None) -> str:
    """`pdserve client: UNAVAILABLE: failed to connect ... (if the router serves TLS, pass --tls-ca)`."""
    return f"{command}: {code}: {with_hint(code, details, credentials)}"
