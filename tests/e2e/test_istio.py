"""The Istio manifests in istio/ and the OCI packaging in tools/oci.py.

* Every manifest is valid against Istio's CRD schemas (the generated bundle, as the API server
  would check it: unknown fields rejected, enums, patterns, and the CEL rules those schemas carry).
* The EnvoyFilter patches name real Envoy fields and kvgate accepts the configuration: the patches
  are applied to the plain-Envoy config of envoy/envoy.yaml the way Istio applies them, and the
  result passes `envoy --mode validate` (which also runs kvgate's on_configure on the manifest's
  configuration). Then real Envoys show both routing paths send each request where kvgate said,
  and that a WasmPlugin (no allow_on_headers_stop_iteration) stalls kvgate's requests.
* The WasmPlugin carries a real configuration: every key is in docs/configuration.md's tables and
  every documented section is present; the EnvoyFilter carries the same one.
* tools/oci.py writes an OCI layout Istio's fetcher accepts, reproducibly, holding exactly the
  built module; the manifests carry placeholder digests that `./build.sh oci` stamps for this build.
"""

import copy
import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile

import pytest
import yaml

from harness import ENVOY_BIN, ENVOY_YAML, ROOT, WASM, Envoy, StubUpstream, free_port, request
from crd_schema import schema_errors

ISTIO = ROOT / "istio"
OCI_TOOL = ROOT / "tools/oci.py"
CONFIG_DOC = ROOT / "docs/configuration.md"

NAMESPACE = "istio-system"
FILTER_NAME = "istio-system.kvgate"
MODEL_CLUSTER = "outbound|8000||vllm.llm.svc.cluster.local"
# The shape of the cluster Istio builds for an InferencePool's shadow Service.
POOL_CLUSTER = "outbound|54321||pool-ip-0a1b2c3d.llm.svc.cluster.local"
WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Tell me about prefix caches."}], "max_tokens": 16}


def load_manifests():
    """{file name: [documents]} for every YAML file in istio/."""
    out = {}
    for path in sorted(ISTIO.glob("*.yaml")):
        out[path.name] = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return out


MANIFESTS = load_manifests()


def one(name, kind=None):
    docs = [d for d in MANIFESTS[name] if kind is None or d["kind"] == kind]
    assert len(docs) == 1, f"{name}: expected one {kind or 'document'}"
    return docs[0]


def all_docs():
    return [(name, i, d) for name, docs in MANIFESTS.items() for i, d in enumerate(docs)]


def test_manifest_set_is_complete():
    kinds = {(name, d["kind"]) for name, _, d in all_docs()}
    assert ("wasmplugin.yaml", "WasmPlugin") in kinds and ("wasmplugin-file.yaml", "WasmPlugin") in kinds
    for name in ["kvgate-envoyfilter.yaml", "support.yaml", "support-mtls.yaml", "routing-override-host.yaml",
                 "routing-inferencepool.yaml"]:
        assert (name, "EnvoyFilter") in kinds, name


# --- CRD schema validation ------------------------------------------------------------------------

@pytest.mark.parametrize("name,index,doc", all_docs(), ids=lambda x: x if isinstance(x, str) else None)
def test_manifest_matches_crd_schema(name, index, doc):
    assert doc["metadata"]["namespace"] == NAMESPACE
    errors = schema_errors(doc)
    assert not errors, f"{name}[{index}] {doc['kind']}:\n" + "\n".join(errors)


@pytest.mark.parametrize("mutate,expect", [
    (lambda d: d["spec"].update(phase="BEFORE_ROUTER"), "is not one of"),
    (lambda d: d["spec"].update(sha256="not-a-digest"), "does not match"),
    (lambda d: d["spec"].update(pluginNmae="kvgate"), "Additional properties"),
    (lambda d: d["spec"].update(url="ftp://example.com/kvgate.wasm"), "url must have schema"),
    (lambda d: d["spec"].update(targetRefs=[{"kind": "Gateway", "name": "gw"}]), "only one of targetRefs or selector"),
    (lambda d: d["spec"]["selector"]["matchLabels"].update(app="*"), "wildcard"),
    (lambda d: d["spec"].update(priority=2**31), "int32"),
    (lambda d: d["spec"].update(vmConfig={"env": [{"name": "A", "valueFrom": "HOST", "value": "x"}]}),
     "value may only be set"),
    (lambda d: d["spec"].update(vmConfig={"env": [{"name": "A"}, {"name": "A"}]}), "duplicate"),
    (lambda d: d["spec"].update(priority=None), None),  # nullable Int32Value: allowed
])
def test_schema_validation_rejects_what_the_api_server_would(mutate, expect):
    doc = copy.deepcopy(one("wasmplugin.yaml"))
    mutate(doc)
    errors = schema_errors(doc)
    if expect is None:
        assert not errors, errors
    else:
        assert any(expect in e for e in errors), errors


def test_envoyfilter_schema_rejects_bad_patches():
    doc = copy.deepcopy(one("kvgate-envoyfilter.yaml"))
    doc["spec"]["configPatches"][0]["patch"]["operation"] = "UPSERT"
    doc["spec"]["configPatches"][1]["match"]["listner"] = {}
    errors = schema_errors(doc)
    assert any("UPSERT" in e for e in errors) and any("listner" in e for e in errors), errors
    doc = copy.deepcopy(one("kvgate-envoyfilter.yaml"))
    doc["spec"]["configPatches"][1]["match"]["cluster"] = {"name": "x"}  # listener and cluster: oneOf
    assert schema_errors(doc)


# --- the plugin configuration ---------------------------------------------------------------------

def documented_keys():
    """{dotted key: default as written} from docs/configuration.md's tables."""
    keys = {}
    for line in CONFIG_DOC.read_text().splitlines():
        m = re.match(r"^\|\s*`([A-Za-z0-9_.]+)`\s*\|\s*`(.*?)`\s*\|", line)
        if m:
            keys[m.group(1)] = m.group(2)
    assert keys, "no key tables found in docs/configuration.md"
    return keys


def flatten(cfg, documented, prefix=""):
    """Dotted keys of a configuration; a documented key is a leaf even when its value is a map."""
    out = {}
    for k, v in cfg.items():
        if isinstance(v, dict) and prefix + k not in documented:
            out.update(flatten(v, documented, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def kind_of(value):
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def envoyfilter_config():
    ef = one("kvgate-envoyfilter.yaml")
    ecds = [p for p in ef["spec"]["configPatches"] if p["applyTo"] == "EXTENSION_CONFIG"]
    wasm = ecds[0]["patch"]["value"]["typed_config"]
    assert wasm["@type"] == WASM_TYPE
    return wasm["config"]


@pytest.mark.parametrize("name", ["wasmplugin.yaml", "wasmplugin-file.yaml"])
def test_plugin_config_is_a_full_documented_configuration(name):
    cfg = one(name)["spec"]["pluginConfig"]
    docs = documented_keys()
    flat = flatten(cfg, docs)
    undocumented = sorted(set(flat) - set(docs))
    assert not undocumented, f"{name}: pluginConfig keys not in docs/configuration.md: {undocumented}"
    missing = sorted(set(docs) - set(flat))
    assert not missing, f"{name}: documented keys missing from pluginConfig (it must be complete): {missing}"
    for key, value in flat.items():
        default = json.loads(docs[key]) if docs[key] else docs[key]
        assert kind_of(value) == kind_of(default), f"{key}: {value!r} vs documented default {docs[key]}"


def test_all_manifests_carry_the_same_configuration():
    oci = one("wasmplugin.yaml")["spec"]
    file = one("wasmplugin-file.yaml")["spec"]
    assert oci["pluginConfig"] == file["pluginConfig"]
    for key in ["phase", "priority", "failStrategy", "pluginName", "selector", "type"]:
        assert oci.get(key) == file.get(key), key
    cfg = envoyfilter_config()
    value = cfg["configuration"]["value"]
    assert json.loads(value) == oci["pluginConfig"], "kvgate-envoyfilter.yaml's configuration differs"
    assert cfg["allow_on_headers_stop_iteration"] is True
    assert cfg["root_id"] == oci["pluginName"] and cfg["fail_open"] is False
    # Never fail open; the EnvoyFilter says what istiod would say for the WasmPlugin's strategy.
    assert oci["failStrategy"] in ("FAIL_CLOSE", "FAIL_RELOAD")
    assert cfg["failure_policy"] == {"FAIL_CLOSE": "FAIL_CLOSED", "FAIL_RELOAD": "FAIL_RELOAD"}[oci["failStrategy"]]
    assert oci["phase"] in ("STATS", "UNSPECIFIED_PHASE")


def test_configuration_matches_the_clusters_and_buffers():
    cfg = one("wasmplugin.yaml")["spec"]["pluginConfig"]
    added = {p["patch"]["value"]["name"]: p["patch"]["value"]
             for name in ["support.yaml", "support-mtls.yaml"]
             for p in one(name)["spec"]["configPatches"] if p["applyTo"] == "CLUSTER"}
    admin = added[cfg["discovery"]["adminCluster"]]
    sock = admin["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert (sock["address"], sock["port_value"]) == ("127.0.0.1", 15000), "Istio proxies' admin"
    metrics = added[cfg["metrics"]["cluster"]]
    assert metrics["type"] == "ORIGINAL_DST" and metrics["lb_policy"] == "CLUSTER_PROVIDED"
    assert metrics["original_dst_lb_config"]["use_http_header"] is True
    for name in ["support.yaml", "support-mtls.yaml"]:
        listener = [p for p in one(name)["spec"]["configPatches"] if p["applyTo"] == "LISTENER"]
        assert listener[0]["patch"]["value"]["per_connection_buffer_limit_bytes"] >= cfg["maxBodyBytes"]
    override = one("routing-override-host.yaml")["spec"]["configPatches"][0]["match"]["cluster"]
    assert cfg["discovery"]["modelCluster"] == f"outbound|{override['portNumber']}||{override['service']}"


# --- the Istio-equivalent plain Envoy configuration -----------------------------------------------

def proto_merge(dst, src):
    """Proto merge as Istio's MERGE does it: messages merge field by field, repeated fields append,
    scalars are replaced."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            proto_merge(dst[k], v)
        elif isinstance(v, list) and isinstance(dst.get(k), list):
            dst[k].extend(copy.deepcopy(v))
        else:
            dst[k] = copy.deepcopy(v)


def go_json(value):
    """google.protobuf.Struct -> JSON as Istio's protomarshal.ToJSON writes a WasmPlugin's
    pluginConfig: every number is a double, printed like Go's encoding/json."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{go_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(go_json(v) for v in value) + "]"
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return json.dumps(value)
    f = float(value)
    if f.is_integer() and abs(f) < 1e21:
        return str(int(f))
    return repr(f)


def istio_gateway_base(pool=False, upstreams=(("127.0.0.1", 8000), ("127.0.0.1", 8001))):
    """envoy/envoy.yaml reshaped into what Istio generates for the ingress gateway before any
    kvgate manifest: no kvgate filter, the route and cluster named as Istio names them, the model
    cluster as Istio builds it (least request for a Service; for an InferencePool's shadow Service
    the metadata-only override-host policy), and the bootstrap's xds-grpc and sds-grpc clusters."""
    cfg = yaml.safe_load(ENVOY_YAML.read_text())
    cfg["admin"]["address"]["socket_address"]["port_value"] = free_port()
    listener = cfg["static_resources"]["listeners"][0]
    listener["name"] = "0.0.0.0_8080"
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": free_port()}
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.router"]
    name = POOL_CLUSTER if pool else MODEL_CLUSTER
    hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"] = name
    model = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "models")
    cfg["static_resources"]["clusters"] = [model]  # kvgate's own clusters come from support.yaml
    model["name"] = model["load_assignment"]["cluster_name"] = name
    model["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}} for h, p in upstreams]
    if pool:
        model["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": [{"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}],
                # Round robin so that a missed override is visible in the tests.
                "fallback_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.round_robin",
                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"}}}]},
            }}}]}
    else:
        del model["load_balancing_policy"]
        model["lb_policy"] = "LEAST_REQUEST"
    h2 = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}}}}
    for cname, port in [("xds-grpc", 15010), ("sds-grpc", 15012)]:
        cfg["static_resources"]["clusters"].append({
            "name": cname, "type": "STATIC", "connect_timeout": "1s", "typed_extension_protocol_options": h2,
            "load_assignment": {"cluster_name": cname, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}})
    cfg["node"] = {"id": "router~10.0.0.1~istio-ingressgateway-0.istio-system~istio-system.svc.cluster.local",
                   "cluster": "istio-ingressgateway.istio-system"}
    cfg["dynamic_resources"] = {"ads_config": {"api_type": "GRPC", "transport_api_version": "V3",
                                               "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]}}
    return cfg


def _hcm_filters(cfg):
    for listener in cfg["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                if f["name"] == "envoy.filters.network.http_connection_manager":
                    yield f["typed_config"]["http_filters"]


def apply_envoy_filters(cfg, envoy_filters, ecds):
    """Applies EnvoyFilters as istiod does for a gateway: in priority order, each patch in order.
    Unlike Istio, a patch that matches nothing fails here instead of being skipped."""
    for ef in sorted(envoy_filters, key=lambda e: e["spec"].get("priority", 0)):
        for patch in ef["spec"]["configPatches"]:
            apply_to, match, p = patch["applyTo"], patch.get("match", {}), patch["patch"]
            assert match.get("context") == "GATEWAY", "kvgate's patches are for the ingress gateway"
            op, value = p["operation"], copy.deepcopy(p.get("value"))
            clusters = cfg["static_resources"]["clusters"]
            if apply_to == "EXTENSION_CONFIG":
                assert op == "ADD", "Istio applies only ADD to EXTENSION_CONFIG"
                ecds[value["name"]] = value
            elif apply_to == "CLUSTER" and op == "ADD":
                assert value["name"] not in {c["name"] for c in clusters}
                clusters.append(value)
            elif apply_to == "CLUSTER" and op == "MERGE":
                cm = match["cluster"]
                want = cm.get("name") or f"outbound|{cm['portNumber']}||{cm['service']}"
                hit = [c for c in clusters if c["name"] == want]
                assert hit, f"CLUSTER MERGE matched nothing ({want})"
                for c in hit:
                    proto_merge(c, value)
            elif apply_to == "LISTENER" and op == "MERGE":
                for listener in cfg["static_resources"]["listeners"]:
                    proto_merge(listener, value)
            elif apply_to == "HTTP_FILTER":
                fm = match["listener"]["filterChain"]["filter"]
                assert fm["name"] == "envoy.filters.network.http_connection_manager"
                sub = fm.get("subFilter", {}).get("name")
                for filters in _hcm_filters(cfg):
                    names = [f["name"] for f in filters]
                    if op == "ADD":
                        filters.append(value)
                    elif op == "INSERT_FIRST":
                        filters.insert(0, value)
                    else:
                        assert op in ("INSERT_BEFORE", "INSERT_AFTER") and sub in names, (op, sub, names)
                        i = names.index(sub)
                        filters.insert(i if op == "INSERT_BEFORE" else i + 1, value)
            else:
                pytest.fail(f"patch {apply_to} {op} is not emulated")
    return cfg


WASMPLUGIN_FILTER = "extensions.istio.io/wasmplugin/istio-system.kvgate"


def wasmplugin_to_ecds(wp):
    """The HTTP filter and ECDS resource istiod makes of a WasmPlugin (pilot/pkg/model
    WasmPluginWrapper.buildPluginConfig, and the ECDS filter of pilot/pkg/networking/core/extension):
    resource and filter named extensions.istio.io/wasmplugin/<ns>.<name>, plugin named <ns>.<name>."""
    spec, meta = wp["spec"], wp["metadata"]
    plugin_name = f"{meta['namespace']}.{meta['name']}"
    name = "extensions.istio.io/wasmplugin/" + plugin_name
    url = spec["url"]
    if url.startswith("file://"):
        code = {"local": {"filename": url[len("file://"):]}}
    else:
        code = {"remote": {"http_uri": {"uri": url, "timeout": "30s", "cluster": "_"}, "sha256": spec.get("sha256", "")}}
    config = {
        "name": plugin_name,
        "root_id": spec.get("pluginName", ""),
        "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": go_json(spec["pluginConfig"])},
        "vm_config": {"runtime": "envoy.wasm.runtime.v8", "code": code,
                      "environment_variables": {"key_values": {"ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION": "1"}}},
        "failure_policy": {"FAIL_OPEN": "FAIL_OPEN", "FAIL_RELOAD": "FAIL_RELOAD"}.get(spec.get("failStrategy"), "FAIL_CLOSED"),
    }
    http_filter = {"name": name, "config_discovery": {
        "config_source": {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"},
        "type_urls": [WASM_TYPE, "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC"]}}
    return http_filter, {"name": name, "typed_config": {"@type": WASM_TYPE, "config": config}}


def insert_wasmplugin(cfg, wp, ecds):
    """Places the WasmPlugin's filter where its phase puts it: STATS (and UNSPECIFIED_PHASE) come
    after Istio's authn/authz filters; this minimal chain has none of those, so before the router."""
    assert wp["spec"]["phase"] in ("STATS", "UNSPECIFIED_PHASE")
    http_filter, resource = wasmplugin_to_ecds(wp)
    ecds[resource["name"]] = resource
    for filters in _hcm_filters(cfg):
        filters.insert(len(filters) - 1, http_filter)


def resolve_ecds(cfg, ecds, wasm=WASM, module_files=None):
    """What istio-agent and Envoy's ECDS do: each config_discovery filter gets its resource's
    config, with a remote module replaced by the local file the agent downloaded
    (pkg/wasm/convert.go). module_files maps file:// paths to the files standing in for them."""
    cfg = copy.deepcopy(cfg)
    for filters in _hcm_filters(cfg):
        for i, f in enumerate(filters):
            if "config_discovery" not in f:
                continue
            res = copy.deepcopy(ecds[f["name"]])
            assert res["typed_config"]["@type"] in f["config_discovery"]["type_urls"]
            vm = res["typed_config"]["config"]["vm_config"]
            if "remote" in vm["code"]:
                assert vm["code"]["remote"]["http_uri"]["uri"].startswith("oci://")
                vm["code"] = {"local": {"filename": str(wasm)}}
            else:
                path = vm["code"]["local"]["filename"]
                vm["code"]["local"]["filename"] = str((module_files or {}).get(path, path))
            filters[i] = {"name": f["name"], "typed_config": res["typed_config"]}
    return cfg


def envoy_validate(cfg, tmp_path, label):
    path = tmp_path / f"{label}.json"
    path.write_text(json.dumps(cfg, indent=1))
    r = subprocess.run([str(ENVOY_BIN), "--mode", "validate", "-c", str(path), "-l", "warning"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "OK" in out, f"envoy rejected {label}:\n{out[-3000:]}"
    return out


def kvgate_via_envoyfilter(support="support.yaml", routing="routing-override-host.yaml", **base):
    ecds = {}
    pool = routing == "routing-inferencepool.yaml"
    cfg = istio_gateway_base(pool=pool, **base)
    efs = [one("kvgate-envoyfilter.yaml"), one(support), one(routing)]
    apply_envoy_filters(cfg, efs, ecds)
    return cfg, ecds


@pytest.mark.parametrize("support,routing", [
    ("support.yaml", "routing-override-host.yaml"),
    ("support-mtls.yaml", "routing-inferencepool.yaml"),
])
def test_envoyfilters_make_a_valid_envoy_config(support, routing, tmp_path):
    cfg, ecds = kvgate_via_envoyfilter(support, routing)
    # As delivered: the filter is an ECDS reference served over ADS.
    envoy_validate(cfg, tmp_path, "delivered")
    # As running: the ECDS resource in place, the module local; Envoy checks every field, and
    # loading kvgate runs its on_configure on the manifest's configuration.
    resolved = resolve_ecds(cfg, ecds)
    out = envoy_validate(resolved, tmp_path, "resolved")
    assert "invalid kvgate config" not in out
    filters = next(_hcm_filters(resolved))
    names = [f["name"] for f in filters]
    assert names[-1] == "envoy.filters.http.router" and FILTER_NAME in names
    kv = filters[names.index(FILTER_NAME)]["typed_config"]["config"]
    assert kv["allow_on_headers_stop_iteration"] is True
    if routing == "routing-inferencepool.yaml":
        assert names.index("kvgate.destination-to-metadata") == names.index(FILTER_NAME) + 1


def self_signed(tmp_path):
    """A throwaway CA-less certificate and key standing in for the mounted etcd client files."""
    crt, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kvgate",
                    "-keyout", str(key), "-out", str(crt)], check=True, capture_output=True)
    return {"/etc/kvgate-etcd/tls.crt": crt, "/etc/kvgate-etcd/tls.key": key, "/etc/kvgate-etcd/ca.crt": crt}


@pytest.mark.parametrize("name", ["etcd-cluster.yaml", "etcd-cluster-tls.yaml"])
def test_etcd_clusters_make_a_valid_envoy_config_with_sharing_on(name, tmp_path):
    """The etcd cluster patch next to the rest, and kvgate configured to share budgets through it
    (its on_configure runs on Envoy's node id, as Istio sets it)."""
    cfg, ecds = kvgate_via_envoyfilter()
    apply_envoy_filters(cfg, [one(name)], ecds)
    resolved = resolve_ecds(cfg, ecds)
    kv = next(f for f in next(_hcm_filters(resolved)) if f["name"] == FILTER_NAME)["typed_config"]["config"]
    plugin = json.loads(kv["configuration"]["value"])
    plugin["etcd"].update(cluster="kvgate_etcd", maxReplicas=5)
    kv["configuration"]["value"] = json.dumps(plugin)
    text = json.dumps(resolved)
    for path, local in self_signed(tmp_path).items():
        text = text.replace(path, str(local))
    out = envoy_validate(json.loads(text), tmp_path, name)
    assert "invalid kvgate config" not in out
    etcd = next(c for c in json.loads(text)["static_resources"]["clusters"] if c["name"] == "kvgate_etcd")
    assert "http2_protocol_options" not in etcd and "typed_extension_protocol_options" not in etcd, \
        "etcd's JSON gateway needs HTTP/1.1"


@pytest.mark.parametrize("name", ["wasmplugin.yaml", "wasmplugin-file.yaml"])
def test_wasmplugins_make_a_valid_envoy_config(name, tmp_path):
    wp = one(name)
    cfg = istio_gateway_base()
    ecds = {}
    apply_envoy_filters(cfg, [one("support.yaml"), one("routing-override-host.yaml")], ecds)
    insert_wasmplugin(cfg, wp, ecds)
    envoy_validate(cfg, tmp_path, "delivered")
    files = {wp["spec"]["url"][len("file://"):]: WASM} if wp["spec"]["url"].startswith("file://") else {}
    resolved = resolve_ecds(cfg, ecds, module_files=files)
    out = envoy_validate(resolved, tmp_path, "resolved")
    assert "invalid kvgate config" not in out
    kv = next(f for f in next(_hcm_filters(resolved)) if f["name"] == WASMPLUGIN_FILTER)["typed_config"]["config"]
    assert "allow_on_headers_stop_iteration" not in kv, "Istio cannot set it from a WasmPlugin"


def test_override_host_merge_conflicts_with_locality_lb(tmp_path):
    """The caveat documented in routing-override-host.yaml: with locality-weighted LB on the
    Service's cluster (a DestinationRule localityLbSetting) Envoy refuses the merged cluster."""
    cfg, ecds = kvgate_via_envoyfilter()
    model = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == MODEL_CLUSTER)
    model["common_lb_config"] = {"locality_weighted_lb_config": {}}
    path = tmp_path / "conflict.json"
    path.write_text(json.dumps(resolve_ecds(cfg, ecds)))
    r = subprocess.run([str(ENVOY_BIN), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "load_balancing_policy cannot be combined" in r.stdout + r.stderr


# --- real Envoys: requests go where kvgate says ---------------------------------------------------

def live_config(cfg_and_ecds, picked):
    """A runnable version of an Istio-equivalent config: kvgate told of one pod only (discovery and
    scraping off, which need a real mesh), so every request it routes must land on that pod."""
    cfg, ecds = cfg_and_ecds
    ecds = copy.deepcopy(ecds)
    res = ecds[FILTER_NAME]["typed_config"]["config"]
    plugin = json.loads(res["configuration"]["value"])
    plugin.update(debugHeaders=True, pods=[picked])
    plugin["discovery"]["adminCluster"] = ""
    plugin["metrics"]["cluster"] = ""
    res["configuration"]["value"] = json.dumps(plugin)
    return resolve_ecds(cfg, ecds)


@pytest.mark.parametrize("routing", ["routing-override-host.yaml", "routing-inferencepool.yaml"])
def test_requests_reach_the_pod_kvgate_picked(routing):
    with StubUpstream() as a, StubUpstream() as b:
        picked = f"127.0.0.1:{b.port}"
        built = kvgate_via_envoyfilter(routing=routing, upstreams=(("127.0.0.1", a.port), ("127.0.0.1", b.port)))
        with Envoy(live_config(built, picked), concurrency=2) as envoy:
            for i in range(6):
                body = dict(CHAT, messages=[{"role": "user", "content": f"question {i}: " + "why " * (5 + i)}])
                r = request(envoy.port, "POST", "/v1/chat/completions", body, timeout=20)
                assert r.status == 200, r.body
                assert r.headers.get("x-kvgate-pod") == picked, r.headers
            assert len(b.received) == 6 and not a.received, \
                f"{routing}: pod a got {len(a.received)}, b got {len(b.received)}; the override was not honoured"


def test_wasmplugin_without_stop_iteration_stalls_kvgate():
    """Why kvgate-envoyfilter.yaml exists: the filter Istio makes of wasmplugin.yaml has no
    allow_on_headers_stop_iteration, and then kvgate never sees the body of a request it waits on."""
    with StubUpstream() as up:
        cfg = istio_gateway_base(upstreams=(("127.0.0.1", up.port),))
        ecds = {}
        apply_envoy_filters(cfg, [one("routing-override-host.yaml")], ecds)
        insert_wasmplugin(cfg, one("wasmplugin.yaml"), ecds)
        plugin = one("wasmplugin.yaml")["spec"]["pluginConfig"]
        plugin = dict(plugin, pods=[f"127.0.0.1:{up.port}"], discovery=dict(plugin["discovery"], adminCluster=""),
                      metrics=dict(plugin["metrics"], cluster=""))
        ecds[WASMPLUGIN_FILTER]["typed_config"]["config"]["configuration"]["value"] = go_json(plugin)
        with Envoy(resolve_ecds(cfg, ecds), concurrency=1) as envoy:
            assert request(envoy.port, "GET", "/healthz").status == 200, "non-OpenAI requests pass"
            with pytest.raises(OSError):  # socket.timeout / TimeoutError
                request(envoy.port, "POST", "/v1/chat/completions", CHAT, timeout=2)
            assert not [r for r in up.received if r[0] == "/v1/chat/completions"]


# --- OCI image -----------------------------------------------------------------------------------

def run_oci(*args):
    r = subprocess.run([sys.executable, str(OCI_TOOL), *map(str, args)], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    return r


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    if not WASM.is_file():
        pytest.fail(f"{WASM} is missing: run ./build.sh build")
    module = WASM.read_bytes()  # read once: the file may be rebuilt while the tests run
    tmp = tmp_path_factory.mktemp("oci")
    wasm = tmp / "kvgate.wasm"
    wasm.write_bytes(module)
    results = []
    for run in ("a", "b"):
        r = run_oci(wasm, "--out", tmp / run, "--json")
        assert r.returncode == 0, r.stderr
        results.append(json.loads(r.stdout))
    return {"dir": tmp / "a", "again": tmp / "b", "module": module, "wasm": wasm, "result": results[0],
            "result_again": results[1]}


def blob(layout_dir, descriptor):
    algo, hexdigest = descriptor["digest"].split(":")
    assert algo == "sha256"
    data = (layout_dir / "blobs/sha256" / hexdigest).read_bytes()
    assert hashlib.sha256(data).hexdigest() == hexdigest, f"blob {hexdigest} does not match its name"
    assert len(data) == descriptor["size"], f"blob {hexdigest}: size {len(data)} != {descriptor['size']}"
    return data


def unpack(layout_dir):
    """index -> manifest -> config and layer, checking every descriptor, then the layer the way
    Istio's extractOCIStandardImage reads it."""
    assert json.loads((layout_dir / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((layout_dir / "index.json").read_text())
    assert index["schemaVersion"] == 2 and len(index["manifests"]) == 1
    mdesc = index["manifests"][0]
    assert mdesc["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    manifest_bytes = blob(layout_dir, mdesc)
    manifest = json.loads(manifest_bytes)
    assert manifest["schemaVersion"] == 2 and manifest["mediaType"] == mdesc["mediaType"]
    assert manifest["annotations"]["module.wasm.image/variant"] == "compat"
    assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    config = json.loads(blob(layout_dir, manifest["config"]))
    assert len(manifest["layers"]) == 1, "the compat variant has exactly one layer"
    ldesc = manifest["layers"][-1]
    assert ldesc["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
    layer = blob(layout_dir, ldesc)
    tar_bytes = gzip.decompress(layer)
    assert config["rootfs"] == {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(tar_bytes).hexdigest()]}
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        members = tar.getmembers()
        found = [m for m in members if os.path.basename(m.name) == "plugin.wasm"]
        assert len(found) == 1 and found[0].isfile()
        m = found[0]
        assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", ""), "tar entry must be reproducible"
        module = tar.extractfile(m).read()
    assert layer[4:8] == b"\0\0\0\0", "gzip mtime must be 0"
    return {"index": index, "manifest_digest": mdesc["digest"].split(":")[1], "module": module,
            "manifest_bytes": manifest_bytes}


def test_oci_layout_holds_exactly_the_built_module(layout):
    got = unpack(layout["dir"])
    assert got["module"] == layout["module"], "plugin.wasm differs from kvgate.wasm"
    assert got["module"][:4] == b"\0asm"
    res = layout["result"]
    assert res["manifestDigest"] == "sha256:" + got["manifest_digest"]
    assert res["moduleSha256"] == hashlib.sha256(layout["module"]).hexdigest()
    assert got["index"]["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"] == res["tag"]
    files = sorted(p.relative_to(layout["dir"]).as_posix() for p in layout["dir"].rglob("*") if p.is_file())
    assert len([f for f in files if f.startswith("blobs/")]) == 3, files  # manifest, config, layer only


def test_oci_layout_is_reproducible(layout):
    a, b = layout["dir"], layout["again"]
    fa = {p.relative_to(a).as_posix(): p.read_bytes() for p in a.rglob("*") if p.is_file()}
    fb = {p.relative_to(b).as_posix(): p.read_bytes() for p in b.rglob("*") if p.is_file()}
    assert fa == fb
    assert layout["result"]["manifestDigest"] == layout["result_again"]["manifestDigest"]


def test_oci_tool_refuses_what_is_not_wasm_or_not_a_layout(tmp_path):
    bad = tmp_path / "x.wasm"
    bad.write_bytes(b"not wasm")
    assert run_oci(bad, "--out", tmp_path / "o").returncode != 0
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "precious.txt").write_text("x")
    assert run_oci(WASM, "--out", keep).returncode != 0
    assert (keep / "precious.txt").exists()


def expected_sha256(doc, image_digest, module_sha):
    """By url scheme, as Istio compares: oci -> manifest digest, http(s) -> module sha256; file:// is
    not checked by Istio and records the module's sha256."""
    if doc["kind"] == "WasmPlugin":
        urls = [(doc["spec"]["url"], doc["spec"]["sha256"])]
    else:
        urls = []
        for p in doc["spec"]["configPatches"]:
            code = ((p["patch"].get("value") or {}).get("typed_config", {}).get("config", {})
                    .get("vm_config", {}).get("code", {}))
            if "remote" in code:
                urls.append((code["remote"]["http_uri"]["uri"], code["remote"]["sha256"]))
    return [(url, sha, image_digest if url.startswith("oci://") else module_sha) for url, sha in urls]


def test_checked_in_manifests_pin_a_module(layout):
    """Every manifest that fetches the module pins it by sha256, checked in as the placeholder
    (64 zeros, failing closed) rather than a digest that goes stale with every change to the
    module: `./build.sh oci` stamps copies in target/istio/ for the module a user actually pushes,
    which `test_stamp_rewrites_only_the_sha256_lines` checks brings them to this build's digests."""
    got = unpack(layout["dir"])
    module_sha = hashlib.sha256(layout["module"]).hexdigest()
    checked = 0
    for name, _, doc in all_docs():
        for url, sha, _ in expected_sha256(doc, got["manifest_digest"], module_sha):
            checked += 1
            assert sha == "0" * 64, f"{name}: sha256 for {url} should be the placeholder (zeros), not {sha!r}"
    assert checked == 3, "wasmplugin.yaml, wasmplugin-file.yaml and kvgate-envoyfilter.yaml pin the module"


def test_stamp_rewrites_only_the_sha256_lines(layout, tmp_path):
    got = unpack(layout["dir"])
    module_sha = hashlib.sha256(layout["module"]).hexdigest()
    copies = []
    for name in ["wasmplugin.yaml", "wasmplugin-file.yaml", "kvgate-envoyfilter.yaml"]:
        text = (ISTIO / name).read_text()
        stale = re.sub(r"(?m)^(\s*sha256:\s*)\S+", r'\g<1>""', text)
        (tmp_path / name).write_text(stale)
        copies.append((tmp_path / name, text))
    r = run_oci(layout["wasm"], "--out", tmp_path / "layout", "--check", *[p for p, _ in copies])
    assert r.returncode == 1 and "stale" in r.stderr
    r = run_oci(layout["wasm"], "--out", tmp_path / "layout", "--stamp", *[p for p, _ in copies])
    assert r.returncode == 0, r.stderr
    for path, original in copies:
        new = path.read_text()
        assert [a for a in original.splitlines() if "sha256:" not in a] == \
               [b for b in new.splitlines() if "sha256:" not in b], "only sha256 lines may change"
        doc = yaml.safe_load(new)
        for url, sha, want in expected_sha256(doc, got["manifest_digest"], module_sha):
            assert sha == want, (path.name, url)
    r = run_oci(layout["wasm"], "--check", *[p for p, _ in copies])
    assert r.returncode == 0, r.stderr
