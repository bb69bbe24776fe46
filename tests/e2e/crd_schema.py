"""Istio's CRD schemas as the Kubernetes API server applies them, for validating manifests offline:
the structural schemas of the generated bundle turned into JSON Schema (unknown fields rejected,
nullable, int32), the x-kubernetes list types, and the CEL rules those schemas carry as Python
predicates (a rule not listed fails validation rather than being skipped, so it never silently
weakens when the bundle changes), wrapped with what the API server checks of every object's
metadata."""

import json
import os
import re
import urllib.parse
from pathlib import Path

import jsonschema
import pytest
import yaml

from harness import ROOT

# Istio's generated CRD bundle (istio/api kubernetes/customresourcedefinitions.gen.yaml), kept in the
# workplace's shared/ folder beside the checkout.
CRDS = Path(os.environ.get("KVGATE_ISTIO_CRDS") or ROOT.parent / "shared/istio/customresourcedefinitions.gen.yaml")


def _has(obj, key):
    return isinstance(obj, dict) and key in obj


def _cel_is_url(s):
    # k8s CEL isURL: Go's url.ParseRequestURI, i.e. an absolute URI or an absolute path.
    if s.startswith("/"):
        return True
    parts = urllib.parse.urlsplit(s)
    return bool(parts.scheme) and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", parts.scheme) is not None


def _cel_url_scheme_ok(s, allowed=("", "http", "https", "file", "oci")):
    if _cel_is_url(s):
        return urllib.parse.urlsplit(s).scheme in allowed
    return _cel_is_url("http://" + s) and "http" in allowed


# The CEL rules (x-kubernetes-validations) in the WasmPlugin, TrafficExtension and EnvoyFilter
# schemas, as Python predicates over `self`. A rule not listed fails the test rather than being
# skipped, so validation never silently weakens when the bundle changes.
CEL_RULES = {
    '!self.contains("*")': lambda s: "*" not in s,
    'self.all(key, !key.contains("*"))': lambda s: all("*" not in k for k in s),
    "self.all(key, key.size() != 0)": lambda s: all(len(k) != 0 for k in s),
    "self.size() == 0": lambda s: len(s) == 0,
    "0 < self && self <= 65535": lambda s: 0 < s <= 65535,
    "has(self.wasm) != has(self.lua)": lambda s: _has(s, "wasm") != _has(s, "lua"),
    "(has(self.selector) ? 1 : 0) + (has(self.targetRefs) ? 1 : 0) <= 1":
        lambda s: _has(s, "selector") + _has(s, "targetRefs") <= 1,
    "(has(self.selector) ? 1 : 0) + (has(self.targetRef) ? 1 : 0) + (has(self.targetRefs) ? 1 : 0) <= 1":
        lambda s: _has(s, "selector") + _has(s, "targetRef") + _has(s, "targetRefs") <= 1,
    "(has(self.workloadSelector) ? 1 : 0) + (has(self.targetRefs) ? 1 : 0) <= 1":
        lambda s: _has(s, "workloadSelector") + _has(s, "targetRefs") <= 1,
    '(has(self.valueFrom) ? self.valueFrom : "") != "HOST" || !has(self.value)':
        lambda s: s.get("valueFrom", "") != "HOST" or "value" not in s,
    'has(self.context) ? ((self.context == "WAYPOINT") ? has(self.waypoint) : !has(self.waypoint)) : !has(self.waypoint)':
        lambda s: (_has(s, "waypoint") if s["context"] == "WAYPOINT" else not _has(s, "waypoint"))
        if _has(s, "context") else not _has(s, "waypoint"),
    'isURL(self) ? (url(self).getScheme() in ["", "http", "https", "oci", "file"]) : (isURL("http://" + self) && url("http://" + self).getScheme() in ["", "http", "https", "oci", "file"])':
        _cel_url_scheme_ok,
    'isURL(self) ? (url(self).getScheme() in ["", "http", "https", "file", "oci"]) : (isURL("http://" + self) && url("http://" + self).getScheme() in ["", "http", "https", "file", "oci"])':
        _cel_url_scheme_ok,
}


def _norm_rule(rule):
    return " ".join(rule.split())


CEL = {_norm_rule(k): v for k, v in CEL_RULES.items()}


def _x_validations(validator, rules, instance, schema):
    for r in rules:
        fn = CEL.get(_norm_rule(r["rule"]))
        if fn is None:
            yield jsonschema.ValidationError(f"CEL rule not implemented by the test: {r['rule']!r}")
        elif not fn(instance):
            yield jsonschema.ValidationError(f"{r.get('message', 'CEL rule failed')} ({r['rule']})")


def _x_list_type(validator, list_type, instance, schema):
    if not isinstance(instance, list):
        return
    if list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        seen = set()
        for item in instance:
            k = tuple(json.dumps(item.get(key), sort_keys=True) for key in keys)
            if k in seen:
                yield jsonschema.ValidationError(f"duplicate list-map key {dict(zip(keys, k))}")
            seen.add(k)
    elif list_type == "set":
        seen = set()
        for item in instance:
            k = json.dumps(item, sort_keys=True)
            if k in seen:
                yield jsonschema.ValidationError(f"duplicate item in a list-type=set: {k}")
            seen.add(k)


def _int32(validator, fmt, instance, schema):
    if fmt == "int32" and isinstance(instance, int) and not -2**31 <= instance < 2**31:
        yield jsonschema.ValidationError(f"{instance} is out of int32 range")


K8sValidator = jsonschema.validators.extend(jsonschema.Draft7Validator, {
    "x-kubernetes-validations": _x_validations,
    "x-kubernetes-list-type": _x_list_type,
    "format": _int32,
})


def structural_to_jsonschema(node):
    """An apiextensions structural schema as JSON Schema. `nullable` becomes a null type; an object
    with `properties` and no `x-kubernetes-preserve-unknown-fields` rejects other keys (the API
    server would prune them, silently losing configuration; kubectl's strict field validation
    rejects them). The x-kubernetes-* keywords left in place are checked by K8sValidator."""
    if isinstance(node, list):
        return [structural_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in ("properties", "patternProperties"):
            out[k] = {name: structural_to_jsonschema(s) for name, s in v.items()}
        elif k in ("items", "additionalProperties", "not", "anyOf", "oneOf", "allOf"):
            out[k] = structural_to_jsonschema(v)
        else:
            out[k] = v
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


DNS_SUBDOMAIN = r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_LABEL = r"^(?=.{1,63}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def crd_schema(api_version, kind):
    """The validator for kind in group/version: the CRD found by group and kind, the version
    asked for (which must be served), wrapped with what the API server checks of every object."""
    if not CRDS.is_file():
        pytest.fail(f"Istio CRD bundle not found at {CRDS} (set KVGATE_ISTIO_CRDS)")
    group, version = api_version.split("/")
    crds = [d for d in _crd_bundle() if d and d["spec"]["group"] == group and d["spec"]["names"]["kind"] == kind]
    assert len(crds) == 1, f"no CRD for {kind}.{group}"
    versions = {v["name"]: v for v in crds[0]["spec"]["versions"]}
    assert version in versions, f"{kind}.{group} has no version {version} (has {sorted(versions)})"
    v = versions[version]
    assert v["served"], f"{api_version} {kind} is not served"
    body = structural_to_jsonschema(v["schema"]["openAPIV3Schema"])
    schema = {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata"] + body.get("required", []),
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "pattern": DNS_SUBDOMAIN},
                    "namespace": {"type": "string", "pattern": DNS_LABEL},
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                },
            },
            **body["properties"],
        },
        "additionalProperties": False,
    }
    for k, val in body.items():
        if k not in ("type", "required", "properties", "additionalProperties"):
            schema[k] = val
    K8sValidator.check_schema(schema)
    return K8sValidator(schema)


_BUNDLE = []


def _crd_bundle():
    if not _BUNDLE:
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # 19k lines: the C loader if there
        _BUNDLE.extend(yaml.load_all(CRDS.read_text(), Loader=loader))
    return _BUNDLE


def schema_errors(doc):
    v = crd_schema(doc["apiVersion"], doc["kind"])
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in v.iter_errors(doc)]
