//! The HTTP context: moves one request's headers and bodies between Envoy and `flow::Flow`, and
//! turns its decisions into host actions. It holds no logic of its own. A request that must wait
//! is registered in `Parked`, where the root context finds it when the line moves (or in `Held`,
//! where its tick does).

use super::host::{self, HostStore};
use super::raw;
use crate::drive::{self, Next};
use crate::flow::{
    Decision, Flow, Gate, RequestHead, Step, DESTINATION_HEADER, ORIGINAL_DST_HEADER,
};
use crate::pods::scrape::Target;
use crate::stats;
use crate::store::interface::Store;
use hashbrown::HashMap;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use std::cell::RefCell;
use std::rc::Rc;

thread_local! {
    /// HTTP contexts of this VM not yet done: while others are open, a finished request's stats
    /// may wait for a batched send (`host::flush_stats_batched`).
    static OPEN: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Requests of this VM waiting in the line: ticket → (context id, its flow).
pub type Parked = Rc<RefCell<HashMap<u64, (u32, Rc<RefCell<Flow>>)>>>;

/// Requests of this VM held for another gateway replica's note of the stored response they name
/// (`Step::Hold`): context id → its flow, for the root's tick to ask again (`Flow::sought`).
pub type Held = Rc<RefCell<HashMap<u32, Rc<RefCell<Flow>>>>>;

/// Requests of this VM whose answers do not stream, from their admission to their end: context
/// id → its flow, for the root's tick to grow their entries (`Flow::on_tick`).
pub type Unseen = Rc<RefCell<HashMap<u32, Rc<RefCell<Flow>>>>>;

/// Puts the request in `unseen` if it was admitted with an answer that does not stream: from its
/// body callback, or from the tick that let it go on after it was held (`Root::run_held`); or,
/// for an answer that comes encoded, from its response headers (`Flow::on_response_encoded`).
/// Returns whether it did.
pub fn watch_unseen(unseen: &Unseen, context: u32, flow: &Rc<RefCell<Flow>>) -> bool {
    let watched = flow.borrow().answers_unseen();
    if watched {
        unseen.borrow_mut().insert(context, flow.clone());
    }
    watched
}

/// A held request's decision has come (`Flow::sought`, from the root's tick, or
/// `Flow::answered`, from a pod's answer in the request's own context): it leaves `held`, and
/// the decision is carried out on the current stream, resumed.
pub fn release_held(
    (held, parked, unseen): (&Held, &Parked, &Unseen),
    context: u32,
    flow: &Rc<RefCell<Flow>>,
    decision: Decision,
) {
    held.borrow_mut().remove(&context);
    watch_unseen(unseen, context, flow);
    if let Step::Park(ticket) = decision.step {
        parked.borrow_mut().insert(ticket, (context, flow.clone()));
    }
    apply(flow, decision, true);
}

/// Carries out a decision on the request's `flow`, the current (effective) stream's, in the shape
/// its API answers in (`Flow::shaped`). Returns the action for a callback; `resume` is for a
/// request parked earlier, which must be resumed explicitly.
pub fn apply(flow: &RefCell<Flow>, d: Decision, resume: bool) -> Action {
    // Never borrowed at this point (each caller's borrow ended with the decision); were it, the
    // decision goes unshaped rather than the VM panicking.
    let d = match flow.try_borrow_mut() {
        Ok(mut flow) => flow.shaped(d),
        Err(_) => d,
    };
    for name in &d.remove {
        host::remove_request_header(name);
    }
    for (name, value) in &d.set {
        host::set_request_header(name, value);
    }
    match drive::next(&d.step, resume) {
        Next::Continue => Action::Continue,
        Next::Resume => {
            host::resume_request();
            Action::Continue
        }
        Next::Pause => Action::Pause,
        Next::Reply(reply) => {
            host::send_reply(reply);
            Action::Pause
        }
    }
}

pub struct Http {
    id: u32,
    gate: Rc<RefCell<Gate>>,
    parked: Parked,
    held: Held,
    unseen: Unseen,
    flow: Rc<RefCell<Flow>>,
    /// Calls out asking pods for the stored response the request is held for: token → pod.
    asks: HashMap<u32, String>,
    /// Host calls this request's callbacks have made so far (`raw::calls`).
    host_calls: u64,
    /// The body buffered so far, in bytes, for a request that ends in trailers.
    buffered: usize,
}

impl Http {
    pub fn new(
        id: u32,
        gate: Rc<RefCell<Gate>>,
        parked: Parked,
        held: Held,
        unseen: Unseen,
    ) -> Self {
        OPEN.with(|n| n.set(n.get() + 1));
        Self {
            id,
            gate,
            parked,
            held,
            unseen,
            flow: Rc::new(RefCell::new(Flow::default())),
            asks: HashMap::new(),
            host_calls: 0,
            buffered: 0,
        }
    }

    /// Runs one callback, charging this request with the host calls it makes.
    fn counted<R>(&mut self, callback: impl FnOnce(&mut Self) -> R) -> R {
        let before = raw::calls();
        let r = callback(self);
        self.host_calls += raw::calls().wrapping_sub(before);
        r
    }

    fn act(&mut self, d: Decision) -> Action {
        if let Step::Park(ticket) = d.step {
            self.parked
                .borrow_mut()
                .insert(ticket, (self.id, self.flow.clone()));
            // A request that waits for its prefix's pod needs the quick tick from now.
            host::retick(&mut self.gate.borrow_mut());
        }
        if d.step == Step::Hold {
            self.held.borrow_mut().insert(self.id, self.flow.clone());
            self.send_asks();
            host::retick(&mut self.gate.borrow_mut());
        }
        apply(&self.flow, d, false)
    }

    /// Sends the calls asking the pods for the stored response the request is held for; their
    /// answers come to this context (`on_http_call_response`). One that cannot be sent counts as
    /// no answer.
    fn send_asks(&mut self) {
        if !self.flow.borrow().has_asks() {
            return;
        }
        let authorization = host::request_header("authorization");
        let calls = self.flow.borrow_mut().take_asks(authorization.as_deref());
        for call in calls {
            let Target::Stored(pod) = &call.target else {
                continue;
            };
            match host::send(&call) {
                Some(token) => {
                    self.asks.insert(token, pod.clone());
                }
                // Its decision comes at the tick: this callback's is the hold.
                None => self.flow.borrow_mut().unasked(pod),
            }
        }
    }

    /// A pod's answer to whether it stores the response the request is held for.
    fn ask_answered(&mut self, token: u32, headers: usize, body_size: usize) {
        let Some(pod) = self.asks.remove(&token) else {
            return;
        };
        // No headers: the call failed (reset, timeout); the host then refuses to read them.
        let (status, body) = if headers == 0 {
            (None, Vec::new())
        } else {
            host::call_response(body_size)
        };
        let decision = {
            let mut gate = self.gate.borrow_mut();
            self.flow
                .borrow_mut()
                .answered(&mut gate, &HostStore::default(), &pod, status, &body)
        };
        if let Some(decision) = decision {
            let lists = (&self.held, &self.parked, &self.unseen);
            release_held(lists, self.id, &self.flow, decision);
            host::retick(&mut self.gate.borrow_mut());
        }
    }
}

impl Context for Http {
    fn on_http_call_response(
        &mut self,
        token: u32,
        headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        self.counted(|s| s.ask_answered(token, headers, body_size));
    }

    fn on_done(&mut self) -> bool {
        self.parked.borrow_mut().retain(|_, (id, _)| *id != self.id);
        self.held.borrow_mut().remove(&self.id);
        self.unseen.borrow_mut().remove(&self.id);
        let open = OPEN.with(|n| {
            n.set(n.get().saturating_sub(1));
            n.get()
        });
        let before = raw::calls();
        let mut gate = self.gate.borrow_mut();
        let store = HostStore::default();
        self.flow.borrow_mut().on_done(&mut gate, &store);
        let now = store.now_ms();
        // What a batched send costs is spread over the requests it carries; this sample counts
        // the request's own calls so far and the one that records it.
        let calls = self.host_calls + raw::calls().wrapping_sub(before) + 1;
        gate.stats.histogram(stats::REQUEST_HOST_CALLS, calls);
        host::flush_stats_batched(&mut gate.stats, now, open > 0);
        true
    }
}

/// The callbacks' bodies; each runs inside `counted`.
impl Http {
    fn request_headers(&mut self, end_of_stream: bool) -> Action {
        let gate = self.gate.borrow();
        let a = &gate.config.admission;
        let headers = host::request_headers();
        let read = |name: &str| (!name.is_empty()).then(|| headers.get(name)).flatten();
        let method = headers.get(":method").unwrap_or_default();
        let path = headers.get(":path").unwrap_or_default();
        let content_type = headers.get("content-type");
        let content_length = headers
            .get("content-length")
            .and_then(|v| v.trim().parse().ok());
        let (objective, priority) = (read(&a.objective_header), read(&a.priority_header));
        let (tenant, session) = (read(&a.tenant_header), read(&a.session_header));
        let ttft_objective = read(&a.ttft_objective_header);
        let cache_salt = read(&gate.config.routing.cache_salt_header);
        let content_encoding = headers.get("content-encoding");
        let accept = headers.get("accept");
        let no_upstream_headers = headers.lacks(&[DESTINATION_HEADER, ORIGINAL_DST_HEADER]);
        let head = RequestHead {
            method,
            path,
            content_type,
            content_length,
            end_of_stream,
            accept,
            objective,
            priority,
            tenant,
            session,
            ttft_objective,
            cache_salt,
            content_encoding,
            no_upstream_headers,
        };
        drop(gate);
        let decision = self.flow.borrow_mut().on_request_headers(
            &mut self.gate.borrow_mut(),
            &HostStore::default(),
            &head,
        );
        self.act(decision)
    }

    fn request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.held.borrow().contains_key(&self.id) {
            // Held at its headers (a `/cancel` with a body): buffered until the root decides,
            // as a Continue here would send it on undecided.
            return Action::Pause;
        }
        if !self.flow.borrow().wants_body() {
            return Action::Continue;
        }
        let progress = self
            .flow
            .borrow()
            .on_body_progress(&self.gate.borrow(), body_size as u64);
        if let Some(d) = progress {
            return self.act(d);
        }
        if !end_of_stream {
            self.buffered = body_size;
            return Action::Pause;
        }
        self.whole_body(body_size)
    }

    /// The request ends in trailers (an HTTP/2 client's, or those Envoy's decompressor filter
    /// adds after the body it inflated): its body callbacks all said more was to come, so the
    /// body is read and decided here, where it ends. Continuing from here undecided would send
    /// it on unrouted and past every budget.
    fn request_trailers(&mut self) -> Action {
        if self.held.borrow().contains_key(&self.id) {
            return Action::Pause;
        }
        if !self.flow.borrow().wants_body() {
            return Action::Continue;
        }
        self.whole_body(self.buffered)
    }

    /// The whole body is buffered (`body_size` bytes): parse, estimate, decide.
    fn whole_body(&mut self, body_size: usize) -> Action {
        let body = host::request_body(body_size);
        let mut decision = {
            let mut gate = self.gate.borrow_mut();
            // Its stats go with the request's last ones, from `on_done`.
            self.flow
                .borrow_mut()
                .on_body(&mut gate, &HostStore::default(), &body)
        };
        if watch_unseen(&self.unseen, self.id, &self.flow) {
            // Its entry grows on the tick, quick from now (`Gate::tick_ms`), not from the next.
            host::retick(&mut self.gate.borrow_mut());
        }
        // Only here, in the callback that ends the body, is the buffered body the stream's to
        // replace.
        if let Some(new_body) = decision.body.take() {
            host::replace_request_body(body_size, &new_body);
        }
        self.act(decision)
    }

    fn response_headers(&mut self) -> Action {
        if !self.flow.borrow().reads_response_headers() {
            return Action::Continue;
        }
        let content_type = host::response_header("content-type");
        let served_by = host::upstream_address();
        let add = self.flow.borrow_mut().on_response_headers(
            &mut self.gate.borrow_mut(),
            &HostStore::default(),
            content_type.as_deref(),
            served_by.as_deref(),
        );
        for (name, value) in &add {
            host::set_response_header(name, value);
        }
        // Absent on nearly every answer, and a header not found costs the call no copy.
        if let Some(coding) = host::response_header("content-encoding") {
            let now_unseen = self
                .flow
                .borrow_mut()
                .on_response_encoded(&mut self.gate.borrow_mut(), &coding);
            if now_unseen && watch_unseen(&self.unseen, self.id, &self.flow) {
                host::retick(&mut self.gate.borrow_mut());
            }
        }
        Action::Continue
    }

    fn response_body(&mut self, body_size: usize) -> Action {
        // An empty piece (the end of a stream Envoy hands on its own) carries nothing to meter:
        // not read, a host call saved on every response.
        if body_size == 0 || !self.flow.borrow().reads_response() {
            return Action::Continue;
        }
        // Envoy hands each chunk as the buffer's whole content when the filter does not pause.
        let bytes = host::response_body(body_size);
        let now_unseen = self.flow.borrow_mut().on_response_body(
            &mut self.gate.borrow_mut(),
            &HostStore::default(),
            &bytes,
        );
        if now_unseen && watch_unseen(&self.unseen, self.id, &self.flow) {
            host::retick(&mut self.gate.borrow_mut());
        }
        Action::Continue
    }
}

impl HttpContext for Http {
    /// Envoy logs the request: kvgate's line goes into the filter state its access log reads.
    fn on_log(&mut self) {
        self.counted(|s| {
            let now = || HostStore::default().now_ms();
            if let Some(line) = s.flow.borrow_mut().take_access_log(now) {
                host::set_access_log(&line);
            }
        });
    }

    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.counted(|s| s.request_headers(end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.counted(|s| s.request_body(body_size, end_of_stream))
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.counted(|s| s.request_trailers())
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        self.counted(|s| s.response_headers())
    }

    fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
        self.counted(|s| s.response_body(body_size))
    }
}
