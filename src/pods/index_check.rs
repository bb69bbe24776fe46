//! What each engine's own prefix-cache counters (`vllm:prefix_cache_hits_total`,
//! `vllm:prefix_cache_queries_total`) say of kvgate's prefix index (`routing::prefix_index`), and
//! the correction that follows (issue 17's "use the pods' scraped hits"). Worked out once per
//! scrape by the scraper, in the pod's record (`follow`), so that every worker reads one answer:
//! - **The engine restarted** (its counters went back): its cache is empty. The snapshot counts
//!   the restarts (`Snapshot::engine_restarts`) and each VM, seeing the count move, forgets the
//!   blocks it believed the pod held (`Router::learn`). Before, the TTL alone aged them out, and
//!   a group kept going to a pod that no longer held its prefix.
//! - **The index believes the pod holds more than it does.** Each routed request adds to the
//!   record's [`Tally`] the prompt blocks kvgate believed the pod cached and its whole prompt's.
//!   Over an interval of at least [`MIN_REQUESTS`] requests, the share kvgate believed cached is
//!   compared with the share the engine found cached (hits ÷ queries). The index learns only from
//!   what this gateway sent; when others fill the pod's cache too (other gateway replicas, each
//!   with its own index, or clients that bypass the gateway), the engine evicts sooner than the
//!   index does, and kvgate believes in prefixes that are gone. So the share of the pod's
//!   capacity the index holds (`Snapshot::index_share`) is scaled by the engine's share over
//!   kvgate's, within a step of [`MAX_STEP`] either way, never above the whole capacity and never
//!   below [`MIN_SHARE`]; where the engine found more, it grows back.
//!
//! Rates, not counts, are compared: with several gateway replicas the engine counts every
//! replica's requests and this record only this replica's. vLLM counts a waiting request's
//! lookup again at every step it waits, so while requests wait the engine's rate weighs each by
//! how long it waited: a scrape that sees requests waiting drops the interval and starts the
//! next from there (kvgate's admission keeps the engine's queue empty; through two replicas with
//! admission off, the engine's queue made the index shrink to 13–50 % while the engine found
//! more cached than kvgate believed). What a rate cannot tell apart: clients of the pod whose prompts share less than kvgate's, whose misses lower the
//! engine's rate; the share then shrinks more than the evictions alone call for, and
//! `routing.indexCheck` turns the correction off (docs/configuration.md).
//!
//! Stability: the share kvgate believes cached, b(s), grows with the index's share s of the
//! capacity, and at most in proportion (an LRU's hit curve is concave: the blocks an index of
//! half the size drops are the least recently used, the least likely to be hit). The step
//! s' = s·e/b(s) towards the engine's rate e therefore moves log s by at most its distance to
//! the fixed point b(s*) = e, without overshooting it. The engine's rate moves little with s:
//! the blocks a smaller index forgets are those the engine had evicted, so routing by what is
//! left sends the same requests to the same cached prefixes. Within [`DEAD_BAND`] nothing
//! moves: on one gateway in front of its pods, kvgate's and the engines' rates were 0.4–0.6
//! points apart on the cache-pressure benchmark (BENCHMARKS.md, 2026-11-27), and character
//! blocks against the engine's token blocks keep them from agreeing exactly.

use crate::pods::record::{Snapshot, Tally};

/// Requests routed to the pod that an interval must count before its rates are compared; until
/// then it goes on from the same baseline over more scrapes. The two rates are of the same
/// requests, so their difference is small where the index is right, but a scrape's edge cuts
/// the requests kvgate has counted from those the engine has looked up by a few; over 32 that
/// is a few points at most, inside the band.
pub const MIN_REQUESTS: u64 = 32;
/// Rates closer than this (absolute share of the prompts, plus a tenth of the larger rate) are
/// taken as agreeing.
pub const DEAD_BAND: (f64, f64) = (0.03, 0.1);
/// One interval moves the share by at most this factor either way.
pub const MAX_STEP: f64 = 2.0;
/// The share never falls below this: an index a sixteenth of the pod's capacity still keeps the
/// prefixes used most recently, which even a crowded cache holds.
pub const MIN_SHARE: f64 = 1.0 / 16.0;

/// The engine's counters and the record's tally at one scrape: an interval's baseline.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct HitTotals {
    /// The engine's prefix-cache hits and lookups, in tokens, since it started.
    pub hits: f64,
    pub queries: f64,
    /// The record's [`Tally`] at that scrape.
    pub tally: Tally,
}

/// Fills `next`'s restart count, index share and baseline from the previous snapshot, the
/// engine's counters it carries (`next.hit_totals`, with an empty tally), its waiting requests
/// (kvgate's own just sent taken off: `record::write_snapshot`) and the record's tally now. A
/// scrape without the counters (a pod marked down, an engine that does not export them,
/// `enabled` false) keeps the previous baseline: it says nothing of them.
pub fn follow(prev: Option<&Snapshot>, next: &mut Snapshot, tally: Tally, enabled: bool) {
    next.engine_restarts = prev.map_or(0, |p| p.engine_restarts);
    // A restart is told by the last scrape's counters, not the interval's baseline, which may
    // be older than anything the engine counted (a quiet pod's stays where it was set).
    let last = prev.and_then(|p| p.hit_counts);
    next.hit_counts = next.hit_totals.map(|t| (t.hits, t.queries)).or(last);
    next.index_cut = if enabled {
        prev.map_or(0.0, |p| p.index_cut)
    } else {
        0.0
    };
    let before = prev.and_then(|p| p.hit_totals);
    let Some(now) = next.hit_totals.filter(|_| enabled) else {
        next.hit_totals = before;
        return;
    };
    let now = HitTotals { tally, ..now };
    next.hit_totals = Some(now);
    if last.is_some_and(|(hits, queries)| now.hits < hits || now.queries < queries) {
        // Counters start again only in a new engine process (or a new pod at the address).
        next.engine_restarts = next.engine_restarts.wrapping_add(1);
        return;
    }
    let Some(before) = before else {
        return;
    };
    if next.waiting > 0.0 {
        // Requests wait in the engine: each is looked up again at every step, its misses and
        // hits counted as often as it waits, so the interval's rate is not its requests'. It
        // starts again from here.
        return;
    }
    let requests = now.tally.requests.wrapping_sub(before.tally.requests);
    let sent = now.tally.sent_blocks.wrapping_sub(before.tally.sent_blocks);
    let queries = now.queries - before.queries;
    if requests < MIN_REQUESTS || sent == 0 || queries.is_nan() || queries <= 0.0 {
        // Too few requests yet, or the engine looked up nothing: the same baseline goes on.
        next.hit_totals = Some(before);
        return;
    }
    let believed = now
        .tally
        .believed_blocks
        .wrapping_sub(before.tally.believed_blocks)
        .min(sent) as f64
        / sent as f64;
    let found = ((now.hits - before.hits) / queries).clamp(0.0, 1.0);
    if !found.is_finite() {
        return;
    }
    let share = next.index_share();
    let band = DEAD_BAND.0 + DEAD_BAND.1 * believed.max(found);
    let stepped = if believed > found + band {
        share * (found / believed).max(1.0 / MAX_STEP)
    } else if found > believed + band && share < 1.0 {
        share * (found / believed.max(f64::MIN_POSITIVE)).min(MAX_STEP)
    } else {
        share
    };
    next.index_cut = 1.0 - stepped.clamp(MIN_SHARE, 1.0);
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    fn scrape(hits: f64, queries: f64) -> Snapshot {
        Snapshot {
            hit_totals: Some(HitTotals {
                hits,
                queries,
                tally: Tally::default(),
            }),
            ..Snapshot::default()
        }
    }

    fn tally(requests: u64, believed_blocks: u64, sent_blocks: u64) -> Tally {
        Tally {
            requests,
            believed_blocks,
            sent_blocks,
        }
    }

    /// Follows a scrape of `(hits, queries)` with the record's tally then.
    fn next(prev: &Snapshot, counters: (f64, f64), t: Tally) -> Snapshot {
        let mut s = scrape(counters.0, counters.1);
        follow(Some(prev), &mut s, t, true);
        s
    }

    #[test]
    fn an_index_believing_more_than_the_engine_finds_shrinks_towards_it_and_grows_back() {
        let mut s = scrape(0.0, 0.0);
        follow(None, &mut s, Tally::default(), true);
        assert_eq!(s.index_share(), 1.0);
        // kvgate believed 60 % of 64 prompts cached; the engine found 30 %.
        s = next(&s, (300.0, 1_000.0), tally(64, 600, 1_000));
        assert!((s.index_share() - 0.5).abs() < 1e-9, "{}", s.index_share());
        // Found a quarter of what was believed: one step halves it, no more.
        s = next(&s, (400.0, 2_000.0), tally(128, 1_000, 2_000));
        assert!((s.index_share() - 0.25).abs() < 1e-9);
        // Agreeing within the band: nothing moves.
        s = next(&s, (700.0, 3_000.0), tally(192, 1_320, 3_000));
        assert!((s.index_share() - 0.25).abs() < 1e-9);
        // The engine finds more than the index believes: back up, by at most a doubling, and
        // never past the pod's whole capacity.
        s = next(&s, (1_500.0, 4_000.0), tally(256, 1_520, 4_000));
        assert!((s.index_share() - 0.5).abs() < 1e-9);
        s = next(&s, (2_200.0, 5_000.0), tally(320, 1_970, 5_000));
        assert!((s.index_share() - 0.5 * 0.7 / 0.45).abs() < 1e-9);
        s = next(&s, (3_100.0, 6_000.0), tally(384, 2_370, 6_000));
        assert_eq!(s.index_share(), 1.0);
    }

    #[test]
    fn an_interval_of_few_requests_waits_for_more_and_the_share_keeps_its_floor() {
        let mut s = scrape(0.0, 0.0);
        follow(None, &mut s, Tally::default(), true);
        // 31 requests: not yet, and the baseline stays where it was.
        let waiting = next(&s, (0.0, 1_000.0), tally(31, 900, 1_000));
        assert_eq!(waiting.index_share(), 1.0);
        assert_eq!(waiting.hit_totals, s.hit_totals);
        // With the 32nd, the whole interval counts.
        s = next(&waiting, (0.0, 1_100.0), tally(32, 990, 1_100));
        assert!((s.index_share() - 0.5).abs() < 1e-9);
        for i in 2..10u64 {
            s = next(
                &s,
                (0.0, 1_100.0 * i as f64),
                tally(32 * i, 990 * i, 1_100 * i),
            );
        }
        assert_eq!(s.index_share(), MIN_SHARE);
    }

    #[test]
    fn a_restart_is_told_by_the_last_scrape_even_before_an_interval_ends() {
        // Two requests since the baseline, so it stays at (0, 0); the restart's counters are
        // below the last scrape's.
        let mut s = scrape(0.0, 0.0);
        follow(None, &mut s, Tally::default(), true);
        s = next(&s, (100.0, 300.0), tally(2, 10, 20));
        assert_eq!(
            s.hit_totals.map(|t| t.hits),
            Some(0.0),
            "the interval goes on"
        );
        s = next(&s, (0.0, 0.0), tally(2, 10, 20));
        assert_eq!(s.engine_restarts, 1);
    }

    #[test]
    fn a_restart_is_counted_and_starts_a_new_baseline() {
        let mut s = scrape(500.0, 1_000.0);
        follow(None, &mut s, tally(10, 100, 200), true);
        s = next(&s, (20.0, 100.0), tally(50, 500, 1_000));
        assert_eq!(s.engine_restarts, 1);
        assert_eq!(s.index_share(), 1.0, "nothing compared across a restart");
        assert_eq!(s.hit_totals.map(|t| t.tally), Some(tally(50, 500, 1_000)));
        // A scrape without counters (down, or not exported) keeps the count and the baseline.
        let mut down = Snapshot::default();
        follow(Some(&s), &mut down, tally(60, 600, 1_200), true);
        assert_eq!(down.engine_restarts, 1);
        assert_eq!(down.hit_totals, s.hit_totals);
    }

    #[test]
    fn a_scrape_that_sees_requests_waiting_starts_the_interval_again() {
        let mut s = scrape(0.0, 0.0);
        follow(None, &mut s, Tally::default(), true);
        // A queue: the engine counted its waiting requests' misses again and again.
        let mut queued = scrape(100.0, 5_000.0);
        queued.waiting = 3.0;
        follow(Some(&s), &mut queued, tally(40, 600, 1_000), true);
        assert_eq!(queued.index_share(), 1.0);
        assert_eq!(
            queued.hit_totals.map(|t| t.tally),
            Some(tally(40, 600, 1_000))
        );
        // The next interval counts from there.
        let after = next(&queued, (400.0, 6_000.0), tally(80, 1_200, 2_000));
        assert!((after.index_share() - 0.5).abs() < 1e-9);
    }

    #[test]
    fn garbage_and_a_disabled_check_change_nothing() {
        let mut s = scrape(0.0, 0.0);
        follow(None, &mut s, Tally::default(), true);
        let nan = next(&s, (f64::NAN, f64::NAN), tally(64, 600, 1_000));
        assert_eq!(nan.index_share(), 1.0);
        let mut cut = scrape(300.0, 1_000.0);
        follow(Some(&s), &mut cut, tally(64, 600, 1_000), true);
        assert!(cut.index_share() < 1.0);
        let mut off = scrape(600.0, 2_000.0);
        follow(Some(&cut), &mut off, tally(128, 1_200, 2_000), false);
        assert_eq!(off.index_share(), 1.0);
    }
}
