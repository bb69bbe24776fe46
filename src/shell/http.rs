//! The HTTP context: moves one request's headers and bodies between Envoy and `flow::Flow`, and
//! turns its decisions into host actions. It holds no logic of its own.

use super::host::{self, HostStore};
use crate::flow::{Decision, Flow, Gate, Head, Step};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use std::cell::RefCell;
use std::rc::Rc;

pub struct Http {
    gate: Rc<RefCell<Gate>>,
    flow: Flow,
}

impl Http {
    pub fn new(gate: Rc<RefCell<Gate>>) -> Self {
        Self {
            gate,
            flow: Flow::default(),
        }
    }

    fn apply(&self, d: Decision) -> Action {
        for name in &d.remove {
            host::remove_request_header(name);
        }
        for (name, value) in &d.set {
            host::set_request_header(name, value);
        }
        match d.step {
            Step::Forward => Action::Continue,
            Step::WaitForBody => Action::Pause,
            Step::Reply(reply) => {
                host::send_reply(&reply);
                Action::Pause
            }
        }
    }
}

impl Context for Http {
    fn on_done(&mut self) -> bool {
        let mut gate = self.gate.borrow_mut();
        self.flow.on_done(&mut gate, &HostStore);
        host::flush_stats(&mut gate.stats);
        true
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let method = host::request_header(":method").unwrap_or_default();
        let path = host::request_header(":path").unwrap_or_default();
        let content_type = host::request_header("content-type");
        let content_length =
            host::request_header("content-length").and_then(|v| v.trim().parse().ok());
        let head = Head {
            method: &method,
            path: &path,
            content_type: content_type.as_deref(),
            content_length,
            end_of_stream,
        };
        let decision = self.flow.on_request_headers(&self.gate.borrow(), &head);
        self.apply(decision)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.flow.wants_body() {
            return Action::Continue;
        }
        if let Some(d) = self
            .flow
            .on_body_progress(&self.gate.borrow(), body_size as u64)
        {
            return self.apply(d);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = host::request_body(body_size);
        let decision = self
            .flow
            .on_body(&mut self.gate.borrow_mut(), &HostStore, &body);
        self.apply(decision)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let content_type = host::response_header("content-type");
        let served_by = host::upstream_address();
        let add = self.flow.on_response_headers(
            &mut self.gate.borrow_mut(),
            &HostStore,
            content_type.as_deref(),
            served_by.as_deref(),
        );
        for (name, value) in &add {
            host::add_response_header(name, value);
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
        if !self.flow.reads_response() {
            return Action::Continue;
        }
        // Envoy hands each chunk as the buffer's whole content when the filter does not pause.
        let bytes = host::response_body(body_size);
        self.flow
            .on_response_body(&mut self.gate.borrow_mut(), &HostStore, &bytes);
        Action::Continue
    }
}
