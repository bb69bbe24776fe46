//! Which prompt blocks in-flight requests occupy on each pod (NVIDIA Dynamo's predicted active
//! blocks): a request's prompt blocks are added at dispatch and removed when it ends; a block held
//! by several in-flight requests counts once. This is each VM's replica of block membership, fed
//! by its own dispatches and the pick log. The counts that must return to zero live in the shared
//! pod record (`pods::record`); this replica only says which blocks are already active, so a new
//! request is charged for the blocks it adds, and which requests it may lean on for the rest. The
//! record decides who counts a shared prefix (`RequestEntry::leans_on`): this replica may still
//! hold a request another worker has finished. Fed by every dispatch, it also counts them per
//! pod: the rate `routing::demand` reads.
//!
//! Block hashes are chained (each covers the prompt up to its block), so a block is held on a
//! pod exactly when some in-flight request there shares the prompt up to it, and the requests
//! sharing a prompt's first n blocks are a run of the pod's requests in lexicographic order of
//! their hashes. The replica keeps that order, and answers every question with a binary search
//! and comparisons of hash lists, where a map of block → holders took a map operation per block
//! on every dispatch and finish, in this VM and again in every other worker's replay of the pick
//! log: about a seventh of a request's time in V8 at two workers, more at more (BENCHMARKS.md,
//! *Per-request cost*, 2026-11-27).

use crate::routing::pod_id::{PodId, PodMap};
use hashbrown::HashMap;
use std::rc::Rc;

/// Requests seen in the log but absent from the pod's shared record for this long are dropped
/// (their finish was lost, or their VM died).
const ORPHAN_MS: u64 = 5_000;

#[derive(Default)]
struct PodActive {
    /// In-flight requests by id: their prompt's block hashes (the dispatch's own list, shared
    /// with `order`, not copied) and when they were added.
    requests: HashMap<u64, (Rc<Vec<u64>>, u64)>,
    /// The same requests in lexicographic order of their hashes, then of their ids.
    order: Vec<(Rc<Vec<u64>>, u64)>,
    /// Requests ever added: the dispatches to the pod this VM has seen (`routing::demand`).
    dispatched: u64,
}

/// Leading blocks two hash lists share.
fn common(a: &[u64], b: &[u64]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PodActive {
    /// Where in `order` the requests sharing all of `prefix` are (a run, as the order is
    /// lexicographic: they start with it, and nothing else sorts among them).
    fn sharing(&self, prefix: &[u64]) -> std::ops::Range<usize> {
        let from = self.order.partition_point(|(hs, _)| &hs[..] < prefix);
        let to = self
            .order
            .partition_point(|(hs, _)| &hs[..prefix.len().min(hs.len())] <= prefix);
        from..to.max(from)
    }

    /// The position `(hashes, id)` has, or would have, in `order`.
    fn position(&self, hashes: &[u64], id: u64) -> Result<usize, usize> {
        self.order
            .binary_search_by(|(hs, other)| (&hs[..], *other).cmp(&(hashes, id)))
    }
}

#[derive(Default)]
pub struct ActiveBlocks {
    pods: PodMap<PodActive>,
    /// The dispatches this VM has seen to any pod, ever.
    dispatched: u64,
}

impl ActiveBlocks {
    /// Leading blocks of `hashes` already held by in-flight requests on the pod: the most any one
    /// request shares with it, which one of the two requests beside where it would sort does.
    pub fn active_prefix(&self, pod: PodId, hashes: &[u64]) -> usize {
        let Some(p) = self.pods.get(&pod) else {
            return 0;
        };
        let at = p.order.partition_point(|(hs, _)| &hs[..] < hashes);
        [at.checked_sub(1), Some(at)]
            .into_iter()
            .flatten()
            .filter_map(|i| p.order.get(i))
            .map(|(hs, _)| common(hs, hashes))
            .max()
            .unwrap_or(0)
    }

    /// In-flight requests on the pod whose prompt holds all of `prefix` (with chained hashes:
    /// its last block).
    pub fn holders(&self, pod: PodId, prefix: &[u64]) -> u32 {
        self.pods
            .get(&pod)
            .map_or(0, |p| p.sharing(prefix).len() as u32)
    }

    pub fn add(&mut self, pod: PodId, request: u64, hashes: Vec<u64>, now: u64) {
        let p = self.pods.entry(pod).or_default();
        if p.requests.contains_key(&request) {
            return;
        }
        p.dispatched += 1;
        self.dispatched += 1;
        let hashes = Rc::new(hashes);
        if let Err(at) = p.position(&hashes, request) {
            p.order.insert(at, (hashes.clone(), request));
        }
        p.requests.insert(request, (hashes, now));
    }

    /// The dispatches to the pod this VM has seen so far, its own and the pick log's.
    pub fn dispatched(&self, pod: PodId) -> u64 {
        self.pods.get(&pod).map_or(0, |p| p.dispatched)
    }

    /// The same, to every pod.
    pub fn dispatched_in_all(&self) -> u64 {
        self.dispatched
    }

    /// In-flight requests on the pod whose prompt holds the first `depth` blocks of `hashes`, in
    /// id order: who a request sharing that prefix may lean on, as this replica knows it. The
    /// pod's record decides which of them is still in flight (`Router::route`).
    pub fn holding(&self, pod: PodId, hashes: &[u64], depth: usize) -> Vec<u64> {
        let (Some(p), Some(prefix)) = (self.pods.get(&pod), hashes.get(..depth)) else {
            return Vec::new();
        };
        if prefix.is_empty() {
            return Vec::new();
        }
        let mut ids: Vec<u64> = p
            .order
            .get(p.sharing(prefix))
            .unwrap_or_default()
            .iter()
            .map(|(_, id)| *id)
            .collect();
        ids.sort_unstable();
        ids
    }

    pub fn hashes_of(&self, pod: PodId, request: u64) -> Option<Vec<u64>> {
        Some(self.pods.get(&pod)?.requests.get(&request)?.0.to_vec())
    }

    pub fn remove(&mut self, pod: PodId, request: u64) {
        let Some(p) = self.pods.get_mut(&pod) else {
            return;
        };
        let Some((hashes, _)) = p.requests.remove(&request) else {
            return;
        };
        if let Ok(at) = p.position(&hashes, request) {
            p.order.remove(at);
        }
    }

    /// Drops requests the shared record no longer lists (after a grace period, since the log and
    /// the record are written one after the other).
    pub fn prune(&mut self, pod: PodId, is_live: impl Fn(u64) -> bool, now: u64) {
        let Some(p) = self.pods.get(&pod) else {
            return;
        };
        let dead: Vec<u64> = p
            .requests
            .iter()
            .filter(|(id, (_, at))| now.saturating_sub(*at) >= ORPHAN_MS && !is_live(**id))
            .map(|(id, _)| *id)
            .collect();
        for id in dead {
            self.remove(pod, id);
        }
    }

    pub fn retain_pods(&mut self, keep: impl Fn(PodId) -> bool) {
        self.pods.retain(|pod, _| keep(*pod));
    }

    /// Distinct blocks the pod's in-flight requests hold: each request's, less what it shares
    /// with the one before it in the order (the router's tests check the replica empties).
    #[cfg(test)]
    pub fn unique_blocks(&self, pod: PodId) -> usize {
        self.pods.get(&pod).map_or(0, |p| {
            let mut before: &[u64] = &[];
            p.order
                .iter()
                .map(|(hs, _)| {
                    let new = hs.len() - common(hs, before);
                    before = hs;
                    new
                })
                .sum()
        })
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    fn pod(name: &str) -> PodId {
        PodId::of(name)
    }

    #[test]
    fn shared_prefix_counts_once_and_its_holders_are_known() {
        let mut a = ActiveBlocks::default();
        a.add(pod("p"), 1, vec![10, 11, 12], 0);
        assert_eq!(a.active_prefix(pod("p"), &[10, 11, 99]), 2);
        a.add(pod("p"), 2, vec![10, 11, 99], 0);
        assert_eq!(a.unique_blocks(pod("p")), 4);
        assert_eq!(a.holding(pod("p"), &[10, 11, 99], 2), vec![1, 2]);
        assert_eq!(a.holding(pod("p"), &[10, 11, 99], 3), vec![2]);
        assert_eq!(a.holding(pod("p"), &[10, 11, 99], 0), Vec::<u64>::new());
        a.remove(pod("p"), 1);
        assert_eq!(a.unique_blocks(pod("p")), 3);
        assert_eq!(a.holding(pod("p"), &[10, 11, 12], 2), vec![2]);
        a.remove(pod("p"), 2);
        a.remove(pod("p"), 2);
        assert_eq!(a.unique_blocks(pod("p")), 0);
        // Every dispatch counts once, a replayed one seen twice once, whatever has ended since.
        a.add(pod("p"), 3, vec![10], 0);
        a.add(pod("p"), 3, vec![10], 0);
        a.add(pod("q"), 4, vec![10], 0);
        assert_eq!((a.dispatched(pod("p")), a.dispatched(pod("q"))), (3, 1));
        assert_eq!(a.dispatched_in_all(), 4);
    }

    /// Chained hashes of a prompt of `blocks` blocks drawn from a few texts per block, so that
    /// prompts share prefixes of every length: each block's hash covers its text and the
    /// hash before it, as `routing::prefix` chains them.
    fn chain(rng: &mut u64, blocks: usize) -> Vec<u64> {
        let mut h = 0u64;
        (0..blocks)
            .map(|_| {
                *rng ^= *rng << 13;
                *rng ^= *rng >> 7;
                *rng ^= *rng << 17;
                h = crate::hash::chain(h, &(*rng % 3).to_le_bytes());
                h
            })
            .collect()
    }

    #[test]
    fn every_answer_is_what_the_requests_themselves_give() {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut a = ActiveBlocks::default();
        let mut live: Vec<(u64, Vec<u64>)> = Vec::new();
        for step in 0..3_000u64 {
            if live.len() > 40 || (!live.is_empty() && step % 3 == 0) {
                let (id, _) = live.swap_remove((rng % live.len() as u64) as usize);
                a.remove(pod("p"), id);
            } else {
                let blocks = 1 + (rng % 9) as usize;
                let hs = chain(&mut rng, blocks);
                a.add(pod("p"), step, hs.clone(), 0);
                live.push((step, hs));
            }
            let blocks = 1 + (rng % 9) as usize;
            let q = chain(&mut rng, blocks);
            let shared = |hs: &[u64]| common(hs, &q);
            let prefix = live.iter().map(|(_, hs)| shared(hs)).max().unwrap_or(0);
            assert_eq!(a.active_prefix(pod("p"), &q), prefix);
            for depth in 0..=q.len() {
                let mut ids: Vec<u64> = live
                    .iter()
                    .filter(|(_, hs)| depth > 0 && shared(hs) >= depth)
                    .map(|(id, _)| *id)
                    .collect();
                ids.sort_unstable();
                if depth > 0 {
                    assert_eq!(a.holders(pod("p"), &q[..depth]), ids.len() as u32);
                }
                assert_eq!(a.holding(pod("p"), &q, depth), ids);
            }
            let distinct: hashbrown::HashSet<u64> =
                live.iter().flat_map(|(_, hs)| hs.iter().copied()).collect();
            assert_eq!(a.unique_blocks(pod("p")), distinct.len());
        }
    }

    #[test]
    fn orphans_are_pruned_after_grace() {
        let mut a = ActiveBlocks::default();
        a.add(pod("p"), 1, vec![1], 0);
        a.add(pod("p"), 2, vec![2], 0);
        a.prune(pod("p"), |id| id == 2, ORPHAN_MS - 1);
        assert_eq!(a.unique_blocks(pod("p")), 2);
        a.prune(pod("p"), |id| id == 2, ORPHAN_MS);
        assert_eq!(a.unique_blocks(pod("p")), 1);
        a.retain_pods(|_| false);
        assert_eq!(a.unique_blocks(pod("p")), 0);
    }
}
