//! Self-calibration of the estimator, per model, shared by every worker: each response's `usage`
//! moves a model's prompt scale (real tokens per static-rule token) and its output-length
//! distribution. Records live in shared data under a bounded key schema, `kvgate.cal.<slot>`,
//! one slot per model hash (32 slots); a slot held by another model that is still being updated is
//! left alone, and that model keeps the static rule. Each VM caches what it read for a second, so
//! the request path makes at most one host call per model per second for this.

use crate::config::EstimatorConfig;
use crate::estimate::Learned;
use crate::store::{update, Store, StoreError};
use hashbrown::HashMap;
use serde::{Deserialize, Serialize};

const SLOTS: u64 = 32;
const CACHE_MS: u64 = 1_000;
/// A slot whose model has not been updated for this long may be taken by another model.
const SLOT_IDLE_MS: u64 = 10 * 60 * 1_000;
/// Output lengths are kept in log-spaced buckets, four per doubling, up to 2^16 tokens.
const BUCKETS: usize = 64;
const BUCKETS_PER_DOUBLING: f64 = 4.0;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct ModelStats {
    model: String,
    samples: u32,
    prompt_scale: f64,
    /// Exponentially decayed weights of output lengths per bucket.
    output: Vec<f64>,
    updated_ms: u64,
}

fn bucket(tokens: u64) -> usize {
    let b = ((tokens as f64 + 1.0).log2() * BUCKETS_PER_DOUBLING) as usize;
    b.min(BUCKETS - 1)
}

fn bucket_upper(b: usize) -> f64 {
    (2f64).powf((b + 1) as f64 / BUCKETS_PER_DOUBLING) - 1.0
}

impl ModelStats {
    fn new(model: &str) -> Self {
        Self {
            model: model.to_string(),
            samples: 0,
            prompt_scale: 1.0,
            output: vec![0.0; BUCKETS],
            updated_ms: 0,
        }
    }

    fn quantile(&self, q: f64) -> f64 {
        let total: f64 = self.output.iter().sum();
        if total <= 0.0 {
            return 0.0;
        }
        let mut seen = 0.0;
        for (b, w) in self.output.iter().enumerate() {
            seen += w;
            if seen >= q * total {
                return bucket_upper(b);
            }
        }
        bucket_upper(BUCKETS - 1)
    }

    fn learned(&self, cfg: &EstimatorConfig) -> Option<Learned> {
        (self.samples >= cfg.min_samples).then(|| Learned {
            prompt_scale: self.prompt_scale,
            output_quantile: self.quantile(cfg.output_quantile),
        })
    }
}

/// One finished response's ground truth.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// What the static rule said for the prompt's text part (0 when the prompt was token ids).
    pub static_text_tokens: f64,
    /// Tokens kvgate knew exactly or charged by rule (token ids, non-text parts).
    pub fixed_tokens: u64,
    pub prompt_tokens: u64,
    /// Generated tokens; `None` when the request's own limit cut it short, which says nothing
    /// about how long the model wanted to talk.
    pub completion_tokens: Option<u64>,
}

fn slot_key(model: &str) -> String {
    format!(
        "kvgate.cal.{}",
        crate::hash::fnv1a(model.as_bytes()) % SLOTS
    )
}

/// A VM's view of the learned values: reads shared data at most once a second per model.
#[derive(Default)]
pub struct Calibration {
    cache: HashMap<String, (u64, Option<Learned>)>,
    /// Samples gathered since the last flush: written once a tick, not once a response, so
    /// the shared records are not a point of contention on the request path.
    pending: Vec<(String, Sample)>,
}

/// Samples kept between flushes at most; beyond, new ones are dropped (a tick's worth of
/// responses is plenty to learn from).
const MAX_PENDING: usize = 512;

impl Calibration {
    pub fn learned(
        &mut self,
        store: &dyn Store,
        model: &str,
        cfg: &EstimatorConfig,
    ) -> Option<Learned> {
        if !cfg.calibrate {
            return None;
        }
        let now = store.now_ms();
        if let Some((at, learned)) = self.cache.get(model) {
            if now.saturating_sub(*at) < CACHE_MS {
                return *learned;
            }
        }
        let learned = store
            .get(&slot_key(model))
            .ok()
            .and_then(|v| v.value)
            .and_then(|bytes| serde_json::from_slice::<ModelStats>(&bytes).ok())
            .filter(|s| s.model == model)
            .and_then(|s| s.learned(cfg));
        // The cache is bounded like the slots: models beyond them are not worth remembering.
        if self.cache.len() >= SLOTS as usize * 4 {
            self.cache.clear();
        }
        self.cache.insert(model.to_string(), (now, learned));
        learned
    }

    /// Notes one response's ground truth; `flush` writes it.
    pub fn observe(&mut self, model: &str, sample: Sample, cfg: &EstimatorConfig) {
        if cfg.calibrate && self.pending.len() < MAX_PENDING {
            self.pending.push((model.to_string(), sample));
        }
    }

    /// Writes the pending samples into the shared records.
    pub fn flush(&mut self, store: &dyn Store, cfg: &EstimatorConfig) -> Result<(), StoreError> {
        for (model, sample) in std::mem::take(&mut self.pending) {
            Self::record(store, &model, sample, cfg)?;
        }
        Ok(())
    }

    /// Folds one response into the model's shared record.
    pub fn record(
        store: &dyn Store,
        model: &str,
        sample: Sample,
        cfg: &EstimatorConfig,
    ) -> Result<(), StoreError> {
        if !cfg.calibrate {
            return Ok(());
        }
        let now = store.now_ms();
        let w = cfg.calibration_weight;
        update(store, &slot_key(model), |current| {
            let existing = current.and_then(|b| serde_json::from_slice::<ModelStats>(b).ok());
            let mut stats = match existing {
                Some(s) if s.model == model => s,
                Some(s) if now.saturating_sub(s.updated_ms) < SLOT_IDLE_MS => return None,
                _ => ModelStats::new(model),
            };
            let text_truth = sample.prompt_tokens.saturating_sub(sample.fixed_tokens) as f64;
            if sample.static_text_tokens >= 1.0 && text_truth >= 1.0 {
                let ratio = (text_truth / sample.static_text_tokens).clamp(0.1, 10.0);
                // Early samples count fully so the scale converges quickly from the rule's 1.0.
                let weight = w.max(1.0 / (stats.samples as f64 + 1.0));
                stats.prompt_scale += weight * (ratio - stats.prompt_scale);
            }
            if let Some(out) = sample.completion_tokens {
                stats.output.iter_mut().for_each(|x| *x *= 1.0 - w);
                stats.output[bucket(out)] += w;
            }
            stats.samples = stats.samples.saturating_add(1);
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
    use crate::fake_host::FakeHost;

    fn sample(static_tokens: f64, real: u64, out: Option<u64>) -> Sample {
        Sample {
            static_text_tokens: static_tokens,
            fixed_tokens: 0,
            prompt_tokens: real,
            completion_tokens: out,
        }
    }

    #[test]
    fn learns_scale_and_output_quantile_shared_across_vms() {
        let host = FakeHost::new();
        let (a, b) = (host.vm(), host.vm());
        // A small weight over many samples keeps the decayed mix near the true one: every tenth
        // output is 1000 tokens, the rest 100.
        let at = |output_quantile: f64| EstimatorConfig {
            min_samples: 5,
            calibration_weight: 0.01,
            output_quantile,
            ..EstimatorConfig::default()
        };
        for i in 0..1_000 {
            let out = if i % 10 == 0 { 1000 } else { 100 };
            Calibration::record(&a, "m", sample(100.0, 130, Some(out)), &at(0.5)).unwrap();
        }
        let learned = |q: f64| Calibration::default().learned(&b, "m", &at(q)).unwrap();
        assert!((learned(0.5).prompt_scale - 1.3).abs() < 0.01);
        // The configured quantile picks the bucket: below the 1000-token tenth, the upper edge
        // of the 100-token bucket; above it, that of the 1000-token bucket.
        let (short, long) = (bucket_upper(bucket(100)), bucket_upper(bucket(1000)));
        assert!((100.0..110.0).contains(&short) && (1000.0..1200.0).contains(&long));
        assert_eq!(learned(0.5).output_quantile, short);
        assert_eq!(learned(0.85).output_quantile, short);
        assert_eq!(learned(0.95).output_quantile, long);
        assert_eq!(learned(0.99).output_quantile, long);
        assert_eq!(Calibration::default().learned(&b, "other", &at(0.9)), None);
    }

    #[test]
    fn needs_min_samples_and_caches_for_a_second() {
        let host = FakeHost::new();
        let vm = host.vm();
        let cfg = EstimatorConfig {
            min_samples: 3,
            ..EstimatorConfig::default()
        };
        let mut cal = Calibration::default();
        for _ in 0..2 {
            Calibration::record(&vm, "m", sample(10.0, 20, Some(5)), &cfg).unwrap();
        }
        assert_eq!(cal.learned(&vm, "m", &cfg), None);
        Calibration::record(&vm, "m", sample(10.0, 20, Some(5)), &cfg).unwrap();
        assert_eq!(cal.learned(&vm, "m", &cfg), None, "cached");
        host.advance_ms(CACHE_MS);
        assert!(cal.learned(&vm, "m", &cfg).is_some());
    }

    #[test]
    fn busy_slot_is_not_stolen_but_idle_one_is() {
        let host = FakeHost::new();
        let vm = host.vm();
        let cfg = EstimatorConfig {
            min_samples: 1,
            ..EstimatorConfig::default()
        };
        // Find two models that share a slot.
        let a = "model-a".to_string();
        let b = (0..10_000)
            .map(|i| format!("model-{i}"))
            .find(|m| *m != a && slot_key(m) == slot_key(&a))
            .unwrap();
        host.set_now_ms(1);
        Calibration::record(&vm, &a, sample(10.0, 20, Some(5)), &cfg).unwrap();
        Calibration::record(&vm, &b, sample(10.0, 20, Some(5)), &cfg).unwrap();
        assert!(Calibration::default().learned(&vm, &a, &cfg).is_some());
        host.advance_ms(SLOT_IDLE_MS);
        Calibration::record(&vm, &b, sample(10.0, 20, Some(5)), &cfg).unwrap();
        assert!(Calibration::default().learned(&vm, &b, &cfg).is_some());
        assert!(Calibration::default().learned(&vm, &a, &cfg).is_none());
    }

    #[test]
    fn observed_samples_reach_shared_data_at_the_flush() {
        let vm = FakeHost::new().vm();
        let cfg = EstimatorConfig {
            min_samples: 2,
            ..EstimatorConfig::default()
        };
        let mut cal = Calibration::default();
        cal.observe("m", sample(10.0, 20, Some(5)), &cfg);
        cal.observe("m", sample(10.0, 20, Some(5)), &cfg);
        assert_eq!(Calibration::default().learned(&vm, "m", &cfg), None);
        cal.flush(&vm, &cfg).unwrap();
        assert!(Calibration::default().learned(&vm, "m", &cfg).is_some());
        cal.flush(&vm, &cfg).unwrap();
    }

    #[test]
    fn truncated_outputs_do_not_teach_lengths() {
        let vm = FakeHost::new().vm();
        let cfg = EstimatorConfig {
            min_samples: 1,
            ..EstimatorConfig::default()
        };
        Calibration::record(&vm, "m", sample(10.0, 10, None), &cfg).unwrap();
        let learned = Calibration::default().learned(&vm, "m", &cfg).unwrap();
        assert_eq!(learned.output_quantile, 0.0);
    }
}
