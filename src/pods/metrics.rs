//! Owns the reading of one model-server pod's Prometheus `/metrics` body (text exposition 0.0.4,
//! and the OpenMetrics variant) into the few load and KV-cache figures kvgate routes on. It is
//! host-agnostic and allocation-free: the shell fetches the body on a scrape tick and hands it here.
//!
//! Decisions a reader needs, because the exposition alone does not settle them:
//!
//! * **Several series of one metric.** A pod can run several engines: vLLM data-parallel ranks
//!   (`engine="0"`, `engine="1"`), SGLang DP-attention ranks (`dp_rank`). Those hold different
//!   requests and different KV pools, so requests, KV capacity and counters are **summed** across
//!   them. Series that differ only in other labels are copies of one scheduler's view (SGLang's
//!   `--enable-metrics-for-all-schedulers` repeats it per `tp_rank`/`pp_rank`; vLLM's multi-process
//!   gauges may carry a `pid`), so the **max** is taken within such a group, never the sum. The
//!   labels that name a distinct engine are `model_name`, `name` (old SGLang), `engine` and
//!   `dp_rank`. KV usage is the **max** over every series: the fullest engine is the one that
//!   preempts first, and a router that underestimates fullness overloads the pod.
//! * **SGLang priority breakdowns.** With priority scheduling SGLang exports the total under
//!   `priority=""` and a per-priority split beside it; series with a non-empty `priority` label
//!   are skipped so requests are not counted twice.
//! * **Implausible values** are not repaired. Counts and counters must be finite and >= 0. KV usage
//!   must lie in 0..=1 (an overshoot of up to 0.01 is rounding and is clamped to 1); anything else,
//!   including values that look like percentages (e.g. `85`), is dropped, since `1.5` could mean
//!   1.5 % or 150 % and a guess would be a made-up number. One bad series makes the whole figure
//!   `None`: the sum of the remaining engines would understate the pod.
//! * **Truncation.** The format requires every line, the last included, to end in `\n`, so a
//!   final line without one is treated as cut off in transit and skipped (`...running 1` may have
//!   been `...running 12`). Truncation exactly at a line boundary cannot be told apart in 0.0.4.
//! * **Bounded work.** Lines longer than [`MAX_LINE_BYTES`] are skipped; a body of more than
//!   [`MAX_LINES`] lines is refused with [`MetricsError::TooManyLines`] rather than half-read.
//! * **KV capacity.** vLLM's own `kv_cache_size_tokens` label (newer releases) wins over
//!   `num_gpu_blocks * block_size`, which is wrong for hybrid attention/Mamba models; SGLang's
//!   `max_total_num_tokens` wins over `num_pages * page_size`. Timestamps are accepted and ignored.

use crate::hash::fnv1a_from;
use core::fmt;

/// Lines longer than this are skipped unread: no series kvgate needs comes near it, while a line
/// of this size is either a label explosion or garbage.
pub const MAX_LINE_BYTES: usize = 64 * 1024;
/// A body with more lines than this is refused. A vLLM or SGLang pod exposes a few thousand.
pub const MAX_LINES: usize = 50_000;
/// More distinct engines than this in one pod is not a real deployment; the figure becomes `None`.
const MAX_GROUPS: usize = 64;
/// Engines round their usage ratio; anything further above 1 is not a ratio.
const KV_USAGE_SLACK: f64 = 0.01;
/// Largest integer an f64 carries exactly; token and block counts beyond it are not believable.
const MAX_EXACT: u64 = 1 << 53;

/// Which model server produced the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Engine {
    Vllm,
    Sglang,
    /// Never returned by [`parse`]; the state of a pod not yet scraped successfully.
    #[default]
    Unknown,
}

/// What kvgate knows about one pod after a scrape. `None` means unknown, never zero.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PodMetrics {
    pub engine: Engine,
    /// Requests in the running batch, summed over the pod's engines.
    pub running: Option<f64>,
    /// Requests queued, summed over the pod's engines.
    pub waiting: Option<f64>,
    /// KV-cache usage, 0..=1, of the fullest engine.
    pub kv_usage: Option<f64>,
    /// Tokens per KV block (vLLM `block_size`, SGLang `page_size`); `None` if engines disagree.
    pub block_size: Option<u64>,
    /// KV blocks (vLLM `num_gpu_blocks`, SGLang `num_pages`), summed over the pod's engines.
    pub num_gpu_blocks: Option<u64>,
    /// KV capacity in tokens, summed over the pod's engines.
    pub capacity_tokens: Option<u64>,
    /// vLLM prefix-cache hits in tokens since start (counter), summed over engines.
    pub prefix_cache_hits: Option<f64>,
    /// vLLM prefix-cache queries in tokens since start (counter), summed over engines.
    pub prefix_cache_queries: Option<f64>,
    /// vLLM's preemptions since start (counter), summed over engines.
    pub preemptions: Option<f64>,
    /// vLLM's `cache_config_info` says `enable_prefix_caching="False"` for one of the pod's
    /// engines: a prompt it served once is not cached there, and sequences share no blocks.
    pub prefix_caching_off: bool,
}

/// Why a body yielded no metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricsError {
    /// The body is not UTF-8, which the exposition format requires.
    InvalidUtf8,
    /// No line carried a metric kvgate reads: not a vLLM or SGLang endpoint, metrics disabled
    /// (`--disable-log-stats`, SGLang without `--enable-metrics`), or an error page.
    NoKnownMetrics,
    /// Both vLLM and SGLang metrics appeared; which engine's numbers describe the pod is unknown.
    MixedEngines,
    /// More than [`MAX_LINES`] lines.
    TooManyLines,
}

impl fmt::Display for MetricsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::InvalidUtf8 => "metrics body is not valid UTF-8",
            Self::NoKnownMetrics => "metrics body has no vLLM or SGLang metric kvgate reads",
            Self::MixedEngines => "metrics body mixes vLLM and SGLang metrics",
            Self::TooManyLines => "metrics body exceeds the line limit",
        })
    }
}

impl std::error::Error for MetricsError {}

/// [`parse`] for a raw HTTP body; a body that is not UTF-8 is refused as a whole.
pub fn parse_bytes(body: &[u8]) -> Result<PodMetrics, MetricsError> {
    core::str::from_utf8(body)
        .map_err(|_| MetricsError::InvalidUtf8)
        .and_then(parse)
}

/// Reads a `/metrics` body. Lines that do not parse are skipped; so is a last line without its
/// terminating `\n` (see the module notes on truncation).
pub fn parse(text: &str) -> Result<PodMetrics, MetricsError> {
    let mut acc = Acc::new();
    let mut rest = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut lines = 0usize;
    while !rest.is_empty() {
        let (line, terminated) = match rest.split_once('\n') {
            Some((line, next)) => {
                rest = next;
                (line, true)
            }
            None => {
                let line = rest;
                rest = "";
                (line, false)
            }
        };
        lines += 1;
        if lines > MAX_LINES {
            return Err(MetricsError::TooManyLines);
        }
        if line.len() > MAX_LINE_BYTES {
            continue;
        }
        let line = line.strip_suffix('\r').unwrap_or(line);
        let line = line.trim_start_matches([' ', '\t']);
        if line.starts_with('#') {
            if line.trim_end_matches([' ', '\t']) == "# EOF" {
                break;
            }
            continue;
        }
        if !terminated {
            break;
        }
        acc.line(line);
    }
    acc.finish()
}

/// The metrics kvgate reads, by what they mean rather than by engine.
#[derive(Clone, Copy)]
enum Metric {
    Running,
    Waiting,
    KvUsage,
    /// vLLM's pre-0.9 name for the same gauge, read only when the current one is absent.
    KvUsageLegacy,
    CacheInfo,
    PageSize,
    NumPages,
    MaxTotalTokens,
    /// Name variant, in order of preference: `_total`, bare, legacy `_total`, legacy bare.
    PrefixHits(usize),
    PrefixQueries(usize),
    /// Name variant: `_total`, bare.
    Preemptions(usize),
}

fn classify(name: &str) -> Option<(Engine, Metric)> {
    use Engine::{Sglang, Vllm};
    use Metric::*;
    Some(match name {
        "vllm:num_requests_running" => (Vllm, Running),
        "vllm:num_requests_waiting" => (Vllm, Waiting),
        "vllm:kv_cache_usage_perc" => (Vllm, KvUsage),
        "vllm:gpu_cache_usage_perc" => (Vllm, KvUsageLegacy),
        "vllm:cache_config_info" => (Vllm, CacheInfo),
        // Counters are exposed with `_total`; a bare name comes only from non-Python exporters.
        // vLLM 0.8 called them `gpu_prefix_cache_*`.
        "vllm:prefix_cache_hits_total" => (Vllm, PrefixHits(0)),
        "vllm:prefix_cache_hits" => (Vllm, PrefixHits(1)),
        "vllm:gpu_prefix_cache_hits_total" => (Vllm, PrefixHits(2)),
        "vllm:gpu_prefix_cache_hits" => (Vllm, PrefixHits(3)),
        "vllm:prefix_cache_queries_total" => (Vllm, PrefixQueries(0)),
        "vllm:prefix_cache_queries" => (Vllm, PrefixQueries(1)),
        "vllm:gpu_prefix_cache_queries_total" => (Vllm, PrefixQueries(2)),
        "vllm:gpu_prefix_cache_queries" => (Vllm, PrefixQueries(3)),
        "vllm:num_preemptions_total" => (Vllm, Preemptions(0)),
        "vllm:num_preemptions" => (Vllm, Preemptions(1)),
        "sglang:num_running_reqs" => (Sglang, Running),
        "sglang:num_queue_reqs" => (Sglang, Waiting),
        "sglang:token_usage" => (Sglang, KvUsage),
        "sglang:cache_config_info" => (Sglang, CacheInfo),
        "sglang:page_size" => (Sglang, PageSize),
        "sglang:num_pages" => (Sglang, NumPages),
        "sglang:max_total_num_tokens" => (Sglang, MaxTotalTokens),
        _ => return None,
    })
}

/// The labels of one sample that matter here, as raw (still escaped) slices of the line: the
/// numbers kvgate reads never contain escapes, and identity only needs consistent bytes.
#[derive(Default)]
struct Labels<'a> {
    model_name: Option<&'a str>,
    name: Option<&'a str>,
    engine: Option<&'a str>,
    dp_rank: Option<&'a str>,
    priority: Option<&'a str>,
    block_size: Option<&'a str>,
    num_gpu_blocks: Option<&'a str>,
    kv_cache_size_tokens: Option<&'a str>,
    page_size: Option<&'a str>,
    num_pages: Option<&'a str>,
    max_total_num_tokens: Option<&'a str>,
    enable_prefix_caching: Option<&'a str>,
}

impl<'a> Labels<'a> {
    fn record(&mut self, key: &'a str, value: &'a str) {
        let slot = match key {
            "model_name" => &mut self.model_name,
            "name" => &mut self.name,
            "engine" => &mut self.engine,
            "dp_rank" => &mut self.dp_rank,
            "priority" => &mut self.priority,
            "block_size" => &mut self.block_size,
            "num_gpu_blocks" => &mut self.num_gpu_blocks,
            "kv_cache_size_tokens" => &mut self.kv_cache_size_tokens,
            "page_size" => &mut self.page_size,
            "num_pages" => &mut self.num_pages,
            "max_total_num_tokens" => &mut self.max_total_num_tokens,
            "enable_prefix_caching" => &mut self.enable_prefix_caching,
            _ => return,
        };
        *slot = Some(value);
    }

    /// Which engine of the pod a series belongs to. Presence is hashed apart from value so
    /// `engine=""` and no `engine` label stay distinct; 0xff never occurs in UTF-8, so it
    /// separates values unambiguously.
    fn engine_key(&self) -> u64 {
        [self.model_name, self.name, self.engine, self.dp_rank]
            .iter()
            .fold(0xcbf2_9ce4_8422_2325, |h, v| match v {
                Some(v) => fnv1a_from(fnv1a_from(h, &[1]), v.as_bytes()),
                None => fnv1a_from(h, &[0, 0xff]),
            })
    }
}

/// Per-engine values of one figure: max within an engine, summed across engines.
#[derive(Clone, Copy)]
struct Groups {
    keys: [u64; MAX_GROUPS],
    values: [f64; MAX_GROUPS],
    len: usize,
    poisoned: bool,
}

impl Groups {
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
struct Same {
    value: Option<u64>,
    poisoned: bool,
}

impl Same {
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

struct Acc {
    saw_vllm: bool,
    saw_sglang: bool,
    running: Groups,
    waiting: Groups,
    kv: Peak,
    kv_legacy: Peak,
    info_block_size: Same,
    info_blocks: Groups,
    info_tokens: Groups,
    gauge_page_size: Same,
    gauge_pages: Groups,
    gauge_tokens: Groups,
    hits: [Groups; 4],
    queries: [Groups; 4],
    preemptions: [Groups; 2],
    prefix_caching_off: bool,
}

impl Acc {
    fn new() -> Self {
        Self {
            saw_vllm: false,
            saw_sglang: false,
            running: Groups::new(),
            waiting: Groups::new(),
            kv: Peak::default(),
            kv_legacy: Peak::default(),
            info_block_size: Same::default(),
            info_blocks: Groups::new(),
            info_tokens: Groups::new(),
            gauge_page_size: Same::default(),
            gauge_pages: Groups::new(),
            gauge_tokens: Groups::new(),
            hits: [Groups::new(); 4],
            queries: [Groups::new(); 4],
            preemptions: [Groups::new(); 2],
            prefix_caching_off: false,
        }
    }

    fn line(&mut self, line: &str) {
        // Almost every line is a histogram bucket or a Python runtime metric; reject those on
        // the name alone, before any label is looked at.
        if !(line.starts_with("vllm:") || line.starts_with("sglang:")) {
            return;
        }
        let name_len = line
            .bytes()
            .position(|b| !is_name_byte(b))
            .unwrap_or(line.len());
        let (Some(name), Some(rest)) = (line.get(..name_len), line.get(name_len..)) else {
            return;
        };
        let Some((engine, metric)) = classify(name) else {
            return;
        };
        let mut labels = Labels::default();
        let Some(value) = sample_value(rest, &mut labels) else {
            return;
        };
        if labels.priority.is_some_and(|p| !p.is_empty()) {
            return;
        }
        match engine {
            Engine::Vllm => self.saw_vllm = true,
            Engine::Sglang => self.saw_sglang = true,
            Engine::Unknown => {}
        }
        self.apply(engine, metric, value, &labels);
    }

    fn apply(&mut self, engine: Engine, metric: Metric, value: f64, labels: &Labels<'_>) {
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
                self.prefix_caching_off |= labels
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
            Metric::PrefixHits(i) => {
                if let Some(g) = self.hits.get_mut(i) {
                    g.add(key, count(value));
                }
            }
            Metric::PrefixQueries(i) => {
                if let Some(g) = self.queries.get_mut(i) {
                    g.add(key, count(value));
                }
            }
            Metric::Preemptions(i) => {
                if let Some(g) = self.preemptions.get_mut(i) {
                    g.add(key, count(value));
                }
            }
        }
    }

    fn finish(&self) -> Result<PodMetrics, MetricsError> {
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
            prefix_caching_off: self.prefix_caching_off,
        })
    }
}

/// The first name variant that appeared at all decides, so `_total` and bare series of the same
/// counter are never added together.
fn first_present(variants: &[Groups]) -> Option<f64> {
    variants
        .iter()
        .find(|g| !g.is_empty())
        .and_then(Groups::total)
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

fn is_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b':'
}

fn is_blank(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

fn skip_blank(b: &[u8], mut i: usize) -> usize {
    while b.get(i).copied().is_some_and(is_blank) {
        i += 1;
    }
    i
}

/// Everything after the metric name: `[{labels}] value [timestamp] [# exemplar]`. Labels are
/// handed to `labels` as they are read; on `None` the caller drops them with the line.
fn sample_value<'a>(rest: &'a str, labels: &mut Labels<'a>) -> Option<f64> {
    let b = rest.as_bytes();
    // The name must end at a blank or a label set; otherwise `name-3` would read as `name -3`.
    let mut i = skip_blank(b, 0);
    if i == 0 && b.first() != Some(&b'{') {
        return None;
    }
    if b.get(i) == Some(&b'{') {
        i = label_set(rest, i + 1, labels)?;
    }
    let mut tokens = rest.get(i..)?.split([' ', '\t']).filter(|t| !t.is_empty());
    let value: f64 = tokens.next()?.parse().ok()?;
    // A timestamp is integer milliseconds in 0.0.4 and float seconds in OpenMetrics; either way
    // it must be a number. OpenMetrics may append an exemplar after `#`.
    let mut after_value = tokens.next();
    if let Some(ts) = after_value.filter(|t| !t.starts_with('#')) {
        if !ts.parse::<f64>().ok()?.is_finite() {
            return None;
        }
        after_value = tokens.next();
    }
    match after_value {
        None => Some(value),
        Some(t) if t.starts_with('#') => Some(value),
        Some(_) => None,
    }
}

/// Reads `name="value", ...}` from byte `i` of `s`, just past the `{`; returns the index just past
/// the `}`. Escapes are skipped over, not decoded: a backslash hides the next byte, which is all it
/// takes to find the closing quote.
fn label_set<'a>(s: &'a str, mut i: usize, labels: &mut Labels<'a>) -> Option<usize> {
    let b = s.as_bytes();
    loop {
        i = skip_blank(b, i);
        match *b.get(i)? {
            b'}' => return Some(i + 1),
            c if c.is_ascii_alphabetic() || c == b'_' => {}
            _ => return None,
        }
        let key_start = i;
        while b
            .get(i)
            .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_')
        {
            i += 1;
        }
        let key = s.get(key_start..i)?;
        i = skip_blank(b, i);
        if b.get(i) != Some(&b'=') {
            return None;
        }
        i = skip_blank(b, i + 1);
        if b.get(i) != Some(&b'"') {
            return None;
        }
        i += 1;
        let value_start = i;
        loop {
            match *b.get(i)? {
                b'"' => break,
                b'\\' => i += 2,
                _ => i += 1,
            }
        }
        labels.record(key, s.get(value_start..i)?);
        i = skip_blank(b, i + 1);
        match *b.get(i)? {
            b',' => i += 1,
            b'}' => return Some(i + 1),
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    const M: &str = "meta-llama/Llama-3.1-8B-Instruct";

    /// A vLLM V1 (0.10-0.11 era) `/metrics` body, single engine, as prometheus_client writes it:
    /// process and HTTP metrics around the engine's, `_created` samples beside counters,
    /// histograms (one of them, `iteration_tokens_total`, named with `_total`), and the full
    /// `cache_config_info` label set including Python `None`s and `kv_cache_size_tokens`.
    const VLLM_DOC: &str = r#"# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 14823.0
python_gc_objects_collected_total{generation="1"} 2931.0
python_gc_objects_collected_total{generation="2"} 1027.0
# HELP python_info Python platform information
# TYPE python_info gauge
python_info{implementation="CPython",major="3",minor="12",patchlevel="11",version="3.12.11"} 1.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 3.221225472e+09
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.73862104712e+09
# HELP http_requests_total Total number of requests by method, status and handler.
# TYPE http_requests_total counter
http_requests_total{handler="/v1/chat/completions",method="POST",status="2xx"} 851.0
http_requests_total{handler="/metrics",method="GET",status="2xx"} 412.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.41830065359477125
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.234567e+06
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7386210512e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 987648.0
# HELP vllm:prefix_cache_hits_created Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_created gauge
vllm:prefix_cache_hits_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7386210512e+09
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.845213e+06
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 214377.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="meta-llama/Llama-3.1-8B-Instruct"} 812.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="meta-llama/Llama-3.1-8B-Instruct"} 37.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.05959e+06
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:iteration_tokens_total_bucket{engine="0",le="8.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 15221.0
vllm:iteration_tokens_total_bucket{engine="0",le="512.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 30102.0
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 31177.0
vllm:iteration_tokens_total_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 31177.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 97.31944346427917
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="meta-llama/Llama-3.1-8B-Instruct"} 402.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.25",model_name="meta-llama/Llama-3.1-8B-Instruct"} 799.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="2560.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 851.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 851.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 851.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4122.605
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 851.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 851.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.7386211e+09
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",kv_cache_dtype_skip_layers="[]",kv_cache_max_concurrency="3.2958984375",kv_cache_memory_bytes="None",kv_cache_size_tokens="432000",kv_sharing_fast_prefill="False",mamba_block_size="None",mamba_cache_dtype="auto",mamba_page_size_padded="None",num_cpu_blocks="None",num_gpu_blocks="27000",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
"#;

    /// A recent SGLang body: scheduler gauges labelled by engine type and parallel ranks,
    /// tokenizer-manager counters labelled by model only, capacity as plain gauges.
    const SGLANG_DOC: &str = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 7.0
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 51228.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.35
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 812.4316520690918
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 2.0
# HELP sglang:num_running_reqs_offline_batch The number of running low-priority offline batch requests(label is 'batch').
# TYPE sglang:num_running_reqs_offline_batch gauge
sglang:num_running_reqs_offline_batch{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.0
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.6216
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 146368.0
# HELP sglang:page_size KV cache page size in tokens.
# TYPE sglang:page_size gauge
sglang:page_size{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 1.0
# HELP sglang:num_pages Number of KV cache pages.
# TYPE sglang:num_pages gauge
sglang:num_pages{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 146368.0
# HELP sglang:context_len Maximum context length.
# TYPE sglang:context_len gauge
sglang:context_len{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 40960.0
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="Qwen/Qwen3-8B"} 3.5186e+07
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="Qwen/Qwen3-8B"} 7.557572e+06
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{model_name="Qwen/Qwen3-8B"} 2.3518979474117756e+06
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="Qwen/Qwen3-8B"} 11.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="Qwen/Qwen3-8B"} 12094.0
sglang:time_to_first_token_seconds_count{model_name="Qwen/Qwen3-8B"} 12094.0
"#;

    fn ok(text: &str) -> PodMetrics {
        match parse(text) {
            Ok(m) => m,
            Err(e) => panic!("expected metrics, got {e}: {text:?}"),
        }
    }

    fn running_of(text: &str) -> Option<f64> {
        ok(text).running
    }

    #[test]
    fn sums_that_overflow_are_unknown_not_infinite() {
        let m = parse_bytes(
            b"vllm:num_requests_running{engine=\"0\"} 1e308\nvllm:num_requests_running{engine=\"1\"} 1e308\nvllm:num_requests_waiting 1\n",
        )
        .unwrap();
        assert_eq!(m.running, None);
    }

    #[test]
    fn full_vllm_v1_document() {
        let m = ok(VLLM_DOC);
        assert_eq!(
            m,
            PodMetrics {
                engine: Engine::Vllm,
                running: Some(3.0),
                waiting: Some(1.0),
                kv_usage: Some(0.41830065359477125),
                block_size: Some(16),
                num_gpu_blocks: Some(27_000),
                capacity_tokens: Some(432_000),
                prefix_cache_hits: Some(987_648.0),
                prefix_cache_queries: Some(1_234_567.0),
                preemptions: Some(0.0),
                prefix_caching_off: false,
            }
        );
    }

    #[test]
    fn full_sglang_document() {
        let m = ok(SGLANG_DOC);
        assert_eq!(
            m,
            PodMetrics {
                engine: Engine::Sglang,
                running: Some(7.0),
                waiting: Some(2.0),
                kv_usage: Some(0.35),
                block_size: Some(1),
                num_gpu_blocks: Some(146_368),
                capacity_tokens: Some(146_368),
                prefix_cache_hits: None,
                prefix_cache_queries: None,
                preemptions: None,
                prefix_caching_off: false,
            }
        );
    }

    #[test]
    fn crlf_bom_blank_lines_and_indentation_change_nothing() {
        let crlf = VLLM_DOC.replace('\n', "\r\n");
        assert_eq!(ok(&crlf), ok(VLLM_DOC));
        let bom = format!("\u{feff}{VLLM_DOC}");
        assert_eq!(ok(&bom), ok(VLLM_DOC));
        let spaced = VLLM_DOC.replace('\n', "\n\n  \t\n\t ");
        assert_eq!(ok(&spaced), ok(VLLM_DOC));
    }

    #[test]
    fn older_vllm_without_engine_label_or_token_capacity() {
        // vLLM V0 / early V1: no `engine` label, the deprecated usage gauge only, and capacity
        // only as blocks.
        let doc = format!(
            "vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"False\",\
             num_cpu_blocks=\"9362\",num_gpu_blocks=\"81767\",num_gpu_blocks_override=\"None\",\
             sliding_window=\"None\",swap_space_bytes=\"4294967296\"}} 1.0\n\
             vllm:num_requests_running{{model_name=\"{M}\"}} 0.0\n\
             vllm:num_requests_swapped{{model_name=\"{M}\"}} 0.0\n\
             vllm:num_requests_waiting{{model_name=\"{M}\"}} 4.0\n\
             vllm:gpu_cache_usage_perc{{model_name=\"{M}\"}} 0.97\n\
             vllm:gpu_prefix_cache_hit_rate{{model_name=\"{M}\"}} 0.5\n"
        );
        let m = ok(&doc);
        assert_eq!(m.engine, Engine::Vllm);
        assert_eq!((m.running, m.waiting), (Some(0.0), Some(4.0)));
        assert_eq!(m.kv_usage, Some(0.97));
        assert_eq!(m.block_size, Some(16));
        assert_eq!(m.num_gpu_blocks, Some(81_767));
        assert_eq!(m.capacity_tokens, Some(81_767 * 16));
        assert_eq!((m.prefix_cache_hits, m.prefix_cache_queries), (None, None));
        assert!(m.prefix_caching_off);
    }

    #[test]
    fn current_usage_gauge_wins_over_deprecated_one() {
        let doc = "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.2\n";
        assert_eq!(ok(doc).kv_usage, Some(0.2));
        // Even when the current one is unusable: it was published, so the engine's value is
        // unknown rather than whatever the old name says.
        let doc = "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc NaN\n";
        assert_eq!(ok(doc).kv_usage, None);
    }

    #[test]
    fn hybrid_model_capacity_comes_from_the_engines_own_token_count() {
        // A hybrid attention/Mamba model: 320 blocks of 8 would claim 2,560 tokens.
        let doc = "vllm:cache_config_info{block_size=\"8\",engine=\"0\",kv_cache_size_tokens=\"463459\",\
                   mamba_block_size=\"16\",mamba_cache_mode=\"align\",num_gpu_blocks=\"320\"} 1.0\n";
        let m = ok(doc);
        assert_eq!(m.capacity_tokens, Some(463_459));
        assert_eq!((m.block_size, m.num_gpu_blocks), (Some(8), Some(320)));
    }

    #[test]
    fn unset_cache_settings_are_unknown_not_zero() {
        // Before profiling, or for attention-free models, vLLM writes the string "None".
        let doc = "vllm:cache_config_info{block_size=\"16\",kv_cache_size_tokens=\"None\",num_gpu_blocks=\"None\"} 1.0\n\
                   vllm:num_requests_running 0\n";
        let m = ok(doc);
        assert_eq!(m.block_size, Some(16));
        assert_eq!((m.num_gpu_blocks, m.capacity_tokens), (None, None));
        let doc = "vllm:cache_config_info{block_size=\"0\",num_gpu_blocks=\"-4\"} 1.0\n";
        let m = ok(doc);
        assert_eq!(
            (m.block_size, m.num_gpu_blocks, m.capacity_tokens),
            (None, None, None)
        );
        // A token count that falls back to blocks when one engine lacks it.
        let doc = "vllm:cache_config_info{block_size=\"16\",engine=\"0\",kv_cache_size_tokens=\"1600\",num_gpu_blocks=\"100\"} 1.0\n\
                   vllm:cache_config_info{block_size=\"16\",engine=\"1\",kv_cache_size_tokens=\"None\",num_gpu_blocks=\"100\"} 1.0\n";
        assert_eq!(ok(doc).capacity_tokens, Some(3_200));
    }

    #[test]
    fn vllm_data_parallel_engines_add_up() {
        let doc = format!(
            "vllm:num_requests_running{{engine=\"0\",model_name=\"{M}\"}} 3.0\n\
             vllm:num_requests_running{{engine=\"1\",model_name=\"{M}\"}} 5.0\n\
             vllm:num_requests_waiting{{engine=\"0\",model_name=\"{M}\"}} 0.0\n\
             vllm:num_requests_waiting{{engine=\"1\",model_name=\"{M}\"}} 2.0\n\
             vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"{M}\"}} 0.25\n\
             vllm:kv_cache_usage_perc{{engine=\"1\",model_name=\"{M}\"}} 0.75\n\
             vllm:prefix_cache_hits_total{{engine=\"0\",model_name=\"{M}\"}} 10.0\n\
             vllm:prefix_cache_hits_total{{engine=\"1\",model_name=\"{M}\"}} 30.0\n\
             vllm:prefix_cache_queries_total{{engine=\"0\",model_name=\"{M}\"}} 100.0\n\
             vllm:prefix_cache_queries_total{{engine=\"1\",model_name=\"{M}\"}} 300.0\n\
             vllm:cache_config_info{{block_size=\"16\",engine=\"0\",kv_cache_size_tokens=\"16000\",num_gpu_blocks=\"1000\"}} 1.0\n\
             vllm:cache_config_info{{block_size=\"16\",engine=\"1\",kv_cache_size_tokens=\"16000\",num_gpu_blocks=\"1000\"}} 1.0\n"
        );
        let m = ok(&doc);
        assert_eq!((m.running, m.waiting), (Some(8.0), Some(2.0)));
        assert_eq!(m.kv_usage, Some(0.75));
        assert_eq!(m.num_gpu_blocks, Some(2_000));
        assert_eq!(m.capacity_tokens, Some(32_000));
        assert_eq!(m.block_size, Some(16));
        assert_eq!(
            (m.prefix_cache_hits, m.prefix_cache_queries),
            (Some(40.0), Some(400.0))
        );
    }

    #[test]
    fn several_models_add_up_and_repeated_series_do_not() {
        let doc = "vllm:num_requests_running{model_name=\"a\"} 1\n\
                   vllm:num_requests_running{model_name=\"b\"} 2\n\
                   vllm:num_requests_running{model_name=\"b\"} 2\n";
        assert_eq!(running_of(doc), Some(3.0));
        // Label order does not make a new engine.
        let doc = "vllm:num_requests_running{engine=\"0\",model_name=\"a\"} 4\n\
                   vllm:num_requests_running{model_name=\"a\",engine=\"0\"} 4\n";
        assert_eq!(running_of(doc), Some(4.0));
        // An empty label is not the same as no label.
        let doc = "vllm:num_requests_running{engine=\"\"} 4\nvllm:num_requests_running 1\n";
        assert_eq!(running_of(doc), Some(5.0));
    }

    #[test]
    fn vllm_multiprocess_pid_copies_are_not_summed() {
        let doc = "vllm:kv_cache_usage_perc{engine=\"0\",pid=\"101\"} 0.5\n\
                   vllm:kv_cache_usage_perc{engine=\"0\",pid=\"102\"} 0.6\n\
                   vllm:num_requests_running{engine=\"0\",pid=\"101\"} 2\n\
                   vllm:num_requests_running{engine=\"0\",pid=\"102\"} 3\n";
        let m = ok(doc);
        assert_eq!((m.kv_usage, m.running), (Some(0.6), Some(3.0)));
    }

    #[test]
    fn sglang_priority_breakdown_is_not_counted_twice() {
        let l = "engine_type=\"unified\",model_name=\"m\",moe_ep_rank=\"0\",pp_rank=\"0\",tp_rank=\"0\"";
        let doc = format!(
            "sglang:num_running_reqs{{{l},priority=\"\"}} 6.0\n\
             sglang:num_running_reqs{{{l},priority=\"0\"}} 4.0\n\
             sglang:num_running_reqs{{{l},priority=\"10\"}} 2.0\n\
             sglang:num_queue_reqs{{{l},priority=\"\"}} 3.0\n\
             sglang:num_queue_reqs{{{l},priority=\"10\"}} 3.0\n"
        );
        let m = ok(&doc);
        assert_eq!((m.running, m.waiting), (Some(6.0), Some(3.0)));
    }

    #[test]
    fn sglang_tensor_parallel_copies_take_the_max_and_dp_ranks_add_up() {
        // --enable-metrics-for-all-schedulers: every TP rank reports the same scheduler.
        let doc = "sglang:num_running_reqs{model_name=\"m\",tp_rank=\"0\"} 5\n\
                   sglang:num_running_reqs{model_name=\"m\",tp_rank=\"1\"} 5\n\
                   sglang:max_total_num_tokens{model_name=\"m\",tp_rank=\"0\"} 1000\n\
                   sglang:max_total_num_tokens{model_name=\"m\",tp_rank=\"1\"} 1000\n";
        let m = ok(doc);
        assert_eq!((m.running, m.capacity_tokens), (Some(5.0), Some(1_000)));
        // DP attention: each rank has its own scheduler and pool.
        let doc = "sglang:num_running_reqs{dp_rank=\"0\",model_name=\"m\",tp_rank=\"0\"} 5\n\
                   sglang:num_running_reqs{dp_rank=\"1\",model_name=\"m\",tp_rank=\"4\"} 7\n\
                   sglang:token_usage{dp_rank=\"0\",model_name=\"m\",tp_rank=\"0\"} 0.1\n\
                   sglang:token_usage{dp_rank=\"1\",model_name=\"m\",tp_rank=\"4\"} 0.9\n\
                   sglang:max_total_num_tokens{dp_rank=\"0\",model_name=\"m\",tp_rank=\"0\"} 1000\n\
                   sglang:max_total_num_tokens{dp_rank=\"1\",model_name=\"m\",tp_rank=\"4\"} 1000\n";
        let m = ok(doc);
        assert_eq!(m.running, Some(12.0));
        assert_eq!(m.kv_usage, Some(0.9));
        assert_eq!(m.capacity_tokens, Some(2_000));
    }

    #[test]
    fn sglang_cache_config_info_labels() {
        // Releases before the page gauges carried the pool as labels of an info gauge.
        let doc =
            "sglang:cache_config_info{model_name=\"m\",num_pages=\"2787\",page_size=\"64\"} 1.0\n\
                   sglang:num_running_reqs{model_name=\"m\"} 1.0\n";
        let m = ok(doc);
        assert_eq!(m.engine, Engine::Sglang);
        assert_eq!((m.block_size, m.num_gpu_blocks), (Some(64), Some(2_787)));
        assert_eq!(m.capacity_tokens, Some(2_787 * 64));
        // The label carrying the token count directly wins over the product and the gauge.
        let doc = "sglang:cache_config_info{max_total_num_tokens=\"178000\",num_pages=\"2787\",page_size=\"64\"} 1.0\n\
                   sglang:max_total_num_tokens 170000\n";
        assert_eq!(ok(doc).capacity_tokens, Some(178_000));
        // And the gauge wins over the product.
        let doc =
            "sglang:page_size 64\nsglang:num_pages 2787\nsglang:max_total_num_tokens 178000\n";
        let m = ok(doc);
        assert_eq!(m.capacity_tokens, Some(178_000));
        assert_eq!((m.block_size, m.num_gpu_blocks), (Some(64), Some(2_787)));
    }

    #[test]
    fn old_sglang_name_label() {
        let doc = "sglang:max_total_num_tokens{name=\"google/gemma-2-9b-it\"} 161721.0\n\
                   sglang:num_running_reqs{name=\"google/gemma-2-9b-it\"} 3.0\n\
                   sglang:num_queue_reqs{name=\"google/gemma-2-9b-it\"} 0.0\n\
                   sglang:token_usage{name=\"google/gemma-2-9b-it\"} 0.05\n";
        let m = ok(doc);
        assert_eq!(m.capacity_tokens, Some(161_721));
        assert_eq!(
            (m.running, m.waiting, m.kv_usage),
            (Some(3.0), Some(0.0), Some(0.05))
        );
        assert_eq!((m.block_size, m.num_gpu_blocks), (None, None));
    }

    #[test]
    fn engines_disagreeing_on_block_size_leave_it_unknown() {
        let doc = "vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"10\"} 1\n\
                   vllm:cache_config_info{block_size=\"32\",engine=\"1\",num_gpu_blocks=\"10\"} 1\n";
        let m = ok(doc);
        assert_eq!(m.block_size, None);
        assert_eq!(m.num_gpu_blocks, Some(20));
        assert_eq!(m.capacity_tokens, None);
    }

    #[test]
    fn escaped_label_values() {
        let doc = concat!(
            r#"vllm:num_requests_running{model_name="we\"ird\\model\nname},x=\"y\"",engine="0"} 2"#,
            "\n",
            r#"vllm:num_requests_running{model_name="ends with backslash\\",engine="0"} 3"#,
            "\n",
            r#"vllm:num_requests_running{model_name="ünïcødé ✓ \\\"",engine="0"} 4"#,
            "\n",
            r#"vllm:cache_config_info{kv_cache_dtype_skip_layers="['0', '2']",note="a \"quoted\" \\ path",block_size="16",num_gpu_blocks="10",} 1.0"#,
            "\n",
        );
        let m = ok(doc);
        assert_eq!(m.running, Some(9.0));
        assert_eq!(m.capacity_tokens, Some(160));
        // Different escaped values are different models; the same bytes are the same model.
        let doc = concat!(
            r#"vllm:num_requests_running{model_name="a\"b"} 1"#,
            "\n",
            r#"vllm:num_requests_running{model_name="a\\b"} 2"#,
            "\n",
            r#"vllm:num_requests_running{model_name="a\\b"} 2"#,
            "\n",
        );
        assert_eq!(running_of(doc), Some(3.0));
    }

    #[test]
    fn label_set_whitespace_and_trailing_comma() {
        let doc = "vllm:num_requests_running { engine = \"0\" , model_name=\"m\" , } 5\n";
        assert_eq!(running_of(doc), Some(5.0));
        assert_eq!(running_of("vllm:num_requests_running{} 6\n"), Some(6.0));
        assert_eq!(
            running_of("vllm:num_requests_running{engine=\"0\"}7\n"),
            Some(7.0)
        );
        assert_eq!(running_of("vllm:num_requests_running\t8\t\n"), Some(8.0));
    }

    #[test]
    fn number_formats() {
        for (text, want) in [
            ("3", 3.0),
            ("3.0", 3.0),
            ("3.5e+01", 35.0),
            ("3.5E1", 35.0),
            ("+2", 2.0),
            ("1e0", 1.0),
            ("0.0", 0.0),
            ("-0.0", 0.0),
            ("-0", 0.0),
        ] {
            let doc = format!("vllm:num_requests_running {text}\n");
            let got = running_of(&doc);
            assert_eq!(got, Some(want), "{text}");
            assert!(got.is_some_and(|v| v.is_sign_positive()), "{text}");
        }
        let doc = "vllm:kv_cache_usage_perc 4.2e-1\n";
        assert_eq!(ok(doc).kv_usage, Some(0.42));
    }

    #[test]
    fn nan_and_infinities_are_unknown() {
        for v in ["NaN", "nan", "+Inf", "-Inf", "Inf", "1e400"] {
            let doc = format!(
                "vllm:num_requests_running {v}\nvllm:num_requests_waiting {v}\n\
                 vllm:kv_cache_usage_perc {v}\nvllm:prefix_cache_hits_total {v}\n\
                 vllm:prefix_cache_queries_total {v}\n"
            );
            let m = ok(&doc);
            assert_eq!(m.engine, Engine::Vllm, "{v}");
            assert_eq!(
                (m.running, m.waiting, m.kv_usage),
                (None, None, None),
                "{v}"
            );
            assert_eq!(
                (m.prefix_cache_hits, m.prefix_cache_queries),
                (None, None),
                "{v}"
            );
        }
        let doc = "sglang:max_total_num_tokens +Inf\nsglang:page_size NaN\nsglang:num_pages 12\n";
        let m = ok(doc);
        assert_eq!(
            (m.capacity_tokens, m.block_size, m.num_gpu_blocks),
            (None, None, Some(12))
        );
    }

    #[test]
    fn one_bad_engine_makes_the_sum_unknown() {
        let doc = "vllm:num_requests_running{engine=\"0\"} 3\nvllm:num_requests_running{engine=\"1\"} NaN\n";
        assert_eq!(running_of(doc), None);
        let doc = "vllm:kv_cache_usage_perc{engine=\"0\"} 0.3\nvllm:kv_cache_usage_perc{engine=\"1\"} -1\n";
        assert_eq!(ok(doc).kv_usage, None);
    }

    #[test]
    fn implausible_values_are_dropped() {
        assert_eq!(running_of("vllm:num_requests_running -1\n"), None);
        assert_eq!(ok("vllm:num_requests_waiting -0.5\n").waiting, None);
        assert_eq!(
            ok("vllm:prefix_cache_hits_total -3\n").prefix_cache_hits,
            None
        );
        for (v, want) in [
            ("0", Some(0.0)),
            ("1", Some(1.0)),
            ("1.004", Some(1.0)),
            ("1.01", Some(1.0)),
            ("1.02", None),
            ("1.5", None),
            ("85", None),
            ("100", None),
            ("-0.1", None),
        ] {
            let doc = format!("sglang:token_usage {v}\n");
            assert_eq!(ok(&doc).kv_usage, want, "{v}");
        }
        // Fractional and huge token counts are not counts.
        let doc =
            "sglang:max_total_num_tokens 1000.5\nsglang:num_pages 1e300\nsglang:page_size 0\n";
        let m = ok(doc);
        assert_eq!(
            (m.capacity_tokens, m.num_gpu_blocks, m.block_size),
            (None, None, None)
        );
    }

    #[test]
    fn timestamps_and_exemplars() {
        assert_eq!(
            running_of("vllm:num_requests_running 3 1712345678000\n"),
            Some(3.0)
        );
        assert_eq!(
            running_of("vllm:num_requests_running 3 -1712345678000\n"),
            Some(3.0)
        );
        assert_eq!(
            running_of("vllm:num_requests_running{engine=\"0\"} 3 1712345678.123\n"),
            Some(3.0)
        );
        let doc =
            "vllm:prefix_cache_hits_total{engine=\"0\"} 17 # {trace_id=\"abc\"} 1.0 1712345678.1\n";
        assert_eq!(ok(doc).prefix_cache_hits, Some(17.0));
        let doc = "vllm:prefix_cache_hits_total 17 1712345678 # {trace_id=\"abc\"} 1.0\n";
        assert_eq!(ok(doc).prefix_cache_hits, Some(17.0));
        // A timestamp that is not a number, or anything more after it, spoils the line.
        for bad in [
            "vllm:num_requests_running 3 yesterday\n",
            "vllm:num_requests_running 3 NaN\n",
            "vllm:num_requests_running 3 1712345678000 9\n",
        ] {
            assert_eq!(parse(bad), Err(MetricsError::NoKnownMetrics), "{bad:?}");
        }
    }

    #[test]
    fn counter_name_variants() {
        assert_eq!(
            ok("vllm:prefix_cache_hits 5\nvllm:prefix_cache_queries 9\n").prefix_cache_hits,
            Some(5.0)
        );
        // Both spellings present: `_total` alone counts.
        let doc = "vllm:prefix_cache_hits 5\nvllm:prefix_cache_hits_total 7\n\
                   vllm:prefix_cache_queries_total 20\nvllm:prefix_cache_queries 9\n";
        let m = ok(doc);
        assert_eq!(
            (m.prefix_cache_hits, m.prefix_cache_queries),
            (Some(7.0), Some(20.0))
        );
        // vLLM 0.8's names, read only when the current ones are absent.
        let doc = "vllm:gpu_prefix_cache_hits_total 4\nvllm:gpu_prefix_cache_queries_total 8\n";
        let m = ok(doc);
        assert_eq!(
            (m.prefix_cache_hits, m.prefix_cache_queries),
            (Some(4.0), Some(8.0))
        );
        let doc = "vllm:gpu_prefix_cache_hits_total 4\nvllm:prefix_cache_hits_total 6\n";
        assert_eq!(ok(doc).prefix_cache_hits, Some(6.0));
        // `_created` is a timestamp, not the counter.
        let doc = "vllm:prefix_cache_hits_created 1.7e9\nvllm:num_requests_running 1\n";
        assert_eq!(ok(doc).prefix_cache_hits, None);
    }

    #[test]
    fn openmetrics_eof_ends_the_document() {
        let doc = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 2\n# EOF\n\
                   vllm:num_requests_running{engine=\"9\"} 50\n";
        assert_eq!(running_of(doc), Some(2.0));
        // The newline after `# EOF` is optional in OpenMetrics.
        let doc = "vllm:num_requests_running 2\n# EOF";
        assert_eq!(running_of(doc), Some(2.0));
        let doc = "vllm:num_requests_running 2\r\n  # EOF \r\nvllm:num_requests_waiting 3\n";
        assert_eq!(ok(doc).waiting, None);
        // Only the exact marker ends it.
        let doc = "# EOFX\n# HELP # EOF\nvllm:num_requests_running 2\n";
        assert_eq!(running_of(doc), Some(2.0));
    }

    #[test]
    fn unterminated_last_line_is_treated_as_cut_off() {
        assert_eq!(
            parse("vllm:num_requests_running 1"),
            Err(MetricsError::NoKnownMetrics)
        );
        let doc = "vllm:num_requests_waiting 0\nvllm:num_requests_running 1";
        let m = ok(doc);
        assert_eq!((m.waiting, m.running), (Some(0.0), None));
    }

    #[test]
    fn any_truncation_of_a_real_document_only_loses_figures() {
        let full = ok(VLLM_DOC);
        let mut successes = 0;
        for (cut, _) in VLLM_DOC.char_indices() {
            let Some(prefix) = VLLM_DOC.get(..cut) else {
                continue;
            };
            let Ok(m) = parse(prefix) else {
                continue;
            };
            successes += 1;
            assert_eq!(m.engine, full.engine, "cut at {cut}");
            for (got, want) in [
                (m.running, full.running),
                (m.waiting, full.waiting),
                (m.kv_usage, full.kv_usage),
                (m.prefix_cache_hits, full.prefix_cache_hits),
                (m.prefix_cache_queries, full.prefix_cache_queries),
            ] {
                assert!(got.is_none() || got == want, "cut at {cut}: {got:?}");
            }
            for (got, want) in [
                (m.block_size, full.block_size),
                (m.num_gpu_blocks, full.num_gpu_blocks),
                (m.capacity_tokens, full.capacity_tokens),
            ] {
                assert!(got.is_none() || got == want, "cut at {cut}: {got:?}");
            }
        }
        assert!(successes > 100);
        for (cut, _) in SGLANG_DOC.char_indices() {
            if let Some(Ok(m)) = SGLANG_DOC.get(..cut).map(parse) {
                assert!(m.running.is_none() || m.running == Some(7.0));
                assert!(m.capacity_tokens.is_none() || m.capacity_tokens == Some(146_368));
            }
        }
    }

    #[test]
    fn malformed_lines_are_skipped_one_by_one() {
        for bad in [
            "vllm:num_requests_running\n",
            "vllm:num_requests_running \n",
            "vllm:num_requests_running{engine=\"0\"}\n",
            "vllm:num_requests_running{engine=\"0\" 3\n",
            "vllm:num_requests_running{engine=\"0} 3\n",
            "vllm:num_requests_running{engine=0} 3\n",
            "vllm:num_requests_running{engine=\"0\"\"} 3\n",
            "vllm:num_requests_running{engine=\"0\" model_name=\"m\"} 3\n",
            "vllm:num_requests_running{=\"0\"} 3\n",
            "vllm:num_requests_running{0engine=\"0\"} 3\n",
            "vllm:num_requests_running{\"vllm.name\"} 3\n",
            "vllm:num_requests_running{engine=\"\\\"} 3\n",
            "vllm:num_requests_running{engine=\"0\\",
            "vllm:num_requests_running-3\n",
            "vllm:num_requests_running3 3\n",
            "vllm:num_requests_running three\n",
            "vllm:num_requests_running 3 4 5\n",
            "vllm:num_requests_running 0x10\n",
            "vllm:num_requests_running 1_000\n",
            "vllm:num_requests_running{engine=\"0\"}} 3\n",
            "vllm:num_requests_running}{ 3\n",
            "{__name__=\"vllm:num_requests_running\"} 3\n",
            "VLLM:NUM_REQUESTS_RUNNING 3\n",
        ] {
            assert_eq!(parse(bad), Err(MetricsError::NoKnownMetrics), "{bad:?}");
            let doc = format!("vllm:num_requests_waiting 1\n{bad}\nvllm:num_requests_running 4\n");
            let m = ok(&doc);
            assert_eq!((m.waiting, m.running), (Some(1.0), Some(4.0)), "{bad:?}");
        }
    }

    #[test]
    fn garbage_is_refused_without_panicking() {
        for junk in [
            "",
            "\n",
            "\r\n\r\n",
            "# HELP vllm:num_requests_running only metadata\n# TYPE vllm:num_requests_running gauge\n",
            "<html><body><h1>502 Bad Gateway</h1></body></html>\n",
            "{\"detail\":\"Not Found\"}\n",
            "vllm:prompt_tokens_total{engine=\"0\"} 12\nprocess_cpu_seconds_total 4.5\n",
            "\u{0}\u{1}\u{2}vllm:\u{7f}\n",
            "{{{{}}}}\"\"\"\\\\\\\n",
            "vllm:\nsglang:\n:\n{\n}\n=\n\"\n",
        ] {
            assert_eq!(parse(junk), Err(MetricsError::NoKnownMetrics), "{junk:?}");
        }
    }

    #[test]
    fn pseudo_random_input_never_panics_or_invents_values() {
        const PIECES: &[&str] = &[
            "vllm:num_requests_running",
            "sglang:num_queue_reqs",
            "vllm:kv_cache_usage_perc",
            "vllm:cache_config_info",
            "sglang:max_total_num_tokens",
            "{",
            "}",
            "engine=",
            "\"",
            "\\",
            ",",
            " ",
            "\t",
            "\n",
            "\r",
            "#",
            " EOF",
            "1",
            "-2",
            "0.5",
            "NaN",
            "+Inf",
            "e",
            "block_size=\"16\"",
            "num_gpu_blocks=\"9\"",
            "ü",
            "✓",
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut doc = String::new();
        for _ in 0..3_000 {
            doc.clear();
            let len = next() % 60;
            for _ in 0..len {
                doc.push_str(PIECES[(next() % PIECES.len() as u64) as usize]);
            }
            if let Ok(m) = parse(&doc) {
                assert_ne!(m.engine, Engine::Unknown);
                for v in [
                    m.running,
                    m.waiting,
                    m.prefix_cache_hits,
                    m.prefix_cache_queries,
                ]
                .into_iter()
                .flatten()
                {
                    assert!(v.is_finite() && v >= 0.0, "{doc:?}");
                }
                if let Some(kv) = m.kv_usage {
                    assert!((0.0..=1.0).contains(&kv), "{doc:?}");
                }
                for v in [m.block_size, m.num_gpu_blocks, m.capacity_tokens]
                    .into_iter()
                    .flatten()
                {
                    assert!(v >= 1, "{doc:?}");
                }
            }
            let _ = parse_bytes(doc.as_bytes());
        }
    }

    #[test]
    fn mixed_engines_are_refused() {
        let doc = "vllm:num_requests_running 1\nsglang:num_running_reqs 2\n";
        assert_eq!(parse(doc), Err(MetricsError::MixedEngines));
    }

    #[test]
    fn bytes_must_be_utf8() {
        assert_eq!(parse_bytes(VLLM_DOC.as_bytes()), parse(VLLM_DOC));
        let mut body = VLLM_DOC.as_bytes().to_vec();
        body.extend_from_slice(b"vllm:num_requests_running{model_name=\"\xff\xfe\"} 1\n");
        assert_eq!(parse_bytes(&body), Err(MetricsError::InvalidUtf8));
        assert_eq!(parse_bytes(b"\xc3"), Err(MetricsError::InvalidUtf8));
        assert_eq!(parse_bytes(b""), Err(MetricsError::NoKnownMetrics));
    }

    #[test]
    fn overlong_lines_are_skipped() {
        let long = format!(
            "vllm:num_requests_running{{model_name=\"{}\"}} 9\n",
            "x".repeat(MAX_LINE_BYTES)
        );
        assert_eq!(parse(&long), Err(MetricsError::NoKnownMetrics));
        let doc = format!("{long}vllm:num_requests_running 2\n");
        assert_eq!(running_of(&doc), Some(2.0));
        // A line right at the limit is still read.
        let head = "vllm:num_requests_running{model_name=\"";
        let tail = "\"} 5";
        let fill = MAX_LINE_BYTES - head.len() - tail.len();
        let doc = format!("{head}{}{tail}\n", "y".repeat(fill));
        assert_eq!(running_of(&doc), Some(5.0));
    }

    #[test]
    fn line_limit() {
        let filler = "process_cpu_seconds_total 1\n".repeat(MAX_LINES - 1);
        let doc = format!("{filler}vllm:num_requests_running 3\n");
        assert_eq!(running_of(&doc), Some(3.0));
        let doc = format!("{filler}\nvllm:num_requests_running 3\n");
        assert_eq!(parse(&doc), Err(MetricsError::TooManyLines));
        let blank = "\n".repeat(MAX_LINES + 1);
        assert_eq!(parse(&blank), Err(MetricsError::TooManyLines));
    }

    #[test]
    fn too_many_engines_is_unknown() {
        let mut doc = String::new();
        for e in 0..=MAX_GROUPS {
            doc.push_str(&format!("vllm:num_requests_running{{engine=\"{e}\"}} 1\n"));
        }
        doc.push_str("vllm:num_requests_waiting 0\n");
        let m = ok(&doc);
        assert_eq!((m.running, m.waiting), (None, Some(0.0)));
        let mut doc = String::new();
        for e in 0..MAX_GROUPS {
            doc.push_str(&format!("vllm:num_requests_running{{engine=\"{e}\"}} 1\n"));
        }
        assert_eq!(running_of(&doc), Some(MAX_GROUPS as f64));
    }

    #[test]
    fn errors_read_as_sentences() {
        assert_eq!(
            MetricsError::InvalidUtf8.to_string(),
            "metrics body is not valid UTF-8"
        );
        assert_eq!(PodMetrics::default().engine, Engine::Unknown);
    }
}
