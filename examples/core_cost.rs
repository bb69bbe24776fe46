//! What kvgate's core costs per request body, natively: the body path `Flow::on_body` runs before
//! routing (`Request::parse`, the token estimate, the prompt's block hashes) on generated chat
//! bodies of 4 KB, 64 KB and 256 KB in three scripts (English prose, code, Chinese), against the
//! floor any JSON-reading filter pays, `serde_json::from_slice::<Value>` of the same body, timed
//! in the same rounds so that a busy machine moves both.
//!
//! ```text
//! cargo run --release --example core_cost                 # the table, a few seconds
//! cargo run --release --example core_cost -- code-256k    # cases whose name contains a filter
//! cargo run --release --example core_cost -- --iters 2    # no timing: baseline and core twice
//! ```
//!
//! `scripts/core_cost_callgrind.sh` runs the `--iters` mode under callgrind and prints each
//! phase's instructions per request (the phases are the `#[inline(never)]` functions below).

use std::hint::black_box;
use std::time::Duration;

use kvgate::config::Config;
use kvgate::estimate::reservation::{estimate_from, Estimate, StaticCount};
use kvgate::openai::request::{Api, Request};
use kvgate::routing::prefix::block_hashes;

const SIZES: [(&str, usize); 3] = [("4k", 4 << 10), ("64k", 64 << 10), ("256k", 256 << 10)];
/// Tokens per prompt block: vLLM's default block size, which the router also assumes before any
/// pod has reported its own.
const BLOCK_TOKENS: u32 = 16;
/// Untimed passes over every case and phase before the first measurement.
const WARM_UP_PASSES: usize = 3;
/// Timed rounds per case; each round times every phase once, interleaved.
const ROUNDS: usize = 9;
/// A round's measurement of one phase lasts at least this long.
const MIN_SAMPLE: Duration = Duration::from_millis(8);

/// xorshift64*: the same bodies on every machine and every run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n.max(1)
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items.get(self.below(items.len())).copied().unwrap_or("")
    }
}

const WORDS: &str = "the of and to in is that for it as was with be by on not this are or from \
    which have an they more their model cache request server latency throughput between because \
    memory scheduler prefix tokens however especially configuration understanding approximately \
    infrastructure measurement performance distributed each when would other these about after \
    first people through system again";

const IDENTS: &str = "request blockHashes pod_state maxTokens self config estimate buffer HashMap \
    parse_body routingTable len value result tokens i cost";

const STATEMENTS: &[&str] = &[
    "let {a} = {b}.{c}({a}, {n});",
    "if {a}.{b} > {n} {{",
    "}}",
    "return Err(Error::new(\"{a} failed\"));",
    "for {a} in {b}.iter().filter(|x| x.{c} != {n}) {{",
    "// Keeps the {a} of each {b}: the {c} would otherwise grow.",
    "{a}.push(({b}, {c} * {n}));",
    "match {a} {{ Some({b}) => {b}, None => {n} }}",
];

/// Common Han characters and CJK punctuation, with an occasional Latin term and number as in
/// real Chinese technical text.
const HAN: &str = "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点从业本去把性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原又么利比或但质气第向道命此变条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果料象员革位入常文总次品式活设及管特件长求老头基资边流路级少图山统接知较将组见计别她手角期根论运农指几九区强放决西被干做必战先回则任取据处理";
const HAN_PUNCT: &[&str] = &["，", "，", "、", "：", "；"];
const HAN_TERMS: &[&str] = &["GPU", "KV", "Envoy", "2048", "vLLM", "128"];

fn prose(rng: &mut Rng, bytes: usize) -> String {
    let vocabulary: Vec<&str> = WORDS.split_whitespace().collect();
    let mut out = String::new();
    while out.len() < bytes {
        let words = 8 + rng.below(14);
        for i in 0..words {
            let w = rng.pick(&vocabulary);
            if i == 0 {
                let mut cs = w.chars();
                out.extend(cs.next().map(|c| c.to_ascii_uppercase()));
                out.push_str(cs.as_str());
            } else {
                out.push(' ');
                match rng.below(40) {
                    0 => out.push_str(&(1 + rng.below(99_999)).to_string()),
                    1 => out.push_str("don't"),
                    _ => out.push_str(w),
                }
                if rng.below(9) == 0 && i + 1 < words {
                    out.push(',');
                }
            }
        }
        out.push_str(if rng.below(12) == 0 { ".\n\n" } else { ". " });
    }
    out
}

fn code(rng: &mut Rng, bytes: usize) -> String {
    let idents: Vec<&str> = IDENTS.split_whitespace().collect();
    let mut out = String::new();
    let mut depth = 1usize;
    while out.len() < bytes {
        let stmt = rng.pick(STATEMENTS);
        if stmt == "}}" {
            depth = depth.saturating_sub(1).max(1);
        }
        out.push_str(&"    ".repeat(depth));
        let line = stmt
            .replace("{a}", rng.pick(&idents))
            .replace("{b}", rng.pick(&idents))
            .replace("{c}", rng.pick(&idents))
            .replace("{n}", &rng.below(4096).to_string())
            .replace("{{", "{")
            .replace("}}", "}");
        out.push_str(&line);
        out.push('\n');
        if stmt.ends_with("{{") {
            depth = (depth + 1).min(6);
        }
    }
    out
}

fn chinese(rng: &mut Rng, bytes: usize) -> String {
    let han: Vec<char> = HAN.chars().collect();
    let mut out = String::new();
    while out.len() < bytes {
        for _ in 0..3 + rng.below(4) {
            for _ in 0..4 + rng.below(12) {
                out.extend(han.get(rng.below(han.len())));
            }
            if rng.below(6) == 0 {
                out.push_str(rng.pick(HAN_TERMS));
            }
            out.push_str(rng.pick(HAN_PUNCT));
        }
        out.pop();
        out.push_str(if rng.below(8) == 0 { "。\n" } else { "。" });
    }
    out
}

type Generator = fn(&mut Rng, usize) -> String;
const SCRIPTS: [(&str, Generator); 3] = [("prose", prose), ("code", code), ("cjk", chinese)];

/// A chat request of about `bytes`: a system prompt, a question, an answer and a follow-up.
fn chat_body(text: Generator, seed: u64, bytes: usize) -> Result<Vec<u8>, serde_json::Error> {
    // Contents take what the envelope leaves; JSON escapes make the body slightly larger.
    let content = bytes.saturating_sub(300);
    let mut rng = Rng(seed);
    let shares = [("system", 4), ("user", 3), ("assistant", 2), ("user", 1)];
    let messages: Vec<serde_json::Value> = shares
        .iter()
        .map(|(role, tenths)| {
            serde_json::json!({"role": role, "content": text(&mut rng, content * tenths / 10)})
        })
        .collect();
    serde_json::to_vec(&serde_json::json!({
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "messages": messages,
        "max_tokens": 256,
        "temperature": 0.7,
        "stream": false,
    }))
}

#[inline(never)]
fn phase_serde_value(body: &[u8]) -> Option<serde_json::Value> {
    serde_json::from_slice(body).ok()
}

#[inline(never)]
fn phase_parse(body: &[u8]) -> Option<Request> {
    Request::parse(Api::ChatCompletions, body).ok()
}

#[inline(never)]
fn phase_estimate(cfg: &Config, req: &Request) -> Estimate {
    estimate_from(
        req,
        StaticCount::of(req),
        None,
        kvgate::estimate::calibration::Prior::configured(&cfg.estimator),
        &cfg.estimator,
    )
}

#[inline(never)]
fn phase_hashes(cfg: &Config, req: &Request) -> Vec<u64> {
    block_hashes(
        &req.model,
        req.cache_salt.as_deref(),
        &req.text,
        cfg.routing.block_chars(BLOCK_TOKENS),
        cfg.routing.max_prompt_blocks as usize,
    )
}

/// Everything `Flow::on_body` does with the body before it asks the router.
#[inline(never)]
fn phase_core(cfg: &Config, body: &[u8]) -> Option<(Estimate, Vec<u64>)> {
    let req = phase_parse(body)?;
    Some((phase_estimate(cfg, &req), phase_hashes(cfg, &req)))
}

struct Case {
    name: String,
    body: Vec<u8>,
    req: Request,
}

/// The phases, in the table's column order; the first is the baseline.
const PHASES: [&str; 5] = ["serde Value", "core", "parse", "estimate", "hashes"];

fn run_phase(phase: usize, cfg: &Config, case: &Case) {
    let body = black_box(case.body.as_slice());
    let req = black_box(&case.req);
    match phase {
        0 => drop(black_box(phase_serde_value(body))),
        1 => drop(black_box(phase_core(cfg, body))),
        2 => drop(black_box(phase_parse(body))),
        3 => drop(black_box(phase_estimate(cfg, req))),
        _ => drop(black_box(phase_hashes(cfg, req))),
    }
}

/// This thread's CPU time, so that time the machine gave other processes is not counted (the
/// machine is shared).
#[cfg(target_os = "linux")]
const CLOCK: &str = "CPU";
#[cfg(not(target_os = "linux"))]
const CLOCK: &str = "wall";

#[cfg(target_os = "linux")]
fn now() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to write.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Wall time where there is no thread CPU clock to read.
#[cfg(not(target_os = "linux"))]
fn now() -> Duration {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START.get_or_init(std::time::Instant::now).elapsed()
}

/// Nanoseconds per call of one phase.
fn sample(phase: usize, cfg: &Config, case: &Case, iters: u32) -> f64 {
    let start = now();
    for _ in 0..iters {
        run_phase(phase, cfg, case);
    }
    now().saturating_sub(start).as_nanos() as f64 / f64::from(iters)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn measure(cfg: &Config, case: &Case) {
    // Iterations per sample so that the slowest phase (core) lasts about MIN_SAMPLE.
    let once = sample(1, cfg, case, 1).max(1.0);
    let iters = ((MIN_SAMPLE.as_nanos() as f64 / once).ceil() as u32).max(1);
    let mut ns = vec![Vec::with_capacity(ROUNDS); PHASES.len()];
    let mut ratios = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        for (phase, times) in ns.iter_mut().enumerate() {
            times.push(sample(phase, cfg, case, iters));
        }
        // The ratio within a round: both sides saw the same machine.
        let (base, core) = (ns[0].last().copied(), ns[1].last().copied());
        ratios.extend(base.zip(core).map(|(b, c)| c / b));
    }
    let [base, core, parse, estimate, hashes] = [0, 1, 2, 3, 4].map(|p| median(ns[p].clone()));
    let parts = parse + estimate + hashes;
    let share = |x: f64| 100.0 * x / parts;
    println!(
        "{:<10} {:>7} {:>6} {:>11.0} {:>11.0} {:>6.2}x {:>10.0} {:>10.0} {:>10.0}   {:>3.0}/{:>3.0}/{:>3.0} %",
        case.name,
        case.body.len(),
        (case.req.text.chars().count() / cfg.routing.block_chars(BLOCK_TOKENS))
            .min(cfg.routing.max_prompt_blocks as usize),
        base,
        core,
        median(ratios),
        parse,
        estimate,
        hashes,
        share(parse),
        share(estimate),
        share(hashes),
    );
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut filters = Vec::new();
    let mut iters = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--iters" => iters = Some(args.next().ok_or("--iters needs a count")?.parse::<u32>()?),
            _ => filters.push(arg),
        }
    }
    let cfg = Config::default();
    let mut cases = Vec::new();
    for (seed, (script, text)) in (1..).zip(SCRIPTS) {
        for (size, bytes) in SIZES {
            let name = format!("{script}-{size}");
            if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
                continue;
            }
            let body = chat_body(text, seed, bytes)?;
            let req = Request::parse(Api::ChatCompletions, &body).map_err(|e| e.message)?;
            cases.push(Case { name, body, req });
        }
    }
    if let Some(n) = iters {
        // The baseline and the core only: the core calls each of its phases once.
        for case in &cases {
            for phase in 0..2 {
                for _ in 0..n {
                    run_phase(phase, &cfg, case);
                }
            }
        }
        return Ok(());
    }
    // Caches, the allocator's free lists and, compiled to wasm, the JIT's tiers settle first.
    for _ in 0..WARM_UP_PASSES {
        for case in &cases {
            for phase in 0..PHASES.len() {
                run_phase(phase, &cfg, case);
            }
        }
    }
    println!(
        "{CLOCK} ns per request (median of {ROUNDS} interleaved rounds); ratio = core / serde Value, per round"
    );
    println!(
        "{:<10} {:>7} {:>6} {:>11} {:>11} {:>7} {:>10} {:>10} {:>10}   parse/est/hash",
        "case", "bytes", "blocks", "serde Value", "core", "ratio", "parse", "estimate", "hashes"
    );
    for case in &cases {
        measure(&cfg, case);
    }
    Ok(())
}
