//! The plugin configuration parser on arbitrary bytes, and a short life of a gate configured with
//! whatever parsed.
//!
//! Invariants: no panic; a config that parses re-serializes with serde_json and parses again to
//! an equal value (so what `on_configure` accepted can be logged, stored and reloaded as is);
//! and a config that parses can run: a gate built from it routes, queues, scrapes, streams and
//! releases requests, and lives through clock steps, without panicking (e.g. on a duration
//! whose deadline overflows).
#![no_main]

use kvgate::admission::admit::Reach;
use kvgate::admission::line::ANYWHERE;
use kvgate::config::Config;
use kvgate::flow::{Flow, Gate, RequestHead, Step};
use kvgate::pods::pool::{encode_pods, PODS_KEY};
use kvgate::pods::record;
use kvgate::pods::scrape::Target;
use kvgate::store::fake_host::FakeHost;
use kvgate::store::interface::Store;
use kvgate_fuzz::skip;
use libfuzzer_sys::fuzz_target;

const METRICS: &[u8] = b"vllm:num_requests_running{engine=\"0\"} 1.0\n\
vllm:num_requests_waiting{engine=\"0\"} 0.0\n\
vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n\
vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"64\"} 1.0\n";
/// The pod serves the model the flows ask for, and an adapter of it.
const MODELS: &[u8] = br#"{"object":"list","data":[{"id":"m","object":"model"},
{"id":"m-lora","object":"model","parent":"m"}]}"#;
const CLUSTERS: &[u8] = br#"{"cluster_statuses":[{"name":"models","host_statuses":[
{"address":{"socket_address":{"address":"10.0.0.9","port_value":8000}}}]}]}"#;

fn to_value(c: &Config) -> serde_json::Value {
    serde_json::to_value(c).unwrap_or(serde_json::Value::Null)
}

/// Equal, except that floats may differ in their last few bits (serde_json's default float
/// parsing is not exact; the `float-roundtrip` known-bug check).
fn same_up_to_ulps(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    use serde_json::Value::{Array, Number, Object};
    match (a, b) {
        (Number(x), Number(y)) if x.is_f64() || y.is_f64() => {
            let (x, y) = (
                x.as_f64().unwrap_or(f64::NAN),
                y.as_f64().unwrap_or(f64::NAN),
            );
            (x - y).abs() <= 1e-14 * x.abs().max(y.abs())
        }
        (Array(x), Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_up_to_ulps(x, y))
        }
        (Object(x), Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_up_to_ulps(v, w)))
        }
        _ => a == b,
    }
}

/// Durations so long that `now + duration` overflows are a known, reported bug; with
/// `KVGATE_FUZZ_SKIP=config-durations` such configs skip the run.
fn has_huge_duration(c: &Config) -> bool {
    [
        c.discovery.interval_ms,
        c.discovery.timeout_ms,
        c.metrics.interval_ms,
        c.metrics.timeout_ms,
        c.metrics.stale_after_ms,
        c.routing.prefix_ttl_ms,
        c.routing.request_ttl_ms,
        c.admission.max_wait_ms,
        c.admission.session_boost_ms,
    ]
    .iter()
    .any(|&ms| ms > 1 << 40)
}

fn run(config: Config) {
    let host = FakeHost::new();
    host.set_now_ms(1_700_000_000_000);
    let vm = host.vm();
    if config.pods.is_empty() {
        // As discovery would: the record first, then the pod set.
        record::ensure(&vm, "10.0.0.9:8000").expect("fake host");
        vm.set(PODS_KEY, &encode_pods(&["10.0.0.9:8000".into()]), None)
            .expect("fake host");
    }
    let mut gate = Gate::new(config, &vm).expect("fake host");
    let tick = |gate: &mut Gate| {
        for call in gate.on_tick(&vm) {
            let body = match call.target {
                Target::Pod(_) => METRICS,
                Target::Discovery => CLUSTERS,
                Target::Models(_) => MODELS,
                // The first call of a replicas' sync is a lease grant.
                Target::Etcd => br#"{"header":{},"ID":"7","TTL":"10"}"#.as_slice(),
                Target::Stored(_) => panic!("a gate's tick asked for a stored response"),
            };
            gate.on_call_response(&vm, &call.target, Some(200), body);
        }
    };
    tick(&mut gate);
    let paths = ["/v1/chat/completions", "/v1/completions", "/v1/models"];
    let mut flows = Vec::new();
    for (i, path) in paths.iter().cycle().take(5).enumerate() {
        let head = RequestHead {
            method: "POST",
            path,
            content_type: Some("application/json"),
            content_length: Some(100),
            tenant: Some(if i % 2 == 0 { "a" } else { "b" }),
            session: Some("s"),
            objective: Some("batch"),
            ..RequestHead::default()
        };
        let mut flow = Flow::default();
        let mut parked = None;
        if flow.on_request_headers(&mut gate, &vm, &head).step == Step::WaitForBody {
            let body = if path.contains("chat") {
                br#"{"model":"m","messages":[{"role":"user","content":"Hello there, how are you doing today?"}],"max_tokens":4000,"stream":true}"#.to_vec()
            } else {
                br#"{"model":"m","prompt":"Once upon a time","max_tokens":3000}"#.to_vec()
            };
            if flow.on_body_progress(&gate, body.len() as u64).is_none() {
                if let Step::Park(t) = flow.on_body(&mut gate, &vm, &body).step {
                    parked = Some(t);
                }
            }
        }
        flows.push((flow, parked));
    }
    for step in [100, 1_000, 60_000, 3_600_000] {
        host.advance_ms(step);
        tick(&mut gate);
        for t in gate.expired(&vm) {
            if let Some((f, p)) = flows.iter_mut().find(|(_, p)| *p == Some(t)) {
                if f.retry(&mut gate, &vm, (Reach::Any, ANYWHERE)).is_ok() {
                    *p = None;
                }
            }
        }
        while let Some((t, within)) = gate.next_parked(&vm, &[]) {
            let Some((f, p)) = flows.iter_mut().find(|(_, p)| *p == Some(t)) else {
                break;
            };
            if f.retry(&mut gate, &vm, (Reach::Any, within)).is_err() {
                break;
            }
            *p = None;
        }
        if let Some((f, _)) = flows
            .iter_mut()
            .find(|(f, p)| p.is_none() && !f.reads_response())
        {
            f.on_response_headers(
                &mut gate,
                &vm,
                Some("text/event-stream"),
                Some("10.0.0.9:8000"),
            );
            f.on_response_body(
                &mut gate,
                &vm,
                b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n",
            );
            f.on_response_body(
                &mut gate,
                &vm,
                b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":1}}\n\n",
            );
        }
    }
    for (f, _) in &mut flows {
        f.on_done(&mut gate, &vm);
    }
    gate.stats.send(|_| {});
}

fuzz_target!(|data: &[u8]| {
    let Ok(config) = Config::parse(data) else {
        return;
    };
    assert!(config.routing.block_chars(config.routing.block_tokens) >= 1);
    assert!(config.estimator.min_reservation_tokens <= config.estimator.max_reservation_tokens);
    let json = match serde_json::to_vec(&config) {
        Ok(j) => j,
        Err(e) => panic!("a parsed config does not serialize: {e}: {config:?}"),
    };
    match Config::parse(&json) {
        Ok(again) if skip("float-roundtrip") => assert!(
            same_up_to_ulps(&to_value(&again), &to_value(&config)),
            "round trip changed the config beyond float rounding: {}",
            String::from_utf8_lossy(&json)
        ),
        Ok(again) => assert_eq!(
            again,
            config,
            "round trip changed the config: {}",
            String::from_utf8_lossy(&json)
        ),
        Err(e) => panic!(
            "a parsed config's own serialization is refused: {e}: {}",
            String::from_utf8_lossy(&json)
        ),
    }
    if skip("config-durations") && has_huge_duration(&config) {
        return;
    }
    run(config);
});
