//! Self-calibration of the estimator, per model, shared by every worker: each response's `usage`
//! moves a model's prompt fit (real tokens per static-rule token and a template's fixed part,
//! fitted apart for templated and raw prompts: `PromptFit`), its output-length
//! distribution (`output_dist`: answers cut off by their own `max_tokens` are kept as censored
//! samples, not dropped) and, for streamed answers, its tokens per streamed piece of text.
//! Records live in shared data under a bounded key schema, `kvgate.cal.<slot>` (32 slots), a
//! model's found and put by its name's hash (`slots`: its own slot or one of the next few; a
//! slot held by another model that is still being updated is left alone, and a model that finds
//! every slot in its reach so held keeps the static rule). Each VM caches what it read for a
//! second, so the request path reads a model's record (a key, or the few past its own it was put
//! in) and the engines' answers' mean the output prior is raised to (`engine_lengths`) at most
//! once per model per second; a record that has not learned yet, for a tick (see
//! `UNLEARNED_CACHE_MS`). The lengths read
//! are pooled with the VM's own `cohort` of answers started, running ones included, which the
//! finished answers alone are biased against (see there). Beside the model's lengths, a model's
//! record learns how its prompt templates' answers run (`templates`), which a request's estimate
//! blends in (`Calibration::own`, from the record as this VM last read it).
//!
//! LoRA adapters are learned twice: each under its own name, and all of one base model's together
//! in a family record ([`family`], slots `kvgate.calf.<slot>`), which an adapter falls back to
//! until it has `minSamples` of its own. An adapter shares its base model's tokenizer, so the
//! family's prompt scale is its own; and a pool of tens of adapters, most of them rare, would
//! otherwise leave most of them on the static rule (measured on the `lora` benchmark, 32 adapters
//! under Zipf traffic: prompt estimates 4–6 % off at the median for most adapters, against 2 % for
//! a calibrated model), some for good, since 33 names in 32 slots collide.

use crate::config::EstimatorConfig;
use crate::estimate::cohort::Cohort;
use crate::estimate::engine_lengths;
use crate::estimate::output_dist::{bucket, OutputDist, Own, BUCKETS};
use crate::estimate::reservation::Learned;
use crate::estimate::slots::{self, Held, SLOTS};
use crate::estimate::templates::{Keys, Templates};
use crate::store::interface::{update_from, Store, StoreError, Versioned};
use hashbrown::HashMap;
use serde::{Deserialize, Serialize};

const CACHE_MS: u64 = 1_000;
/// How long a read that found a record short of `minSamples` stands: a tick, the most often the
/// VMs write their samples into it (`Calibration::flush`). Cached for a second,
/// a fresh gateway's first read held every request of the next second to the output prior's
/// guess however many answers had ended meanwhile: answers of 32 tokens on the prior of 256,
/// ten requests a pod for a second where the lengths, learned by a third of it, fit about
/// thirty (BENCHMARKS.md, *A record that has not learned, read again a tick later*). Only
/// until the model has learned, or for a model too rare to: at most four reads a second.
const UNLEARNED_CACHE_MS: u64 = crate::gate::TICK_MS;
/// Each answer counts one in the output-length histograms, and older ones fade by this much per
/// answer, so the histograms hold about the last 256 answers' worth: a distribution's tail needs
/// hundreds of samples to be seen at all (the prompt scale, one number, moves faster: its weight
/// is `estimator.calibrationWeight`), and a model's length profile drifts slowly.
const OUTPUT_FADE: f64 = 1.0 / 256.0;
/// A sample's tokens per streamed piece count as at most this many: more is not a stream of
/// tokens (a client's own chunking of a non-streamed body, say).
const MAX_TOKENS_PER_PIECE: f64 = 16.0;
/// A non-text part counts as at most this many tokens: a model's largest images take a few
/// thousand (Qwen2-VL's at 16k pixels a side, 16,384 by its default limit).
const MAX_PART_TOKENS: f64 = 65_536.0;

/// How far the fit of a prompt's tokens as a line is pulled toward one through zero, as a share
/// of the mean squared rule estimate: a pool whose prompts are all about one size cannot tell a
/// fixed part from a scale, and is fitted as a scale, as before the line; one whose sizes vary by
/// a third (`chat-short`) keeps nine tenths of its fixed part.
const OFFSET_SHRINK: f64 = 0.01;

/// The text-only responses' rule estimates (x) against the tokens the engine counted for what
/// kvgate estimated (y), as faded means: the line the prompt estimate is fitted to. A chat
/// template adds tokens to every request whatever its size (a ChatML turn's markers, Llama 3's
/// system header of about 25 tokens): fitted as a scale alone, by requests of every size, short
/// prompts were under-counted and long ones over-counted (the median error on 20–80-token chat
/// prompts was 10 %). One line per kind of prompt, as the engine renders it (`PromptFit`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
struct PromptLine {
    n: u32,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl PromptLine {
    /// Folds one response in, `weight` its share of the means.
    fn add(&mut self, x: f64, y: f64, weight: f64) {
        for (m, v) in [
            (&mut self.x, x),
            (&mut self.y, y),
            (&mut self.xx, x * x),
            (&mut self.xy, x * y),
        ] {
            *m += weight * (v - *m);
        }
        self.n = self.n.saturating_add(1);
    }

    /// The fixed part and the scale, least squares with the fixed part pulled toward zero by
    /// `OFFSET_SHRINK`; a line through zero when the fit's fixed part would be negative (a rule
    /// that over-counts every prompt is a scale below one, not tokens taken away).
    fn fit(&self) -> (f64, f64) {
        let det = (1.0 + OFFSET_SHRINK) * self.xx - self.x * self.x;
        if self.xx <= 0.0 || det <= 0.0 {
            return (0.0, 1.0);
        }
        let offset = (self.y * self.xx - self.x * self.xy) / det;
        if offset < 0.0 {
            return (0.0, self.xy / self.xx);
        }
        let scale = ((1.0 + OFFSET_SHRINK) * self.xy - self.x * self.y) / det;
        (offset, scale)
    }

    /// The fit, within what a tokenizer can be off by: a scale of 0.1 to 10, a fixed part no
    /// larger than a non-text part's most.
    fn fitted(&self) -> PromptFit {
        let (offset, scale) = self.fit();
        PromptFit {
            scale: scale.clamp(0.1, 10.0),
            offset: offset.min(MAX_PART_TOKENS),
        }
    }
}

/// How a model's engine counts a prompt's text: `scale` tokens per static-rule token, and
/// `offset` more for any text at all (the fixed part of what renders it), for each prompt: a
/// batch (a completions or embeddings list, a score request's pairs) is fitted and estimated as
/// its mean prompt, as many times as it has prompts (`tokens_each`), since the engine renders
/// each on its own (a BOS token each, a reranker's score template around each pair). Fitted apart for the
/// two kinds of prompt (`Request::templated`): a chat or responses prompt goes through the
/// model's chat template, whose fixed part is tens of tokens (Llama 3's system header alone
/// is about 25), and a completions prompt is taken as it is, with a BOS token at most. One line
/// for both fitted their mix: with a model served both ways, the completions prompts were
/// over-counted by part of the template and the chat prompts under-counted by the rest.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PromptFit {
    pub scale: f64,
    pub offset: f64,
}

impl PromptFit {
    /// The static rule as it is, before any response taught the model's own.
    pub const RULE: PromptFit = PromptFit {
        scale: 1.0,
        offset: 0.0,
    };

    /// The tokens a text of `rule` tokens by the static rule takes: a prompt with no text
    /// (token ids only) takes no fixed part.
    pub fn tokens(self, rule: f64) -> f64 {
        if rule >= 1.0 {
            rule * self.scale + self.offset
        } else {
            rule * self.scale
        }
    }

    /// The tokens `prompts` prompts of `rule` tokens by the static rule together take: each
    /// their mean's.
    pub fn tokens_each(self, rule: f64, prompts: u64) -> f64 {
        let n = prompts.max(1) as f64;
        n * self.tokens(rule / n)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct ModelStats {
    model: String,
    samples: u32,
    /// Real prompt tokens per rule token of a templated prompt, past `prompt_offset`
    /// (`PromptLine`).
    prompt_scale: f64,
    /// The tokens every templated text prompt holds besides its text's share: the chat
    /// template's fixed part, as the model's engine renders it. Absent from records written
    /// before it was fitted.
    #[serde(default)]
    prompt_offset: f64,
    #[serde(default)]
    prompt_line: PromptLine,
    /// The line of prompts no template renders (`PromptFit`), fitted when asked for. Absent
    /// until such a response was seen (records written before the kinds were told apart
    /// fitted both kinds in `prompt_line`).
    #[serde(default)]
    raw_line: Option<PromptLine>,
    /// The mean squared relative error of the scaled prompt estimate, faded like the scale:
    /// how far one request's prompt may be off, which the forecast's headroom covers. Absent
    /// from records written before it was measured.
    #[serde(default)]
    prompt_var: Option<f64>,
    /// Exponentially faded counts of answers that stopped by themselves, per length bucket.
    output: Vec<f64>,
    /// The same for answers their own `max_tokens` cut off (censored: the model would have
    /// gone on). Absent from records written before censoring was kept.
    #[serde(default)]
    cut: Vec<f64>,
    /// Answers of requests with a limit of their own that ended by themselves before it, faded
    /// like the length histograms: each shows the model's engine ending such answers where the
    /// model stops, not at their limit (`OutputDist::with_limits_ended`). Absent from records
    /// written before it was counted.
    #[serde(default)]
    ended_within_limit: f64,
    /// Streamed answers' output tokens and the pieces of text they came in, summed and faded
    /// like the length histograms: their ratio is the tokens a piece carries, 1 from an engine
    /// that sends a token a chunk, more from one that sends several (SGLang's
    /// `--stream-interval`, the tokens a speculative-decoding step accepts). A ratio of sums,
    /// not a mean of each answer's: an answer's last chunk holds what is left, so short answers
    /// carry fewer tokens a piece, and the long answers that hold a pod's KV would be counted
    /// short by their mean (a pool streaming four tokens a chunk learned 3.8 that way). Absent
    /// until a streamed answer's usage was seen.
    #[serde(default)]
    streamed: Option<(f64, f64)>,
    /// The tokens one non-text content part (an image, an audio clip) takes in the engine's
    /// prompt, and how many responses taught it: what a request's prompt held past its text
    /// (scaled) and its token ids, per part, faded like the scale. A model's own, as its
    /// processor makes it (Qwen2-VL's images take tokens by resolution, LLaVA's 576, others a
    /// few dozen): the configured `nonTextPartTokens` until learned. Absent from records written
    /// before it was learned.
    #[serde(default)]
    part_tokens: Option<f64>,
    #[serde(default)]
    part_samples: u32,
    /// Each prompt template's answers and the model's over them (`templates`). Absent until an
    /// answer of a known template ended by itself.
    #[serde(default, skip_serializing_if = "Templates::is_empty")]
    templates: Templates,
    updated_ms: u64,
}

impl ModelStats {
    fn new(model: &str) -> Self {
        Self {
            model: model.to_string(),
            samples: 0,
            prompt_scale: 1.0,
            prompt_offset: 0.0,
            prompt_line: PromptLine::default(),
            raw_line: None,
            prompt_var: None,
            output: vec![0.0; BUCKETS],
            cut: vec![0.0; BUCKETS],
            ended_within_limit: 0.0,
            streamed: None,
            part_tokens: None,
            part_samples: 0,
            templates: Templates::default(),
            updated_ms: 0,
        }
    }

    /// Folds one response in.
    fn add(&mut self, sample: &Sample, cfg: &EstimatorConfig) {
        let w = cfg.calibration_weight;
        // What the prompt held besides the tokens known exactly: its text and its parts.
        let estimated = sample.prompt_tokens.saturating_sub(sample.known_tokens) as f64;
        if sample.parts > 0 {
            // The text's share by the scale requests of text alone taught; what is left is the
            // parts'. (Taught by such requests too, the scale would take the parts' error for
            // the text's: a short question about an image is a few tokens of text beside
            // hundreds of the image's, and one model's text-only prompts were then estimated at
            // four times their size.)
            let fit = self.fit(sample.templated);
            let text = fit.tokens_each(sample.static_text_tokens, sample.prompts);
            let per_part = ((estimated - text) / sample.parts as f64).clamp(0.0, MAX_PART_TOKENS);
            let weight = w.max(1.0 / (self.part_samples as f64 + 1.0));
            let old = self.part_tokens.unwrap_or(per_part);
            self.part_tokens = Some(old + weight * (per_part - old));
            self.part_samples = self.part_samples.saturating_add(1);
        } else if sample.static_text_tokens >= 1.0 && estimated >= 1.0 {
            // Its mean prompt's.
            let n = sample.prompts.max(1) as f64;
            let x = sample.static_text_tokens / n;
            // A response more than ten times off the rule either way is not the rule's error.
            let y = (estimated / n).clamp(0.1 * x, 10.0 * x);
            // The error of the estimate this request was routed with, before the fit learns
            // from it.
            let error = y / self.fit(sample.templated).tokens(x) - 1.0;
            let line = if sample.templated {
                &mut self.prompt_line
            } else {
                self.raw_line.get_or_insert_with(PromptLine::default)
            };
            // Early samples count fully so the fit converges quickly from the rule's own count.
            let weight = w.max(1.0 / (line.n as f64 + 1.0));
            line.add(x, y, weight);
            if sample.templated {
                let fit = self.prompt_line.fitted();
                (self.prompt_scale, self.prompt_offset) = (fit.scale, fit.offset);
            }
            let var = self.prompt_var.unwrap_or(cfg.prompt_spread.powi(2));
            self.prompt_var = Some(var + weight * (error * error - var));
        }
        if sample.pieces > 0 && sample.completion_tokens > 0 {
            let (tokens, pieces) = self.streamed.unwrap_or_default();
            let keep = 1.0 - OUTPUT_FADE;
            self.streamed = Some((
                tokens * keep + sample.completion_tokens as f64,
                pieces * keep + sample.pieces as f64,
            ));
        }
        if sample.length != Length::Untold {
            for x in self.output.iter_mut().chain(self.cut.iter_mut()) {
                *x *= 1.0 - OUTPUT_FADE;
            }
            self.ended_within_limit *= 1.0 - OUTPUT_FADE;
            if sample.length == Length::Ended && sample.bounded {
                self.ended_within_limit += 1.0;
            }
            let into = if sample.length == Length::Cut {
                &mut self.cut
            } else {
                &mut self.output
            };
            let one = sample.completion_tokens / sample.choices.max(1);
            if let Some(x) = into.get_mut(bucket(one)) {
                *x += 1.0;
            }
            if sample.length == Length::Ended && !sample.template.is_empty() {
                self.templates.ended(&sample.template, one);
            }
        }
        self.samples = self.samples.saturating_add(1);
    }

    /// How the model's engine counts a templated prompt's text, or a raw one's. A kind not
    /// seen yet borrows the other's: a raw prompt the templated scale without its fixed part
    /// (there is no template to add it), a templated one the raw fit (short by the template's
    /// part until its first response, which the fit then takes in full).
    fn fit(&self, templated: bool) -> PromptFit {
        let own = PromptFit {
            scale: self.prompt_scale,
            offset: self.prompt_offset,
        };
        match (templated, self.raw_line) {
            (true, Some(raw)) if self.prompt_line.n == 0 => raw.fitted(),
            (true, _) => own,
            (false, Some(raw)) => raw.fitted(),
            (false, None) => PromptFit { offset: 0.0, ..own },
        }
    }

    /// What the record has learned, its lengths pooled with this VM's `cohort` of answers
    /// started (deaths and censorings added per bucket: `cohort`'s module says why).
    fn learned(
        &self,
        cohort: Option<&Cohort>,
        prior: Prior,
        cfg: &EstimatorConfig,
    ) -> Option<Learned> {
        let (mut ended, mut cut) = (self.output.clone(), self.cut.clone());
        if let Some((e, c)) = cohort.map(Cohort::counts) {
            for (into, from) in [(&mut ended, e), (&mut cut, c)] {
                into.resize(BUCKETS, 0.0);
                for (x, y) in into.iter_mut().zip(from) {
                    *x += y;
                }
            }
        }
        (self.samples >= cfg.min_samples).then(|| Learned {
            templated: self.fit(true),
            raw: self.fit(false),
            part_tokens: self.part_tokens.filter(|_| self.part_samples > 0),
            prompt_spread: self
                .prompt_var
                .map_or(cfg.prompt_spread, |v| v.max(0.0).sqrt().min(1.0)),
            output: OutputDist::learned(&ended, &cut, prior.tokens, prior.engines_mean(cfg))
                .with_limits_ended(self.ended_within_limit),
            tokens_per_piece: self
                .streamed
                .filter(|&(_, pieces)| pieces > 0.0)
                .map_or(1.0, |(tokens, pieces)| {
                    (tokens / pieces).clamp(1.0, MAX_TOKENS_PER_PIECE)
                }),
        })
    }
}

/// One finished response's ground truth.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// What the static rule said for the prompt's text part (0 when the prompt was token ids).
    pub static_text_tokens: f64,
    /// Its prompt went through the chat template (`Request::templated`).
    pub templated: bool,
    /// Tokens kvgate knew exactly: token ids, a stored conversation's history.
    pub known_tokens: u64,
    /// Its non-text content parts (images, audio).
    pub parts: u64,
    /// The prompts it carried (`Estimate::prompts`): the prompt fit learns from their mean.
    pub prompts: u64,
    pub prompt_tokens: u64,
    /// Over all its choices.
    pub completion_tokens: u64,
    /// Its answers (`n`): one answer's length is taken as their mean (the usage counts them
    /// together; learned as one answer's, a request for eight taught the model's every request
    /// eight times its length).
    pub choices: u64,
    pub length: Length,
    /// The request set its own output limit (a max-tokens field).
    pub bounded: bool,
    /// Pieces of text its stream carried (`ResponseMeter::pieces`); 0 for an answer that did
    /// not stream.
    pub pieces: u64,
    /// The keys of the prompt's template (`templates`); none when its lengths are not learned.
    pub template: Keys,
}

/// What an answer's length says of the model's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Length {
    /// The model stopped by itself: its length.
    Ended,
    /// The request's own limit cut the answer off: the model would have gone on.
    Cut,
    /// The engine held its end back (`min_tokens`, `ignore_eos`): nothing of where the model
    /// stops. Past a `min_tokens` floor the model did stop by itself, but only answers that
    /// ran past it show that, a sample of the long ones.
    Untold,
}

/// Marks a family record's name.
const FAMILY: &str = "\u{1}adapters";

/// The record all LoRA adapters of `base` are learned in together. The name cannot be a listed
/// model's (`models::served` keeps no name with a control character).
pub fn family(base: &str) -> String {
    format!("{base}{FAMILY}")
}

/// The prefix of the keys a record is looked for in (`slots`). Family records have slots of
/// their own (`kvgate.calf.<slot>`): with tens of adapters taking the model slots, a family
/// sharing them would often find them held.
fn slot_prefix(model: &str) -> &'static str {
    if model.ends_with(FAMILY) {
        "kvgate.calf."
    } else {
        "kvgate.cal."
    }
}

/// `model`'s record, if it has one.
fn read_record(store: &dyn Store, model: &str) -> Option<ModelStats> {
    let hash = crate::hash::fnv1a(model.as_bytes());
    slots::find(store, slot_prefix(model), hash, |bytes| {
        serde_json::from_slice::<ModelStats>(bytes)
            .ok()
            .filter(|s| s.model == model)
    })
}

/// The key `model`'s record is in, or is to be put in, as `now`, and its value as read: `None`
/// when every slot in its reach is held by another model still learning.
fn record_key(
    store: &dyn Store,
    model: &str,
    now: u64,
) -> Result<Option<(String, Versioned)>, StoreError> {
    let hash = crate::hash::fnv1a(model.as_bytes());
    slots::place(store, slot_prefix(model), hash, |bytes| {
        let stats = serde_json::from_slice::<ModelStats>(bytes).ok();
        Held::of(stats.map(|s| (s.model == model, s.updated_ms)), now)
    })
}

/// The output prior a model's requests without an output limit are estimated on until its
/// lengths are learned (`output_prior`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prior {
    /// Its mean answer, in tokens.
    pub tokens: u64,
    /// Nothing has measured it: it is `estimator.defaultOutputTokens`, a guess, with calibration
    /// on and the model's engines reporting no lengths. Every request estimated on it shares
    /// its error (`estimator.outputPriorSpread`, counted by `admission::forecast`). Measured
    /// when the engines have: their mean, or the configured one where theirs is shorter (then
    /// the guess errs long). Without calibration the configured mean is the operator's word and
    /// stands.
    pub guessed: bool,
}

impl Prior {
    /// The mean the engines measured, where it is what the prior is (longer than the configured
    /// one); else 0. Lengths kvgate learns do not lower the prior below it (`OutputDist::learned`).
    fn engines_mean(self, cfg: &EstimatorConfig) -> u64 {
        if self.guessed || self.tokens <= cfg.default_output_tokens {
            0
        } else {
            self.tokens
        }
    }

    /// The configured mean, as calibration on or off takes it.
    pub fn configured(cfg: &EstimatorConfig) -> Prior {
        Prior {
            tokens: cfg.default_output_tokens,
            guessed: cfg.calibrate,
        }
    }
}

/// The output prior for a model whose engines label their answers `engines` (an adapter's are
/// its base model's): its mean `estimator.defaultOutputTokens`, raised to the engines' own mean
/// once they have finished `minSamples` answers (`engine_lengths`), and no longer than the output
/// cap (an answer is taken to stop there anyway, and an engine reporting more, garbage or another
/// model's answers under its name, is held to it). The configured mean alone without
/// calibration. What estimates use, and what the status page and the per-model gauge show.
pub fn output_prior(store: &dyn Store, engines: &str, cfg: &EstimatorConfig) -> Prior {
    if !cfg.calibrate {
        return Prior::configured(cfg);
    }
    engine_lengths::mean(store, engines, f64::from(cfg.min_samples)).map_or(
        Prior::configured(cfg),
        |mean| Prior {
            tokens: (mean.round() as u64)
                .min(cfg.output_cap_tokens)
                .max(cfg.default_output_tokens),
            guessed: false,
        },
    )
}

/// What an estimate for a model goes by (`Calibration::known`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Known {
    /// What its answers taught, once it has `minSamples` of them.
    pub learned: Option<Learned>,
    /// Its output prior: `estimator.defaultOutputTokens`, or the mean its engines report where
    /// that is longer (`engine_lengths`).
    pub prior: Prior,
}

impl Known {
    fn prior(prior: Prior) -> Known {
        Known {
            learned: None,
            prior,
        }
    }
}

/// A VM's view of the learned values: reads shared data at most once a second per model.
#[derive(Default)]
pub struct Calibration {
    /// Per record read: when, what it says, and its templates' answers.
    cache: HashMap<String, (u64, Known, Templates)>,
    /// Samples gathered since the last flush: written once a tick, not once a response, so
    /// the shared records are not a point of contention on the request path.
    pending: Vec<(String, Sample)>,
    /// The answers this VM started last, per model and adapter family (`cohort`).
    cohorts: HashMap<String, Cohort>,
    /// Numbers the answers in the cohorts.
    started: u32,
}

/// An answer's place in its model's cohorts (`Calibration::started`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Started {
    seq: u32,
    /// The length bucket last noted: the cohorts hear of an answer again only when it moves to
    /// the next (a few dozen times over a long answer), not at every chunk.
    bucket: usize,
}

/// Samples kept between flushes at most; beyond, new ones are dropped (a tick's worth of
/// responses is plenty to learn from).
const MAX_PENDING: usize = 512;

impl Calibration {
    /// What `model` has learned; for an adapter still short of samples, its `family`'s.
    pub fn learned(
        &mut self,
        store: &dyn Store,
        model: &str,
        family: Option<&str>,
        cfg: &EstimatorConfig,
    ) -> Option<Learned> {
        self.known(store, model, family, cfg).learned
    }

    /// What an estimate for `model` goes by: what it has learned (for an adapter still short of
    /// samples, its `family`'s), and the output prior's mean, raised to what the engines of its
    /// base model report (`engine_lengths`: they label an adapter's answers with their base).
    pub fn known(
        &mut self,
        store: &dyn Store,
        model: &str,
        family: Option<&str>,
        cfg: &EstimatorConfig,
    ) -> Known {
        let engines = family.and_then(|f| f.strip_suffix(FAMILY)).unwrap_or(model);
        let own = self.known_as(store, model, engines, cfg);
        match family {
            Some(f) if own.learned.is_none() => Known {
                learned: self.known_as(store, f, engines, cfg).learned,
                ..own
            },
            _ => own,
        }
    }

    /// `record`'s slot, read at most once a second, with the prior of `engines`' answers.
    fn known_as(
        &mut self,
        store: &dyn Store,
        record: &str,
        engines: &str,
        cfg: &EstimatorConfig,
    ) -> Known {
        if !cfg.calibrate {
            return Known::prior(output_prior(store, engines, cfg));
        }
        let now = store.now_ms();
        if let Some((at, known, _)) = self.cache.get(record) {
            let stands = if known.learned.is_some() {
                CACHE_MS
            } else {
                UNLEARNED_CACHE_MS
            };
            if now.saturating_sub(*at) < stands {
                return *known;
            }
        }
        let prior = output_prior(store, engines, cfg);
        let stats = read_record(store, record);
        let learned = stats
            .as_ref()
            .and_then(|s| s.learned(self.cohorts.get(record), prior, cfg));
        let known = Known { learned, prior };
        let templates = stats.map(|s| s.templates).unwrap_or_default();
        // The cache is bounded like the slots: models beyond them are not worth remembering.
        if self.cache.len() >= SLOTS as usize * 4 {
            self.cache.clear();
        }
        self.cache
            .insert(record.to_string(), (now, known, templates));
        known
    }

    /// An answer for `model` (and its adapter `family`) has started streaming.
    pub fn started(
        &mut self,
        model: &str,
        family: Option<&str>,
        cfg: &EstimatorConfig,
    ) -> Option<Started> {
        if !cfg.calibrate {
            return None;
        }
        self.started = self.started.wrapping_add(1);
        // Bounded like the cache; a VM serving more models than that keeps learning from the
        // shared records alone for the ones it drops.
        if self.cohorts.len() >= SLOTS as usize * 2 {
            self.cohorts.clear();
        }
        for name in std::iter::once(model).chain(family) {
            self.cohorts
                .entry_ref(name)
                .or_default()
                .start(self.started);
        }
        Some(Started {
            seq: self.started,
            bucket: 0,
        })
    }

    /// What `model`'s cohort holds: per bucket, the answers ended and censored (tests).
    #[cfg(test)]
    pub fn cohort_counts(&self, model: &str) -> Option<([f64; BUCKETS], [f64; BUCKETS])> {
        self.cohorts.get(model).map(Cohort::counts)
    }

    /// The answer has streamed `tokens` so far, or stopped there (`over`: `Some(true)` by
    /// itself, `Some(false)` cut off by its limit or lost). Returns whether the cohorts heard
    /// of it (it moved to the next length bucket, or stopped).
    pub fn streamed(
        &mut self,
        model: &str,
        family: Option<&str>,
        at: &mut Started,
        tokens: u64,
        over: Option<bool>,
    ) -> bool {
        let b = bucket(tokens);
        if over.is_none() && b == at.bucket {
            return false;
        }
        at.bucket = b;
        for name in std::iter::once(model).chain(family) {
            if let Some(c) = self.cohorts.get_mut(name) {
                c.note(at.seq, tokens, over);
            }
        }
        true
    }

    /// What the answers to `model`'s prompts of `template` (the keys it goes by,
    /// `flow::admit`) say of the next one's length beyond the model's (`templates`), as its
    /// record read last (`known`) holds them.
    pub fn own(&self, model: &str, template: &Keys, cfg: &EstimatorConfig) -> Own {
        if !(cfg.calibrate && cfg.template_lengths) {
            return Own::NONE;
        }
        self.cache
            .get(model)
            .map_or(Own::NONE, |(_, _, t)| t.own(template))
    }

    /// Notes one response's ground truth, for `model` and its adapter `family` if it has one;
    /// `flush` writes it.
    pub fn observe(
        &mut self,
        model: &str,
        family: Option<&str>,
        sample: Sample,
        cfg: &EstimatorConfig,
    ) {
        // Templates are learned in the model's own record only: a request's `own` reads there.
        let family = family.map(|f| {
            (
                f,
                Sample {
                    template: Keys::default(),
                    ..sample
                },
            )
        });
        for (name, sample) in std::iter::once((model, sample)).chain(family) {
            if cfg.calibrate && self.pending.len() < MAX_PENDING {
                self.pending.push((name.to_string(), sample));
            }
        }
    }

    /// Writes the pending samples into the shared records: one read-modify-write per model,
    /// whatever the number of its samples. Written one sample at a time, a busy worker's tick
    /// decoded and re-encoded a model's record hundreds of times (up to `MAX_PENDING`), which
    /// stalled the requests that worker was serving for several milliseconds every tick.
    pub fn flush(&mut self, store: &dyn Store, cfg: &EstimatorConfig) -> Result<(), StoreError> {
        let mut pending = std::mem::take(&mut self.pending);
        // A stable sort: each model's samples stay in the order they came.
        pending.sort_by(|a, b| a.0.cmp(&b.0));
        for group in pending.chunk_by(|a, b| a.0 == b.0) {
            let Some((model, _)) = group.first() else {
                continue;
            };
            let samples: Vec<Sample> = group.iter().map(|(_, s)| *s).collect();
            Self::record(store, model, &samples, cfg)?;
        }
        Ok(())
    }

    /// Folds responses into the model's shared record, in order, in one read-modify-write.
    pub fn record(
        store: &dyn Store,
        model: &str,
        samples: &[Sample],
        cfg: &EstimatorConfig,
    ) -> Result<(), StoreError> {
        if !cfg.calibrate || samples.is_empty() {
            return Ok(());
        }
        let now = store.now_ms();
        let Some((key, seen)) = record_key(store, model, now)? else {
            return Ok(());
        };
        // Checked again on the value written over: another VM may have put a model there since.
        update_from(store, &key, Some(seen), |current| {
            let existing = current.and_then(|b| serde_json::from_slice::<ModelStats>(b).ok());
            let held = Held::of(
                existing.as_ref().map(|s| (s.model == model, s.updated_ms)),
                now,
            );
            let mut stats = match (held, existing) {
                (Held::Mine, Some(s)) => s,
                (Held::Other, _) => return None,
                _ => ModelStats::new(model),
            };
            stats.output.resize(BUCKETS, 0.0);
            stats.cut.resize(BUCKETS, 0.0);
            for sample in samples {
                stats.add(sample, cfg);
            }
            stats.updated_ms = now;
            serde_json::to_vec(&stats).ok().map(|b| (b, ()))
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::store::fake_host::FakeHost;
    use crate::test_support::{two_vms, Watched};

    fn sample(static_tokens: f64, real: u64, out: u64) -> Sample {
        Sample {
            static_text_tokens: static_tokens,
            templated: true,
            known_tokens: 0,
            parts: 0,
            prompts: 1,
            prompt_tokens: real,
            completion_tokens: out,
            choices: 1,
            length: Length::Ended,
            bounded: false,
            pieces: 0,
            template: Keys::default(),
        }
    }

    /// The estimator's defaults, but learning a model from its `n`th answer on.
    fn learning_after(n: u32) -> EstimatorConfig {
        EstimatorConfig {
            min_samples: n,
            ..EstimatorConfig::default()
        }
    }

    #[test]
    fn learns_scale_and_output_lengths_shared_across_vms() {
        let (a, b) = two_vms();
        let cfg = EstimatorConfig {
            min_samples: 5,
            calibration_weight: 0.2,
            ..EstimatorConfig::default()
        };
        let mut cal = Calibration::default();
        for i in 0..200 {
            let out = if i % 10 == 0 { 1000 } else { 100 };
            Calibration::record(&a, "m", &[sample(100.0, 130, out)], &cfg).unwrap();
        }
        let learned = cal.learned(&b, "m", None, &cfg).unwrap();
        assert!((learned.templated.scale - 1.3).abs() < 0.01, "{learned:?}");
        // 10 % of outputs are 1000 tokens, the rest 100: a mean of 190 and one answer in ten
        // still running at 500 tokens, within a bucket's width and the prior's small weight.
        let mean = learned.output.expected(0, 100_000);
        assert!((170..=240).contains(&mean), "mean {mean}");
        let tail = learned.output.survival(500.0);
        assert!((0.08..=0.14).contains(&tail), "P(> 500) = {tail}");
        assert!(learned.output.survival(150.0) < 0.2);
        assert_eq!(cal.learned(&b, "other", None, &cfg), None);
    }

    /// Every worker's answers teach each template's lengths: one VM's flushes reach another's
    /// estimate with the model's record; an adapter's family record learns none, and a template
    /// whose lengths are off (or calibration) is the model's.
    #[test]
    fn each_templates_lengths_are_learned_in_the_models_record_by_every_vm() {
        let (a, b) = two_vms();
        let cfg = learning_after(5);
        let (mut on_a, mut on_b) = (Calibration::default(), Calibration::default());
        for i in 0..40 {
            for (template, out) in [(1, 6 + i % 3), (2, 400 + i % 20)] {
                let s = Sample {
                    template: Keys::one(template),
                    ..sample(100.0, 130, out)
                };
                on_a.observe("m", Some(&family("base")), s, &cfg);
            }
        }
        on_a.flush(&a, &cfg).unwrap();
        on_b.known(&b, "m", None, &cfg);
        let (short, long) = (
            on_b.own("m", &Keys::one(1), &cfg),
            on_b.own("m", &Keys::one(2), &cfg),
        );
        assert!(
            (f64::from(short.mean) - 7f64.log2()).abs() < 0.2,
            "{short:?}"
        );
        assert!(
            (f64::from(long.mean) - 410f64.log2()).abs() < 0.1,
            "{long:?}"
        );
        assert!(short.weight > 0.9 && long.weight > 0.9);
        assert_eq!(
            on_b.own("m", &Keys::one(3), &cfg),
            Own::NONE,
            "a template never seen"
        );
        let family = read_record(&b, &family("base")).unwrap();
        assert!(family.templates.is_empty() && family.samples == 80);
        let off = EstimatorConfig {
            template_lengths: false,
            ..cfg.clone()
        };
        assert_eq!(on_b.own("m", &Keys::one(1), &off), Own::NONE);
        let uncalibrated = EstimatorConfig {
            calibrate: false,
            ..cfg
        };
        assert_eq!(on_b.own("m", &Keys::one(1), &uncalibrated), Own::NONE);
    }

    /// A chat template adds tokens to every prompt whatever its size: prompts of 20 to 800 rule
    /// tokens that take 30 + 1.2 × that are fitted as such, and a short prompt and a long one
    /// are both estimated within 2 %, where a scale alone was 20 % short on the short one.
    #[test]
    fn a_fixed_part_of_every_prompt_is_learned_beside_the_scale() {
        let vm = FakeHost::new().vm();
        let cfg = learning_after(5);
        for i in 0..200u32 {
            let rule = 20.0 * 1.2f64.powi((i % 21) as i32);
            let real = (30.0 + 1.2 * rule).round() as u64;
            Calibration::record(&vm, "m", &[sample(rule, real, 100)], &cfg).unwrap();
        }
        let learned = Calibration::default()
            .learned(&vm, "m", None, &cfg)
            .unwrap();
        assert!((learned.templated.offset - 30.0).abs() < 3.0, "{learned:?}");
        assert!((learned.templated.scale - 1.2).abs() < 0.02, "{learned:?}");
        for rule in [20.0, 800.0] {
            let est = learned.templated.tokens(rule);
            let real = 30.0 + 1.2 * rule;
            assert!((est / real - 1.0).abs() < 0.02, "{rule}: {est} for {real}");
        }
        assert!(learned.prompt_spread < 0.1, "{learned:?}");
    }

    /// A reranker renders a template around each pair (or an engine a BOS token before each
    /// prompt of a batch): pages of 1 to 64 pairs, each pair 30 + 1.1 × its rule tokens, are
    /// fitted as their mean pair, so a page of any size is estimated within 2 %. Fitted as
    /// whole requests, the fixed part was counted once a page: a page of 64 short pairs was
    /// estimated 30 % short, and a page of one 45 % over.
    #[test]
    fn a_batchs_prompts_are_each_given_the_fixed_part() {
        let vm = FakeHost::new().vm();
        let cfg = learning_after(5);
        let page = |pairs: u64, rule_each: f64| {
            let real = pairs as f64 * (30.0 + 1.1 * rule_each);
            Sample {
                prompts: pairs,
                ..sample(pairs as f64 * rule_each, real.round() as u64, 0)
            }
        };
        for i in 0..200u32 {
            let pairs = 1 << (i % 7);
            let rule_each = 40.0 + f64::from(i % 13) * 20.0;
            Calibration::record(&vm, "m", &[page(pairs, rule_each)], &cfg).unwrap();
        }
        let learned = Calibration::default()
            .learned(&vm, "m", None, &cfg)
            .unwrap();
        assert!((learned.templated.offset - 30.0).abs() < 3.0, "{learned:?}");
        for (pairs, rule_each) in [(1, 300.0), (64, 40.0), (8, 120.0)] {
            let est = learned
                .templated
                .tokens_each(pairs as f64 * rule_each, pairs);
            let real = pairs as f64 * (30.0 + 1.1 * rule_each);
            assert!((est / real - 1.0).abs() < 0.02, "{pairs}: {est} for {real}");
        }
    }

    /// A model served both through its chat template and as raw completions: each kind is
    /// fitted on its own, so neither takes the other's share of the template. One line for
    /// both, fitted to this mix by least squares, puts a completions prompt of 20 rule tokens
    /// 58 % over and a chat prompt of 20 27 % under.
    #[test]
    fn templated_and_raw_prompts_are_fitted_apart() {
        let vm = FakeHost::new().vm();
        let cfg = learning_after(5);
        let real = |templated: bool, rule: f64| {
            (if templated { 30.0 } else { 1.0 } + 1.2 * rule).round() as u64
        };
        // Before any raw response, a raw prompt takes the templated scale without its fixed part.
        for i in 0..100u32 {
            let rule = 20.0 * 1.2f64.powi((i % 21) as i32);
            Calibration::record(&vm, "m", &[sample(rule, real(true, rule), 100)], &cfg).unwrap();
        }
        let chat_only = Calibration::default()
            .learned(&vm, "m", None, &cfg)
            .unwrap();
        assert_eq!(chat_only.raw.offset, 0.0, "{chat_only:?}");
        assert_eq!(chat_only.raw.scale, chat_only.templated.scale);
        for i in 0..200u32 {
            let rule = 20.0 * 1.2f64.powi((i % 21) as i32);
            let templated = i % 2 == 0;
            let s = Sample {
                templated,
                ..sample(rule, real(templated, rule), 100)
            };
            Calibration::record(&vm, "m", &[s], &cfg).unwrap();
        }
        let learned = Calibration::default()
            .learned(&vm, "m", None, &cfg)
            .unwrap();
        assert!((learned.templated.offset - 30.0).abs() < 3.0, "{learned:?}");
        assert!(learned.raw.offset < 3.0, "{learned:?}");
        for (fit, templated) in [(learned.templated, true), (learned.raw, false)] {
            for rule in [20.0, 800.0] {
                let (est, real) = (fit.tokens(rule), real(templated, rule) as f64);
                assert!(
                    (est / real - 1.0).abs() < 0.05,
                    "{templated} {rule}: {est} for {real}"
                );
            }
        }
    }

    /// Prompts all of one size cannot tell a fixed part from a scale: they are fitted as a
    /// scale. A rule that over-counts every prompt is a scale below one, never a negative
    /// fixed part; and a prompt of token ids alone takes no fixed part.
    #[test]
    fn one_size_of_prompt_or_a_rule_that_over_counts_is_fitted_as_a_scale() {
        let (one_size, over_counted) = (FakeHost::new().vm(), FakeHost::new().vm());
        let cfg = learning_after(5);
        for i in 0..100u32 {
            Calibration::record(&one_size, "m", &[sample(100.0, 130, 100)], &cfg).unwrap();
            let rule = 50.0 + (i % 10) as f64 * 50.0;
            let real = (0.8 * rule - 10.0).round() as u64;
            Calibration::record(&over_counted, "m", &[sample(rule, real, 100)], &cfg).unwrap();
        }
        let learned = |vm| Calibration::default().learned(vm, "m", None, &cfg).unwrap();
        let one = learned(&one_size);
        assert!(one.templated.offset < 0.5, "{one:?}");
        assert!((one.templated.scale - 1.3).abs() < 0.01, "{one:?}");
        let over = learned(&over_counted);
        assert_eq!(over.templated.offset, 0.0, "{over:?}");
        assert!((0.7..0.8).contains(&over.templated.scale), "{over:?}");
        let fit = PromptFit {
            scale: 1.3,
            offset: 30.0,
        };
        assert_eq!(fit.tokens(0.0), 0.0);
    }

    /// A record written before the fixed part was fitted (a reloaded plugin reads what its
    /// predecessor left in Envoy's shared data) keeps its scale and goes on learning.
    #[test]
    fn a_record_without_the_line_is_read_and_learns_on() {
        let mut old = ModelStats::new("m");
        old.prompt_scale = 1.3;
        old.samples = 50;
        let mut json: serde_json::Value = serde_json::to_value(&old).unwrap();
        let fields = json.as_object_mut().unwrap();
        fields.remove("prompt_offset");
        fields.remove("prompt_line");
        let mut read: ModelStats = serde_json::from_value(json).unwrap();
        assert_eq!((read.prompt_scale, read.prompt_offset), (1.3, 0.0));
        let cfg = learning_after(5);
        for _ in 0..20 {
            read.add(&sample(100.0, 150, 100), &cfg);
        }
        assert!(
            (read.fit(true).tokens(100.0) - 150.0).abs() < 1.0,
            "{read:?}"
        );
    }

    /// A request for eight answers reports their tokens together: the model learns one
    /// answer's length from it, not eight answers' as one.
    #[test]
    fn a_request_of_several_choices_teaches_one_answers_length() {
        let vm = FakeHost::new().vm();
        let cfg = learning_after(5);
        let eight = Sample {
            choices: 8,
            ..sample(100.0, 100, 800)
        };
        for _ in 0..200 {
            Calibration::record(&vm, "m", &[eight], &cfg).unwrap();
        }
        let learned = Calibration::default()
            .learned(&vm, "m", None, &cfg)
            .unwrap();
        let mean = learned.output.expected(0, 100_000);
        assert!((90..=130).contains(&mean), "mean {mean}");
    }

    /// Streamed answers teach how many tokens a piece of text carries; answers that did not
    /// stream (no pieces) leave it alone, and a model no stream has taught counts one.
    #[test]
    fn tokens_per_streamed_piece_are_learned_from_usage() {
        let host = FakeHost::new();
        let vm = host.vm();
        let cfg = learning_after(5);
        let streamed = |out, pieces| Sample {
            pieces,
            ..sample(100.0, 100, out)
        };
        for _ in 0..20 {
            Calibration::record(&vm, "one", &[streamed(100, 100)], &cfg).unwrap();
            // Four tokens a chunk, an answer's last chunk what is left: long and short answers
            // (each one's own ratio 3.99 and 2.5), and one that did not stream.
            Calibration::record(
                &vm,
                "four",
                &[streamed(997, 250), streamed(5, 2), sample(100.0, 100, 300)],
                &cfg,
            )
            .unwrap();
            Calibration::record(&vm, "none", &[sample(100.0, 100, 100)], &cfg).unwrap();
        }
        let per_piece = |model| {
            Calibration::default()
                .learned(&vm, model, None, &cfg)
                .unwrap()
                .tokens_per_piece
        };
        assert_eq!(per_piece("one"), 1.0);
        // About 3.98 (each faded once more than the next); counted at the answers' mean ratio,
        // 3.24, a long answer would lag a fifth behind.
        assert!(
            (per_piece("four") - 1002.0 / 252.0).abs() < 1e-3,
            "{}",
            per_piece("four")
        );
        assert_eq!(per_piece("none"), 1.0);
    }

    /// The shared record has seen only short answers finish; this VM has long ones still
    /// streaming. They count as running past what they have streamed (censored), so the
    /// lengths learned are not the finished ones' alone, and once they end they are deaths
    /// like any other. An adapter's answers count for its family too.
    #[test]
    fn answers_still_streaming_lengthen_what_is_learned() {
        let host = FakeHost::new();
        let vm = host.vm();
        let cfg = learning_after(5);
        for _ in 0..100 {
            Calibration::record(&vm, "m", &[sample(100.0, 100, 100)], &cfg).unwrap();
        }
        let finished_only = Calibration::default()
            .learned(&vm, "m", None, &cfg)
            .unwrap()
            .output;
        let mut cal = Calibration::default();
        let fam = family("m");
        let mut running: Vec<Started> = (0..100)
            .map(|_| cal.started("m", Some(&fam), &cfg).unwrap())
            .collect();
        for at in &mut running {
            for tokens in (16..=600).step_by(16) {
                cal.streamed("m", Some(&fam), at, tokens, None);
            }
        }
        let with_running = cal.learned(&vm, "m", None, &cfg).unwrap().output;
        assert!(finished_only.survival(300.0) < 0.05, "{finished_only:?}");
        // Half the answers seen are still running at 600: at least that many run past 300.
        assert!(with_running.survival(300.0) > 0.45, "{with_running:?}");
        assert!(with_running.expected(0, 8192) > 2 * finished_only.expected(0, 8192));
        // Once they end at 600, they are lengths: half at 100, half at 600.
        for at in &mut running {
            cal.streamed("m", Some(&fam), at, 600, Some(true));
        }
        host.advance_ms(CACHE_MS);
        let ended = cal.learned(&vm, "m", None, &cfg).unwrap().output;
        assert!((0.45..0.55).contains(&ended.survival(300.0)), "{ended:?}");
        assert!(ended.survival(700.0) < 0.1, "{ended:?}");
        // The family's cohort heard of them too.
        assert_eq!(
            cal.cohorts.get(&fam).map(|c| c.counts().0[bucket(600)]),
            Some(100.0)
        );
    }

    #[test]
    fn learns_how_far_the_scaled_prompt_estimate_is_off() {
        let vm = FakeHost::new().vm();
        let cfg = learning_after(5);
        // The rule says 100 for prompts of 120 ± 6 tokens (5 % of 120): once the scale has
        // learned the 1.2, what is left is the 5 %.
        for i in 0..400 {
            let real = if i % 2 == 0 { 114 } else { 126 };
            Calibration::record(&vm, "m", &[sample(100.0, real, 10)], &cfg).unwrap();
        }
        let learned = Calibration::default()
            .learned(&vm, "m", None, &cfg)
            .unwrap();
        assert!((learned.templated.scale - 1.2).abs() < 0.01, "{learned:?}");
        assert!(
            (0.04..=0.06).contains(&learned.prompt_spread),
            "{learned:?}"
        );
        // A rule that is exactly right leaves no spread to pay for.
        for _ in 0..400 {
            Calibration::record(&vm, "exact", &[sample(100.0, 100, 10)], &cfg).unwrap();
        }
        let exact = Calibration::default()
            .learned(&vm, "exact", None, &cfg)
            .unwrap();
        assert!(exact.prompt_spread < 0.01, "{exact:?}");
    }

    /// Engines that have answered a model at 750 tokens on average, before kvgate has seen an
    /// answer: the prior's mean is theirs, for the model and for its adapters (vLLM labels an
    /// adapter's answers with its base model), and stays theirs under what kvgate then learns.
    /// Engines that report shorter answers than the configured prior leave it as it is. Only a
    /// prior nothing measured is a guess (`Prior::guessed`).
    #[test]
    fn the_engines_answers_raise_the_prior_before_the_first_answer() {
        use crate::estimate::engine_lengths::EngineLengths;
        use crate::pods::metrics::AnswerTotals;
        let host = FakeHost::new();
        let vm = host.vm();
        let cfg = learning_after(5);
        let report = |model: &str, mean: f64| {
            EngineLengths::default()
                .note(
                    &vm,
                    "pod:1",
                    AnswerTotals {
                        model: crate::hash::fnv1a(model.as_bytes()),
                        tokens: mean * 100.0,
                        count: 100.0,
                    },
                    host.now_ms(),
                )
                .unwrap();
        };
        report("m", 750.0);
        report("short", 100.0);
        let mut cal = Calibration::default();
        let measured = |tokens| Prior {
            tokens,
            guessed: false,
        };
        let known = cal.known(&vm, "m", None, &cfg);
        assert_eq!((known.learned, known.prior), (None, measured(750)));
        let adapter = cal.known(&vm, "m-lora", Some(&family("m")), &cfg);
        assert_eq!(adapter.prior, measured(750));
        assert_eq!(cal.known(&vm, "short", None, &cfg).prior, measured(256));
        assert_eq!(
            cal.known(&vm, "unreported", None, &cfg).prior,
            Prior {
                tokens: 256,
                guessed: true
            }
        );
        // Garbage: answers longer than the output cap are held to it.
        report("absurd", 1e12);
        assert_eq!(
            cal.known(&vm, "absurd", None, &cfg).prior,
            measured(cfg.output_cap_tokens)
        );
        // An unbounded request's estimate before anything is learned: the engines' mean.
        let req = crate::openai::request::Request::default();
        let e = crate::estimate::reservation::estimate_from(
            &req,
            crate::estimate::reservation::StaticCount {
                all: 10.0,
                query: 0.0,
            },
            known.learned,
            known.prior,
            &cfg,
        );
        assert!((740..=760).contains(&e.output_tokens), "{e:?}");
        assert!(!e.output_guessed);
        // Learned from kvgate's own short answers, the tail past them still fades at 750.
        for _ in 0..50 {
            Calibration::record(&vm, "m", &[sample(100.0, 100, 50)], &cfg).unwrap();
        }
        host.advance_ms(CACHE_MS);
        let learned = cal.known(&vm, "m", None, &cfg).learned.unwrap().output;
        let fade = learned.survival(1_100.0) / learned.survival(600.0);
        assert!((fade - (-500.0f64 / 750.0).exp()).abs() < 0.05, "{fade}");
        // Without calibration the configured prior alone.
        let off = EstimatorConfig {
            calibrate: false,
            ..cfg
        };
        assert_eq!(cal.known(&vm, "m", None, &off).prior, measured(256));
    }

    /// A vision model's traffic: text-only chats (the rule says 100 for 120 tokens) and short
    /// questions about an image (10 by the rule, 12 real, plus the image's 1,200 after its token
    /// ids' 30). The text-only ones teach the scale; those with an image, the image's cost. The
    /// scale used to learn from both, and took the image's 700 tokens past the configured 512
    /// for the text's: the text-only prompts were then estimated at about four times their size.
    #[test]
    fn a_part_costs_what_the_prompts_carrying_it_held_past_their_text() {
        let vm = FakeHost::new().vm();
        let cfg = learning_after(5);
        for i in 0..200 {
            let s = if i % 2 == 0 {
                sample(100.0, 120, 10)
            } else {
                Sample {
                    known_tokens: 30,
                    parts: 1,
                    ..sample(10.0, 30 + 12 + 1_200, 10)
                }
            };
            Calibration::record(&vm, "vl", &[s], &cfg).unwrap();
        }
        let learned = Calibration::default()
            .learned(&vm, "vl", None, &cfg)
            .unwrap();
        assert!((learned.templated.scale - 1.2).abs() < 0.01, "{learned:?}");
        let part = learned.part_tokens.unwrap_or_default();
        assert!((part - 1_200.0).abs() < 2.0, "{learned:?}");
        assert!(learned.prompt_spread < 0.02, "{learned:?}");
        // Estimated so: an image request within a token or two, a text-only one exact.
        let image = crate::openai::request::Request {
            non_text_parts: 1,
            token_ids: 30,
            templated: true,
            ..crate::openai::request::Request::default()
        };
        let e = crate::estimate::reservation::estimate_from(
            &image,
            crate::estimate::reservation::StaticCount {
                all: 10.0,
                query: 0.0,
            },
            Some(learned),
            Prior::configured(&cfg),
            &cfg,
        );
        assert!(e.prompt_tokens.abs_diff(1_242) <= 2, "{e:?}");
        // A model no request with parts has taught keeps the configured cost.
        for _ in 0..10 {
            Calibration::record(&vm, "text", &[sample(100.0, 120, 10)], &cfg).unwrap();
        }
        let text = Calibration::default().learned(&vm, "text", None, &cfg);
        assert_eq!(text.and_then(|l| l.part_tokens), None);
    }

    #[test]
    fn needs_min_samples_and_caches_a_learned_record_for_a_second() {
        let host = FakeHost::new();
        let vm = host.vm();
        let cfg = learning_after(3);
        let mut cal = Calibration::default();
        for _ in 0..2 {
            Calibration::record(&vm, "m", &[sample(10.0, 20, 5)], &cfg).unwrap();
        }
        assert_eq!(cal.learned(&vm, "m", None, &cfg), None);
        Calibration::record(&vm, "m", &[sample(10.0, 20, 5)], &cfg).unwrap();
        assert_eq!(cal.learned(&vm, "m", None, &cfg), None, "cached");
        // Short of samples, read again a tick later, not a second.
        host.advance_ms(UNLEARNED_CACHE_MS);
        let learned = cal.learned(&vm, "m", None, &cfg);
        assert!(learned.is_some());
        // Learned, it stands for a second.
        Calibration::record(&vm, "m", &[sample(10.0, 20, 50); 20], &cfg).unwrap();
        host.advance_ms(CACHE_MS - 1);
        assert_eq!(cal.learned(&vm, "m", None, &cfg), learned, "cached");
        host.advance_ms(1);
        assert_ne!(cal.learned(&vm, "m", None, &cfg), learned);
    }

    /// The key `model`'s name hash points at first.
    fn home_key(model: &str) -> String {
        let hash = crate::hash::fnv1a(model.as_bytes());
        format!("{}{}", slot_prefix(model), hash % SLOTS)
    }

    #[test]
    fn models_whose_names_share_a_slot_each_learn_and_an_idle_ones_slot_is_taken() {
        let host = FakeHost::new();
        let vm = host.vm();
        let cfg = learning_after(1);
        let a = "model-a".to_string();
        let mut sharing = (0..)
            .map(|i| format!("model-{i}"))
            .filter(|m| *m != a && home_key(m) == home_key(&a));
        let (b, c) = (
            sharing.next().unwrap_or_default(),
            sharing.next().unwrap_or_default(),
        );
        host.set_now_ms(1);
        // Before, the second of two models in one slot kept the static rule while the first was
        // learning.
        Calibration::record(&vm, &a, &[sample(10.0, 20, 5)], &cfg).unwrap();
        Calibration::record(&vm, &b, &[sample(10.0, 30, 7)], &cfg).unwrap();
        let learned = |m: &str| Calibration::default().learned(&vm, m, None, &cfg);
        let (la, lb) = (learned(&a), learned(&b));
        assert!(la.is_some() && lb.is_some() && la != lb, "{la:?} {lb:?}");
        // Long after, `a` has learned nothing more; `b` has, and `c` takes `a`'s slot.
        host.advance_ms(slots::IDLE_MS - 1);
        Calibration::record(&vm, &b, &[sample(10.0, 30, 7)], &cfg).unwrap();
        host.advance_ms(1);
        Calibration::record(&vm, &c, &[sample(10.0, 20, 5)], &cfg).unwrap();
        assert!(learned(&c).is_some() && learned(&b).is_some());
        assert!(learned(&a).is_none(), "the idle one's slot was given");
        assert!(
            serde_json::from_slice::<ModelStats>(
                &vm.get(&home_key(&a)).unwrap().value.unwrap_or_default()
            )
            .is_ok_and(|s| s.model == c),
            "in its home slot, not a new one"
        );
    }

    #[test]
    fn observed_samples_reach_shared_data_at_the_flush() {
        let vm = FakeHost::new().vm();
        let cfg = learning_after(2);
        let mut cal = Calibration::default();
        cal.observe("m", None, sample(10.0, 20, 5), &cfg);
        cal.observe("m", None, sample(10.0, 20, 5), &cfg);
        assert_eq!(Calibration::default().learned(&vm, "m", None, &cfg), None);
        cal.flush(&vm, &cfg).unwrap();
        assert!(Calibration::default()
            .learned(&vm, "m", None, &cfg)
            .is_some());
        cal.flush(&vm, &cfg).unwrap();
    }

    #[test]
    fn answers_cut_by_their_max_tokens_say_the_model_would_go_on() {
        let vm = FakeHost::new().vm();
        let cfg = learning_after(1);
        for _ in 0..100 {
            let cut = Sample {
                length: Length::Cut,
                ..sample(10.0, 10, 50)
            };
            Calibration::record(&vm, "m", &[cut], &cfg).unwrap();
            Calibration::record(&vm, "short", &[sample(10.0, 10, 50)], &cfg).unwrap();
        }
        let learned = |model| {
            Calibration::default()
                .learned(&vm, model, None, &cfg)
                .unwrap()
        };
        assert!(
            learned("m").output.survival(45.0) > 0.95,
            "all still running at 45"
        );
        assert!(
            learned("short").output.survival(60.0) < 0.1,
            "all stopped by 60"
        );
    }

    /// Answers of requests with a limit that end before it teach that this engine ends them
    /// where the model stops: a far limit is then not held for. Answers run to their limit (a
    /// benchmark's engine) teach nothing of the kind, and the prior holds.
    #[test]
    fn answers_ended_within_their_limit_say_the_engine_does_not_run_to_it() {
        let vm = FakeHost::new().vm();
        let cfg = learning_after(1);
        for _ in 0..100 {
            let within = Sample {
                bounded: true,
                ..sample(10.0, 10, 50)
            };
            let to_limit = Sample {
                bounded: true,
                length: Length::Cut,
                ..sample(10.0, 10, 50)
            };
            Calibration::record(&vm, "honours", &[within], &cfg).unwrap();
            // Unbounded answers say nothing of limits: only the cut ones are about them.
            Calibration::record(&vm, "runs", &[sample(10.0, 10, 50), to_limit], &cfg).unwrap();
        }
        let far = |model| {
            let learned = Calibration::default().learned(&vm, model, None, &cfg);
            learned
                .unwrap()
                .output
                .of_request(true, 0)
                .expected(0, 8192)
        };
        assert!(far("honours") < 60, "{}", far("honours"));
        assert!(far("runs") > 200, "{}", far("runs"));
    }

    #[test]
    fn an_adapter_short_of_samples_learns_from_its_family() {
        let vm = FakeHost::new().vm();
        let cfg = learning_after(20);
        let fam = family("base");
        let mut cal = Calibration::default();
        // Forty adapters of the same base, two answers each: none has enough of its own.
        for k in 0..40 {
            for _ in 0..2 {
                cal.observe(
                    &format!("lora-{k}"),
                    Some(&fam),
                    sample(100.0, 130, 5),
                    &cfg,
                );
            }
            cal.flush(&vm, &cfg).unwrap();
        }
        let fresh = || Calibration::default();
        assert_eq!(fresh().learned(&vm, "lora-3", None, &cfg), None);
        let pooled = fresh().learned(&vm, "lora-3", Some(&fam), &cfg).unwrap();
        assert!((pooled.templated.scale - 1.3).abs() < 0.01, "{pooled:?}");
        // The base model's own record learned nothing from its adapters.
        assert_eq!(fresh().learned(&vm, "base", None, &cfg), None);
        // An adapter with samples enough of its own goes by them.
        for _ in 0..20 {
            cal.observe("lora-3", Some(&fam), sample(100.0, 90, 5), &cfg);
        }
        cal.flush(&vm, &cfg).unwrap();
        let own = fresh().learned(&vm, "lora-3", Some(&fam), &cfg).unwrap();
        assert!(own.templated.scale < 1.0, "{own:?}");
        assert!(
            family("base").chars().any(char::is_control),
            "no listed name is a family"
        );
    }

    #[test]
    fn a_flush_reads_and_writes_each_model_once_and_learns_as_one_sample_at_a_time() {
        let (a, b) = two_vms();
        let cfg = learning_after(5);
        let answers: Vec<(&str, Sample)> = (0..300)
            .map(|i| {
                let model = if i % 3 == 0 { "n" } else { "m" };
                (model, sample(100.0, 100 + i % 40, 10 + 7 * i % 500))
            })
            .collect();
        for (model, s) in &answers {
            Calibration::record(&a, &format!("{model}-alone"), &[*s], &cfg).unwrap();
        }
        let mut cal = Calibration::default();
        for (model, s) in &answers {
            cal.observe(model, None, *s, &cfg);
        }
        let watched = Watched::new(&b);
        cal.flush(&watched, &cfg).unwrap();
        // A record first put is read twice: a key never written is read again just before its
        // (blind) write, in case another VM has written it since.
        assert_eq!(watched.reads_of(&home_key("m")), 2);
        assert_eq!(watched.reads_of(&home_key("n")), 2);
        for model in ["m", "n"] {
            let batched = Calibration::default().learned(&b, model, None, &cfg);
            let alone = Calibration::default().learned(&a, &format!("{model}-alone"), None, &cfg);
            assert!(batched.is_some() && batched == alone, "{model}");
        }
        // Once there, once: the read that finds it is the one its compare-and-swap goes by.
        for (model, s) in &answers {
            cal.observe(model, None, *s, &cfg);
        }
        let watched = Watched::new(&b);
        cal.flush(&watched, &cfg).unwrap();
        assert_eq!(watched.reads_of(&home_key("m")), 1);
        assert_eq!(watched.reads_of(&home_key("n")), 1);
    }
}
