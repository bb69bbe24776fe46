//! kvgate-bench: the load generator of kvgate's benchmarks (docs/benchmarks.md).
//!
//! `kvgate-bench run` sends a seeded workload (shared-prefix, multi-turn, mixed, chat, fixed) to an
//! OpenAI-compatible endpoint, open loop (Poisson arrivals or a burst) or closed loop (fixed
//! concurrency), streaming, and writes one JSON line per request plus a JSON summary.
//! `kvgate-bench echo` is an instantly answering upstream for the filter-overhead benchmark.
//! `kvgate-bench plan` prints a workload's jobs without sending anything.

mod client;
mod echo;
mod rng;
mod stats;
mod workload;

use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::{Parser, Subcommand, ValueEnum};
use serde_json::{json, Value};

use crate::client::Client;
use crate::stats::Record;
use crate::workload::{Arrival, Job};

#[derive(Parser)]
#[command(
    name = "kvgate-bench",
    version,
    about = "Load generator for kvgate's benchmarks"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Send a workload and record every request.
    Run(RunArgs),
    /// Print the workload's jobs as JSON lines (nothing is sent).
    Plan(WorkloadArgs),
    /// Serve instant OpenAI-shaped answers (filter-overhead benchmark upstream).
    Echo {
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        #[arg(long, default_value_t = 8900)]
        port: u16,
    },
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum WorkloadKind {
    SharedPrefix,
    MultiTurn,
    Mixed,
    Chat,
    Lora,
    Fixed,
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum ArrivalKind {
    Poisson,
    Burst,
    Closed,
}

#[derive(clap::Args, Clone)]
struct WorkloadArgs {
    #[arg(long, value_enum)]
    workload: WorkloadKind,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long, value_enum, default_value = "poisson")]
    arrival: ArrivalKind,
    /// Jobs (requests, or sessions for multi-turn) per second, Poisson arrivals.
    #[arg(long, default_value_t = 10.0)]
    rate: f64,
    // shared-prefix
    #[arg(long, default_value_t = 13)]
    groups: usize,
    #[arg(long, default_value_t = 20)]
    questions: usize,
    #[arg(long, default_value_t = 2048)]
    system_tokens: usize,
    #[arg(long, default_value_t = 256)]
    question_tokens: usize,
    #[arg(long, default_value_t = 64)]
    output_tokens: u32,
    /// Groups are tenants of one application: one system prompt for all, each group's cache
    /// kept apart by the engine under its `x-cache-salt` header.
    #[arg(long)]
    salted: bool,
    // multi-turn
    #[arg(long, default_value_t = 40)]
    sessions: usize,
    #[arg(long, default_value_t = 5)]
    turns: usize,
    #[arg(long, default_value_t = 1000)]
    first_tokens: usize,
    #[arg(long, default_value_t = 100)]
    followup_tokens: usize,
    #[arg(long, default_value_t = 1.0)]
    think_mean: f64,
    // mixed / chat / fixed
    #[arg(long, default_value_t = 400)]
    requests: usize,
    #[arg(long, default_value_t = 0.15)]
    long_fraction: f64,
    #[arg(long, default_value = "64,512")]
    short_prompt: String,
    #[arg(long, default_value = "16,128")]
    short_output: String,
    #[arg(long, default_value = "3000,6000")]
    long_prompt: String,
    #[arg(long, default_value = "256,512")]
    long_output: String,
    // chat
    /// Prompt length range (tokens), log-uniform.
    #[arg(long, default_value = "200,3000")]
    prompt_tokens: String,
    /// Fraction of chat requests sent without max_tokens.
    #[arg(long, default_value_t = 0.5)]
    unbounded_fraction: f64,
    /// Range of max_tokens on the other chat requests (uniform).
    #[arg(long, default_value = "128,1024")]
    max_tokens: String,
    /// Applications sharing the chat model, each its own system prompt and answer lengths (0:
    /// the simulator draws every answer's length).
    #[arg(long, default_value_t = 0)]
    apps: usize,
    /// The applications' answers' mean, tokens.
    #[arg(long, default_value_t = 256.0)]
    app_answer_mean: f64,
    /// σ of the applications' log-medians.
    #[arg(long, default_value_t = 1.0)]
    app_spread: f64,
    /// σ of one application's answers' log-lengths.
    #[arg(long, default_value_t = 0.5)]
    app_answer_spread: f64,
    /// Words every application's system prompt opens with, alike in all of them.
    #[arg(long, default_value_t = 0)]
    app_opening_words: usize,
    /// Each application's own system-prompt words, after the opening.
    #[arg(long, default_value_t = 120)]
    app_prompt_words: usize,
    /// Words of each request's own that close its application's system prompt (a user's
    /// profile, retrieved passages, a date and time): the opening no longer repeats whole.
    #[arg(long, default_value_t = 0)]
    app_context_words: usize,
    /// Approximate JSON body size of the fixed workload.
    #[arg(long, default_value_t = 4096)]
    body_bytes: usize,
    // lora (prompt lengths: --prompt-tokens, uniform; answers: --output-tokens)
    /// Adapters `lora-0` .. `lora-<n-1>` the requests name.
    #[arg(long, default_value_t = 16)]
    adapters: usize,
    /// Adapter popularity: `lora-k` is drawn with weight 1 / (k + 1)^zipf.
    #[arg(long, default_value_t = 1.0)]
    adapter_zipf: f64,
}

#[derive(clap::Args)]
struct RunArgs {
    #[command(flatten)]
    w: WorkloadArgs,
    /// Base URL of the target, e.g. http://127.0.0.1:10000
    #[arg(long)]
    url: String,
    /// Where requests go: a chat completions path, a completions path (the conversation rendered
    /// through Llama 3's template by the client), an Anthropic Messages path (`/v1/messages`:
    /// the system prompt in `system`, and a request without its own limit sent with
    /// `ANTHROPIC_MAX_TOKENS`, as that API requires one), or SGLang's native `/generate` (the
    /// conversation rendered through Llama 3's template as `text`, the limit in
    /// `sampling_params.max_new_tokens`, null for a request without one).
    #[arg(long, default_value = "/v1/chat/completions")]
    path: String,
    /// With a completions `--path`, each prompt sent as token ids (a client that tokenizes
    /// itself): one id a word of the rendered prompt.
    #[arg(long)]
    prompt_ids: bool,
    #[arg(long, default_value = "meta-llama/Llama-3.1-8B-Instruct")]
    model: String,
    /// Closed-loop workers (with --arrival closed).
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Stop starting jobs (and turns) after this many seconds.
    #[arg(long, default_value_t = 300.0)]
    max_duration: f64,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 120.0)]
    timeout: f64,
    /// Goodput objective: a successful request whose TTFT is at most this counts.
    #[arg(long, default_value_t = 1000.0)]
    ttft_slo_ms: f64,
    /// A header every request carries beside its workload's own, `name: value` (repeatable):
    /// e.g. a time-to-first-token objective, `x-slo-ttft-ms: 1000`.
    #[arg(long = "header", value_parser = header)]
    headers: Vec<(String, String)>,
    /// Send non-streaming requests.
    #[arg(long)]
    no_stream: bool,
    /// Closed loop: cycle through the jobs until --max-duration instead of stopping after the last.
    #[arg(long)]
    repeat: bool,
    /// Per-request JSON lines.
    #[arg(long)]
    out: Option<String>,
    /// Summary JSON (default: stdout).
    #[arg(long)]
    summary: Option<String>,
}

fn header(s: &str) -> Result<(String, String), String> {
    let (name, value) = s
        .split_once(':')
        .ok_or_else(|| format!("expected `name: value`, got {s:?}"))?;
    let name = name.trim().to_ascii_lowercase();
    if name.is_empty() {
        return Err(format!("no header name in {s:?}"));
    }
    Ok((name, value.trim().to_string()))
}

fn pair(s: &str) -> Result<(u64, u64), String> {
    let mut it = s.split(',').map(|x| x.trim().parse::<u64>());
    match (it.next(), it.next(), it.next()) {
        (Some(Ok(a)), Some(Ok(b)), None) if a <= b => Ok((a, b)),
        _ => Err(format!("expected LO,HI, got {s:?}")),
    }
}

fn build_jobs(w: &WorkloadArgs) -> Result<Vec<Job>, String> {
    let arrival = match w.arrival {
        ArrivalKind::Poisson => Arrival::Poisson(w.rate),
        ArrivalKind::Burst => Arrival::Burst,
        ArrivalKind::Closed => Arrival::Closed,
    };
    Ok(match w.workload {
        WorkloadKind::SharedPrefix => workload::shared_prefix(
            w.seed,
            &workload::SharedPrefix {
                groups: w.groups,
                questions: w.questions,
                system_tokens: w.system_tokens,
                question_tokens: w.question_tokens,
                output_tokens: w.output_tokens,
                salted: w.salted,
            },
            arrival,
        ),
        WorkloadKind::MultiTurn => workload::multi_turn(
            w.seed,
            &workload::MultiTurn {
                sessions: w.sessions,
                turns: w.turns,
                system_tokens: w.system_tokens,
                first_tokens: w.first_tokens,
                followup_tokens: w.followup_tokens,
                output_tokens: w.output_tokens,
                think_mean: w.think_mean,
            },
            arrival,
        ),
        WorkloadKind::Mixed => workload::mixed(
            w.seed,
            &workload::Mixed {
                requests: w.requests,
                long_fraction: w.long_fraction,
                short_prompt: pair(&w.short_prompt)?,
                short_output: pair(&w.short_output)?,
                long_prompt: pair(&w.long_prompt)?,
                long_output: pair(&w.long_output)?,
            },
            arrival,
        ),
        WorkloadKind::Chat => workload::chat(
            w.seed,
            &workload::Chat {
                requests: w.requests,
                prompt: pair(&w.prompt_tokens)?,
                unbounded_fraction: w.unbounded_fraction,
                max_tokens: pair(&w.max_tokens)?,
                apps: (w.apps > 0).then_some(workload::Apps {
                    count: w.apps,
                    mean: w.app_answer_mean,
                    between: w.app_spread,
                    within: w.app_answer_spread,
                    opening: w.app_opening_words,
                    words: w.app_prompt_words,
                    context: w.app_context_words,
                }),
            },
            arrival,
        ),
        WorkloadKind::Lora => workload::lora(
            w.seed,
            &workload::Lora {
                requests: w.requests,
                adapters: w.adapters,
                zipf: w.adapter_zipf,
                prompt: pair(&w.prompt_tokens)?,
                output_tokens: w.output_tokens,
            },
            arrival,
        ),
        WorkloadKind::Fixed => workload::fixed(w.seed, w.requests, w.body_bytes, w.output_tokens),
    })
}

struct Ctx {
    client: Client,
    path: String,
    prompt_ids: bool,
    model: String,
    stream: bool,
    t0: Instant,
    deadline: Instant,
    records: Mutex<Vec<Record>>,
}

/// A conversation rendered through Llama 3's chat template, as an application that sends it to
/// `/v1/completions` renders it itself (`--path /v1/completions`).
fn llama3_prompt(messages: &[Value]) -> String {
    let mut prompt = String::from("<|begin_of_text|>");
    for m in messages {
        let role = m["role"].as_str().unwrap_or("user");
        let content = m["content"].as_str().unwrap_or_default();
        prompt.push_str(&format!(
            "<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>"
        ));
    }
    prompt + "<|start_header_id|>assistant<|end_header_id|>\n\n"
}

/// A prompt as token ids, one a word: the same words give the same ids, so prompts that share
/// their first words share their first ids (ids from 1,000, within a 200k vocabulary).
fn word_ids(prompt: &str) -> Vec<u32> {
    let fnv = |w: &str| {
        w.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    };
    prompt
        .split_whitespace()
        .map(|w| 1_000 + (fnv(w) % 150_000) as u32)
        .collect()
}

/// The `max_tokens` an Anthropic Messages request without a limit of its own is sent with: large,
/// as agent clients send it, and within the simulator's pods (a 3,000-token prompt and this fit
/// 1,024 blocks of 16).
const ANTHROPIC_MAX_TOKENS: u32 = 8192;

/// Sends a job's turns one after another, carrying the conversation.
async fn run_job(ctx: Arc<Ctx>, job: Job) {
    let mut messages: Vec<Value> = Vec::new();
    if let Some(s) = &job.system {
        messages.push(json!({"role": "system", "content": s}));
    }
    let tags: BTreeMap<String, String> = job.tags.iter().cloned().collect();
    for (t, turn) in job.turns.iter().enumerate() {
        if t > 0 && Instant::now() >= ctx.deadline {
            break;
        }
        messages.push(json!({"role": "user", "content": turn.user}));
        let model = job.model.as_deref().unwrap_or(&ctx.model);
        let native = ctx.path == "/generate";
        let mut body = if native {
            // No limit of its own is sent as null, the engine's "until the model stops" (absent,
            // SGLang stops at 128).
            let params = json!({"max_new_tokens": turn.max_tokens, "temperature": 0.0});
            json!({"text": llama3_prompt(&messages), "sampling_params": params})
        } else if ctx.path.ends_with("/v1/messages") {
            // The API requires a limit: a client that sets none of its own sends a large one, as
            // agent clients do, and the answer ends where the model stops.
            let max_tokens = turn.max_tokens.unwrap_or(ANTHROPIC_MAX_TOKENS);
            let mut body = json!({"model": model, "max_tokens": max_tokens, "temperature": 0.0});
            let system = job.system.is_some();
            body["messages"] = json!(messages[usize::from(system)..]);
            if let Some(s) = &job.system {
                body["system"] = json!(s);
            }
            body
        } else if ctx.path.ends_with("/v1/completions") {
            let prompt = llama3_prompt(&messages);
            let prompt = if ctx.prompt_ids {
                json!(word_ids(&prompt))
            } else {
                json!(prompt)
            };
            json!({"model": model, "prompt": prompt, "temperature": 0.0})
        } else {
            json!({"model": model, "messages": messages, "temperature": 0.0})
        };
        if let Some(m) = turn.max_tokens.filter(|_| !native) {
            body["max_tokens"] = json!(m);
        }
        if ctx.stream {
            body["stream"] = json!(true);
            // An Anthropic Messages stream always ends with its usage, an SGLang one carries its
            // counts in every chunk.
            if !native && !ctx.path.ends_with("/v1/messages") {
                body["stream_options"] = json!({"include_usage": true});
            }
        }
        let bytes = Bytes::from(body.to_string());
        let sent = ctx.t0.elapsed().as_secs_f64();
        let o = ctx
            .client
            .post(&ctx.path, bytes, &job.headers, ctx.stream)
            .await;
        let ok = o.status == 200 && o.error.is_none();
        let content = o.content.clone();
        let itl = o
            .itl
            .iter()
            .map(|x| (x * 1000.0).round() / 1000.0)
            .collect();
        let rec = Record {
            job: job.id,
            turn: t,
            sent,
            max_tokens: turn.max_tokens,
            outcome: client::Outcome { itl, ..o },
            tags: tags.clone(),
        };
        if let Ok(mut r) = ctx.records.lock() {
            r.push(rec);
        }
        if !ok {
            break;
        }
        messages.push(json!({"role": "assistant", "content": content}));
        if turn.think > 0.0 && t + 1 < job.turns.len() {
            tokio::time::sleep(Duration::from_secs_f64(turn.think)).await;
        }
    }
}

async fn run(a: RunArgs) -> Result<(), String> {
    let mut jobs = build_jobs(&a.w)?;
    for job in &mut jobs {
        job.headers.extend(a.headers.iter().cloned());
    }
    let addr = client::authority(&a.url)?;
    let t0 = Instant::now();
    let ctx = Arc::new(Ctx {
        client: Client::new(addr, Duration::from_secs_f64(a.timeout)),
        path: a.path.clone(),
        prompt_ids: a.prompt_ids,
        model: a.model.clone(),
        stream: !a.no_stream,
        t0,
        deadline: t0 + Duration::from_secs_f64(a.max_duration),
        records: Mutex::new(Vec::new()),
    });
    let mut handles = Vec::new();
    if a.w.arrival == ArrivalKind::Closed {
        let jobs = Arc::new(jobs);
        let next = Arc::new(AtomicUsize::new(0));
        let repeat = a.repeat;
        for _ in 0..a.concurrency.max(1) {
            let (ctx, jobs, next) = (ctx.clone(), jobs.clone(), next.clone());
            handles.push(tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let k = if repeat && !jobs.is_empty() {
                        i % jobs.len()
                    } else {
                        i
                    };
                    let Some(job) = jobs.get(k) else { break };
                    if Instant::now() >= ctx.deadline {
                        break;
                    }
                    let mut job = job.clone();
                    job.id = i;
                    run_job(ctx.clone(), job).await;
                }
            }));
        }
    } else {
        for job in jobs {
            let at = t0 + Duration::from_secs_f64(job.start);
            if at >= ctx.deadline {
                break;
            }
            tokio::time::sleep_until(at.into()).await;
            handles.push(tokio::spawn(run_job(ctx.clone(), job)));
        }
    }
    for h in handles {
        let _ = h.await;
    }
    let mut records = match ctx.records.lock() {
        Ok(mut r) => std::mem::take(&mut *r),
        Err(_) => Vec::new(),
    };
    records.sort_by(|x, y| x.sent.total_cmp(&y.sent));
    if let Some(path) = &a.out {
        let f = std::fs::File::create(path).map_err(|e| format!("{path}: {e}"))?;
        let mut w = std::io::BufWriter::new(f);
        for r in &records {
            let line = serde_json::to_string(r).map_err(|e| e.to_string())?;
            writeln!(w, "{line}").map_err(|e| format!("{path}: {e}"))?;
        }
        w.flush().map_err(|e| format!("{path}: {e}"))?;
    }
    let report = stats::report(&records, a.ttft_slo_ms);
    let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    match &a.summary {
        Some(path) => std::fs::write(path, text).map_err(|e| format!("{path}: {e}"))?,
        None => println!("{text}"),
    }
    let s = &report.overall;
    eprintln!(
        "kvgate-bench: {} requests, {} ok, {:.1}s, ttft p50 {:.1} ms p99 {:.1} ms, {:.0} output tok/s, errors {:?}",
        s.requests,
        s.ok,
        s.duration_s,
        s.ttft_ms.p50.unwrap_or(f64::NAN),
        s.ttft_ms.p99.unwrap_or(f64::NAN),
        s.output_tok_per_s,
        s.errors
    );
    Ok(())
}

fn plan(w: WorkloadArgs) -> Result<(), String> {
    let jobs = build_jobs(&w)?;
    let mut out = std::io::stdout().lock();
    for j in jobs {
        let line = serde_json::to_string(&j).map_err(|e| e.to_string())?;
        if writeln!(out, "{line}").is_err() {
            break;
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvgate-bench: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let res = rt.block_on(async move {
        match cli.cmd {
            Cmd::Run(a) => run(a).await,
            Cmd::Plan(w) => plan(w),
            Cmd::Echo { host, port } => echo::serve(&host, port).await,
        }
    });
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvgate-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
