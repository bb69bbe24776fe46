//! What kvgate's core costs per request, end to end, natively: one chat request's headers, body,
//! response headers, response body and end through `flow::Flow` on the in-memory host (`fake_host`,
//! shared data with Envoy's semantics), against pods that have been scraped, at 1, 2, 16 and 64
//! pods. It times the whole path the VM runs per request (routing, admission, the pick log,
//! metering, calibration), which `core_cost` (the body path alone) does not, and under callgrind
//! (`valgrind --tool=callgrind target/release/examples/request_cost -- --iters 2000`) shows where
//! the instructions go.
//!
//! ```text
//! cargo run --release --example request_cost              # µs per request at each pool size
//! cargo run --release --example request_cost -- --iters N # N requests at 2 pods, no timing
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

    fn one(gate: &mut Gate, vm: &FakeVm, body: &[u8]) {
        let mut flow = Flow::default();
        let head = RequestHead {
            method: "POST",
            path: "/v1/chat/completions",
            content_type: Some("application/json"),
            content_length: Some(body.len() as u64),
            ..RequestHead::default()
        };
        black_box(flow.on_request_headers(gate, vm, &head));
        let d = flow.on_body(gate, vm, body);
        let pod = d
            .set
            .iter()
            .find(|(n, _)| n == "x-gateway-destination-endpoint")
            .map(|(_, v)| v.clone());
        black_box(flow.on_response_headers(gate, vm, Some("application/json"), pod.as_deref()));
        flow.on_response_body(gate, vm, RESPONSE);
        flow.on_done(gate, vm);
        black_box(gate.stats.drain().count());
    }

    pub fn main() {
        let args: Vec<String> = std::env::args().collect();
        let bodies: Vec<Vec<u8>> = (0..16).map(body).collect();
        if let Some(n) = args
            .iter()
            .position(|a| a == "--iters")
            .and_then(|i| args.get(i + 1))
            .and_then(|n| n.parse::<usize>().ok())
        {
            let (_host, vm, mut gate, _) = setup(2);
            for i in 0..n {
                one(&mut gate, &vm, &bodies[i % bodies.len()]);
            }
            return;
        }
        println!("{:>5} {:>14}", "pods", "µs per request");
        for pods in [1, 2, 16, 64] {
            let (host, vm, mut gate, _) = setup(pods);
            let n = 4000;
            for i in 0..500 {
                one(&mut gate, &vm, &bodies[i % bodies.len()]);
            }
            let t = Instant::now();
            for i in 0..n {
                one(&mut gate, &vm, &bodies[i % bodies.len()]);
                if i % 100 == 0 {
                    host.advance_ms(1);
                }
            }
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
