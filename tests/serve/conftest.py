"""Fixtures shared by the serving tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def hermes_server(tmp_path_factory):
    """One ``gqa serve`` of the embedded model with the Hermes chat template (tools) and ``HERMES_KEY`` for the
    modules that talk to it through a client library (test_tools, test_messages_api, test_responses_api): started
    once for the session (~3 s each saved), stopped at its end. Its state (the prefix cache, the grammar cache, the
    stored responses) is shared: no test may depend on it being fresh."""
    pytest.importorskip("uvicorn")
    from tests.helpers.server_process import HERMES_KEY, HERMES_TEMPLATE, Server

    template = tmp_path_factory.mktemp("hermes") / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    s = Server("--chat-template", str(template), "--api-key", HERMES_KEY)
    yield s
    assert s.stop() == 0
