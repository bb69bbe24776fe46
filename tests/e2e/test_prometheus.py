"""The operator's view (monitoring/ and the status page), against the real thing.

* A real Prometheus (Debian's `prometheus`, on loopback) scrapes a real Envoy's /stats/prometheus
  with monitoring/prometheus.yml's job while kvgate is under load in front of kvgate-sim pods and
  one dead pod; PromQL returns kvgate's series with pods, bands and outcomes as labels, agreeing
  with Envoy's own stats.
* Every query of monitoring/kvgate-dashboard.json parses and returns a number there.
* monitoring/kvgate-rules.yml passes `promtool check rules` and its unit tests (every alert fires
  in one), loads into that Prometheus with every rule healthy, and the dead pod's alerts go
  pending on live series; the PrometheusRule and PodMonitor carry the same rules and relabelling,
  and every alert has its runbook entry in docs/operations.md.
* The status page (statusPath) answers under load with the pool as shared data holds it.
"""

import json
import math
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
import yaml

from harness import (ROOT, STATUS_PATH, Sim, default_plugin_config, free_port, kvgate_envoy, request,
                     stop, wait_for, wait_port)

MONITORING = ROOT / "monitoring"
RULES = MONITORING / "kvgate-rules.yml"
# Long enough to cut into several 16-token blocks, shared by every request: prefix hits.
SYSTEM = "You are a careful assistant for the operations team. " * 12
SCRAPE_S = 1


def promtool(*args):
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool is missing: ./build.sh setup installs Debian's prometheus package")
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, timeout=60,
                          cwd=MONITORING)


class Prometheus:
    """A Prometheus server on loopback scraping `admin_port` with monitoring/prometheus.yml's job
    every second and evaluating kvgate's rules."""

    def __init__(self, admin_port):
        self.admin_port = admin_port
        self.port = free_port()
        self.proc = None

    def __enter__(self):
        exe = shutil.which("prometheus")
        if exe is None:
            pytest.fail("prometheus is missing: ./build.sh setup installs Debian's prometheus package")
        self.dir = Path(tempfile.mkdtemp(prefix="kvgate-prometheus-"))
        job = yaml.safe_load((MONITORING / "prometheus.yml").read_text())["scrape_configs"][0]
        job["static_configs"] = [{"targets": [f"127.0.0.1:{self.admin_port}"]}]
        config = {"global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
                  "rule_files": [str(RULES)], "scrape_configs": [job]}
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(self.dir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [exe, f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_port(self.port, 30, self.proc)
            assert wait_for(lambda: request(self.port, "GET", "/-/ready").status == 200, timeout=30)
        except Exception:
            self.__exit__()
            raise
        return self

    def api(self, path, **params):
        r = request(self.port, "GET", f"/api/v1/{path}?" + urllib.parse.urlencode(params))
        body = r.json()
        assert r.status == 200 and body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr):
        """An instant query's samples as {frozenset(labels): value}."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return {frozenset(s["metric"].items()): float(s["value"][1]) for s in data["result"]}

    def by(self, expr, label):
        return {dict(k).get(label): v for k, v in self.query(expr).items()}

    def __exit__(self, *exc):
        stop(self.proc)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def load(envoy, stop_at, statuses, results):
    """One client: requests sharing a system prompt; every fourth is sheddable (batch)."""
    i = 0
    while time.time() < stop_at:
        i += 1
        headers = {"x-gateway-inference-objective": "batch"} if i % 4 == 0 else {}
        body = {"model": "m", "max_tokens": 96,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}]}
        r = request(envoy.port, "POST", "/v1/chat/completions", body, headers=headers, timeout=30)
        results.append(r.status)
        if r.status != 200 and not (r.status in (429, 503) and "x-kvgate-reason" in r.headers):
            statuses.append(("unexpected", r.status, r.body[:200]))


@pytest.fixture(scope="module")
def live():
    """Envoy + kvgate in front of two small simulated pods and one dead address, under ~12 s of
    load that queues, sheds and times out, scraped by Prometheus; yields once the load is over
    and Prometheus has Envoy's final numbers."""
    dead = ("127.0.0.1", free_port())  # nothing listens: scrapes fail, the pod is avoided
    cfg = default_plugin_config()
    cfg["statusPath"] = STATUS_PATH
    cfg["admission"] = dict(cfg.get("admission", {}), maxWaitMs=500, objectives={"batch": -1})
    # 40 blocks of 16 tokens: a budget of two or three of these requests per pod.
    # The pods serve "m": kvgate reads their model lists and answers 404 for a model none serves.
    with Sim(pods=2, args=["--num-gpu-blocks", "40", "--served-model-name", "m"]) as sim, \
            kvgate_envoy(sim.endpoints + [dead], cfg, concurrency=2) as envoy, \
            Prometheus(envoy.admin_port) as prom:
        statuses, results, snapshots = [], [], []
        stop_at = time.time() + 12
        clients = [threading.Thread(target=load, args=(envoy, stop_at, statuses, results)) for _ in range(12)]
        for c in clients:
            c.start()
        while time.time() < stop_at:
            snapshots.append(request(envoy.port, "GET", STATUS_PATH).json())
            time.sleep(0.5)
        html = request(envoy.port, "GET", STATUS_PATH, headers={"accept": "text/html"})
        for c in clients:
            c.join(60)
        # Let the pool gauges settle (written each 250 ms tick) and Prometheus take them.
        time.sleep(3 * SCRAPE_S + 1)
        routed = envoy.stats("wasmcustom.kvgate.routed")["wasmcustom.kvgate.routed"]
        assert wait_for(lambda: prom.query("sum(kvgate_routed)") and
                        list(prom.query("sum(kvgate_routed)").values())[0] == routed, timeout=10)
        yield {"envoy": envoy, "prom": prom, "sim": sim, "dead": f"{dead[0]}:{dead[1]}",
               "live": [f"127.0.0.1:{p}" for p in sim.ports], "statuses": statuses, "results": results,
               "snapshots": snapshots, "html": html}


def test_the_load_exercised_every_outcome(live):
    assert not live["statuses"], live["statuses"][:5]
    codes = set(live["results"])
    assert {200, 429, 503} <= codes, f"the load should admit, shed and time out: {sorted(codes)}"


def test_prometheus_shows_kvgates_series_with_pods_models_bands_and_outcomes_as_labels(live):
    prom, envoy = live["prom"], live["envoy"]
    stats = envoy.stats("wasmcustom.kvgate")
    # Per pod: one name, the pod as ip:port, agreeing with Envoy's per-pod stats.
    picks = prom.by("kvgate_pod_picks", "pod")
    assert set(picks) == set(live["live"]), picks
    for pod, n in picks.items():
        assert n == stats[f"wasmcustom.kvgate.pod.{pod.replace('.', '_').replace(':', '_')}.picks"]
    assert sum(picks.values()) == stats["wasmcustom.kvgate.routed"]
    for gauge in ("reserved_tokens", "held_tokens", "budget_tokens", "unexplained_tokens", "backoff_percent",
                  "relief_percent", "active_blocks", "in_flight", "healthy"):
        assert set(prom.by(f"kvgate_pod_{gauge}", "pod")) == set(live["live"]) | {live["dead"]}, gauge
    assert prom.by("kvgate_pod_healthy", "pod")[live["dead"]] == 0
    assert all(prom.by("max_over_time(kvgate_pod_reserved_tokens[5m])", "pod")[p] > 0 for p in live["live"])
    assert set(prom.by("kvgate_pod_scrape_errors", "pod")) == {live["dead"]}, "only the dead pod fails"
    assert not prom.query('{__name__=~"kvgate_pod_[0-9].*|kvgate_model_m_.*|kvgate_queue_priority_.*|kvgate_admission_shed"}'), \
        "every per-pod, per-model, per-band and outcome name is relabelled"
    # Per model: the pods' one model, "m" (answers of 96 tokens: the prior stays the configured 256).
    assert prom.by("kvgate_model_picks", "model") == {"m": stats["wasmcustom.kvgate.model.m.picks"]}
    assert prom.by("kvgate_model_output_prior_tokens", "model") == {"m": 256}
    assert set(prom.by("sum by (model) (kvgate_model_output_error_pct_count)", "model")) == {"m"}
    # The line, by band: the default band, the configured batch band, and the rest.
    assert set(prom.by("kvgate_queue_band_length", "priority")) == {"0", "-1", "other"}
    assert list(prom.query("max_over_time(kvgate_queue_length[5m])").values())[0] > 0
    outcomes = prom.by("kvgate_admission_requests", "outcome")
    assert {"admitted", "queued", "shed", "timed_out"} <= set(outcomes), outcomes
    assert outcomes["shed"] == stats["wasmcustom.kvgate.admission.shed"]
    assert outcomes["admitted"] == stats["wasmcustom.kvgate.admission.admitted"]
    assert list(prom.query("sum(rate(kvgate_admission_requests{outcome='admitted'}[5m]))").values())[0] > 0
    assert list(prom.query("sum(kvgate_admission_wait_ms_count)").values())[0] > 0
    # Routing quality and estimates.
    matched, total = (list(prom.query(f"kvgate_prefix_blocks_{k}").values())[0] for k in ("matched", "total"))
    assert 0 < matched <= total
    ratio = prom.query("kvgate_usage_prompt_tokens / kvgate_estimate_prompt_tokens")
    assert ratio and all(0.5 < v < 2 for v in ratio.values()), ratio
    assert list(prom.query("kvgate_pods_total").values())[0] == 3


def dashboard_queries():
    dash = json.loads((MONITORING / "kvgate-dashboard.json").read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["refId"], target["expr"]))
    return dash, out


def test_the_dashboard_is_importable_and_every_query_returns_data(live):
    dash, queries = dashboard_queries()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] and dash["schemaVersion"] >= 36
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert variables == {"datasource", "instance"}
    assert len(queries) >= 15
    for title, ref, expr in queries:
        # What Grafana substitutes: every instance, and a window over the whole run.
        concrete = expr.replace("$instance", ".*").replace("$__rate_interval", "5m")
        assert "$" not in concrete, f"{title}/{ref}: unknown variable in {expr}"
        values = live["prom"].query(concrete)
        assert any(math.isfinite(v) for v in values.values()), f"{title}/{ref}: no data for {concrete}: {values}"


def test_alert_rules_pass_promtool_and_their_unit_tests_fire_every_alert():
    r = promtool("check", "rules", RULES)
    assert r.returncode == 0, r.stdout + r.stderr
    r = promtool("test", "rules", MONITORING / "kvgate-rules.test.yml")
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    rules = yaml.safe_load(RULES.read_text())
    alerts = {rule["alert"] for g in rules["groups"] for rule in g["rules"] if "alert" in rule}
    tests = yaml.safe_load((MONITORING / "kvgate-rules.test.yml").read_text())["tests"]
    fired = {case["alertname"] for t in tests for case in t.get("alert_rule_test", []) if case["exp_alerts"]}
    assert alerts == fired, f"alerts without a unit test that fires them: {alerts - fired}"
    ops = (ROOT / "docs/operations.md").read_text()
    for g in rules["groups"]:
        for rule in g["rules"]:
            anchor = rule["annotations"]["runbook"].split("#")[1]
            assert anchor == rule["alert"].lower(), rule["alert"]
            assert f"#### {rule['alert']}" in ops, f"docs/operations.md has no runbook for {rule['alert']}"


def test_the_operator_manifests_carry_the_same_rules_and_relabelling():
    rules = yaml.safe_load(RULES.read_text())
    manifest = yaml.safe_load((MONITORING / "kvgate-prometheusrule.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert manifest["spec"]["groups"] == rules["groups"]
    job = yaml.safe_load((MONITORING / "prometheus.yml").read_text())["scrape_configs"][0]
    monitor = yaml.safe_load((MONITORING / "podmonitor.yaml").read_text())
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    camel = {"source_labels": "sourceLabels", "target_label": "targetLabel", "regex": "regex",
             "replacement": "replacement"}
    assert endpoint["metricRelabelings"] == [{camel[k]: v for k, v in r.items()}
                                            for r in job["metric_relabel_configs"]]
    assert endpoint["path"] == job["metrics_path"]


def test_the_rules_load_into_prometheus_and_the_dead_pod_is_flagged(live):
    prom = live["prom"]
    groups = prom.api("rules")["groups"]
    loaded = [r for g in groups for r in g["rules"]]
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert len(loaded) == len(rules) and all(r["health"] == "ok" for r in loaded), \
        [(r["name"], r.get("lastError")) for r in loaded if r["health"] != "ok"]
    # Their `for` is minutes long, so on a live run they go pending: on the right series.
    pending = wait_for(lambda: {(a["labels"]["alertname"], a["labels"].get("pod"))
                                for a in prom.api("alerts")["alerts"]}, timeout=10)
    assert ("KvgateScrapeFailing", live["dead"]) in pending and ("KvgatePodAvoided", live["dead"]) in pending, pending
    assert not [p for p in pending if p[1] in live["live"]], f"a live pod flagged: {pending}"


def test_the_status_page_shows_the_pool_under_load(live):
    snaps = live["snapshots"]
    assert snaps, "no snapshot taken"
    pods = [p for s in snaps for p in s["pods"]]
    assert {p["pod"] for p in pods} == set(live["live"]) | {live["dead"]}
    busy = [p for p in pods if p["inFlight"] > 0]
    # Reservations are reconciled as responses stream, so one moment's entry may hold none.
    assert any(p["reservedTokens"] > 0 and p["activeBlocks"] > 0 for p in busy), busy[:3]
    assert max(s["queue"]["length"] for s in snaps) > 0, "the line was seen"
    dead = [p for p in pods if p["pod"] == live["dead"]]
    assert dead and not dead[-1]["healthy"] and dead[-1]["inFlight"] == 0
    html = live["html"]
    assert html.status == 200 and html.headers["content-type"].startswith("text/html")
    assert html.body.decode().count("<tr><td>") == 3
