//! What the engine's own numbers say about kvgate's accounting of a pod, applied at each scrape
//! (`record::write_snapshot`; the result lives in the pod's snapshot, the source of truth the
//! budget reads). Two corrections, both of the budget (`budget`):
//!
//! - **Unexplained KV**: the engine's used KV (`kv_cache_usage_perc` × capacity) beyond what
//!   kvgate's in-flight entries hold (plus `forecast::slack` each) is traffic kvgate did not
//!   send, or prompts it underestimated. The budget shrinks by that much, for one scrape: the next
//!   one measures again, so the correction follows the cause and never accumulates.
//! - **Preemptions**: a rise of `vllm:num_preemptions_total` means the forecast let the pod run out
//!   of KV. The budget backs off multiplicatively (× [`BACKOFF_FACTOR`], down to
//!   [`MAX_BACKOFF`] of it taken back) and recovers additively ([`RECOVERY`] per clean scrape).
//!   This is AIMD, the rule TCP congestion control uses (Chiu and Jain, 1989): with a signal that
//!   arrives within one scrape and a recovery slow enough that the budget needs many scrapes to
//!   climb back to where the signal fired, the admitted load settles just under the point where
//!   the engine preempts instead of oscillating around it; and it converges from any start, since
//!   every overshoot is cut by a constant fraction.

use crate::pods::record::{PodRecord, Snapshot};

/// Each scrape that saw preemptions keeps this fraction of what the budget had left.
const BACKOFF_FACTOR: f64 = 0.9;
/// At most this fraction of the budget is taken back.
const MAX_BACKOFF: f64 = 0.3;
/// Each scrape without preemptions gives back this fraction of the budget.
const RECOVERY: f64 = 0.05;

/// What kvgate's entries may hold on the pod, as the forecast counts it (`forecast::slack`).
pub fn explained(rec: &PodRecord, block_size: u32) -> u64 {
    let block = u64::from(block_size.max(1));
    rec.held_tokens() + crate::admission::forecast::slack(block) * rec.entries.len() as u64
}

/// Fills `next`'s `backoff` and `unexplained_tokens` from the previous snapshot and the record's
/// in-flight entries. `remote_tokens` is what other gateway replicas account for on the pod
/// (`replicas`): explained too, or every replica would subtract the others' requests as well.
pub fn follow(prev: Option<&Snapshot>, next: &mut Snapshot, rec: &PodRecord, remote_tokens: u64) {
    let was = prev.map_or(0.0, |p| p.backoff);
    let before = prev.map_or(f64::NAN, |p| p.preemptions);
    // A counter that went backwards is a restarted engine: a new baseline, not a signal.
    let preempted = next.preemptions > before;
    next.backoff = if preempted {
        (1.0 - (1.0 - was) * BACKOFF_FACTOR).min(MAX_BACKOFF)
    } else {
        (was - RECOVERY).max(0.0)
    };
    if !next.healthy {
        // A pod marked down says nothing of its counter: keep the last one.
        next.preemptions = before;
        next.backoff = was;
    }
    let used = if next.kv_usage.is_finite() {
        next.kv_usage.clamp(0.0, 1.0) * next.capacity_tokens as f64
    } else {
        0.0
    };
    let explained = explained(rec, next.block_size).saturating_add(remote_tokens);
    next.unexplained_tokens = (used as u64).saturating_sub(explained);
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::pods::record::Entry;

    fn scraped(preemptions: f64, kv_usage: f64) -> Snapshot {
        Snapshot {
            healthy: true,
            preemptions,
            kv_usage,
            capacity_tokens: 4096,
            block_size: 16,
            ..Snapshot::default()
        }
    }

    fn after(prev: Option<Snapshot>, mut next: Snapshot, rec: &PodRecord) -> Snapshot {
        follow(prev.as_ref(), &mut next, rec, 0);
        next
    }

    #[test]
    fn preemptions_back_the_budget_off_at_once_and_clean_scrapes_give_it_back_slowly() {
        let rec = PodRecord::default();
        let first = after(None, scraped(0.0, 0.0), &rec);
        assert_eq!(first.backoff, 0.0, "a first reading is a baseline");
        let hit = after(Some(first), scraped(3.0, 0.0), &rec);
        assert!((hit.backoff - 0.1).abs() < 1e-9);
        let again = after(Some(hit), scraped(5.0, 0.0), &rec);
        assert!((again.backoff - 0.19).abs() < 1e-9, "{}", again.backoff);
        let mut s = again;
        for _ in 0..2 {
            s = after(Some(s), scraped(5.0, 0.0), &rec);
        }
        assert!((s.backoff - 0.09).abs() < 1e-9, "{}", s.backoff);
        let mut worst = s;
        for i in 0..20 {
            worst = after(Some(worst), scraped(10.0 + f64::from(i), 0.0), &rec);
        }
        assert_eq!(
            worst.backoff, MAX_BACKOFF,
            "never more than 30 % is taken back"
        );
        let restarted = after(Some(scraped(100.0, 0.0)), scraped(0.0, 0.0), &rec);
        assert_eq!(
            restarted.backoff, 0.0,
            "a counter reset is not a preemption"
        );
    }

    #[test]
    fn kv_the_engine_holds_beyond_kvgates_entries_is_unexplained() {
        let rec = PodRecord {
            entries: vec![Entry {
                held_tokens: 1000,
                ..Entry::default()
            }],
            ..PodRecord::default()
        };
        // 50 % of 4096 tokens used; kvgate accounts for 1000 and two blocks of 16 (a partly
        // filled one, and one streamed since the entry was written).
        let s = after(None, scraped(0.0, 0.5), &rec);
        assert_eq!(s.unexplained_tokens, 2048 - 1032);
        let s = after(None, scraped(0.0, 0.1), &rec);
        assert_eq!(
            s.unexplained_tokens, 0,
            "kvgate's requests not yet scheduled: no excess"
        );
        let s = after(None, scraped(0.0, f64::NAN), &rec);
        assert_eq!(
            s.unexplained_tokens, 0,
            "no usage reported, nothing to compare"
        );
        // Another replica's 700 tokens on the pod are accounted for, not subtracted twice.
        let mut s = scraped(0.0, 0.5);
        follow(None, &mut s, &rec, 700);
        assert_eq!(s.unexplained_tokens, 2048 - 1032 - 700);
    }
}
