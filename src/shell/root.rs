//! The root context of one VM: parses the plugin configuration, creates HTTP contexts that share
//! this VM's `Gate`, runs the tick (lease, scrapes, discovery) and delivers callout answers.

use super::host::{self, HostStore};
use super::http::Http;
use crate::config::Config;
use crate::flow::{Gate, TICK_MS};
use crate::scrape::Target;
use hashbrown::HashMap;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use std::cell::RefCell;
use std::rc::Rc;

#[derive(Default)]
pub struct Root {
    gate: Option<Rc<RefCell<Gate>>>,
    calls: HashMap<u32, Target>,
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        let (Some(target), Some(gate)) = (self.calls.remove(&token), &self.gate) else {
            return;
        };
        let (status, body) = host::call_response(body_size);
        let mut gate = gate.borrow_mut();
        gate.on_call_response(&HostStore, &target, status, &body);
        host::flush_stats(&mut gate.stats);
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let config = match Config::parse(&host::plugin_configuration()) {
            Ok(config) => config,
            Err(e) => {
                log::error!("{e}");
                return false;
            }
        };
        match Gate::new(config, &HostStore) {
            Ok(gate) => {
                self.gate = Some(Rc::new(RefCell::new(gate)));
                host::set_tick_period(TICK_MS);
                true
            }
            Err(e) => {
                log::error!("kvgate: shared data unavailable at configure: {e:?}");
                false
            }
        }
    }

    fn on_tick(&mut self) {
        let Some(gate) = &self.gate else {
            return;
        };
        let mut gate = gate.borrow_mut();
        for call in gate.on_tick(&HostStore) {
            match host::dispatch_get(&call.cluster, &call.path, &call.headers, call.timeout_ms) {
                Some(token) => {
                    self.calls.insert(token, call.target);
                }
                None => {
                    log::warn!(
                        "kvgate: cannot call cluster `{}` (is it defined?)",
                        call.cluster
                    );
                    gate.on_call_failed(&call.target);
                }
            }
        }
        host::flush_stats(&mut gate.stats);
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let gate = self.gate.clone()?;
        Some(Box::new(Http::new(gate)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
