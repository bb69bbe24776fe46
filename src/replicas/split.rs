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
    /// What it asks for: its reservations there plus its share of its waiting line.
    pub demand: u64,
    /// Its lease lapsed: it keeps its grant (it may still be admitting, cut off from etcd) until
    /// the grace ends, and asks for nothing more.
    pub lapsed: bool,
}

/// The max-min fair split of `budget` between `demands` (water-filling): each gets what it asks
/// for up to a common level, and the level is as high as the budget allows. Credit nobody asks
/// for is split evenly on top, so a replica has room for its next request before it can ask.
pub fn fair_split(budget: u64, demands: &[u64]) -> Vec<u64> {
    let n = demands.len() as u64;
    if n == 0 {
        return Vec::new();
    }
    let total: u64 = demands.iter().sum();
    if total <= budget {
        let spare = (budget - total) / n;
        return demands.iter().map(|d| d + spare).collect();
    }
    // Raise the level through the demands in increasing order until the budget is spent.
    let mut sorted: Vec<u64> = demands.to_vec();
    sorted.sort_unstable();
    let (mut left, mut level) = (budget, 0);
    for (i, &d) in sorted.iter().enumerate() {
        let rest = n - i as u64;
        if d.saturating_mul(rest) <= left {
            left -= d;
            level = d;
        } else {
            level = left / rest;
            break;
        }
    }
    demands.iter().map(|&d| d.min(level)).collect()
}

/// This replica's next grant on a pod: towards its fair target, shrinking freely (never below
/// `in_use`, what it has reserved now), growing only by the credit no one holds. `me` indexes
/// `holders`; lapsed holders keep their grants and take no part in the split.
pub fn next_grant(budget: u64, holders: &[Holder], me: usize, in_use: u64) -> u64 {
    let Some(mine) = holders.get(me) else {
        return in_use.min(budget);
    };
    let held_by_lapsed: u64 = holders
        .iter()
        .filter(|h| h.lapsed)
        .map(|h| h.grant)
        .sum();
    let live: Vec<usize> = (0..holders.len())
        .filter(|&i| i == me || !holders[i].lapsed)
        .collect();
    let demands: Vec<u64> = live.iter().map(|&i| holders[i].demand).collect();
    let split = fair_split(budget.saturating_sub(held_by_lapsed), &demands);
    let target = live
        .iter()
        .position(|&i| i == me)
        .and_then(|k| split.get(k).copied())
        .unwrap_or(0);
    if target <= mine.grant {
        return target.max(in_use.min(mine.grant));
    }
    let granted: u64 = holders.iter().map(|h| h.grant).sum();
    let free = budget.saturating_sub(granted);
    mine.grant + (target - mine.grant).min(free)
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

    fn live(grant: u64, demand: u64) -> Holder {
        Holder {
            grant,
            demand,
            lapsed: false,
        }
    }

    #[test]
    fn the_split_is_max_min_fair_and_spends_the_budget_exactly() {
        assert_eq!(fair_split(900, &[100, 100, 100]), [300, 300, 300]);
        assert_eq!(fair_split(900, &[0, 600, 0]), [100, 700, 100]);
        assert_eq!(fair_split(900, &[100, 2_000, 2_000]), [100, 400, 400]);
        assert_eq!(fair_split(900, &[5_000, 5_000, 5_000]), [300, 300, 300]);
        assert!(fair_split(900, &[]).is_empty());
        for demands in [[1u64, 2, 3], [900, 1, 1], [400, 400, 400], [0, 0, 0]] {
            let s: u64 = fair_split(900, &demands).iter().sum();
            assert!(s <= 900, "{demands:?}: {s}");
        }
    }

    #[test]
    fn a_grant_grows_only_from_free_credit_and_never_shrinks_below_what_is_reserved() {
        // Replica 0 holds everything and uses 700 of it; replica 1 asks for 800.
        let holders = [live(1_000, 700), live(0, 800)];
        // The fair level is 500 each: 0 gives back the 300 it does not use, keeping its 700.
        assert_eq!(next_grant(1_000, &holders, 0, 700), 700);
        assert_eq!(next_grant(1_000, &holders, 1, 0), 0, "no free credit yet");
        let after = [live(700, 700), live(0, 800)];
        assert_eq!(next_grant(1_000, &after, 1, 0), 300, "the freed credit");
        // Requests end on 0: its grant falls to its fair share, and 1 grows into it.
        let later = [live(500, 500), live(300, 800)];
        assert_eq!(next_grant(1_000, &later, 1, 300), 500);
        let mut sum = 0;
        for me in 0..2 {
            sum += next_grant(1_000, &later, me, later[me].grant.min(later[me].demand));
        }
        assert!(sum <= 1_000);
    }

    #[test]
    fn a_lapsed_holder_keeps_its_grant_out_of_the_split() {
        let holders = [
            live(200, 1_000),
            Holder {
                grant: 500,
                demand: 9_999,
                lapsed: true,
            },
            live(300, 1_000),
        ];
        // 1 000 less the lapsed 500 is split between the two live replicas, 250 each: 2 gives
        // back 50, which 0 cannot take before it is free.
        assert_eq!(next_grant(1_000, &holders, 2, 0), 250);
        assert_eq!(next_grant(1_000, &holders, 0, 0), 200);
        // Once it is gone (reclaimed), its credit is free.
        let reclaimed = [live(250, 1_000), live(250, 1_000)];
        assert_eq!(next_grant(1_000, &reclaimed, 0, 0), 500);
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
