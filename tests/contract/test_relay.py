"""What the relay carries: only the three client routes, never the runtime's leaking ones,
without hop-by-hop headers or the client's key, and error codes a RESET can carry."""

from __future__ import annotations

import pytest

from modelforge_contract import relay
from modelforge_contract.tunnel import json_of, reset_frame

pytestmark = pytest.mark.every_python  # tests/parts.py: on every CPython


def test_only_the_three_client_routes_are_relayed_and_only_by_post():
    assert relay.is_relayed("POST", "/v1/chat/completions")
    assert relay.is_relayed("POST", "/v1/completions")
    assert relay.is_relayed("POST", "/v1/embeddings")
    for method, path in [
        ("GET", "/v1/chat/completions"),
        ("POST", "/v1/models"),  # the control plane answers it itself
        ("POST", "/v1/chat/completions/"),
        ("POST", "/v1/chat/completions?x=1"),
        ("POST", "/v1/../props"),
        ("POST", "/V1/embeddings"),
        *(("GET", p) for p in relay.RUNTIME_PATHS_NOT_RELAYED),
        *(("POST", p) for p in relay.RUNTIME_PATHS_NOT_RELAYED),
    ]:
        assert not relay.is_relayed(method, path), (method, path)
    assert {"/props", "/slots", "/metrics"} == relay.RUNTIME_PATHS_NOT_RELAYED


def test_hop_by_hop_headers_and_those_connection_names_are_dropped():
    headers = [
        ("Content-Type", "text/event-stream"),
        ("Connection", "keep-alive, X-Private"),
        ("Keep-Alive", "timeout=5"),
        ("Transfer-Encoding", "chunked"),
        ("X-Private", "1"),
        ("TE", "trailers"),
        ("Upgrade", "h2c"),
        ("Proxy-Authorization", "Basic x"),
        ("Cache-Control", "no-cache"),
    ]
    assert relay.relayable_headers(headers) == [
        ("Content-Type", "text/event-stream"),
        ("Cache-Control", "no-cache"),
    ]
    request = [("Authorization", "Bearer mfk_x"), ("Host", "cp"), ("Cookie", "a=b"), ("A", "1")]
    assert relay.relayable_headers(request, relay.REQUEST_HEADERS_NOT_RELAYED) == [("A", "1")]
    answer = [("Content-Length", "10"), ("Set-Cookie", "x"), ("Content-Type", "a/b")]
    assert relay.relayable_headers(answer, relay.RESPONSE_HEADERS_NOT_RELAYED) == [
        ("Content-Type", "a/b")
    ]


def test_the_relay_error_codes_are_their_own_names_and_have_a_status():
    for code in relay.RELAY_ERROR_CODES:
        assert getattr(relay, code) == code
    assert relay.RELAY_ERROR_STATUS[relay.MODEL_NOT_DEPLOYED] == 404
    assert relay.RELAY_ERROR_STATUS[relay.NO_RUNNING_SERVER] == 503
    assert relay.RELAY_ERROR_STATUS[relay.NODE_LINK_LOST] == 502
    assert set(relay.RELAY_ERROR_STATUS) <= set(relay.RELAY_ERROR_CODES)
    # A RESET can carry every one of them.
    for code in relay.RELAY_ERROR_CODES:
        assert json_of(reset_frame(1, code, "x"))["code"] == code


def test_a_client_sees_only_the_allow_listed_response_headers_one_of_each():
    from_node = [
        ("Content-Type", "application/json"),
        ("Set-Cookie", "a=b"),
        ("Access-Control-Allow-Origin", "*"),
        ("Location", "/api/v1/admin/api-keys"),
        ("X-Accel-Redirect", "/api/v1/admin/api-keys"),
        ("Server", "llama.cpp"),
        ("Content-Length", "10"),
        ("Transfer-Encoding", "chunked"),
        ("content-type", "text/html"),  # a second one: the first stands
        ("X-Request-Id", "r1"),
        ("Retry-After", "2"),
        ("Cache-Control", "no-cache"),
    ]
    assert relay.client_headers(from_node) == [
        ("Content-Type", "application/json"),
        ("X-Request-Id", "r1"),
        ("Retry-After", "2"),
        ("Cache-Control", "no-cache"),
    ]


@pytest.mark.parametrize(
    ("lengths", "framed"),
    [(["12"], 12), ([" 7 "], 7), ([], None), (["12", "13"], None), (["12", "12"], None),
     (["-1"], None), (["1e3"], None), (["\u0661"], None), (["9" * 16], None)],
)  # fmt: skip
def test_a_body_is_framed_by_its_length_only_when_it_has_exactly_one_plain_one(lengths, framed):
    headers = [("Content-Type", "application/json"), *(("Content-Length", v) for v in lengths)]
    assert relay.single_content_length(headers) == framed


def test_only_an_identity_body_is_relayed():
    assert relay.ACCEPT_ENCODING_TO_RUNTIME == "identity"
    for value in (None, "", "identity", " Identity "):
        assert relay.is_identity_encoding(value)
    for value in ("gzip", "br", "deflate", "gzip, identity", "x-gzip"):
        assert not relay.is_identity_encoding(value)
