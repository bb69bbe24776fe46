"""vLLM's Embeddings API (`/v1/embeddings`) through kvgate, in a real Envoy in front of
kvgate-sim pods: both of its request forms (`input`, and the chat form's `messages`, which
multimodal and instruction-tuned embedding models are called with) reach the engine, each
reserved as its prompt and released, and the engine's usage is read from every answer, a
batch's too, whose vectors make it megabytes long."""

import base64
import struct

from harness import Sim, default_plugin_config, kvgate_envoy, kvgate_gauges, kvgate_stat, request, wait_for

from bodies import MODEL, WORDS

SIZE = 4096


def passage(i, words=120):
    return f"passage {i}: " + " ".join(WORDS[(i * 11 + j * 7) % len(WORDS)] for j in range(words))


def embed(port, body):
    r = request(port, "POST", "/v1/embeddings", body, timeout=60)
    return r.status, (r.json() if r.status == 200 else r.body)


def test_both_forms_of_embeddings_are_admitted_and_their_usage_read_whole():
    with Sim(pods=2, args=["--time-scale", "10", "--num-gpu-blocks", "256"]) as sim, \
            kvgate_envoy(sim.endpoints, default_plugin_config(), concurrency=2) as envoy:
        model = MODEL
        bodies = [
            {"model": model, "input": passage(0)},
            # A batch whose answer (24 vectors of 4,096 floats) is about 2 MB: past the megabyte
            # kvgate keeps of an answer to read its usage from.
            {"model": model, "input": [passage(i) for i in range(1, 25)]},
            {"model": model, "messages": [
                {"role": "system", "content": "Represent the query for retrieving passages."},
                {"role": "user", "content": passage(30, 60)}]},
            {"model": model, "input": passage(31), "encoding_format": "base64"},
        ]
        prompt_tokens = 0
        for body in bodies:
            status, answer = embed(envoy.port, body)
            assert status == 200, (body.get("messages") and "messages", answer)
            inputs = body["input"] if isinstance(body.get("input"), list) else [None]
            assert [d["index"] for d in answer["data"]] == list(range(len(inputs)))
            first = answer["data"][0]["embedding"]
            if body.get("encoding_format") == "base64":
                first = struct.unpack(f"<{SIZE}f", base64.b64decode(first))
            assert len(first) == SIZE
            assert answer["usage"]["prompt_tokens"] > 0
            prompt_tokens += answer["usage"]["prompt_tokens"]
        # Every answer's usage was read: the batch's too, past the megabyte.
        assert wait_for(lambda: kvgate_stat(envoy, "usage.prompt_tokens") == prompt_tokens, timeout=5), \
            (kvgate_stat(envoy, "usage.prompt_tokens"), prompt_tokens)
        assert kvgate_stat(envoy, "usage.completion_tokens") == 0
        assert wait_for(lambda: all(v == 0 for v in kvgate_gauges(envoy, "reserved_tokens").values()),
                        timeout=5), kvgate_gauges(envoy, "reserved_tokens")
        # What kvgate refuses, the engine would too.
        for body, param in [({"model": model}, "input"), ({"model": model, "messages": []}, "messages")]:
            status, answer = embed(envoy.port, body)
            assert status == 400 and param.encode() in answer, (status, answer)
