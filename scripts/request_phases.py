#!/usr/bin/env python3
"""Where one request's time goes inside Envoy, phase by phase, with kvgate, with the overhead
benchmark's floor filter (bench/floor) and with no filter at all: Envoy's own access log times each
request's phases (`%COMMON_DURATION(START:END:us)%`, in µs), so what kvgate adds shows in the phase
that runs its callbacks, not as one end-to-end figure. One client (the overhead benchmark's
latency cell: nothing else queues, so a phase is that request's own work), `kvgate-bench echo`
upstream, Envoy with 2 workers; fronts interleaved, a different order each round; the median of
every request's phase over the rounds.

    .venv/bin/python scripts/request_phases.py                          # 4 KB, 2 rounds
    .venv/bin/python scripts/request_phases.py --body-bytes 262144 --rounds 3
    .venv/bin/python scripts/request_phases.py --wasm /tmp/a.wasm,/tmp/b.wasm   # kvgate builds

The phases (Envoy's names for the points between them):
- `headers→body end` (DS_RX_BEG → DS_RX_END): the request's headers callback, and the body's
  arrival;
- `body end→upstream` (DS_RX_END → US_TX_BEG): the body callback (kvgate's parse, estimate, pick
  and admission) and the upstream request's start;
- `upstream` (US_TX_END → US_RX_BEG): the echo's answer, as Envoy sees it;
- `response` (US_RX_BEG → US_RX_END): the response headers and body callbacks;
- `to client` (US_RX_END → DS_TX_END), and `total` (DS_RX_BEG → DS_TX_END).
The end of a request (`on_done`: the release, calibration, stats) runs after `total` ends: it
shows only in the overhead benchmark's end-to-end latency. BENCHMARKS.md, 2026-11-29."""

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests/e2e"))

import run as bench  # noqa: E402
from harness import ROUND_ROBIN, WASM, Envoy, default_plugin_config, free_port  # noqa: E402

PHASES = [("headers→body end", "DS_RX_BEG:DS_RX_END"), ("body end→upstream", "DS_RX_END:US_TX_BEG"),
          ("upstream", "US_TX_END:US_RX_BEG"), ("response", "US_RX_BEG:US_RX_END"),
          ("to client", "US_RX_END:DS_TX_END"), ("total", "DS_RX_BEG:DS_TX_END")]
SECONDS = 3


def config(front, echo, log):
    """The front's Envoy configuration, its access log writing each request's phases to `log`."""
    if front == "envoy":
        cfg = bench.envoy_config(free_port(), free_port(), echo.endpoints, with_kvgate=False, lb_policy=ROUND_ROBIN)
    elif front == "floor":
        cfg = bench.envoy_config(free_port(), free_port(), echo.endpoints, wasm=str(bench.FLOOR_WASM))
    else:
        cfg = bench.envoy_config(free_port(), free_port(), echo.endpoints, default_plugin_config(), wasm=front)
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    line = " ".join(f"%COMMON_DURATION({points}:us)%" for _, points in PHASES) + "\n"
    hcm["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
        "path": str(log), "log_format": {"text_format_source": {"inline_string": line}}}}]
    return cfg


def phases(front, body_bytes, out):
    """Every measured request's phases (µs), in PHASES order; a phase Envoy did not time is None."""
    log = out / "access.log"
    log.unlink(missing_ok=True)
    with bench.Echo() as echo, Envoy(config(front, echo, log), concurrency=2) as envoy:
        base = ["--workload", "fixed", "--requests", 1, "--repeat", "--body-bytes", body_bytes, "--output-tokens", 1,
                "--arrival", "closed", "--concurrency", 1, "--no-stream", "--timeout", 30]
        warm = bench.run_bench(envoy.port, base + ["--max-duration", 1], out / "warmup", 60)["overall"]["requests"]
        bench.run_bench(envoy.port, base + ["--max-duration", SECONDS], out / "measured", 60)
    # Envoy has exited, so its access log is complete: one line a request, the warm-up's first.
    return [[None if v == "-" else int(v) for v in line.split()] for line in log.read_text().splitlines()[warm:]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--body-bytes", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--wasm", default=str(WASM), help="kvgate builds to measure, comma-separated")
    a = ap.parse_args()
    bench.ensure_binaries()
    out = ROOT / "target/request-phases"
    out.mkdir(parents=True, exist_ok=True)
    fronts = ["envoy", "floor"] + a.wasm.split(",")
    seen = {f: [[] for _ in PHASES] for f in fronts}
    for r in range(a.rounds):
        for front in fronts[r % len(fronts):] + fronts[:r % len(fronts)]:
            for request in phases(front, a.body_bytes, out):
                for i, v in enumerate(request[:len(PHASES)]):
                    if v is not None:
                        seen[front][i].append(v)
    median = {f: [statistics.median(v) if v else None for v in seen[f]] for f in fronts}
    print(f"{a.body_bytes}-byte body, one client, median µs of each phase over {a.rounds} round(s)")
    print(f"{'front':>24} " + " ".join(f"{name:>18}" for name, _ in PHASES) + "  requests")
    for f in fronts:
        cells = " ".join(f"{'–' if m is None else f'{m:.0f}':>18}" for m in median[f])
        print(f"{Path(f).name:>24} {cells}  {len(seen[f][-1])}")
    for f in fronts[2:]:
        diff = [None if m is None or b is None else m - b for m, b in zip(median[f], median["floor"])]
        cells = " ".join(f"{'–' if d is None else f'{d:+.0f}':>18}" for d in diff)
        print(f"{Path(f).name + ' − floor':>24} {cells}")


if __name__ == "__main__":
    main()
