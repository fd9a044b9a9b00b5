"""Fixtures of the checkpoint tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ckpt_support import SaverServer


@pytest.fixture
def saver_server(tmp_path: Path) -> Iterator[Callable[[Path, str], SaverServer]]:
    """Start kill-helper servers for a checkpoint path and mode; all are stopped afterwards."""
    servers: list[SaverServer] = []

    def start(path: Path, mode: str = "sync") -> SaverServer:
        servers.append(SaverServer(path, mode, tmp_path / f"helper-stderr-{len(servers)}.txt"))
        return servers[-1]

    yield start
    for server in servers:
        server.close()
