//! One pod's engine: vLLM V1-style continuous-batching scheduler over the
//! paged KV cache, with a step-time model. Pure and clock-free: the caller
//! advances `now` (virtual seconds) by each step's duration, so tests run on a
//! virtual clock and the server runs it against (scaled) wall time.

use std::collections::{HashMap, VecDeque};

use crate::kv::{hash_block, lora_root, mix64, root_hash, KvCacheManager, ReqId, SlotRequest};
use crate::lora::{add_distinct, AdapterCache, LoraConfig, LoraId, LoraRef, Residency};

/// Step-time model: `overhead + prefill_tokens * prefill_token + decode_seqs *
/// decode_seq + decode_ctx_tokens * decode_ctx_token + attention_pairs * attn_pair
/// + lora_loads * lora_load + lora_activations * lora_activate`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimingModel {
    /// Fixed cost of every forward step (weight streaming, launch, sampling), s.
    pub step_overhead: f64,
    /// Per prefill token computed this step (dense matmuls), s.
    pub prefill_token: f64,
    /// Per decoding sequence in the batch, s.
    pub decode_seq: f64,
    /// Per context token read by a decoding sequence (KV read bandwidth), s.
    pub decode_ctx_token: f64,
    /// Per (new prefill token × attended token) pair (prefill attention), s.
    pub prefill_attn_pair: f64,
    /// Per LoRA adapter loaded from disk into the host cache in the step, s
    /// (vLLM's worker loads adapters synchronously while preparing the batch).
    pub lora_load: f64,
    /// Per LoRA adapter copied from the host cache into a GPU slot, s.
    pub lora_activate: f64,
}

impl Default for TimingModel {
    /// Llama-3.1-8B (BF16) on one H100 SXM; see docs/simulator.md.
    fn default() -> Self {
        TimingModel {
            step_overhead: 6.0e-3,
            prefill_token: 30.0e-6,
            decode_seq: 30.0e-6,
            decode_ctx_token: 50.0e-9,
            prefill_attn_pair: 1.3e-9,
            lora_load: 40.0e-3,
            lora_activate: 3.0e-3,
        }
    }
}

/// The work one step does, as the timing model sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepWork {
    pub prefill_tokens: usize,
    pub prefill_attn_pairs: f64,
    pub decode_seqs: usize,
    pub decode_ctx_tokens: usize,
    /// Adapters of the batch that were not in the host cache / a GPU slot.
    pub lora: Residency,
}

impl TimingModel {
    pub fn step_time(&self, w: &StepWork) -> f64 {
        self.step_overhead
            + w.prefill_tokens as f64 * self.prefill_token
            + w.prefill_attn_pairs * self.prefill_attn_pair
            + w.decode_seqs as f64 * self.decode_seq
            + w.decode_ctx_tokens as f64 * self.decode_ctx_token
            + w.lora.loads as f64 * self.lora_load
            + w.lora.activations as f64 * self.lora_activate
    }
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    pub enable_prefix_caching: bool,
    pub timing: TimingModel,
    /// `--enable-lora`: adapter slots and host cache; None serves base models only.
    pub lora: Option<LoraConfig>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            num_gpu_blocks: 2048,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 32768,
            enable_prefix_caching: true,
            timing: TimingModel::default(),
            lora: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    Stop,
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// A request as handed to the engine (already tokenized and validated).
#[derive(Debug, Clone)]
pub struct NewRequest {
    pub prompt: Vec<u32>,
    /// Tokens to generate before finishing.
    pub max_output: usize,
    /// Finish reason reported when `max_output` is reached.
    pub finish_reason: FinishReason,
    pub cache_salt: Option<String>,
    /// Seed for the generated token ids.
    pub output_seed: u64,
    /// LoRA adapter the request runs with (None: the base model).
    pub lora: Option<LoraRef>,
    /// A pooling request (vLLM's embeddings): its prefill is all it runs; it samples nothing and
    /// finishes (stopped) when the prefill completes. `max_output` is not read.
    pub pooling: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Waiting,
    Running,
}

#[derive(Debug, Clone)]
pub struct Request {
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub max_output: usize,
    pub finish_reason: FinishReason,
    pub num_computed: usize,
    pub block_hashes: Vec<u64>,
    root: u64,
    pub num_preemptions: u32,
    /// Prefix-cache hit tokens at first admission (usage.cached_tokens).
    pub num_cached_tokens: Option<usize>,
    pub status: Status,
    pub first_token_time: Option<f64>,
    output_seed: u64,
    /// Filler ids generated tokens are drawn from.
    filler: std::sync::Arc<[u32]>,
    pub lora: Option<LoraId>,
    /// A pooling request (`NewRequest::pooling`).
    pub pooling: bool,
}

impl Request {
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }
    pub fn num_output(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
    fn update_hashes(&mut self, bs: usize) {
        while (self.block_hashes.len() + 1) * bs <= self.tokens.len() {
            let i = self.block_hashes.len();
            let parent = if i == 0 {
                self.root
            } else {
                self.block_hashes[i - 1]
            };
            let h = hash_block(parent, &self.tokens[i * bs..(i + 1) * bs]);
            self.block_hashes.push(h);
        }
    }
    fn next_output_token(&self) -> u32 {
        let n = self.filler.len().max(1) as u64;
        let r = mix64(self.output_seed ^ (self.num_output() as u64).wrapping_mul(0x9e37_79b9));
        self.filler.get((r % n) as usize).copied().unwrap_or(0)
    }
}

/// One scheduled request in a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scheduled {
    pub id: ReqId,
    pub num_tokens: usize,
}

/// vLLM's `SchedulerOutput`, reduced to what the simulator needs.
#[derive(Debug, Clone, Default)]
pub struct StepPlan {
    pub scheduled: Vec<Scheduled>,
    pub preempted: Vec<ReqId>,
    pub work: StepWork,
    pub duration: f64,
}

/// What a step produced for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    pub id: ReqId,
    pub token: u32,
    /// First generated token of the request (TTFT).
    pub first: bool,
    pub finished: Option<FinishReason>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    /// Times the request was preempted so far (SGLang reports its retractions).
    pub preemptions: u32,
}

/// Counters, cumulative since start.
#[derive(Debug, Clone, Default)]
pub struct Counters {
    /// vLLM's `prefix_cache_queries` / `prefix_cache_hits`: counted at every
    /// lookup of a not-yet-preempted waiting request (a request that waits at
    /// the head of the queue for KV space is counted again each step, exactly
    /// as vLLM's scheduler does).
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    /// Same, for lookups of previously preempted requests (vLLM keeps these
    /// separate and does not export them).
    pub preempted_prefix_queries: u64,
    pub preempted_prefix_hits: u64,
    /// Counted once per request at its first admission (for /sim/stats).
    pub admitted_requests: u64,
    pub admitted_query_tokens: u64,
    pub admitted_hit_tokens: u64,
    pub request_cache_hits: u64,
    pub request_cache_misses: u64,
    pub preemptions: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub finished_stop: u64,
    pub finished_length: u64,
    pub finished_abort: u64,
    /// Prompt tokens, and those found cached at first admission, of the requests that ended:
    /// SGLang's `prompt_tokens_total` and `cached_tokens_total`, counted when a request ends.
    pub finished_prompt_tokens: u64,
    pub finished_cached_tokens: u64,
    pub peak_used_blocks: usize,
    pub steps: u64,
    pub busy_time: f64,
    pub prefill_tokens_computed: u64,
    /// LoRA adapters loaded from disk / activated into a GPU slot by steps.
    pub lora_loads: u64,
    pub lora_activations: u64,
}

pub struct Engine {
    pub cfg: EngineConfig,
    pub kv: KvCacheManager,
    pub waiting: VecDeque<ReqId>,
    pub running: Vec<ReqId>,
    pub reqs: HashMap<ReqId, Request>,
    pub counters: Counters,
    /// Virtual time in seconds.
    pub now: f64,
    next_id: ReqId,
    filler: std::sync::Arc<[u32]>,
    /// Resident adapters (None without `--enable-lora`).
    pub loras: Option<AdapterCache>,
}

impl Engine {
    pub fn new(cfg: EngineConfig, filler: &[u32]) -> Self {
        let kv = KvCacheManager::new(
            cfg.num_gpu_blocks,
            cfg.block_size,
            cfg.enable_prefix_caching,
            cfg.max_model_len,
        );
        let filler: std::sync::Arc<[u32]> = if filler.is_empty() {
            std::sync::Arc::from(vec![0u32])
        } else {
            std::sync::Arc::from(filler.to_vec())
        };
        let loras = cfg.lora.map(AdapterCache::new);
        Engine {
            cfg,
            kv,
            waiting: VecDeque::new(),
            running: Vec::new(),
            reqs: HashMap::new(),
            counters: Counters::default(),
            now: 0.0,
            next_id: 1,
            filler,
            loras,
        }
    }

    pub fn add_request(&mut self, r: NewRequest) -> ReqId {
        let id = self.next_id;
        self.next_id += 1;
        let prompt_len = r.prompt.len();
        let mut req = Request {
            tokens: r.prompt,
            prompt_len,
            max_output: if r.pooling { 0 } else { r.max_output.max(1) },
            finish_reason: r.finish_reason,
            num_computed: 0,
            block_hashes: Vec::new(),
            root: match &r.lora {
                Some(l) => lora_root(root_hash(r.cache_salt.as_deref()), &l.name),
                None => root_hash(r.cache_salt.as_deref()),
            },
            num_preemptions: 0,
            num_cached_tokens: None,
            status: Status::Waiting,
            first_token_time: None,
            output_seed: r.output_seed,
            filler: self.filler.clone(),
            lora: r.lora.map(|l| l.id),
            pooling: r.pooling,
        };
        req.update_hashes(self.cfg.block_size);
        self.reqs.insert(id, req);
        self.waiting.push_back(id);
        id
    }

    /// A request's prompt length and the hashes of its full blocks so far.
    pub fn prompt_blocks(&self, id: ReqId) -> Option<(usize, &[u64])> {
        self.reqs
            .get(&id)
            .map(|r| (r.prompt_len, r.block_hashes.as_slice()))
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Abort a request (client went away): drop it and free its blocks.
    pub fn abort(&mut self, id: ReqId) -> bool {
        let Some(req) = self.reqs.remove(&id) else {
            return false;
        };
        match req.status {
            Status::Waiting => self.waiting.retain(|&x| x != id),
            Status::Running => self.running.retain(|&x| x != id),
        }
        self.kv.free(id);
        self.counters.finished_abort += 1;
        true
    }

    fn preempt_last(&mut self) -> Option<ReqId> {
        let victim = self.running.pop()?;
        self.kv.free(victim);
        if let Some(r) = self.reqs.get_mut(&victim) {
            r.status = Status::Waiting;
            r.num_computed = 0;
            r.num_preemptions += 1;
        }
        self.waiting.push_front(victim);
        self.counters.preemptions += 1;
        Some(victim)
    }

    /// Plan one step (vLLM V1 `Scheduler.schedule`): running requests first
    /// (decodes and unfinished prefill chunks, preempting the most recently
    /// admitted request when KV blocks run out), then waiting requests FCFS
    /// while the token budget, `max_num_seqs` and free blocks allow.
    pub fn schedule(&mut self) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.cfg.max_num_batched_tokens;
        let max_len = self.cfg.max_model_len;

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(req) = self.reqs.get(&id) else {
                self.running.remove(i);
                continue;
            };
            let mut n = req
                .num_tokens()
                .saturating_sub(req.num_computed)
                .min(budget);
            n = n.min(
                max_len
                    .saturating_sub(1)
                    .saturating_sub(req.num_computed)
                    .max(1),
            );
            if n == 0 {
                i += 1;
                continue;
            }
            let scheduled = loop {
                let ok = {
                    let Some(req) = self.reqs.get(&id) else {
                        break false;
                    };
                    let slot = SlotRequest {
                        id,
                        num_tokens: req.num_tokens(),
                        num_computed_tokens: req.num_computed,
                        block_hashes: &req.block_hashes,
                    };
                    self.kv.allocate_slots(&slot, n, &[]).is_some()
                };
                if ok {
                    break true;
                }
                match self.preempt_last() {
                    Some(v) => {
                        plan.preempted.push(v);
                        if v == id {
                            break false;
                        }
                    }
                    None => break false,
                }
            };
            if !scheduled {
                break;
            }
            plan.scheduled.push(Scheduled { id, num_tokens: n });
            budget -= n;
            i += 1;
        }

        // Adapters of the running requests scheduled so far; a waiting request
        // whose adapter would exceed `max_loras` is skipped (left in place, so
        // it keeps its turn) while later requests may still be admitted, as
        // vLLM's `Scheduler.schedule` does with its `scheduled_loras`.
        // (Skipped without LoRA: base-model steps stay as cheap as before.)
        let mut batch_loras: Vec<LoraId> = Vec::new();
        if self.cfg.lora.is_some() {
            for s in &plan.scheduled {
                if let Some(l) = self.reqs.get(&s.id).and_then(|r| r.lora) {
                    add_distinct(&mut batch_loras, l);
                }
            }
        }
        if plan.preempted.is_empty() {
            // Index of the next waiting request to consider (past skipped ones).
            let mut wi = 0;
            while budget > 0 {
                let Some(&id) = self.waiting.get(wi) else {
                    break;
                };
                if self.running.len() >= self.cfg.max_num_seqs {
                    break;
                }
                let Some(req) = self.reqs.get(&id) else {
                    self.waiting.remove(wi);
                    continue;
                };
                if let (Some(l), Some(lc)) = (req.lora, self.cfg.lora) {
                    if batch_loras.len() >= lc.max_loras && !batch_loras.contains(&l) {
                        wi += 1;
                        continue;
                    }
                }
                let hit = if req.num_computed == 0 {
                    self.kv.find_longest_cache_hit(
                        &req.block_hashes,
                        req.num_tokens().saturating_sub(1),
                    )
                } else {
                    Vec::new()
                };
                let hit_tokens = hit.len() * self.cfg.block_size;
                if req.num_computed == 0 && self.cfg.enable_prefix_caching {
                    if req.num_preemptions > 0 {
                        self.counters.preempted_prefix_queries += req.num_tokens() as u64;
                        self.counters.preempted_prefix_hits += hit_tokens as u64;
                    } else {
                        self.counters.prefix_queries += req.num_tokens() as u64;
                        self.counters.prefix_hits += hit_tokens as u64;
                    }
                }
                let computed = req.num_computed + hit_tokens;
                let n = req.num_tokens().saturating_sub(computed).min(budget);
                if n == 0 {
                    break;
                }
                let ok = {
                    let slot = SlotRequest {
                        id,
                        num_tokens: req.num_tokens(),
                        num_computed_tokens: req.num_computed,
                        block_hashes: &req.block_hashes,
                    };
                    self.kv.allocate_slots(&slot, n, &hit).is_some()
                };
                if !ok {
                    break;
                }
                self.waiting.remove(wi);
                self.running.push(id);
                if let Some(req) = self.reqs.get_mut(&id) {
                    if let Some(l) = req.lora {
                        add_distinct(&mut batch_loras, l);
                    }
                    req.status = Status::Running;
                    req.num_computed = computed;
                    if req.num_cached_tokens.is_none() {
                        req.num_cached_tokens = Some(hit_tokens);
                        self.counters.admitted_requests += 1;
                        self.counters.admitted_query_tokens += req.prompt_len as u64;
                        self.counters.admitted_hit_tokens += hit_tokens as u64;
                        if hit_tokens > 0 {
                            self.counters.request_cache_hits += 1;
                        } else {
                            self.counters.request_cache_misses += 1;
                        }
                    }
                }
                plan.scheduled.push(Scheduled { id, num_tokens: n });
                budget -= n;
            }
        }

        let used = self.kv.pool.num_used();
        if used > self.counters.peak_used_blocks {
            self.counters.peak_used_blocks = used;
        }
        plan.work = self.work_of(&plan.scheduled);
        plan.work.lora = self.make_resident(&batch_loras);
        plan.duration = if plan.scheduled.is_empty() {
            0.0
        } else {
            self.cfg.timing.step_time(&plan.work)
        };
        plan
    }

    /// Load and activate the adapters the step's batch uses, in batch order (as
    /// vLLM's worker applies them while preparing the step's inputs); what was
    /// not resident adds its cost to this step, so every request in the batch
    /// waits for it.
    fn make_resident(&mut self, batch_loras: &[LoraId]) -> Residency {
        let mut r = Residency::default();
        let Some(cache) = self.loras.as_mut() else {
            return r;
        };
        for &l in batch_loras {
            r += cache.ensure(l);
        }
        self.counters.lora_loads += r.loads as u64;
        self.counters.lora_activations += r.activations as u64;
        r
    }

    /// `/v1/load_lora_adapter`: vLLM's `add_lora` loads the adapter into the
    /// host cache and activates it right away, so its first request pays
    /// nothing (the call itself is not timed here).
    pub fn load_lora(&mut self, id: LoraId) {
        if let Some(c) = self.loras.as_mut() {
            c.ensure(id);
        }
    }

    /// The adapter was unloaded: free its slot and host copy. Requests still
    /// running with it load it again at their next step, as vLLM's worker
    /// would from the request's own `LoRARequest`.
    pub fn unload_lora(&mut self, id: LoraId) {
        if let Some(c) = self.loras.as_mut() {
            c.remove(id);
        }
    }

    /// Distinct adapters with at least one running / waiting request, in
    /// queue order (what `vllm:lora_requests_info` reports).
    pub fn lora_adapters(&self) -> (Vec<LoraId>, Vec<LoraId>) {
        let distinct = |ids: &mut dyn Iterator<Item = &ReqId>| {
            let mut out: Vec<LoraId> = Vec::new();
            for l in ids.filter_map(|id| self.reqs.get(id).and_then(|r| r.lora)) {
                add_distinct(&mut out, l);
            }
            out
        };
        (
            distinct(&mut self.running.iter()),
            distinct(&mut self.waiting.iter()),
        )
    }

    fn work_of(&self, scheduled: &[Scheduled]) -> StepWork {
        let mut w = StepWork::default();
        for s in scheduled {
            let Some(req) = self.reqs.get(&s.id) else {
                continue;
            };
            let c = req.num_computed;
            let is_decode = s.num_tokens == 1 && req.num_output() > 0 && c + 1 == req.num_tokens();
            if is_decode {
                w.decode_seqs += 1;
                w.decode_ctx_tokens += c + 1;
            } else {
                let n = s.num_tokens as f64;
                w.prefill_tokens += s.num_tokens;
                w.prefill_attn_pairs += n * c as f64 + n * (n + 1.0) / 2.0;
            }
        }
        w
    }

    /// Apply a planned step after its duration has elapsed: advance computed
    /// tokens, sample one token for every request whose prompt (or recompute)
    /// is complete, and finish requests. `now` must already be the step's end.
    pub fn complete_step(&mut self, plan: &StepPlan) -> Vec<Output> {
        self.counters.steps += 1;
        self.counters.busy_time += plan.duration;
        self.counters.prefill_tokens_computed += plan.work.prefill_tokens as u64;
        let bs = self.cfg.block_size;
        let max_len = self.cfg.max_model_len;
        let mut outs = Vec::new();
        let mut finished = Vec::new();
        for s in &plan.scheduled {
            let Some(req) = self.reqs.get_mut(&s.id) else {
                continue; // aborted during the step
            };
            if req.status != Status::Running {
                continue;
            }
            req.num_computed = (req.num_computed + s.num_tokens).min(req.num_tokens());
            if req.num_computed < req.num_tokens() {
                continue; // partial prefill chunk: the sampled token is discarded
            }
            if req.pooling {
                // vLLM V1's pooling request: the prefill's hidden states are pooled and nothing
                // is sampled; the request ends `FINISHED_STOPPED` with no output token (its
                // prompt counted, no generation token).
                req.first_token_time = Some(self.now);
                self.counters.prompt_tokens += req.prompt_len as u64;
                outs.push(Output {
                    id: s.id,
                    token: 0,
                    first: true,
                    finished: Some(FinishReason::Stop),
                    prompt_tokens: req.prompt_len,
                    completion_tokens: 0,
                    cached_tokens: req.num_cached_tokens.unwrap_or(0),
                    preemptions: req.num_preemptions,
                });
                finished.push((s.id, FinishReason::Stop));
                continue;
            }
            let tok = req.next_output_token();
            req.tokens.push(tok);
            req.update_hashes(bs);
            let first = req.num_output() == 1;
            if first {
                req.first_token_time = Some(self.now);
                self.counters.prompt_tokens += req.prompt_len as u64;
            }
            self.counters.generation_tokens += 1;
            let reason = if req.num_output() >= req.max_output {
                Some(req.finish_reason)
            } else if req.num_tokens() >= max_len {
                Some(FinishReason::Length)
            } else {
                None
            };
            outs.push(Output {
                id: s.id,
                token: tok,
                first,
                finished: reason,
                prompt_tokens: req.prompt_len,
                completion_tokens: req.num_output(),
                cached_tokens: req.num_cached_tokens.unwrap_or(0),
                preemptions: req.num_preemptions,
            });
            if let Some(r) = reason {
                finished.push((s.id, r));
            }
        }
        for (id, r) in finished {
            self.running.retain(|&x| x != id);
            self.kv.free(id);
            if let Some(req) = self.reqs.remove(&id) {
                self.counters.finished_prompt_tokens += req.prompt_len as u64;
                self.counters.finished_cached_tokens += req.num_cached_tokens.unwrap_or(0) as u64;
            }
            match r {
                FinishReason::Stop => self.counters.finished_stop += 1,
                FinishReason::Length => self.counters.finished_length += 1,
            }
        }
        outs
    }

    pub fn finished_total(&self) -> u64 {
        self.counters.finished_stop + self.counters.finished_length
    }

    pub fn reset_prefix_cache(&mut self) -> bool {
        self.kv.reset_prefix_cache()
    }
}

/// Drive an engine on a purely virtual clock (tests and offline studies):
/// `arrivals` are `(time, request)` sorted by time. Returns per-request
/// `(id, arrival, first token time, finish time)` in completion order.
#[cfg(test)]
pub fn simulate(
    engine: &mut Engine,
    arrivals: Vec<(f64, NewRequest)>,
) -> Vec<(ReqId, f64, f64, f64)> {
    let mut pending: VecDeque<(f64, NewRequest)> = arrivals.into();
    let mut first: HashMap<ReqId, (f64, f64)> = HashMap::new();
    let mut done = Vec::new();
    loop {
        while let Some((t, _)) = pending.front() {
            if *t <= engine.now {
                if let Some((t, r)) = pending.pop_front() {
                    let saved = engine.now;
                    engine.now = t;
                    let id = engine.add_request(r);
                    engine.now = saved;
                    first.insert(id, (t, f64::NAN));
                }
            } else {
                break;
            }
        }
        if !engine.has_work() {
            match pending.front() {
                Some((t, _)) => {
                    engine.now = *t;
                    continue;
                }
                None => break,
            }
        }
        let plan = engine.schedule();
        if plan.scheduled.is_empty() {
            if plan.preempted.is_empty() {
                break; // cannot make progress (would hang a real pod too)
            }
            continue;
        }
        engine.now += plan.duration;
        for o in engine.complete_step(&plan) {
            if o.first {
                if let Some(e) = first.get_mut(&o.id) {
                    e.1 = engine.now;
                }
            }
            if o.finished.is_some() {
                let (a, f) = first.remove(&o.id).unwrap_or((f64::NAN, f64::NAN));
                done.push((o.id, a, f, engine.now));
            }
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filler() -> Vec<u32> {
        (1000..1064).collect()
    }

    fn req(prompt: Vec<u32>, out: usize) -> NewRequest {
        NewRequest {
            prompt,
            max_output: out,
            finish_reason: FinishReason::Length,
            cache_salt: None,
            output_seed: 7,
            lora: None,
            pooling: false,
        }
    }

    fn lora_req(prompt: Vec<u32>, out: usize, lora: LoraId) -> NewRequest {
        NewRequest {
            lora: Some(LoraRef {
                id: lora,
                name: format!("adapter-{lora}"),
            }),
            ..req(prompt, out)
        }
    }

    fn lora_cfg(max_loras: usize, max_cpu_loras: usize) -> EngineConfig {
        EngineConfig {
            lora: Some(LoraConfig {
                max_loras,
                max_cpu_loras,
            }),
            ..cfg()
        }
    }

    fn unique_prompt(tag: u32, len: usize) -> Vec<u32> {
        (0..len as u32).map(|i| tag * 100_000 + i).collect()
    }

    fn cfg() -> EngineConfig {
        EngineConfig {
            block_size: 16,
            num_gpu_blocks: 1024,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 32768,
            enable_prefix_caching: true,
            timing: TimingModel::default(),
            lora: None,
        }
    }

    #[test]
    fn timing_formula() {
        let t = TimingModel {
            step_overhead: 1.0,
            prefill_token: 0.1,
            decode_seq: 0.01,
            decode_ctx_token: 0.001,
            prefill_attn_pair: 0.0001,
            lora_load: 10.0,
            lora_activate: 100.0,
        };
        let w = StepWork {
            prefill_tokens: 10,
            prefill_attn_pairs: 100.0,
            decode_seqs: 3,
            decode_ctx_tokens: 50,
            lora: Residency {
                loads: 2,
                activations: 1,
            },
        };
        let expect = 1.0 + 1.0 + 0.01 + 0.03 + 0.05 + 20.0 + 100.0;
        assert!((t.step_time(&w) - expect).abs() < 1e-12);
    }

    #[test]
    fn single_request_ttft_and_decode_on_virtual_clock() {
        let mut e = Engine::new(cfg(), &filler());
        let done = simulate(&mut e, vec![(0.0, req(unique_prompt(1, 1000), 10))]);
        assert_eq!(done.len(), 1);
        let (_, arrival, first, end) = done[0];
        let t = TimingModel::default();
        let prefill = t.step_overhead
            + 1000.0 * t.prefill_token
            + 1000.0 * 1001.0 / 2.0 * t.prefill_attn_pair;
        assert!(
            (first - arrival - prefill).abs() < 1e-9,
            "ttft {}",
            first - arrival
        );
        // 9 more decode steps, contexts 1001..1009 (+1 for the new token).
        let mut dec = 0.0;
        for c in 1000..1009 {
            dec += t.step_overhead + t.decode_seq + (c + 1) as f64 * t.decode_ctx_token;
        }
        assert!((end - first - dec).abs() < 1e-9);
        assert_eq!(e.counters.prompt_tokens, 1000);
        assert_eq!(e.counters.generation_tokens, 10);
        assert_eq!(e.counters.finished_length, 1);
        assert_eq!(e.kv.pool.num_used(), 0);
    }

    /// A pooling request (an embedding) is its prefill alone: it ends, stopped, in the step that
    /// completes its prompt (a chunked one's last chunk), samples no token, counts its prompt
    /// and no generation token, frees its blocks, and leaves them cached for the next request.
    #[test]
    fn a_pooling_request_is_a_prefill_with_no_output() {
        let mut e = Engine::new(
            EngineConfig {
                max_num_batched_tokens: 512,
                ..cfg()
            },
            &filler(),
        );
        let pooling = |prompt| NewRequest {
            pooling: true,
            ..req(prompt, 0)
        };
        let p = unique_prompt(9, 1000);
        let id = e.add_request(pooling(p.clone()));
        let mut outs = Vec::new();
        let mut steps = 0;
        while e.has_work() {
            let plan = e.schedule();
            assert!(e.kv.pool.num_used() > 0, "the prefill holds its blocks");
            steps += 1;
            outs.extend(e.complete_step(&plan));
        }
        assert_eq!(steps, 2, "two chunks of at most 512");
        assert_eq!(outs.len(), 1);
        let o = &outs[0];
        assert_eq!(
            (o.id, o.first, o.finished),
            (id, true, Some(FinishReason::Stop))
        );
        assert_eq!((o.prompt_tokens, o.completion_tokens), (1000, 0));
        let c = &e.counters;
        assert_eq!((c.prompt_tokens, c.generation_tokens), (1000, 0));
        assert_eq!((c.finished_stop, c.finished_length), (1, 0));
        assert_eq!(e.kv.pool.num_used(), 0);
        assert!(e.reqs.is_empty() && e.running.is_empty());

        e.add_request(pooling(p));
        let plan = e.schedule();
        let outs = e.complete_step(&plan);
        assert_eq!(outs[0].cached_tokens, 992, "all but the last block cached");
        assert_eq!(e.counters.prefix_hits, 992);
    }

    #[test]
    fn repeated_prompt_hits_cache_and_is_much_faster() {
        let mut e = Engine::new(cfg(), &filler());
        let p = unique_prompt(2, 4000);
        let d1 = simulate(&mut e, vec![(0.0, req(p.clone(), 2))]);
        let t0 = e.now;
        let d2 = simulate(&mut e, vec![(t0, req(p.clone(), 2))]);
        let ttft1 = d1[0].2 - d1[0].1;
        let ttft2 = d2[0].2 - d2[0].1;
        // 4000 = 250 blocks; the last block is recomputed (hit 249 blocks).
        assert_eq!(e.counters.prefix_hits, 249 * 16);
        assert_eq!(e.counters.prefix_queries, 8000);
        assert!(ttft2 < ttft1 * 0.1, "{ttft2} vs {ttft1}");
    }

    #[test]
    fn chunked_prefill_respects_token_budget() {
        let mut c = cfg();
        c.max_num_batched_tokens = 512;
        let mut e = Engine::new(c, &filler());
        e.add_request(req(unique_prompt(3, 1200), 3));
        e.add_request(req(unique_prompt(4, 100), 3));
        let p1 = e.schedule();
        assert_eq!(
            p1.scheduled,
            vec![Scheduled {
                id: 1,
                num_tokens: 512
            }]
        );
        e.now += p1.duration;
        assert!(
            e.complete_step(&p1).is_empty(),
            "partial chunk emits nothing"
        );
        let p2 = e.schedule();
        assert_eq!(
            p2.scheduled,
            vec![Scheduled {
                id: 1,
                num_tokens: 512
            }]
        );
        e.complete_step(&p2);
        let p3 = e.schedule();
        // 176 tokens finish request 1's prefill; request 2 gets the rest.
        assert_eq!(
            p3.scheduled,
            vec![
                Scheduled {
                    id: 1,
                    num_tokens: 176
                },
                Scheduled {
                    id: 2,
                    num_tokens: 100
                }
            ]
        );
        assert_eq!(p3.work.prefill_tokens, 276);
        let outs = e.complete_step(&p3);
        assert_eq!(outs.len(), 2);
        assert!(outs.iter().all(|o| o.first));
        let p4 = e.schedule();
        assert_eq!(p4.work.decode_seqs, 2);
        assert_eq!(p4.work.prefill_tokens, 0);
    }

    #[test]
    fn max_num_seqs_limits_admission() {
        let mut c = cfg();
        c.max_num_seqs = 3;
        let mut e = Engine::new(c, &filler());
        for i in 0..5 {
            e.add_request(req(unique_prompt(10 + i, 50), 5));
        }
        let p = e.schedule();
        assert_eq!(p.scheduled.len(), 3);
        assert_eq!(e.num_running(), 3);
        assert_eq!(e.num_waiting(), 2);
    }

    #[test]
    fn admission_waits_for_free_blocks() {
        let mut c = cfg();
        c.num_gpu_blocks = 10; // 160 tokens
        let mut e = Engine::new(c, &filler());
        e.add_request(req(unique_prompt(20, 100), 5)); // 7 blocks
        e.add_request(req(unique_prompt(21, 100), 5)); // would need 7 more
        let p = e.schedule();
        assert_eq!(p.scheduled.len(), 1);
        assert_eq!(e.num_waiting(), 1);
        // Each blocked lookup is counted again, as in vLLM.
        e.now += p.duration;
        e.complete_step(&p);
        let p = e.schedule();
        assert_eq!(p.scheduled.len(), 1);
        assert_eq!(e.counters.prefix_queries, 100 + 100 + 100);
        assert_eq!(e.counters.admitted_requests, 1);
    }

    #[test]
    fn decode_growth_preempts_most_recently_admitted() {
        let mut c = cfg();
        c.num_gpu_blocks = 8; // 128 tokens
        let mut e = Engine::new(c, &filler());
        // Three 32-token prompts: 2 blocks each, 6 of 8 blocks at admission.
        for i in 0..3 {
            e.add_request(req(unique_prompt(30 + i, 32), 40));
        }
        let p = e.schedule();
        assert_eq!(p.scheduled.len(), 3);
        assert_eq!(e.kv.pool.num_used(), 6);
        e.now += p.duration;
        e.complete_step(&p);
        // Next step: each needs a 3rd block for its 33rd token; only 2 free.
        let p = e.schedule();
        assert_eq!(p.preempted, vec![3], "the most recently admitted goes");
        assert_eq!(p.scheduled.len(), 2);
        assert_eq!(e.waiting.front(), Some(&3));
        assert_eq!(e.counters.preemptions, 1);
        let r3 = &e.reqs[&3];
        assert_eq!(r3.num_computed, 0);
        assert_eq!(
            r3.num_output(),
            1,
            "generated tokens are kept and recomputed"
        );
        // Run everything to completion: all finish despite preemptions.
        let done = simulate(&mut e, vec![]);
        assert_eq!(done.len(), 3);
        assert_eq!(e.counters.finished_length, 3);
        assert!(e.counters.preemptions >= 1);
        assert!(e.counters.peak_used_blocks <= 8);
        assert_eq!(e.kv.pool.num_used(), 0);
    }

    #[test]
    fn preempted_request_reuses_its_cached_blocks() {
        let mut c = cfg();
        c.num_gpu_blocks = 8;
        let mut e = Engine::new(c, &filler());
        for i in 0..3 {
            e.add_request(req(unique_prompt(40 + i, 32), 40));
        }
        let p = e.schedule();
        e.now += p.duration;
        e.complete_step(&p);
        let p = e.schedule();
        assert_eq!(p.preempted, vec![3]);
        e.now += p.duration;
        e.complete_step(&p);
        // Request 3's two full prompt blocks are still cached (ref 0, LRU).
        let r3 = &e.reqs[&3];
        let hit =
            e.kv.find_longest_cache_hit(&r3.block_hashes, r3.num_tokens() - 1);
        assert_eq!(hit.len(), 2);
        assert_eq!(r3.num_cached_tokens, Some(0));
    }

    #[test]
    fn abort_frees_blocks() {
        let mut e = Engine::new(cfg(), &filler());
        let id = e.add_request(req(unique_prompt(50, 300), 100));
        let p = e.schedule();
        e.now += p.duration;
        e.complete_step(&p);
        assert!(e.kv.pool.num_used() > 0);
        assert!(e.abort(id));
        assert_eq!(e.kv.pool.num_used(), 0);
        assert!(!e.has_work());
        assert_eq!(e.counters.finished_abort, 1);
        // Its blocks stay cached for the next request with the same prefix.
        let id2 = e.add_request(req(unique_prompt(50, 300), 1));
        e.schedule();
        assert_eq!(e.reqs[&id2].num_cached_tokens, Some(288));
    }

    #[test]
    fn at_most_max_loras_adapters_share_a_batch_and_the_others_wait_their_turn() {
        let mut e = Engine::new(lora_cfg(2, 2), &filler());
        let a = e.add_request(lora_req(unique_prompt(60, 64), 3, 1));
        let b = e.add_request(lora_req(unique_prompt(61, 64), 3, 2));
        let c = e.add_request(lora_req(unique_prompt(62, 64), 3, 3));
        let base = e.add_request(req(unique_prompt(63, 64), 3));
        let d = e.add_request(lora_req(unique_prompt(64, 64), 3, 1));
        let p = e.schedule();
        let ids: Vec<ReqId> = p.scheduled.iter().map(|s| s.id).collect();
        // The third adapter is skipped; the base model and a request for an
        // adapter already in the batch are admitted past it.
        assert_eq!(ids, vec![a, b, base, d]);
        assert_eq!(e.waiting, VecDeque::from(vec![c]));
        assert_eq!(e.lora_adapters(), (vec![1, 2], vec![3]));
        e.now += p.duration;
        e.complete_step(&p);
        // While adapters 1 and 2 keep running, adapter 3 still waits.
        let p = e.schedule();
        assert_eq!(p.scheduled.len(), 4);
        assert_eq!(e.num_waiting(), 1);
        let done = simulate(&mut e, vec![]);
        assert_eq!(done.len(), 5, "adapter 3 runs once a slot frees");
        assert_eq!(e.counters.lora_loads, 3);
    }

    #[test]
    fn a_skipped_request_keeps_its_place_ahead_of_later_arrivals() {
        let mut c = lora_cfg(1, 1);
        c.max_num_seqs = 2;
        let mut e = Engine::new(c, &filler());
        let a = e.add_request(lora_req(unique_prompt(70, 32), 2, 1));
        let b = e.add_request(lora_req(unique_prompt(71, 32), 2, 2));
        let p = e.schedule();
        assert_eq!(p.scheduled.len(), 1);
        let later = e.add_request(lora_req(unique_prompt(72, 32), 2, 3));
        assert_eq!(e.waiting, VecDeque::from(vec![b, later]));
        let done = simulate(&mut e, vec![]);
        let order: Vec<ReqId> = done.iter().map(|d| d.0).collect();
        assert_eq!(order, vec![a, b, later]);
    }

    #[test]
    fn a_non_resident_adapter_delays_its_first_token_by_the_load_time() {
        let t = TimingModel::default();
        let ttft = |preload: bool| {
            let mut e = Engine::new(lora_cfg(1, 1), &filler());
            if preload {
                e.load_lora(5);
            }
            let d = simulate(&mut e, vec![(0.0, lora_req(unique_prompt(80, 500), 4, 5))]);
            (d[0].2 - d[0].1, e.counters.lora_loads)
        };
        let (cold, cold_loads) = ttft(false);
        let (warm, warm_loads) = ttft(true);
        assert_eq!((cold_loads, warm_loads), (1, 0));
        assert!(
            (cold - warm - t.lora_load - t.lora_activate).abs() < 1e-9,
            "cold {cold} warm {warm}"
        );
    }

    #[test]
    fn adapters_beyond_the_slots_are_evicted_least_recently_used_first() {
        // One slot, sequential requests A, B, A: every switch reloads from disk.
        let run = |max_cpu_loras: usize| {
            let mut e = Engine::new(lora_cfg(1, max_cpu_loras), &filler());
            let arrivals = [1, 2, 1]
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as f64, lora_req(unique_prompt(90 + i as u32, 64), 2, l)))
                .collect();
            assert_eq!(simulate(&mut e, arrivals).len(), 3);
            (e.counters.lora_loads, e.counters.lora_activations)
        };
        assert_eq!(run(1), (3, 3));
        // A host cache for two keeps A loaded: switching back is only a copy.
        assert_eq!(run(2), (2, 3));
    }

    #[test]
    fn a_prompt_shares_cached_blocks_only_under_the_same_adapter() {
        let mut e = Engine::new(lora_cfg(2, 2), &filler());
        let p = unique_prompt(95, 320);
        simulate(&mut e, vec![(0.0, lora_req(p.clone(), 1, 1))]);
        let t = e.now;
        simulate(&mut e, vec![(t, req(p.clone(), 1))]);
        simulate(&mut e, vec![(t + 1.0, lora_req(p.clone(), 1, 2))]);
        assert_eq!(e.counters.prefix_hits, 0, "base model and adapter 2 miss");
        simulate(&mut e, vec![(t + 2.0, lora_req(p, 1, 1))]);
        assert_eq!(e.counters.prefix_hits, 304);
    }

    #[test]
    fn base_model_requests_time_the_same_with_lora_enabled() {
        let arrivals = || {
            (0..20)
                .map(|i| (i as f64 * 0.01, req(unique_prompt(200 + i, 700), 16)))
                .collect::<Vec<_>>()
        };
        let mut off = Engine::new(cfg(), &filler());
        let mut on = Engine::new(lora_cfg(2, 4), &filler());
        assert_eq!(
            simulate(&mut off, arrivals()),
            simulate(&mut on, arrivals())
        );
        assert_eq!(on.counters.lora_loads, 0);
    }

    #[test]
    fn saturation_throughput_plateaus_on_virtual_clock() {
        // Offered load sweep with deterministic arrivals: throughput follows the
        // offered load, then flattens while TTFT grows.
        let mut results = Vec::new();
        for rate in [2.0, 8.0, 32.0, 128.0] {
            let mut e = Engine::new(cfg(), &filler());
            let n = 200;
            let arrivals: Vec<(f64, NewRequest)> = (0..n)
                .map(|i| {
                    (
                        i as f64 / rate,
                        req(unique_prompt(1000 + i as u32, 1024), 64),
                    )
                })
                .collect();
            let done = simulate(&mut e, arrivals);
            assert_eq!(done.len(), n);
            let span = done.iter().map(|d| d.3).fold(0.0, f64::max);
            let thr = n as f64 / span;
            let ttft = done.iter().map(|d| d.2 - d.1).sum::<f64>() / n as f64;
            results.push((rate, thr, ttft));
        }
        assert!((results[0].1 / 2.0 - 1.0).abs() < 0.1, "{results:?}");
        assert!(results[2].1 > results[1].1);
        assert!(
            (results[3].1 - results[2].1).abs() / results[3].1 < 0.35,
            "{results:?}"
        );
        assert!(results[3].2 > 5.0 * results[0].2, "{results:?}");
    }
}
