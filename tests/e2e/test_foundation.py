"""Foundation end to end: a real Envoy loads the built kvgate.wasm; malformed bodies get an
OpenAI-style 400, oversized ones 413, valid ones reach the upstream with kvgate's estimate visible,
and a client-supplied destination header never reaches the upstream."""

import json

import pytest

from harness import StubUpstream, kvgate_envoy, request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello there, how are you today?"}],
        "max_tokens": 32}


def test_valid_request_passes_with_estimate_headers():
    with StubUpstream() as up, kvgate_envoy([("127.0.0.1", up.port)], {"debugHeaders": True}) as envoy:
        r = request(envoy.port, "POST", "/v1/chat/completions", CHAT)
        assert r.status == 200, r.body
        assert int(r.headers["x-kvgate-prompt-tokens"]) > 0
        assert int(r.headers["x-kvgate-cost"]) >= int(r.headers["x-kvgate-prompt-tokens"])
        assert r.headers["x-kvgate-output-tokens"] == "32"
        path, _, body = up.received[-1]
        assert path == "/v1/chat/completions"
        assert json.loads(body) == CHAT, "the body reaches the upstream unchanged"


def test_malformed_json_gets_openai_400():
    with StubUpstream() as up, kvgate_envoy([("127.0.0.1", up.port)]) as envoy:
        for body in [b"{not json", b"[]", b'{"model":"m"}', b'{"model":"m","messages":"x"}', b"\xff\xfe"]:
            r = request(envoy.port, "POST", "/v1/chat/completions", body)
            assert r.status == 400, (body, r.status, r.body)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"]
        assert up.received == [], "nothing malformed reached the upstream"


def test_oversized_body_gets_413_and_unknown_paths_pass():
    cfg = {"maxBodyBytes": 4096}
    with StubUpstream() as up, kvgate_envoy([("127.0.0.1", up.port)], cfg) as envoy:
        big = dict(CHAT, messages=[{"role": "user", "content": "x" * 10000}])
        r = request(envoy.port, "POST", "/v1/chat/completions", big)
        assert r.status == 413, r.body
        assert "maxBodyBytes" in r.json()["error"]["message"]
        r = request(envoy.port, "GET", "/v1/models")
        assert r.status == 200
        r = request(envoy.port, "POST", "/not/openai", b"anything", {"content-type": "text/plain"})
        assert r.status == 200


def test_client_destination_header_is_stripped():
    with StubUpstream() as up, kvgate_envoy([("127.0.0.1", up.port)]) as envoy:
        r = request(envoy.port, "POST", "/v1/chat/completions", CHAT,
                    {"x-gateway-destination-endpoint": "10.9.9.9:80"})
        assert r.status == 200
        _, headers, _ = up.received[-1]
        # Sent at once, before discovery's first answer: it waited for the pool, and the only
        # destination Envoy saw is kvgate's pick.
        dest = {k.lower(): v for k, v in headers.items()}.get("x-gateway-destination-endpoint")
        assert dest == f"127.0.0.1:{up.port}", dest


def test_broken_config_is_refused_with_the_field_named():
    """A static config with a typo fails Envoy's start (fail closed) with one line naming the
    field; it must never run with a silently ignored key."""
    with StubUpstream() as up:
        with pytest.raises(RuntimeError) as failed:
            with kvgate_envoy([("127.0.0.1", up.port)], {"estimator": {"safetyFactr": 2}}):
                pass
        assert "field `estimator.safetyFactr`: unknown field" in str(failed.value)
