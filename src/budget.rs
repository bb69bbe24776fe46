//! A pod's token budget and whether a reservation fits it. By default the budget is the engine's
//! own KV capacity (`num_gpu_blocks × block_size`, from its metrics) times a utilisation target;
//! a configured value overrides it; a pod with neither is not limited (kvgate will not guess).

use crate::config::AdmissionConfig;
use crate::pod_state::Snapshot;

pub fn budget_tokens(cfg: &AdmissionConfig, snapshot: Option<&Snapshot>) -> Option<u64> {
    if !cfg.enabled {
        return None;
    }
    if cfg.budget_tokens > 0 {
        return Some(cfg.budget_tokens);
    }
    snapshot
        .filter(|s| s.capacity_tokens > 0)
        .map(|s| (s.capacity_tokens as f64 * cfg.utilization) as u64)
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
    fn derived_configured_or_unlimited() {
        let cfg = AdmissionConfig::default();
        let snap = Snapshot {
            capacity_tokens: 1000,
            ..Snapshot::default()
        };
        assert_eq!(budget_tokens(&cfg, Some(&snap)), Some(900));
        assert_eq!(budget_tokens(&cfg, None), None);
        let fixed = AdmissionConfig {
            budget_tokens: 50,
            ..AdmissionConfig::default()
        };
        assert_eq!(budget_tokens(&fixed, Some(&snap)), Some(50));
        let off = AdmissionConfig {
            enabled: false,
            ..AdmissionConfig::default()
        };
        assert_eq!(budget_tokens(&off, Some(&snap)), None);
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
