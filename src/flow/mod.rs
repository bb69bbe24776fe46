//! One request's way through kvgate, from request headers to the end of its response, as plain
//! decisions the shell carries out: which headers to strip or set, whether to wait for the body,
//! forward, or answer locally. All shared state is reached through the `Store` given to each step.
//! This file is the request side (headers, body, the decision, a parked request's retry);
//! `response.rs` the response side (headers, streamed body, the end); `other_path.rs` the
//! requests on paths kvgate does not read, sent by the model they name.

use crate::admission::admit::{Admit, Asks, Class, Reach, Stay};
use crate::admission::line::Ticket;
use crate::config::Config;
use crate::estimate::calibration::{family, Started};
use crate::estimate::reservation::{estimate_from, Estimate, StaticCount};
use crate::estimate::templates::Keys;
pub use crate::gate::Gate;
use crate::models::listing;
use crate::observe;
use crate::openai::reply::LocalReply;
use crate::openai::request::{Api, Request};
use crate::openai::response::ResponseMeter;
use crate::pods::scrape::Call;
use crate::routing::prefix::{block_hashes, id_block_hashes, template_keys};
use crate::routing::router::Routed;
use crate::routing::stored::Stored;
use crate::routing::stored_ask::{self, Asking};
use crate::stats;
use crate::store::interface::{Store, StoreError};

pub mod decode;
mod other_path;
mod response;
use response::header_safe;

/// Clients never choose the upstream: this header is kvgate's to set, and Envoy's override-host
/// policy trusts whatever it says.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The header an ORIGINAL_DST cluster with `use_http_header` connects to: left to clients it would
/// let them reach any address, so it is always stripped too.
pub const ORIGINAL_DST_HEADER: &str = "x-envoy-original-dst-host";

/// What the shell does next with the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Send it on upstream (after the header edits).
    Forward,
    /// Keep buffering the body and call again.
    WaitForBody,
    /// Answer locally; the request goes no further.
    Reply(LocalReply),
    /// Hold the request (paused, body buffered) until woken: no pod has room yet.
    Park(u64),
    /// Hold the request (paused) while the note of the stored response it names may still come
    /// from another gateway replica; the root's tick asks again (`Flow::sought`).
    Hold,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub remove: Vec<&'static str>,
    pub set: Vec<(String, String)>,
    /// A new request body (the model rewritten), with `content-length` among `set` to match.
    pub body: Option<Vec<u8>>,
    pub step: Step,
}

impl Decision {
    fn step(step: Step) -> Self {
        Decision {
            remove: Vec::new(),
            set: Vec::new(),
            body: None,
            step,
        }
    }
}

/// The request line and headers kvgate looks at: what `on_request_headers` decides on.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestHead<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub content_type: Option<&'a str>,
    pub content_length: Option<u64>,
    /// The request has no body.
    pub end_of_stream: bool,
    /// `accept`, read only while the status page is on (it picks HTML or JSON).
    pub accept: Option<&'a str>,
    /// Values of the admission headers (objective, priority, tenant, session, the time-to-first-
    /// token objective), as configured.
    pub objective: Option<&'a str>,
    pub priority: Option<&'a str>,
    pub tenant: Option<&'a str>,
    pub session: Option<&'a str>,
    /// The request's own time-to-first-token objective (`admission.ttftObjectiveHeader`).
    pub ttft_objective: Option<&'a str>,
    /// The cache salt header's value (`routing.cacheSaltHeader`): the salt the engine keys the
    /// prompt's cached blocks by, over the body's `cache_salt`.
    pub cache_salt: Option<&'a str>,
    /// `content-encoding`: a body encoded (gzip …) cannot be read (`encoded_body`).
    pub content_encoding: Option<&'a str>,
    /// The request is known to carry neither header that chooses the upstream
    /// (`DESTINATION_HEADER`, `ORIGINAL_DST_HEADER`): the shell read every header and found
    /// neither, so there is nothing to strip (two host calls saved). False, the default, strips
    /// both.
    pub no_upstream_headers: bool,
}

#[cfg(test)]
impl RequestHead<'_> {
    /// A JSON POST to `path` with nothing else said: what most tests send.
    pub fn json_post(path: &str) -> RequestHead<'_> {
        RequestHead {
            method: "POST",
            path,
            content_type: Some("application/json"),
            ..RequestHead::default()
        }
    }
}

/// What was decided about a parsed request, kept for the response side.
#[derive(Debug, Clone)]
struct Admitted {
    /// The model the request is sent as (after any rename): what calibration and stats key on.
    model: String,
    /// Its calibration family when it is a LoRA adapter (`calibration::family`).
    family: Option<String>,
    /// The name the client asked for, when a rename or split changed it.
    requested: Option<String>,
    /// `model`'s segment in per-model stat names (`stats::OTHER_MODEL` for names without stats).
    stat_model: String,
    estimate: Estimate,
    static_text_tokens: f64,
    /// Its prompt went through the chat template (`Request::templated`).
    templated: bool,
    /// Prompt tokens known exactly (token ids, a stored conversation's history), and the
    /// non-text parts: what calibration needs besides the text (`calibration::Sample`).
    known_tokens: u64,
    parts: u64,
    max_output_tokens: Option<u64>,
    /// The engine stores its answer (`Request::stored`), on the pod that answered
    /// (`answered_by`, the upstream Envoy used), which its follow-ups must go back to
    /// (`routing::stored`).
    stored: bool,
    answered_by: Option<String>,
    /// Its answer is metered as it streams: the client asked for a stream (`stream`), and its
    /// body can be read (not encoded, `Flow::on_response_encoded`). Any other answer's entry
    /// grows on the tick instead (`Flow::on_tick`).
    streams: bool,
    /// What one streamed piece of its answer counts, in tokens: the model's learned tokens per
    /// piece when it was admitted (`calibration`; 1 until learned), kept for the whole answer
    /// so that its count only grows.
    tokens_per_piece: f64,
    routed: Option<Routed>,
    /// Its answer's place in the VM's cohorts of answers started, once it streams.
    started: Option<Started>,
    /// The keys of its prompt's template (`estimate::templates`): its opening's and its heads',
    /// or its first block's.
    template: Keys,
    /// While parked: the ticket and what a retry needs.
    waiting: Option<(Ticket, Vec<u64>)>,
    waited_ms: Option<u64>,
}

impl Admitted {
    /// The output tokens `pieces` streamed pieces of its answer hold.
    fn made(&self, pieces: u64) -> u64 {
        (pieces as f64 * self.tokens_per_piece).round() as u64
    }
}

/// A request naming a stored response this replica has no note of, held (`Step::Hold`) for
/// another replica's note of it, or while the pods are asked for it (`routing::stored_ask`),
/// until one tells where it is or neither can any more.
struct Seeking {
    /// When it was held.
    since_ms: u64,
    /// Until when another replica's note may come (`etcd.followUpWaitMs`); 0: none is awaited.
    note_until_ms: u64,
    asking: Option<Asking>,
    what: Sought,
}

impl Seeking {
    /// The response's place once known (a note, or a pod's answer), and whether the wait is
    /// over: `(None, false)` while it may still be learned.
    fn settled(&self, store: &dyn Store, id: Option<&str>) -> (Option<Stored>, bool) {
        if let Named::On(on) = named(store, id) {
            return (Some(on), true);
        }
        if let Some(found) = self.asking.as_ref().and_then(Asking::found) {
            return (Some(found.clone()), true);
        }
        let now = store.now_ms();
        // A note may still come until the wait is over, unless every pod said it stores no such
        // response, or a read of etcd since the hold found no other replica alive (nobody to
        // send one: a lone replica with `etcd` on held each such request for the whole wait,
        // before the engine's 404).
        let note_due = now < self.note_until_ms
            && !self.asking.as_ref().is_some_and(Asking::nowhere)
            && !crate::routing::stored::alone_since(store, self.since_ms).unwrap_or(false);
        let answers_due = self.asking.as_ref().is_some_and(|a| !a.settled(now));
        (None, !note_due && !answers_due)
    }
}

enum Sought {
    /// A Responses API follow-up, parsed and its model chosen.
    FollowUp(Box<(Request, SentAs)>),
    /// A retrieval, `/cancel` or `/input_items` of the response `id`.
    Retrieval(String),
}

#[derive(Default)]
pub struct Flow {
    api: Option<Api>,
    class: Class,
    seeking: Option<Seeking>,
    /// The calls asking the pods for the stored response it is held for, for the shell to send.
    asks: Vec<Call>,
    admitted: Option<Admitted>,
    meter: Option<ResponseMeter>,
    /// The answer's gzip decoder, when it comes gzipped (`Flow::on_response_encoded`).
    decoder: Option<decode::Decoder>,
    finished: bool,
    /// The client's headers set a priority: a model's default band does not replace it.
    priority_given: bool,
    /// The cache salt its header gave (`RequestHead::cache_salt`), for the body to be hashed by.
    salt_header: Option<String>,
    /// Its body is read for its model alone (`other_path`).
    model_only: bool,
    /// Its report for Envoy's access log, for the shell to set (`take_access_log`).
    access_log: Option<String>,
    /// `accessLog`, as at its headers: a refusal's line is made where no configuration is at
    /// hand (`shaped`).
    logs: bool,
}

/// What the model step decided for a request.
#[derive(Default)]
struct SentAs {
    requested: Option<String>,
    stat_model: String,
    headers: Vec<(String, String)>,
    body: Option<Vec<u8>>,
}

/// A model name as a request header value for Envoy routes to match: as it is when it is visible
/// ASCII (every name a route is likely to name), else percent-encoded byte by byte, so no name
/// can add a header or carry bytes a codec refuses.
fn header_value(model: &str) -> String {
    let mut out = String::with_capacity(model.len());
    for b in model.bytes() {
        if b.is_ascii_graphic() && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn too_large(limit: u64) -> LocalReply {
    LocalReply::error(
        413,
        "request_too_large",
        &format!("request body exceeds kvgate's limit of {limit} bytes (maxBodyBytes)"),
        None,
    )
}

/// Whether a `content-encoding` value names a coding (anything but none or `identity`).
pub(crate) fn encoded(coding: &str) -> bool {
    let coding = coding.trim();
    !coding.is_empty() && !coding.eq_ignore_ascii_case("identity")
}

/// A request body kvgate cannot read, encoded on its way (a client compressing its body): 415,
/// as the engines would fail to parse it too, rather than let it reach a pod unestimated and
/// past the budget. A decompressor listed before kvgate in the chain makes it readable.
fn encoded_body(coding: &str) -> LocalReply {
    LocalReply::error(
        415,
        "invalid_request_error",
        &format!(
            "request body is encoded (content-encoding: {}); kvgate reads only unencoded bodies: \
             decompress it before kvgate (envoy.filters.http.decompressor listed before it)",
            header_safe(coding)
        ),
        None,
    )
}

/// Where the response a request names is stored, as far as this replica knows.
enum Named {
    /// It names none (or the notes cannot be read).
    Nothing,
    On(Stored),
    Unknown,
}

fn named(store: &dyn Store, id: Option<&str>) -> Named {
    let Some(id) = id else {
        return Named::Nothing;
    };
    match crate::routing::stored::find(store, id) {
        Ok(Some(s)) => Named::On(s),
        Ok(None) => Named::Unknown,
        Err(e) => {
            log::debug!("stored responses unreadable: {e:?}");
            Named::Nothing
        }
    }
}

/// A Responses API follow-up goes to the pod its previous response is stored on, the only one
/// that can answer it, with the conversation the engine prepends counted as known tokens.
fn follow(gate: &mut Gate, req: &mut Request, on: &Stored) -> u64 {
    gate.stats.count(stats::STORED_FOLLOWED, 1);
    req.token_ids = req.token_ids.saturating_add(on.tokens);
    crate::hash::fnv1a(on.pod.as_bytes())
}

/// How long a request naming a stored response this replica has not heard of is held for
/// another replica's note of it (`etcd.followUpWaitMs`), from now; `None`: not held for one (no
/// replicas share etcd, or Envoy's balancer chooses: `routing.mode` `observe` holds nothing).
fn seek(gate: &mut Gate, store: &dyn Store) -> Option<u64> {
    let e = &gate.config.etcd;
    if !e.enabled() || e.follow_up_wait_ms == 0 || !observe::enforces_routing(&gate.config) {
        return None;
    }
    let until = store.now_ms().saturating_add(e.follow_up_wait_ms);
    // The elected worker syncs at the busy pace meanwhile, to read the note sooner.
    if let Err(e) = crate::routing::stored::seek(store, until) {
        log::debug!("marking a stored response sought: {e:?}");
    }
    gate.stats.count(stats::STORED_WAITED, 1);
    Some(until)
}

/// The pods asked for stored response `id` (`routing::stored_ask`) and the calls that ask them;
/// `None` when none is asked (`routing.storedLookupMs` 0, no cluster to ask through, no pod
/// known, Envoy's balancer chooses, or `stored_ask::MAX_ASKING` of the VM's requests ask now).
/// A follow-up's model narrows the pods to those serving it.
fn ask(
    gate: &mut Gate,
    store: &dyn Store,
    id: &str,
    model: Option<&str>,
) -> Option<(Asking, Vec<Call>)> {
    let cfg = &gate.config;
    if !stored_ask::asks(cfg)
        || !observe::enforces_routing(cfg)
        || gate.asking >= stored_ask::MAX_ASKING
    {
        return None;
    }
    let pods = match model {
        Some(model) => gate.router.serving_pods(store, model),
        None => gate.pods().to_vec(),
    };
    if pods.is_empty() {
        return None;
    }
    let until = store.now_ms().saturating_add(cfg.routing.stored_lookup_ms);
    gate.stats.count(stats::STORED_ASKED, 1);
    gate.asking += 1;
    Some(Asking::start(cfg, id, &pods, until))
}

/// What a request naming a stored response this replica has no note of is held for: another
/// replica's note (until `note_until_ms`; 0: none awaited), the pods' answers, or both.
struct Wait {
    note_until_ms: u64,
    asking: Option<(Asking, Vec<Call>)>,
}

/// `None`: held for neither, the request is routed by cost at once (the engine answers, a 404
/// unless it lands where the response is stored).
fn wait_for(gate: &mut Gate, store: &dyn Store, id: &str, model: Option<&str>) -> Option<Wait> {
    let note_until_ms = seek(gate, store).unwrap_or(0);
    let asking = ask(gate, store, id, model);
    let until = note_until_ms.max(asking.as_ref().map_or(0, |(a, _)| a.until_ms));
    if until == 0 {
        return None;
    }
    // The quick tick ends the wait on time, whatever the pods answer.
    gate.seeking_until(until);
    Some(Wait {
        note_until_ms,
        asking,
    })
}

/// The decision for a request kvgate does not read: forwarded, or refused while
/// `passthroughUnknown` is off.
fn unread(cfg: &Config) -> Decision {
    Decision::step(if cfg.passthrough_unknown {
        Step::Forward
    } else {
        Step::Reply(LocalReply::error(
            404,
            "not_found_error",
            "kvgate serves only POST OpenAI JSON APIs here (passthroughUnknown is off)",
            None,
        ))
    })
}

/// A request kvgate does not admit sent to `pod`, through Envoy's override host (and the
/// original-destination header, when configured), while that pod is in the pool: a stored
/// response's retrieval to the pod storing it (one gone, or another replica's pod this one does
/// not know, is no constraint, as for a follow-up), a request on another path to a pod serving
/// its model (`other_path`).
fn retrieval(gate: &Gate, pod: &str) -> Decision {
    let cfg = &gate.config;
    if !gate.pods().iter().any(|p| p == pod) {
        return unread(cfg);
    }
    let mut d = Decision::step(Step::Forward);
    d.set
        .push((DESTINATION_HEADER.to_string(), pod.to_string()));
    if cfg.routing.set_original_dst_header {
        d.set
            .push((ORIGINAL_DST_HEADER.to_string(), pod.to_string()));
    }
    d
}

impl Flow {
    pub fn on_request_headers(
        &mut self,
        gate: &mut Gate,
        store: &dyn Store,
        head: &RequestHead,
    ) -> Decision {
        let cfg = &gate.config;
        self.class = Class::from_headers(
            &cfg.admission,
            head.objective,
            head.priority,
            head.tenant,
            head.session,
            head.ttft_objective,
        );
        self.priority_given =
            Class::priority_given(&cfg.admission, head.objective, head.priority).is_some();
        self.logs = cfg.access_log;
        // vLLM takes the header's salt over the body's (its `X-Cache-Salt`; an empty one it
        // refuses, so it names no salt here either).
        self.salt_header = head
            .cache_salt
            .filter(|s| !s.is_empty())
            .map(str::to_string);
        let mut decision = if crate::status::is_status_path(cfg, head.path) {
            Decision::step(Step::Reply(crate::status::reply(
                gate,
                store,
                head.method,
                head.accept,
            )))
        } else {
            self.classify(gate, store, head)
        };
        if !head.no_upstream_headers {
            decision.remove.push(DESTINATION_HEADER);
            decision.remove.push(ORIGINAL_DST_HEADER);
        }
        decision
    }

    fn classify(&mut self, gate: &mut Gate, store: &dyn Store, head: &RequestHead) -> Decision {
        // The gateway's model list: every pod's, not the one pod's Envoy would pick.
        if head.method.eq_ignore_ascii_case("GET") && observe::enforces_routing(&gate.config) {
            if let Some(id) = listing::asks(head.path) {
                if let Some(served) = gate.router.listed_models(store, &gate.config) {
                    let reply = listing::reply(&served, &gate.config.models, id, store.now_ms());
                    return Decision::step(Step::Reply(reply));
                }
            }
        }
        let cfg = &gate.config;
        let json = head
            .content_type
            .is_none_or(|c| c.to_ascii_lowercase().contains("json"));
        let api = Api::from_path(head.path).filter(|_| head.method.eq_ignore_ascii_case("POST"));
        let Some(api) = api.filter(|_| json) else {
            // A response's retrieval, `/cancel` or `/input_items`: only the pod storing it can
            // answer (while routing is enforced).
            let id = crate::routing::stored::id_in_path(head.path)
                .filter(|_| observe::enforces_routing(cfg));
            return match (named(store, id), id) {
                (Named::On(s), _) => retrieval(gate, &s.pod),
                (Named::Unknown, Some(id)) => match wait_for(gate, store, id, None) {
                    Some(wait) => {
                        self.hold(store, wait, Sought::Retrieval(id.to_string()));
                        Decision::step(Step::Hold)
                    }
                    None => unread(&gate.config),
                },
                _ => self.other_path(gate, store, head, json),
            };
        };
        self.api = Some(api);
        if let Some(coding) = head.content_encoding.filter(|c| encoded(c)) {
            return Decision::step(Step::Reply(encoded_body(coding)));
        }
        if head.content_length.is_some_and(|n| n > cfg.max_body_bytes) {
            return Decision::step(Step::Reply(too_large(cfg.max_body_bytes)));
        }
        if head.end_of_stream {
            return Decision::step(Step::Reply(LocalReply::error(
                400,
                "invalid_request_error",
                "request body is empty",
                None,
            )));
        }
        Decision::step(Step::WaitForBody)
    }

    /// The decision as the request's API answers: a local error to an Anthropic Messages
    /// request in that API's shape (`LocalReply::anthropic`). Every decision the shell carries
    /// out passes here, whichever callback or tick made it, so a refusal's access log line is
    /// made here too (`refused`).
    pub fn shaped(&mut self, mut d: Decision) -> Decision {
        if self.api == Some(Api::Messages) {
            d.step = match d.step {
                Step::Reply(reply) => Step::Reply(reply.anthropic()),
                step => step,
            };
        }
        if let (Step::Reply(reply), true) = (&d.step, self.logs) {
            self.refused(reply);
        }
        d
    }

    /// Whether the request has been classified as one kvgate reads the body of.
    pub fn wants_body(&self) -> bool {
        (self.api.is_some() || self.model_only) && self.admitted.is_none() && self.seeking.is_none()
    }

    /// More of the body has arrived (`size` bytes buffered so far).
    pub fn on_body_progress(&self, gate: &Gate, size: u64) -> Option<Decision> {
        (size > gate.config.max_body_bytes)
            .then(|| Decision::step(Step::Reply(too_large(gate.config.max_body_bytes))))
    }

    /// The whole body is here: parse, estimate, decide.
    pub fn on_body(&mut self, gate: &mut Gate, store: &dyn Store, body: &[u8]) -> Decision {
        if self.model_only {
            return self.on_other_path_body(gate, store, body);
        }
        let Some(api) = self.api else {
            return Decision::step(Step::Forward);
        };
        if body.len() as u64 > gate.config.max_body_bytes {
            return Decision::step(Step::Reply(too_large(gate.config.max_body_bytes)));
        }
        let mut req = match Request::parse(api, body) {
            Ok(r) => r,
            // An IO processor plugin's request, or another server's on a score path: routed by
            // its model alone, as on other paths.
            Err(e) if e.names_no_prompt() => {
                self.api = None;
                return self.on_other_path_body(gate, store, body);
            }
            Err(e) => {
                return Decision::step(Step::Reply(LocalReply::error(
                    400,
                    "invalid_request_error",
                    &e.message,
                    e.param.as_deref(),
                )))
            }
        };
        if let Some(salt) = self.salt_header.take() {
            req.cache_salt = Some(salt);
        }
        let mut sent_as = match self.choose_model(gate, store, &mut req, body) {
            Ok(m) => m,
            Err(reply) => return Decision::step(Step::Reply(reply)),
        };
        let only_on = match named(store, req.previous_response.as_deref()) {
            Named::On(on) => Some(follow(gate, &mut req, &on)),
            Named::Unknown => {
                let id = req.previous_response.as_deref().unwrap_or_default();
                match wait_for(gate, store, id, Some(&req.model)) {
                    Some(wait) => {
                        // Set now, while the body and headers are this callback's to change.
                        let mut d = Decision::step(Step::Hold);
                        d.set = std::mem::take(&mut sent_as.headers);
                        d.body = sent_as.body.take();
                        self.hold(store, wait, Sought::FollowUp(Box::new((req, sent_as))));
                        return d;
                    }
                    None => {
                        gate.stats.count(stats::STORED_UNKNOWN, 1);
                        None
                    }
                }
            }
            Named::Nothing => None,
        };
        let SentAs {
            requested,
            stat_model,
            headers,
            body,
        } = sent_as;
        let mut decision = self.admit(gate, store, req, only_on, requested, stat_model);
        // Set now, while the body and headers are still this callback's to change, even for a
        // request that parks: it is resumed later from another callback.
        decision.set.extend(headers);
        decision.body = body;
        decision
    }

    /// Holds the request (`Step::Hold`) for `what` it names, leaving the calls that ask the
    /// pods for the shell to send (`take_asks`).
    fn hold(&mut self, store: &dyn Store, wait: Wait, what: Sought) {
        let (asking, calls) = wait.asking.unzip();
        self.asks = calls.unwrap_or_default();
        self.seeking = Some(Seeking {
            since_ms: store.now_ms(),
            note_until_ms: wait.note_until_ms,
            asking,
            what,
        });
    }

    /// The request is no longer held (decided, or its stream done): its place among the VM's
    /// asking requests is free.
    fn end_seeking(&mut self, gate: &mut Gate) -> Option<Seeking> {
        let seeking = self.seeking.take()?;
        if seeking.asking.is_some() {
            gate.asking = gate.asking.saturating_sub(1);
        }
        Some(seeking)
    }

    /// The calls asking the pods for the stored response the request is held for, to send now,
    /// with the client's `authorization` when it sent one (`stored_ask::Asking::authorize`).
    pub fn take_asks(&mut self, authorization: Option<&str>) -> Vec<Call> {
        let mut calls = std::mem::take(&mut self.asks);
        if let Some(auth) = authorization {
            Asking::authorize(&mut calls, auth);
        }
        calls
    }

    /// Whether the request waits for the pods' answers to calls not yet sent (`take_asks`).
    pub fn has_asks(&self) -> bool {
        !self.asks.is_empty()
    }

    /// A call to `pod` could not be sent: no answer will come from it. The decision waits for
    /// the tick (`sought`), as the callback that held the request is still running.
    pub fn unasked(&mut self, pod: &str) {
        if let Some(asking) = self.seeking.as_mut().and_then(|s| s.asking.as_mut()) {
            asking.answered(pod, None, &[]);
        }
    }

    /// `pod`'s answer to whether it stores the response the request is held for (`status`
    /// `None`: no answer, or the call could not be sent): the decision once that settles it,
    /// `None` while it still waits (or was decided before).
    pub fn answered(
        &mut self,
        gate: &mut Gate,
        store: &dyn Store,
        pod: &str,
        status: Option<u32>,
        body: &[u8],
    ) -> Option<Decision> {
        let asking = self.seeking.as_mut()?.asking.as_mut()?;
        let h = crate::routing::stored::id_hash(asking.id());
        if let Some(found) = asking.answered(pod, status, body) {
            gate.stats.count(stats::STORED_FOUND, 1);
            // Its next turns need no asking, through this replica or another.
            gate.note_stored(store, h, &found.pod, found.tokens);
        }
        self.sought(gate, store)
    }

    /// Held for the stored response it names (`Step::Hold`): the decision, once a note or a pod
    /// says where it is, or neither can any more; `None` while it still waits. Asked again at
    /// each of its worker's ticks, and at each pod's answer (`answered`).
    pub fn sought(&mut self, gate: &mut Gate, store: &dyn Store) -> Option<Decision> {
        let seeking = self.seeking.as_ref()?;
        let id = match &seeking.what {
            Sought::FollowUp(parsed) => parsed.0.previous_response.as_deref(),
            Sought::Retrieval(id) => Some(id.as_str()),
        };
        let (on, over) = seeking.settled(store, id);
        if !over {
            return None;
        }
        let seeking = self.end_seeking(gate)?;
        Some(match seeking.what {
            Sought::FollowUp(parsed) => {
                let (mut req, sent_as) = *parsed;
                let only_on = match on {
                    Some(on) => Some(follow(gate, &mut req, &on)),
                    None => {
                        gate.stats.count(stats::STORED_UNKNOWN, 1);
                        None
                    }
                };
                let (requested, stat_model) = (sent_as.requested, sent_as.stat_model);
                self.admit(gate, store, req, only_on, requested, stat_model)
            }
            Sought::Retrieval(_) => match on {
                Some(on) => retrieval(gate, &on.pod),
                None => unread(&gate.config),
            },
        })
    }

    /// Estimates, places and admits a parsed request (`only_on`: the one pod it may go to).
    fn admit(
        &mut self,
        gate: &mut Gate,
        store: &dyn Store,
        req: Request,
        only_on: Option<u64>,
        requested: Option<String>,
        stat_model: String,
    ) -> Decision {
        let cfg = &gate.config.estimator;
        let family = gate.router.base_of(&req.model).map(family);
        let known = gate
            .calibration
            .known(store, &req.model, family.as_deref(), cfg);
        let counted = StaticCount::of(&req);
        let r = &gate.config.routing;
        let block_tokens = gate.router.block_tokens(r);
        let block_chars = r.block_chars(block_tokens);
        let (model, salt, max_blocks) = (
            &req.model,
            req.cache_salt.as_deref(),
            r.max_prompt_blocks as usize,
        );
        // A prompt of token ids is hashed in the engine's own blocks; a text in blocks of as
        // many tokens by the characters they take.
        let hashes = if req.ids.is_empty() {
            block_hashes(model, salt, req.prefix_text(), block_chars, max_blocks)
        } else {
            id_block_hashes(model, salt, &req.ids, block_tokens as usize, max_blocks)
        };
        // The prompt's template (its application's), whose answers may run apart from the
        // model's (`estimate::templates`): its opening, the tools and instructions it starts with,
        // whatever their length, and the heads of it; without one (a completions prompt, which
        // has no turns), the heads of its text. Not worked out when no template is learned.
        let mut template = Keys::default();
        if cfg.calibrate && cfg.template_lengths {
            template = template_keys(
                &req.model,
                req.cache_salt.as_deref(),
                &req.text,
                req.opening,
                block_chars,
                &hashes,
            );
        }
        let mut learned = known.learned;
        if let (Some(l), false) = (&mut learned, template.is_empty()) {
            l.output = l
                .output
                .with_own(gate.calibration.own(&req.model, &template, cfg));
        }
        let mut est = estimate_from(&req, counted, learned, known.prior, cfg);
        est.only_on = only_on;
        let placed = gate.admission.place(
            store,
            &gate.config,
            &mut gate.router,
            &mut gate.stats,
            self.class,
            &Asks {
                model: &req.model,
                hashes: &hashes,
                est: &est,
            },
        );
        gate.stats
            .count(stats::model_stat(&stat_model, stats::MODEL_REQUESTS), 1);
        if !req.stream {
            // Until its on_done (`Flow::on_done`), the VM's tick is quick to grow its entry.
            gate.unseen_answers += 1;
        }
        self.admitted = Some(Admitted {
            requested,
            stat_model,
            static_text_tokens: counted.all,
            templated: req.templated,
            known_tokens: req.token_ids,
            parts: req.non_text_parts,
            max_output_tokens: req.max_output_tokens,
            stored: req.stored,
            answered_by: None,
            streams: req.stream,
            tokens_per_piece: known.learned.map_or(1.0, |l| l.tokens_per_piece),
            started: None,
            template,
            model: req.model,
            family,
            estimate: est,
            routed: None,
            waiting: None,
            waited_ms: None,
        });
        match placed {
            Ok(Admit::Wait(ticket)) => {
                if let Some(a) = &mut self.admitted {
                    a.waiting = Some((ticket, hashes));
                }
                Decision::step(Step::Park(ticket.id))
            }
            Ok(admit) => self.decide(gate, admit),
            Err(e) => {
                // Shared state unavailable: Envoy's fallback policy still serves the request.
                log::warn!("admission failed, falling back to Envoy's balancing: {e:?}");
                gate.stats.count(stats::ROUTE_ERRORS, 1);
                Decision::step(Step::Forward)
            }
        }
    }

    /// The model step: the public name's target (a rename or weighted split, the body rewritten
    /// to it), the model's default priority band, and the 404 for a model no pod serves.
    fn choose_model(
        &mut self,
        gate: &mut Gate,
        store: &dyn Store,
        req: &mut Request,
        body: &[u8],
    ) -> Result<SentAs, LocalReply> {
        if req.model.is_empty() {
            // An SGLang `/generate` names its adapter instead (`lora_path`): counted and routed
            // as that adapter where a pod serves it, as on the paths that name it as the model.
            // A name no pod lists (a path, or one not loaded) is the engine's to resolve.
            if let Some(adapter) = req
                .adapter
                .take()
                .filter(|a| gate.router.serves(store, &gate.config, a))
            {
                req.model = adapter;
                return self.model_found(gate, store, req, SentAs::default());
            }
            match gate.router.default_model(store, &gate.config) {
                // The engine serves its own model: the body is sent as it came, and `routes`
                // (keyed by the names clients send) do not apply.
                Ok(Some(model)) => req.model = model,
                Ok(None) => {}
                Err(several) => {
                    return Err(LocalReply::error(
                        400,
                        "invalid_request_error",
                        &format!(
                            "`model` is required: the model servers behind this gateway serve several models ({}).",
                            several.join(", ")
                        ),
                        Some("model"),
                    ))
                }
            }
            return self.model_found(gate, store, req, SentAs::default());
        }
        let models = &gate.config.models;
        let requested = req.model.clone();
        let mut sent = SentAs::default();
        if let Some(target) = gate
            .split
            .choose(&models.routes, &requested, self.class.session)
            .filter(|t| *t != requested)
        {
            let new_body = req.with_model(body, target);
            sent.headers
                .push(("content-length".into(), new_body.len().to_string()));
            sent.body = Some(new_body);
            req.model = target.to_string();
            sent.requested = Some(requested.clone());
            gate.stats.count(stats::MODELS_REWRITTEN, 1);
        }
        if !self.priority_given {
            let band = [&requested, &req.model]
                .into_iter()
                .find_map(|m| models.routes.get(m.as_str()).and_then(|r| r.priority));
            if let Some(band) = band {
                self.class.priority = band;
            }
        }
        self.model_found(gate, store, req, sent)
    }

    /// The model `req` is sent as is served by some pod (else 404); its stat name and header.
    fn model_found(
        &mut self,
        gate: &mut Gate,
        store: &dyn Store,
        req: &Request,
        mut sent: SentAs,
    ) -> Result<SentAs, LocalReply> {
        let models = &gate.config.models;
        if !gate.router.serves(store, &gate.config, &req.model) {
            gate.stats.count(stats::MODELS_NOT_FOUND, 1);
            let renamed = sent
                .requested
                .as_ref()
                .map_or(String::new(), |r| format!(" (requested as `{r}`)"));
            return Err(LocalReply::error(
                404,
                "model_not_found",
                &format!(
                    "The model `{}`{renamed} does not exist: no model server behind this gateway serves it.",
                    req.model
                ),
                Some("model"),
            ));
        }
        let configured = models.routes.contains_key(&req.model)
            || models
                .routes
                .values()
                .any(|r| r.targets.iter().any(|t| t.model == req.model));
        sent.stat_model = if configured || gate.router.lists(&req.model) {
            req.model.clone()
        } else {
            stats::OTHER_MODEL.to_string()
        };
        if !models.header.is_empty() && !req.model.is_empty() {
            sent.headers
                .push((models.header.clone(), header_value(&req.model)));
        }
        Ok(sent)
    }

    /// Turns an admission outcome into what the shell does.
    fn decide(&mut self, gate: &mut Gate, admit: Admit) -> Decision {
        match admit {
            Admit::Routed(routed) => {
                gate.stats.count(stats::ROUTED, 1);
                gate.stats
                    .count(stats::ADAPTER_LOADS, u64::from(routed.adapter_load));
                gate.stats
                    .count(stats::ROUTING_HOT_PREFIX_HELD, u64::from(routed.hot_held));
                if let Some(a) = &self.admitted {
                    gate.stats
                        .count(stats::model_stat(&a.stat_model, stats::MODEL_PICKS), 1);
                }
                gate.stats
                    .count(stats::pod_stat(&routed.pod, stats::POD_PICKS), 1);
                gate.stats
                    .count(stats::PREFIX_BLOCKS_TOTAL, routed.prompt_blocks as u64);
                gate.stats
                    .count(stats::PREFIX_BLOCKS_MATCHED, routed.cached_blocks as u64);
                gate.stats.count(
                    stats::pod_stat(&routed.pod, stats::POD_PREFIX_BLOCKS_TOTAL),
                    routed.prompt_blocks as u64,
                );
                gate.stats.count(
                    stats::pod_stat(&routed.pod, stats::POD_PREFIX_BLOCKS_MATCHED),
                    routed.cached_blocks as u64,
                );
                if routed.over_budget {
                    observe::placed_past_budget(gate, &routed, self.class);
                }
                let mut d = Decision::step(Step::Forward);
                if observe::enforces_routing(&gate.config) {
                    d.set
                        .push((DESTINATION_HEADER.to_string(), routed.order.join(",")));
                    if gate.config.routing.set_original_dst_header {
                        d.set
                            .push((ORIGINAL_DST_HEADER.to_string(), routed.pod.clone()));
                    }
                }
                if let Some(a) = &mut self.admitted {
                    a.routed = Some(routed);
                }
                d
            }
            Admit::Unrouted => {
                gate.stats.count(stats::ROUTE_UNROUTED, 1);
                Decision::step(Step::Forward)
            }
            Admit::Wait(ticket) => Decision::step(Step::Park(ticket.id)),
            Admit::Refuse(reply) => Decision::step(Step::Reply(reply)),
        }
    }

    /// While parked: whether its prompt belongs on one of `pods` (cached there by this VM's
    /// prefix index, or its group's home: `Router::belongs_on`), a cheap test before a retry.
    pub fn parked_prompt_belongs_on(&self, gate: &Gate, pods: &[String], now: u64) -> bool {
        let Some((_, hashes)) = self.admitted.as_ref().and_then(|a| a.waiting.as_ref()) else {
            return false;
        };
        gate.router.belongs_on(&gate.config, pods, hashes, now)
    }

    /// The parked request is at the head of the line, a backfill, or past its deadline: try
    /// again, on the pods `reach` allows among those its bits name (`Admission::retry`). `Err`
    /// while it still has to wait, and why.
    pub fn retry(
        &mut self,
        gate: &mut Gate,
        store: &dyn Store,
        reach: (Reach, u64),
    ) -> Result<Decision, Stay> {
        let Some(a) = self.admitted.as_mut() else {
            return Err(Stay::NoRoom);
        };
        let Some((ticket, hashes)) = a.waiting.as_mut() else {
            return Err(Stay::NoRoom);
        };
        let est = a.estimate;
        let outcome = gate.admission.retry(
            store,
            &gate.config,
            &mut gate.router,
            &mut gate.stats,
            ticket,
            &Asks {
                model: &a.model,
                hashes,
                est: &est,
            },
            reach,
        );
        let ticket = *ticket;
        let admit = match outcome {
            Ok(Ok(admit)) => admit,
            Ok(Err(stay)) => return Err(stay),
            Err(StoreError::CasMismatch) => {
                // Every compare-and-swap of its pick lost to other workers' writes (of a pod's
                // record, or the line), and nothing was charged: it keeps its place and is tried
                // at the next pass. Sent on undecided, it would pass every budget.
                gate.admission.contended(&mut gate.stats);
                return Err(Stay::NoRoom);
            }
            Err(e) => {
                log::warn!("admission retry failed, sending unrouted: {e:?}");
                gate.stats.count(stats::ROUTE_ERRORS, 1);
                gate.admission.withdraw(store, ticket.id);
                Admit::Unrouted
            }
        };
        a.waiting = None;
        let waited = store.now_ms().saturating_sub(ticket.enqueued_ms);
        a.waited_ms = Some(waited);
        gate.stats.histogram(
            stats::model_stat(&a.stat_model, stats::MODEL_QUEUE_WAIT_MS),
            waited,
        );
        Ok(self.decide(gate, admit))
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::store::fake_host::FakeHost;

    fn head(path: &str) -> RequestHead<'_> {
        RequestHead::json_post(path)
    }

    fn gate(config: Config) -> (FakeHost, crate::store::fake_host::FakeVm, Gate) {
        let host = FakeHost::new();
        let vm = host.vm();
        let gate = Gate::new(config, &vm).unwrap();
        (host, vm, gate)
    }

    #[test]
    fn client_text_in_headers_cannot_split_or_bloat_them() {
        assert_eq!(header_safe("m\r\nx-injected: yes"), "m??x-injected: yes");
        assert_eq!(header_safe(&"é".repeat(500)).len(), 128);
    }

    #[test]
    fn destination_header_is_always_stripped() {
        let (_, vm, mut gate) = gate(Config::default());
        for h in [
            head("/v1/chat/completions"),
            head("/other"),
            RequestHead {
                method: "GET",
                ..head("/v1/models")
            },
        ] {
            assert_eq!(
                Flow::default()
                    .on_request_headers(&mut gate, &vm, &h)
                    .remove,
                [DESTINATION_HEADER, ORIGINAL_DST_HEADER]
            );
            let without = RequestHead {
                no_upstream_headers: true,
                ..h
            };
            assert!(
                Flow::default()
                    .on_request_headers(&mut gate, &vm, &without)
                    .remove
                    .is_empty(),
                "nothing to strip from a request known to carry neither"
            );
        }
    }

    #[test]
    fn unknown_and_non_json_pass_through_or_404() {
        let (_, vm, mut gate) = gate(Config::default());
        assert_eq!(
            Flow::default()
                .on_request_headers(&mut gate, &vm, &head("/v1/models"))
                .step,
            Step::Forward
        );
        let text = RequestHead {
            content_type: Some("text/plain"),
            ..head("/v1/completions")
        };
        assert_eq!(
            Flow::default()
                .on_request_headers(&mut gate, &vm, &text)
                .step,
            Step::Forward
        );
        gate.config.passthrough_unknown = false;
        let d = Flow::default().on_request_headers(&mut gate, &vm, &head("/v1/models"));
        assert!(matches!(d.step, Step::Reply(r) if r.status == 404));
    }

    #[test]
    fn oversize_and_empty_bodies_answer_locally() {
        let (_, vm, mut gate) = gate(Config::default());
        let big = RequestHead {
            content_length: Some(2 << 20),
            ..head("/v1/completions")
        };
        assert!(
            matches!(Flow::default().on_request_headers(&mut gate, &vm, &big).step, Step::Reply(r) if r.status == 413)
        );
        let mut f = Flow::default();
        assert_eq!(
            f.on_request_headers(&mut gate, &vm, &head("/v1/completions"))
                .step,
            Step::WaitForBody
        );
        assert!(f.on_body_progress(&gate, 10).is_none());
        assert!(
            matches!(f.on_body_progress(&gate, 2 << 20).map(|d| d.step), Some(Step::Reply(r)) if r.status == 413)
        );
        let empty = RequestHead {
            end_of_stream: true,
            ..head("/v1/completions")
        };
        assert!(
            matches!(Flow::default().on_request_headers(&mut gate, &vm, &empty).step, Step::Reply(r) if r.status == 400)
        );
        // A body encoded on its way (a client compressing it) cannot be read: 415, naming the
        // coding and the fix, before any of it is buffered; `identity` is no coding, and a path
        // kvgate does not read goes on as it is.
        let encoded = |coding, path| RequestHead {
            content_encoding: Some(coding),
            ..head(path)
        };
        let d =
            Flow::default().on_request_headers(&mut gate, &vm, &encoded("gzip", "/v1/completions"));
        let Step::Reply(r) = d.step else {
            panic!("an encoded body is answered")
        };
        let message = String::from_utf8_lossy(&r.body).into_owned();
        assert!(
            r.status == 415
                && message.contains("content-encoding: gzip")
                && message.contains("decompressor"),
            "{message}"
        );
        for (coding, path) in [
            (" Identity", "/v1/completions"),
            ("", "/v1/completions"),
            ("gzip", "/other"),
        ] {
            let step = Flow::default()
                .on_request_headers(&mut gate, &vm, &encoded(coding, path))
                .step;
            assert!(
                matches!(step, Step::WaitForBody | Step::Forward),
                "{coding:?} {path}: {step:?}"
            );
        }
    }

    #[test]
    fn malformed_body_is_400_and_valid_one_forwards_with_debug_headers() {
        let (_, vm, mut gate) = gate(Config {
            debug_headers: true,
            ..crate::test_support::with_pods(&["10.0.0.1:80"])
        });
        let mut f = Flow::default();
        f.on_request_headers(&mut gate, &vm, &head("/v1/chat/completions"));
        let d = f.on_body(&mut gate, &vm, b"{oops");
        assert!(matches!(d.step, Step::Reply(r) if r.status == 400));

        let mut f = Flow::default();
        f.on_request_headers(&mut gate, &vm, &head("/v1/chat/completions"));
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":20}"#;
        let d = f.on_body(&mut gate, &vm, body);
        assert_eq!(d.step, Step::Forward);
        assert_eq!(
            d.set,
            vec![
                (DESTINATION_HEADER.to_string(), "10.0.0.1:80".to_string()),
                ("x-gateway-model-name".to_string(), "m".to_string())
            ]
        );
        assert_eq!(d.body, None, "no rename, no new body");
        let headers = f.on_response_headers(
            &mut gate,
            &vm,
            Some("application/json"),
            Some("10.0.0.1:80"),
        );
        let get = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(get("x-kvgate-cost").as_deref(), Some("64"));
        assert_eq!(get("x-kvgate-pod").as_deref(), Some("10.0.0.1:80"));
        // The one candidate, its cost and the six terms it sums: 1 block to compute (×2), the
        // 1 + 2 blocks its decode steps read (×0.2) and add to memory (×0.05), no queue, no kv,
        // no adapter.
        assert_eq!(
            get("x-kvgate-ranking").as_deref(),
            Some("10.0.0.1:80 3=2+1+0+0+0+0")
        );
        // The same report for the access log, once.
        assert_eq!(
            f.take_access_log(|| 0).as_deref(),
            Some(
                r#"model=m prompt_tokens=5 output_tokens=20 cost=64 pod=10.0.0.1:80 prefix_blocks=0/1 ranking="10.0.0.1:80 3=2+1+0+0+0+0""#
            )
        );
        assert_eq!(f.take_access_log(|| 0), None);
        f.on_response_body(
            &mut gate,
            &vm,
            br#"{"usage":{"prompt_tokens":9,"completion_tokens":20}}"#,
        );
        f.on_done(&mut gate, &vm);
        f.on_done(&mut gate, &vm);
        let rec = crate::pods::record::read(&vm, "10.0.0.1:80").unwrap();
        assert_eq!(
            (rec.held_tokens(), rec.entries.len()),
            (0, 0),
            "released once"
        );
    }

    /// An Anthropic Messages request is routed and admitted as a chat is: its reservation held
    /// while it streams, its usage read in its own names, released once; its errors come in its
    /// API's shape (every other API's stay OpenAI's).
    #[test]
    fn an_anthropic_messages_request_is_routed_admitted_and_answered_in_its_shape() {
        let pod = "10.0.0.1:80";
        let (_, vm, mut gate) = gate(crate::test_support::with_pods(&[pod]));
        let mut f = Flow::default();
        f.on_request_headers(&mut gate, &vm, &head("/v1/messages"));
        let d = f.on_body(
            &mut gate,
            &vm,
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        );
        let d = f.shaped(d);
        let Step::Reply(r) = &d.step else {
            panic!("{d:?}")
        };
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!((r.status, &v["type"]), (400, &serde_json::json!("error")));
        assert_eq!(v["error"]["type"], "invalid_request_error");

        let mut f = Flow::default();
        f.on_request_headers(&mut gate, &vm, &head("/v1/messages"));
        let body = br#"{"model":"m","max_tokens":20,"stream":true,"system":"Be brief.","messages":[{"role":"user","content":"hello there"}]}"#;
        let d = f.on_body(&mut gate, &vm, body);
        let d = f.shaped(d);
        assert_eq!(d.step, Step::Forward);
        assert!(d
            .set
            .contains(&(DESTINATION_HEADER.to_string(), pod.to_string())));
        let held = || {
            let rec = crate::pods::record::read(&vm, pod).unwrap();
            (rec.entries.len(), rec.held_tokens())
        };
        assert!(matches!(held(), (1, h) if h > 0), "{:?}", held());
        f.on_response_headers(&mut gate, &vm, Some("text/event-stream"), Some(pod));
        f.on_response_body(&mut gate, &vm, concat!(
            "event: content_block_delta\n",
            "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n",
            "event: message_delta\n",
            "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"input_tokens\":9,\"output_tokens\":1}}\n\n",
        ).as_bytes());
        f.on_done(&mut gate, &vm);
        f.on_done(&mut gate, &vm);
        assert_eq!(held(), (0, 0), "released once");
        // Its usage read in its own names: 9 tokens in, 1 out.
        assert_eq!(gate.stats.take_count(stats::USAGE_TOTAL_TOKENS), 10);
        // A chat's errors stay OpenAI's.
        let mut f = Flow::default();
        f.on_request_headers(&mut gate, &vm, &head("/v1/chat/completions"));
        let d = f.on_body(&mut gate, &vm, b"{oops");
        let d = f.shaped(d);
        assert!(matches!(&d.step, Step::Reply(r) if r.body.starts_with(b"{\"error\"")));
    }

    /// The engines' own generate APIs are routed and admitted as completions are: SGLang's
    /// `/generate` stream metered by its `meta_info` counts, vLLM's `/inference/v1/generate`
    /// answer by its usage; each released once. A path that only ends alike passes unread.
    #[test]
    fn the_engines_generate_apis_are_routed_admitted_and_metered() {
        let pod = "10.0.0.1:80";
        let (_, vm, mut gate) = gate(crate::test_support::with_pods(&[pod]));
        let held = || {
            let rec = crate::pods::record::read(&vm, pod).unwrap();
            (rec.entries.len(), rec.held_tokens())
        };
        let mut f = Flow::default();
        f.on_request_headers(&mut gate, &vm, &head("/generate"));
        let body =
            br#"{"text":"hello there","sampling_params":{"max_new_tokens":20},"stream":true}"#;
        let d = f.on_body(&mut gate, &vm, body);
        assert_eq!(d.step, Step::Forward);
        assert!(d
            .set
            .contains(&(DESTINATION_HEADER.to_string(), pod.to_string())));
        assert!(matches!(held(), (1, h) if h > 0), "{:?}", held());
        f.on_response_headers(&mut gate, &vm, Some("text/event-stream"), Some(pod));
        f.on_response_body(&mut gate, &vm, concat!(
            "data: {\"text\":\"Hi\",\"output_ids\":[5],\"meta_info\":{\"id\":\"r\",\"finish_reason\":null,\"prompt_tokens\":9,\"completion_tokens\":1,\"cached_tokens\":0}}\n\n",
            "data: {\"text\":\"Hi!\",\"output_ids\":[5,6],\"meta_info\":{\"id\":\"r\",\"finish_reason\":{\"type\":\"stop\",\"matched\":2},\"prompt_tokens\":9,\"completion_tokens\":2,\"cached_tokens\":0}}\n\n",
            "data: [DONE]\n\n",
        ).as_bytes());
        f.on_done(&mut gate, &vm);
        f.on_done(&mut gate, &vm);
        assert_eq!(held(), (0, 0), "released once");
        assert_eq!(gate.stats.take_count(stats::USAGE_TOTAL_TOKENS), 11);

        let mut f = Flow::default();
        f.on_request_headers(&mut gate, &vm, &head("/inference/v1/generate"));
        let body = br#"{"token_ids":[1,2,3,4],"sampling_params":{"max_tokens":8}}"#;
        assert_eq!(f.on_body(&mut gate, &vm, body).step, Step::Forward);
        assert!(matches!(held(), (1, h) if h > 0), "{:?}", held());
        f.on_response_headers(&mut gate, &vm, Some("application/json"), Some(pod));
        f.on_response_body(
            &mut gate,
            &vm,
            br#"{"request_id":"generate-tokens-1","choices":[{"index":0,"finish_reason":"length","token_ids":[9,9,9,9,9,9,9,9]}],"usage":{"prompt_tokens":4,"completion_tokens":8,"total_tokens":12}}"#,
        );
        f.on_done(&mut gate, &vm);
        assert_eq!(held(), (0, 0), "released once");
        assert_eq!(gate.stats.take_count(stats::USAGE_TOTAL_TOKENS), 12);

        let mut f = Flow::default();
        let d = f.on_request_headers(&mut gate, &vm, &head("/api/generate"));
        assert!(!f.wants_body(), "{d:?}");
    }

    /// A prompt's cached blocks are the engine's under the salt it keys them by, which vLLM
    /// takes from the `X-Cache-Salt` header over the body's `cache_salt`: a request of another
    /// salt holds its whole prompt beside one in flight with the same text, and one of the same
    /// salt only what it adds.
    #[test]
    fn the_cache_salt_header_keys_a_prompts_blocks_over_the_body() {
        let pod = "10.0.0.1:80";
        let (_, vm, mut gate) = gate(crate::test_support::with_pods(&[pod]));
        let system = "You answer questions about the fleet's schedules. ".repeat(60);
        let body = |salt: &str| {
            format!(
                r#"{{"model":"m","max_tokens":10,"cache_salt":"{salt}","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"When?"}}]}}"#
            )
        };
        let mut open = Vec::new();
        let mut send = |header: Option<&str>, body: String| {
            let mut f = Flow::default();
            let mut h = head("/v1/chat/completions");
            h.cache_salt = header;
            f.on_request_headers(&mut gate, &vm, &h);
            let held = || crate::pods::record::read(&vm, pod).map_or(0, |r| r.held_tokens());
            let before = held();
            assert_eq!(
                f.on_body(&mut gate, &vm, body.as_bytes()).step,
                Step::Forward
            );
            open.push(f);
            held() - before
        };
        let first = send(Some("tenant-a"), body("x"));
        // The body's salt is the same, the header's another: nothing shared.
        let other = send(Some("tenant-b"), body("x"));
        assert!(other + 16 >= first, "{other} vs {first}");
        // The same header's salt, whatever the body says: the prompt's blocks are shared.
        let same = send(Some("tenant-a"), body("y"));
        assert!(same * 4 < first, "{same} vs {first}");
        // No header, or an empty one: the body's salt (the same text, the same namespace).
        let unsalted = send(Some(""), body("z"));
        assert!(unsalted + 16 >= first, "{unsalted} vs {first}");
        let bodys = send(None, body("tenant-a"));
        assert!(bodys * 4 < first, "{bodys} vs {first}");
    }

    /// An SGLang `/generate` names its adapter by `lora_path`: counted as that adapter where the
    /// pods serve it, as the engine's own model where none does.
    #[test]
    fn an_sglang_generates_adapter_is_its_model_where_the_pods_serve_it() {
        let pod = "10.0.0.1:80";
        let (_, vm, mut gate) = gate(crate::test_support::with_pods(&[pod]));
        let list = [("base", None), ("sql", Some("base".to_string()))].map(|(id, parent)| {
            crate::models::served::ServedModel {
                id: id.to_string(),
                parent,
            }
        });
        crate::models::served::write_list(&vm, pod, &list, 1).unwrap();
        let model = |gate: &mut Gate, lora: &str| {
            let mut f = Flow::default();
            f.on_request_headers(gate, &vm, &head("/generate"));
            let body = format!(r#"{{"text":"hi","lora_path":"{lora}"}}"#);
            let d = f.on_body(gate, &vm, body.as_bytes());
            assert_eq!(d.step, Step::Forward, "{d:?}");
            let model = f.admitted.as_ref().map(|a| a.model.clone());
            f.on_done(gate, &vm);
            model
        };
        assert_eq!(model(&mut gate, "sql").as_deref(), Some("sql"));
        // A path, or a name no pod lists: the engine resolves it, kvgate counts the base.
        assert_eq!(model(&mut gate, "/adapters/sql").as_deref(), Some("base"));
    }

    fn served(vm: &crate::store::fake_host::FakeVm, pod: &str, models: &[&str]) {
        let list: Vec<_> = models
            .iter()
            .map(|m| crate::models::served::ServedModel {
                id: m.to_string(),
                parent: None,
            })
            .collect();
        crate::models::served::write_list(vm, pod, &list, 1).unwrap();
    }

    fn send(gate: &mut Gate, vm: &crate::store::fake_host::FakeVm, body: &str) -> Decision {
        let mut f = Flow::default();
        f.on_request_headers(gate, vm, &head("/v1/chat/completions"));
        f.on_body(gate, vm, body.as_bytes())
    }

    #[test]
    fn a_model_no_pod_lists_is_answered_404_naming_it_and_others_go_to_their_pods() {
        let (host, vm, mut gate) = gate(crate::test_support::with_pods(&[
            "10.0.0.1:80",
            "10.0.0.2:80",
        ]));
        let chat = |model: &str| {
            format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]}}"#)
        };
        // Before any list is known every pod is eligible, as without model scraping.
        assert_eq!(send(&mut gate, &vm, &chat("nope")).step, Step::Forward);
        served(&vm, "10.0.0.1:80", &["a"]);
        served(&vm, "10.0.0.2:80", &["b"]);
        host.advance_ms(1_000);
        let d = send(&mut gate, &vm, &chat("nope"));
        let Step::Reply(r) = d.step else {
            panic!("{d:?}")
        };
        let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(
            (r.status, body["error"]["param"].as_str()),
            (404, Some("model"))
        );
        assert!(body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`nope`"));
        for _ in 0..10 {
            let d = send(&mut gate, &vm, &chat("b"));
            assert!(d
                .set
                .contains(&(DESTINATION_HEADER.into(), "10.0.0.2:80".into())));
        }
    }

    #[test]
    fn a_rename_rewrites_the_body_and_its_length_and_names_the_target() {
        let mut config = Config {
            debug_headers: true,
            ..crate::test_support::with_pods(&["10.0.0.1:80"])
        };
        let route: crate::config::ModelRoute =
            serde_json::from_str(r#"{"targets":[{"model":"llama-v2","weight":1}],"priority":7}"#)
                .unwrap();
        config.models.routes.insert("llama".into(), route);
        let (_, vm, mut gate) = gate(config);
        let body = r#"{"model":"llama","messages":[{"role":"user","content":"hi"}]}"#;
        let mut f = Flow::default();
        f.on_request_headers(&mut gate, &vm, &head("/v1/chat/completions"));
        assert_eq!(f.class.priority, 0);
        let d = f.on_body(&mut gate, &vm, body.as_bytes());
        assert_eq!(f.class.priority, 7, "the model's default band");
        let new_body = d.body.clone().unwrap();
        assert_eq!(
            new_body,
            body.replace("\"llama\"", "\"llama-v2\"").into_bytes()
        );
        let set = |name: &str| {
            d.set
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(set("content-length"), Some(new_body.len().to_string()));
        assert_eq!(set("x-gateway-model-name").as_deref(), Some("llama-v2"));
        let headers = f.on_response_headers(&mut gate, &vm, None, Some("10.0.0.1:80"));
        assert!(headers.contains(&("x-kvgate-model", "llama".into())));
        assert!(headers.contains(&("x-kvgate-target-model", "llama-v2".into())));
        let counted: Vec<_> = gate.stats.drain().collect();
        for name in [
            "kvgate.models.rewritten",
            "kvgate.model.llama_v2.requests",
            "kvgate.model.llama_v2.picks",
        ] {
            assert!(
                counted.contains(&stats::Stat::Counter(name.into(), 1)),
                "{name}: {counted:?}"
            );
        }
    }

    #[test]
    fn model_header_values_cannot_carry_odd_bytes() {
        assert_eq!(header_value("org/llama-3.1:lora_1"), "org/llama-3.1:lora_1");
        assert_eq!(header_value("a b%\r\né"), "a%20b%25%0D%0A%C3%A9");
    }
}
