//! A pod's token budget and whether a reservation fits it. By default the budget is the engine's
//! own KV capacity (`num_gpu_blocks × block_size`, from its metrics) times a utilisation target;
//! a configured value overrides it. Until a pod's first scrape says how large it is, it takes one
//! request at a time (kvgate will not guess, and will not flood a pod it knows nothing of); a pod
//! whose metrics carry no capacity, or any pod when nothing is scraped, is not limited.

use crate::config::Config;
use crate::pod_state::Snapshot;

pub fn budget_tokens(cfg: &Config, snapshot: Option<&Snapshot>) -> Option<u64> {
    let a = &cfg.admission;
    if !a.enabled {
        return None;
    }
    if a.budget_tokens > 0 {
        return Some(a.budget_tokens);
    }
    match snapshot {
        Some(s) if s.capacity_tokens > 0 => Some((s.capacity_tokens as f64 * a.utilization) as u64),
        Some(s) if s.healthy => None,
        _ if cfg.metrics.cluster.is_empty() => None,
        // Not scraped yet (or down): room for one request, which `fits` always allows alone.
        _ => Some(0),
    }
}

/// A reservation fits when it stays within the budget, or when the pod has nothing reserved: a
/// request larger than any budget still runs, alone, rather than waiting forever.
pub fn fits(reserved: u64, cost: u64, budget: Option<u64>) -> bool {
    budget.is_none_or(|b| reserved == 0 || reserved.saturating_add(cost) <= b)
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    #[test]
    fn derived_configured_unknown_or_unlimited() {
        let mut cfg = Config::default();
        cfg.metrics.cluster = "kvgate_metrics".into();
        let snap = Snapshot {
            healthy: true,
            capacity_tokens: 1000,
            ..Snapshot::default()
        };
        assert_eq!(budget_tokens(&cfg, Some(&snap)), Some(900));
        assert_eq!(
            budget_tokens(&cfg, None),
            Some(0),
            "not scraped yet: one at a time"
        );
        let no_capacity = Snapshot {
            healthy: true,
            ..Snapshot::default()
        };
        assert_eq!(budget_tokens(&cfg, Some(&no_capacity)), None);
        cfg.admission.budget_tokens = 50;
        assert_eq!(budget_tokens(&cfg, Some(&snap)), Some(50));
        cfg.admission.enabled = false;
        assert_eq!(budget_tokens(&cfg, Some(&snap)), None);
        let unscraped = Config::default();
        assert_eq!(budget_tokens(&unscraped, None), None);
    }

    #[test]
    fn fits_within_budget_or_alone() {
        assert!(fits(0, 10, Some(5)), "alone it always fits");
        assert!(fits(5, 5, Some(10)));
        assert!(!fits(6, 5, Some(10)));
        assert!(fits(u64::MAX, 5, None));
        assert!(!fits(u64::MAX, 5, Some(10)));
    }
}
