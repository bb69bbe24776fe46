"""kvgate in front of SGLang pods: the simulator's `--metrics-flavor sglang` exposes each pod's
`/metrics` as SGLang's scheduler and tokenizer collectors do (KV in tokens, retractions for
preemptions, prompt and cached tokens counted when a request ends, the inter-token latency
histogram), and kvgate must read from them all it reads from vLLM's: each pod's budget, the
engine's prefix-cache hit rate that checks its index, each pod's pace, and the retractions that
back a pod's budget off."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from harness import Sim, default_plugin_config, kvgate_envoy, kvgate_gauges, request, wait_for

from bodies import grouped_chat, unshared_chat

# Pod 1 runs at half speed; 256 pages of 16 tokens each.
SGLANG = ["--time-scale", "2", "--num-gpu-blocks", "256", "--metrics-flavor", "sglang", "--pod-speed", "1,0.5"]


def test_sglang_pods_are_budgeted_paced_checked_and_backed_off_like_vllm_pods():
    with Sim(pods=2, args=SGLANG) as sim, kvgate_envoy(sim.endpoints, default_plugin_config()) as envoy:
        fast, slow = (f"127_0_0_1_{p}" for p in sim.ports)
        gauge = lambda name: kvgate_gauges(envoy, name)
        # The budget is the KV SGLang reports (`sglang:max_total_num_tokens`).
        assert wait_for(lambda: gauge("budget_tokens") == {fast: 4096, slow: 4096}, timeout=5), \
            gauge("budget_tokens")

        # Six clients, each asking one of three groups' questions in turn, for 8 s.
        served = {0: 0, 1: 0}
        lock = threading.Lock()
        deadline = time.time() + 8

        def client(c):
            i = c
            while time.time() < deadline:
                r = request(envoy.port, "POST", "/v1/chat/completions",
                            grouped_chat(i % 3, i, 48, system_words=200, question_words=40), timeout=60)
                assert r.status == 200, r.body
                with lock:
                    served[int(r.headers["x-sim-pod"])] += 1
                i += 6

        with ThreadPoolExecutor(6) as pool:
            list(pool.map(client, range(6)))
        time.sleep(1.2)  # a scrape after the last answers ended
        hits, queries = gauge("engine_prefix_hit_tokens"), gauge("engine_prefix_query_tokens")
        factors = gauge("cost_factor_percent")
        print(f"served {served}; engine hits {hits} of {queries} prompt tokens; pace factors % {factors}")
        # The engines' hit rate, from SGLang's cached and prompt tokens: most of each prompt is
        # its group's system prompt.
        assert sum(queries.values()) > 0 and sum(hits.values()) > 0.3 * sum(queries.values()), (hits, queries)
        # Each pod's pace, from SGLang's inter-token latency: the slow pod's blocks cost more.
        assert factors[slow] > 110 and factors[fast] < 90, factors

        # Traffic straight to the fast pod, past its KV: SGLang retracts (preempts), and kvgate
        # backs that pod's budget off.
        assert gauge("backoff_percent").get(fast, 0) == 0
        with ThreadPoolExecutor(16) as pool:
            t0 = time.time()
            direct = [pool.submit(request, sim.ports[0], "POST", "/v1/chat/completions",
                                  unshared_chat(10_000 + i, 1200), timeout=120) for i in range(16)]
            assert wait_for(lambda: gauge("backoff_percent").get(fast, 0) > 0, timeout=10), \
                (gauge("backoff_percent"), sim.stats(0).get("preemptions"))
            print(f"backoff {gauge('backoff_percent')} % after {time.time() - t0:.1f} s, "
                  f"{sim.stats(0)['preemptions']} retractions so far")
            assert all(f.result().status == 200 for f in direct)
        assert sim.stats(0)["preemptions"] > 0
        assert gauge("backoff_percent").get(slow, 0) == 0
