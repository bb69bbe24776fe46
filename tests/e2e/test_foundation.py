"""Foundation end to end: a real Envoy loads the built kvgate.wasm; malformed bodies get an
OpenAI-style 400, oversized ones 413, valid ones reach the upstream with kvgate's estimate visible,
and a client-supplied destination header never reaches the upstream."""

import json

import pytest

from harness import Sim, StubUpstream, access_log_lines, default_plugin_config, kvgate_envoy, request, wait_for

from bodies import MODEL

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


def test_the_access_log_gets_kvgates_report_that_clients_do_not_see(tmp_path):
    """`accessLog` (on by default): each request kvgate routed leaves its report in Envoy's
    filter state, which the access log reads as `%FILTER_STATE(wasm.kvgate:PLAIN)%`: the pod that
    served it, its estimate, its prefix blocks; the client sees no `x-kvgate-*` header. A request
    kvgate refused logs its reason (and what it knew of the request), one it did not read nothing
    of kvgate's."""
    log = tmp_path / "access.log"
    with Sim(pods=2, args=["--time-scale", "10"]) as sim, \
            kvgate_envoy(sim.endpoints, dict(default_plugin_config(), debugHeaders=False), concurrency=2,
                         access_log=log) as envoy:
        served = []
        for i in range(6):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"question {i}: " + "why " * 40}],
                    "max_tokens": 8}
            r = request(envoy.port, "POST", "/v1/chat/completions", body)
            assert r.status == 200, r.body
            assert not [h for h in r.headers if h.startswith("x-kvgate-")], r.headers
            served.append(f"127.0.0.1:{sim.ports[int(r.headers['x-sim-pod'])]}")
        assert request(envoy.port, "POST", "/v1/chat/completions", b"{oops").status == 400
        assert request(envoy.port, "GET", "/health").status == 200
        unknown = {"model": "no-such-model", "prompt": "hi", "max_tokens": 4}
        assert request(envoy.port, "POST", "/v1/completions", unknown).status == 404
        assert wait_for(lambda: log.exists() and len(access_log_lines(log)) >= 9, timeout=5), \
            (log.exists() and log.read_text())
        lines = access_log_lines(log)
        assert len(lines) == 9, log.read_text()
    routed = [fields for status, fields, _ in lines[:6]]
    assert [f["pod"] for f in routed] == served
    for f in routed:
        assert f["model"] == MODEL and int(f["prompt_tokens"]) > 40 and f["output_tokens"] == "8", f
        cached, blocks = map(int, f["prefix_blocks"].split("/"))
        assert 0 <= cached <= blocks and int(f["cost"]) >= int(f["prompt_tokens"]), f
        assert "ranking" not in f, "built for the headers only"
        # What the engine counted, beside the estimate.
        assert int(f["used_prompt_tokens"]) > 40 and 0 < int(f["used_output_tokens"]) <= 8, f
    assert lines[6] == (400, {"reason": "invalid_request_error"}, "invalid_request_error"), lines[6]
    assert lines[7] == (200, None, None), lines[7]
    assert lines[8] == (404, {"reason": "model_not_found"}, "model_not_found"), lines[8]
