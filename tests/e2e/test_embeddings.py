"""vLLM's pooling APIs through kvgate, in a real Envoy in front of kvgate-sim pods: embeddings
(`/v1/embeddings`) in both of their request forms (`input`, and the chat form's `messages`, which
multimodal and instruction-tuned embedding models are called with) reach the engine, each
reserved as its prompt and released, and the engine's usage is read from every answer, a
batch's too, whose vectors make it megabytes long; `/pooling` and `/classify` (a reward model
scoring answers) are routed to the pod caching their prompt; `/score` and `/rerank` (a reranker
scoring documents for a query) are reserved for each of their pairs, and routed by the query."""

import base64
import struct
from concurrent.futures import ThreadPoolExecutor

from harness import (Sim, baseline_envoy, default_plugin_config, kvgate_envoy, kvgate_gauges, kvgate_stat, request,
                     wait_for)

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


def hit_rate(sim):
    """The engines' prefix-cache hits, as a share of the prompt tokens they were asked to prefill."""
    stats = [sim.stats(i) for i in range(sim.pods)]
    return sum(s["prefix_cache_hit_tokens"] for s in stats) / sum(s["prefix_cache_query_tokens"] for s in stats)


def test_a_reward_models_scores_of_one_prompts_answers_go_where_the_prompt_is_cached():
    """A reward model scoring an RL rollout: each prompt's answers scored together, as vLLM's
    `/pooling` (chat form) and `/classify` take them. kvgate reads these as it reads embeddings:
    each is reserved and routed by its prefix, so a prompt's answers after the first find it
    cached; round robin spreads them over the pods, which compute it again. Their usage is read
    and every reservation released."""
    prompts = [passage(100 + p, words=500) for p in range(12)]

    def score(port, i):
        prompt, answer = prompts[i // 4], passage(200 + i, words=30)
        # A prompt's answers all in one form (the two forms render the prompt differently).
        if i // 4 % 2:
            body = {"model": MODEL, "messages": [{"role": "user", "content": prompt},
                                                 {"role": "assistant", "content": answer}], "task": "classify"}
            path = "/pooling"
        else:
            body, path = {"model": MODEL, "input": prompt + " " + answer}, "/classify"
        r = request(port, "POST", path, body, timeout=60)
        assert r.status == 200, (path, r.body)
        return r.json()["usage"]["prompt_tokens"]

    rates = {}
    for name in ("round_robin", "kvgate"):
        with Sim(pods=4, args=["--time-scale", "10"]) as sim:
            ctx = baseline_envoy(sim.endpoints) if name == "round_robin" else \
                kvgate_envoy(sim.endpoints, default_plugin_config(), concurrency=2)
            with ctx as envoy, ThreadPoolExecutor(4) as pool:
                # A prompt's four answers at once, prompt after prompt.
                tokens = sum(sum(pool.map(lambda i: score(envoy.port, i), range(p * 4, p * 4 + 4)))
                             for p in range(len(prompts)))
                rates[name] = hit_rate(sim)
                if name == "kvgate":
                    assert wait_for(lambda: kvgate_stat(envoy, "usage.prompt_tokens") == tokens, timeout=5), \
                        (kvgate_stat(envoy, "usage.prompt_tokens"), tokens)
                    assert wait_for(lambda: all(v == 0 for v in kvgate_gauges(envoy, "reserved_tokens").values()),
                                    timeout=5), kvgate_gauges(envoy, "reserved_tokens")
    print(f"prefix-cache hit rate: round robin {rates['round_robin']:.1%}, kvgate {rates['kvgate']:.1%}")
    # Three of each prompt's four scorings can find it cached: about 70 % of the prompt tokens.
    assert rates["kvgate"] >= 0.55 and rates["kvgate"] >= rates["round_robin"] + 0.25, rates


def test_a_rerank_is_reserved_for_each_pair_and_a_querys_next_page_goes_where_it_is_cached():
    """vLLM's score APIs in each of their forms: every pair (the query, then a document) is a
    prompt the engine prefills, so kvgate reserves the query once for each document (its
    estimate within a quarter of the engine's count), reads the answer's usage, and releases the
    reservation. A query's next page of documents goes to the pod that holds the query; a
    `/rerank` body vLLM would not take (Hugging Face TEI's `texts`) reaches the engine unread."""
    query = "Instruct: find the passages that answer the question. Query: " + passage(500, words=200)
    pages = [[passage(600 + page * 8 + d, words=40) for d in range(8)] for page in range(3)]
    with Sim(pods=4, args=["--time-scale", "10"]) as sim, \
            kvgate_envoy(sim.endpoints, default_plugin_config(), concurrency=2) as envoy:
        prompt_tokens, pods = 0, []
        for i, documents in enumerate(pages):
            body = {"model": MODEL, "query": query, "documents": documents, "top_n": 3}
            r = request(envoy.port, "POST", ["/rerank", "/v1/rerank", "/v2/rerank"][i], body, timeout=60)
            assert r.status == 200, r.body
            answer = r.json()
            assert len(answer["results"]) == 3
            used = answer["usage"]["prompt_tokens"]
            estimated = int(r.headers["x-kvgate-prompt-tokens"])
            assert abs(estimated - used) <= used / 4, (estimated, used)
            cached, blocks = map(int, r.headers["x-kvgate-prefix-blocks"].split("/"))
            # A later page finds the query's blocks (about 16 of its 8 pairs' 130) cached.
            assert (cached == 0) if i == 0 else (blocks > 100 and cached >= 10), \
                r.headers["x-kvgate-prefix-blocks"]
            prompt_tokens += used
            pods.append(r.headers["x-sim-pod"])
        assert len(set(pods)) == 1, pods
        for path, body in [
            ("/score", {"model": MODEL, "queries": ["a question", "another"], "documents": ["one", "two"]}),
            ("/v1/score", {"model": MODEL, "text_1": "a question", "text_2": ["one", "two", "three"]}),
            ("/score", {"model": MODEL, "data_1": ["a question"], "data_2": ["one"]}),
        ]:
            r = request(envoy.port, "POST", path, body, timeout=60)
            assert r.status == 200 and "x-kvgate-cost" in r.headers, (path, r.body)
            assert [d["index"] for d in r.json()["data"]] == list(range(len(body.get("documents", body.get("text_2",
                                                                                           body.get("data_2"))))))
            prompt_tokens += r.json()["usage"]["prompt_tokens"]
        assert wait_for(lambda: kvgate_stat(envoy, "usage.prompt_tokens") == prompt_tokens, timeout=5), \
            (kvgate_stat(envoy, "usage.prompt_tokens"), prompt_tokens)
        assert wait_for(lambda: all(v == 0 for v in kvgate_gauges(envoy, "reserved_tokens").values()),
                        timeout=5), kvgate_gauges(envoy, "reserved_tokens")
        # What kvgate refuses, the engine would too; what vLLM would not take, the engine answers.
        r = request(envoy.port, "POST", "/score", {"model": MODEL, "queries": ["a", "b"], "documents": ["c"] * 3})
        assert r.status == 400 and b"1:1, 1:N or N:N" in r.body and "x-kvgate-reason" in r.headers, r.body
        r = request(envoy.port, "POST", "/rerank", {"model": MODEL, "query": "a", "texts": ["b"]})
        assert r.status == 400 and "x-kvgate-reason" not in r.headers, (r.headers, r.body)
