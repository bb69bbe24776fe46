//! Asking the pods for a stored response no note names. The notes (`routing::stored`) live in
//! Envoy's shared data: an Envoy restarted (a rollout, a crash) has none, a response past the
//! notes' 4,096 is forgotten, and a replica that shares no etcd never hears of the responses the
//! others saw end. A follow-up naming such a response went where its cost said, and the engine
//! answered 404 unless it landed on the right pod (n − 1 times in n). The engine itself knows:
//! vLLM answers `GET /v1/responses/{id}` from its API server's store at once, 404 where it is not
//! stored (SGLang alike). So the request is held while each pod that may store it is asked, and
//! goes to the first that has it; the answer's usage is the conversation the engine prepends.
//!
//! Source of truth: the engines' own stores. What is found is noted like a response seen ending
//! (`stored::remember`), so the conversation's next turns need no asking.

use crate::config::Config;
use crate::pods::scrape::{Call, Target};
use crate::routing::stored::Stored;
use serde::Deserialize;

/// A VM's requests held while the pods are asked, at most: each asks every pod of its model, and
/// a client naming ids no engine made (a bug, or worse) would otherwise turn each of its
/// requests into a call to every pod. Past it a request is routed by cost, as with the asking
/// off. A restarted gateway's conversations hold one each for a round trip, a few at a time.
pub const MAX_ASKING: usize = 32;

/// The response a request names, asked of the pods that may store it.
#[derive(Debug)]
pub struct Asking {
    id: String,
    /// Pods asked that have not answered yet.
    pending: Vec<String>,
    found: Option<Stored>,
    /// Some pod gave no answer (the call failed, timed out or could not be sent).
    unanswered: bool,
    /// Past this the request goes on without an answer from every pod.
    pub until_ms: u64,
}

/// Whether requests naming an unknown stored response are held while the pods are asked:
/// `routing.storedLookupMs` above 0, and a cluster to reach each pod through (the metrics').
pub fn asks(cfg: &Config) -> bool {
    cfg.routing.stored_lookup_ms > 0 && !cfg.metrics.cluster.is_empty()
}

impl Asking {
    /// Asks each of `pods` for response `id` until `until_ms`.
    pub fn start(cfg: &Config, id: &str, pods: &[String], until_ms: u64) -> (Self, Vec<Call>) {
        let path = format!("/v1/responses/{}", path_segment(id));
        let calls = pods
            .iter()
            .map(|pod| {
                let headers = vec![
                    (":authority".to_string(), pod.clone()),
                    ("x-envoy-original-dst-host".to_string(), pod.clone()),
                    ("accept".to_string(), "application/json".to_string()),
                ];
                Call {
                    target: Target::Stored(pod.clone()),
                    cluster: cfg.metrics.cluster.clone(),
                    path: path.clone(),
                    headers,
                    body: None,
                    timeout_ms: cfg.routing.stored_lookup_ms,
                }
            })
            .collect();
        let asking = Asking {
            id: id.to_string(),
            pending: pods.to_vec(),
            found: None,
            unanswered: false,
            until_ms,
        };
        (asking, calls)
    }

    /// The calls carry the client's `authorization`, when it sent one: an engine started with
    /// `--api-key` refuses a retrieval without it, and a client learns only what its key may.
    pub fn authorize(calls: &mut [Call], authorization: &str) {
        for call in calls {
            call.headers
                .push(("authorization".to_string(), authorization.to_string()));
        }
    }

    /// `pod`'s answer (`None`: no answer, the call failed or could not be sent). Returns what it
    /// found, the first time a pod says it stores the response.
    pub fn answered(&mut self, pod: &str, status: Option<u32>, body: &[u8]) -> Option<&Stored> {
        let i = self.pending.iter().position(|p| p == pod)?;
        self.pending.swap_remove(i);
        self.unanswered |= status.is_none();
        if self.found.is_some() || status != Some(200) {
            return None;
        }
        let tokens = conversation(&self.id, body)?;
        self.found = Some(Stored {
            pod: pod.to_string(),
            tokens,
        });
        self.found.as_ref()
    }

    /// The response asked for.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The pod that said it stores the response.
    pub fn found(&self) -> Option<&Stored> {
        self.found.as_ref()
    }

    /// Whether every pod asked has answered that it does not store the response. An engine
    /// stores a response before its last bytes leave (vLLM as its generator ends), so by the
    /// time a client names it, this is final: no other replica's note can say otherwise.
    pub fn nowhere(&self) -> bool {
        self.found.is_none() && self.pending.is_empty() && !self.unanswered
    }

    /// Whether there is nothing more to learn: found, or every pod answered, or the time is up.
    pub fn settled(&self, now_ms: u64) -> bool {
        self.found.is_some() || self.pending.is_empty() || now_ms >= self.until_ms
    }
}

#[derive(Deserialize)]
struct Retrieved<'a> {
    #[serde(borrow)]
    id: Option<std::borrow::Cow<'a, str>>,
    usage: Option<Usage>,
}

#[derive(Deserialize, Default)]
struct Usage {
    #[serde(default)]
    input_tokens: u64,
    #[serde(default)]
    output_tokens: u64,
}

/// The conversation's tokens a retrieved response holds (its usage's input and output: the
/// input already counts the history before it), when the body is the response asked for; 0 for
/// one without usage yet (run in the background and not done: it is stored all the same).
fn conversation(id: &str, body: &[u8]) -> Option<u64> {
    let r: Retrieved = serde_json::from_slice(body).ok()?;
    if r.id.as_deref() != Some(id) {
        return None;
    }
    let usage = r.usage.unwrap_or_default();
    Some(usage.input_tokens.saturating_add(usage.output_tokens))
}

/// `id` as one path segment: ids are the engine's (`resp_` and hex), but a client may name
/// anything, and no byte of it may end the segment, start a query or break the header.
fn path_segment(id: &str) -> String {
    let mut out = String::with_capacity(id.len());
    for b in id.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    fn cfg() -> Config {
        Config::parse(br#"{"metrics":{"cluster":"kvgate_metrics"}}"#).unwrap()
    }

    fn pods() -> Vec<String> {
        vec!["10.0.0.1:8000".into(), "10.0.0.2:8000".into()]
    }

    #[test]
    fn each_pod_is_asked_through_the_metrics_cluster_with_the_clients_key() {
        let (asking, mut calls) = Asking::start(&cfg(), "resp_a1", &pods(), 900);
        Asking::authorize(&mut calls, "Bearer k");
        assert_eq!(calls.len(), 2);
        let c = &calls[1];
        assert_eq!(c.target, Target::Stored("10.0.0.2:8000".into()));
        assert_eq!(
            (c.cluster.as_str(), c.path.as_str()),
            ("kvgate_metrics", "/v1/responses/resp_a1")
        );
        assert!(c.body.is_none(), "a GET");
        for (name, value) in [
            (":authority", "10.0.0.2:8000"),
            ("x-envoy-original-dst-host", "10.0.0.2:8000"),
            ("authorization", "Bearer k"),
        ] {
            assert!(
                c.headers.iter().any(|(k, v)| k == name && v == value),
                "{name}"
            );
        }
        assert_eq!(asking.until_ms, 900);
        let (_, calls) = Asking::start(&cfg(), "a/b?c d", &pods(), 900);
        assert_eq!(calls[0].path, "/v1/responses/a%2Fb%3Fc%20d");
        assert!(!calls[0].headers.iter().any(|(k, _)| k == "authorization"));
    }

    #[test]
    fn the_pod_answering_with_the_response_is_found_and_others_are_not() {
        let (mut asking, _) = Asking::start(&cfg(), "resp_a1", &pods(), 900);
        let body = br#"{"id":"resp_a1","object":"response","usage":{"input_tokens":300,"output_tokens":40,"total_tokens":340}}"#;
        assert!(asking.answered("10.0.0.1:8000", Some(404), b"{}").is_none());
        assert!(
            !asking.settled(0) && !asking.nowhere(),
            "one pod has not answered"
        );
        assert!(
            asking.answered("10.0.0.9:8000", Some(200), body).is_none(),
            "not asked"
        );
        let found = asking.answered("10.0.0.2:8000", Some(200), body).cloned();
        assert_eq!(
            found,
            Some(Stored {
                pod: "10.0.0.2:8000".into(),
                tokens: 340
            })
        );
        assert!(asking.settled(0));
    }

    #[test]
    fn another_response_garbage_or_no_answer_is_not_found() {
        let (mut asking, _) = Asking::start(&cfg(), "resp_a1", &pods(), 900);
        assert!(asking
            .answered(
                "10.0.0.1:8000",
                Some(200),
                br#"{"id":"resp_zz","usage":{}}"#
            )
            .is_none());
        assert!(!asking.nowhere());
        assert!(asking.answered("10.0.0.2:8000", None, b"").is_none());
        assert!(
            asking.settled(0) && asking.found().is_none(),
            "all answered"
        );
        assert!(!asking.nowhere(), "one did not say");
        let (mut asking, _) = Asking::start(&cfg(), "resp_a1", &pods(), 900);
        assert!(asking
            .answered("10.0.0.1:8000", Some(200), b"\xff{")
            .is_none());
        assert!(
            !asking.settled(899) && asking.settled(900),
            "the time is up"
        );
        // In the background and not done: stored all the same, its usage still to come.
        let (mut asking, _) = Asking::start(&cfg(), "resp_b", &pods(), 900);
        let found = asking.answered(
            "10.0.0.1:8000",
            Some(200),
            br#"{"id":"resp_b","status":"in_progress","usage":null}"#,
        );
        assert_eq!(found.map(|s| s.tokens), Some(0));
    }

    #[test]
    fn asking_needs_a_cluster_and_a_time() {
        assert!(asks(&cfg()));
        assert!(!asks(&Config::default()), "no metrics cluster");
        let off = Config::parse(
            br#"{"metrics":{"cluster":"kvgate_metrics"},"routing":{"storedLookupMs":0}}"#,
        )
        .unwrap();
        assert!(!asks(&off));
    }
}
