"""``GET /health`` reports each stage's state: 200 while all serve, 503 while one is down."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from vllm_omni.entrypoints.openai.api_server import build_app
from vllm_omni.entrypoints.openai.settings import ServerSettings
from vllm_omni.entrypoints.openai.state import ServerState


def _client(health: dict[int, str]) -> TestClient:
    omni = SimpleNamespace(stage_health=lambda: dict(health))
    state = ServerState(omni=omni, settings=ServerSettings(), registry=None, base_name="m", info=None)
    return TestClient(build_app(state))


@pytest.mark.parametrize(
    ("health", "status"),
    [
        ({0: "ready", 1: "ready"}, 200),
        ({0: "restarting", 1: "ready"}, 503),
        ({0: "ready", 1: "dead"}, 503),
    ],
)
def test_health_answers_per_stage(health, status):
    reply = _client(health).get("/health")
    assert reply.status_code == status
    assert reply.json() == {"stages": {str(k): v for k, v in health.items()}}
