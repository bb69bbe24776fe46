//! A pod's KV forecast: what its in-flight requests will hold over the coming decode steps, and
//! the budget check admission makes against it. The inputs are the requests' entries in the pod's
//! shared record (`pod_state`, the source of truth): each holds `held` tokens now (its prompt,
//! less a prefix another request already holds, plus what it has streamed) and its outlook (the
//! chance it is still running `s` steps ahead, from `output_dist`).
//!
//! Every running sequence grows by one token a step and frees everything when it stops, so `s`
//! steps ahead request `i` holds `held_i + s` tokens if it is still running: certainly not past
//! `left_i` (the steps to its own limit), and otherwise with the chance `p_i` its outlook gives for
//! the interval of `output_dist::HORIZON_STEPS` that `s` falls in (taken at the interval's start,
//! which errs towards full). The pod then holds, in expectation and variance,
//!
//! ```text
//! E(s) = Σ_{left_i ≥ s} (held_i + s + block) · p_i      Var(s) = Σ_{left_i ≥ s} (…)² · p_i (1 − p_i)
//! ```
//!
//! (`block`: a sequence's partly filled last block). Both grow with `s` until a request stops, so
//! their highest values lie just before some request's limit or at an interval's end: the forecast
//! is `E + z·σ` (never more than all of them still running would hold) at those points, and a
//! request is admitted when it stays within the budget. A request with `max_tokens` is thus
//! counted exactly up to its limit. The sum of
//! many independent requests is far narrower than each one, so a pod is filled near what its
//! requests really take, and a request with `max_tokens` is certainly gone past its limit. Later
//! arrivals are left out: each is checked against the forecast when it comes.

use crate::estimate::output_dist::{Outlook, HORIZON_END, HORIZON_STEPS};

/// One in-flight request as the forecast sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Load {
    pub held: u64,
    /// Decode steps until its own limit (`max_tokens`, or the output cap) stops it.
    pub left: u64,
    pub outlook: Outlook,
}

/// The highest `E + z·σ` over the horizon, in tokens.
pub fn peak(loads: impl Iterator<Item = Load> + Clone, z: f64, block: u64) -> u64 {
    let mut worst: f64 = 0.0;
    for (j, &start) in HORIZON_STEPS.iter().enumerate() {
        let end = u64::from(HORIZON_STEPS.get(j + 1).copied().unwrap_or(HORIZON_END));
        // Within the interval each request holds more with every step until it stops, so the pod
        // holds most just before one of them stops (at its limit) or at the interval's end.
        let at = |s: u64| {
            let (mut mean, mut var, mut all) = (0.0, 0.0, 0.0);
            for l in loads.clone() {
                let p = f64::from(l.outlook[j]) / 255.0;
                if p <= 0.0 || l.left < s {
                    continue;
                }
                let size = l.held.saturating_add(s).saturating_add(block) as f64;
                mean += size * p;
                var += size * size * p * (1.0 - p);
                all += size;
            }
            // The normal approximation's tail is unbounded; the pod's is not: it can hold at
            // most what every request that may still run would then hold.
            (mean + z * var.sqrt()).min(all)
        };
        worst = worst.max(at(end));
        for l in loads.clone() {
            if (u64::from(start)..end).contains(&l.left) {
                worst = worst.max(at(l.left));
            }
        }
    }
    worst.ceil() as u64
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::estimate::output_dist::OutputDist;

    fn load(held: u64, streamed: u64, max: u64) -> Load {
        Load {
            held,
            left: max.saturating_sub(streamed),
            outlook: OutputDist::prior(256).outlook(streamed, max),
        }
    }

    #[test]
    fn requests_that_must_stop_soon_forecast_little_more_than_they_hold() {
        // Ten requests of 300 prompt tokens with max_tokens 20: gone within 32 steps.
        let loads = vec![load(300, 0, 20); 10];
        let p = peak(loads.iter().copied(), 2.0, 16);
        assert!(p >= 10 * 316, "never below what they hold now: {p}");
        assert!(
            p <= 10 * (316 + 20),
            "never above all of them running to their limit: {p}"
        );
    }

    #[test]
    fn a_request_that_runs_to_its_limit_is_counted_up_to_it() {
        // Two requests known to run 1000 more tokens: between 512 and 1024 steps ahead both
        // still hold 300 + nearly 1000, not 300 + 512.
        let running = |held| Load {
            held,
            left: 1000,
            outlook: OutputDist::never_stops().outlook(0, 1000),
        };
        assert_eq!(
            peak([running(300), running(300)].into_iter(), 2.0, 16),
            2 * 1316
        );
    }

    #[test]
    fn many_requests_need_less_headroom_each_than_one() {
        let one = peak([load(300, 0, u64::MAX)].into_iter(), 2.0, 16);
        let many = peak(vec![load(300, 0, u64::MAX); 16].into_iter(), 2.0, 16);
        assert!(many < 16 * one * 3 / 4, "one {one}, sixteen {many}");
        let bare = peak(vec![load(300, 0, u64::MAX); 16].into_iter(), 0.0, 16);
        assert!(bare < many, "z adds headroom");
    }

    #[test]
    fn an_empty_pod_forecasts_nothing() {
        assert_eq!(peak(std::iter::empty(), 2.0, 16), 0);
        let last = Load {
            held: 500,
            left: 0,
            outlook: [255; HORIZON_STEPS.len()],
        };
        assert_eq!(
            peak([last].into_iter(), 2.0, 16),
            516,
            "a request at its limit holds its KV now, and nothing after"
        );
    }
}
