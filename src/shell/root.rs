//! The root context of one VM: parses the plugin configuration and creates HTTP contexts that
//! share this VM's `Gate`.

use super::host;
use super::http::Http;
use crate::config::Config;
use crate::flow::Gate;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use std::cell::RefCell;
use std::rc::Rc;

#[derive(Default)]
pub struct Root {
    gate: Option<Rc<RefCell<Gate>>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        match Config::parse(&host::plugin_configuration()) {
            Ok(config) => {
                self.gate = Some(Rc::new(RefCell::new(Gate::new(config))));
                true
            }
            Err(e) => {
                log::error!("{e}");
                false
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let gate = self.gate.clone()?;
        Some(Box::new(Http::new(gate)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
