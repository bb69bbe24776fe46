//! What kvgate's core costs per request, end to end, natively: one chat request's headers, body,
//! response headers, response body and end through `flow::Flow` on the in-memory host (`fake_host`,
//! shared data with Envoy's semantics), against pods that have been scraped, at 1, 2, 16 and 64
//! pods. It times the whole path the VM runs per request (routing, admission, the pick log,
//! metering, calibration), which `core_cost` (the body path alone) does not. Each phase is an
//! `#[inline(never)]` function (`phase_*`), so `scripts/core_cost_callgrind.sh --request` reads
//! the instructions of each from callgrind.
//!
//! ```text
//! cargo run --release --example request_cost                        # µs per request per pool size
//! cargo run --release --example request_cost -- --iters N [--pods P] # N requests, no timing
//! ```

// The in-memory host is built for native targets only (a dev-dependency feature).
#[cfg(not(target_arch = "wasm32"))]
mod native {
    use std::hint::black_box;
    use std::time::Instant;

    use kvgate::config::Config;
    use kvgate::flow::{Flow, Gate, RequestHead};
    use kvgate::pods::record::{self, Snapshot};
    use kvgate::store::fake_host::{FakeHost, FakeVm};
    use kvgate::store::interface::Store;

    /// A 4 KB chat body (about the overhead benchmark's).
    fn body(i: usize) -> Vec<u8> {
        let words = [
            "the", "cache", "prefix", "model", "token", "server", "route", "block",
        ];
        let text: Vec<&str> = (0..640).map(|k| words[(k * 7 + i) % words.len()]).collect();
        format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"You are helpful."}},{{"role":"user","content":"{}"}}],"max_tokens":64}}"#,
            text.join(" ")
        )
        .into_bytes()
    }

    const RESPONSE: &[u8] = br#"{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"length"}],"usage":{"prompt_tokens":700,"completion_tokens":64,"total_tokens":764}}"#;

    fn setup(pods: usize) -> (FakeHost, FakeVm, Gate, Vec<String>) {
        let names: Vec<String> = (0..pods)
            .map(|i| format!("10.0.{}.{}:8000", i / 250, i % 250 + 1))
            .collect();
        let config = serde_json::json!({ "pods": names, "debugHeaders": true });
        let config = Config::parse(config.to_string().as_bytes()).unwrap_or_default();
        let host = FakeHost::new();
        let vm = host.vm();
        let gate = Gate::new(config.clone(), &vm).unwrap_or_else(|e| {
            eprintln!("gate: {e:?}");
            std::process::exit(1)
        });
        for pod in &names {
            let snapshot = Snapshot {
                at_ms: vm.now_ms(),
                healthy: true,
                kv_usage: 0.1,
                capacity_tokens: 1 << 20,
                block_size: 16,
                preemptions: 0.0,
                ..Snapshot::default()
            };
            let _ = record::write_snapshot(&vm, pod, snapshot, 0, &config);
        }
        (host, vm, gate, names)
    }

    fn head(body: &[u8]) -> RequestHead<'static> {
        RequestHead {
            method: "POST",
            path: "/v1/chat/completions",
            content_type: Some("application/json"),
            content_length: Some(body.len() as u64),
            ..RequestHead::default()
        }
    }

    #[inline(never)]
    fn phase_request_headers(flow: &mut Flow, gate: &Gate, vm: &FakeVm, head: &RequestHead) {
        black_box(flow.on_request_headers(gate, vm, head));
    }

    #[inline(never)]
    fn phase_body(flow: &mut Flow, gate: &mut Gate, vm: &FakeVm, body: &[u8]) -> Option<String> {
        let d = flow.on_body(gate, vm, body);
        d.set
            .into_iter()
            .find(|(n, _)| n == "x-gateway-destination-endpoint")
            .map(|(_, v)| v)
    }

    #[inline(never)]
    fn phase_response_headers(flow: &mut Flow, gate: &mut Gate, vm: &FakeVm, pod: Option<&str>) {
        black_box(flow.on_response_headers(gate, vm, Some("application/json"), pod));
    }

    #[inline(never)]
    fn phase_response_body(flow: &mut Flow, gate: &mut Gate, vm: &FakeVm) {
        flow.on_response_body(gate, vm, RESPONSE);
    }

    #[inline(never)]
    fn phase_done(flow: &mut Flow, gate: &mut Gate, vm: &FakeVm) {
        flow.on_done(gate, vm);
    }

    /// What the shell then hands to Envoy's stats (one host call per name there).
    #[inline(never)]
    fn phase_stats(gate: &mut Gate) {
        black_box(gate.stats.drain().count());
    }

    fn one(gate: &mut Gate, vm: &FakeVm, body: &[u8]) {
        let mut flow = Flow::default();
        phase_request_headers(&mut flow, gate, vm, &head(body));
        let pod = phase_body(&mut flow, gate, vm, body);
        phase_response_headers(&mut flow, gate, vm, pod.as_deref());
        phase_response_body(&mut flow, gate, vm);
        phase_done(&mut flow, gate, vm);
        phase_stats(gate);
    }

    /// `requests` requests, the clock moving 1 ms every 100 (as in the timed runs).
    fn run(host: &FakeHost, vm: &FakeVm, gate: &mut Gate, bodies: &[Vec<u8>], requests: usize) {
        for i in 0..requests {
            one(gate, vm, &bodies[i % bodies.len()]);
            if i % 100 == 0 {
                host.advance_ms(1);
            }
        }
    }

    pub fn main() {
        let args: Vec<String> = std::env::args().collect();
        let arg = |name: &str| {
            args.iter()
                .position(|a| a == name)
                .and_then(|i| args.get(i + 1))
                .and_then(|n| n.parse::<usize>().ok())
        };
        let bodies: Vec<Vec<u8>> = (0..16).map(body).collect();
        if let Some(n) = arg("--iters") {
            let (host, vm, mut gate, _) = setup(arg("--pods").unwrap_or(2));
            run(&host, &vm, &mut gate, &bodies, n);
            return;
        }
        println!("{:>5} {:>14}", "pods", "µs per request");
        for pods in [1, 2, 16, 64] {
            let (host, vm, mut gate, _) = setup(pods);
            let n = 4000;
            run(&host, &vm, &mut gate, &bodies, 500);
            let t = Instant::now();
            run(&host, &vm, &mut gate, &bodies, n);
            println!(
                "{pods:>5} {:>14.1}",
                t.elapsed().as_secs_f64() * 1e6 / n as f64
            );
        }
    }
}

fn main() {
    #[cfg(not(target_arch = "wasm32"))]
    native::main();
}
