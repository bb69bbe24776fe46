//! What the engine's own numbers say about kvgate's accounting of a pod, applied at each scrape
//! (`record::write_snapshot`; the result lives in the pod's snapshot, the source of truth the
//! budget reads). Two corrections, both of the budget (`budget`):
//!
//! - **Unexplained KV**: the engine's used KV (`kv_cache_usage_perc` × capacity) beyond what
//!   kvgate's in-flight entries hold (plus `forecast::slack` each) is traffic kvgate did not
//!   send, or prompts it underestimated. The budget shrinks by that much, for one scrape: the next
//!   one measures again, so the correction follows the cause and never accumulates.
//! - **Preemptions**: a rise of `vllm:num_preemptions_total` means the forecast let the pod run out
//!   of KV. The budget backs off multiplicatively (× `BACKOFF_FACTOR`, down to
//!   `admission.preemptionBackoff` of it taken back) and recovers additively (`RECOVERY` per
//!   clean scrape).
//!   This is AIMD, the rule TCP congestion control uses (Chiu and Jain, 1989): with a signal that
//!   arrives within one scrape and a recovery slow enough that the budget needs many scrapes to
//!   climb back to where the signal fired, the admitted load settles just under the point where
//!   the engine preempts instead of oscillating around it; and it converges from any start, since
//!   every overshoot is cut by a constant fraction.
//!
//! And one correction of the forecast's headroom (`Snapshot::relief`, the fraction of
//! `admission.headroomSigmas` given up): the headroom is sized for the worst plausible spread of
//! the pod's answers, and the engine says how much of it the pod really needed. While kvgate's
//! forecast holds the pod at its budget (admission is what limits it) but the engine's KV stays
//! below the target (`admission.utilization`, at most `RELIEF_CEILING`, less `RELIEF_BAND`) and
//! it never preempts, each scrape gives up `RELIEF_STEP` more of the headroom; KV above the target
//! takes it back twice as fast, and a preemption restores all of it at once (with the budget's
//! backoff on top) and caps the relief a step below what was in force (`Snapshot::relief_lost`,
//! regained slowly), so a pod whose traffic does need the headroom stops being probed. The
//! admitted load so tracks the target utilisation from below: the headroom is given up slowly
//! (three clean, full, under-used scrapes to reach the most it gives up, `MAX_RELIEF`) and
//! regained in one, so an overshoot lasts at most a scrape; and it cannot run away, since most of
//! the headroom is always kept on top of the expected KV.
//!
//! The cap a preemption sets holds for **every pod of the gateway**, not only the one that
//! preempted (shared data, [`LOST_KEY`], next to each pod's own `relief_lost`): the pods of a
//! pool serve the same traffic, and a cap learned pod by pod is learned by preempting once on
//! each. Measured on a pool of 8 pods whose KV is mostly long answers still growing (prompts
//! 50–300 tokens, answers of mean 512 without `max_tokens`): each pod in turn climbed to the
//! most relief and preempted, 45–52 times in 30 s, where without relief the same runs preempted
//! 4–25 times. A gateway serving several models shares one cap: a preemption on one model's pods
//! costs the others some relief for a while, which errs towards the whole headroom.

use crate::admission::budget::budget_tokens;
use crate::config::Config;
use crate::pods::record::{At, PodRecord, Snapshot};
use crate::store::codec::{Reader, Writer};
use crate::store::interface::{create_if_missing, update, Store, StoreError};

/// Each scrape that saw preemptions keeps this fraction of what the budget had left.
const BACKOFF_FACTOR: f64 = 0.9;
/// Each scrape without preemptions gives back this fraction of the budget.
const RECOVERY: f64 = 0.05;
/// Each full, under-used, clean scrape gives up this fraction of the forecast's headroom.
const RELIEF_STEP: f64 = 0.1;
/// At most this fraction of the headroom is given up: the engine's past KV says how wide the
/// spread of a pod's answers has been, not how wide the next one will be, and without any
/// headroom the forecast is an expectation that a few long answers at once overrun (measured:
/// 1–3 preemptions a run on a KV-bound pool, with `max_tokens` on every request too). With the
/// whole KV as the budget (`admission.utilization` 1.0) the headroom is the only margin left:
/// half of it given up (2.5 σ down to 1.25) preempted 2–3 times a run on the `chat` benchmark,
/// 0.3 (down to 1.75 σ) once in four runs, and with no relief at all (2.5 σ) never, at 7 % less
/// throughput.
const MAX_RELIEF: f64 = 0.3;
/// Each clean scrape lets the relief climb this much nearer `MAX_RELIEF` again after a
/// preemption capped it (a minute of clean scrapes to regain a step): the traffic that made
/// the pod preempt may have changed, but probing again at once would repeat the preemption.
const RELIEF_REGAIN: f64 = 0.002;
/// The engine's KV counts as under-used this far below the target utilisation.
const RELIEF_BAND: f64 = 0.05;
/// The relief's target is never above this share of the pod's KV: the engine's KV above it is a
/// near miss, whatever the budget. With `utilization` 1.0 the target would be the capacity
/// itself, which the engine's KV cannot pass, so nothing but a preemption would take relief back.
const RELIEF_CEILING: f64 = 0.95;
/// Relief is given only on pods running at least this many requests. `E + z·σ` covers the tail
/// of a sum of many answers well (it is nearly normal), but the sum of a handful of long-tailed
/// answers has a heavier tail than the normal's, which the full headroom is there for; and one
/// scrape's KV reading of a pod whose every request is a tenth of it says little of its peaks.
/// Measured on pods of 4k tokens running about six requests each: giving up 20–30 % of the
/// headroom preempted 1–4 times in 240 requests, where the whole headroom preempted none.
const MIN_RELIEF_REQUESTS: usize = 8;
/// Admission holds a pod "at its budget" when its forecast is within this fraction of it.
const FULL: f64 = 0.9;

/// The gateway's relief cap: one shared-data value (the cap in force as a little-endian f64,
/// and the milliseconds it was set at as a u64), raised by a pod's preemption and regained with
/// time like each pod's own.
pub const LOST_KEY: &str = "kvgate.relief_lost";

/// `lost` set at `at`, less what `RELIEF_REGAIN` a scrape interval has regained by `now`.
fn regained(lost: f64, at: u64, now: u64, interval_ms: u64) -> f64 {
    let scrapes = now.saturating_sub(at) as f64 / interval_ms.max(1) as f64;
    (lost - RELIEF_REGAIN * scrapes).max(0.0)
}

fn decode_lost(bytes: &[u8], now: u64, interval_ms: u64) -> Option<f64> {
    let mut r = Reader(bytes);
    let (lost, at) = (r.f64()?, r.u64()?);
    lost.is_finite()
        .then(|| regained(lost.clamp(0.0, MAX_RELIEF), at, now, interval_ms))
}

fn encode_lost(lost: f64, at: u64) -> Vec<u8> {
    let mut w = Writer::new();
    w.f64(lost).u64(at);
    w.0
}

/// Creates the gateway's cap, none yet, before traffic can raise it (a compare-and-swap on a
/// missing key is a blind create).
pub fn ensure(store: &dyn Store) -> Result<(), StoreError> {
    create_if_missing(store, LOST_KEY, &encode_lost(0.0, 0))
}

/// The cap the gateway's last preemption still sets on every pod's relief at `now` (0 when
/// none, or unreadable: a missing cap errs towards relief only as far as each pod's own).
pub fn pool_lost(store: &dyn Store, now: u64, interval_ms: u64) -> f64 {
    store
        .get(LOST_KEY)
        .ok()
        .and_then(|v| v.value)
        .and_then(|b| decode_lost(&b, now, interval_ms))
        .unwrap_or(0.0)
}

/// Raises the gateway's cap to `lost` at `now`, unless it is already as high.
pub fn share_lost(
    store: &dyn Store,
    lost: f64,
    now: u64,
    interval_ms: u64,
) -> Result<(), StoreError> {
    update(store, LOST_KEY, |current| {
        let was = current
            .and_then(|b| decode_lost(b, now, interval_ms))
            .unwrap_or(0.0);
        (lost > was).then(|| (encode_lost(lost, now), ()))
    })
    .map(|_| ())
}

/// What kvgate's entries may hold on the pod, as the forecast counts it (`forecast::slack`).
pub fn explained(rec: &PodRecord, block_size: u32) -> u64 {
    let block = u64::from(block_size.max(1));
    let slack = |e: &crate::pods::record::RequestEntry| {
        crate::admission::forecast::slack(block, u64::from(e.choices))
    };
    rec.held_tokens() + rec.entries.iter().map(slack).sum::<u64>()
}

/// Fills `next`'s `backoff`, `unexplained_tokens` and `relief` from the previous snapshot and
/// the record's in-flight entries. `remote_tokens` is what other gateway replicas account for on
/// the pod (`replicas`): explained too, or every replica would subtract the others' requests as
/// well. `pool_lost` is the gateway's relief cap ([`pool_lost`]). Returns whether the pod
/// preempted, so its new cap is the gateway's to share ([`share_lost`]).
pub fn follow(
    prev: Option<&Snapshot>,
    next: &mut Snapshot,
    rec: &PodRecord,
    cfg: &Config,
    remote_tokens: u64,
    pool_lost: f64,
) -> bool {
    let was = prev.map_or(0.0, |p| p.backoff);
    let before = prev.map_or(f64::NAN, |p| p.preemptions);
    // A counter that went backwards is a restarted engine: a new baseline, not a signal.
    let preempted = next.preemptions > before;
    next.backoff = if preempted {
        (1.0 - (1.0 - was) * BACKOFF_FACTOR).min(cfg.admission.preemption_backoff)
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
    let lost = prev.map_or(0.0, |p| p.relief_lost).max(pool_lost);
    next.relief_lost = if preempted {
        // The relief in force let the pod run out: it may climb back only to a step below.
        let tolerated = prev.map_or(0.0, |p| p.relief) - RELIEF_STEP;
        (MAX_RELIEF - tolerated).clamp(lost, MAX_RELIEF)
    } else if next.healthy {
        (lost - RELIEF_REGAIN).max(0.0)
    } else {
        lost
    };
    next.relief = relief(prev, next, rec, cfg, preempted);
    preempted && next.healthy
}

fn relief(
    prev: Option<&Snapshot>,
    next: &Snapshot,
    rec: &PodRecord,
    cfg: &Config,
    preempted: bool,
) -> f64 {
    let was = prev.map_or(0.0, |p| p.relief);
    if preempted || !next.kv_usage.is_finite() {
        // A preemption, or no reading of how full the pod is: the whole headroom.
        return 0.0;
    }
    if !next.healthy {
        return was;
    }
    let target = cfg.admission.utilization.min(RELIEF_CEILING);
    let most = MAX_RELIEF - next.relief_lost;
    if next.kv_usage > target {
        return (was - 2.0 * RELIEF_STEP).max(0.0).min(most);
    }
    // `rec` still carries the previous snapshot, so its forecast has the relief in force.
    let block = u64::from(next.block_size.max(1));
    let full = budget_tokens(cfg, Some(next)).is_some_and(|b| {
        let at = At::of(cfg, next.at_ms);
        rec.forecast(None, cfg.admission.headroom(), block, at) as f64 >= b as f64 * FULL
    });
    let many = rec.entries.len() >= MIN_RELIEF_REQUESTS;
    if full && many && next.kv_usage < target - RELIEF_BAND {
        (was + RELIEF_STEP).min(most).max(0.0)
    } else {
        was.min(most)
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::pods::record::RequestEntry;

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
        follow(prev.as_ref(), &mut next, rec, &Config::default(), 0, 0.0);
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
            worst.backoff, 0.3,
            "never more than `preemptionBackoff` (30 %) is taken back"
        );
        // An operator who lets the engine preempt (cheap preemptions) keeps the whole budget.
        let mut cfg = Config::default();
        cfg.admission.preemption_backoff = 0.0;
        let mut kept = scraped(40.0, 0.0);
        follow(Some(&worst), &mut kept, &rec, &cfg, 0, 0.0);
        assert_eq!(kept.backoff, 0.0, "{}", kept.backoff);
        let restarted = after(Some(scraped(100.0, 0.0)), scraped(0.0, 0.0), &rec);
        assert_eq!(
            restarted.backoff, 0.0,
            "a counter reset is not a preemption"
        );
    }

    #[test]
    fn headroom_is_given_up_slowly_while_a_full_pod_runs_below_target_and_regained_at_once() {
        // Admission holds the pod at its budget (eight requests forecast at about 3,700 of
        // 3,891)...
        let full = PodRecord {
            entries: vec![
                RequestEntry {
                    held_tokens: 440,
                    left: 1,
                    outlook: [255; crate::estimate::output_dist::HORIZON_STEPS.len()],
                    ..RequestEntry::default()
                };
                MIN_RELIEF_REQUESTS
            ],
            ..PodRecord::default()
        };
        // ... while the engine says half its KV is free: each scrape gives up a tenth.
        let mut s = after(None, scraped(0.0, 0.5), &full);
        assert!((s.relief - 0.1).abs() < 1e-9, "{}", s.relief);
        for _ in 0..20 {
            let mut rec = full.clone();
            rec.snapshot = Some(s);
            s = after(Some(s), scraped(0.0, 0.5), &rec);
        }
        assert_eq!(s.relief, MAX_RELIEF, "most of the headroom is always kept");
        let mut rec = full.clone();
        rec.snapshot = Some(s);
        let over = after(Some(s), scraped(0.0, 0.97), &rec);
        assert!(
            (over.relief - (MAX_RELIEF - 2.0 * RELIEF_STEP)).abs() < 1e-9,
            "above the target: back twice as fast"
        );
        let at = after(Some(s), scraped(0.0, 0.93), &rec);
        assert_eq!(at.relief, MAX_RELIEF, "near the target: held");
        let preempted = after(Some(s), scraped(1.0, 0.5), &rec);
        assert_eq!(preempted.relief, 0.0, "a preemption: all of it at once");
        // ... and the relief climbs back only to a step below what let the pod run out.
        let mut back = preempted;
        for _ in 0..20 {
            let mut rec = full.clone();
            rec.snapshot = Some(back);
            back = after(Some(back), scraped(1.0, 0.5), &rec);
        }
        assert!(
            (back.relief - (MAX_RELIEF - RELIEF_STEP + 20.0 * RELIEF_REGAIN)).abs() < 1e-9,
            "a step below, and what 20 clean scrapes regained: {}",
            back.relief
        );
        let blind = after(Some(s), scraped(0.0, f64::NAN), &rec);
        assert_eq!(blind.relief, 0.0, "no reading of the KV: all of it");
        // A pod with room to spare under admission is not a sign the headroom was too much.
        let light = after(None, scraped(0.0, 0.1), &PodRecord::default());
        assert_eq!(light.relief, 0.0);
        // Nor is a full pod running a handful of requests, whose sum's tail is not normal.
        let few = PodRecord {
            entries: full.entries[..MIN_RELIEF_REQUESTS - 1]
                .iter()
                .map(|e| RequestEntry {
                    held_tokens: 520,
                    ..*e
                })
                .collect(),
            ..PodRecord::default()
        };
        assert_eq!(after(None, scraped(0.0, 0.5), &few).relief, 0.0);
    }

    #[test]
    fn kv_the_engine_holds_beyond_kvgates_entries_is_unexplained() {
        let rec = PodRecord {
            entries: vec![RequestEntry {
                held_tokens: 1000,
                ..RequestEntry::default()
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
        follow(None, &mut s, &rec, &Config::default(), 700, 0.0);
        assert_eq!(s.unexplained_tokens, 2048 - 1032 - 700);
    }
}
