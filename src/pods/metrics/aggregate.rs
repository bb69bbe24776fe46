//! Folding a pod's samples into its figures: summed across the pod's engines and max within one
//! (`PerEngine`), max over every series (`Peak`), settings every series must agree on (`Agreed`),
//! and the plausibility checks each value passes first. One bad value makes its figure unknown.

use super::figures::{AnswerTotals, Engine, ItlTotals, MetricsError, PodMetrics};
use super::series::{Labels, Metric};
use crate::hash::fnv1a;

/// More distinct engines than this in one pod is not a real deployment; the figure becomes `None`.
pub(super) const MAX_GROUPS: usize = 64;
/// Engines round their usage ratio; anything further above 1 is not a ratio.
const KV_USAGE_SLACK: f64 = 0.01;
/// Largest integer an f64 carries exactly; token and block counts beyond it are not believable.
const MAX_EXACT: u64 = 1 << 53;

/// Per-engine values of one figure: max within an engine, summed across engines.
#[derive(Clone, Copy)]
struct PerEngine {
    keys: [u64; MAX_GROUPS],
    values: [f64; MAX_GROUPS],
    len: usize,
    poisoned: bool,
}

impl PerEngine {
    const fn new() -> Self {
        Self {
            keys: [0; MAX_GROUPS],
            values: [0.0; MAX_GROUPS],
            len: 0,
            poisoned: false,
        }
    }

    fn is_empty(&self) -> bool {
        self.len == 0 && !self.poisoned
    }

    fn add(&mut self, key: u64, value: Option<f64>) {
        let Some(value) = value else {
            self.poisoned = true;
            return;
        };
        let used = self.len;
        for (k, v) in self.keys.iter().zip(self.values.iter_mut()).take(used) {
            if *k == key {
                *v = v.max(value);
                return;
            }
        }
        match (self.keys.get_mut(used), self.values.get_mut(used)) {
            (Some(k), Some(v)) => {
                *k = key;
                *v = value;
                self.len += 1;
            }
            _ => self.poisoned = true,
        }
    }

    fn total(&self) -> Option<f64> {
        if self.poisoned || self.len == 0 {
            return None;
        }
        // Each value is finite, but two huge ones can still sum to infinity.
        Some(self.values.iter().take(self.len).sum::<f64>()).filter(|t| t.is_finite())
    }

    fn total_whole(&self) -> Option<u64> {
        self.total().and_then(whole)
    }
}

/// Max over every series.
#[derive(Clone, Copy, Default)]
struct Peak {
    value: Option<f64>,
    poisoned: bool,
}

impl Peak {
    fn is_empty(&self) -> bool {
        self.value.is_none() && !self.poisoned
    }

    fn add(&mut self, value: Option<f64>) {
        match value {
            Some(v) => self.value = Some(self.value.map_or(v, |old| old.max(v))),
            None => self.poisoned = true,
        }
    }

    fn get(&self) -> Option<f64> {
        self.value.filter(|_| !self.poisoned)
    }
}

/// A setting every series must agree on.
#[derive(Clone, Copy, Default)]
struct Agreed {
    value: Option<u64>,
    poisoned: bool,
}

impl Agreed {
    fn add(&mut self, value: Option<u64>) {
        match (value, self.value) {
            (Some(v), Some(old)) if v != old => self.poisoned = true,
            (Some(v), _) => self.value = Some(v),
            (None, _) => self.poisoned = true,
        }
    }

    fn get(&self) -> Option<u64> {
        self.value.filter(|_| !self.poisoned)
    }
}

/// One body's figures as its samples are read: filled sample by sample by `apply`, read once by
/// `finish`.
pub(super) struct Tally {
    saw_vllm: bool,
    saw_sglang: bool,
    running: PerEngine,
    waiting: PerEngine,
    kv: Peak,
    kv_legacy: Peak,
    info_block_size: Agreed,
    info_blocks: PerEngine,
    info_tokens: PerEngine,
    gauge_page_size: Agreed,
    gauge_pages: PerEngine,
    gauge_tokens: PerEngine,
    hits: [PerEngine; 4],
    queries: [PerEngine; 4],
    preemptions: [PerEngine; 2],
    itl_sum: [PerEngine; 2],
    itl_count: [PerEngine; 2],
    answer_tokens: PerEngine,
    answers: PerEngine,
    /// The model the answers' series are labelled with (its name's hash): one for all of them.
    answers_model: Agreed,
    no_prefix_caching: bool,
}

impl Tally {
    pub(super) fn new() -> Self {
        Self {
            saw_vllm: false,
            saw_sglang: false,
            running: PerEngine::new(),
            waiting: PerEngine::new(),
            kv: Peak::default(),
            kv_legacy: Peak::default(),
            info_block_size: Agreed::default(),
            info_blocks: PerEngine::new(),
            info_tokens: PerEngine::new(),
            gauge_page_size: Agreed::default(),
            gauge_pages: PerEngine::new(),
            gauge_tokens: PerEngine::new(),
            hits: [PerEngine::new(); 4],
            queries: [PerEngine::new(); 4],
            preemptions: [PerEngine::new(); 2],
            itl_sum: [PerEngine::new(); 2],
            itl_count: [PerEngine::new(); 2],
            answer_tokens: PerEngine::new(),
            answers: PerEngine::new(),
            answers_model: Agreed::default(),
            no_prefix_caching: false,
        }
    }

    pub(super) fn apply(
        &mut self,
        engine: Engine,
        metric: Metric,
        value: f64,
        labels: &Labels<'_>,
    ) {
        match engine {
            Engine::Vllm => self.saw_vllm = true,
            Engine::Sglang => self.saw_sglang = true,
            Engine::Unknown => {}
        }
        let key = labels.engine_key();
        match metric {
            Metric::Running => self.running.add(key, count(value)),
            Metric::Waiting => self.waiting.add(key, count(value)),
            Metric::KvUsage => self.kv.add(fraction(value)),
            Metric::KvUsageLegacy => self.kv_legacy.add(fraction(value)),
            // An info gauge's value is a constant 1; the labels are the data.
            Metric::CacheInfo => {
                let (size, blocks, tokens) = match engine {
                    Engine::Vllm => (
                        labels.block_size,
                        labels.num_gpu_blocks,
                        labels.kv_cache_size_tokens,
                    ),
                    _ => (
                        labels.page_size,
                        labels.num_pages,
                        labels.max_total_num_tokens,
                    ),
                };
                self.no_prefix_caching |= labels
                    .enable_prefix_caching
                    .is_some_and(|v| v.eq_ignore_ascii_case("false"));
                self.info_block_size.add(label_whole(size));
                self.info_blocks
                    .add(key, label_whole(blocks).map(|n| n as f64));
                self.info_tokens
                    .add(key, label_whole(tokens).map(|n| n as f64));
            }
            Metric::PageSize => self.gauge_page_size.add(whole(value)),
            Metric::NumPages => self.gauge_pages.add(key, whole(value).map(|n| n as f64)),
            Metric::MaxTotalTokens => self.gauge_tokens.add(key, whole(value).map(|n| n as f64)),
            // Counters kept per name variant (vLLM's and SGLang's, old and new), summed over engines.
            Metric::PrefixHits(i) => add_counter(&mut self.hits, i, labels.part_key(), value),
            Metric::PrefixQueries(i) => add_counter(&mut self.queries, i, key, value),
            Metric::Preemptions(i) => add_counter(&mut self.preemptions, i, key, value),
            Metric::ItlSum(i) => add_counter(&mut self.itl_sum, i, key, value),
            Metric::ItlCount(i) => add_counter(&mut self.itl_count, i, key, value),
            Metric::AnswerTokens | Metric::Answers => {
                let totals = match metric {
                    Metric::AnswerTokens => &mut self.answer_tokens,
                    _ => &mut self.answers,
                };
                totals.add(key, count(value));
                self.answers_model
                    .add(labels.model_name.map(|m| fnv1a(m.as_bytes())));
            }
        }
    }

    pub(super) fn finish(&self) -> Result<PodMetrics, MetricsError> {
        let engine = match (self.saw_vllm, self.saw_sglang) {
            (true, false) => Engine::Vllm,
            (false, true) => Engine::Sglang,
            (true, true) => return Err(MetricsError::MixedEngines),
            (false, false) => return Err(MetricsError::NoKnownMetrics),
        };
        let kv_usage = if self.kv.is_empty() {
            self.kv_legacy.get()
        } else {
            self.kv.get()
        };
        let block_size = self.info_block_size.get().or(self.gauge_page_size.get());
        let num_gpu_blocks = self
            .info_blocks
            .total_whole()
            .or(self.gauge_pages.total_whole());
        let capacity_tokens = self
            .info_tokens
            .total_whole()
            .or(self.gauge_tokens.total_whole())
            .or_else(|| {
                num_gpu_blocks
                    .zip(block_size)
                    .and_then(|(n, b)| n.checked_mul(b))
                    .filter(|t| *t <= MAX_EXACT)
            });
        Ok(PodMetrics {
            engine,
            running: self.running.total(),
            waiting: self.waiting.total(),
            kv_usage,
            block_size,
            num_gpu_blocks,
            capacity_tokens,
            prefix_cache_hits: first_present(&self.hits),
            prefix_cache_queries: first_present(&self.queries),
            preemptions: first_present(&self.preemptions),
            no_prefix_caching: self.no_prefix_caching,
            itl: self.itl(),
            answers: self.answers(),
        })
    }

    /// The finished answers' totals, when every series of them names the same model.
    fn answers(&self) -> Option<AnswerTotals> {
        Some(AnswerTotals {
            model: self.answers_model.get()?,
            tokens: self.answer_tokens.total()?,
            count: self.answers.total()?,
        })
    }

    /// The inter-token latency totals of the first name variant whose count appeared, its sum
    /// from the same variant: an older name's sum never pairs with the newer name's count.
    fn itl(&self) -> Option<ItlTotals> {
        let i = self.itl_count.iter().position(|g| !g.is_empty())?;
        Some(ItlTotals {
            sum_s: self.itl_sum.get(i)?.total()?,
            count: self.itl_count.get(i)?.total()?,
        })
    }
}
/// The first name variant that appeared at all decides, so `_total` and bare series of the same
/// counter are never added together.
fn first_present(variants: &[PerEngine]) -> Option<f64> {
    variants
        .iter()
        .find(|g| !g.is_empty())
        .and_then(PerEngine::total)
}

fn add_counter(variants: &mut [PerEngine], i: usize, key: u64, value: f64) {
    if let Some(g) = variants.get_mut(i) {
        g.add(key, count(value));
    }
}

fn count(v: f64) -> Option<f64> {
    // `+ 0.0` turns -0.0 into 0.0.
    (v.is_finite() && v >= 0.0).then_some(v + 0.0)
}

fn fraction(v: f64) -> Option<f64> {
    (v.is_finite() && (0.0..=1.0 + KV_USAGE_SLACK).contains(&v)).then_some(v.min(1.0) + 0.0)
}

fn whole(v: f64) -> Option<u64> {
    (v.is_finite() && v >= 1.0 && v.fract() == 0.0 && v <= MAX_EXACT as f64).then_some(v as u64)
}

/// vLLM writes Python's `str()` of each setting, so an unset one reads `"None"`; that, like any
/// non-number or zero, is unknown.
fn label_whole(raw: Option<&str>) -> Option<u64> {
    raw?.parse::<u64>()
        .ok()
        .filter(|n| (1..=MAX_EXACT).contains(n))
}
