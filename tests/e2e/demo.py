#!/usr/bin/env python3
"""kvgate demo (`./build.sh demo`): a simulated pool of 8 vLLM pods (kvgate-sim), Envoy with kvgate
and Envoy with round robin in front of fresh pods each, the same short shared-prefix workload
(29 prompt groups, 2k-token system prompts, Poisson 60 req/s for 15 s) sent to both by
kvgate-bench; prints a comparison (prefix-cache hit rate, TTFT mean/p90, throughput, kvgate's
ratios) and writes the report and plots under results/<timestamp>/. About a minute in all.
Everything it starts is stopped when it ends, fails or is interrupted (Ctrl-C).

Extra arguments go to bench/run.py, e.g. `./build.sh demo --out /tmp/demo`.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import run  # noqa: E402  (bench/run.py)


def main():
    sys.argv = [sys.argv[0], "--demo", *sys.argv[1:]]
    data = run.main()
    out = Path(data["plots"][0]).name if data.get("plots") else None
    print("\nkvgate demo done." + (f" Plots: {out} and more in the results directory above." if out else ""))
    failed = [t for cells in data["results"].values() for t, c in cells.items() if "error" in c]
    return 1 if failed or not data["results"] else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted; everything the demo started was stopped", file=sys.stderr)
        sys.exit(130)
