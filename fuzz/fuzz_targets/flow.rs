//! kvgate end to end, as the proxy-wasm shell drives it: several worker VMs, each with a `Gate`,
//! and HTTP streams (`Flow`s) going through request headers, body, admission (parking in the
//! shared line, woken by releases or the tick), response headers (possibly served by another
//! pod after Envoy's retries), response body chunks and done (possibly early, possibly twice),
//! plus ticks whose scrape and discovery calls get arbitrary answers, and clock steps. The
//! configuration itself is drawn from the input (always one `Config::parse` accepts).
//!
//! Parked requests are retried by `drive::run_line`, the shell's own line driver, through this
//! target's `Waiting`; a parked stream can vanish (reset, its on_done not delivered yet), which
//! the driver must release itself. With replicas on (etcd's calls answered arbitrarily), a
//! request naming a stored response no note names is held, and asked again on its worker's
//! ticks (`Flow::sought`) while notes arrive (`Op::Note`) and the clock moves; with a metrics
//! cluster, while the pods asked for it answer (`Op::Ask`), as arbitrarily.
//!
//! Invariants: nothing panics; the destination header is always stripped and, when set, names
//! only pods the deciding worker knows; local replies carry an expected status; pod records never
//! wrap; every routed stream in flight holds exactly one entry (unless its entry may have
//! expired, or a pod left the pool since it was routed) and there are no other entries; the line
//! stays ordered with unique tickets, all held by parked streams; once every stream is done,
//! every pod's entries, reserved tokens and active blocks are zero and the line is empty.
#![no_main]

use arbitrary::Arbitrary;
use kvgate::config::Config;
use kvgate::drive::{self, Waiting};
use kvgate::flow::{Decision, Flow, Gate, RequestHead, Step, DESTINATION_HEADER};
use kvgate::pods::pool::{decode_pods, PODS_KEY};
use kvgate::pods::scrape::{Call, Target};
use kvgate::routing::stored;
use kvgate::store::fake_host::{FakeHost, FakeVm};
use kvgate::store::interface::Store;
use kvgate_fuzz::{checked_pod, checked_queue, live, live_line, skip};
use libfuzzer_sys::fuzz_target;
use serde_json::json;
use std::collections::HashMap;

const POOL: [&str; 3] = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"];
const MODELS: [&str; 3] = ["llama", "qwen", ""];
const MAX_OPS: usize = 160;
const MAX_FLOWS: usize = 48;
/// Each word is one two-bit symbol, so prompts built from the same leading symbols share their
/// leading prompt blocks.
const WORDS: [&str; 4] = [
    "You are a helpful assistant. ",
    "Answer the question briefly. ",
    "def main():\n    return 42\n",
    "数据库连接池的配置说明。",
];

#[derive(Arbitrary, Debug)]
struct Knobs {
    vms: u8,
    static_pods: u8,
    discovery: bool,
    scrape: bool,
    admission: bool,
    budget: u8,
    /// The engines' seats stated (`admission.engineSeats`; else learned from the scrapes).
    engine_seats: u8,
    max_queue: u8,
    max_wait: u8,
    ttl: u8,
    debug: bool,
    passthrough: bool,
    calibrate: bool,
    stale_saturated: bool,
    temperature: bool,
    session_boost: bool,
    max_body: u8,
    backfill: u8,
    /// Gateway replicas sharing etcd (whose calls get arbitrary answers, as the scrapes'), and
    /// how long a request naming a stored response it has not heard of is held.
    replicas: bool,
    follow_up_wait: u8,
    /// How long such a request is held while the pods are asked for it (with a metrics cluster).
    stored_lookup: u8,
}

#[derive(Arbitrary, Debug)]
enum Body {
    Chat {
        model: u8,
        path: u32,
        len: u8,
        extra: String,
        max_tokens: Option<u16>,
        stream: bool,
        usage: bool,
        salt: Option<u8>,
        image: bool,
    },
    Completions {
        model: u8,
        path: u32,
        len: u8,
        tokens: Option<Vec<u32>>,
        max_tokens: Option<u16>,
        n: Option<u8>,
    },
    Responses {
        model: u8,
        path: u32,
        len: u8,
        instructions: Option<String>,
        max_output: Option<u16>,
        /// Names `resp_<n % 4>` as its `previous_response_id`.
        previous: Option<u8>,
    },
    Embeddings {
        model: u8,
        input: Vec<String>,
    },
    /// A rerank: one query paired with each document (none is a 400).
    Rerank {
        model: u8,
        query: String,
        documents: Vec<String>,
    },
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
enum Chunk {
    Deltas {
        n: u8,
        cut: u16,
    },
    Usage {
        prompt: u32,
        completion: u32,
        sse: bool,
    },
    Done,
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
enum Answer {
    Vllm {
        running: u16,
        waiting: u16,
        kv: u8,
        blocks: u32,
        block_size: u8,
    },
    Sglang {
        running: u16,
        waiting: u16,
        kv: u8,
        tokens: u32,
    },
    Clusters {
        mask: u8,
    },
    /// A pod's model list naming some of the models requests ask for: pods of different
    /// models make lines of their own.
    Models {
        mask: u8,
    },
    Refused,
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
enum Op {
    Request {
        worker: u8,
        path: u8,
        post: bool,
        json: bool,
        tenant: u8,
        objective: u8,
        session: u8,
        lie_length: bool,
        no_body: bool,
        body: Body,
    },
    Respond {
        flow: u8,
        sse: bool,
        served_by: u8,
    },
    Chunk {
        flow: u8,
        chunk: Chunk,
    },
    Done {
        flow: u8,
    },
    /// A parked stream is reset; its on_done comes later (a `Done`), if at all before the line
    /// moves.
    Vanish {
        flow: u8,
    },
    Tick {
        worker: u8,
    },
    Deliver,
    Answer {
        worker: u8,
        call: u8,
        status: u8,
        answer: Answer,
    },
    CallFailed {
        worker: u8,
        call: u8,
    },
    Advance {
        ms: u16,
    },
    AdvanceLong {
        s: u8,
    },
    /// A pod asked whether it stores the response a held stream names answers: a 404, a
    /// response `resp_<id % 4>` (the one named, or not), no answer, or garbage.
    Ask {
        flow: u8,
        ask: u8,
        answer: u8,
        id: u8,
    },
    /// A note of response `resp_<id % 4>` stored on a pod arrives, as another replica's would
    /// through the sync.
    Note {
        id: u8,
        pod: u8,
        tokens: u16,
    },
}

#[derive(Arbitrary, Debug)]
struct Input {
    knobs: Knobs,
    ops: Vec<Op>,
}

fn pick<T: Copy>(options: &[T], sel: u8) -> T {
    options[usize::from(sel) % options.len()]
}

fn config(k: &Knobs) -> Config {
    let pods: Vec<&str> = POOL
        .iter()
        .enumerate()
        .filter(|(i, _)| k.static_pods & (1 << i) != 0)
        .map(|(_, p)| *p)
        .collect();
    let mut objectives = serde_json::Map::new();
    objectives.insert("batch".into(), json!(-1));
    objectives.insert("critical".into(), json!(10));
    let json = json!({
        "pods": pods,
        "passthroughUnknown": k.passthrough,
        "debugHeaders": k.debug,
        "maxBodyBytes": pick(&[1u64 << 20, 256, 64], k.max_body),
        "discovery": {
            "adminCluster": if k.discovery { "envoy_admin" } else { "" },
            "modelCluster": "models",
        },
        "metrics": {
            "cluster": if k.scrape { "kvgate_metrics" } else { "" },
            "stalePolicy": if k.stale_saturated { "saturated" } else { "ignore" },
        },
        "routing": {
            "requestTtlMs": pick(&[660_000u64, 3_000, 604_800_000], k.ttl),
            "temperature": if k.temperature { 0.3 } else { 0.0 },
            "storedLookupMs": pick(&[500u64, 0, 1, 10_000], k.stored_lookup),
        },
        "admission": {
            "enabled": k.admission,
            "budgetTokens": pick(&[0u64, 300, 3_000, 1_000_000], k.budget),
            "engineSeats": pick(&[0u32, 1, 3], k.engine_seats),
            "maxQueue": pick(&[1_000u32, 0, 1, 4], k.max_queue),
            "maxWaitMs": pick(&[30_000u64, 1, 2_000, 604_800_000], k.max_wait),
            "objectives": objectives,
            "sessionBoostMs": if k.session_boost { 60_000 } else { 0 },
            "backfillPasses": pick(&[4u32, 0, 1], k.backfill),
            "cacheFirstPasses": pick(&[16u32, 0, 2], k.backfill),
        },
        "estimator": {
            "calibrate": k.calibrate,
            "minSamples": 2,
        },
        "etcd": if k.replicas {
            json!({
                "cluster": "etcd",
                "replicaId": "r0",
                "maxReplicas": 2,
                "followUpWaitMs": pick(&[300u64, 0, 1, 10_000], k.follow_up_wait),
            })
        } else {
            json!({})
        },
    });
    match Config::parse(json.to_string().as_bytes()) {
        Ok(c) => c,
        Err(e) => panic!("the target's own config is invalid: {e}"),
    }
}

fn text(path: u32, len: u8) -> String {
    (0..usize::from(len % 24))
        .map(|i| WORDS[((path >> (2 * (i % 16))) & 3) as usize])
        .collect()
}

fn body_bytes(b: &Body) -> (&'static str, Vec<u8>) {
    let model = |m: u8| MODELS[usize::from(m) % MODELS.len()];
    match b {
        Body::Chat {
            model: m,
            path,
            len,
            extra,
            max_tokens,
            stream,
            usage,
            salt,
            image,
        } => {
            let mut user: Vec<serde_json::Value> = vec![json!({"type": "text", "text": extra})];
            if *image {
                user.push(json!({"type": "image_url", "image_url": {"url": "data:x"}}));
            }
            let mut v = json!({
                "model": model(*m),
                "messages": [
                    {"role": "system", "content": text(*path, *len)},
                    {"role": "user", "content": user},
                ],
                "stream": stream,
                "stream_options": {"include_usage": usage},
            });
            if let Some(t) = max_tokens {
                v["max_tokens"] = json!(t);
            }
            if let Some(s) = salt {
                v["cache_salt"] = json!(format!("tenant-{}", s % 3));
            }
            ("/v1/chat/completions", v.to_string().into_bytes())
        }
        Body::Completions {
            model: m,
            path,
            len,
            tokens,
            max_tokens,
            n,
        } => {
            let prompt = match tokens {
                Some(t) => json!(t),
                None => json!(text(*path, *len)),
            };
            let mut v = json!({"model": model(*m), "prompt": prompt});
            if let Some(t) = max_tokens {
                v["max_tokens"] = json!(t);
            }
            if let Some(n) = n {
                v["n"] = json!(n);
            }
            ("/v1/completions", v.to_string().into_bytes())
        }
        Body::Responses {
            model: m,
            path,
            len,
            instructions,
            max_output,
            previous,
        } => {
            let mut v = json!({
                "model": model(*m),
                "input": [{"role": "user", "content": [{"type": "input_text", "text": text(*path, *len)}]}],
            });
            if let Some(i) = instructions {
                v["instructions"] = json!(i);
            }
            if let Some(t) = max_output {
                v["max_output_tokens"] = json!(t);
            }
            if let Some(p) = previous {
                v["previous_response_id"] = json!(format!("resp_{}", p % 4));
            }
            ("/v1/responses", v.to_string().into_bytes())
        }
        Body::Embeddings { model: m, input } => (
            "/v1/embeddings",
            json!({"model": model(*m), "input": input})
                .to_string()
                .into_bytes(),
        ),
        Body::Rerank {
            model: m,
            query,
            documents,
        } => (
            "/rerank",
            json!({"model": model(*m), "query": query, "documents": documents})
                .to_string()
                .into_bytes(),
        ),
        Body::Raw(bytes) => ("/v1/chat/completions", bytes.clone()),
    }
}

fn chunk_bytes(c: &Chunk, sse: bool) -> Vec<Vec<u8>> {
    match c {
        Chunk::Deltas { n, cut } => {
            let mut s = String::new();
            for i in 0..(n % 16) {
                if sse {
                    s.push_str(&format!(
                        "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i}\"}}}}]}}\n\n"
                    ));
                } else {
                    s.push_str(&format!("{{\"x\":{i}}}"));
                }
            }
            let at = usize::from(*cut) % (s.len() + 1);
            let (a, b) = s.as_bytes().split_at(at);
            vec![a.to_vec(), b.to_vec()]
        }
        Chunk::Usage {
            prompt,
            completion,
            sse: as_sse,
        } => {
            let usage = json!({"prompt_tokens": prompt, "completion_tokens": completion});
            if *as_sse {
                vec![format!("data: {}\n\n", json!({"choices": [], "usage": usage})).into_bytes()]
            } else {
                vec![json!({"choices": [], "usage": usage})
                    .to_string()
                    .into_bytes()]
            }
        }
        Chunk::Done => vec![b"data: [DONE]\n\n".to_vec()],
        Chunk::Raw(b) => vec![b.clone()],
    }
}

fn answer_bytes(a: &Answer) -> Vec<u8> {
    match a {
        Answer::Vllm {
            running,
            waiting,
            kv,
            blocks,
            block_size,
        } => format!(
            "# TYPE vllm:num_requests_running gauge\n\
             vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}.0\n\
             vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {waiting}.0\n\
             vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {}\n\
             vllm:cache_config_info{{block_size=\"{block_size}\",engine=\"0\",num_gpu_blocks=\"{blocks}\"}} 1.0\n",
            f64::from(*kv) / 250.0
        )
        .into_bytes(),
        Answer::Sglang {
            running,
            waiting,
            kv,
            tokens,
        } => format!(
            "sglang:num_running_reqs{{model_name=\"m\",tp_rank=\"0\"}} {running}.0\n\
             sglang:num_queue_reqs{{model_name=\"m\",tp_rank=\"0\"}} {waiting}.0\n\
             sglang:token_usage{{model_name=\"m\",tp_rank=\"0\"}} {}\n\
             sglang:max_total_num_tokens{{model_name=\"m\",tp_rank=\"0\"}} {tokens}.0\n",
            f64::from(*kv) / 250.0
        )
        .into_bytes(),
        Answer::Clusters { mask } => {
            let hosts: Vec<serde_json::Value> = POOL
                .iter()
                .enumerate()
                .filter(|(i, _)| mask & (1 << i) != 0)
                .map(|(_, p)| {
                    let (ip, port) = p.rsplit_once(':').unwrap_or((p, "0"));
                    json!({"address": {"socket_address": {"address": ip, "port_value": port.parse::<u16>().unwrap_or(0)}}})
                })
                .collect();
            json!({"cluster_statuses": [{"name": "models", "host_statuses": hosts}]})
                .to_string()
                .into_bytes()
        }
        Answer::Models { mask } => {
            let data: Vec<serde_json::Value> = MODELS
                .iter()
                .enumerate()
                .filter(|(i, m)| mask & (1 << i) != 0 && !m.is_empty())
                .map(|(_, m)| json!({"id": m, "object": "model", "owned_by": "vllm", "root": m, "parent": null}))
                .collect();
            json!({"object": "list", "data": data})
                .to_string()
                .into_bytes()
        }
        Answer::Refused => b"upstream connect error or disconnect/reset before headers".to_vec(),
        Answer::Raw(b) => b.clone(),
    }
}

#[derive(Debug, Clone, PartialEq)]
enum State {
    /// Forwarded upstream; `routed` when kvgate picked the pod.
    Forwarded {
        routed: bool,
    },
    Parked(u64),
    /// Held for another replica's note of the stored response it names.
    Held,
    Responding {
        routed: bool,
    },
    Replied,
    Done,
}

struct Stream {
    worker: usize,
    flow: Flow,
    state: State,
    pod: Option<String>,
    /// Reset by the client: the host can no longer switch to it.
    gone: bool,
    /// When kvgate routed it: (clock, op number).
    routed_at: Option<(u64, usize)>,
    /// While held: the pods asked for the stored response it names, not yet answered.
    asks: Vec<String>,
}

struct Worker {
    vm: FakeVm,
    gate: Gate,
    /// The shell's map of parked tickets to their streams.
    parked: HashMap<u64, usize>,
    calls: Vec<Call>,
}

struct World {
    host: FakeHost,
    workers: Vec<Worker>,
    streams: Vec<Stream>,
    ttl_ms: u64,
    backfill_passes: u32,
    /// The op being applied, and the last op after which a pod had left the published pool (its
    /// record, entries included, is blanked).
    op: usize,
    pod_left_at: Option<usize>,
}

/// This worker's parked streams as the shell keeps them, for `drive::run_line`. Decisions that
/// take a request out of the line are collected, to be checked and applied once it returns.
struct Line<'a> {
    parked: &'a mut HashMap<u64, usize>,
    streams: &'a mut [Stream],
    resumed: Vec<(usize, Decision)>,
}

impl Waiting for Line<'_> {
    type Stream = usize;

    fn find(&self, ticket: u64) -> Option<usize> {
        self.parked.get(&ticket).copied()
    }

    fn unpark(&mut self, ticket: u64) {
        self.parked.remove(&ticket);
    }

    fn enter(&mut self, &s: &usize) -> bool {
        !self.streams[s].gone
    }

    fn with_flow<R>(&mut self, &s: &usize, f: impl FnOnce(&mut Flow) -> R) -> R {
        f(&mut self.streams[s].flow)
    }

    fn resume(&mut self, &s: &usize, decision: Decision) {
        self.resumed.push((s, decision));
    }
}

fn published_pods(store: &dyn Store) -> Vec<String> {
    store
        .get(PODS_KEY)
        .ok()
        .and_then(|v| v.value)
        .and_then(|b| decode_pods(&b))
        .unwrap_or_default()
}

fn check_decision(d: &Decision, known_pods: &[String]) {
    for (name, value) in &d.set {
        if name == DESTINATION_HEADER {
            assert!(!value.is_empty(), "empty destination");
            for pod in value.split(',') {
                assert!(
                    known_pods.iter().any(|p| p == pod),
                    "destination names {pod:?}, not one of the worker's pods {known_pods:?}"
                );
            }
        }
    }
    if let Step::Reply(r) = &d.step {
        let body: serde_json::Value = serde_json::from_slice(&r.body).expect("reply body is JSON");
        if r.status == 200 {
            // The gateway's own model list (`models::listing`): the list, or one model's entry.
            assert!(
                matches!(body["object"].as_str(), Some("list" | "model")),
                "a local 200 is the model list: {body}"
            );
        } else {
            assert!(
                [400, 404, 413, 415, 429, 503].contains(&r.status),
                "unexpected local reply {}",
                r.status
            );
        }
    }
}

impl World {
    /// Applies a decision to a stream, as `shell::http::apply` would.
    fn take(&mut self, s: usize, d: Decision) {
        let w = self.streams[s].worker;
        check_decision(&d, self.workers[w].gate.pods());
        // (A stored response's retrieval, sent to the pod storing it, holds no entry: kvgate
        // decided no admission for it.)
        let routed = d.set.iter().any(|(n, _)| n == DESTINATION_HEADER)
            && self.streams[s].flow.reads_response_headers();
        self.streams[s].state = match d.step {
            Step::Forward => {
                self.streams[s].pod = d
                    .set
                    .iter()
                    .find(|(n, _)| n == DESTINATION_HEADER)
                    .and_then(|(_, v)| v.split(',').next().map(str::to_string));
                if routed {
                    self.streams[s].routed_at = Some((self.host.now_ms(), self.op));
                }
                State::Forwarded { routed }
            }
            Step::Park(ticket) => {
                assert!(
                    self.workers[w].parked.insert(ticket, s).is_none(),
                    "ticket {ticket} parked twice"
                );
                State::Parked(ticket)
            }
            Step::Reply(_) => State::Replied,
            Step::WaitForBody => panic!("WaitForBody after the whole body"),
            Step::Hold => {
                let known = self.workers[w].gate.pods();
                let asks = self.streams[s].flow.take_asks(None);
                self.streams[s].asks = asks
                    .into_iter()
                    .map(|c| match c.target {
                        Target::Stored(pod) if known.contains(&pod) => pod,
                        other => panic!("asked {other:?}, not a known pod"),
                    })
                    .collect();
                State::Held
            }
        };
    }

    /// A pod answers a held stream's ask, in the stream's own context as the shell's does.
    fn answer_ask(&mut self, s: usize, ask: usize, answer: u8, id: u8) {
        let st = &mut self.streams[s];
        if st.asks.is_empty() || st.gone {
            return;
        }
        let pod = st.asks.swap_remove(ask % st.asks.len());
        let found = format!(
            r#"{{"id":"resp_{}","object":"response","usage":{{"input_tokens":{id},"output_tokens":3}}}}"#,
            id % 4
        );
        let (status, body) = match answer % 4 {
            0 => (Some(404), br#"{"error":{"message":"not found"}}"#.to_vec()),
            1 => (Some(200), found.into_bytes()),
            2 => (None, Vec::new()),
            _ => (Some(200), b"\xff{".to_vec()),
        };
        let Worker { vm, gate, .. } = &mut self.workers[st.worker];
        if let Some(d) = st.flow.answered(gate, vm, &pod, status, &body) {
            assert_eq!(st.state, State::Held, "decided while not held");
            assert_ne!(d.step, Step::Hold, "held again");
            assert!(d.body.is_none(), "a body set after its callback");
            self.take(s, d);
        }
    }

    /// Worker `w`'s tick asks its held streams again, as the shell's root does (one reset is
    /// left to its on_done).
    fn run_held(&mut self, w: usize) {
        for s in 0..self.streams.len() {
            let st = &mut self.streams[s];
            if st.worker != w || st.state != State::Held || st.gone {
                continue;
            }
            let Worker { vm, gate, .. } = &mut self.workers[w];
            if let Some(d) = self.streams[s].flow.sought(gate, vm) {
                assert_ne!(d.step, Step::Hold, "held again");
                assert!(d.body.is_none(), "a body set after its callback");
                self.take(s, d);
            }
        }
    }

    /// The line moved on worker `w`: the shell's driver decides, the streams carry it out.
    fn run_line(&mut self, w: usize) {
        let Worker {
            vm, gate, parked, ..
        } = &mut self.workers[w];
        let mut line = Line {
            parked,
            streams: &mut self.streams,
            resumed: Vec::new(),
        };
        drive::run_line(gate, vm, &mut line);
        for (s, d) in line.resumed {
            assert!(
                matches!(self.streams[s].state, State::Parked(_)),
                "resumed a stream that was not parked"
            );
            assert!(!self.streams[s].gone, "resumed a stream that is gone");
            self.take(s, d);
        }
    }

    fn stream(&self, sel: u8, ok: impl Fn(&State) -> bool) -> Option<usize> {
        let c: Vec<usize> = (0..self.streams.len())
            .filter(|&i| ok(&self.streams[i].state))
            .collect();
        (!c.is_empty()).then(|| c[usize::from(sel) % c.len()])
    }

    fn done(&mut self, s: usize) {
        let w = self.streams[s].worker;
        self.workers[w].parked.retain(|_, &mut v| v != s);
        let Worker { vm, gate, .. } = &mut self.workers[w];
        self.streams[s].flow.on_done(gate, vm);
        self.streams[s].state = State::Done;
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::Request {
                worker,
                path,
                post,
                json: is_json,
                tenant,
                objective,
                session,
                lie_length,
                no_body,
                body,
            } => {
                if self.streams.len() >= MAX_FLOWS {
                    return;
                }
                let w = usize::from(*worker) % self.workers.len();
                let (api_path, bytes) = body_bytes(body);
                let paths = [
                    api_path,
                    "/openai/v1/chat/completions?x=1",
                    "/v1/models",
                    "/v1/completions/",
                    "/v1/responses/resp_1",
                    "/v1/responses/resp_2/cancel",
                    "/tokenize",
                    "/pooling",
                    "/classify",
                    "/v1/score",
                ];
                let tenant = format!("tenant-{}", tenant % 3);
                let session_id = format!("s{}", session % 4);
                let head = RequestHead {
                    method: if *post { "POST" } else { "GET" },
                    path: pick(&paths, *path),
                    content_type: Some(if *is_json {
                        "application/json"
                    } else {
                        "text/plain"
                    }),
                    content_length: Some(if *lie_length { 1 } else { bytes.len() as u64 }),
                    end_of_stream: *no_body,
                    accept: None,
                    objective: [None, Some("batch"), Some("critical"), Some("unknown")]
                        [usize::from(*objective) % 4],
                    priority: None,
                    tenant: Some(&tenant),
                    session: (*session % 5 != 0).then_some(session_id.as_str()),
                    // Now and then the request's own time-to-first-token objective: its wait
                    // bounded, its ticket's deadline sooner than `maxWaitMs`.
                    ttft_objective: [None, None, Some("300"), Some("2500.5"), Some("soon")]
                        [usize::from(*objective / 20) % 5],
                    // Tenants' caches kept apart by the engine now and then (an empty salt is
                    // none): the budget holds whether or not prompts share blocks.
                    cache_salt: [None, Some(""), Some(tenant.as_str())][usize::from(*session) % 3],
                    // Now and then a body the client compressed (refused before it is read).
                    content_encoding: [None, None, None, Some("identity"), Some("gzip")]
                        [usize::from(*objective / 4) % 5],
                    // As if the client sent them: then they are stripped, whatever else happens.
                    no_upstream_headers: false,
                };
                let mut flow = Flow::default();
                let worker = &mut self.workers[w];
                let d = flow.on_request_headers(&mut worker.gate, &worker.vm, &head);
                assert!(
                    d.remove.contains(&DESTINATION_HEADER),
                    "destination not stripped"
                );
                let s = self.streams.len();
                self.streams.push(Stream {
                    worker: w,
                    flow,
                    state: State::Replied,
                    pod: None,
                    gone: false,
                    routed_at: None,
                    asks: Vec::new(),
                });
                match d.step {
                    Step::WaitForBody => {
                        assert!(self.streams[s].flow.wants_body());
                        let progress = self.streams[s]
                            .flow
                            .on_body_progress(&self.workers[w].gate, bytes.len() as u64);
                        let d = match progress {
                            Some(d) => d,
                            None => {
                                let Worker { vm, gate, .. } = &mut self.workers[w];
                                self.streams[s].flow.on_body(gate, vm, &bytes)
                            }
                        };
                        self.take(s, d);
                    }
                    _ => self.take(s, d),
                }
            }
            Op::Respond {
                flow,
                sse,
                served_by,
            } => {
                let Some(s) = self.stream(*flow, |st| matches!(st, State::Forwarded { .. })) else {
                    return;
                };
                let State::Forwarded { routed } = self.streams[s].state else {
                    return;
                };
                let w = self.streams[s].worker;
                let served = match served_by % 4 {
                    0 => self.streams[s].pod.clone(),
                    1 => None,
                    2 => Some(POOL[usize::from(*served_by / 4) % POOL.len()].to_string()),
                    _ => Some("192.0.2.1:80".to_string()),
                };
                let ct = if *sse {
                    "text/event-stream"
                } else {
                    "application/json"
                };
                let Worker { vm, gate, .. } = &mut self.workers[w];
                let headers =
                    self.streams[s]
                        .flow
                        .on_response_headers(gate, vm, Some(ct), served.as_deref());
                if let Some((_, cost)) = headers.iter().find(|(n, _)| *n == "x-kvgate-cost") {
                    let cost: u64 = cost.parse().expect("x-kvgate-cost is a number");
                    let e = &gate.config.estimator;
                    assert!((e.min_reservation_tokens..=e.max_reservation_tokens).contains(&cost));
                }
                // An answer now and then comes compressed (a compressor after kvgate): in a
                // coding not decoded, grown on the tick from here, its body no longer read; as
                // gzip, decoded, so its plain chunks break it and it is grown on the tick from
                // its first.
                if *served_by >= 224 {
                    let coding = if *served_by >= 240 { "br" } else { "gzip" };
                    self.streams[s].flow.on_response_encoded(gate, coding);
                }
                self.streams[s].state = State::Responding { routed };
            }
            Op::Chunk { flow, chunk } => {
                let Some(s) = self.stream(*flow, |st| matches!(st, State::Responding { .. }))
                else {
                    return;
                };
                let w = self.streams[s].worker;
                let sse = self.streams[s].flow.reads_response();
                let Worker { vm, gate, .. } = &mut self.workers[w];
                for piece in chunk_bytes(chunk, sse) {
                    self.streams[s].flow.on_response_body(gate, vm, &piece);
                }
            }
            Op::Done { flow } => {
                if let Some(s) = self.stream(*flow, |_| true) {
                    self.done(s);
                }
            }
            Op::Vanish { flow } => {
                if let Some(s) =
                    self.stream(*flow, |st| matches!(st, State::Parked(_) | State::Held))
                {
                    self.streams[s].gone = true;
                }
            }
            Op::Tick { worker } => {
                let w = usize::from(*worker) % self.workers.len();
                let Worker {
                    vm, gate, calls, ..
                } = &mut self.workers[w];
                let new = gate.on_tick(vm);
                calls.extend(new);
                calls.truncate(32);
                // The shell's tick grows the entries of its answers that are not metered.
                for st in self.streams.iter_mut().filter(|st| st.worker == w) {
                    if st.flow.answers_unseen() {
                        st.flow.on_tick(gate, vm);
                    }
                }
                self.run_held(w);
                self.run_line(w);
            }
            Op::Deliver => {
                for w in 0..self.workers.len() {
                    if !self.workers[w].vm.take_notifications().is_empty() {
                        self.run_line(w);
                    }
                }
            }
            Op::Answer {
                worker,
                call,
                status,
                answer,
            } => {
                let w = usize::from(*worker) % self.workers.len();
                let Worker {
                    vm, gate, calls, ..
                } = &mut self.workers[w];
                if calls.is_empty() {
                    return;
                }
                let c = calls.remove(usize::from(*call) % calls.len());
                let status = [Some(200), Some(503), None, Some(404)][usize::from(*status) % 4];
                let body = answer_bytes(answer);
                gate.on_call_response(vm, &c.target, status, &body);
                if let Target::Pod(pod) = &c.target {
                    assert!(POOL.contains(&pod.as_str()), "scraped unknown pod {pod}");
                }
            }
            Op::CallFailed { worker, call } => {
                let w = usize::from(*worker) % self.workers.len();
                let Worker {
                    vm, gate, calls, ..
                } = &mut self.workers[w];
                if calls.is_empty() {
                    return;
                }
                let c = calls.remove(usize::from(*call) % calls.len());
                gate.on_call_failed(vm, &c.target);
            }
            Op::Advance { ms } => self.host.advance_ms(u64::from(*ms)),
            Op::AdvanceLong { s } => self.host.advance_ms(u64::from(*s) * 1_000),
            Op::Ask {
                flow,
                ask,
                answer,
                id,
            } => {
                if let Some(s) = self.stream(*flow, |st| *st == State::Held) {
                    self.answer_ask(s, usize::from(*ask), *answer, *id);
                }
            }
            Op::Note { id, pod, tokens } => {
                let id = stored::id_hash(&format!("resp_{}", id % 4));
                let pod = POOL[usize::from(*pod) % POOL.len()];
                let vm = &self.workers[0].vm;
                stored::remember(vm, id, pod, u64::from(*tokens))
                    .expect("the fake host never fails");
            }
        }
        for w in &mut self.workers {
            w.gate.stats.send(|_| {});
        }
    }

    fn check(&self) {
        let store = &self.workers[0].vm;
        let now = self.host.now_ms();
        let entries: usize = POOL
            .iter()
            .map(|p| live(&checked_pod(store, p), now).entries.len())
            .sum();
        let in_flight = |s: &&Stream| {
            matches!(
                s.state,
                State::Forwarded { routed: true } | State::Responding { routed: true }
            )
        };
        let routed = self.streams.iter().filter(in_flight).count();
        // An entry lasts at least the TTL from its dispatch (growth renews it), and only a pod
        // leaving the pool takes entries away before their streams end.
        let surely_held = self
            .streams
            .iter()
            .filter(in_flight)
            .filter(|s| {
                s.routed_at.is_some_and(|(at, op)| {
                    now < at.saturating_add(self.ttl_ms) && self.pod_left_at.is_none_or(|l| op > l)
                })
            })
            .count();
        assert!(
            (surely_held..=routed).contains(&entries),
            "{entries} entries on the pods for {routed} routed streams in flight \
             ({surely_held} of them surely still holding theirs)"
        );
        let q = live_line(&checked_queue(store), now);
        // Backfills past one head: the configured passes, plus one per worker racing for the
        // last (each checks the count before it routes).
        let racing = self.workers.len() as u32;
        for &(head, passes) in &q.passes {
            assert!(
                passes <= self.backfill_passes + racing,
                "{passes} backfills past head {head}, {} allowed",
                self.backfill_passes
            );
        }
        let parked: usize = self.workers.iter().map(|w| w.parked.len()).sum();
        assert!(
            q.tickets.len() <= parked,
            "{} tickets in the line but {parked} parked streams",
            q.tickets.len()
        );
    }
}

fuzz_target!(|input: Input| {
    let cfg = config(&input.knobs);
    let host = FakeHost::new();
    host.set_now_ms(1_700_000_000_000);
    let workers: Vec<Worker> = (0..1 + usize::from(input.knobs.vms % 3))
        .map(|_| {
            let vm = host.vm();
            let gate = Gate::new(cfg.clone(), &vm).expect("the fake host never fails");
            Worker {
                vm,
                gate,
                parked: HashMap::new(),
                calls: Vec::new(),
            }
        })
        .collect();
    let mut world = World {
        host,
        workers,
        streams: Vec::new(),
        ttl_ms: cfg.routing.request_ttl_ms,
        backfill_passes: cfg.admission.backfill_passes,
        op: 0,
        pod_left_at: None,
    };
    for (i, op) in input.ops.iter().take(MAX_OPS).enumerate() {
        world.op = i;
        let before = published_pods(&world.workers[0].vm);
        world.apply(op);
        let after = published_pods(&world.workers[0].vm);
        if before.iter().any(|p| !after.contains(p)) {
            world.pod_left_at = Some(i);
        }
        world.check();
    }
    for s in 0..world.streams.len() {
        if world.streams[s].state != State::Done {
            world.done(s);
        }
    }
    let store = &world.workers[0].vm;
    let now = world.host.now_ms();
    for pod in POOL {
        let raw = checked_pod(store, pod);
        let rec = if skip("expired-entries") {
            live(&raw, now)
        } else {
            raw
        };
        assert!(
            rec.entries.is_empty() && rec.held_tokens() == 0,
            "{pod} after every stream is done: {rec:?}"
        );
    }
    let raw = checked_queue(store);
    let q = if skip("abandoned-tickets") {
        live_line(&raw, now)
    } else {
        raw
    };
    assert!(
        q.tickets.is_empty(),
        "tickets left after every stream is done: {q:?}"
    );
});
