//! Choosing the pod: a cost per eligible pod, in KV blocks, blending the prompt blocks it would
//! have to compute (its cached prefix is free, a hot prefix's copy shared by the requests it will
//! serve) and still computes for requests sent before this one, the blocks its sequences read at every decode step
//! and the blocks they hold (both with this request added), its scraped queue and cache usage, and the load of the request's LoRA adapter where it is not resident;
//! the terms that are time on the pod's GPU scaled by its learned pace (`pods::pace`);
//! lowest cost wins, ties at random, or a softmax draw when a temperature is set. Pure: every
//! input is given, so the formula is read and tested here alone.

use crate::config::RoutingConfig;

/// What is known of one pod at decision time.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate<'a> {
    pub pod: &'a str,
    /// Leading prompt blocks the pod is believed to have cached.
    pub cached_blocks: usize,
    /// Of the prompt blocks the pod would compute, those in-flight requests on other pods hold
    /// (a hot prefix the pod would copy), and the share of their prefill one request pays
    /// ([`copy_weight`]).
    pub copied_blocks: usize,
    pub copy_weight: f64,
    /// Prompt blocks the pod has still to compute for requests sent before this one that have
    /// not had their first token: this one's first token waits behind them.
    pub pending_blocks: u64,
    /// KV blocks in use by in-flight requests now, in the engine's blocks.
    pub active_blocks: u64,
    /// Blocks the pod's in-flight sequences read at each decode step (shared prefixes once per
    /// sequence).
    pub read_blocks: u64,
    /// The engine's blocks this request would add to them (what it would hold there: its prompt
    /// less a prefix in-flight requests already hold, plus its expected output).
    pub added_blocks: u64,
    /// Scraped waiting requests (0 when unknown or stale under the ignore policy).
    pub waiting: f64,
    /// Scraped KV usage 0..1 (0 when unknown).
    pub kv_usage: f64,
    pub capacity_blocks: u64,
    /// The cost of making the request's LoRA adapter usable there (`routing::adapters`): 0 where
    /// it is resident or the model is a base model.
    pub adapter_cost: f64,
    /// Blocks the pod is believed to cache for all prompts: among equal costs, a new prefix goes
    /// where the least is cached, so new prompt groups spread evenly instead of by chance
    /// (`usize::MAX` for a pod whose engine caches no prefixes: it comes last).
    pub cached_total: usize,
    /// How much dearer the pod's time is than the other candidates' (`pods::pace`: its
    /// inter-token latency against theirs), 1 when unknown or not learned.
    pub cost_factor: f64,
    /// How long the request would wait there for the engine's step under way to end before it
    /// is scheduled, in µs (`routing::step_phase`): not a cost, an order among pods loaded alike
    /// (`Router::soonest_step`).
    pub step_wait_us: u64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scored {
    pub index: usize,
    pub cost: f64,
}

/// The six weighted terms of a pod's cost, kept apart so a decision can be explained.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Terms {
    pub prefill: f64,
    pub decode: f64,
    pub active: f64,
    pub queue: f64,
    pub kv: f64,
    pub adapter: f64,
}

impl Terms {
    /// `own_blocks`: what this request's decode steps read (its prompt and expected output), the
    /// same on every pod, so the decode term reads as the pod's step with this request added.
    pub fn of(c: &Candidate, prompt_blocks: usize, own_blocks: u64, w: &RoutingConfig) -> Terms {
        let computed = prompt_blocks.saturating_sub(c.cached_blocks);
        let copied = c.copied_blocks.min(computed) as f64;
        // A copy is memory too: its prefill is shared by the requests it will serve only as far
        // as the pod has room for them (on a pod at its KV capacity, a copy displaces requests).
        let free = 1.0 - (c.active_blocks as f64 / c.capacity_blocks.max(1) as f64).min(1.0);
        let copy_share = 1.0 - (1.0 - c.copy_weight) * free;
        // The pod's pace scales the terms that are time on its GPU: a decode step (what its
        // inter-token latency measures), a prefill (a GPU slower at reading KV is slower at the
        // matmuls too, if not by quite the same ratio: one factor is simpler than a second
        // estimate, and honest about the direction) and the queue (drained at that pace). Not
        // the memory terms: a block held fills the same KV whatever the GPU's speed, and its
        // capacity is measured apart. Not the adapter's load, a copy from host memory.
        let pace = c.cost_factor;
        Terms {
            prefill: pace
                * w.prefill_weight
                * ((computed as f64 - copied)
                    + copied * copy_share
                    + PENDING_SHARE * c.pending_blocks as f64),
            decode: pace * w.decode_weight * (c.read_blocks + own_blocks) as f64,
            active: w.active_weight * (c.active_blocks + c.added_blocks) as f64,
            queue: pace * w.queue_weight * c.waiting * prompt_blocks.max(1) as f64,
            kv: w.kv_usage_weight * c.kv_usage * c.capacity_blocks as f64,
            adapter: c.adapter_cost,
        }
    }

    pub fn total(&self) -> f64 {
        self.prefill + self.decode + self.active + self.queue + self.kv + self.adapter
    }
}

/// The share of a hot prefix's prefill that one request copying it to another pod pays, when
/// `holders` in-flight requests hold it over `pods` eligible pods.
///
/// Computing a prompt's blocks is paid once per pod, not per request: a copy of a prefix serves
/// every later request of it that lands there, for as long as the pod keeps it. A prefix few
/// requests share is worth keeping where it is (its next request may well be the only one), and
/// then the copy is paid in full; one with many requests in flight arrives fast enough to keep
/// about `holders / pods` of them on every pod, so a copy on one more pod is shared by that many,
/// and each pays its part: `1 / (1 + holders / pods)`. Counted in full instead, a prefix every
/// request carries stayed on the pods that first computed it until their decode load outweighed a
/// whole recomputation (an application's 2k-token system prompt at 20 req/s used six of eight
/// pods, each running a third more sequences than round robin's), where round robin pays each
/// pod's copy once and then balances for free.
pub fn copy_weight(holders: u32, pods: usize) -> f64 {
    1.0 / (1.0 + f64::from(holders) / pods.max(1) as f64)
}

/// What a block the pod still computes for earlier requests weighs, against one this request
/// makes it compute: this request's first token waits for either, but computing a block is also
/// work the pool would not otherwise do (the sequences running there stall for it, and a request
/// that leaves its prefix's pod to avoid a wait has the prefix computed again). Counted in full,
/// a conversation's next turn left the pod caching its history whenever a new conversation's
/// first turn was being computed there (multi-turn: prefix hits 78 % → 74 %).
pub const PENDING_SHARE: f64 = 0.5;

/// A small deterministic generator for tie-breaking and softmax draws (xorshift64*), seeded per
/// request so decisions are reproducible in tests.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        // Nearby seeds (consecutive request ids) must not give correlated draws: mix first
        // (splitmix64's finaliser).
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        Rng((z ^ (z >> 31)) | 1)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        (x >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Candidates ordered best first (the pick, then the fallbacks).
pub fn rank(
    candidates: &[Candidate],
    prompt_blocks: usize,
    own_blocks: u64,
    w: &RoutingConfig,
    rng: &mut Rng,
) -> Vec<Scored> {
    let mut scored: Vec<(Scored, usize, f64)> = candidates
        .iter()
        .enumerate()
        .map(|(index, c)| {
            (
                Scored {
                    index,
                    cost: Terms::of(c, prompt_blocks, own_blocks, w).total(),
                },
                c.cached_total,
                rng.next_f64(),
            )
        })
        .collect();
    // Equal costs go to the pod caching least, then fall in random order, so ties do not
    // always favour the first pod listed. The random draw leaves no two keys equal, so the
    // order needs no stable sort (which allocates: with the one in `prefer`, 7 % of a request's
    // instructions at 64 pods).
    scored.sort_unstable_by(|a, b| {
        a.0.cost
            .total_cmp(&b.0.cost)
            .then(a.1.cmp(&b.1))
            .then(a.2.total_cmp(&b.2))
    });
    let mut out: Vec<Scored> = scored.into_iter().map(|(s, _, _)| s).collect();
    if w.temperature > 0.0 && out.len() > 1 {
        let first = softmax_draw(&out, w.temperature, rng);
        let chosen = out.remove(first);
        out.insert(0, chosen);
    }
    out
}

/// Moves to the front, among the ranked pods within `tolerance` of the best cost, those
/// `affinity` scores, highest first (equal scores in ranked order; the rest keep their order
/// after them); pods it scores `None` are passed over (and with none scored nothing moves). All
/// of them, not only the highest: room is checked after the ranking, and when the highest has
/// none the next scored pod still has the affinity (a group's earlier home, a prompt's next
/// rendezvous choice) that an unscored pod lacks. Under cache pressure a group whose last home was
/// full went to the cheapest pod with room, a third pod, while an earlier home had room within
/// the tolerance. The tolerance keeps load first: a pod more than that above the best is never
/// chosen for affinity's sake.
pub fn prefer<K: Ord>(
    ranked: &mut Vec<Scored>,
    tolerance: f64,
    affinity: impl Fn(&Scored) -> Option<K>,
) {
    let Some(best) = ranked.first().map(|s| s.cost) else {
        return;
    };
    // Nothing is allocated unless some pod scores (most picks score none).
    let mut keyed: Vec<(K, Scored)> = ranked
        .iter()
        .filter_map(|s| {
            let k = (s.cost <= best + tolerance)
                .then(|| affinity(s))
                .flatten()?;
            Some((k, *s))
        })
        .collect();
    if keyed.is_empty() {
        return;
    }
    // Highest score first; the sort is stable, so ties keep their rank. Only the scored pods
    // are sorted: the rest follow in ranked order.
    keyed.sort_by(|a, b| b.0.cmp(&a.0));
    let mut moved = vec![false; ranked.iter().map(|s| s.index + 1).max().unwrap_or(0)];
    for (_, s) in &keyed {
        if let Some(m) = moved.get_mut(s.index) {
            *m = true;
        }
    }
    ranked.retain(|s| !moved.get(s.index).copied().unwrap_or(false));
    ranked.splice(0..0, keyed.into_iter().map(|(_, s)| s));
}

/// Several gateway replicas agreeing, without talking, where a prompt no pod caches goes: the
/// pod with the highest rendezvous score of `(first_block, pod)` (highest random weight, Thaler
/// and Ravishankar, 1998), among those close enough to the best (`prefer`). Every replica
/// computes the same score, so a new prompt group's first requests meet on one pod whichever
/// replica they come through, and its later ones find the prefix there; a pod leaving moves only
/// the groups it held.
pub fn rendezvous_score(first_block: u64, pod: &str) -> u64 {
    crate::hash::chain(first_block, pod.as_bytes())
}

/// Draws an index with probability ∝ exp(-normalised cost / temperature).
fn softmax_draw(sorted: &[Scored], temperature: f64, rng: &mut Rng) -> usize {
    let lo = sorted[0].cost;
    let hi = sorted[sorted.len() - 1].cost;
    let span = if hi > lo { hi - lo } else { 1.0 };
    let weights: Vec<f64> = sorted
        .iter()
        .map(|s| (-(s.cost - lo) / span / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut x = rng.next_f64() * total;
    for (i, w) in weights.iter().enumerate() {
        if x < *w {
            return i;
        }
        x -= w;
    }
    0
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    fn pod(name: &str, cached: usize, active: u64, waiting: f64) -> Candidate<'_> {
        Candidate {
            pod: name,
            cached_blocks: cached,
            copied_blocks: 0,
            copy_weight: 1.0,
            pending_blocks: 0,
            active_blocks: active,
            read_blocks: active,
            added_blocks: 10,
            waiting,
            kv_usage: 0.0,
            capacity_blocks: 1000,
            adapter_cost: 0.0,
            cached_total: 0,
            cost_factor: 1.0,
            step_wait_us: 0,
        }
    }

    /// A pod with nothing running or waiting, caching none of the prompt.
    fn idle(name: &str) -> Candidate<'_> {
        pod(name, 0, 0, 0.0)
    }

    #[test]
    fn a_hot_prefixs_copy_is_shared_by_the_requests_it_will_serve() {
        assert_eq!(copy_weight(0, 8), 1.0, "nobody else holds it: paid in full");
        assert_eq!(copy_weight(8, 8), 0.5);
        assert!((copy_weight(36, 8) - 1.0 / 5.5).abs() < 1e-12);
        let w = RoutingConfig::default();
        // 100 blocks to compute, 60 of them a prefix in flight elsewhere, at a fifth each.
        let c = Candidate {
            copied_blocks: 60,
            copy_weight: 0.2,
            ..idle("a")
        };
        let t = Terms::of(&c, 100, 10, &w);
        assert!(
            (t.prefill - 2.0 * (40.0 + 60.0 * 0.2)).abs() < 1e-9,
            "{t:?}"
        );
    }

    #[test]
    fn cached_prefix_wins_when_load_is_equal() {
        let w = RoutingConfig::default();
        let c = [idle("a"), pod("b", 80, 0, 0.0), pod("c", 40, 0, 0.0)];
        let r = rank(&c, 100, 10, &w, &mut Rng::new(1));
        assert_eq!(
            r.iter().map(|s| c[s.index].pod).collect::<Vec<_>>(),
            ["b", "c", "a"]
        );
    }

    #[test]
    fn an_overloaded_pod_holding_the_prefix_is_avoided() {
        let w = RoutingConfig::default();
        let c = [pod("hot", 100, 900, 4.0), pod("cold", 0, 50, 0.0)];
        let r = rank(&c, 100, 10, &w, &mut Rng::new(1));
        assert_eq!(c[r[0].index].pod, "cold");
    }

    #[test]
    fn a_prefix_read_by_many_sequences_weighs_more_than_recomputing_it() {
        // 200 prompt blocks, 180 of them a system prompt that `sequences` requests decoding on
        // "home" share: 190 blocks of memory, but every step reads the prompt once per sequence.
        // "spare" is idle.
        let pick = |sequences: u64| {
            let mut home = pod("home", 180, 190, 0.0);
            home.read_blocks = sequences * 200;
            let c = [home, idle("spare")];
            let r = rank(&c, 200, 210, &RoutingConfig::default(), &mut Rng::new(1));
            c[r[0].index].pod
        };
        assert_eq!(
            pick(4),
            "home",
            "four readers: the cached prefix is worth its pod"
        );
        assert_eq!(
            pick(12),
            "spare",
            "twelve: recomputing it elsewhere is cheaper"
        );
    }

    #[test]
    fn at_equal_load_the_faster_pod_wins_and_its_time_terms_are_scaled() {
        let w = RoutingConfig::default();
        let paced = |name, cost_factor| Candidate {
            cost_factor,
            pending_blocks: 4,
            waiting: 1.0,
            ..pod(name, 0, 50, 0.0)
        };
        let c = [paced("slow", 2.0), paced("fast", 0.5)];
        for seed in 0..20 {
            assert_eq!(
                c[rank(&c, 100, 10, &w, &mut Rng::new(seed))[0].index].pod,
                "fast"
            );
        }
        let (slow, fast) = (Terms::of(&c[0], 100, 10, &w), Terms::of(&c[1], 100, 10, &w));
        for (s, f) in [
            (slow.prefill, fast.prefill),
            (slow.decode, fast.decode),
            (slow.queue, fast.queue),
        ] {
            assert!((s - 4.0 * f).abs() < 1e-9, "{slow:?} {fast:?}");
        }
        assert_eq!(
            (slow.active, slow.kv),
            (fast.active, fast.kv),
            "memory is memory"
        );
    }

    #[test]
    fn consecutive_seeds_pick_uniformly_among_ties() {
        let w = RoutingConfig::default();
        let c = [idle("a"), idle("b"), idle("c"), idle("d")];
        let mut counts = [0; 4];
        for seed in (7u64 << 32)..(7u64 << 32) + 400 {
            counts[rank(&c, 10, 10, &w, &mut Rng::new(seed))[0].index] += 1;
        }
        assert!(
            counts.iter().all(|&n| (60..=140).contains(&n)),
            "{counts:?}"
        );
    }

    #[test]
    fn ties_go_to_the_pod_caching_least() {
        let w = RoutingConfig::default();
        let mut busy = idle("busy");
        busy.cached_total = 500;
        let c = [busy, idle("empty")];
        for seed in 0..20 {
            assert_eq!(
                c[rank(&c, 10, 10, &w, &mut Rng::new(seed))[0].index].pod,
                "empty"
            );
        }
    }

    #[test]
    fn ties_are_broken_at_random() {
        let w = RoutingConfig::default();
        let c = [idle("a"), idle("b")];
        let firsts: std::collections::HashSet<&str> = (0..50)
            .map(|seed| c[rank(&c, 10, 10, &w, &mut Rng::new(seed))[0].index].pod)
            .collect();
        assert_eq!(firsts.len(), 2);
    }

    #[test]
    fn rendezvous_agrees_on_one_pod_among_those_close_to_the_best() {
        // Two idle pods and a loaded one, none caching the prompt.
        let c: Vec<Candidate> = [("a", 0), ("b", 0), ("c", 1_000)]
            .into_iter()
            .map(|(name, load)| pod(name, 0, load, 0.0))
            .collect();
        let w = RoutingConfig::default();
        let ranked = |c: &[Candidate]| rank(c, 100, 10, &w, &mut Rng::new(1));
        // Whatever order the tie-break left them in, every replica moves the same pod first.
        let mut firsts = std::collections::BTreeSet::new();
        for seed in 0..20 {
            let mut r = rank(&c, 100, 10, &w, &mut Rng::new(seed));
            prefer(&mut r, 1.0, |s| Some(rendezvous_score(42, c[s.index].pod)));
            firsts.insert(c[r[0].index].pod);
        }
        assert_eq!(firsts.len(), 1, "{firsts:?}");
        assert_ne!(firsts.first(), Some(&"c"), "the loaded pod is never chosen");
        // Different groups spread over the acceptable pods.
        let mut pods = std::collections::BTreeSet::new();
        for group in 0..20 {
            let mut r = ranked(&c);
            prefer(&mut r, 1.0, |s| {
                Some(rendezvous_score(group * 7_919, c[s.index].pod))
            });
            pods.insert(c[r[0].index].pod);
        }
        assert_eq!(pods.len(), 2, "{pods:?}");
    }

    #[test]
    fn prefer_moves_the_best_scored_pod_within_the_tolerance_and_only_a_scored_one() {
        let scored = |costs: &[f64]| -> Vec<Scored> {
            costs
                .iter()
                .enumerate()
                .map(|(index, &cost)| Scored { index, cost })
                .collect()
        };
        let front = |r: &[Scored]| r[0].index;
        let mut r = scored(&[1.0, 1.5, 2.5]);
        prefer(&mut r, 1.0, |s| (s.index > 0).then_some(s.index));
        assert_eq!(front(&r), 1, "pod 2 is past the tolerance");
        let mut r = scored(&[1.0, 1.5, 2.5]);
        prefer(&mut r, 1.0, |_| None::<u64>);
        assert_eq!(front(&r), 0, "nothing scored, nothing moves");
        let mut r = scored(&[1.0, 1.5, 2.5]);
        prefer(&mut r, 5.0, |s| Some(s.index));
        assert_eq!(front(&r), 2);
        // Every scored pod within the tolerance goes ahead of the unscored, highest first, so
        // a pod without room at the front leaves the next scored one before an unscored one.
        let mut r = scored(&[1.0, 1.2, 1.5, 1.8, 2.5]);
        prefer(&mut r, 1.0, |s| {
            [None, Some(1), None, Some(3), Some(9)][s.index]
        });
        let order: Vec<usize> = r.iter().map(|s| s.index).collect();
        assert_eq!(order, vec![3, 1, 0, 2, 4]);
    }

    #[test]
    fn temperature_spreads_picks_towards_cheaper_pods() {
        let w = RoutingConfig {
            temperature: 0.5,
            ..RoutingConfig::default()
        };
        let c = [pod("cheap", 50, 0, 0.0), idle("dear")];
        let mut rng = Rng::new(7);
        let cheap = (0..1000)
            .filter(|_| c[rank(&c, 100, 10, &w, &mut rng)[0].index].pod == "cheap")
            .count();
        // p(cheap) = 1 / (1 + e^-2) ≈ 0.88
        assert!((820..=940).contains(&cheap), "{cheap}");
    }
}
