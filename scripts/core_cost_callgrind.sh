#!/usr/bin/env bash
# Instructions per request of kvgate's core, by phase, counted by callgrind: unlike timings, the
# counts do not move with whatever else runs on the machine, so they compare builds precisely.
#
# The body path (default): examples/core_cost in its untimed mode, one case per callgrind run,
# each phase function's inclusive count.
#
#   scripts/core_cost_callgrind.sh [CASE...]     default: every case (about a minute)
#
# The whole request (--request): examples/request_cost in its untimed mode, REQUESTS requests of
# 4 KB through headers, body (parse, estimate, admission, the pick), response headers, response
# body (metering), the end (release, pick log, calibration) and the stats they leave (what the
# shell hands to Envoy when no other request is open), and another worker replaying the
# request's pick and finish (`replay`: each other worker that routes pays it), one callgrind run
# per pool size, each phase's inclusive count per request; then the host calls of each phase (not
# a callgrind count: the example counts the store's calls and adds the shell's own,
# `request_cost --calls`).
#
#   scripts/core_cost_callgrind.sh --request [PODS...]   default: 2 and 16 pods
#   OPEN=N scripts/core_cost_callgrind.sh --request ...   with N other requests in flight over
#                                                         the pool throughout (default 0)
#   STREAM=N scripts/core_cost_callgrind.sh --request ... answers streamed as N chunks of a token
#                                                         (default 0: one JSON body)
#
#   KEEP=DIR scripts/core_cost_callgrind.sh ...  also keep the callgrind.out files in DIR
#
# The build is the release profile (what ships) with symbols and line tables kept, in a target
# directory of its own so that the ordinary release build is not rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET_DIR=target/core-cost-callgrind
ITERS=2
REQUESTS=${REQUESTS:-2000}
OUT=${KEEP:-$(mktemp -d)}
mkdir -p "$OUT"
[ -n "${KEEP:-}" ] || trap 'rm -rf "$OUT"' EXIT
build() {
    CARGO_PROFILE_RELEASE_STRIP=false CARGO_PROFILE_RELEASE_DEBUG=line-tables-only \
        cargo build -q --release --example "$1" --target-dir "$TARGET_DIR"
}

if [ "${1:-}" = --request ]; then
    shift
    PODS=("$@")
    [ ${#PODS[@]} -gt 0 ] || PODS=(2 16)
    build request_cost
    BIN=$TARGET_DIR/release/examples/request_cost
    printf '%-5s %10s %10s %10s %10s %10s %10s %10s %10s %10s\n' \
        pods headers body resp_hdrs resp_body log done replay stats total
    for pods in "${PODS[@]}"; do
        valgrind --tool=callgrind --callgrind-out-file="$OUT/request-$pods.out" "$BIN" \
            --iters "$REQUESTS" --pods "$pods" --open "${OPEN:-0}" --stream "${STREAM:-0}" 2>/dev/null
        callgrind_annotate --inclusive=yes --threshold=100 --auto=no "$OUT/request-$pods.out" \
            2>/dev/null |
            awk -v pods="$pods" -v n="$REQUESTS" '
                /request_cost::measure::phase_[a-z_]+ \[/ {
                    ir = $1; gsub(",", "", ir)
                    match($0, /request_cost::measure::phase_[a-z_]+/)
                    count[substr($0, RSTART + 29, RLENGTH - 29)] = ir / n
                }
                END {
                    split("request_headers body response_headers response_body log done replay stats", p)
                    printf "%-5s", pods
                    for (i = 1; i <= 8; i++) { printf " %10d", count[p[i]]; total += count[p[i]] }
                    printf " %10d\n", total
                }'
    done
    echo
    echo "host calls per request"
    "$BIN" --calls --open "${OPEN:-0}" --stream "${STREAM:-0}"
    exit 0
fi

CASES=("$@")
if [ ${#CASES[@]} -eq 0 ]; then
    CASES=(prose-4k prose-64k prose-256k code-4k code-64k code-256k cjk-4k cjk-64k cjk-256k)
fi
build core_cost
BIN=$TARGET_DIR/release/examples/core_cost

printf '%-10s %12s %12s %7s %12s %12s %12s   parse/est/hash\n' \
    case "serde Value" core ratio parse estimate hashes
for case in "${CASES[@]}"; do
    valgrind --tool=callgrind --callgrind-out-file="$OUT/$case.out" "$BIN" --iters "$ITERS" "$case" \
        2>/dev/null
    callgrind_annotate --inclusive=yes --threshold=100 --auto=no "$OUT/$case.out" 2>/dev/null |
        awk -v name="$case" -v iters="$ITERS" '
            # Lines read "1,234,567 (12.3%)  file:function [object]", largest first; a
            # function with inlined code also has lines per source file, without the object.
            /core_cost::phase_[a-z_]+ \[/ {
                ir = $1; gsub(",", "", ir)
                match($0, /core_cost::phase_[a-z_]+/)
                count[substr($0, RSTART + 17, RLENGTH - 17)] = ir / iters
            }
            END {
                parts = count["parse"] + count["estimate"] + count["hashes"]
                printf "%-10s %12d %12d %6.2fx %12d %12d %12d   %3.0f/%3.0f/%3.0f %%\n",
                    name, count["serde_value"], count["core"],
                    count["core"] / count["serde_value"], count["parse"],
                    count["estimate"], count["hashes"], 100 * count["parse"] / parts,
                    100 * count["estimate"] / parts, 100 * count["hashes"] / parts
            }'
done
