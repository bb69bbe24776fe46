//! How many requests a pod's engine runs at once, learned from its scrapes (`follow`), and
//! whether a request may be sent there (`room`). vLLM's `--max-num-seqs` (256 by default, 1,024 on
//! the largest GPUs) and SGLang's `--max-running-requests` bind before the KV does whenever the
//! requests are small for the card (an 8B model's short chats on an 80 GB GPU): the engine then
//! queues the rest in its own first-come line, with KV to spare, so kvgate's budget never fills,
//! its line never forms, and a critical request waits there behind every batch request sent
//! before it. Held to the engine's seats, the overload waits in kvgate's line instead, where
//! priority bands, tenant fairness and the bounded wait apply.
//!
//! An operator who knows the limit states it (`admission.engineSeats`), and every pod is held to
//! it from its first request, scraped or not. Otherwise, since neither engine exports its limit
//! in its metrics, it is learned from what the limit does:
//! requests waiting in the engine while its KV has room, at consecutive scrapes at least
//! [`EVIDENCE_MS`] apart, and the most it was ever seen running since it (re)started is the
//! limit. A single scrape is not evidence: requests that have just arrived, or a burst of long
//! prompts the engine's per-step token budget takes in over a few steps, wait for a moment
//! too. A limit learned too low is unlearned as soon as the engine runs more than it: a pod is
//! held to its seats and [`ENGINE_QUEUE`] more, so an engine that can run more shows it at the
//! next scrape. Source of truth: the configuration, else the pod's snapshot (`Snapshot::seats`,
//! `most_running`, `queued_since_ms`), written with each scrape (`record::write_snapshot`).

use crate::admission::forecast::Load;
use crate::config::Config;
use crate::pods::record::{PodRecord, Snapshot};

/// How long requests must have waited in the engine with KV to spare, over consecutive scrapes,
/// before the most it ran is taken as its limit: with the default scrape interval (1 s), two
/// scrapes in a row.
const EVIDENCE_MS: u64 = 1_000;

/// KV use (a fraction of the capacity) below which requests waiting in the engine are not
/// waiting for KV: vLLM schedules a waiting request when its blocks are free, so with a tenth
/// of the KV free a queue is the engine's seats (or its step's token budget) at work.
const KV_SPARE: f64 = 0.9;

/// Requests a pod is sent beyond its seats, waiting in the engine's own queue: one ready for the
/// seat the next finished answer frees, which kvgate releases only as the answer's last chunk
/// comes through Envoy, a step or so later. And what unlearns a limit learned too low: held to
/// exactly its seats, an engine could never show it runs more.
const ENGINE_QUEUE: u64 = 1;

/// Fills `next`'s seats from the previous snapshot and this scrape's running and waiting counts
/// (`next.waiting` already less kvgate's own requests not yet scheduled). Called after
/// `index_check::follow`, whose restart count says when the engine started again.
pub fn follow(prev: Option<&Snapshot>, next: &mut Snapshot) {
    let running = if next.running.is_finite() {
        next.running.round().clamp(0.0, f64::from(u32::MAX)) as u32
    } else {
        0
    };
    let restarted = prev.is_some_and(|p| p.engine_restarts != next.engine_restarts);
    let (seats, most, since) = match prev {
        Some(p) if !restarted => (p.seats, p.most_running, p.queued_since_ms),
        _ => (0, 0, 0),
    };
    if !next.healthy {
        // A pod marked down says nothing of its engine: keep what was learned.
        (next.seats, next.most_running, next.queued_since_ms) = (seats, most, since);
        return;
    }
    next.most_running = most.max(running);
    let queued =
        running > 0 && next.waiting >= 1.0 && next.kv_usage.is_finite() && next.kv_usage < KV_SPARE;
    next.queued_since_ms = match (queued, since) {
        (false, _) => 0,
        (true, 0) => next.at_ms.max(1),
        (true, since) => since,
    };
    next.seats = if seats > 0 && running > seats {
        // It runs more than it was held to: the limit was a burst's, not the engine's.
        0
    } else if queued && since > 0 && next.at_ms.saturating_sub(since) >= EVIDENCE_MS {
        next.most_running
    } else {
        seats
    };
}

/// The seats a pod is held to: those configured, else those learned from its scrapes (0: none,
/// and not held).
pub fn in_force(cfg: &Config, snapshot: Option<&Snapshot>) -> u32 {
    match cfg.admission.engine_seats {
        0 => snapshot.map_or(0, |s| s.seats),
        stated => stated,
    }
}

/// Whether `request` may be sent to the pod of `rec` as far as its engine's seats go: the
/// sequences kvgate has running there (each answer of a request with `n` is one) with it added
/// stay within its seats and [`ENGINE_QUEUE`], or the pod has nothing of kvgate's in flight.
/// `share`: the part of the pod's seats this gateway replica may fill (1 alone; with several,
/// its grant of the budget over the budget, as the tokens are split).
pub fn room(rec: &PodRecord, request: &Load, share: f64, cfg: &Config) -> bool {
    let seats = in_force(cfg, rec.snapshot.as_ref());
    if seats == 0 || rec.entries.is_empty() {
        return true;
    }
    let mine = (f64::from(seats) * share.clamp(0.0, 1.0)).ceil() as u64;
    running(rec) + request.rate.max(1) <= mine + ENGINE_QUEUE
}

/// The sequences kvgate has in flight on the pod: each answer of a request with `n` is one.
fn running(rec: &PodRecord) -> u64 {
    rec.entries
        .iter()
        .map(|e| u64::from(e.choices.max(1)))
        .sum()
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::pods::record::RequestEntry;

    fn scrape(at_ms: u64, running: f64, waiting: f64, kv_usage: f64) -> Snapshot {
        Snapshot {
            at_ms,
            healthy: true,
            running,
            waiting,
            kv_usage,
            ..Snapshot::default()
        }
    }

    /// The scrapes in order, each followed from the one before; the last.
    fn learn(scrapes: &[Snapshot]) -> Snapshot {
        let mut prev: Option<Snapshot> = None;
        for s in scrapes {
            let mut next = *s;
            follow(prev.as_ref(), &mut next);
            prev = Some(next);
        }
        prev.unwrap_or_default()
    }

    #[test]
    fn a_queue_with_kv_to_spare_over_two_scrapes_is_the_engines_seats() {
        let s = learn(&[
            scrape(1_000, 5.0, 0.0, 0.2),
            scrape(2_000, 8.0, 12.0, 0.3),
            scrape(3_000, 7.0, 14.0, 0.3),
        ]);
        assert_eq!(s.seats, 8, "the most it ran");
        // One scrape of a queue is not evidence: requests just arrived, or long prompts the
        // step's token budget takes in over a few steps.
        let once = learn(&[scrape(1_000, 8.0, 12.0, 0.3), scrape(2_000, 9.0, 0.0, 0.3)]);
        assert_eq!(once.seats, 0);
        // Nor scrapes too close together.
        let close = learn(&[scrape(1_000, 8.0, 12.0, 0.3), scrape(1_400, 8.0, 12.0, 0.3)]);
        assert_eq!(close.seats, 0);
        // A queue with the KV full is waiting for KV, which the budget already holds.
        let full = learn(&[
            scrape(1_000, 8.0, 12.0, 0.95),
            scrape(2_000, 8.0, 12.0, 0.97),
        ]);
        assert_eq!(full.seats, 0);
        // An engine that does not say how full its KV is cannot tell the two apart.
        let unknown = learn(&[
            scrape(1_000, 8.0, 12.0, f64::NAN),
            scrape(2_000, 8.0, 12.0, f64::NAN),
        ]);
        assert_eq!(unknown.seats, 0);
    }

    #[test]
    fn seats_are_kept_until_the_engine_runs_more_or_starts_again() {
        let learned = learn(&[scrape(1_000, 8.0, 3.0, 0.3), scrape(2_000, 8.0, 2.0, 0.3)]);
        assert_eq!(learned.seats, 8);
        // Held there, the engine's queue empties: the seats stay.
        let mut calm = scrape(3_000, 8.0, 0.0, 0.3);
        follow(Some(&learned), &mut calm);
        assert_eq!((calm.seats, calm.queued_since_ms), (8, 0));
        // Down: nothing said of the engine.
        let mut down = Snapshot {
            healthy: false,
            ..scrape(4_000, 0.0, 0.0, f64::NAN)
        };
        follow(Some(&calm), &mut down);
        assert_eq!(down.seats, 8);
        // Running more than it was held to: the limit was a moment's, unlearned.
        let mut more = scrape(5_000, 9.0, 0.0, 0.3);
        follow(Some(&down), &mut more);
        assert_eq!((more.seats, more.most_running), (0, 9));
        // A restarted engine may have been started with another limit.
        let mut again = Snapshot {
            engine_restarts: 1,
            ..scrape(6_000, 2.0, 0.0, 0.1)
        };
        follow(Some(&learned), &mut again);
        assert_eq!((again.seats, again.most_running), (0, 2));
        // A garbled running count is none.
        let mut garbled = scrape(7_000, f64::NAN, 5.0, 0.3);
        follow(Some(&learned), &mut garbled);
        assert_eq!((garbled.seats, garbled.queued_since_ms), (8, 0));
    }

    fn pod(seats: u32, choices: &[u16]) -> PodRecord {
        PodRecord {
            snapshot: Some(Snapshot {
                seats,
                ..Snapshot::default()
            }),
            entries: choices
                .iter()
                .enumerate()
                .map(|(i, &choices)| RequestEntry {
                    id: i as u64 + 1,
                    choices,
                    ..RequestEntry::default()
                })
                .collect(),
            ..PodRecord::default()
        }
    }

    fn asking(rate: u64) -> Load {
        Load {
            held: 100,
            sigma: 0,
            left: 10,
            rate,
            bounded: true,
            guessed: false,
            streamed: 0,
            ahead: None,
            outlook: [0; crate::estimate::output_dist::HORIZON_STEPS.len()],
        }
    }

    #[test]
    fn a_pod_takes_its_seats_and_one_more_counted_in_answers() {
        let learned = Config::default();
        assert!(
            room(&pod(4, &[1, 1, 1, 1]), &asking(1), 1.0, &learned),
            "one waiting"
        );
        assert!(!room(&pod(4, &[1, 1, 1, 1, 1]), &asking(1), 1.0, &learned));
        // Entries of records from before choices were kept read as 0: one answer.
        assert!(!room(&pod(4, &[0, 0, 0, 0, 0]), &asking(1), 1.0, &learned));
        assert!(
            !room(&pod(4, &[2, 2]), &asking(2), 1.0, &learned),
            "n = 2 is two"
        );
        assert!(
            room(&pod(0, &[1; 40]), &asking(1), 1.0, &learned),
            "unknown: unlimited"
        );
        assert!(
            room(&pod(4, &[]), &asking(9), 1.0, &learned),
            "alone, always"
        );
        // A replica granted half the pod's budget fills half its seats.
        assert!(room(&pod(8, &[1, 1, 1, 1]), &asking(1), 0.5, &learned));
        assert!(!room(&pod(8, &[1, 1, 1, 1, 1]), &asking(1), 0.5, &learned));
    }

    #[test]
    fn seats_stated_in_the_configuration_hold_every_pod_scraped_or_not() {
        let mut stated = Config::default();
        stated.admission.engine_seats = 2;
        // Its seats and one more.
        let unscraped = PodRecord {
            snapshot: None,
            ..pod(0, &[1, 1, 1])
        };
        assert!(!room(&unscraped, &asking(1), 1.0, &stated));
        assert!(room(&pod(0, &[1, 1]), &asking(1), 1.0, &stated));
        // Over what was learned.
        assert!(!room(&pod(8, &[1, 1, 1]), &asking(1), 1.0, &stated));
        assert_eq!(in_force(&stated, unscraped.snapshot.as_ref()), 2);
        assert_eq!(in_force(&Config::default(), None), 0);
        assert_eq!(
            in_force(&Config::default(), pod(8, &[]).snapshot.as_ref()),
            8
        );
        assert!(
            room(&pod(0, &[]), &asking(9), 1.0, &stated),
            "alone, always"
        );
    }
}
