//! What kvgate's core costs per request, end to end, natively: one chat request's headers, body,
//! response headers, response body and end through `flow::Flow` on the in-memory host (`fake_host`,
//! shared data with Envoy's semantics), against pods that have been scraped, at 1, 2, 16 and 64
//! pods. It times the whole path the VM runs per request (routing, admission, the pick log,
//! metering, calibration), which `core_cost` (the body path alone) does not. Each phase is an
//! `#[inline(never)]` function (`phase_*`), so `scripts/core_cost_callgrind.sh --request` reads
//! the instructions of each from callgrind.
//!
//! With it, `replay`: what another worker's VM then does with this request (Envoy runs one VM per
//! worker, and every worker that routes replays the others' picks and finishes from the pick
//! log, before its own next pick or on its tick): a second VM's catch-up after each request, its
//! reads included.
//!
//! Each phase runs on a store that stands for the shell's (`shell::host::HostStore`: the clock
//! read once per callback) and counts its calls; with the calls the shell itself makes around the
//! core in that callback (headers, bodies, the response's upstream address: see `shell_calls`),
//! that is the phase's host calls, what `kvgate.request.host_calls` counts in Envoy.
//!
//! A loaded pool has many requests in flight on each pod, and a pod's record holds an entry for
//! each, which every request reads, forecasts over and writes back: with `--open N`, N requests
//! are admitted over the pool first and stay in flight throughout.
//!
//! Chat is mostly streamed, and a streamed answer reaches the filter as a chunk per token, each a
//! response-body callback (metered; the entry grows at each block boundary): with `--stream N`,
//! the answer is N such chunks, as vLLM sends them, then its usage, instead of one JSON body.
//!
//! ```text
//! cargo run --release --example request_cost                        # µs per request per pool size
//! cargo run --release --example request_cost -- --iters N [--pods P] # N requests, no timing
//! cargo run --release --example request_cost -- --calls             # host calls per phase
//! cargo run --release --example request_cost -- --open 200          # with 200 others in flight
//! cargo run --release --example request_cost -- --stream 256        # answers of 256 streamed tokens
//! cargo run --release --example request_cost -- --kb 256            # request bodies of 256 KB
//! ```

// The in-memory host is a feature: a native build's dev-dependency turns it on; a wasm32 build
// asks for it (`--features fake-host`, as scripts/wasm_request_cost.sh does).
#[cfg(any(not(target_arch = "wasm32"), feature = "fake-host"))]
mod measure {
    use std::cell::Cell;
    use std::hint::black_box;
    use std::time::Instant;

    use kvgate::config::Config;
    use kvgate::flow::{Decision, Flow, Gate, RequestHead};
    use kvgate::pods::record::{self, Snapshot};
    use kvgate::store::fake_host::{FakeHost, FakeVm};
    use kvgate::store::interface::{Store, StoreError, Versioned};

    /// One callback's store, as the shell's: the clock read at most once, every call counted.
    struct Callback<'a> {
        vm: &'a FakeVm,
        now_us: Cell<Option<u64>>,
        calls: Cell<u64>,
    }

    impl<'a> Callback<'a> {
        fn new(vm: &'a FakeVm) -> Self {
            Callback {
                vm,
                now_us: Cell::new(None),
                calls: Cell::new(0),
            }
        }

        /// `n` more host calls in this callback.
        fn add(&self, n: u64) {
            self.calls.set(self.calls.get() + n);
        }
    }

    impl Store for Callback<'_> {
        fn get(&self, key: &str) -> Result<Versioned, StoreError> {
            self.add(1);
            self.vm.get(key)
        }

        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
            self.add(1);
            self.vm.set(key, value, cas)
        }

        fn register_queue(&self, name: &str) -> Result<u32, StoreError> {
            self.add(1);
            self.vm.register_queue(name)
        }

        fn resolve_queue(&self, name: &str) -> Result<Option<u32>, StoreError> {
            self.add(1);
            self.vm.resolve_queue(name)
        }

        fn enqueue(&self, queue: u32, message: &[u8]) -> Result<(), StoreError> {
            self.add(1);
            self.vm.enqueue(queue, message)
        }

        fn dequeue(&self, queue: u32) -> Result<Option<Vec<u8>>, StoreError> {
            self.add(1);
            self.vm.dequeue(queue)
        }

        fn now_us(&self) -> u64 {
            if let Some(now) = self.now_us.get() {
                return now;
            }
            self.add(1);
            let now = self.vm.now_us();
            self.now_us.set(Some(now));
            now
        }
    }

    /// A chat body of about `kb` KB (the overhead benchmark's are 4 and 256).
    fn body(i: usize, kb: usize) -> Vec<u8> {
        led_body("", i, kb)
    }

    /// `body(i, kb)` with its user message led by `lead` (a distinct one: a prompt of its own).
    fn led_body(lead: &str, i: usize, kb: usize) -> Vec<u8> {
        let words = [
            "the", "cache", "prefix", "model", "token", "server", "route", "block",
        ];
        // 160 of these words (and their spaces) are about a KB.
        let text: Vec<&str> = (0..160 * kb.max(1))
            .map(|k| words[(k * 7 + i) % words.len()])
            .collect();
        format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"You are helpful."}},{{"role":"user","content":"{lead}{}"}}],"max_tokens":64}}"#,
            text.join(" ")
        )
        .into_bytes()
    }

    const RESPONSE: &[u8] = br#"{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"length"}],"usage":{"prompt_tokens":700,"completion_tokens":64,"total_tokens":764}}"#;

    /// An answer as the response body's chunks: one JSON body, or `stream` server-sent events of
    /// a token each (vLLM's chat chunk), the last with the usage, then `[DONE]`.
    fn answer(stream: usize) -> (&'static str, Vec<Vec<u8>>) {
        if stream == 0 {
            return ("application/json", vec![RESPONSE.to_vec()]);
        }
        let chunk = |i: usize| {
            format!(
                "data: {{\"id\":\"chatcmpl-x\",\"object\":\"chat.completion.chunk\",\"created\":1764000000,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" tok{i}\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
            )
            .into_bytes()
        };
        let mut chunks: Vec<Vec<u8>> = (0..stream).map(chunk).collect();
        chunks.push(
            format!(
                "data: {{\"id\":\"chatcmpl-x\",\"object\":\"chat.completion.chunk\",\"created\":1764000000,\"model\":\"m\",\"choices\":[],\"usage\":{{\"prompt_tokens\":700,\"completion_tokens\":{stream},\"total_tokens\":{}}}}}\n\ndata: [DONE]\n\n",
                700 + stream
            )
            .into_bytes(),
        );
        ("text/event-stream", chunks)
    }

    /// Another worker's VM beside the request's, as `replay` needs it.
    struct Other {
        vm: FakeVm,
        gate: Gate,
    }

    /// The pool of `pods` pods, scraped, with `open` requests admitted over it that stay in
    /// flight (their entries in the pods' records).
    fn setup(pods: usize, open: usize) -> (FakeHost, FakeVm, Gate, Other) {
        let names: Vec<String> = (0..pods)
            .map(|i| format!("10.0.{}.{}:8000", i / 250, i % 250 + 1))
            .collect();
        let config = serde_json::json!({ "pods": names, "debugHeaders": true });
        let config = Config::parse(config.to_string().as_bytes()).unwrap_or_default();
        let host = FakeHost::new();
        let vm = host.vm();
        let mut gate = Gate::new(config.clone(), &vm).unwrap_or_else(|e| {
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
        // The request's VM holds the scrape lease, as one worker (or the main thread) does; the
        // other one has routed, so it replays.
        gate.on_tick(&vm);
        let other_vm = host.vm();
        let Ok(other_gate) = Gate::new(config, &other_vm) else {
            eprintln!("gate: the second VM did not start");
            std::process::exit(1)
        };
        let mut other = Other {
            vm: other_vm,
            gate: other_gate,
        };
        let mut flow = Flow::default();
        let b = body(0, 4);
        let _ = flow.on_request_headers(&mut other.gate, &other.vm, &head(&b));
        let _ = flow.on_body(&mut other.gate, &other.vm, &b);
        flow.on_done(&mut other.gate, &other.vm);
        for i in 0..open {
            // Prompts of their own, as a loaded pool's mostly are.
            let b = led_body(&format!("held {i}: "), i, 4);
            let mut held = Flow::default();
            let _ = held.on_request_headers(&mut gate, &vm, &head(&b));
            let _ = held.on_body(&mut gate, &vm, &b);
        }
        (host, vm, gate, other)
    }

    fn head(body: &[u8]) -> RequestHead<'static> {
        RequestHead {
            method: "POST",
            path: "/v1/chat/completions",
            content_type: Some("application/json"),
            content_length: Some(body.len() as u64),
            // The shell read every header and the client named no upstream (as clients do).
            no_upstream_headers: true,
            ..RequestHead::default()
        }
    }

    /// The phases, in order, as the callgrind script names them (`phase_<name>`).
    const PHASES: [&str; 8] = [
        "request_headers",
        "body",
        "response_headers",
        "response_body",
        "log",
        "done",
        "replay",
        "stats",
    ];

    /// Host calls the shell makes around the core in each callback (`shell::http`): the request
    /// headers read in one call and each header removed or set; the body read, and written back
    /// when rewritten; the response's `content-type` and upstream address read and each debug
    /// header set; each response chunk read; at the end, the sample of
    /// `kvgate.request.host_calls` itself.
    fn shell_calls(d: &Decision) -> u64 {
        (d.remove.len() + d.set.len() + usize::from(d.body.is_some())) as u64 + 1
    }

    #[inline(never)]
    fn phase_request_headers(
        flow: &mut Flow,
        gate: &mut Gate,
        store: &Callback,
        head: &RequestHead,
    ) {
        let d = flow.on_request_headers(gate, store, head);
        store.add(shell_calls(&d));
        black_box(d);
    }

    #[inline(never)]
    fn phase_body(
        flow: &mut Flow,
        gate: &mut Gate,
        store: &Callback,
        body: &[u8],
    ) -> Option<String> {
        let d = flow.on_body(gate, store, body);
        store.add(shell_calls(&d));
        d.set
            .into_iter()
            .find(|(n, _)| n == "x-gateway-destination-endpoint")
            .map(|(_, v)| v)
    }

    #[inline(never)]
    fn phase_response_headers(
        flow: &mut Flow,
        gate: &mut Gate,
        store: &Callback,
        pod: Option<&str>,
        content_type: &str,
    ) {
        let headers = flow.on_response_headers(gate, store, Some(content_type), pod);
        // content-type, the upstream address, content-encoding (absent), each header set.
        store.add(3 + headers.len() as u64);
        black_box(headers);
    }

    /// Every chunk of the answer, each a callback of its own (its own clock read).
    #[inline(never)]
    fn phase_response_body(
        flow: &mut Flow,
        gate: &mut Gate,
        vm: &FakeVm,
        chunks: &[Vec<u8>],
    ) -> u64 {
        chunks
            .iter()
            .map(|chunk| {
                let store = Callback::new(vm);
                flow.on_response_body(gate, &store, chunk);
                store.add(1);
                store.calls.get()
            })
            .sum()
    }

    /// Envoy logs the request (`on_log`): the access log's line, and the property it is set in
    /// (`accessLog`); the clock read only for a request still in the line.
    #[inline(never)]
    fn phase_log(flow: &mut Flow, store: &Callback) {
        let logged = flow.take_access_log(|| store.now_ms());
        store.add(u64::from(logged.is_some()));
        black_box(logged);
    }

    #[inline(never)]
    fn phase_done(flow: &mut Flow, gate: &mut Gate, store: &Callback) {
        flow.on_done(gate, store);
        store.now_ms();
        store.add(1);
    }

    /// What another worker then does with the request: before its own next pick (or on its
    /// tick, while it routes) it replays the request's pick and finish from the pick log into its
    /// replicas. Envoy's every other worker that routes pays this for every request.
    #[inline(never)]
    fn phase_replay(other: &mut Gate, store: &Callback) {
        black_box(other.catch_up(store)).ok();
    }

    /// What the shell then sends to Envoy's stats when no other request is open
    /// (`shell::host::flush_stats`: a host call per value, each metric defined on its first).
    #[inline(never)]
    fn phase_stats(gate: &mut Gate) -> u64 {
        let mut sent = 0;
        gate.stats.send(|s| {
            s.host_id.get_or_insert(0);
            black_box((s.name, s.kind, s.value));
            sent += 1;
        });
        sent
    }

    /// One request through every phase; the host calls of each.
    fn one(
        gate: &mut Gate,
        vm: &FakeVm,
        other: &mut Other,
        body: &[u8],
        answer: &(&str, Vec<Vec<u8>>),
    ) -> [u64; PHASES.len()] {
        let mut flow = Flow::default();
        let stores: [Callback; 6] = std::array::from_fn(|_| Callback::new(vm));
        let replay = Callback::new(&other.vm);
        phase_request_headers(&mut flow, gate, &stores[0], &head(body));
        let pod = phase_body(&mut flow, gate, &stores[1], body);
        phase_response_headers(&mut flow, gate, &stores[2], pod.as_deref(), answer.0);
        stores[3].add(phase_response_body(&mut flow, gate, vm, &answer.1));
        phase_log(&mut flow, &stores[4]);
        phase_done(&mut flow, gate, &stores[5]);
        phase_replay(&mut other.gate, &replay);
        let sent = phase_stats(gate);
        let mut calls = [0; PHASES.len()];
        for (c, s) in calls.iter_mut().zip(&stores) {
            *c = s.calls.get();
        }
        calls[6] = replay.calls.get();
        calls[7] = sent;
        calls
    }

    /// `requests` requests, the clock moving 1 ms every 100 (as in the timed runs); the host calls
    /// of each phase, summed.
    fn run(
        host: &FakeHost,
        vm: &FakeVm,
        gate: &mut Gate,
        other: &mut Other,
        bodies: &[Vec<u8>],
        answer: &(&str, Vec<Vec<u8>>),
        requests: usize,
    ) -> [u64; PHASES.len()] {
        let mut calls = [0; PHASES.len()];
        for i in 0..requests {
            let one = one(gate, vm, other, &bodies[i % bodies.len()], answer);
            calls.iter_mut().zip(one).for_each(|(c, n)| *c += n);
            if i % 100 == 0 {
                host.advance_ms(1);
            }
        }
        calls
    }

    pub fn main() {
        let args: Vec<String> = std::env::args().collect();
        let arg = |name: &str| {
            args.iter()
                .position(|a| a == name)
                .and_then(|i| args.get(i + 1))
                .and_then(|n| n.parse::<usize>().ok())
        };
        let kb = arg("--kb").unwrap_or(4);
        let bodies: Vec<Vec<u8>> = (0..16).map(|i| body(i, kb)).collect();
        let open = arg("--open").unwrap_or(0);
        let answer = answer(arg("--stream").unwrap_or(0));
        if let Some(n) = arg("--iters") {
            let (host, vm, mut gate, mut other) = setup(arg("--pods").unwrap_or(2), open);
            run(&host, &vm, &mut gate, &mut other, &bodies, &answer, n);
            return;
        }
        if args.iter().any(|a| a == "--calls") {
            let n = 1000;
            print!("{:>5}", "pods");
            PHASES.iter().for_each(|p| print!(" {p:>16}"));
            println!(" {:>16} {:>16}", "request", "with stats");
            for pods in [1, 2, 16, 64] {
                let (host, vm, mut gate, mut other) = setup(pods, open);
                run(&host, &vm, &mut gate, &mut other, &bodies, &answer, 100);
                let calls = run(&host, &vm, &mut gate, &mut other, &bodies, &answer, n);
                let per = |c: u64| c as f64 / n as f64;
                print!("{pods:>5}");
                calls.iter().for_each(|&c| print!(" {:>16.2}", per(c)));
                // The request's own VM: what `kvgate.request.host_calls` counts.
                let request: u64 = calls[..6].iter().sum();
                println!(" {:>16.2} {:>16.2}", per(request), per(request + calls[7]));
            }
            return;
        }
        println!("{:>5} {:>14}", "pods", "µs per request");
        for pods in [1, 2, 16, 64] {
            let (host, vm, mut gate, mut other) = setup(pods, open);
            let n = 4000;
            run(&host, &vm, &mut gate, &mut other, &bodies, &answer, 500);
            let t = Instant::now();
            run(&host, &vm, &mut gate, &mut other, &bodies, &answer, n);
            println!(
                "{pods:>5} {:>14.1}",
                t.elapsed().as_secs_f64() * 1e6 / n as f64
            );
        }
    }
}

fn main() {
    #[cfg(any(not(target_arch = "wasm32"), feature = "fake-host"))]
    measure::main();
}
