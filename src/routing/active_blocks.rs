//! Which prompt blocks in-flight requests occupy on each pod (NVIDIA Dynamo's predicted active
//! blocks): a request's prompt blocks are added at dispatch and removed when it ends; a block held
//! by several in-flight requests counts once. This is each VM's replica of block membership, fed
//! by its own dispatches and the pick log. The counts that must return to zero live in the shared
//! pod record (`pods::record`); this replica only says which blocks are already active, so a new
//! request is charged for the blocks it adds, and which requests it may lean on for the rest. The
//! record decides who counts a shared prefix (`RequestEntry::leans_on`): this replica may still
//! hold a request another worker has finished.

use hashbrown::HashMap;

/// Requests seen in the log but absent from the pod's shared record for this long are dropped
/// (their finish was lost, or their VM died).
const ORPHAN_MS: u64 = 5_000;

#[derive(Default)]
struct PodActive {
    refs: HashMap<u64, u32>,
    requests: HashMap<u64, (Vec<u64>, u64)>,
}

#[derive(Default)]
pub struct ActiveBlocks {
    pods: HashMap<String, PodActive>,
}

impl ActiveBlocks {
    /// Leading blocks of `hashes` already held by in-flight requests on the pod.
    pub fn active_prefix(&self, pod: &str, hashes: &[u64]) -> usize {
        let Some(p) = self.pods.get(pod) else {
            return 0;
        };
        hashes
            .iter()
            .take_while(|h| p.refs.contains_key(*h))
            .count()
    }

    /// In-flight requests on the pod whose prompt holds the block (with chained hashes: its
    /// whole prefix up to there).
    pub fn holders(&self, pod: &str, block: u64) -> u32 {
        self.pods
            .get(pod)
            .and_then(|p| p.refs.get(&block))
            .copied()
            .unwrap_or(0)
    }

    pub fn add(&mut self, pod: &str, request: u64, hashes: Vec<u64>, now: u64) {
        let p = self.pods.entry_ref(pod).or_default();
        if p.requests.contains_key(&request) {
            return;
        }
        for h in &hashes {
            *p.refs.entry(*h).or_insert(0) += 1;
        }
        p.requests.insert(request, (hashes, now));
    }

    /// In-flight requests on the pod whose prompt holds the first `depth` blocks of `hashes` (with
    /// chained hashes, those holding its block `depth - 1` there), in id order: who a request
    /// sharing that prefix may lean on, as this replica knows it. The pod's record decides which
    /// of them is still in flight (`Router::route`).
    pub fn holding(&self, pod: &str, hashes: &[u64], depth: usize) -> Vec<u64> {
        let (Some(p), Some(deepest)) = (self.pods.get(pod), depth.checked_sub(1)) else {
            return Vec::new();
        };
        let Some(&block) = hashes.get(deepest) else {
            return Vec::new();
        };
        let mut ids: Vec<u64> = p
            .requests
            .iter()
            .filter(|(_, (hs, _))| hs.get(deepest) == Some(&block))
            .map(|(id, _)| *id)
            .collect();
        ids.sort_unstable();
        ids
    }

    pub fn hashes_of(&self, pod: &str, request: u64) -> Option<Vec<u64>> {
        Some(self.pods.get(pod)?.requests.get(&request)?.0.clone())
    }

    pub fn remove(&mut self, pod: &str, request: u64) {
        let Some(p) = self.pods.get_mut(pod) else {
            return;
        };
        let Some((hashes, _)) = p.requests.remove(&request) else {
            return;
        };
        for h in hashes {
            // One lookup per block, whether its count drops or the block goes.
            if let hashbrown::hash_map::Entry::Occupied(mut n) = p.refs.entry(h) {
                *n.get_mut() -= 1;
                if *n.get() == 0 {
                    n.remove();
                }
            }
        }
    }

    /// Drops requests the shared record no longer lists (after a grace period, since the log and
    /// the record are written one after the other).
    pub fn prune(&mut self, pod: &str, is_live: impl Fn(u64) -> bool, now: u64) {
        let Some(p) = self.pods.get(pod) else {
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

    pub fn retain_pods(&mut self, keep: impl Fn(&str) -> bool) {
        self.pods.retain(|pod, _| keep(pod));
    }

    pub fn unique_blocks(&self, pod: &str) -> usize {
        self.pods.get(pod).map_or(0, |p| p.refs.len())
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    #[test]
    fn shared_prefix_counts_once_and_its_holders_are_known() {
        let mut a = ActiveBlocks::default();
        a.add("p", 1, vec![10, 11, 12], 0);
        assert_eq!(a.active_prefix("p", &[10, 11, 99]), 2);
        a.add("p", 2, vec![10, 11, 99], 0);
        assert_eq!(a.unique_blocks("p"), 4);
        assert_eq!(a.holding("p", &[10, 11, 99], 2), vec![1, 2]);
        assert_eq!(a.holding("p", &[10, 11, 99], 3), vec![2]);
        assert_eq!(a.holding("p", &[10, 11, 99], 0), Vec::<u64>::new());
        a.remove("p", 1);
        assert_eq!(a.unique_blocks("p"), 3);
        assert_eq!(a.holding("p", &[10, 11, 12], 2), vec![2]);
        a.remove("p", 2);
        a.remove("p", 2);
        assert_eq!(a.unique_blocks("p"), 0);
    }

    #[test]
    fn orphans_are_pruned_after_grace() {
        let mut a = ActiveBlocks::default();
        a.add("p", 1, vec![1], 0);
        a.add("p", 2, vec![2], 0);
        a.prune("p", |id| id == 2, ORPHAN_MS - 1);
        assert_eq!(a.unique_blocks("p"), 2);
        a.prune("p", |id| id == 2, ORPHAN_MS);
        assert_eq!(a.unique_blocks("p"), 1);
        a.retain_pods(|_| false);
        assert_eq!(a.unique_blocks("p"), 0);
    }
}
