"""The HTTP API's CORS settings are refused at start, in one line naming the flag, when no browser could match them
(an origin not written as a browser sends it) or the CORS spec forbids them (`*` with credentials); good ones are
taken from repeated or comma-separated flags and from a config file."""

from __future__ import annotations

import pytest

from pdserve import cli
from pdserve.config import RouterConfig
from services.main import main

ROUTER = ["router", "--model", "tiny-random", "--redis", "redis://127.0.0.1:1/0", "--http-port", "8000"]


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--http-cors-origins", "https://chat.example.com/"], "write 'https://chat.example.com'"),
        (["--http-cors-origins", "https://chat.example.com/app"], "is no origin: scheme://host[:port]"),
        (["--http-cors-origins", "HTTPS://Chat.Example.com"], "write 'https://chat.example.com'"),
        (["--http-cors-origins", "https://chat.example.com:443"], "write 'https://chat.example.com'"),
        (["--http-cors-origins", "http://localhost:80"], "write 'http://localhost'"),
        (["--http-cors-origins", "http://localhost:08080"], "write 'http://localhost:8080'"),
        (["--http-cors-origins", "chat.example.com"], "is no origin"),
        (["--http-cors-origins", "https://user@chat.example.com"], "is no origin"),
        (["--http-cors-origins", "https://chat.example.com:99999"], "has no valid port"),
        (["--http-cors-origins", "https://a.example,"], "'' is no origin"),
        (["--http-cors-origins", "null"], "'null' cannot be allowed"),
        (["--http-cors-origins", "https://*.com"], "one domain of two labels at least"),
        (["--http-cors-origins", "http://*.localhost:5173"], "one domain of two labels at least"),
        (["--http-cors-origins", "https://*.*.example.com"], "stands only before it"),
        (["--http-cors-origins", "https://*.10.0.0.1"], "one domain of two labels at least"),
        (["--http-cors-origins", "https://pr-*.example.com"], "is no origin: scheme://host[:port]"),
        (["--http-cors-origins", "https://*.Example.com:443"], "write 'https://*.example.com'"),
        (["--http-cors-origins", "*,https://a.example"], "'*' already allows every origin"),
        (["--http-cors-origins", "*", "--http-cors-allow-credentials"], "'*' cannot go with credentials"),
    ],
)
def test_origins_no_browser_sends_or_the_spec_forbids_are_refused_naming_the_flag(capsys, flags, line):
    assert main([*ROUTER, *flags]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith("pdserve router: --http-cors-origins "), err
    assert line in err, err


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        ([*ROUTER, "--http-cors-allow-credentials"], "--http-cors-allow-credentials needs the origins"),
        (ROUTER[:-2] + ["--http-cors-origins", "https://a.example"], "--http-cors-origins needs --http-port"),
    ],
)
def test_a_setting_that_would_do_nothing_is_refused(capsys, argv, line):
    assert main(argv) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith(f"pdserve router: {line}"), err


def test_origins_come_repeated_or_comma_separated_and_none_by_default():
    parse = cli._parser().parse_args
    origins = ("https://a.example", "http://localhost:5173", "chrome-extension://abcdefgh", "http://[::1]:8080")
    origins += ("https://*.preview.example.com", "http://*.dev.example.com:8080")
    flags = ["--http-cors-origins", ", ".join(origins[:2]), "--http-cors-origins", ",".join(origins[2:])]
    config = cli._cluster_config(parse([*ROUTER, *flags, "--http-cors-allow-credentials"])).router
    assert config.http_cors_origins == origins and config.http_cors_allow_credentials
    default = cli._cluster_config(parse(ROUTER)).router
    assert default.http_cors_origins == () and not default.http_cors_allow_credentials
    assert cli._cluster_config(parse([*ROUTER, "--http-cors-origins", "*"])).router.http_cors_origins == ("*",)


def test_a_config_file_lists_them_as_an_array_of_strings(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text('[router]\nhttp_cors_origins = ["https://a.example"]\nhttp_cors_allow_credentials = true\n')
    config = RouterConfig.from_file(str(path))
    assert config.http_cors_origins == ("https://a.example",) and config.http_cors_allow_credentials
    path.write_text('[router]\nhttp_cors_origins = "https://a.example"\n')
    with pytest.raises(ValueError, match="http_cors_origins must be an array of strings"):
        RouterConfig.from_file(str(path))
    path.write_text('[router]\nhttp_cors_origins = ["https://a.example/"]\n')
    with pytest.raises(ValueError, match="router.toml: http_cors_origins 'https://a.example/' is never sent so"):
        RouterConfig.from_file(str(path))
