"""Tenants whose cached blocks the engine keeps apart by a salt that a gateway sets from each
tenant's identity (vLLM's `X-Cache-Salt` header, taken over the body's `cache_salt`), and who
all open with the same system prompt, as the tenants of one application do. In a real Envoy in
front of kvgate-sim pods, which key their prefix caches by that header as vLLM does: each tenant's
prompts keep a pod of their own and hit its cache there, and admission counts each tenant's
prompt in full, since the engine shares no block between tenants. (Hashed without the header,
kvgate took the tenants for one hot prefix: it spread them over the pods, where each pod computed
each tenant's prompt again, and counted each request as sharing the others' blocks in flight, a
reservation short by the whole prompt.)"""

from concurrent.futures import ThreadPoolExecutor

from harness import Sim, default_plugin_config, kvgate_envoy, kvgate_gauges, preemptions, request, wait_for

from bodies import MODEL, WORDS

# About 1,000 tokens every tenant's requests open with.
SYSTEM = "You are the scheduling assistant of a logistics company. " + \
    " ".join(WORDS[(j * 11) % len(WORDS)] for j in range(950))


def ask(port, tenant, q, max_tokens, **extra):
    """One tenant's chat request; its status and the pod that answered."""
    body = {"model": MODEL, "max_tokens": max_tokens, **extra,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Question {q} of tenant {tenant}: when does it ship?"}]}
    r = request(port, "POST", "/v1/chat/completions", body, headers={"x-cache-salt": f"tenant-{tenant}"},
                timeout=120)
    return r.status, r.headers.get("x-sim-pod")


def test_each_tenants_prompts_keep_their_pod_and_hit_its_cache():
    """Six tenants, ten requests each, a round of one a tenant at a time, on four pods: each
    tenant's requests go to one pod (its cached prompt's), and the engines reuse the prompt for
    all but about a request a tenant, where one hot prefix spread over the pods is computed again
    on each of them."""
    tenants, rounds = 6, 10
    with Sim(pods=4, args=["--time-scale", "20"]) as sim, \
            kvgate_envoy(sim.endpoints, default_plugin_config()) as envoy, ThreadPoolExecutor(tenants) as pool:
        pods = {t: [] for t in range(tenants)}
        for q in range(rounds):
            for t, (status, pod) in zip(range(tenants), pool.map(lambda t: ask(envoy.port, t, q, 8), range(tenants))):
                assert status == 200
                pods[t].append(pod)
        kept = [max(map(p.count, set(p))) / len(p) for p in pods.values()]
        stats = [sim.stats(i) for i in range(sim.pods)]
        hit = sum(s["prefix_cache_hit_tokens"] for s in stats) / sum(s["prefix_cache_query_tokens"] for s in stats)
        print(f"share of each tenant's requests on its pod: {kept}; engines' hit rate {hit:.3f}")
        assert min(kept) >= 0.9, pods
        # A tenant's prompt computed about once: 54 of 60 requests' system prompts reusable (0.88).
        assert hit >= 0.84, hit


def test_tenants_that_share_a_system_prompt_are_admitted_within_the_budget():
    """Eight tenants' requests of about 1,050 prompt tokens with max_tokens 150, 32 at a time, on
    two pods of 4,096 tokens (Envoy `--concurrency` 2): the engines never preempt, since each
    tenant's prompt is counted in full on its pod; every reservation is released."""
    with Sim(pods=2, args=["--time-scale", "10", "--num-gpu-blocks", "256"]) as sim, \
            kvgate_envoy(sim.endpoints, default_plugin_config(), concurrency=2) as envoy, \
            ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda i: ask(envoy.port, i % 8, i, 150, ignore_eos=True), range(96)))
        assert all(status == 200 for status, _ in answers), answers
        preempted = preemptions(sim)
        print(f"preemptions: {preempted}")
        assert preempted == 0
        assert wait_for(lambda: all(v == 0 for v in kvgate_gauges(envoy, "reserved_tokens").values()),
                        timeout=5), kvgate_gauges(envoy, "reserved_tokens")
