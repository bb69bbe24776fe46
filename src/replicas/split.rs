//! The grant arithmetic for one pod, pure: how the pod's budget is split between replicas, how far
//! this replica's grant may move in one sync, and what it may admit against between syncs.
//!
//! The invariant every function here keeps: the grants in etcd sum to at most the pod's budget.
//! A grant only grows out of credit no one holds (`budget − Σ grants`, grants of replicas whose
//! lease lapsed less than the grace ago included), and only through a txn that compares the pod's
//! guard revision, so two replicas never hand out the same credit; it shrinks freely, never below
//! what the replica already has reserved there, so credit another replica takes is really free.
//! Admission stays local: each replica keeps its own reservations within its grant, and the sum of
//! reservations within the budget follows.

/// One replica's line for a pod, as read from etcd.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Holder {
    pub grant: u64,
    /// What its requests there hold now (their forecast): its share never falls below it.
    pub in_use: u64,
    /// What it asks for: `in_use` plus its share of its waiting line.
    pub demand: u64,
    /// The size of the next request it would admit (the head of its line; 0 when none waits):
    /// credit is handed out in these steps.
    pub unit: u64,
    /// Its lease lapsed: it keeps its grant (it may still be admitting, cut off from etcd) until
    /// the grace ends, and asks for nothing more.
    pub lapsed: bool,
    /// Its place, among holders given as much so far, for a further request: drawn per pod and
    /// per period by the sync (`sync::rank`), the same in every replica's split.
    pub rank: u64,
}

/// How many steps of water-filling one split takes at most; each hands out at least a token, and
/// units are whole requests, so real splits take a few dozen.
const MAX_STEPS: usize = 100_000;

/// The max-min fair split of `budget` between holders, in whole requests: each keeps what its
/// requests hold, then the credit left goes one request (`unit`) at a time to whoever has the
/// least so far and still asks for more, while that request fits (ties: `fill`). Credit nobody
/// can use is split evenly on top, so a replica has room for its next small request before it
/// can ask.
///
/// Why whole requests: an even split of a small pod leaves every replica a fraction of a request
/// it cannot use. Two pods of 4 096 tokens split three ways give each replica ~1 300 tokens of
/// a pod, one 700-token request and 600 idle: three requests per pod where one Envoy runs five.
/// Handing out whole requests gives the same five, spread as evenly as whole requests allow.
///
/// Why what each holds is kept: a replica whose request ended admits the next from its line
/// at once, within the grant it holds, where credit given to another waits two syncs (the holder
/// shrinks at its sync, the other grows at its own); split from nothing every sync, the credit
/// moved back and forth and the 2× overload through three replicas took 0.56–0.59 s at
/// the median against 0.39–0.40 s (`tests/e2e/replicas_bench.py`).
///
/// Except for a replica owed a request there: one asking for more of the pod, whose next request
/// the split from what each holds leaves no room for, while the split from nothing gives it that
/// request. Each of the others' requests that ended was followed by the next from their lines, so
/// what each held stayed as it was for as long as the lines waited: a replica holding nothing
/// waited for ever for its first request (CI, 2026-12-03: two replicas of 750-token requests kept
/// a 4 096-token pod between them, and a third replica's 1 350-token request waited past 10 s),
/// and one a request behind on a pod stayed there. Then the split starts from nothing: the owed
/// replica's next request comes before anyone's further one, and a replica whose share falls
/// below what it holds admits nothing more there until its requests end below it (`Next::cap`),
/// its credit going to the owed one. Which of the replicas given as much so far a further request
/// goes to is their `rank`, drawn per pod and per period, so one behind on a pod is behind there
/// for a period, not on every pod for good (`sync::rank`).
pub fn fair_split(budget: u64, holders: &[Holder]) -> Vec<u64> {
    let kept = fill(budget, holders, true);
    // A replica short of its next request there: wanting more than it holds, not given it.
    let short_of = |given: &[u64], i: usize| {
        holders.get(i).zip(given.get(i)).is_some_and(|(h, &g)| {
            h.unit > 0 && h.demand > h.in_use && g < h.in_use.saturating_add(h.unit)
        })
    };
    if !(0..holders.len()).any(|i| short_of(&kept, i)) {
        return kept;
    }
    // Only if that lets one in: a request larger than the pod's whole budget moves no credit.
    let fresh = fill(budget, holders, false);
    if (0..holders.len()).any(|i| short_of(&kept, i) && !short_of(&fresh, i)) {
        fresh
    } else {
        kept
    }
}

/// The water-filling of `fair_split`, from what each holds (`keep`) or from nothing. Ties,
/// between holders given as much so far: a first request goes to whoever holds least now, so
/// that where not every replica's next request fits, one holding nothing goes first; a further
/// one by `rank` (then the first listed: every replica lists them in etcd's key order).
fn fill(budget: u64, holders: &[Holder], keep: bool) -> Vec<u64> {
    let n = holders.len() as u64;
    if n == 0 {
        return Vec::new();
    }
    let mut share: Vec<u64> = holders
        .iter()
        .map(|h| if keep { h.in_use } else { 0 })
        .collect();
    let mut left = budget.saturating_sub(share.iter().sum());
    // A holder that names no request size asks in small steps, so such holders still share
    // evenly (to a 1/1024 of the budget).
    let quantum = (budget / 1_024).max(1);
    for _ in 0..MAX_STEPS {
        let step = |i: usize| {
            let h = &holders[i];
            let unit = if h.unit == 0 { quantum } else { h.unit };
            unit.min(h.demand.saturating_sub(share[i]))
        };
        let next = (0..holders.len())
            .filter(|&i| step(i) > 0 && step(i) <= left)
            .min_by_key(|&i| {
                let h = &holders[i];
                (share[i], if share[i] == 0 { h.in_use } else { h.rank })
            });
        let Some(i) = next else {
            break;
        };
        let s = step(i);
        share[i] += s;
        left -= s;
    }
    let spare = left / n;
    share.iter().map(|s| s + spare).collect()
}

/// This replica's next step on a pod (`next`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Next {
    /// The grant to hold in etcd: towards the fair target, shrinking freely but never below
    /// `in_use` (what it has reserved), growing only by the credit no one holds.
    pub grant: u64,
    /// What it may reserve there until the next sync: the grant, or its fair share where that
    /// fell below what it holds, so that what its requests free goes back to the split instead
    /// of to its own line.
    pub cap: u64,
}

/// This replica's next grant and cap on a pod (`Next`). `me` indexes `holders` (its own line
/// carries its fresh `in_use`); lapsed holders keep their grants and take no part in the split.
pub fn next(budget: u64, holders: &[Holder], me: usize) -> Next {
    let Some(mine) = holders.get(me) else {
        return Next { grant: 0, cap: 0 };
    };
    let held_by_lapsed: u64 = holders.iter().filter(|h| h.lapsed).map(|h| h.grant).sum();
    let live: Vec<usize> = (0..holders.len())
        .filter(|&i| i == me || !holders[i].lapsed)
        .collect();
    let split = fair_split(
        budget.saturating_sub(held_by_lapsed),
        &live.iter().map(|&i| holders[i]).collect::<Vec<_>>(),
    );
    let target = live
        .iter()
        .position(|&i| i == me)
        .and_then(|k| split.get(k).copied())
        .unwrap_or(0);
    if target <= mine.grant {
        return Next {
            grant: target.max(mine.in_use.min(mine.grant)),
            cap: target,
        };
    }
    let granted: u64 = holders.iter().map(|h| h.grant).sum();
    let free = budget.saturating_sub(granted);
    let grant = mine.grant + (target - mine.grant).min(free);
    Next { grant, cap: grant }
}

/// What this replica admits against on a pod between syncs, given the pod's budget as it was
/// just corrected by the engine's numbers (`budget_now`).
///
/// In contact with etcd: the grant, scaled down by `budget_now / granted` when the budget fell
/// below the grants' sum since the last sync (traffic kvgate did not send, preemptions). Every
/// replica scales by the same ratio from the same scrape figures, so the shrink takes effect
/// within one scrape, without waiting for etcd. Out of contact: at most the budget divided by the
/// configured maximum of replicas, so replicas that all lost etcd still sum to the budget, and
/// never more than the last grant, which the others still count.
pub fn admit_cap(
    grant: u64,
    granted: u64,
    budget_now: u64,
    in_contact: bool,
    max_replicas: u32,
) -> u64 {
    let scaled = if granted > budget_now {
        (u128::from(grant) * u128::from(budget_now) / u128::from(granted)) as u64
    } else {
        grant
    }
    .min(budget_now);
    if in_contact {
        scaled
    } else {
        scaled.min(budget_now / u64::from(max_replicas.max(1)))
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    fn live(grant: u64, in_use: u64, demand: u64, unit: u64) -> Holder {
        Holder {
            grant,
            in_use,
            demand,
            unit,
            lapsed: false,
            rank: 0,
        }
    }

    fn asking(demands: &[u64], unit: u64) -> Vec<Holder> {
        demands.iter().map(|&d| live(0, 0, d, unit)).collect()
    }

    #[test]
    fn the_split_is_max_min_fair_and_spends_the_budget_exactly() {
        assert_eq!(
            fair_split(900, &asking(&[100, 100, 100], 0)),
            [300, 300, 300]
        );
        assert_eq!(fair_split(900, &asking(&[0, 600, 0], 0)), [100, 700, 100]);
        assert_eq!(
            fair_split(900, &asking(&[100, 2_000, 2_000], 10)),
            [100, 400, 400]
        );
        assert_eq!(
            fair_split(900, &asking(&[5_000, 5_000, 5_000], 1)),
            [300, 300, 300]
        );
        assert!(fair_split(900, &[]).is_empty());
        for demands in [[1u64, 2, 3], [900, 1, 1], [400, 400, 400], [0, 0, 0]] {
            let s: u64 = fair_split(900, &asking(&demands, 7)).iter().sum();
            assert!(s <= 900, "{demands:?}: {s}");
        }
    }

    #[test]
    fn credit_goes_out_in_whole_requests() {
        // A pod of 3 891 tokens, three replicas each holding one 700-token request and asking
        // for more: an even split (1 297 each) fits no second request anywhere; whole requests
        // give two of them a second one, and the 391 left over evenly on top.
        let busy = [live(0, 700, 5_000, 700); 3];
        assert_eq!(fair_split(3_891, &busy), [1_530, 1_530, 830]);
        // What each holds is kept even past its fair share, while the others' next requests fit.
        let held = [live(0, 2_000, 2_000, 700), live(0, 0, 5_000, 700)];
        assert_eq!(fair_split(3_000, &held), [2_000 + 150, 700 + 150]);
    }

    #[test]
    fn a_replica_holding_past_its_share_admits_nothing_more_so_a_larger_request_elsewhere_fits() {
        // Two replicas hold two 750-token requests each on a pod of 4 096 tokens, their lines
        // asking for more; a third waits with a request of 1 352, and 1 096 is free.
        let mut holders = [
            live(1_500, 1_500, 5_000, 750),
            live(1_500, 1_500, 5_000, 750),
            live(1_096, 0, 1_352, 1_352),
        ];
        // The third is starved: each gets a request before any gets a second, and the second
        // replica's share (914) falls below what it holds, so it admits nothing more there.
        assert_eq!(fair_split(4_096, &holders), [1_664, 914, 1_516]);
        assert_eq!(
            next(4_096, &holders, 1),
            Next {
                grant: 1_500,
                cap: 914
            }
        );
        assert_eq!(
            next(4_096, &holders, 2),
            Next {
                grant: 1_096,
                cap: 1_096
            },
            "none free yet"
        );
        // One of its requests ends: its grant falls to its share, and the third grows into it
        // (the split from what each holds gives it its request now).
        holders[1].in_use = 750;
        holders[1].grant = next(4_096, &holders, 1).grant;
        assert_eq!(holders[1].grant, 914);
        assert_eq!(
            next(4_096, &holders, 2),
            Next {
                grant: 1_516,
                cap: 1_516
            }
        );
        // A request larger than the whole budget starves no one: what each holds is kept.
        let huge = [live(3_000, 3_000, 5_000, 700), live(0, 0, 9_000, 9_000)];
        assert_eq!(fair_split(4_096, &huge), [3_000 + 700 + 198, 198]);
        // Ties: a first request to whoever holds least now, a second by rank (both 0 here: the
        // first listed).
        let even = [live(0, 750, 5_000, 750), live(0, 0, 5_000, 750)];
        assert_eq!(fair_split(1_000, &even), [125, 750 + 125]);
        assert_eq!(fair_split(2_250, &even), [1_500, 750]);
    }

    #[test]
    fn a_replica_two_requests_behind_another_is_owed_one_and_one_behind_is_not() {
        // Three replicas' lines all wait, 650-token requests, a pod of 4 600 tokens: seven fit.
        // Holding three, two and two, no split gives anyone more than a request apart: kept.
        let near = [
            live(1_950, 1_950, 9_000, 650),
            live(1_300, 1_300, 9_000, 650),
            live(1_300, 1_300, 9_000, 650),
        ];
        assert_eq!(fair_split(4_600, &near), [1_966, 1_316, 1_316]);
        // Holding four, two and one: the third is owed the first's fourth, which admits nothing
        // more there until one of its requests ends.
        let far = [
            live(2_600, 2_600, 9_000, 650),
            live(1_300, 1_300, 9_000, 650),
            live(650, 650, 9_000, 650),
        ];
        assert_eq!(fair_split(4_600, &far), [1_966, 1_316, 1_316]);
        assert_eq!(next(4_600, &far, 0).cap, 1_966);
        // A line that is empty is owed nothing: the second is owed the first's fourth instead.
        let content = [far[0], far[1], live(650, 650, 650, 650)];
        assert_eq!(fair_split(4_600, &content), [1_966, 1_966, 666]);
    }

    #[test]
    fn a_grant_grows_only_from_free_credit_and_never_shrinks_below_what_is_reserved() {
        // Replica 0 holds everything and uses 700 of it; replica 1 asks for 800.
        let holders = [live(1_000, 700, 700, 0), live(0, 0, 800, 0)];
        // The split keeps 0's 700 and gives 1 the 300 left: 0 gives back the rest.
        assert_eq!(
            next(1_000, &holders, 0),
            Next {
                grant: 700,
                cap: 700
            }
        );
        assert_eq!(next(1_000, &holders, 1).grant, 0, "no free credit yet");
        let after = [live(700, 700, 700, 0), live(0, 0, 800, 0)];
        assert_eq!(next(1_000, &after, 1).grant, 300, "the freed credit");
        // Requests end on 0: its grant falls to what it holds, and 1 grows into the rest.
        let later = [live(700, 200, 200, 0), live(300, 300, 800, 0)];
        assert_eq!(next(1_000, &later, 0).grant, 200);
        let freed = [live(200, 200, 200, 0), live(300, 300, 800, 0)];
        assert_eq!(next(1_000, &freed, 1).grant, 800);
    }

    #[test]
    fn a_lapsed_holder_keeps_its_grant_out_of_the_split() {
        let holders = [
            live(200, 0, 1_000, 0),
            Holder {
                grant: 500,
                demand: 9_999,
                lapsed: true,
                ..Holder::default()
            },
            live(300, 0, 1_000, 0),
        ];
        // 1 000 less the lapsed 500 is split between the two live replicas, 250 each: 2 gives
        // back 50, which 0 cannot take before it is free.
        assert_eq!(next(1_000, &holders, 2).grant, 250);
        assert_eq!(next(1_000, &holders, 0).grant, 200);
        // Once it is gone (reclaimed), its credit is free.
        let reclaimed = [live(250, 0, 1_000, 0), live(250, 0, 1_000, 0)];
        assert_eq!(next(1_000, &reclaimed, 0).grant, 500);
    }

    #[test]
    fn the_budget_falling_shrinks_every_cap_at_once_and_out_of_contact_caps_by_the_maximum() {
        assert_eq!(admit_cap(400, 1_000, 1_200, true, 3), 400);
        assert_eq!(
            admit_cap(400, 1_000, 500, true, 3),
            200,
            "half the budget, half the grant"
        );
        assert_eq!(admit_cap(400, 1_000, 1_000, false, 4), 250);
        assert_eq!(
            admit_cap(100, 1_000, 1_000, false, 4),
            100,
            "never above the last grant"
        );
        assert_eq!(admit_cap(400, 0, 0, true, 0), 0);
    }
}
