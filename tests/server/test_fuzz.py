"""A bounded property-based fuzz of the server's own OpenAPI schema (schemathesis): whatever
schema-shaped or schema-breaking body arrives, the answer is never a 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

LIMITS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2}  # keep each call short on CPU


@pytest.fixture(scope="session")
def api_schema(server):  # type: ignore[no-untyped-def]
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_no_server_errors(case) -> None:  # type: ignore[no-untyped-def]
    if isinstance(case.body, dict):
        for key, most in LIMITS.items():
            value = case.body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > most:
                case.body[key] = most
        if case.path == "/v1/chat/completions" and "max_completion_tokens" not in case.body:
            case.body["max_completion_tokens"] = LIMITS["max_completion_tokens"]
    response = case.call(timeout=120)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text)
