#!/usr/bin/env bash
# What kvgate's core costs per request in V8, the engine Envoy runs it in: examples/request_cost
# built for wasm32-wasip1 (the shipped release profile, function names kept) and run under Node
# (scripts/wasm_request_cost.mjs). Native timings and callgrind's counts rank the work; V8 runs
# some of it several times slower than native code and some about as fast, so what to cut is
# decided here.
#
#   scripts/wasm_request_cost.sh                 µs per request at 1, 2, 16 and 64 pods (as the
#                                                native example prints them)
#   scripts/wasm_request_cost.sh --profile [PODS] [REQUESTS]
#                                                where the time goes at PODS pods (default 2):
#                                                Node's sampling profiler over REQUESTS requests
#                                                (default 20000); each wasm function's share of
#                                                the samples, self and with what it calls
#   scripts/wasm_request_cost.sh --callgrind [PODS] [SHORT LONG]
#                                                x86 instructions per request that V8 runs (the
#                                                compiled wasm and the runtime under it), counted by
#                                                callgrind: Node run over SHORT and over LONG requests
#                                                (default 200 and 2200) at PODS pods (default 2), the
#                                                difference divided by LONG − SHORT, so start-up and
#                                                compilation cancel. Unlike timings, the count does not
#                                                move with what else runs on the machine (two runs
#                                                agree within 0.5 %), so it compares builds in V8
#                                                where a shared machine's timings swing by half
#
# Any other arguments go to the example (`--open N`, `--stream N`, `--kb N`, `--calls`).
#   KB=N scripts/wasm_request_cost.sh --profile|--callgrind ...   request bodies of about N KB
#                                                                  (default 4)
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET_DIR=target/wasm-request-cost
CARGO_PROFILE_RELEASE_STRIP=false cargo build -q --release --target wasm32-wasip1 \
    --example request_cost --features fake-host --target-dir "$TARGET_DIR"
WASM=$TARGET_DIR/wasm32-wasip1/release/examples/request_cost.wasm
RUNNER=scripts/wasm_request_cost.mjs
command -v node >/dev/null || { echo "needs Node.js 20 or later (apt-get install nodejs)" >&2; exit 1; }

if [ "${1:-}" = --callgrind ]; then
    command -v valgrind >/dev/null || { echo "needs valgrind (apt-get install valgrind)" >&2; exit 1; }
    PODS=${2:-2}
    SHORT=${3:-200}
    LONG=${4:-2200}
    OUT=$(mktemp -d)
    trap 'rm -rf "$OUT"' EXIT
    # One thread (no concurrent compilation or GC helpers, whose share would vary) and no
    # Liftoff, as Envoy runs V8; --smc-check=all, since V8 writes the code it then runs.
    count() {
        valgrind --tool=callgrind --smc-check=all --callgrind-out-file="$OUT/$1.out" \
            node --no-liftoff --single-threaded "$RUNNER" "$WASM" --iters "$1" --pods "$PODS" --kb "${KB:-4}" \
            >/dev/null 2>&1
        awk '/^totals:/ { print $2 }' "$OUT/$1.out"
    }
    short=$(count "$SHORT")
    long=$(count "$LONG")
    echo "pods $PODS: $(((long - short) / (LONG - SHORT))) instructions per request in V8"
    exit 0
fi
if [ "${1:-}" != --profile ]; then
    exec node "$RUNNER" "$WASM" "$@"
fi
PODS=${2:-2}
REQUESTS=${3:-20000}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
node --cpu-prof --cpu-prof-dir="$OUT" --cpu-prof-interval 50 "$RUNNER" "$WASM" \
    --iters "$REQUESTS" --pods "$PODS" --kb "${KB:-4}"
python3 - "$OUT"/*.cpuprofile <<'PY'
import json, re, sys
from collections import defaultdict

prof = json.load(open(sys.argv[1]))
nodes = {n["id"]: n for n in prof["nodes"]}
hits = defaultdict(int)
for s in prof["samples"]:
    hits[s] += 1
parent = {c: n["id"] for n in prof["nodes"] for c in n.get("children", [])}


ESCAPES = {"$LT$": "<", "$GT$": ">", "$u20$": " ", "$RF$": "&", "$C$": ",", "$BP$": "*",
           "$u7b$": "{", "$u7d$": "}", "$u27$": "'", "$u5b$": "[", "$u5d$": "]", "..": "::"}


def name(n):
    """A wasm function's name from the module's name section, Rust's legacy mangling undone
    (`_ZN6kvgate4flow4Flow7on_body17h…E` → `kvgate::flow::Flow::on_body`)."""
    f = (n["callFrame"]["functionName"] or "(anonymous)").lstrip("$")
    if not (f.startswith("_ZN") and f.endswith("E")):
        return f
    parts, rest = [], f[3:-1]
    while rest and rest[0].isdigit():
        digits = re.match(r"\d+", rest).group()
        size, rest = int(digits), rest[len(digits):]
        parts.append(rest[:size])
        rest = rest[size:]
    if parts and re.fullmatch(r"h[0-9a-f]{16}", parts[-1]):
        parts.pop()
    out = "::".join(p[1:] if p.startswith("_$") else p for p in parts)
    for code, text in ESCAPES.items():
        out = out.replace(code, text)
    return out


total = sum(hits.values())
self_t, incl = defaultdict(int), defaultdict(int)
for nid, k in hits.items():
    self_t[name(nodes[nid])] += k
    seen, at = set(), nid
    while at is not None:
        fn = name(nodes[at])
        if fn not in seen:
            seen.add(fn)
            incl[fn] += k
        at = parent.get(at)
print(f"{total} samples")
for title, table in (("self", self_t), ("with callees", incl)):
    print(f"\n{title}:")
    for fn, k in sorted(table.items(), key=lambda kv: -kv[1])[:40]:
        print(f"{100 * k / total:6.1f} %  {fn[:150]}")
PY
