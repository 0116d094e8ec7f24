"""What the router says at start about who may call it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pdserve.config import RouterConfig
from pdserve.security.api_keys import digest
from services.router.server import _key_reload


def test_an_open_cluster_says_so_and_a_keyed_one_counts_its_keys(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="services.router.server"):
        assert _key_reload(RouterConfig(), "0.0.0.0", 50051) is None
        path = tmp_path / "keys.toml"
        path.write_text(f'[[keys]]\nsha256 = "{digest("k")}"\ntenant = "t"\n')
        reload = _key_reload(RouterConfig(api_keys_file=str(path)), "0.0.0.0", 50051)
        assert reload is not None and len(reload.table) == 1
    warning, info = caplog.records
    assert warning.levelname == "WARNING" and "cluster is OPEN" in warning.getMessage()
    assert "0.0.0.0:50051" in warning.getMessage() and "1 keys" in info.getMessage()
    assert "drain or scale" in warning.getMessage()  # the Admin service is open too
    with pytest.raises(ValueError, match="no \\[\\[keys\\]\\]"):
        path.write_text("")
        _key_reload(RouterConfig(api_keys_file=str(path)), "h", 1)
