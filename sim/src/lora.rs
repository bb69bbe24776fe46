//! LoRA adapter residency on one pod, as vLLM's worker keeps it
//! (`vllm/lora/worker_manager.py` `LRUCacheWorkerLoRAManager.add_adapter`,
//! `vllm/lora/models.py` `LRUCacheLoRAModelManager`): two LRU tiers, adapters
//! loaded from disk into a host cache of `max_cpu_loras`, and host adapters
//! activated into `max_loras` GPU slots. Every step touches (or loads and
//! activates) each adapter of its batch, so the least recently batched one is
//! the one evicted.

/// Engine-side adapter id (vLLM's `lora_int_id`, never 0).
pub type LoraId = u32;

/// The adapter a request runs with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraRef {
    pub id: LoraId,
    /// Part of every block hash (prefix caching is per adapter).
    pub name: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoraConfig {
    /// GPU slots: the most distinct adapters one batch may use.
    pub max_loras: usize,
    /// Host (CPU) cache of loaded adapters; vLLM defaults it to `max_loras`.
    pub max_cpu_loras: usize,
}

/// Append `id` to an ordered set of adapters unless it is already there.
pub fn add_distinct(set: &mut Vec<LoraId>, id: LoraId) {
    if !set.contains(&id) {
        set.push(id);
    }
}

/// Adapters held in one tier, least recently used first (a handful of
/// entries, so a vector beats a linked map).
#[derive(Debug, Clone)]
struct Lru {
    cap: usize,
    ids: Vec<LoraId>,
}

impl Lru {
    fn new(cap: usize) -> Self {
        Lru {
            cap,
            ids: Vec::with_capacity(cap),
        }
    }

    /// Mark `id` most recently used; false when it is not held.
    fn touch(&mut self, id: LoraId) -> bool {
        match self.ids.iter().position(|&x| x == id) {
            Some(i) => {
                self.ids.remove(i);
                self.ids.push(id);
                true
            }
            None => false,
        }
    }

    /// Add `id` as most recently used; returns the adapter evicted to make room.
    fn insert(&mut self, id: LoraId) -> Option<LoraId> {
        let evicted =
            (self.ids.len() >= self.cap && !self.ids.is_empty()).then(|| self.ids.remove(0));
        self.ids.push(id);
        evicted
    }

    fn remove(&mut self, id: LoraId) {
        self.ids.retain(|&x| x != id);
    }
}

/// What making one adapter resident cost: a load from disk into the host
/// cache, an activation (host to GPU copy) into a slot, or neither.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Residency {
    pub loads: usize,
    pub activations: usize,
}

impl std::ops::AddAssign for Residency {
    fn add_assign(&mut self, o: Residency) {
        self.loads += o.loads;
        self.activations += o.activations;
    }
}

#[derive(Debug, Clone)]
pub struct AdapterCache {
    host: Lru,
    gpu: Lru,
}

impl AdapterCache {
    pub fn new(cfg: LoraConfig) -> Self {
        AdapterCache {
            host: Lru::new(cfg.max_cpu_loras.max(cfg.max_loras)),
            gpu: Lru::new(cfg.max_loras),
        }
    }

    /// Make `id` usable by the next step: load it into the host cache if it is
    /// not there (evicting the least recently used adapter, which also leaves
    /// its GPU slot, as `remove_oldest_adapter` deactivates it), then activate
    /// it into a GPU slot if it has none (evicting the least recently used slot).
    pub fn ensure(&mut self, id: LoraId) -> Residency {
        let mut r = Residency::default();
        if !self.host.touch(id) {
            if let Some(old) = self.host.insert(id) {
                self.gpu.remove(old);
            }
            r.loads = 1;
        }
        if !self.gpu.touch(id) {
            self.gpu.insert(id);
            r.activations = 1;
        }
        r
    }

    /// Drop `id` from both tiers (the adapter was unloaded or replaced).
    pub fn remove(&mut self, id: LoraId) {
        self.host.remove(id);
        self.gpu.remove(id);
    }

    /// Adapters in GPU slots, least recently used first.
    pub fn active(&self) -> &[LoraId] {
        &self.gpu.ids
    }

    /// Adapters in the host cache, least recently used first.
    pub fn loaded(&self) -> &[LoraId] {
        &self.host.ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_adapter_is_loaded_and_activated_once_then_stays_resident() {
        let mut c = AdapterCache::new(LoraConfig {
            max_loras: 2,
            max_cpu_loras: 2,
        });
        assert_eq!(
            c.ensure(1),
            Residency {
                loads: 1,
                activations: 1
            }
        );
        assert_eq!(c.ensure(1), Residency::default());
        assert_eq!(c.active(), &[1]);
    }

    #[test]
    fn the_least_recently_used_adapter_is_evicted_from_both_tiers() {
        let mut c = AdapterCache::new(LoraConfig {
            max_loras: 2,
            max_cpu_loras: 2,
        });
        c.ensure(1);
        c.ensure(2);
        c.ensure(1); // 2 is now the least recently used
        assert_eq!(c.ensure(3).loads, 1);
        assert_eq!(c.loaded(), &[1, 3]);
        assert_eq!(c.active(), &[1, 3]);
        assert_eq!(c.ensure(2).loads, 1, "an evicted adapter is loaded again");
    }

    #[test]
    fn a_larger_host_cache_turns_a_reload_into_a_cheap_activation() {
        let mut c = AdapterCache::new(LoraConfig {
            max_loras: 1,
            max_cpu_loras: 3,
        });
        c.ensure(1);
        c.ensure(2);
        assert_eq!(c.active(), &[2]);
        assert_eq!(
            c.ensure(1),
            Residency {
                loads: 0,
                activations: 1
            }
        );
        c.remove(1);
        assert_eq!(
            c.ensure(1).loads,
            1,
            "a removed adapter must be loaded again"
        );
    }
}
