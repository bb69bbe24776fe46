//! How long an answer that does not stream takes on each pod before its tokens begin, as this VM
//! has measured from such answers ending: what `Router::grow_unseen` takes off an answer's age
//! before counting its tokens at the pod's pace.
//!
//! An answer that does not stream shows kvgate no token until it ends, so its entry grows by the
//! tokens the pod's pace says it has made since it was sent (`pods::pace`). Its age also holds
//! what came before its first token: the way to the engine, its wait in the engine's queue, its
//! prefill. Counted as decode steps, that time ran each such answer ahead of the engine by a
//! constant, measured end to end on two pods at 36 requests a second (answers of 250 and 1,000
//! tokens, 806 answers, 2026-12-07): at its end an answer had made, by the pace, 11 tokens more
//! than it had (the median; 5 at the tenth percentile, 18 at the ninetieth, 34 at most), the same
//! for both lengths. Its entry thus reached its limit while the engine was still decoding it, and
//! the forecast counted its KV free up to 34 steps early: room the line filled, and pods held at
//! their budget preempted in about one run in ten.
//!
//! The lead is learned from each unseen answer as it ends: its age then, less its tokens at the
//! pace, is the time before they began. The lead taken off is the samples' smoothed mean plus
//! twice their smoothed deviation, so that an answer is counted behind the engine rather than
//! ahead: behind, its entry holds a few tokens less than the engine does (the scrape's
//! unexplained KV takes those off the budget) and its end is counted a little late; ahead, its
//! end came early, which nothing corrects.
//!
//! Source of truth: this VM alone. Each VM grows the entries of the answers it carries, and learns
//! from the same answers; a pod this VM has seen no unseen answer end on has no lead (0, the age
//! counted whole, as before). A pod that left the pool is forgotten.

use crate::routing::pod_id::{PodId, PodMap};

/// Weight of one answer's lead in a pod's smoothed mean and deviation: about the last eight
/// answers, which follows a pod whose queue fills within seconds.
const WEIGHT: f64 = 0.125;
/// Deviations the lead taken off keeps beyond the mean.
const DEVIATIONS: f64 = 2.0;

#[derive(Debug, Clone, Copy)]
struct Lead {
    mean_s: f64,
    dev_s: f64,
}

#[derive(Debug, Default)]
pub struct Leads {
    pods: PodMap<Lead>,
}

impl Leads {
    /// An unseen answer on `pod` ended `age_s` after it was sent, having made `tokens` tokens an
    /// answer at the pod's pace of `itl_s` a token.
    pub fn ended(&mut self, pod: PodId, age_s: f64, tokens: u64, itl_s: f64) {
        if !(itl_s.is_finite() && itl_s > 0.0 && age_s.is_finite() && age_s >= 0.0) {
            return;
        }
        let sample = (age_s - tokens as f64 * itl_s).clamp(0.0, age_s);
        match self.pods.get_mut(&pod) {
            Some(l) => {
                let off = sample - l.mean_s;
                l.mean_s += WEIGHT * off;
                l.dev_s += WEIGHT * (off.abs() - l.dev_s);
            }
            None => {
                self.pods.insert(
                    pod,
                    Lead {
                        mean_s: sample,
                        dev_s: 0.0,
                    },
                );
            }
        }
    }

    /// What to take off an unseen answer's age on `pod` before counting its tokens, in seconds.
    pub fn lead_s(&self, pod: PodId) -> f64 {
        self.pods
            .get(&pod)
            .map_or(0.0, |l| l.mean_s + DEVIATIONS * l.dev_s)
    }

    pub fn retain_pods(&mut self, keep: impl Fn(PodId) -> bool) {
        self.pods.retain(|pod, _| keep(*pod));
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    #[test]
    fn a_pod_never_measured_has_no_lead() {
        let mut l = Leads::default();
        assert_eq!(l.lead_s(PodId::of("a")), 0.0);
        // A pace unknown says nothing.
        l.ended(PodId::of("a"), 1.0, 100, 0.0);
        assert_eq!(l.lead_s(PodId::of("a")), 0.0);
    }

    /// Answers that began 10 ms after they were sent, then made a token each millisecond: the
    /// lead is those 10 ms, and each pod keeps its own.
    #[test]
    fn the_lead_is_the_age_less_the_tokens_at_the_pace() {
        let mut l = Leads::default();
        for tokens in [100, 250, 1000, 40] {
            l.ended(PodId::of("a"), 0.010 + tokens as f64 * 0.001, tokens, 0.001);
        }
        assert!((l.lead_s(PodId::of("a")) - 0.010).abs() < 1e-9);
        assert_eq!(l.lead_s(PodId::of("b")), 0.0);
        l.retain_pods(|p| p == PodId::of("b"));
        assert_eq!(l.lead_s(PodId::of("a")), 0.0, "forgotten with its pod");
    }

    /// Leads that vary are taken long: past their mean by twice their spread, so most answers
    /// are counted behind the engine, not ahead of it.
    #[test]
    fn a_spread_lead_is_taken_long() {
        let mut l = Leads::default();
        let leads: Vec<f64> = (0..200).map(|i| 0.005 + 0.010 * f64::from(i % 2)).collect();
        for lead in &leads {
            l.ended(PodId::of("a"), lead + 0.5, 500, 0.001);
        }
        let taken = l.lead_s(PodId::of("a"));
        assert!(taken > 0.015 && taken < 0.025, "{taken}");
        // An answer faster than the pace (its lead would be negative) counts as none.
        let mut fast = Leads::default();
        fast.ended(PodId::of("a"), 0.3, 500, 0.001);
        assert_eq!(fast.lead_s(PodId::of("a")), 0.0);
    }
}
