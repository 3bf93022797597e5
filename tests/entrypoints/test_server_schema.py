"""schemathesis against the real server's own OpenAPI schema: generated requests (valid and not)
never get a 5xx, and every response matches what the schema says (status codes, content types,
JSON bodies). Bounded: a few dozen examples per route, a 64-token context, a short queue."""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (content_type_conformance, not_a_server_error,
                                 response_schema_conformance, status_code_conformance)

from conftest import Server

CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    server = Server(tiny_model_dir("qwen2"), tmp_path_factory.mktemp("schema-logs"), "--max-model-len", "64",
                    "--max-queued-requests", "4", "--max-num-seqs", "4", "--max-logprobs", "5")
    try:
        yield server
    finally:
        server.terminate()


@pytest.mark.slow
def test_the_server_keeps_to_its_schema(server):
    schema = schemathesis.openapi.from_url(server.url("/openapi.json"))
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/responses",
                                             "/v1/responses/{response_id}", "/v1/messages",
                                             "/v1/messages/count_tokens", "/v1/embeddings", "/v1/score", "/v1/rerank"}
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            case.call_and_validate(checks=CHECKS, timeout=60)

        run()
