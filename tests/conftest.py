"""pytest's fixtures for every test; the shared helpers live in tests/helpers."""

from __future__ import annotations

import pytest


@pytest.fixture
def local_world():
    """In-process trainers make a world of one; tear it down so later forked ranks start clean."""
    import ddpkit

    yield
    ddpkit.destroy_process_group()
