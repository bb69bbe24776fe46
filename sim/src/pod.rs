//! A pod: one engine driven by its own OS thread against (scaled) wall time,
//! plus the per-request channels that carry generated tokens to HTTP handlers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::mpsc::UnboundedSender;

use crate::config::Args;
use crate::engine::{Engine, FinishReason, NewRequest, Output};
use crate::ideal::IdealCache;
use crate::kv::{mix64, ReqId};
use crate::lora::{LoraId, LoraRef};
use crate::metrics::{
    Histogram, LoraInfo, E2E_BUCKETS, GENERATION_TOKENS_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS,
};
use crate::tokenizer::Tokenizer;

/// Process-wide state shared by all pods.
pub struct Shared {
    pub args: Args,
    pub tok: Tokenizer,
    pub served: Vec<String>,
    pub start_unix: f64,
    /// Every prompt block any pod was asked for: the benchmarks' hit-rate ceiling.
    pub ideal: IdealCache,
}

impl Shared {
    /// The base model an adapter is listed under: its `base_model_name` when
    /// that is a served name, else the first served name (vLLM's
    /// `show_available_models`).
    pub fn parent_of(&self, base_model_name: Option<&str>) -> String {
        match base_model_name {
            Some(b) if self.served.iter().any(|s| s == b) => b.to_string(),
            _ => self.served[0].clone(),
        }
    }

    pub fn new(args: Args, tok: Tokenizer) -> Self {
        let served = args.served_names();
        let start_unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        Shared {
            args,
            tok,
            served,
            start_unix,
            ideal: IdealCache::default(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Finish {
    pub reason: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

/// One generated token for a request (the last one carries `finish`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Event {
    /// Which of the request's choices (its `n`) the token is for: vLLM's
    /// `CompletionOutput.index`.
    pub choice: usize,
    pub token: u32,
    pub first: bool,
    pub finish: Option<Finish>,
    /// The request's prefix-cache hit tokens (known from its first token on) and its
    /// preemptions so far: what SGLang's every streamed chunk reports.
    pub cached_tokens: usize,
    pub preemptions: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricsFault {
    Ok,
    Garbage,
    Error500,
    /// No `/metrics` route: an engine that exports none (SGLang without `--enable-metrics`).
    NotFound,
    Slow,
}

impl MetricsFault {
    pub fn as_str(self) -> &'static str {
        match self {
            MetricsFault::Ok => "ok",
            MetricsFault::Garbage => "garbage",
            MetricsFault::Error500 => "500",
            MetricsFault::NotFound => "404",
            MetricsFault::Slow => "slow",
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Fault {
    pub metrics: MetricsFault,
    pub metrics_delay_ms: u64,
    /// Wall-clock delay before `GET /v1/responses/{id}` answers (a busy store, a slow link).
    pub retrieve_delay_ms: u64,
}

/// Small deterministic RNG (SplitMix64).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(mix64(seed ^ 0x6b76_6761_7465))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.0)
    }
    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn normal(&mut self) -> f64 {
        let u1 = self.next_f64().max(f64::MIN_POSITIVE);
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// Draw an output length (tokens) from the configured distribution.
pub fn draw_output_len(rng: &mut Rng, dist: &str, mean: f64, sigma: f64) -> usize {
    let v = match dist {
        "fixed" => mean,
        "uniform" => 1.0 + rng.next_f64() * (2.0 * mean - 1.0),
        _ => {
            let mu = mean.ln() - sigma * sigma / 2.0;
            (mu + sigma * rng.normal()).exp()
        }
    };
    if v.is_finite() {
        (v.round() as usize).max(1)
    } else {
        1
    }
}

struct Sink {
    tx: UnboundedSender<Event>,
    choice: usize,
    arrival: Instant,
    last: Option<Instant>,
}

/// A registered LoRA adapter (an entry of vLLM's
/// `OpenAIServingModels.lora_requests`).
#[derive(Debug, Clone, PartialEq)]
pub struct Adapter {
    pub name: String,
    pub path: String,
    /// Base model it is listed under in /v1/models.
    pub parent: String,
    pub id: LoraId,
}

/// Why `/v1/load_lora_adapter` refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadError {
    LoraDisabled,
    AlreadyLoaded,
}

fn unix_now_f64() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

pub struct Inner {
    pub engine: Engine,
    /// Registered adapters in load order (as /v1/models lists them).
    pub adapters: Vec<Adapter>,
    /// Name of every adapter id ever registered: a request keeps running
    /// under its adapter's name after an unload, as in vLLM's stats.
    lora_names: HashMap<LoraId, String>,
    next_lora_id: LoraId,
    pub lora_info: LoraInfo,
    sinks: HashMap<ReqId, Sink>,
    pub rng: Rng,
    pub ttft: Histogram,
    pub e2e: Histogram,
    pub itl: Histogram,
    /// Each finished answer's generated tokens, as vLLM records a finished request's.
    pub generation: Histogram,
    next_seq: u64,
    /// Per-process salt so response ids differ between runs (like vLLM's uuids).
    id_salt: u64,
    /// The Responses API's stored responses (`responses`): this pod's own.
    pub responses: crate::responses::Store,
}

impl Inner {
    fn dispatch(&mut self, outs: Vec<Output>) {
        let now = Instant::now();
        let mut gone = Vec::new();
        for o in outs {
            let Some(sink) = self.sinks.get_mut(&o.id) else {
                continue;
            };
            if o.first {
                self.ttft
                    .observe(now.duration_since(sink.arrival).as_secs_f64());
            } else if let Some(last) = sink.last {
                self.itl.observe(now.duration_since(last).as_secs_f64());
            }
            sink.last = Some(now);
            let finish = o.finished.map(|reason| Finish {
                reason,
                prompt_tokens: o.prompt_tokens,
                completion_tokens: o.completion_tokens,
                cached_tokens: o.cached_tokens,
            });
            if let Some(f) = &finish {
                self.e2e
                    .observe(now.duration_since(sink.arrival).as_secs_f64());
                self.generation.observe(f.completion_tokens as f64);
            }
            let delivered = sink
                .tx
                .send(Event {
                    choice: sink.choice,
                    token: o.token,
                    first: o.first,
                    finish,
                    cached_tokens: o.cached_tokens,
                    preemptions: o.preemptions,
                })
                .is_ok();
            if finish.is_some() {
                self.sinks.remove(&o.id);
            } else if !delivered {
                gone.push(o.id);
            }
        }
        for id in gone {
            self.sinks.remove(&id);
            self.engine.abort(id);
        }
    }

    /// Register an adapter (vLLM `OpenAIServingModels.load_lora_adapter`); with
    /// `inplace` an adapter of that name is replaced and reloaded.
    fn register_adapter(
        &mut self,
        name: &str,
        path: &str,
        parent: String,
        inplace: bool,
    ) -> Result<(), LoadError> {
        if self.engine.loras.is_none() {
            return Err(LoadError::LoraDisabled);
        }
        if let Some(i) = self.adapters.iter().position(|a| a.name == name) {
            if !inplace {
                return Err(LoadError::AlreadyLoaded);
            }
            let old = self.adapters.remove(i);
            self.engine.unload_lora(old.id);
        }
        self.next_lora_id += 1;
        let id = self.next_lora_id;
        self.lora_names.insert(id, name.to_string());
        self.adapters.push(Adapter {
            name: name.to_string(),
            path: path.to_string(),
            parent,
            id,
        });
        self.engine.load_lora(id);
        Ok(())
    }

    /// Adapter names of `ids`, in order.
    pub fn lora_names_of(&self, ids: &[LoraId]) -> Vec<&str> {
        ids.iter()
            .filter_map(|id| self.lora_names.get(id).map(String::as_str))
            .collect()
    }

    /// Set `vllm:lora_requests_info` for the adapters running and waiting now.
    fn record_lora_info(&mut self) {
        let (running, waiting) = self.engine.lora_adapters();
        let r = self.lora_names_of(&running).join(",");
        let w = self.lora_names_of(&waiting).join(",");
        self.lora_info.set(r, w, unix_now_f64());
    }

    /// Process-unique id suffix for OpenAI response ids.
    pub fn next_response_id(&mut self) -> String {
        self.next_seq += 1;
        let a = mix64(self.id_salt ^ self.next_seq);
        format!("{a:016x}{:016x}", mix64(a ^ self.next_seq))
    }
}

pub struct Pod {
    pub index: usize,
    pub port: u16,
    pub g: Arc<Shared>,
    inner: Mutex<Inner>,
    cv: Condvar,
    origin: Instant,
    fault: Mutex<Fault>,
    /// Times a busy engine fell more than the allowed slack behind the scaled
    /// wall clock and was re-anchored (the host could not keep up with
    /// --time-scale; simulated throughput is then understated).
    clock_resyncs: AtomicU64,
    /// This pod's requests' prompt tokens and what an unbounded cache shared by every pod
    /// would have hit of them (`Shared::ideal`).
    ideal_query_tokens: AtomicU64,
    ideal_hit_tokens: AtomicU64,
}

/// What a handler submits: one engine request, or one choice of a request with `n` of them
/// (vLLM V1's `ParentRequest` makes each choice a child request of its own).
pub struct Submit {
    pub prompt: Vec<u32>,
    pub max_output: usize,
    pub finish_reason: FinishReason,
    pub cache_salt: Option<String>,
    pub lora: Option<LoraRef>,
    /// The choice's index, which its events carry.
    pub choice: usize,
    /// A pooling request (an embedding): a prefill with no output (`NewRequest::pooling`).
    pub pooling: bool,
}

impl Pod {
    pub fn new(index: usize, port: u16, g: Arc<Shared>) -> Arc<Self> {
        let engine = Engine::new(g.args.engine_config(index), g.tok.filler());
        let mut inner = Inner {
            engine,
            adapters: Vec::new(),
            lora_names: HashMap::new(),
            next_lora_id: 0,
            lora_info: LoraInfo::new(g.start_unix),
            sinks: HashMap::new(),
            rng: Rng::new(g.args.seed.wrapping_add(index as u64)),
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            generation: Histogram::new(GENERATION_TOKENS_BUCKETS),
            next_seq: 0,
            responses: crate::responses::Store::default(),
            id_salt: mix64(
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as u64)
                    ^ (u64::from(std::process::id()) << 32)
                    ^ index as u64,
            ),
        };
        // Static adapters load at start like vLLM's `init_static_loras`: in
        // order, so with more modules than cache room the last ones stay resident.
        // (Validated in main: names are unique and LoRA is on when given.)
        for m in g.args.lora_modules().unwrap_or_default() {
            let parent = g.parent_of(m.base_model_name.as_deref());
            let _ = inner.register_adapter(&m.name, &m.path, parent, false);
        }
        Arc::new(Pod {
            index,
            port,
            g,
            inner: Mutex::new(inner),
            cv: Condvar::new(),
            origin: Instant::now(),
            fault: Mutex::new(Fault {
                metrics: MetricsFault::Ok,
                metrics_delay_ms: 0,
                retrieve_delay_ms: 0,
            }),
            clock_resyncs: AtomicU64::new(0),
            ideal_query_tokens: AtomicU64::new(0),
            ideal_hit_tokens: AtomicU64::new(0),
        })
    }

    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    pub fn fault(&self) -> Fault {
        match self.fault.lock() {
            Ok(g) => *g,
            Err(p) => *p.into_inner(),
        }
    }

    pub fn set_fault(&self, f: Fault) {
        match self.fault.lock() {
            Ok(mut g) => *g = f,
            Err(p) => *p.into_inner() = f,
        }
    }

    pub fn clock_resyncs(&self) -> u64 {
        self.clock_resyncs.load(Ordering::Relaxed)
    }

    /// (prompt tokens, tokens an unbounded cache shared by every pod would have hit).
    pub fn ideal_tokens(&self) -> (u64, u64) {
        (
            self.ideal_query_tokens.load(Ordering::Relaxed),
            self.ideal_hit_tokens.load(Ordering::Relaxed),
        )
    }

    fn scale(&self) -> f64 {
        self.g.args.time_scale
    }

    /// Simulated seconds since the pod started.
    pub fn virtual_now(&self) -> f64 {
        self.origin.elapsed().as_secs_f64() * self.scale()
    }

    fn sleep_until_virtual(&self, v: f64) {
        let deadline = self.origin + Duration::from_secs_f64((v / self.scale()).max(0.0));
        let now = Instant::now();
        if deadline > now {
            std::thread::sleep(deadline - now);
        }
    }

    /// Queue a request; its tokens are sent on `tx`, which a request's choices share, so that
    /// their tokens arrive in the order the engine made them.
    pub fn submit(&self, s: Submit, tx: &UnboundedSender<Event>) -> ReqId {
        let mut inner = self.lock();
        let seed = inner.rng.next_u64();
        let id = inner.engine.add_request(NewRequest {
            prompt: s.prompt,
            max_output: s.max_output,
            finish_reason: s.finish_reason,
            cache_salt: s.cache_salt,
            output_seed: seed,
            lora: s.lora,
            pooling: s.pooling,
        });
        if let Some((prompt_len, hashes)) = inner.engine.prompt_blocks(id) {
            let hit = self
                .g
                .ideal
                .hit_tokens(hashes, prompt_len, self.g.args.block_size);
            self.ideal_query_tokens
                .fetch_add(prompt_len as u64, Ordering::Relaxed);
            self.ideal_hit_tokens
                .fetch_add(hit as u64, Ordering::Relaxed);
        }
        inner.sinks.insert(
            id,
            Sink {
                tx: tx.clone(),
                choice: s.choice,
                arrival: Instant::now(),
                last: None,
            },
        );
        drop(inner);
        self.cv.notify_one();
        id
    }

    /// The registered adapter called `name`.
    pub fn adapter(&self, name: &str) -> Option<LoraRef> {
        let inner = self.lock();
        inner
            .adapters
            .iter()
            .find(|a| a.name == name)
            .map(|a| LoraRef {
                id: a.id,
                name: a.name.clone(),
            })
    }

    pub fn load_adapter(&self, name: &str, path: &str, inplace: bool) -> Result<(), LoadError> {
        let parent = self.g.parent_of(None);
        self.lock().register_adapter(name, path, parent, inplace)
    }

    /// Unregister an adapter; false when no adapter has that name.
    pub fn unload_adapter(&self, name: &str) -> bool {
        let mut inner = self.lock();
        let Some(i) = inner.adapters.iter().position(|a| a.name == name) else {
            return false;
        };
        let a = inner.adapters.remove(i);
        inner.engine.unload_lora(a.id);
        true
    }

    /// Client went away: abort the requests still running in the engine (frees their KV blocks).
    pub fn abort(&self, ids: &[ReqId]) {
        let mut inner = self.lock();
        for &id in ids {
            if inner.sinks.remove(&id).is_some() {
                inner.engine.abort(id);
            }
        }
    }

    /// The engine loop; runs on its own thread for the life of the process.
    pub fn run_engine(self: Arc<Self>) {
        // Timer slack the clock may absorb while busy (so sleep overshoot does not
        // bias throughput); beyond it the engine re-anchors to wall time.
        let max_lag = 0.05 * self.scale();
        let mut inner = self.lock();
        let mut idle = true;
        loop {
            if !inner.engine.has_work() {
                idle = true;
                inner = match self.cv.wait(inner) {
                    Ok(g) => g,
                    Err(p) => p.into_inner(),
                };
                continue;
            }
            let v = self.virtual_now();
            // After idling, the next step starts now; while busy, steps follow
            // back to back on the virtual clock.
            if idle && v > inner.engine.now {
                inner.engine.now = v;
            } else if v - inner.engine.now > max_lag {
                inner.engine.now = v;
                self.clock_resyncs.fetch_add(1, Ordering::Relaxed);
            }
            idle = false;
            let plan = inner.engine.schedule();
            if plan.scheduled.is_empty() {
                if !plan.preempted.is_empty() {
                    // Everything running was preempted: vLLM's next step readmits
                    // from the waiting queue right away.
                    continue;
                }
                // Nothing schedulable: cannot happen for validated requests; do not spin.
                inner = match self.cv.wait_timeout(inner, Duration::from_millis(5)) {
                    Ok((g, _)) => g,
                    Err(p) => p.into_inner().0,
                };
                continue;
            }
            let end = inner.engine.now + plan.duration;
            drop(inner);
            self.sleep_until_virtual(end);
            inner = self.lock();
            inner.engine.now = end;
            let outs = inner.engine.complete_step(&plan);
            inner.dispatch(outs);
            if inner.engine.loras.is_some() {
                inner.record_lora_info();
            }
        }
    }
}

/// Aborts a request's engine requests (one per choice) when dropped while still
/// armed (the response body or handler future was dropped: the client
/// disconnected). Those that finished already are left alone.
pub struct AbortGuard {
    pod: Arc<Pod>,
    ids: Vec<ReqId>,
    armed: bool,
}

impl AbortGuard {
    pub fn new(pod: Arc<Pod>, ids: Vec<ReqId>) -> Self {
        AbortGuard {
            pod,
            ids,
            armed: true,
        }
    }
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if self.armed {
            self.pod.abort(&self.ids);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_len_distributions_have_the_right_mean() {
        for dist in ["lognormal", "uniform", "fixed"] {
            let mut r = Rng::new(1);
            let n = 20000;
            let s: usize = (0..n)
                .map(|_| draw_output_len(&mut r, dist, 200.0, 0.8))
                .sum();
            let mean = s as f64 / n as f64;
            assert!((mean - 200.0).abs() < 10.0, "{dist}: {mean}");
        }
    }
}
