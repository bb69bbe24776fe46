"""Anthropic's Messages API (`/v1/messages`), which vLLM and SGLang serve beside the OpenAI ones
and agent clients (Claude Code on a local model) send nothing else through, in a real Envoy in
front of kvgate-sim pods: its requests are admitted within the pods' budgets (with max_tokens the
engine never preempts, where round robin on the same pool does, and a limit far past the answers
is not held for), its conversations keep their
prefix's pod even with Claude Code's per-request attribution block in their system prompt, its
usage is read in its own names, and kvgate's own errors reach its clients in that API's shape."""

import random
import time
from concurrent.futures import ThreadPoolExecutor

from harness import (Sim, baseline_envoy, default_plugin_config, kvgate_envoy, kvgate_gauges, on_their_pod, posted,
                     preemptions, request, sse_data, wait_for)

from bodies import MODEL, WORDS, group_system_prompt

BLOCKS = 256
SMALL_KV = ["--time-scale", "10", "--num-gpu-blocks", str(BLOCKS)]


def messages_body(text, max_tokens, system=None, stream=False):
    body = {"model": MODEL, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
    if system is not None:
        body["system"] = system
    return body


def claude_code_system(group):
    """A system prompt as Claude Code sends it: an attribution block whose hash differs on every
    request (the engine drops it), then the group's own prompt, which its requests share."""
    billing = f"x-anthropic-billing-header: cc_version=2.1.0; cc_entrypoint=cli; cch={random.getrandbits(64):016x};"
    return [{"type": "text", "text": billing},
            {"type": "text", "text": group_system_prompt(group), "cache_control": {"type": "ephemeral"}}]


def messages_stream(port, body, timeout=120.0):
    """POSTs a streamed Messages request; returns its status, the answer's text deltas and the
    usage of its `message_delta`, and the events' types in order."""
    with posted(port, "/v1/messages", dict(body, stream=True), timeout=timeout) as r:
        out = {"status": r.status, "deltas": 0, "usage": None, "events": []}
        if r.status != 200:
            out["body"] = r.read()
            return out
        for event in sse_data(r):
            out["events"].append(event["type"])
            if event["type"] == "content_block_delta" and event["delta"].get("type") == "text_delta":
                out["deltas"] += 1
            if event["type"] == "message_delta":
                out["usage"] = event["usage"]
        return out


def test_anthropic_messages_are_admitted_within_the_budget():
    """48 streamed Messages requests of about 330 prompt tokens with max_tokens 300 at a time, on
    two pods that hold six each: passed through unread (round robin, as kvgate did before it read
    this API), the engines preempt; admitted, never, and every reservation is back to zero."""
    def text(i):
        return f"question {i}: " + " ".join(WORDS[(i * 7 + j * 13) % len(WORDS)] for j in range(300))

    out = {}
    for name in ("round_robin", "kvgate"):
        with Sim(pods=2, args=SMALL_KV) as sim:
            ctx = baseline_envoy(sim.endpoints) if name == "round_robin" else \
                kvgate_envoy(sim.endpoints, default_plugin_config(), concurrency=2)
            with ctx as envoy, ThreadPoolExecutor(48) as pool:
                answers = list(pool.map(lambda i: messages_stream(envoy.port, messages_body(text(i), 300)),
                                        range(144)))
                assert all(a["status"] == 200 for a in answers), [a.get("body") for a in answers if a["status"] != 200]
                assert all(a["deltas"] == 300 and a["usage"]["output_tokens"] == 300 for a in answers)
                assert answers[0]["events"][0] == "message_start" and answers[0]["events"][-1] == "message_stop"
                out[name] = preemptions(sim)
                if name == "kvgate":
                    assert wait_for(lambda: all(v == 0 for v in kvgate_gauges(envoy, "reserved_tokens").values()),
                                    timeout=5), kvgate_gauges(envoy, "reserved_tokens")
    print(f"preemptions: {out}")
    assert out["round_robin"] >= 20, out
    assert out["kvgate"] == 0, out


def test_a_limit_far_past_the_answers_leaves_no_kv_idle():
    """The API requires `max_tokens`, and agent clients send one far past their answers. On pods
    whose engine ends answers where the model stops (answers of mean 256 drawn by the simulator,
    limits of 3,000), kvgate learns that such a limit is not run to and admits as for answers
    without one, at a bound's wider headroom. Measured over these 480 requests: 0.60x round
    robin's output with 3 preemptions to its 290 (the first wave, held to its limits until
    answers are seen, is most of the gap on pods this small; 0.95-0.97x on the benchmark's chat
    pool); held as if one answer in thirty ran to its limit, as kvgate did before, 0.31x."""
    def text(i):
        return f"question {i}: " + " ".join(WORDS[(i * 7 + j * 13) % len(WORDS)] for j in range(300))

    out = {}
    for name in ("round_robin", "kvgate"):
        with Sim(pods=2, args=[*SMALL_KV, "--eos-before-max-tokens"]) as sim:
            ctx = baseline_envoy(sim.endpoints) if name == "round_robin" else \
                kvgate_envoy(sim.endpoints, default_plugin_config(), concurrency=2)
            with ctx as envoy, ThreadPoolExecutor(48) as pool:
                started = time.monotonic()
                answers = list(pool.map(lambda i: messages_stream(envoy.port, messages_body(text(i), 3000)),
                                        range(480)))
                elapsed = time.monotonic() - started
                assert all(a["status"] == 200 for a in answers), [a.get("body") for a in answers if a["status"] != 200]
                out[name] = {"output_per_s": round(sum(a["usage"]["output_tokens"] for a in answers) / elapsed),
                             "preemptions": preemptions(sim)}
    print(f"limits of 3,000: {out}")
    assert out["kvgate"]["output_per_s"] >= 0.45 * out["round_robin"]["output_per_s"], out
    # Measured 3, 4 and 3 (the first wave learning its lengths on pods of six requests); a limit
    # held for, as before, none.
    assert out["kvgate"]["preemptions"] <= max(8, 0.03 * out["round_robin"]["preemptions"]), out


def test_anthropic_conversations_keep_their_prefix_pod():
    """Six groups' conversations, each request's system prompt opened by Claude Code's attribution
    block with a hash of its own: a group's requests go to its pod (without affinity a third of
    them would), and kvgate reads every answer's usage as the engine reported it."""
    with Sim(pods=4, args=["--time-scale", "20"]) as sim, \
            kvgate_envoy(sim.endpoints, default_plugin_config()) as envoy:
        jobs = [(g, q) for q in range(16) for g in range(6)]

        def one(job):
            g, q = job
            body = messages_body(f"Question {q}: what does clause {q} mean?", 8, system=claude_code_system(g))
            r = request(envoy.port, "POST", "/v1/messages", body)
            return g, r.status, r.headers.get("x-sim-pod"), r.json()

        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(one, jobs))
        assert all(status == 200 for _, status, _, _ in results), [b for _, s, _, b in results if s != 200]
        assert all(b["type"] == "message" and b["content"][0]["type"] == "text" for _, _, _, b in results)
        share = on_their_pod((g, p) for g, _, p, _ in results)
        print(f"requests on their group's pod: {share:.1%}")
        assert share >= 0.8, share
        used = sum(b["usage"]["input_tokens"] + b["usage"]["output_tokens"] for _, _, _, b in results)
        name = "wasmcustom.kvgate.usage.total_tokens"
        assert wait_for(lambda: envoy.stats(name).get(name, 0) == used, timeout=5), (envoy.stats(name), used)


def test_anthropic_clients_get_kvgate_errors_in_their_shape():
    """A Messages request kvgate refuses (no max_tokens; a body past maxBodyBytes) gets the
    status it would get on any path, in Anthropic's error shape, with kvgate's reason; a chat
    request's errors stay OpenAI's. Counting tokens generates nothing and passes through."""
    config = dict(default_plugin_config(), maxBodyBytes=4096)
    with Sim(pods=1, args=["--time-scale", "20"]) as sim, kvgate_envoy(sim.endpoints, config) as envoy:
        body = messages_body("hi", 8)
        del body["max_tokens"]
        r = request(envoy.port, "POST", "/v1/messages", body)
        assert r.status == 400, r.body
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", r.body
        assert "max_tokens" in r.json()["error"]["message"]
        assert r.headers.get("x-kvgate-reason") == "invalid_request_error"
        r = request(envoy.port, "POST", "/v1/messages", messages_body("word " * 2000, 8))
        assert r.status == 413, r.body
        assert r.json() == {"type": "error", "error": {"type": "request_too_large",
                                                       "message": r.json()["error"]["message"]}}
        r = request(envoy.port, "POST", "/v1/chat/completions", b"{oops")
        assert r.status == 400 and "type" not in r.json() and r.json()["error"]["code"] == 400, r.body
        # Answered by the engine itself.
        r = request(envoy.port, "POST", "/v1/messages/count_tokens",
                    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status == 200 and r.json()["input_tokens"] > 0, r.body
        assert "x-kvgate-reason" not in r.headers
