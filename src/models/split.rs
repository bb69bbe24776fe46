//! Public model names and the target models they are sent as: a rename (one target) or a weighted
//! split (several, e.g. 90 % `llama-3.1-8b`, 10 % `llama-3.1-8b-v2`), as the Gateway API Inference
//! Extension's InferenceModel target models and kthena's ModelRoute weights do.
//!
//! Each VM deals its requests by smooth weighted round robin (nginx's algorithm): over any run of
//! `total weight` requests every target gets exactly its weight, so the split holds within one
//! request per target and worker rather than within a random draw's spread. A request that names a
//! session goes by a hash of the session instead, so a conversation stays on one target.
//!
//! Source of truth: the configuration (`models.routes`). The round-robin credits are per VM and
//! die with it.

use crate::config::ModelRoute;
use hashbrown::HashMap;
use std::collections::BTreeMap;

#[derive(Default)]
pub struct Split {
    /// Per public name, each target's current credit.
    credit: HashMap<String, Vec<i64>>,
}

impl Split {
    /// The model a request for `model` is sent as: a target of its route, or `None` when the
    /// name has no targets configured (it is sent as it is).
    pub fn choose<'c>(
        &mut self,
        routes: &'c BTreeMap<String, ModelRoute>,
        model: &str,
        session: Option<u64>,
    ) -> Option<&'c str> {
        let targets = &routes.get(model)?.targets;
        let weights: Vec<i64> = targets.iter().map(|t| i64::from(t.weight)).collect();
        let total: i64 = weights.iter().sum();
        if total <= 0 {
            return None;
        }
        let index = match session {
            Some(s) => {
                let mut point = (s % total as u64) as i64;
                weights
                    .iter()
                    .position(|&w| {
                        point -= w;
                        point < 0
                    })
                    .unwrap_or(0)
            }
            None => {
                let credit = self
                    .credit
                    .entry_ref(model)
                    .or_insert_with(|| vec![0; weights.len()]);
                credit.resize(weights.len(), 0);
                let mut best = 0;
                for (i, w) in weights.iter().enumerate() {
                    credit[i] += w;
                    if credit[i] > credit[best] {
                        best = i;
                    }
                }
                credit[best] -= total;
                best
            }
        };
        targets.get(index).map(|t| t.model.as_str())
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::config::ModelTarget;

    fn routes() -> BTreeMap<String, ModelRoute> {
        let target = |model: &str, weight| ModelTarget {
            model: model.into(),
            weight,
        };
        BTreeMap::from([
            (
                "llama".to_string(),
                ModelRoute {
                    targets: vec![target("v1", 90), target("v2", 10), target("off", 0)],
                    priority: None,
                },
            ),
            ("plain".to_string(), ModelRoute::default()),
        ])
    }

    #[test]
    fn a_split_deals_exactly_its_weights_over_each_round() {
        let (routes, mut split) = (routes(), Split::default());
        let mut counts: HashMap<&str, u32> = HashMap::new();
        for _ in 0..200 {
            *counts
                .entry(split.choose(&routes, "llama", None).unwrap())
                .or_default() += 1;
        }
        assert_eq!((counts["v1"], counts["v2"]), (180, 20));
        assert!(!counts.contains_key("off"), "a zero weight gets nothing");
        assert_eq!(
            split.choose(&routes, "plain", None),
            None,
            "no targets: kept"
        );
        assert_eq!(split.choose(&routes, "other", None), None);
    }

    #[test]
    fn a_session_stays_on_one_target_and_sessions_split_by_weight() {
        let (routes, mut split) = (routes(), Split::default());
        let first = split.choose(&routes, "llama", Some(12_345));
        assert!((0..10).all(|_| split.choose(&routes, "llama", Some(12_345)) == first));
        let v2 = (0..1000u64)
            .filter(|s| {
                split.choose(&routes, "llama", Some(s.wrapping_mul(0x9e37_79b9))) == Some("v2")
            })
            .count();
        assert!((60..140).contains(&v2), "{v2}");
    }
}
