//! How long a model's answers run by its engines' own count: each pod's finished answers since the
//! engine started (`metrics::AnswerTotals`: vLLM's `request_generation_tokens` histogram, SGLang's
//! generated tokens and requests), pooled over the pods that serve the model. Source of truth:
//! one shared-data value per calibration slot, `kvgate.engine_len.<slot>` (the model's name hash,
//! its pods' tokens and answers), written by the scraper alone (`pods::scrape`, the lease
//! holder), which keeps each pod's last totals in memory ([`EngineLengths`]); `calibration`
//! reads it with the model's own slot, a second at a time.
//!
//! What it is for: the output prior. Until kvgate has learned a model's lengths from its own
//! answers, a request without `max_tokens` is taken to run `estimator.defaultOutputTokens` on
//! average, and the first wave of requests is admitted on that alone, all at once. A gateway
//! started (or restarted, or a replica added) in front of engines that have served the model for
//! hours knew nothing they did: on a pool whose answers run 512 tokens on average it took a first
//! wave sized for 256 and preempted about 23 times in its first 8 s (BENCHMARKS.md, *The first
//! answers' lengths*). The engines' mean raises the prior to what they have seen, before the
//! first request.
//!
//! It only ever raises it (the prior is the larger of the two). The engines count every answer
//! they finished, those cut short by a client's `max_tokens` at their limit: a mean that says
//! the model runs long is right at least that far, one that says it runs short may only say
//! that the clients' limits were short, and a prior too short is what preempts.

use crate::estimate::calibration::SLOTS;
use crate::pods::metrics::AnswerTotals;
use crate::store::codec::{Reader, Writer};
use crate::store::interface::{update, Store, StoreError};
use hashbrown::HashMap;

const KEY_PREFIX: &str = "kvgate.engine_len.";
/// A pod not scraped for this long no longer counts in its model's pool: it left, or the scrape
/// fails; its totals stay in the last value written until another pod of its model is scraped.
const STALE_MS: u64 = 60_000;

fn key(model_hash: u64) -> String {
    format!("{KEY_PREFIX}{}", model_hash % SLOTS)
}

/// The scraper's view: each pod's last totals, and what it last wrote per model.
#[derive(Default)]
pub struct EngineLengths {
    pods: HashMap<String, (AnswerTotals, u64)>,
    written: HashMap<u64, (f64, f64)>,
}

impl EngineLengths {
    /// `pod`'s engines have finished `totals` by `now`: its model's pool, written when it moved.
    pub fn note(
        &mut self,
        store: &dyn Store,
        pod: &str,
        totals: AnswerTotals,
        now: u64,
    ) -> Result<(), StoreError> {
        self.pods.insert(pod.to_string(), (totals, now));
        let (tokens, answers) = self
            .pods
            .values()
            .filter(|(t, at)| t.model == totals.model && now.saturating_sub(*at) <= STALE_MS)
            .fold((0.0, 0.0), |(tokens, answers), (t, _)| {
                (tokens + t.tokens, answers + t.count)
            });
        if self.written.get(&totals.model) == Some(&(tokens, answers)) {
            return Ok(());
        }
        // The model's name hash, its pods' tokens and answers.
        let mut value = Writer::new();
        value.u64(totals.model).f64(tokens).f64(answers);
        update(store, &key(totals.model), |_| Some((value.0.clone(), ())))?;
        self.written.insert(totals.model, (tokens, answers));
        Ok(())
    }

    /// Forgets pods not scraped for `STALE_MS`.
    pub fn expire(&mut self, now: u64) {
        self.pods
            .retain(|_, (_, at)| now.saturating_sub(*at) <= STALE_MS);
    }
}

/// The mean length of `model`'s answers by its engines' count, once they have finished at least
/// `min_answers`; `None` when unknown (no engine reports it, another model holds the slot).
pub fn mean(store: &dyn Store, model: &str, min_answers: f64) -> Option<f64> {
    let hash = crate::hash::fnv1a(model.as_bytes());
    let bytes = store.get(&key(hash)).ok()?.value?;
    let mut r = Reader(&bytes);
    if r.u64()? != hash {
        return None;
    }
    let (tokens, answers) = (r.f64()?, r.f64()?);
    (answers >= min_answers.max(1.0) && tokens.is_finite() && tokens >= 0.0)
        .then(|| tokens / answers)
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::store::fake_host::FakeHost;

    fn totals(model: &str, tokens: f64, count: f64) -> AnswerTotals {
        AnswerTotals {
            model: crate::hash::fnv1a(model.as_bytes()),
            tokens,
            count,
        }
    }

    #[test]
    fn a_models_mean_is_pooled_over_its_pods_and_kept_apart_from_other_models() {
        let host = FakeHost::new();
        let vm = host.vm();
        let mut lengths = EngineLengths::default();
        assert_eq!(mean(&vm, "m", 20.0), None);
        lengths
            .note(&vm, "a:1", totals("m", 5_000.0, 10.0), host.now_ms())
            .unwrap();
        // Fewer answers than asked for: not yet a mean to go by.
        assert_eq!(mean(&vm, "m", 20.0), None);
        lengths
            .note(&vm, "b:1", totals("m", 25_000.0, 30.0), host.now_ms())
            .unwrap();
        assert_eq!(mean(&vm, "m", 20.0), Some(750.0));
        // A pod's later totals replace its earlier ones, not add to them.
        lengths
            .note(&vm, "a:1", totals("m", 15_000.0, 20.0), host.now_ms())
            .unwrap();
        assert_eq!(mean(&vm, "m", 20.0), Some(800.0));
        // Another model's pods: its own mean, and none for a model nobody reports.
        lengths
            .note(&vm, "c:1", totals("n", 1_000.0, 40.0), host.now_ms())
            .unwrap();
        assert_eq!(mean(&vm, "n", 20.0), Some(25.0));
        assert_eq!(mean(&vm, "m", 20.0), Some(800.0));
        assert_eq!(mean(&vm, "other", 20.0), None);
    }

    #[test]
    fn a_pod_gone_quiet_leaves_its_models_pool() {
        let host = FakeHost::new();
        let vm = host.vm();
        let mut lengths = EngineLengths::default();
        lengths
            .note(&vm, "a:1", totals("m", 90_000.0, 100.0), host.now_ms())
            .unwrap();
        host.advance_ms(STALE_MS + 1);
        lengths.expire(host.now_ms());
        lengths
            .note(&vm, "b:1", totals("m", 3_000.0, 30.0), host.now_ms())
            .unwrap();
        assert_eq!(mean(&vm, "m", 20.0), Some(100.0));
    }

    #[test]
    fn a_value_another_model_wrote_or_garbage_is_no_mean() {
        let host = FakeHost::new();
        let vm = host.vm();
        let hash = crate::hash::fnv1a(b"m");
        // Another model whose name falls in the same slot.
        let mut other = (hash + SLOTS).to_le_bytes().to_vec();
        other.extend_from_slice(&1_000.0f64.to_le_bytes());
        other.extend_from_slice(&100.0f64.to_le_bytes());
        vm.set(&key(hash), &other, None).unwrap();
        assert_eq!(mean(&vm, "m", 1.0), None);
        for bytes in [&b"short"[..], &[0u8; 0][..]] {
            vm.set(&key(hash), bytes, None).unwrap();
            assert_eq!(mean(&vm, "m", 1.0), None);
        }
        let mut negative = hash.to_le_bytes().to_vec();
        negative.extend_from_slice(&(-5.0f64).to_le_bytes());
        negative.extend_from_slice(&100.0f64.to_le_bytes());
        vm.set(&key(hash), &negative, None).unwrap();
        assert_eq!(mean(&vm, "m", 1.0), None);
    }
}
