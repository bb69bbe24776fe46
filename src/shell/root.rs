//! The root context of one VM: parses the plugin configuration, creates HTTP contexts that share
//! this VM's `Gate`, runs the tick (lease, scrapes, discovery, the queue's backstop, the growth
//! of this VM's answers that do not stream, requests held for another replica's note) and
//! delivers callout answers and wake-ups to parked requests, which it resumes in their own
//! context.

use super::host::{self, HostStore};
use super::http::{apply, release_held, Held, Http, Parked, Unseen};
use crate::config::Config;
use crate::drive::{self, Waiting};
use crate::flow::{Decision, Flow};
use crate::gate::Gate;
use crate::pods::scrape::{Call, Target};
use hashbrown::HashMap;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use std::cell::RefCell;
use std::rc::Rc;

#[derive(Default)]
pub struct Root {
    gate: Option<Rc<RefCell<Gate>>>,
    calls: HashMap<u32, Target>,
    parked: Parked,
    held: Held,
    unseen: Unseen,
}

impl Root {
    /// Sends the core's callouts; one that cannot be sent is handed back as failed.
    fn send(&mut self, gate: &mut Gate, calls: Vec<Call>) {
        for call in calls {
            match host::send(&call) {
                Some(token) => {
                    self.calls.insert(token, call.target);
                }
                None => gate.on_call_failed(&HostStore::default(), &call.target),
            }
        }
    }

    /// Asks each request held for another replica's note whether it may go on now, and carries
    /// out the decision of those that may, in their own context.
    fn run_held(&self, gate: &mut Gate) {
        let held: Vec<(u32, Rc<RefCell<Flow>>)> = self
            .held
            .borrow()
            .iter()
            .map(|(id, flow)| (*id, flow.clone()))
            .collect();
        let store = HostStore::default();
        for (context, flow) in held {
            // (A stream reset and not yet done is left to its on_done, which forgets it.)
            if !host::switch_to(context) {
                continue;
            }
            let Some(decision) = flow.borrow_mut().sought(gate, &store) else {
                continue;
            };
            // Its tick's retick (`run_line`, next) makes the tick quick for it.
            let lists = (&self.held, &self.parked, &self.unseen);
            release_held(lists, context, &flow, decision);
        }
    }

    /// The line moved: `drive::run_line` decides which parked requests to retry; this VM's
    /// streams carry the decisions out.
    fn run_line(&self, gate: &mut Gate) {
        drive::run_line(gate, &HostStore::default(), &mut self.parked.clone());
        host::flush_stats(&mut gate.stats);
        host::retick(gate);
    }
}

impl Waiting for Parked {
    type Stream = (u32, Rc<RefCell<Flow>>);

    fn find(&self, ticket: u64) -> Option<Self::Stream> {
        self.borrow().get(&ticket).cloned()
    }

    fn unpark(&mut self, ticket: u64) {
        self.borrow_mut().remove(&ticket);
    }

    fn enter(&mut self, (context, _): &Self::Stream) -> bool {
        host::switch_to(*context)
    }

    fn with_flow<R>(&mut self, (_, flow): &Self::Stream, f: impl FnOnce(&mut Flow) -> R) -> R {
        f(&mut flow.borrow_mut())
    }

    fn resume(&mut self, (_, flow): &Self::Stream, decision: Decision) {
        apply(flow, decision, true);
    }
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token: u32,
        headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        let (Some(target), Some(gate)) = (self.calls.remove(&token), self.gate.clone()) else {
            return;
        };
        // No headers: the call failed (reset, timeout, a pod dying mid-answer). The host then
        // refuses to read the response's header map, and the SDK would panic on that refusal.
        let (status, body) = if headers == 0 {
            (None, Vec::new())
        } else {
            host::call_response(body_size)
        };
        let mut gate = gate.borrow_mut();
        let next = gate.on_call_response(&HostStore::default(), &target, status, &body);
        self.send(&mut gate, next);
        host::flush_stats(&mut gate.stats);
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let mut config = match Config::parse(&host::plugin_configuration()) {
            Ok(config) => config,
            Err(e) => {
                log::error!("{e}");
                return false;
            }
        };
        if config.etcd.enabled() && config.etcd.replica_id.is_empty() {
            // Keys are split on `/`: a node id's own slashes become `_`.
            match host::node_id() {
                Some(id) => config.etcd.replica_id = id.replace('/', "_"),
                None => {
                    log::error!(
                        "invalid kvgate config: etcd.replicaId: empty, and Envoy has no node id to take"
                    );
                    return false;
                }
            }
        }
        match Gate::new(config, &HostStore::default()) {
            Ok(mut gate) => {
                log::info!("configured as vm {}", gate.vm());
                host::retick(&mut gate);
                self.gate = Some(Rc::new(RefCell::new(gate)));
                true
            }
            Err(e) => {
                log::error!("shared data unavailable at configure: {e:?}");
                false
            }
        }
    }

    fn on_tick(&mut self) {
        let Some(gate) = self.gate.clone() else {
            return;
        };
        let mut gate = gate.borrow_mut();
        let calls = gate.on_tick(&HostStore::default());
        self.send(&mut gate, calls);
        for flow in self.unseen.borrow().values() {
            flow.borrow_mut().on_tick(&mut gate, &HostStore::default());
        }
        if !self.held.borrow().is_empty() {
            self.run_held(&mut gate);
        }
        self.run_line(&mut gate);
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        let Some(gate) = self.gate.clone() else {
            return;
        };
        let mut gate = gate.borrow_mut();
        if queue_id == gate.wake_queue() {
            self.run_line(&mut gate);
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let gate = self.gate.clone()?;
        Some(Box::new(Http::new(
            context_id,
            gate,
            self.parked.clone(),
            self.held.clone(),
            self.unseen.clone(),
        )))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
