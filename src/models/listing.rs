//! What the gateway answers to `GET /v1/models` (and `GET /v1/models/{id}`): every model the
//! pods behind it serve, from their lists as last read (`served`), and the public names of
//! `models.routes`. Passed on to one pod, as before, the answer was that pod's list alone: with
//! two models on two pods a client listing models saw one or the other, request by request.
//! GIE answers for the pool (its InferenceModel objects name what the gateway serves); vLLM's
//! and SGLang's own routers pass the request to one worker.
//!
//! Source of truth: the pods' model records (`served::Served`), read through the router's view.

use crate::config::ModelsConfig;
use crate::models::served::ServedModel;
use crate::openai::reply::LocalReply;
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// The OpenAI path of the list, and of one model's entry below it.
pub const PATH: &str = "/v1/models";

/// Which listing `path` asks for: `Some(None)` the list, `Some(Some(id))` one model's entry.
pub fn asks(path: &str) -> Option<Option<&str>> {
    let path = path.split(['?', '#']).next().unwrap_or_default();
    let rest = path.strip_prefix(PATH)?;
    match rest.strip_prefix('/') {
        None if rest.is_empty() => Some(None),
        Some(id) if !id.is_empty() && !id.contains('/') => Some(Some(id)),
        _ => None,
    }
}

/// One model's entry, as vLLM writes it (`parent` for a LoRA adapter's base model).
fn entry(id: &str, parent: Option<&str>, created_s: u64) -> Value {
    json!({
        "id": id,
        "object": "model",
        "created": created_s,
        "owned_by": "kvgate",
        "root": id,
        "parent": parent,
    })
}

/// The gateway's list: the pods' models (the first pod's entry for a name two pods list), then
/// the routes' public names no pod lists whose requests some pod serves (one of their targets),
/// sorted by name; `id` asks for one entry (404 when nothing listed names it). A route without
/// targets keeps its name, listed only where a pod lists it.
pub fn reply(
    served: &[ServedModel],
    models: &ModelsConfig,
    id: Option<&str>,
    now_ms: u64,
) -> LocalReply {
    let created = now_ms / 1_000;
    // By name, so each is listed once (the first pod's entry) and the list comes sorted.
    let mut entries: BTreeMap<&str, Option<&str>> = BTreeMap::new();
    for m in served {
        let parent = m.parent.as_deref().filter(|p| *p != m.id);
        entries.entry(m.id.as_str()).or_insert(parent);
    }
    let routes: Vec<&str> = models
        .routes
        .iter()
        .filter(|(name, route)| {
            !entries.contains_key(name.as_str())
                && route
                    .targets
                    .iter()
                    .any(|t| entries.contains_key(t.model.as_str()))
        })
        .map(|(name, _)| name.as_str())
        .collect();
    entries.extend(routes.into_iter().map(|name| (name, None)));
    let body = match id {
        None => json!({
            "object": "list",
            "data": entries.iter().map(|(id, parent)| entry(id, *parent, created)).collect::<Vec<_>>(),
        }),
        Some(id) => match entries.get_key_value(id) {
            Some((id, parent)) => entry(id, *parent, created),
            None => {
                return LocalReply::error(
                    404,
                    "model_not_found",
                    &format!(
                        "The model `{id}` does not exist: no model server behind this gateway serves it."
                    ),
                    Some("model"),
                )
            }
        },
    };
    LocalReply {
        status: 200,
        headers: vec![("content-type".into(), "application/json".into())],
        body: body.to_string().into_bytes(),
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::config::{ModelRoute, ModelTarget};

    fn model(id: &str, parent: Option<&str>) -> ServedModel {
        ServedModel {
            id: id.into(),
            parent: parent.map(str::to_string),
        }
    }

    #[test]
    fn the_paths_it_answers() {
        assert_eq!(asks("/v1/models"), Some(None));
        assert_eq!(asks("/v1/models?x=1"), Some(None));
        assert_eq!(asks("/v1/models/llama"), Some(Some("llama")));
        for other in [
            "/v1/models/",
            "/v1/models/a/b",
            "/v1/modelsx",
            "/v1/chat/completions",
        ] {
            assert_eq!(asks(other), None, "{other}");
        }
    }

    #[test]
    fn every_pods_models_and_the_routes_names_once_sorted() {
        let to = |model: &str| ModelRoute {
            targets: vec![ModelTarget {
                model: model.into(),
                weight: 1,
            }],
            priority: None,
        };
        let mut cfg = ModelsConfig::default();
        cfg.routes.insert("public".into(), to("a"));
        cfg.routes.insert("b".into(), to("a"));
        // Its targets served nowhere, or no targets (a priority band for a name pods list).
        cfg.routes.insert("nowhere".into(), to("gone"));
        cfg.routes.insert("banded".into(), ModelRoute::default());
        let served = [
            model("b", None),
            model("a", None),
            model("sql", Some("a")),
            model("b", None),
        ];
        let list = reply(&served, &cfg, None, 7_500);
        assert_eq!(list.status, 200);
        let v: Value = serde_json::from_slice(&list.body).unwrap();
        let ids: Vec<&str> = v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, ["a", "b", "public", "sql"]);
        assert_eq!(v["data"][3]["parent"], "a");
        assert_eq!(v["data"][0]["created"], 7);
        let one = reply(&served, &cfg, Some("sql"), 0);
        let v: Value = serde_json::from_slice(&one.body).unwrap();
        assert_eq!(
            (one.status, v["id"].as_str(), v["parent"].as_str()),
            (200, Some("sql"), Some("a"))
        );
        assert_eq!(reply(&served, &cfg, Some("nope"), 0).status, 404);
    }
}
