//! The floor of the filter-overhead benchmark (bench/run.py, BENCHMARKS.md *Filter overhead*):
//! what any proxy-wasm filter that routes on the request body must do, and nothing more. It stops
//! the request at its headers, lets Envoy buffer the body, reads the whole body into the VM once
//! it is complete, and sets one request header (as a router sets its pick) before letting the
//! request go. It is built with the same SDK, toolchain and release profile as kvgate and loaded
//! through the same Envoy configuration, so kvgate's figures divided by this one's are what
//! kvgate's own work costs beyond the unavoidable.

#[cfg(target_os = "wasi")]
mod filter {
    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::{Action, ContextType, LogLevel};

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Warn);
        proxy_wasm::set_root_context(|_| Box::new(Root));
    }}

    struct Root;

    impl Context for Root {}

    impl RootContext for Root {
        fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
            Some(Box::new(Floor))
        }

        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }
    }

    struct Floor;

    impl Context for Floor {}

    impl HttpContext for Floor {
        fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
            if end_of_stream {
                return Action::Continue;
            }
            // Routing waits for the body (Envoy: `allow_on_headers_stop_iteration`).
            Action::Pause
        }

        fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
            if !end_of_stream {
                // Envoy keeps buffering; the body is read once, whole.
                return Action::Pause;
            }
            let body = self.get_http_request_body(0, body_size).unwrap_or_default();
            let picked = if body.len().is_multiple_of(2) {
                "even"
            } else {
                "odd"
            };
            self.set_http_request_header("x-floor-pick", Some(picked));
            Action::Continue
        }
    }
}
