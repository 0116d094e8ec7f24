"""`pdserve generate` and `pdserve client` take an output constraint: --json-schema FILE, --json-object or --regex, one
at most; a schema file that cannot be read, or a constraint that does not compile, is exit 2 naming it."""

from __future__ import annotations

import json
import re

import pytest

from pdserve.cli import _parser, main
from pdserve.flags import sampling_from_flags


def test_generate_holds_its_output_to_the_constraint(tmp_path, capsys):
    schema = tmp_path / "schema.json"
    only_ok = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    schema.write_text(json.dumps(only_ok))
    common = ["generate", "--model", "tiny-random", "--prompt", "hi", "--max-tokens", "16", "--threads", "1"]
    assert main([*common, "--regex", "[0-9]{3}"]) == 0
    assert re.fullmatch(r"### hi\n[0-9]{3}\n\[3 tokens, stop\]\n\n", capsys.readouterr().out)
    assert main([*common, "--json-schema", str(schema)]) == 0
    text = capsys.readouterr().out.removeprefix("### hi\n").rsplit("\n[", 1)[0]
    assert json.loads(text) in ({"ok": True}, {"ok": False})


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--json-schema", "/nonexistent/schema.json"], "sampling.json_schema: cannot read /nonexistent/schema.json"),
        (["--json-schema", "/dev/zero"], "sampling.json_schema: /dev/zero is over 65536 bytes, the most it may be"),
        (["--json-schema", "LATIN1"], "sampling.json_schema: LATIN1 is not UTF-8 text"),
        (["--regex", "[0-9"], "sampling.regex: does not compile"),
    ],
)
def test_a_bad_constraint_is_exit_2_naming_it(flags, says, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "LATIN1").write_bytes('{"enum": ["café"]}'.encode("latin-1"))
    assert main(["generate", "--model", "tiny-random", "--prompt", "hi", *flags]) == 2
    assert says in capsys.readouterr().err


def test_one_constraint_at_most(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--prompt", "hi", "--regex", "a", "--json-object"])
    assert exited.value.code == 2 and "not allowed with argument --regex" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "--model", "tiny-random"], ["client", "--addr", "127.0.0.1:1"]])
def test_top_k_minus_one_is_off_as_both_apis_read_it_and_below_is_a_usage_error(capsys, command) -> None:
    """The CLI refused the -1 that vLLM clients send and both APIs take as off."""
    parse = _parser().parse_args
    assert sampling_from_flags(parse([*command, "--prompt", "hi", "--top-k", "-1"]), 8).top_k == 0
    assert sampling_from_flags(parse([*command, "--prompt", "hi", "--top-k", "5"]), 8).top_k == 5
    with pytest.raises(SystemExit):
        parse([*command, "--prompt", "hi", "--top-k", "-2"])
    assert "argument --top-k: must lie in [-1, 2.14748e+09)" in capsys.readouterr().err
