//! Adapter affinity: which LoRA adapters each pod has resident as far as this VM can tell, and
//! what running a request's adapter there costs. A pod runs at most `max_lora` distinct adapters
//! in one batch and keeps the most recently used ones in its slots (vLLM's LRU adapter manager);
//! a request whose adapter is not resident waits for its load before its first token, and one
//! whose adapter finds every slot taken by running adapters waits for a slot as well (Gateway API
//! Inference Extension's LoRA affinity scorer, kthena's LoRA-aware scoring).
//!
//! This is each VM's replica, fed like the prefix index by its own picks and the pick log: per
//! pod, the adapter of each in-flight request and the adapters used most recently. The scraped
//! `vllm:lora_requests_info` (`models::served`) adds what other traffic runs there. Approximate by
//! design: nothing that must return to zero depends on it.

use crate::config::ModelsConfig;
use crate::models::served::LoraState;
use crate::routing::pod_id::{PodId, PodMap};
use hashbrown::HashMap;

/// Requests seen in the log but absent from the pod's shared record for this long are dropped
/// (their finish was lost, or their VM died).
const ORPHAN_MS: u64 = 5_000;
/// Distinct recently used adapters remembered per pod: more than any engine's slots.
const MAX_RECENT: usize = 64;

#[derive(Default)]
struct PodAdapters {
    /// In-flight request → (its adapter, when it was dispatched).
    running: HashMap<u64, (u64, u64)>,
    /// Distinct adapters, least recently used first.
    recent: Vec<u64>,
}

impl PodAdapters {
    fn touch(&mut self, adapter: u64) {
        self.recent.retain(|&a| a != adapter);
        if self.recent.len() >= MAX_RECENT {
            self.recent.remove(0);
        }
        self.recent.push(adapter);
    }
}

/// Where a request's adapter stands on a pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    /// Running there, or among the adapters it used last (still in a slot): no load.
    Resident,
    /// Not resident, but a slot is free of running adapters: it is loaded before the first step.
    FreeSlot,
    /// Every slot is taken by running adapters: the request waits for one, then loads.
    NoSlot,
}

impl Fit {
    /// The pick's adapter term.
    pub fn cost(self, cfg: &ModelsConfig) -> f64 {
        match self {
            Fit::Resident => 0.0,
            Fit::FreeSlot => cfg.adapter_load_cost,
            Fit::NoSlot => cfg.adapter_load_cost + cfg.adapter_slot_cost,
        }
    }
}

#[derive(Default)]
pub struct Adapters {
    pods: PodMap<PodAdapters>,
}

impl Adapters {
    /// A request with `adapter` (0: none) was dispatched to `pod`.
    pub fn dispatch(&mut self, pod: PodId, request: u64, adapter: u64, now: u64) {
        if adapter == 0 {
            return;
        }
        let p = self.pods.entry(pod).or_default();
        p.running.insert(request, (adapter, now));
        p.touch(adapter);
    }

    /// The adapter a request in flight on `pod` runs (0: none, or not known here).
    pub fn adapter_of(&self, pod: PodId, request: u64) -> u64 {
        self.pods
            .get(&pod)
            .and_then(|p| p.running.get(&request))
            .map_or(0, |&(adapter, _)| adapter)
    }

    /// The request ended; its adapter stays resident until others displace it.
    pub fn finish(&mut self, pod: PodId, request: u64) {
        if let Some(p) = self.pods.get_mut(&pod) {
            if let Some((adapter, _)) = p.running.remove(&request) {
                p.touch(adapter);
            }
        }
    }

    /// Forgets requests the pod's shared record no longer holds, after a grace period.
    pub fn prune(&mut self, pod: PodId, is_live: impl Fn(u64) -> bool, now: u64) {
        if let Some(p) = self.pods.get_mut(&pod) {
            p.running
                .retain(|id, (_, at)| now.saturating_sub(*at) < ORPHAN_MS || is_live(*id));
        }
    }

    pub fn retain_pods(&mut self, keep: impl Fn(PodId) -> bool) {
        self.pods.retain(|pod, _| keep(*pod));
    }

    /// Where `adapter` stands on `pod`, given the pod's scraped adapter state (when fresh).
    pub fn fit(&self, pod: PodId, adapter: u64, scraped: Option<&LoraState>) -> Fit {
        let p = self.pods.get(&pod);
        let mut running: Vec<u64> = scraped.map_or_else(Vec::new, |l| l.running.clone());
        for (a, _) in p.iter().flat_map(|p| p.running.values()) {
            if !running.contains(a) {
                running.push(*a);
            }
        }
        let slots = scraped.map_or(0, |l| l.max_lora as usize);
        // Without a scraped slot count, only the last adapter used is taken to be resident.
        let kept = slots.max(1);
        let recent = p.map_or(&[][..], |p| {
            &p.recent[p.recent.len().saturating_sub(kept)..]
        });
        if running.contains(&adapter) || recent.contains(&adapter) {
            Fit::Resident
        } else if slots > 0 && running.len() >= slots {
            Fit::NoSlot
        } else {
            Fit::FreeSlot
        }
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

    fn slots(max_lora: u32, running: Vec<u64>) -> LoraState {
        LoraState {
            at_ms: 0,
            max_lora,
            running,
            waiting: vec![],
        }
    }

    #[test]
    fn running_then_recent_adapters_are_resident_and_full_slots_make_a_wait() {
        let mut a = Adapters::default();
        let two = slots(2, vec![]);
        assert_eq!(
            a.fit(pod("p"), 7, Some(&two)),
            Fit::FreeSlot,
            "nothing known"
        );
        a.dispatch(pod("p"), 1, 7, 0);
        a.dispatch(pod("p"), 2, 8, 0);
        assert_eq!(a.fit(pod("p"), 7, Some(&two)), Fit::Resident);
        assert_eq!(
            a.fit(pod("p"), 9, Some(&two)),
            Fit::NoSlot,
            "7 and 8 hold both slots"
        );
        a.finish(pod("p"), 1);
        a.finish(pod("p"), 2);
        assert_eq!(
            a.fit(pod("p"), 7, Some(&two)),
            Fit::Resident,
            "still in its slot"
        );
        assert_eq!(a.fit(pod("p"), 9, Some(&two)), Fit::FreeSlot);
        a.dispatch(pod("p"), 3, 9, 0);
        a.finish(pod("p"), 3);
        assert_eq!(
            a.fit(pod("p"), 7, Some(&two)),
            Fit::FreeSlot,
            "evicted by 8 and 9"
        );
        assert_eq!(
            a.fit(pod("q"), 7, Some(&slots(1, vec![5]))),
            Fit::NoSlot,
            "other traffic's adapter, as scraped"
        );
        assert_eq!(a.fit(pod("q"), 5, Some(&slots(1, vec![5]))), Fit::Resident);
        a.dispatch(pod("q"), 4, 0, 0);
        assert_eq!(
            a.fit(pod("q"), 7, None),
            Fit::FreeSlot,
            "a base-model request holds no slot"
        );
    }

    #[test]
    fn orphans_are_pruned_after_the_grace_period() {
        let mut a = Adapters::default();
        let one = slots(1, vec![]);
        a.dispatch(pod("p"), 1, 7, 0);
        a.prune(pod("p"), |_| false, ORPHAN_MS - 1);
        assert_eq!(a.fit(pod("p"), 8, Some(&one)), Fit::NoSlot);
        a.prune(pod("p"), |_| false, ORPHAN_MS);
        assert_eq!(a.fit(pod("p"), 8, Some(&one)), Fit::FreeSlot);
        let cfg = ModelsConfig::default();
        assert_eq!(
            Fit::NoSlot.cost(&cfg),
            cfg.adapter_load_cost + cfg.adapter_slot_cost
        );
        a.retain_pods(|_| false);
        assert_eq!(a.fit(pod("p"), 7, Some(&one)), Fit::FreeSlot);
    }
}
