"""`pdserve generate` and `pdserve client` take an output constraint: --json-schema FILE, --json-object or --regex, one
at most; a schema file that cannot be read, or a constraint that does not compile, is exit 2 naming it."""

from __future__ import annotations

import json
import re

import pytest

from pdserve.cli import main


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
