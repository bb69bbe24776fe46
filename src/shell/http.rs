//! The HTTP context: moves one request's headers and bodies between Envoy and `flow::Flow`, and
//! turns its decisions into host actions. It holds no logic of its own. A request that must wait
//! is registered in `Parked`, where the root context finds it when the line moves.

use super::host::{self, HostStore};
use crate::drive::{self, Next};
use crate::flow::{Decision, Flow, Gate, Head, Step};
use hashbrown::HashMap;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use std::cell::RefCell;
use std::rc::Rc;

/// Requests of this VM waiting in the line: ticket → (context id, its flow).
pub type Parked = Rc<RefCell<HashMap<u64, (u32, Rc<RefCell<Flow>>)>>>;

/// Carries out a decision on the current (effective) stream. Returns the action for a callback;
/// `resume` is for a request parked earlier, which must be resumed explicitly.
pub fn apply(d: Decision, resume: bool) -> Action {
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
    flow: Rc<RefCell<Flow>>,
}

impl Http {
    pub fn new(id: u32, gate: Rc<RefCell<Gate>>, parked: Parked) -> Self {
        Self {
            id,
            gate,
            parked,
            flow: Rc::new(RefCell::new(Flow::default())),
        }
    }

    fn act(&self, d: Decision) -> Action {
        if let Step::Park(ticket) = d.step {
            self.parked
                .borrow_mut()
                .insert(ticket, (self.id, self.flow.clone()));
        }
        apply(d, false)
    }
}

impl Context for Http {
    fn on_done(&mut self) -> bool {
        self.parked.borrow_mut().retain(|_, (id, _)| *id != self.id);
        let mut gate = self.gate.borrow_mut();
        self.flow.borrow_mut().on_done(&mut gate, &HostStore);
        host::flush_stats(&mut gate.stats);
        true
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let gate = self.gate.borrow();
        let a = &gate.config.admission;
        let read = |name: &str| {
            (!name.is_empty())
                .then(|| host::request_header(name))
                .flatten()
        };
        let method = host::request_header(":method").unwrap_or_default();
        let path = host::request_header(":path").unwrap_or_default();
        let content_type = host::request_header("content-type");
        let content_length =
            host::request_header("content-length").and_then(|v| v.trim().parse().ok());
        let (objective, priority) = (read(&a.objective_header), read(&a.priority_header));
        let (tenant, session) = (read(&a.tenant_header), read(&a.session_header));
        // One host call less per request while the status page is off (its only reader).
        let accept = (!gate.config.status_path.is_empty())
            .then(|| host::request_header("accept"))
            .flatten();
        let head = Head {
            method: &method,
            path: &path,
            content_type: content_type.as_deref(),
            content_length,
            end_of_stream,
            accept: accept.as_deref(),
            objective: objective.as_deref(),
            priority: priority.as_deref(),
            tenant: tenant.as_deref(),
            session: session.as_deref(),
        };
        let decision = self
            .flow
            .borrow_mut()
            .on_request_headers(&gate, &HostStore, &head);
        drop(gate);
        self.act(decision)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
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
            return Action::Pause;
        }
        let body = host::request_body(body_size);
        let mut decision = {
            let mut gate = self.gate.borrow_mut();
            let d = self.flow.borrow_mut().on_body(&mut gate, &HostStore, &body);
            host::flush_stats(&mut gate.stats);
            d
        };
        // Only here, in the body callback itself, is the buffered body the stream's to replace.
        if let Some(new_body) = decision.body.take() {
            host::replace_request_body(body_size, &new_body);
        }
        self.act(decision)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let content_type = host::response_header("content-type");
        let served_by = host::upstream_address();
        let add = self.flow.borrow_mut().on_response_headers(
            &mut self.gate.borrow_mut(),
            &HostStore,
            content_type.as_deref(),
            served_by.as_deref(),
        );
        for (name, value) in &add {
            host::set_response_header(name, value);
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
        if !self.flow.borrow().reads_response() {
            return Action::Continue;
        }
        // Envoy hands each chunk as the buffer's whole content when the filter does not pause.
        let bytes = host::response_body(body_size);
        self.flow
            .borrow_mut()
            .on_response_body(&mut self.gate.borrow_mut(), &HostStore, &bytes);
        Action::Continue
    }
}
