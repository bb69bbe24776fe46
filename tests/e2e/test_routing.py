"""KV-aware routing inside a real Envoy (--concurrency 4) in front of kvgate-sim pods: prefix
groups stick to one pod each and spread across pods, a group's request waits for room on its pod
before computing its prefix elsewhere, a loaded pod is avoided, clients cannot
steer, a dead pod is routed around, the scrape runs once per interval per pod whatever the
worker count, predicted active blocks return to zero, pods of two speeds learn their pace, a
request goes where the engine step under way ends first, a stored response's follow-ups go
back to the pod that stored it, and pods reached over HTTP/2 (through mesh sidecars) are routed and
metered as over HTTP/1.1."""

import http.client
import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import (ROOT, STATUS_PATH, Envoy, Sim, baseline_envoy, default_plugin_config, envoy_config,
                     free_port, kvgate_envoy, kvgate_gauges, request, responses_call, stat, stream, wait_for)
from robustness import pick_of

from bodies import MODEL, group_chat, grouped_chat, tagged_chat, unshared_chat
SIM_ARGS = ["--time-scale", "20"]
# Where engine time, not proxy overhead, dominates TTFT (prefill of a 3k-token prompt ≈ 45 ms).
REALISTIC_SIM_ARGS = ["--time-scale", "2"]


def run_groups(port, groups, questions, workers=16, headers=None, explain=None):
    """(group, status, pod) per request; `explain`, when given, collects kvgate's ranking header
    for each request, so a test can say why one left its group's pod."""
    jobs = [(g, q) for q in range(questions) for g in range(groups)]

    def one(job):
        g, q = job
        r = request(port, "POST", "/v1/chat/completions", group_chat(g, q), headers)
        if explain is not None:
            explain.append((g, q, r.headers.get("x-sim-pod"), r.headers.get("x-kvgate-ranking")))
        return g, r.status, r.headers.get("x-sim-pod")

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, jobs))


def test_prefix_groups_stick_to_one_pod_and_spread_over_pods():
    with Sim(pods=4, args=SIM_ARGS) as sim, kvgate_envoy(sim.endpoints, default_plugin_config()) as envoy:
        # Cold: a group's first requests arrive together on different workers.
        rankings = []
        results = run_groups(envoy.port, groups=6, questions=20, explain=rankings)
        assert all(status == 200 for _, status, _ in results)
        on_majority = 0
        majority = {}
        for g in range(6):
            pods = [p for gg, _, p in results if gg == g]
            top = max(set(pods), key=pods.count)
            majority[g] = top
            on_majority += pods.count(top)
        share = on_majority / len(results)
        moved = "\n".join(f"group {g} q{q} on pod {p}: {why}" for g, q, p, why in rankings if p != majority[g])
        print(f"requests on their group's pod: {share:.1%}; group -> pod: {majority}\n{moved}")
        # Without affinity a group's majority pod takes about a third of its requests. With it,
        # 86.7–100 % (median 100 %) over 24 runs of this test: six groups on four pods put two
        # groups on some pod, and at 16 clients that pod's decode load can make a copy of a
        # group's prefix elsewhere the cheaper place for a few of its requests (a hot prefix
        # spreads when its pod is loaded, by design); a bar at 95 % failed one run in eight.
        assert share >= 0.8, f"{share:.1%} on their group's pod; moved:\n{moved}"
        assert len(set(majority.values())) >= 3, "groups spread over the pods"


def test_original_dst_variant_routes_to_the_pick_and_ignores_client_destinations():
    variant = ROOT / "envoy/envoy-original-dst.yaml"
    with Sim(pods=3, args=SIM_ARGS) as sim:
        cfg = default_plugin_config(variant)
        cfg["pods"] = [f"{h}:{p}" for h, p in sim.endpoints]
        with Envoy(envoy_config(free_port(), free_port(), [], cfg, yaml_path=variant)) as envoy:
            wait_for(lambda: len(kvgate_gauges(envoy, "healthy")) >= 3, timeout=10)
            homes = set()
            for q in range(6):
                # A client naming an address must not reach it (SSRF through ORIGINAL_DST).
                r = request(envoy.port, "POST", "/v1/chat/completions", group_chat(3, q),
                            {"x-envoy-original-dst-host": "127.0.0.1:1"})
                assert r.status == 200, r.body
                # The pod that answered is the one kvgate picked, not the client's address.
                assert pick_of(r.headers["x-kvgate-ranking"]) == f"127.0.0.1:{sim.ports[int(r.headers['x-sim-pod'])]}"
                homes.add(r.headers["x-sim-pod"])
            assert len(homes) == 1, "the group sticks to one pod"


def test_client_supplied_destination_has_no_effect():
    with Sim(pods=3, args=SIM_ARGS) as sim, kvgate_envoy(sim.endpoints, default_plugin_config()) as envoy:
        first = request(envoy.port, "POST", "/v1/chat/completions", group_chat(1, 0))
        home = first.headers["x-sim-pod"]
        other = next(f"127.0.0.1:{p}" for i, p in enumerate(sim.ports) if str(i) != home)
        for q in range(1, 8):
            r = request(envoy.port, "POST", "/v1/chat/completions", group_chat(1, q),
                        {"x-gateway-destination-endpoint": other})
            assert r.headers["x-sim-pod"] == home


def hot_and_cold_groups(envoy, sim):
    """48 requests of one hot group at once, while eight cold groups send six questions each, one
    after another: the pod each hot request landed on, the pool's prefix-cache hit rate, and its
    preemptions."""
    def hot(q):
        r = request(envoy.port, "POST", "/v1/chat/completions", group_chat(7, q, max_tokens=256), timeout=120)
        assert r.status == 200
        return r.headers.get("x-sim-pod")

    def cold(g):
        for q in range(6):
            assert request(envoy.port, "POST", "/v1/chat/completions", group_chat(100 + g, q), timeout=120).status == 200

    with ThreadPoolExecutor(56) as pool:
        colds = [pool.submit(cold, g) for g in range(8)]
        pods = list(pool.map(hot, range(48)))
        for c in colds:
            c.result()
    stats = [sim.stats(i) for i in range(sim.pods)]
    hits = sum(s["prefix_cache_hit_tokens"] for s in stats) / sum(s["prefix_cache_query_tokens"] for s in stats)
    return pods, hits, sum(s["preemptions"] for s in stats)


def test_a_hot_prefix_spreads_over_pods_while_the_others_keep_their_cache():
    # One hot group, 48 requests at once on 4 pods with room for 40 each. Every sequence reads the
    # whole 3.6k-token prefix at each decode step, so the decode term grows by the prefix with each
    # request in flight on its pod; after about nine, recomputing the prefix on an idle pod is
    # cheaper, and the group spreads over the pool long before its pod's KV is full. Spreading is
    # what round robin does too; what it cannot do is keep the cold groups' questions on the pod
    # that already caches their prompt: kvgate must spread the hot one and still hit more.
    arms = {}
    for name in ("round_robin", "kvgate"):
        with Sim(pods=4, args=SIM_ARGS + ["--num-gpu-blocks", "1024"]) as sim:
            ctx = baseline_envoy(sim.endpoints) if name == "round_robin" else \
                kvgate_envoy(sim.endpoints, default_plugin_config())
            with ctx as envoy:
                pods, hits, preemptions = hot_and_cold_groups(envoy, sim)
                arms[name] = {"share": {p: pods.count(p) for p in set(pods)}, "hit_rate": round(hits, 3),
                              "preemptions": preemptions}
    print(f"one hot group and eight cold ones: {arms}")
    # Round robin is the reference for the hit rate only: its pods, sent everything at once, may
    # preempt (1 in about 8 runs here); kvgate's admission must not let them.
    assert arms["kvgate"]["preemptions"] == 0, arms
    share = arms["kvgate"]["share"]
    assert len(share) >= 3, f"the hot prefix spread over the pool: {share}"
    assert max(share.values()) <= 24, f"no pod took more than half: {share}"
    assert arms["kvgate"]["hit_rate"] >= arms["round_robin"]["hit_rate"] + 0.05, arms


def test_prompts_are_cut_in_the_engines_block_size():
    # Pods whose cache_config_info reports 32-token blocks: once they are scraped, a 1,280-character
    # prompt is 10 blocks of 32 × 4 characters, not 20 of the default 16. One connection keeps the
    # requests on one Envoy worker, so the second is cut with what that worker learned routing the
    # first.
    with Sim(pods=2, args=SIM_ARGS + ["--block-size", "32"]) as sim, \
            kvgate_envoy(sim.endpoints, default_plugin_config()) as envoy:
        assert wait_for(lambda: envoy.stats("wasmcustom.kvgate.scrape.ok").get("wasmcustom.kvgate.scrape.ok", 0) >= 2,
                        timeout=10), "both pods scraped"
        body = json.dumps({"model": MODEL, "prompt": "abcd " * 256, "max_tokens": 1})
        conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=30)
        blocks = []
        try:
            for _ in range(2):
                conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
                r = conn.getresponse()
                r.read()
                assert r.status == 200
                blocks.append(r.getheader("x-kvgate-prefix-blocks"))
        finally:
            conn.close()
        print(f"prefix blocks (cached/total) per request: {blocks}")
        assert blocks[1].split("/")[1] == "10", blocks


@pytest.mark.parametrize("lists", [1, 2])
def test_prompts_of_token_ids_keep_their_prefix_pod_in_the_engines_blocks(lists):
    """Completions prompts sent as token ids (a client that tokenizes itself: RL rollouts,
    pre-tokenized batches) are cut in the engine's own blocks, 16 ids each, and routed by
    prefix like text: each group's shared 600 ids stay on one pod. Before, kvgate counted the ids
    and hashed nothing, so every such request was routed by load alone; a batch of lists
    (`lists` 2), by its first list's prefix, since this stop's batches (before: by load alone)."""
    rng = random.Random(7)
    shared = {g: [rng.randrange(1000, 90000) for _ in range(600)] for g in range(6)}

    def body(g, q):
        prompts = [shared[g] + [rng.randrange(1000, 90000) for _ in range(40)] for _ in range(lists)]
        return {"model": MODEL, "max_tokens": 4, "prompt": prompts[0] if lists == 1 else prompts}

    with Sim(pods=4, args=SIM_ARGS) as sim, kvgate_envoy(sim.endpoints, default_plugin_config()) as envoy:
        jobs = [(g, q) for q in range(12) for g in range(6)]

        def one(job):
            r = request(envoy.port, "POST", "/v1/completions", body(*job))
            return job[0], r.status, r.headers.get("x-sim-pod"), r.headers.get("x-kvgate-prefix-blocks")

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, jobs))
        assert all(status == 200 for _, status, _, _ in results), results[0]
        # 640 ids a prompt: 40 blocks of the engine's 16 (a text of 640 tokens would be cut by
        # its characters).
        assert all(blocks.split("/")[1] == str(40 * lists) for _, _, _, blocks in results), results[0]
        majority = {}
        on_majority = 0
        for g in range(6):
            pods = [p for gg, _, p, _ in results if gg == g]
            majority[g] = max(set(pods), key=pods.count)
            on_majority += pods.count(majority[g])
        share = on_majority / len(results)
        print(f"requests on their group's pod: {share:.1%}; group -> pod: {majority}")
        # A batch is routed by its first list's prefix. Its answers each read their own list at
        # every step: counted as reading both lists each, a batch in flight made its pod look
        # twice as busy decoding as it was, and load moved the group's next batches off it
        # (80.6-95.8 % of requests on their group's pod in 8 runs; 94.4-100 % since; 37.5-44.4 %
        # routed by load alone).
        assert share >= 0.8 and len(set(majority.values())) >= 3, (share, majority)


def test_a_pod_without_prefix_caching_gets_no_prefix_credit():
    # A vLLM pod started with --no-enable-prefix-caching says so in cache_config_info. kvgate
    # gives it no prefix credit however often it served a prompt, and among equal costs it comes
    # last, so prompt groups settle on the pod that caches; it still takes load that spills.
    with Sim(pods=1, args=SIM_ARGS + ["--no-enable-prefix-caching"]) as plain, Sim(pods=1, args=SIM_ARGS) as caching, \
            kvgate_envoy(plain.endpoints + caching.endpoints, default_plugin_config()) as envoy:
        assert wait_for(lambda: envoy.stats("wasmcustom.kvgate.scrape.ok").get("wasmcustom.kvgate.scrape.ok", 0) >= 2,
                        timeout=10), "both pods scraped"
        caching_pod = "%s:%d" % caching.endpoints[0]

        def one(job):
            group, q, max_tokens = job
            r = request(envoy.port, "POST", "/v1/chat/completions", group_chat(group, q, max_tokens=max_tokens), timeout=120)
            assert r.status == 200
            return r.headers["x-kvgate-pod"], r.headers["x-kvgate-prefix-blocks"]

        one_by_one = [one((g, q, 8)) for q in range(4) for g in (3, 4, 5)]
        print(f"one at a time (pod, cached/total): {one_by_one}")
        assert all(pod == caching_pod for pod, _ in one_by_one), one_by_one
        with ThreadPoolExecutor(24) as pool:
            together = list(pool.map(one, [(3, q, 64) for q in range(100, 124)]))
        spilled = [blocks for pod, blocks in together if pod != caching_pod]
        print(f"24 at once: {len(spilled)} spilled to the pod without caching: {spilled}")
        assert spilled, "the busy caching pod shed load"
        assert all(blocks.startswith("0/") for blocks in spilled), together


def test_pod_holding_the_prefix_but_overloaded_is_avoided():
    args = SIM_ARGS + ["--max-num-seqs", "2"]
    with Sim(pods=3, args=args) as sim, kvgate_envoy(sim.endpoints, default_plugin_config()) as envoy:
        home = int(request(envoy.port, "POST", "/v1/chat/completions", group_chat(2, 0)).headers["x-sim-pod"])
        # Load the home pod behind kvgate's back: a long queue only its metrics reveal.
        flood = {"model": MODEL, "prompt": "flood " * 50, "max_tokens": 4000}

        def flood_one():
            try:
                request(sim.ports[home], "POST", "/v1/completions", flood, timeout=120)
            except OSError:
                pass  # cut off when the pods stop at the end of the test

        threads = [threading.Thread(target=flood_one, daemon=True) for _ in range(12)]
        for t in threads:
            t.start()
        waiting = wait_for(lambda: envoy.stats("wasmcustom.kvgate.scrape.ok").get("wasmcustom.kvgate.scrape.ok", 0) > 8
                           and sim.stats(home)["waiting"] >= 8, timeout=10)
        assert waiting, "the home pod's queue built up"
        time.sleep(1.5)  # at least one scrape after the queue formed
        r = request(envoy.port, "POST", "/v1/chat/completions", group_chat(2, 1))
        assert r.status == 200
        assert int(r.headers["x-sim-pod"]) != home, "kvgate avoided the overloaded pod holding the prefix"


def test_a_groups_request_waits_for_room_on_its_pod_before_computing_its_prefix_elsewhere():
    """Two pods and a budget that holds one of a group's requests a pod, not a second beside it.
    The group's first request streams on one pod when its next arrives: the other pod has room,
    but would compute the group's 1,500-token system prompt again, which one request in flight
    shares. The next request waits for room on its group's pod (admission.cacheWaitMs): with a
    wait longer than the first request it goes there once the first ends and finds its prefix
    cached; with the default 100 ms it goes to the other pod as its wait ends, not at the next
    250 ms tick, since nothing else wakes the line meanwhile (the worker's quick tick)."""
    first, second = grouped_chat(1, 0, 300), grouped_chat(1, 1, 300)

    def envoy_with(sim, **admission):
        cfg = default_plugin_config()
        cfg["statusPath"] = STATUS_PATH
        cfg["admission"] = dict(cfg.get("admission", {}), **admission)
        return kvgate_envoy(sim.endpoints, cfg)

    def while_first_streams(envoy, then):
        """Starts the first request, waits until kvgate has it in flight, runs `then`; returns
        the first's answer and what `then` returned."""
        with ThreadPoolExecutor(1) as pool:
            f = pool.submit(stream, envoy.port, "/v1/chat/completions", first)
            pods = wait_for(lambda: [p for p in request(envoy.port, "GET", STATUS_PATH).json()["pods"]
                                     if p["inFlight"]], timeout=5)
            assert pods, "the first request is in flight"
            out = then(pods[0])
            return f.result(), out

    with Sim(pods=2, args=REALISTIC_SIM_ARGS) as sim:
        # What the first reserves alone, as admission counts it: the budget holds it and less
        # than the second's question and answer beside it (about 470 tokens).
        with envoy_with(sim, budgetTokens=1_000_000) as envoy:
            _, reserved = while_first_streams(envoy, lambda pod: pod["reservedTokens"])
        for wait in (5_000, 100):
            with envoy_with(sim, budgetTokens=reserved + 200, cacheWaitMs=wait) as envoy:
                a, b = while_first_streams(envoy, lambda _: stream(envoy.port, "/v1/chat/completions", second))
                assert a["status"] == b["status"] == 200, (a["status"], b["status"])
                waited = int(b["headers"]["x-kvgate-queue-ms"])
                waits = envoy.stats("wasmcustom.kvgate.admission.cache_waits")
                print(f"cacheWaitMs {wait}: first on pod {a['headers']['x-sim-pod']}, second on pod "
                      f"{b['headers']['x-sim-pod']} after {waited} ms (first took {a['total']:.2f} s)")
                assert waits.get("wasmcustom.kvgate.admission.cache_waits") == 1, waits
                if wait > 1_000:
                    assert b["headers"]["x-sim-pod"] == a["headers"]["x-sim-pod"], "its group's pod"
                    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1_400, b["usage"]
                else:
                    assert b["headers"]["x-sim-pod"] != a["headers"]["x-sim-pod"], "room elsewhere"
                    assert 100 <= waited < 200, waited


def test_a_restarted_engine_is_not_believed_to_cache_what_it_held_before():
    """A pod's engine restarts on the same address: its prefix cache is empty, and its counters
    (vllm:prefix_cache_*_total) start again. kvgate sees them go back at the next scrape
    (`kvgate.pod.<pod>.engine_restarts`) and forgets what it believed the pod held, so the
    group's next request is routed with nothing believed cached (before, the TTL alone aged the
    belief out, ten minutes by default, and the pick counted on a cache that was gone)."""
    with Sim(pods=1, args=SIM_ARGS) as one, Sim(pods=1, args=SIM_ARGS) as two:
        with kvgate_envoy(one.endpoints + two.endpoints, default_plugin_config()) as envoy:
            matched = "wasmcustom.kvgate.prefix.blocks_matched"

            def ask(q):
                r = request(envoy.port, "POST", "/v1/chat/completions", group_chat(0, q))
                assert r.status == 200, r.body
                return envoy.stats(matched).get(matched, 0)

            ask(0)
            before = ask(1)
            assert before > 0, "the second found its group's prefix cached"
            picks = kvgate_gauges(envoy, "picks")
            home = next(seg for seg, n in picks.items() if n == 2)
            assert kvgate_gauges(envoy, "engine_restarts").get(home, 0) == 0
            # A scrape has seen the engine count them (a restart shows against what was seen).
            assert wait_for(lambda: kvgate_gauges(envoy, "engine_prefix_hit_tokens").get(home, 0) > 0)
            old = one if home.endswith(f"_{one.ports[0]}") else two
            old.__exit__(None, None, None)
            again = Sim(pods=1, args=SIM_ARGS)
            again.base_port = old.base_port
            with again:
                assert wait_for(lambda: kvgate_gauges(envoy, "engine_restarts").get(home) == 1, timeout=10)
                after = ask(2)
                assert after == before, f"believed {after - before} blocks cached after the restart"


def test_dead_pod_is_routed_around_and_nothing_hangs():
    with Sim(pods=3, args=SIM_ARGS) as live, Sim(pods=1, args=SIM_ARGS) as doomed:
        endpoints = live.endpoints + doomed.endpoints
        with kvgate_envoy(endpoints, default_plugin_config()) as envoy:
            dead = f"127.0.0.1:{doomed.ports[0]}"
            explain = []
            before = run_groups(envoy.port, groups=8, questions=3, explain=explain)
            assert all(s == 200 for _, s, _ in before)
            assert any(pick_of(why) == dead for *_, why in explain), "the doomed pod had groups"
            doomed.__exit__(None, None, None)
            t0 = time.time()
            after = []
            for q in range(3, 9):
                for g in range(8):
                    r = request(envoy.port, "POST", "/v1/chat/completions", group_chat(g, q), timeout=30)
                    after.append((r.status, pick_of(r.headers["x-kvgate-ranking"])))
            elapsed = time.time() - t0
            ok = [s for s, _ in after if s == 200]
            picked = [i for i, (_, p) in enumerate(after) if p == dead]
            print(f"after the kill: {len(ok)}/{len(after)} ok in {elapsed:.1f}s; dead pod picked at {picked}")
            assert len(ok) == len(after), "retries move failed picks to the next listed pod"
            assert not [i for i in picked if i >= 16], "once its scrape fails the dead pod is no longer picked"
            assert elapsed < 60


def test_scrape_runs_once_per_interval_per_pod_not_per_worker():
    cfg = default_plugin_config()
    cfg["metrics"]["intervalMs"] = 500
    with Sim(pods=3, args=SIM_ARGS) as sim, kvgate_envoy(sim.endpoints, cfg, concurrency=4) as envoy:
        time.sleep(1.0)
        start = envoy.stats("cluster.kvgate_metrics.upstream_rq_total")["cluster.kvgate_metrics.upstream_rq_total"]
        time.sleep(5.0)
        end = envoy.stats("cluster.kvgate_metrics.upstream_rq_total")["cluster.kvgate_metrics.upstream_rq_total"]
        per_pod_per_interval = (end - start) / 3 / (5.0 / 0.5)
        print(f"scrapes per pod per interval with 4 workers: {per_pod_per_interval:.2f}")
        assert 0.7 <= per_pod_per_interval <= 1.3


def test_active_blocks_return_to_zero_after_streaming_traffic():
    with Sim(pods=4, args=SIM_ARGS) as sim, kvgate_envoy(sim.endpoints, default_plugin_config()) as envoy:
        def one(i):
            return stream(envoy.port, "/v1/chat/completions", group_chat(i % 5, i, max_tokens=64))
        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(one, range(60)))
        assert all(r["status"] == 200 and r["chunks"] == 64 for r in results)
        peak_seen = kvgate_gauges(envoy, "active_blocks")
        assert peak_seen, "the scraper reports per-pod gauges"
        zero = wait_for(lambda: all(v == 0 for v in kvgate_gauges(envoy, "active_blocks").values())
                        and all(v == 0 for v in kvgate_gauges(envoy, "in_flight").values()), timeout=5)
        assert zero, kvgate_gauges(envoy, "active_blocks")


def shared_prefix_run(port, groups=7, questions=12, workers=14):
    def one(job):
        g, q = job
        return stream(port, "/v1/chat/completions", group_chat(g, q, max_tokens=32))

    jobs = [(g, q) for q in range(questions) for g in range(groups)]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, jobs))


def hit_rate(sim):
    hits = queries = 0
    for i in range(sim.pods):
        s = sim.stats(i)
        hits += s["prefix_cache_hit_tokens"]
        queries += s["prefix_cache_query_tokens"]
    return hits / max(queries, 1)


def test_kvgate_beats_round_robin_on_shared_prefix_workload():
    """The closing note's numbers: prefix-cache hit rate and mean TTFT, kvgate vs round robin,
    on fresh pods each, same workload (7 groups over 4 pods, so round robin cannot fake affinity)."""
    out = {}
    for name in ("round_robin", "kvgate"):
        with Sim(pods=4, args=REALISTIC_SIM_ARGS) as sim:
            ctx = kvgate_envoy(sim.endpoints, default_plugin_config()) if name == "kvgate" else baseline_envoy(sim.endpoints)
            with ctx as envoy:
                results = shared_prefix_run(envoy.port)
            assert all(r["status"] == 200 for r in results)
            ttfts = sorted(r["ttft"] for r in results)
            out[name] = {"hit_rate": hit_rate(sim), "mean_ttft_ms": 1000 * sum(ttfts) / len(ttfts),
                         "p90_ttft_ms": 1000 * ttfts[int(0.9 * len(ttfts))]}
    print("shared-prefix workload:", out)
    assert out["kvgate"]["hit_rate"] > out["round_robin"]["hit_rate"] + 0.2
    assert out["kvgate"]["mean_ttft_ms"] < out["round_robin"]["mean_ttft_ms"]


def closed_loop(port, clients, seconds, first=0):
    """`clients` clients each sending unshared 64-token chats one after another for `seconds`:
    how many requests each sim pod answered."""
    served = {}
    lock = threading.Lock()
    deadline = time.time() + seconds

    def client(c):
        i = first + c
        while time.time() < deadline:
            r = request(port, "POST", "/v1/chat/completions", unshared_chat(i, 64), timeout=60)
            assert r.status == 200, r.body
            with lock:
                pod = int(r.headers["x-sim-pod"])
                served[pod] = served.get(pod, 0) + 1
            i += clients

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return served


def test_slower_pods_learn_their_pace_and_take_less():
    # Pods 2 and 3 run at half speed: every engine step takes them twice as long. Sixteen clients
    # keep the pool busy; after a few scrapes' learning, the request split is measured with the
    # learned pace applied and, on a fresh pool, with it off (the factors are learned and shown
    # either way). Off, kvgate balances the sequences in flight, so the fast pods answer about
    # twice as many (each of their sequences finishes twice as fast); on, a slow pod's blocks cost
    # it twice a fast one's (√2 against 1/√2 of the weights), so it takes a request only once the
    # fast pods run many more sequences than it does.
    fast, slow = (0, 1), (2, 3)
    arms = {}
    for learn in (False, True):
        cfg = default_plugin_config()
        cfg["routing"] = {"learnDecodeCost": learn}
        with Sim(pods=4, args=REALISTIC_SIM_ARGS + ["--pod-speed", "1,1,0.5,0.5"]) as sim, \
                kvgate_envoy(sim.endpoints, cfg) as envoy:
            closed_loop(envoy.port, clients=16, seconds=6)
            served = closed_loop(envoy.port, clients=16, seconds=8, first=100_000)
            gauges = kvgate_gauges(envoy, "cost_factor_percent")
            factors = [gauges.get(f"127_0_0_1_{p}") for p in sim.ports]
            fast_share = sum(served.get(i, 0) for i in fast) / sum(served.values())
            arms[learn] = (factors, served, fast_share)
            print(f"learnDecodeCost={learn}: factors % {factors}, requests per pod {served} "
                  f"({sum(served.values())} in 8 s), fast pods' share {fast_share:.1%}")
    for learn, (factors, _, _) in arms.items():
        # Twice as slow against the geometric mean: 71 % and 141 % ideally.
        assert all(f is not None for f in factors), factors
        assert max(factors[i] for i in fast) < 90 and min(factors[i] for i in slow) > 115, (learn, factors)
        assert min(factors[i] for i in slow) / max(factors[i] for i in fast) > 1.6, (learn, factors)
    off, on = arms[False][2], arms[True][2]
    assert on >= off + 0.1, f"fast pods' share {on:.1%} learned vs {off:.1%} not"


def test_a_cached_prompt_goes_where_the_engine_step_under_way_ends_first():
    # An engine takes a new request in at the start of its next step. Both pods cache a group's
    # 2k-token system prompt and decode two long answers each; probes of the group sent at random
    # moments go, with routing.stepPhase, to the pod whose step ends first as kvgate reads it from
    # the chunks it streams, and start sooner than without it (the pods tie; the wait is half a
    # step on average). At --time-scale 0.5 a step is about 12 ms of wall time, many times Envoy's
    # own jitter; the second pod runs a tenth slower, so the two pods' steps drift apart and a
    # probe finds them at any two phases (equal engines started together step in lockstep). One
    # Envoy worker sees every stream, so it knows both pods' phases (each worker reads its own).
    rng = random.Random(5)
    arms = {}
    with Sim(pods=2, args=["--time-scale", "0.5", "--pod-speed", "1,0.9"]) as sim:
        for phase in (True, False):
            cfg = default_plugin_config()
            # A low prefill weight lets the group's prompt be copied to the second pod at once.
            cfg["routing"] = {"stepPhase": phase, "prefillWeight": 0.1}
            with kvgate_envoy(sim.endpoints, cfg, concurrency=1) as envoy:
                with ThreadPoolExecutor(4) as pool:
                    # The group's prompt on both pods: two at once, the second where the first's
                    # prefill is not under way.
                    warmed = set()
                    for attempt in range(4):
                        warm = pool.map(lambda i: stream(envoy.port, "/v1/chat/completions",
                                                         group_chat(0, i, max_tokens=4)), (2 * attempt, 2 * attempt + 1))
                        warmed |= {w["headers"].get("x-sim-pod") for w in warm}
                        if len(warmed) == 2:
                            break
                    warmed = sorted(warmed)
                    # Long answers of prompts of their own, which the phase does not place.
                    long = []
                    for i in range(4):
                        long.append(pool.submit(stream, envoy.port, "/v1/chat/completions", unshared_chat(i, 600)))
                        time.sleep(0.3)
                    time.sleep(1.0)
                    ttfts, rankings = [], []
                    for q in range(80):
                        time.sleep(rng.uniform(0.0, 0.03))
                        r = stream(envoy.port, "/v1/chat/completions", group_chat(0, 100 + q, max_tokens=1))
                        assert r["status"] == 200, r
                        ttfts.append(r["ttft"] * 1000)
                        rankings.append(r["headers"].get("x-kvgate-ranking", ""))
                    background = [f.result() for f in long]
                    assert all(b["status"] == 200 for b in background), background
                    spread = sorted(b["headers"].get("x-sim-pod") for b in background)
                delay = envoy.stats("wasmcustom.kvgate.routing.dispatch_delay_us").get(
                    "wasmcustom.kvgate.routing.dispatch_delay_us")
            ttfts.sort()
            arms[phase] = (sum(ttfts) / len(ttfts), ttfts[len(ttfts) // 2], delay, rankings, spread, warmed)
            print(f"stepPhase {phase}: TTFT mean {arms[phase][0]:.1f} ms, p50 {arms[phase][1]:.1f} ms, "
                  f"learned delay {delay} µs, group warmed on {warmed}, long answers on {spread}; "
                  f"e.g. {rankings[-1]}")
    on, off = arms[True], arms[False]
    assert on[5] == off[5] == ["0", "1"], "both pods cache the group's prompt"
    assert on[4] == off[4] == ["0", "0", "1", "1"], "two long answers on each pod"
    # Where a worker knows a pod's phase, the ranking shows the wait it read.
    assert sum("wait=" in r for r in on[3]) >= 60, on[3][:3]
    # The delay is learned from the first tokens (it starts at routing.dispatchDelayMs, 1 ms):
    # under a step, as the chunks see it.
    assert on[2] is not None and 0 < on[2] < 12_000, on[2]
    # The wait is half a step on average, about 6 ms; the sooner of two phases (less the delay's
    # misses) saves about 2 ms of it (five runs: mean 1.6–2.7 ms, p50 2.7–3.6 ms sooner).
    assert on[0] < off[0] - 0.5 and on[1] < off[1] - 1.0, (on[:3], off[:3])


def test_a_stored_responses_follow_ups_go_back_to_the_pod_that_stored_it():
    """The Responses API's stored responses live in the memory of the engine that made them
    (vLLM's store is its API server's; the simulator's is each pod's): a follow-up naming one by
    `previous_response_id`, or a `GET /v1/responses/{id}`, is answered only by that pod, and
    elsewhere is a 404. Through kvgate each conversation's turns (streamed or not) all go to the
    pod that answered its first, and each turn's prompt, the whole conversation so far, grows;
    through round robin most follow-ups are not found."""
    def conversations(port, count, turns):
        """Per conversation its turns' pods, their prompts and its last response's id; and every
        follow-up's status."""
        done, statuses = [], []
        for c in range(count):
            status, pod, rid, usage = responses_call(
                port, {"model": MODEL, "input": f"conversation {c}: tell me about KV caches",
                       "max_output_tokens": 12, "stream": c % 2 == 0})
            assert status == 200 and rid, (status, rid)
            pods, prompts = [pod], [usage["input_tokens"]]
            for turn in range(1, turns):
                status, pod, next_id, usage = responses_call(
                    port, {"model": MODEL, "input": f"and then {turn}?", "max_output_tokens": 12,
                           "previous_response_id": rid, "stream": turn % 2 == 1})
                statuses.append(status)
                if status != 200:
                    break
                pods.append(pod)
                prompts.append(usage["input_tokens"])
                rid = next_id
            done.append((pods, prompts, rid))
        return done, statuses

    with Sim(pods=4, args=SIM_ARGS) as sim:
        with kvgate_envoy(sim.endpoints, default_plugin_config(), concurrency=4) as envoy:
            done, statuses = conversations(envoy.port, 6, 4)
            assert statuses == [200] * 18, statuses
            for pods, prompts, last in done:
                assert len(set(pods)) == 1, pods
                assert prompts == sorted(prompts) and prompts[-1] > prompts[0] + 3 * 12, prompts
                got = request(envoy.port, "GET", f"/v1/responses/{last}")
                assert got.status == 200 and got.json()["id"] == last, got.status
                assert got.headers.get("x-sim-pod") == pods[0]
            followed = envoy.stats("wasmcustom.kvgate.stored").get("wasmcustom.kvgate.stored.followed", 0)
            assert followed == 18, followed
        with baseline_envoy(sim.endpoints) as rr:
            _, statuses = conversations(rr.port, 8, 2)
            print("round robin follow-ups:", statuses)
            assert statuses.count(404) >= 2, statuses


def test_a_gateway_that_did_not_see_a_stored_response_asks_the_pods_where_it_is():
    """kvgate's notes of stored responses live in Envoy's shared data: a restarted Envoy (or a
    replica sharing no etcd) has none of the responses stored before it, and their follow-ups
    went where their cost said, a 404 three times in four on four pods. Now such a request is
    held while the pods are asked `GET /v1/responses/{id}` (`routing.storedLookupMs`) and goes
    to the one storing it. Through a first gateway, first turns and responses to retrieve;
    through a second, new one, each conversation's next two turns (asked once, then noted) and
    the retrievals; an id no pod stores gets the engine's 404 as soon as every pod has said so."""
    with Sim(pods=4, args=SIM_ARGS) as sim:
        firsts, kept = [], []
        with kvgate_envoy(sim.endpoints, default_plugin_config(), concurrency=2) as before:
            for c in range(16):
                status, pod, rid, usage = responses_call(
                    before.port, {"model": MODEL, "input": f"conversation {c}: what is a KV cache?",
                                  "max_output_tokens": 12, "stream": c % 2 == 0})
                assert status == 200 and rid, status
                (firsts if c < 8 else kept).append((pod, rid, usage["input_tokens"] + usage["output_tokens"]))
        assert len({pod for pod, _, _ in firsts + kept}) > 1, "spread over pods"
        with kvgate_envoy(sim.endpoints, default_plugin_config(), concurrency=2) as after:
            held = []
            for c, (pod, rid, tokens) in enumerate(firsts):
                for turn in range(2):
                    t0 = time.monotonic()
                    status, on, rid, usage = responses_call(
                        after.port, {"model": MODEL, "input": f"and then {turn}?", "max_output_tokens": 12,
                                     "previous_response_id": rid, "stream": (c + turn) % 2 == 1})
                    assert status == 200 and on == pod, (c, turn, status, on, pod)
                    assert usage["input_tokens"] > tokens, "the conversation prepended"
                    tokens = usage["input_tokens"] + usage["output_tokens"]
                    held.append(time.monotonic() - t0)
            for pod, rid, _ in kept:
                got = request(after.port, "GET", f"/v1/responses/{rid}")
                assert got.status == 200 and got.json()["id"] == rid, got.status
                assert got.headers.get("x-sim-pod") == pod
            t0 = time.monotonic()
            status, _, _, _ = responses_call(
                after.port, {"model": MODEL, "input": "hm", "max_output_tokens": 4,
                             "previous_response_id": "resp_stored_nowhere"})
            nowhere_s = time.monotonic() - t0
            assert status == 404, status
            counts = after.stats("wasmcustom.kvgate.stored")
            got = {k.rsplit(".", 1)[-1]: v for k, v in counts.items()}
            print("stored:", got, "turns' times (ms):", [round(h * 1000) for h in held],
                  "nowhere:", round(nowhere_s * 1000))
            assert (got.get("asked"), got.get("found")) == (17, 16), got
            assert (got.get("followed"), got.get("unknown")) == (16, 1), got
            # Asked at once, answered at once: far inside the lookup's 500 ms.
            assert nowhere_s < 0.4, nowhere_s


def test_a_request_gone_while_the_pods_are_asked_leaves_nothing_behind():
    """A client that leaves while its follow-up is held for the pods' answers: the calls go on
    to their end (Envoy does not cancel a stream's calls when it resets; the SDK forgets each
    call when its answer comes), and the answer of the pod that stores the response, coming
    after the request is gone, admits nothing and counts nothing. Two pods whose store answers
    after 1 s (the lookup allows 2 s); the response stored on pod 0 without this gateway."""
    cfg = default_plugin_config()
    cfg.setdefault("routing", {})["storedLookupMs"] = 2000
    with Sim(pods=2, args=SIM_ARGS) as sim, kvgate_envoy(sim.endpoints, cfg, concurrency=1) as envoy:
        status, pod, rid, _ = responses_call(sim.ports[0], {"model": MODEL, "input": "hello", "max_output_tokens": 4})
        assert status == 200 and rid
        for port in sim.ports:
            assert request(port, "POST", "/sim/fault", {"retrieveDelayMs": 1000}).status == 200
        body = json.dumps({"model": MODEL, "input": "and?", "max_output_tokens": 400,
                           "previous_response_id": rid}).encode()
        s = socket.create_connection(("127.0.0.1", envoy.port), timeout=10)
        s.sendall(b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  + f"content-length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_for(lambda: stat(envoy, "wasmcustom.kvgate.stored.asked") == 1, timeout=2)
        s.close()
        # Both pods answer, 404 and 200, a second after the asks: neither is cancelled.
        assert wait_for(lambda: stat(envoy, "cluster.kvgate_metrics.upstream_rq_404") == 1, timeout=5)
        time.sleep(0.3)
        assert stat(envoy, "wasmcustom.kvgate.stored.found") == 0 and stat(envoy, "wasmcustom.kvgate.stored.followed") == 0
        assert all(v == 0 for v in kvgate_gauges(envoy, "reserved_tokens").values())
        assert all(v == 0 for v in kvgate_gauges(envoy, "in_flight").values())
        assert sum(sim.stats(i)["request_cache_misses"] for i in range(2)) == 1, "only the first turn ran"
        for port in sim.ports:
            request(port, "POST", "/sim/fault", {"retrieveDelayMs": 0})
        # The VM goes on: the next turn is asked for, found and followed.
        status, on, _, _ = responses_call(
            envoy.port, {"model": MODEL, "input": "and?", "max_output_tokens": 4, "previous_response_id": rid})
        assert (status, on) == (200, pod)
        assert stat(envoy, "wasmcustom.kvgate.stored.followed") == 1


def sidecars(upstreams, admin_port):
    """One Envoy standing for the pods' mesh sidecars: a listener per pod that takes HTTP/1.1 or
    cleartext HTTP/2 (as an Istio sidecar takes its mesh's traffic) and hands it to its pod over
    HTTP/1.1, as the sidecar hands vLLM's. Returns (config, the listeners' ports)."""
    ports = [free_port() for _ in upstreams]
    listeners, clusters = [], []
    for i, ((host, port), listen) in enumerate(zip(upstreams, ports)):
        listeners.append({
            "name": f"pod{i}", "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
            "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                             ".HttpConnectionManager",
                    "stat_prefix": f"pod{i}", "codec_type": "AUTO",
                    "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
                        {"match": {"prefix": "/"}, "route": {"cluster": f"pod{i}", "timeout": "0s"}}]}]},
                    "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}}]}]})
        clusters.append({
            "name": f"pod{i}", "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": f"pod{i}", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}]}]}})
    cfg = {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
           "static_resources": {"listeners": listeners, "clusters": clusters}}
    return cfg, ports


def test_pods_reached_over_http2_as_through_a_mesh_sidecar():
    """The gateway reaching its pods over HTTP/2, as an Istio gateway does through the pods'
    sidecars with `h2UpgradePolicy: UPGRADE` (or a port declared `http2`): kvgate's pick is
    honoured, its streams are metered as they come and its answers' usage read, and everything is
    released. The sidecars' own counters show the hop was HTTP/2."""
    with Sim(pods=2) as sim:
        side_cfg, side_ports = sidecars(sim.endpoints, free_port())
        with Envoy(side_cfg, concurrency=1) as side:
            cfg = envoy_config(free_port(), free_port(), [("127.0.0.1", p) for p in side_ports])
            models = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "models")
            models["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}}
            with Envoy(cfg, concurrency=2) as envoy:
                wait_for(lambda: len(kvgate_gauges(envoy, "healthy")) >= 2, timeout=10)
                pods = {f"127.0.0.1:{p}" for p in side_ports}
                usage0 = stat(envoy, "wasmcustom.kvgate.usage.completion_tokens")
                picked = []
                for i in range(6):
                    r = request(envoy.port, "POST", "/v1/chat/completions", tagged_chat(f"h2-{i}", max_tokens=16))
                    assert r.status == 200, r.body
                    picked.append(r.headers.get("x-kvgate-pod"))
                    assert r.headers.get("x-kvgate-pod") and r.headers.get("x-sim-pod") is not None
                assert set(picked) <= pods, picked
                # A group's second request goes where its first did: the pick holds over HTTP/2.
                again = request(envoy.port, "POST", "/v1/chat/completions", tagged_chat("h2-0", max_tokens=16))
                assert again.headers.get("x-kvgate-pod") == picked[0]
                samples, out = [], {}
                t = threading.Thread(target=lambda: out.update(r=stream(
                    envoy.port, "/v1/chat/completions", dict(tagged_chat("h2-long", max_tokens=400), ignore_eos=True))))
                t.start()
                while t.is_alive():
                    samples.append(kvgate_gauges(envoy, "active_blocks"))
                    time.sleep(0.1)
                t.join()
                s = out["r"]
                assert s["status"] == 200 and s["usage"]["completion_tokens"] == 400, s
                held = [sum(g.values()) for g in samples if sum(g.values()) > 0]
                print(f"the stream's active blocks over HTTP/2, every 0.1 s: {held}")
                assert held and max(held) - held[0] >= 12, f"400 streamed tokens (25 blocks) did not grow the entry: {held}"
                assert wait_for(lambda: stat(envoy, "wasmcustom.kvgate.usage.completion_tokens") - usage0
                                == 6 * 16 + 16 + 400, timeout=3), "every answer's usage was read"
                h2 = sum(v for k, v in side.stats("http.pod").items() if k.endswith(".downstream_cx_http2_total"))
                assert h2 >= 1, side.stats("http.pod")
                assert wait_for(lambda: all(v == 0 for v in kvgate_gauges(envoy, "reserved_tokens").values())
                                and all(v == 0 for v in kvgate_gauges(envoy, "active_blocks").values()), timeout=6)
