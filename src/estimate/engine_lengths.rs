//! How long a model's answers run by its engines' own count: each pod's finished answers since the
//! engine started (`metrics::AnswerTotals`: vLLM's `request_generation_tokens` histogram, SGLang's
//! generated tokens and requests), pooled over the pods that serve the model. Source of truth:
//! one shared-data value per model, `kvgate.engine_len.<slot>` (the model's name hash, its pods'
//! tokens and answers, when written; the slot found by the name's hash, `slots`), written by the
//! scraper alone (`pods::scrape`, the lease holder), which keeps each pod's last totals in memory
//! ([`EngineLengths`]); `calibration` reads it with the model's own record, a second at a time.
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

use crate::estimate::slots::{self, Held};
use crate::pods::metrics::AnswerTotals;
use crate::store::codec::{Reader, Writer};
use crate::store::interface::{update_from, Store, StoreError};
use hashbrown::HashMap;

const KEY_PREFIX: &str = "kvgate.engine_len.";
/// A pod not scraped for this long no longer counts in its model's pool: it left, or the scrape
/// fails; its totals stay in the last value written until another pod of its model is scraped.
const STALE_MS: u64 = 60_000;

/// A model's value: its name's hash, its pods' pooled tokens and answers, and when that was
/// written (a value unchanged for `slots::IDLE_MS`, its engines finishing nothing, may give its
/// slot to another model).
struct Pooled {
    model: u64,
    tokens: f64,
    answers: f64,
    written_ms: u64,
}

impl Pooled {
    fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.u64(self.model)
            .f64(self.tokens)
            .f64(self.answers)
            .u64(self.written_ms);
        w.0
    }

    fn decode(bytes: &[u8]) -> Option<Pooled> {
        let mut r = Reader(bytes);
        Some(Pooled {
            model: r.u64()?,
            tokens: r.f64()?,
            answers: r.f64()?,
            written_ms: r.u64()?,
        })
    }
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
        let model = totals.model;
        let held = |bytes: &[u8]| {
            Held::of(
                Pooled::decode(bytes).map(|p| (p.model == model, p.written_ms)),
                now,
            )
        };
        let Some((key, seen)) = slots::place(store, KEY_PREFIX, model, held)? else {
            return Ok(());
        };
        let value = Pooled {
            model,
            tokens,
            answers,
            written_ms: now,
        }
        .encode();
        // Checked again on the value written over: the slot may have been given since.
        let wrote = update_from(store, &key, Some(seen), |current| {
            current
                .is_none_or(|b| held(b) != Held::Other)
                .then(|| (value.clone(), ()))
        })?;
        if wrote.is_some() {
            self.written.insert(model, (tokens, answers));
        }
        Ok(())
    }

    /// Forgets pods not scraped for `STALE_MS`.
    pub fn expire(&mut self, now: u64) {
        self.pods
            .retain(|_, (_, at)| now.saturating_sub(*at) <= STALE_MS);
    }
}

/// The mean length of `model`'s answers by its engines' count, once they have finished at least
/// `min_answers`; `None` when unknown (no engine reports it, or every slot in its reach is
/// another model's).
pub fn mean(store: &dyn Store, model: &str, min_answers: f64) -> Option<f64> {
    let hash = crate::hash::fnv1a(model.as_bytes());
    let p = slots::find(store, KEY_PREFIX, hash, |bytes| {
        Pooled::decode(bytes).filter(|p| p.model == hash)
    })?;
    (p.answers >= min_answers.max(1.0) && p.tokens.is_finite() && p.tokens >= 0.0)
        .then(|| p.tokens / p.answers)
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

    /// A name other than `model` whose hash falls in the same slot.
    fn sharing_a_slot_with(model: &str) -> String {
        let slot = |m: &str| crate::hash::fnv1a(m.as_bytes()) % slots::SLOTS;
        (0..)
            .map(|i| format!("other-{i}"))
            .find(|m| slot(m) == slot(model))
            .unwrap_or_default()
    }

    #[test]
    fn models_whose_names_share_a_slot_each_keep_their_own_mean() {
        let host = FakeHost::new();
        let vm = host.vm();
        let other = sharing_a_slot_with("m");
        let mut lengths = EngineLengths::default();
        // Each scrape of either model's pods used to overwrite the other's in the one slot.
        for round in 1..=3 {
            let n = f64::from(round) * 10.0;
            lengths
                .note(&vm, "a:1", totals("m", 100.0 * n, n), host.now_ms())
                .unwrap();
            lengths
                .note(&vm, "b:1", totals(&other, 900.0 * n, n), host.now_ms())
                .unwrap();
            assert_eq!(mean(&vm, "m", 10.0), Some(100.0));
            assert_eq!(mean(&vm, &other, 10.0), Some(900.0));
        }
    }

    #[test]
    fn a_slot_whose_model_finished_nothing_for_long_is_given_to_another() {
        let host = FakeHost::new();
        let vm = host.vm();
        let mut lengths = EngineLengths::default();
        let fillers: Vec<String> = (0..)
            .map(|i| format!("filler-{i}"))
            .filter(|m| sharing_a_slot_with(m) == sharing_a_slot_with("m"))
            .take(8)
            .collect();
        for (i, model) in fillers.iter().enumerate() {
            lengths
                .note(
                    &vm,
                    &format!("f{i}:1"),
                    totals(model, 500.0, 50.0),
                    host.now_ms(),
                )
                .unwrap();
        }
        // Every slot in reach is held by a model whose engines answer.
        lengths
            .note(&vm, "a:1", totals("m", 2_000.0, 20.0), host.now_ms())
            .unwrap();
        assert_eq!(mean(&vm, "m", 10.0), None);
        // Long after, one of them has finished nothing more, and its slot is taken.
        host.advance_ms(slots::IDLE_MS);
        lengths
            .note(&vm, "a:1", totals("m", 3_000.0, 30.0), host.now_ms())
            .unwrap();
        assert_eq!(mean(&vm, "m", 10.0), Some(100.0));
    }

    #[test]
    fn a_value_another_model_wrote_or_garbage_is_no_mean() {
        let host = FakeHost::new();
        let vm = host.vm();
        let hash = crate::hash::fnv1a(b"m");
        let key = format!("{KEY_PREFIX}{}", hash % slots::SLOTS);
        let value = |model: u64, tokens: f64| {
            Pooled {
                model,
                tokens,
                answers: 100.0,
                written_ms: 0,
            }
            .encode()
        };
        // Another model's, whose name falls in the same slot.
        vm.set(&key, &value(hash + slots::SLOTS, 1_000.0), None)
            .unwrap();
        assert_eq!(mean(&vm, "m", 1.0), None);
        // Written before it said when (three fields), cut short, empty.
        let old = &value(hash, 1_000.0)[..24];
        for bytes in [old, &b"short"[..], &[0u8; 0][..]] {
            vm.set(&key, bytes, None).unwrap();
            assert_eq!(mean(&vm, "m", 1.0), None);
        }
        vm.set(&key, &value(hash, -5.0), None).unwrap();
        assert_eq!(mean(&vm, "m", 1.0), None);
        vm.set(&key, &value(hash, 1_000.0), None).unwrap();
        assert_eq!(mean(&vm, "m", 1.0), Some(10.0));
    }
}
