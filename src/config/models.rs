//! The `models` section: which models pods serve, adapter affinity, renames and weighted splits
//! (docs/configuration.md; `models` for what is done with it).

use super::{invalid, ConfigError, MAX_DURATION_MS};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Many models behind one gateway: which pods serve what (their `/v1/models`), adapter affinity,
/// public names mapped to target models with weights, and per-model defaults (docs/design.md,
/// *Models and adapters*).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ModelsConfig {
    /// Path of each pod's OpenAI model list, fetched through `metrics.cluster`; empty turns model
    /// scraping off (every pod is taken to serve every model).
    pub path: String,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    /// Request header kvgate sets to the model the request is sent with (after any rename), for
    /// Envoy routes to match on; empty sets none.
    pub header: String,
    /// Pick cost of a pod where the request's adapter is neither running nor among its recently
    /// used ones, so it must be loaded before the first step (the pick's unit: one prompt block to
    /// compute costs `routing.prefillWeight`).
    pub adapter_load_cost: f64,
    /// Further cost when every adapter slot (`max_lora`) of the pod is taken by running adapters:
    /// the request waits for a slot, then evicts an adapter others may want.
    pub adapter_slot_cost: f64,
    /// Public model names: each rewritten to one of its targets, and its default priority band.
    pub routes: BTreeMap<String, ModelRoute>,
}

impl Default for ModelsConfig {
    fn default() -> Self {
        Self {
            path: "/v1/models".into(),
            interval_ms: 10_000,
            timeout_ms: 1_000,
            header: "x-gateway-model-name".into(),
            adapter_load_cost: 160.0,
            adapter_slot_cost: 400.0,
            routes: BTreeMap::new(),
        }
    }
}

/// One public model name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ModelRoute {
    /// The models the name is rewritten to, by weight; empty keeps the name.
    pub targets: Vec<ModelTarget>,
    /// Priority band of its requests when the client sets none (`admission.defaultPriority` else).
    pub priority: Option<i32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModelTarget {
    pub model: String,
    /// A share of the name's traffic, relative to its other targets' weights.
    pub weight: u32,
}

impl ModelsConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let e = |field: &str, reason: &str| Err(invalid(&format!("models.{field}"), reason));
        if !self.path.is_empty() && !self.path.starts_with('/') {
            return e("path", "must be empty or start with /");
        }
        if self.interval_ms == 0 || self.timeout_ms == 0 {
            return e("intervalMs", "intervals and timeouts must be > 0");
        }
        if self.interval_ms > MAX_DURATION_MS || self.timeout_ms > MAX_DURATION_MS {
            return e("intervalMs", "must be at most 604800000 (7 days)");
        }
        if self
            .header
            .bytes()
            .any(|b| !is_token_byte(b) || b.is_ascii_uppercase())
        {
            return e(
                "header",
                "a header name must be lower case, without spaces or separators",
            );
        }
        for (name, w) in [
            ("adapterLoadCost", self.adapter_load_cost),
            ("adapterSlotCost", self.adapter_slot_cost),
        ] {
            if !(w.is_finite() && w >= 0.0) {
                return e(name, "must be a finite number >= 0");
            }
        }
        for (name, route) in &self.routes {
            let field = format!("routes.{name}");
            if !is_model_name(name) {
                return e(&field, "a model name must be 1 to 256 visible characters");
            }
            for (i, t) in route.targets.iter().enumerate() {
                if !is_model_name(&t.model) {
                    return e(
                        &format!("{field}.targets[{i}].model"),
                        "a model name must be 1 to 256 visible characters",
                    );
                }
            }
            let total: u64 = route.targets.iter().map(|t| u64::from(t.weight)).sum();
            if !route.targets.is_empty() && total == 0 {
                return e(&format!("{field}.targets"), "the weights must not all be 0");
            }
        }
        Ok(())
    }
}

/// A model name kvgate can pass on: what request parsing accepts, without control characters
/// (it is written into a header and a stat name).
fn is_model_name(s: &str) -> bool {
    !s.is_empty() && s.chars().count() <= 256 && !s.chars().any(char::is_control)
}

/// A byte of an HTTP header name (RFC 9110 `tchar`).
fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}
