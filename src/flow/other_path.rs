//! Requests on paths kvgate does not read that name a model (vLLM's `/tokenize`, `/detokenize`,
//! an IO processor plugin's `/pooling` request, another server's `/rerank` body, Anthropic's
//! `/v1/messages/count_tokens` …): sent
//! to a pod whose model list names it when the pods serve different models, and named in the
//! model header (`models.header`) for Envoy's routes, as the Gateway API Inference Extension's
//! body-based routing routes any request by its `model`. Left unread, such a request reached a pod
//! serving another model about as often as the pool has other models' pods, and that engine
//! answered 404 (vLLM checks the model on each of these paths); behind a front instance that
//! only names the model for Envoy's routes to each model's cluster (envoy/envoy-models.yaml) it
//! matched no route. Where every pod serves the same models the body is not read: any pod serves
//! it, and no route needs the name.
//!
//! Only the model is read (`Request::model_only`): the request is neither estimated nor admitted,
//! and goes to the listing pods in turn (those not marked down first), not by their load, as
//! before it went wherever Envoy's balancer sent it. The model lists are the routing step's
//! (`Router::listing_pods`); the turn is the VM's (`Gate::other_turn`).

use super::{encoded, header_value, retrieval, unread, Decision, Flow, RequestHead, Step};
use crate::gate::Gate;
use crate::observe;
use crate::openai::request::Request;
use crate::stats;
use crate::store::interface::Store;

impl Flow {
    /// At the headers of a request on a path kvgate does not read: whether to read its body for
    /// its model (a JSON `POST` with a body no larger than `maxBodyBytes`, its length told, not
    /// encoded, while routing is enforced, and either the pods' model lists differ or no pod is
    /// known: a front instance naming models for Envoy's routes), else the decision for a
    /// request kvgate does not read.
    pub(super) fn other_path(
        &mut self,
        gate: &mut Gate,
        store: &dyn Store,
        head: &RequestHead,
        json: bool,
    ) -> Decision {
        let cfg = &gate.config;
        let readable = cfg.passthrough_unknown
            && json
            && head.method.eq_ignore_ascii_case("POST")
            && !head.end_of_stream
            && head.content_encoding.is_none_or(|c| !encoded(c))
            && head.content_length.is_some_and(|n| n <= cfg.max_body_bytes)
            && observe::enforces_routing(cfg);
        if readable && (gate.pods().is_empty() || gate.router.models_differ(store, cfg)) {
            self.model_only = true;
            return Decision::step(Step::WaitForBody);
        }
        unread(cfg)
    }

    /// The whole body of a request read for its model alone (`other_path`): the model named in
    /// the model header for Envoy's routes, and the request sent to a pod whose list names it
    /// (a public name of `models.routes` first made its target, the body rewritten, as on the
    /// APIs kvgate reads). A model no list names goes where Envoy's balancer sends it, for the
    /// engine to answer; a body naming none goes on as it came.
    pub(super) fn on_other_path_body(
        &mut self,
        gate: &mut Gate,
        store: &dyn Store,
        body: &[u8],
    ) -> Decision {
        self.model_only = false;
        let Some(req) = Request::model_only(body) else {
            return unread(&gate.config);
        };
        let models = &gate.config.models;
        let target = gate
            .split
            .choose(&models.routes, &req.model, self.class.session)
            .filter(|t| *t != req.model)
            .map(str::to_string);
        let model = target.as_deref().unwrap_or(&req.model);
        let pods = gate.router.listing_pods(store, &gate.config, model);
        let mut d = if pods.is_empty() {
            Decision::step(Step::Forward)
        } else {
            gate.other_turn = gate.other_turn.wrapping_add(1);
            retrieval(gate, &pods[(gate.other_turn % pods.len() as u64) as usize])
        };
        if let Some(target) = &target {
            let new_body = req.with_model(body, target);
            d.set
                .push(("content-length".into(), new_body.len().to_string()));
            d.body = Some(new_body);
            gate.stats.count(stats::MODELS_REWRITTEN, 1);
        }
        let header = &gate.config.models.header;
        if !header.is_empty() {
            d.set.push((header.clone(), header_value(model)));
        }
        gate.stats.count(stats::OTHER_PATHS_ROUTED, 1);
        d
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::super::DESTINATION_HEADER;
    use super::*;
    use crate::config::Config;
    use crate::models::served::{write_list, ServedModel};
    use crate::store::fake_host::{FakeHost, FakeVm};

    const PODS: [&str; 3] = ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"];

    /// Three pods, each serving the models given, their lists read.
    fn pool(config: Config, models: [&[&str]; 3]) -> (FakeVm, Gate) {
        let host = FakeHost::new();
        let vm = host.vm();
        let gate = Gate::new(config, &vm).unwrap();
        for (pod, models) in PODS.iter().zip(models) {
            let list: Vec<ServedModel> = models
                .iter()
                .map(|m| ServedModel {
                    id: m.to_string(),
                    parent: None,
                })
                .collect();
            write_list(&vm, pod, &list, 1).unwrap();
        }
        host.advance_ms(1_000);
        (vm, gate)
    }

    fn with_pods() -> Config {
        crate::test_support::with_pods(&PODS)
    }

    fn head(body: &str) -> RequestHead<'_> {
        RequestHead {
            content_length: Some(body.len() as u64),
            ..RequestHead::json_post("/tokenize")
        }
    }

    /// The decision at the headers, then, when the body is read, at the body.
    fn send(gate: &mut Gate, vm: &FakeVm, head: &RequestHead, body: &str) -> Decision {
        let mut f = Flow::default();
        let d = f.on_request_headers(gate, vm, head);
        if d.step != Step::WaitForBody {
            return d;
        }
        assert!(f.wants_body());
        let d = f.on_body(gate, vm, body.as_bytes());
        assert!(!f.wants_body(), "decided once");
        d
    }

    fn sent_to(d: &Decision) -> Option<&str> {
        d.set
            .iter()
            .find(|(k, _)| k == DESTINATION_HEADER)
            .map(|(_, v)| v.as_str())
    }

    /// Two models on pods of their own: a request on another path naming one goes to its pods
    /// in turn, with the model header set; before, Envoy's balancer sent a third of model-a's
    /// to model-b's engines, which answered 404.
    #[test]
    fn a_request_on_another_path_goes_to_a_pod_serving_its_model() {
        let (vm, mut gate) = pool(with_pods(), [&["a"], &["b"], &["b"]]);
        let body = r#"{"model":"b","prompt":"hi"}"#;
        let to: Vec<String> = (0..4)
            .map(|_| {
                let d = send(&mut gate, &vm, &head(body), body);
                assert_eq!(d.step, Step::Forward);
                assert!(d.set.contains(&("x-gateway-model-name".into(), "b".into())));
                assert_eq!(d.body, None, "sent as it came");
                sent_to(&d).unwrap().to_string()
            })
            .collect();
        assert_eq!(to, [PODS[2], PODS[1], PODS[2], PODS[1]]);
        let body = r#"{"prompt":"hi","model":"a"}"#;
        assert_eq!(
            sent_to(&send(&mut gate, &vm, &head(body), body)),
            Some(PODS[0])
        );
        assert_eq!(gate.stats.take_count(stats::OTHER_PATHS_ROUTED), 5);
    }

    /// vLLM's `/pooling` is read as the embeddings are, reserved on the pod it is routed to; an
    /// IO processor plugin's request there (its `data`, no prompt) is routed by its model alone,
    /// as on other paths, not refused.
    #[test]
    fn a_pooling_request_is_admitted_and_a_plugins_routed_by_its_model() {
        let (vm, mut gate) = pool(with_pods(), [&["a"], &["r"], &["r"]]);
        let pooling = |body: &str| RequestHead {
            content_length: Some(body.len() as u64),
            ..RequestHead::json_post("/pooling")
        };
        let body = r#"{"model":"r","input":"a prompt and its answer","task":"classify"}"#;
        let d = send(&mut gate, &vm, &pooling(body), body);
        // The pick first, its fallbacks after.
        let pod = sent_to(&d).unwrap().split(',').next().unwrap().to_string();
        assert!(pod == PODS[1] || pod == PODS[2], "{pod}");
        let held = crate::pods::record::read(&vm, &pod).unwrap().entries;
        assert_eq!(held.len(), 1, "reserved there");
        let body = r#"{"model":"r","data":{"data":"s3://tile.tif","data_format":"url"}}"#;
        let d = send(&mut gate, &vm, &pooling(body), body);
        assert_eq!(d.step, Step::Forward);
        assert!(sent_to(&d).is_some_and(|p| p == PODS[1] || p == PODS[2]));
        assert_eq!(gate.stats.take_count(stats::OTHER_PATHS_ROUTED), 1);
    }

    /// vLLM's `/rerank` is read for its pairs: reserved on one pod for each document, with the
    /// query before them held once (its pairs share its blocks in the engine's prefix cache).
    /// Hugging Face TEI's `/rerank` body (`texts`, not a pair vLLM takes) is routed by its model
    /// alone, as on other paths, not refused.
    #[test]
    fn a_rerank_is_reserved_for_its_pairs_and_another_servers_routed_by_its_model() {
        let (vm, mut gate) = pool(with_pods(), [&["a"], &["r"], &["r"]]);
        let rerank = |body: &str| RequestHead {
            content_length: Some(body.len() as u64),
            ..RequestHead::json_post("/v1/rerank")
        };
        let query = "which of these passages answers the question about the reranker? ".repeat(8);
        let mut held = |documents: usize| {
            let docs = vec![
                "a passage about half as long as the question it is ranked for. "
                    .repeat(2);
                documents
            ];
            let body = serde_json::json!({"model": "r", "query": query, "documents": docs});
            let body = body.to_string();
            let d = send(&mut gate, &vm, &rerank(&body), &body);
            let pod = sent_to(&d).unwrap().split(',').next().unwrap().to_string();
            assert!(pod == PODS[1] || pod == PODS[2], "{pod}");
            let entries = crate::pods::record::read(&vm, &pod).unwrap().entries;
            entries.iter().map(|e| e.held_tokens).max().unwrap()
        };
        let (one, eight) = (held(1), held(8));
        // About 90 tokens of query and 30 of each document: eight documents and the query once
        // (less what the first page, in flight, already holds of it), where a query a pair
        // held about seven times the first.
        assert!(one < eight && eight < one * 3, "{one} {eight}");
        let body = r#"{"model":"r","query":"q","texts":["a","b"]}"#;
        let d = send(&mut gate, &vm, &rerank(body), body);
        assert_eq!(d.step, Step::Forward);
        assert!(sent_to(&d).is_some_and(|p| p == PODS[1] || p == PODS[2]));
        assert_eq!(gate.stats.take_count(stats::OTHER_PATHS_ROUTED), 1);
    }

    /// A public name of `models.routes` is sent as its target, as on the APIs kvgate reads.
    #[test]
    fn a_public_name_is_sent_as_its_target() {
        let mut config = with_pods();
        let route: crate::config::ModelRoute =
            serde_json::from_str(r#"{"targets":[{"model":"b","weight":1}]}"#).unwrap();
        config.models.routes.insert("llama".into(), route);
        let (vm, mut gate) = pool(config, [&["a"], &["b"], &["a"]]);
        let body = r#"{"model": "llama", "prompt":"hi"}"#;
        let d = send(&mut gate, &vm, &head(body), body);
        assert_eq!(sent_to(&d), Some(PODS[1]));
        let sent = r#"{"model": "b", "prompt":"hi"}"#;
        assert_eq!(d.body.as_deref(), Some(sent.as_bytes()));
        assert!(d
            .set
            .contains(&("content-length".into(), sent.len().to_string())));
    }

    /// A front instance that knows no pods (envoy/envoy-models.yaml's, before each model's
    /// cluster) names the model for Envoy's routes, a public name as its target.
    #[test]
    fn a_front_instance_names_the_model_for_envoys_routes() {
        let mut config = Config::default();
        let route: crate::config::ModelRoute =
            serde_json::from_str(r#"{"targets":[{"model":"llama-3.1-8b","weight":1}]}"#).unwrap();
        config.models.routes.insert("llama".into(), route);
        let host = FakeHost::new();
        let vm = host.vm();
        let mut gate = Gate::new(config, &vm).unwrap();
        for (model, named) in [("qwen", "qwen"), ("llama", "llama-3.1-8b")] {
            let body = format!(r#"{{"model":"{model}","text_1":"a","text_2":"b"}}"#);
            let d = send(&mut gate, &vm, &head(&body), &body);
            assert_eq!((d.step.clone(), sent_to(&d)), (Step::Forward, None));
            assert!(d
                .set
                .contains(&("x-gateway-model-name".into(), named.into())));
        }
    }

    /// What goes on as it came, unread or read: a pool whose pods all serve the same models;
    /// a request that is not a JSON `POST` with a body of told length within `maxBodyBytes`;
    /// routing observed; a body that names no model, or one no list names, or is no JSON object.
    #[test]
    fn the_rest_goes_on_as_it_came() {
        let unchanged = |d: Decision| {
            assert_eq!(d.step, Step::Forward);
            assert_eq!(sent_to(&d), None, "{d:?}");
            assert_eq!(d.body, None);
        };
        let body = r#"{"model":"b","prompt":"hi"}"#;
        let (vm, mut gate) = pool(with_pods(), [&["a", "b"], &["b", "a"], &["a", "b"]]);
        let mut f = Flow::default();
        unchanged(f.on_request_headers(&mut gate, &vm, &head(body)));
        assert!(!f.wants_body(), "the same models everywhere: not read");

        let (vm, mut gate) = pool(with_pods(), [&["a"], &["b"], &["b"]]);
        for h in [
            RequestHead {
                content_length: None,
                ..head(body)
            },
            RequestHead {
                content_length: Some(1 << 30),
                ..head(body)
            },
            RequestHead {
                method: "PUT",
                ..head(body)
            },
            RequestHead {
                content_type: Some("text/plain"),
                ..head(body)
            },
            RequestHead {
                content_encoding: Some("gzip"),
                ..head(body)
            },
        ] {
            let mut f = Flow::default();
            unchanged(f.on_request_headers(&mut gate, &vm, &h));
            assert!(!f.wants_body());
        }
        for body in [
            r#"{"prompt":"hi"}"#,
            r#"{"model":"nope","prompt":"hi"}"#,
            r#"{"model":7}"#,
            r#"["model","b"]"#,
            "{\"model\":\"b\"",
            "\u{feff}{\"model\":\"b\"}",
        ] {
            unchanged(send(&mut gate, &vm, &head(body), body));
        }
        let mut config = with_pods();
        config.routing.mode = crate::config::Mode::Observe;
        let (vm, mut gate) = pool(config, [&["a"], &["b"], &["b"]]);
        unchanged(send(&mut gate, &vm, &head(body), body));
        assert_eq!(gate.stats.take_count(stats::OTHER_PATHS_ROUTED), 0);
    }
}
