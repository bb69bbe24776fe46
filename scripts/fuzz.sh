#!/usr/bin/env bash
# Coverage-guided fuzzing of kvgate's host-agnostic core: cargo-fuzz (libFuzzer) on the nightly
# toolchain. Targets, invariants and past runs: docs/fuzzing.md.
#
#   scripts/fuzz.sh short                 every target for 25 s (about 2.5 minutes of fuzzing)
#   scripts/fuzz.sh long [seconds]        every target for [seconds] each (default 600)
#   scripts/fuzz.sh run TARGET [seconds]  one target (default 60 s)
#   scripts/fuzz.sh repro TARGET FILE     runs one input (e.g. a crash artifact) with a backtrace
#   scripts/fuzz.sh fmt TARGET FILE       prints a structured input (router, flow) as Rust Debug
#   scripts/fuzz.sh cmin [TARGET...]      minimizes grown corpora (libFuzzer -merge=1); a short
#                                         run otherwise spends its time replaying a large corpus
#   scripts/fuzz.sh build | list | setup
#
# Sets up what it needs, idempotently: a toolchain cargo-fuzz can drive and cargo-fuzz itself
# (pinned) in $KVGATE_TOOLS (default ~/.cache/kvgate-tools, shared with build.sh). The toolchain is
# nightly when rustup has it or can install it; otherwise stable with RUSTC_BOOTSTRAP=1, which
# accepts the -Z flags cargo-fuzz passes (its coverage instrumentation and libFuzzer build work
# on stable: checked with cargo-fuzz 0.13.2 and Rust 1.95). Any failure to set up, build or run
# is an error: a run that fuzzed nothing is never reported as a success.
# Environment:
#   FUZZ_SANITIZER    none (default: the core has no unsafe code; ~2x the executions) or address
#   KVGATE_FUZZ_SKIP  comma-separated checks for known, reported bugs to switch off, so a run can
#                     look past them (names in docs/fuzzing.md); every check is on by default
# Corpora grow in fuzz/corpus/<target> (git-ignored), seeded from fuzz/seeds/<target>; crashes
# and logs go to fuzz/artifacts/<target>/. Exits non-zero when any target crashed or ran nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
FUZZ=$ROOT/fuzz
TOOLS=${KVGATE_TOOLS:-$HOME/.cache/kvgate-tools}
CARGO_FUZZ_VERSION=0.13.2
SANITIZER=${FUZZ_SANITIZER:-none}
TRIPLE=$(rustc -vV | sed -n 's/^host: //p')
BIN=$FUZZ/target/$TRIPLE/release
TARGETS=(request response metrics config router flow decode)

log() { printf '\033[1m== %s\033[0m\n' "$*" >&2; }

max_len() {
    case $1 in
        metrics) echo 8192 ;;
        config) echo 2048 ;;
        *) echo 4096 ;;
    esac
}

# The toolchain `cargo +$TOOLCHAIN fuzz` runs with (set by setup).
TOOLCHAIN=nightly

setup() {
    if ! rustup toolchain list | grep -q '^nightly'; then
        log "installing the nightly toolchain (cargo-fuzz needs -Z flags and sanitizer coverage)"
        if ! rustup toolchain install nightly --profile minimal; then
            log "no nightly toolchain to be had: fuzzing on stable with RUSTC_BOOTSTRAP=1"
            TOOLCHAIN=stable
            export RUSTC_BOOTSTRAP=1
        fi
    fi
    if ! "$TOOLS/bin/cargo-fuzz" --version 2>/dev/null | grep -q " $CARGO_FUZZ_VERSION\$"; then
        log "installing cargo-fuzz $CARGO_FUZZ_VERSION into $TOOLS (once per machine, about a minute)"
        cargo install -q cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked --root "$TOOLS"
    fi
    export PATH="$TOOLS/bin:$PATH"
}

build() {
    setup
    log "building fuzz targets ($TOOLCHAIN, sanitizer: $SANITIZER)"
    local start=$SECONDS
    cargo +"$TOOLCHAIN" fuzz build --fuzz-dir "$FUZZ" -s "$SANITIZER" >&2
    log "built in $((SECONDS - start)) s"
}

check_target() {
    local t
    for t in "${TARGETS[@]}"; do [ "$t" = "$1" ] && return 0; done
    echo "unknown target '$1' (targets: ${TARGETS[*]})" >&2
    exit 2
}

# Runs one target for $2 seconds; appends "target runs exec/s corpus result [artifact]" to $SUMMARY.
fuzz_one() {
    local t=$1 secs=$2
    local corpus=$FUZZ/corpus/$t artifacts=$FUZZ/artifacts/$t
    mkdir -p "$corpus" "$artifacts"
    local logfile=$artifacts/last-run.log
    local args=(
        "$corpus"
        -max_total_time="$secs"
        -max_len="$(max_len "$t")"
        -timeout=10
        -rss_limit_mb=2048
        -print_final_stats=1
        -artifact_prefix="$artifacts/"
    )
    [ -d "$FUZZ/seeds/$t" ] && args+=("$FUZZ/seeds/$t")
    [ -f "$FUZZ/dicts/$t.dict" ] && args+=(-dict="$FUZZ/dicts/$t.dict")
    log "fuzzing $t for ${secs} s"
    local rc=0
    "$BIN/$t" "${args[@]}" >"$logfile" 2>&1 || rc=$?
    local runs rate size artifact result
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$logfile" | tail -1)
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$logfile" | tail -1)
    size=$(find "$corpus" -type f | wc -l)
    artifact=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$logfile" | tail -1)
    if [ "$rc" -eq 0 ] && [ "${runs:-0}" -gt 0 ]; then
        result=ok
    elif [ "$rc" -eq 0 ]; then
        # An exit without a single execution (a binary that cannot start its loop) fuzzed nothing.
        result=NORUN
        echo "    $t ran no input (log: $logfile)" >&2
    else
        result=CRASH
        # libFuzzer prints no final stats after a crash: count what it reported last.
        [ -n "$runs" ] || runs=$(grep -o '^#[0-9]*' "$logfile" | tail -1 | tr -d '#')
        grep -m1 -A2 'panicked at' "$logfile" | sed 's/^/    /' >&2 || true
        echo "    artifact: ${artifact:-none} (log: $logfile)" >&2
    fi
    printf '%-9s %12s %9s %7s  %-5s %s\n' "$t" "${runs:-?}" "${rate:-?}" "$size" "$result" "${artifact:-}" >>"$SUMMARY"
}

fuzz_all() {
    local secs=$1
    shift
    build
    SUMMARY=$(mktemp)
    trap 'rm -f "$SUMMARY"' EXIT
    local t
    for t in "$@"; do fuzz_one "$t" "$secs"; done
    echo
    printf '%-9s %12s %9s %7s  %-5s %s\n' target runs exec/s corpus result artifact
    cat "$SUMMARY"
    [ -n "${KVGATE_FUZZ_SKIP:-}" ] && echo "(checks switched off: $KVGATE_FUZZ_SKIP)"
    if grep -q ' CRASH ' "$SUMMARY"; then
        echo "crashes found: reproduce with scripts/fuzz.sh repro TARGET ARTIFACT" >&2
        return 1
    fi
    if grep -q ' NORUN ' "$SUMMARY"; then
        echo "a target ran no input: nothing was fuzzed there" >&2
        return 1
    fi
}

# Keeps only the inputs that add coverage.
cmin() {
    build
    local t
    for t in "$@"; do
        local corpus=$FUZZ/corpus/$t
        [ -d "$corpus" ] || continue
        local before tmp
        mkdir -p "$FUZZ/artifacts"
        before=$(find "$corpus" -type f | wc -l)
        tmp=$(mktemp -d "$FUZZ/corpus/.$t.XXXX")
        "$BIN/$t" -merge=1 -max_len="$(max_len "$t")" -timeout=10 -rss_limit_mb=2048 \
            "$tmp" "$corpus" >"$FUZZ/artifacts/$t-cmin.log" 2>&1
        rm -rf "$corpus"
        mv "$tmp" "$corpus"
        echo "$t: $before -> $(find "$corpus" -type f | wc -l) inputs"
    done
}

cmd=${1:-help}
shift || true
case "$cmd" in
    setup) setup ;;
    build) build ;;
    list) printf '%s\n' "${TARGETS[@]}" ;;
    cmin) if [ $# -gt 0 ]; then cmin "$@"; else cmin "${TARGETS[@]}"; fi ;;
    short) fuzz_all 25 "${TARGETS[@]}" ;;
    long) fuzz_all "${1:-600}" "${TARGETS[@]}" ;;
    run)
        check_target "${1:?target}"
        fuzz_all "${2:-60}" "$1"
        ;;
    repro)
        check_target "${1:?target}"
        [ -f "${2:?input file}" ] || { echo "no such file: $2" >&2; exit 2; }
        [ -x "$BIN/$1" ] || build
        RUST_BACKTRACE=1 "$BIN/$1" "$2"
        ;;
    fmt)
        check_target "${1:?target}"
        setup
        cargo +"$TOOLCHAIN" fuzz fmt --fuzz-dir "$FUZZ" -s "$SANITIZER" "$1" "${2:?input file}"
        ;;
    *)
        sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'
        [ "$cmd" = help ] || exit 2
        ;;
esac
