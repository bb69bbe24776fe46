//! The floor of the filter-overhead benchmark (bench/run.py, BENCHMARKS.md *Filter overhead*):
//! what any proxy-wasm filter that routes on the request body must do, and nothing more. It stops
//! the request at its headers, lets Envoy buffer the body, reads the whole body into the VM once
//! it is complete, and sets one request header (as a router sets its pick) before letting the
//! request go. It is built with the same SDK, toolchain and release profile as kvgate and loaded
//! through the same Envoy configuration, so kvgate's figures divided by this one's are what
//! kvgate's own work costs beyond the unavoidable.
//!
//! It also prices one host call (`scripts/host_call_cost.py`): with a plugin configuration of the
//! form `<kind> <count>` (see [`Kind`]) it makes that many calls of that kind per request, after
//! reading the body, or, for `response-body`, per chunk of the response (what a filter that meters
//! a streamed answer must do: `scripts/stream_cost.py`). Any other configuration (the benchmark
//! passes kvgate's JSON) leaves it the bare floor.

#[cfg(target_os = "wasi")]
mod filter {
    use proxy_wasm::hostcalls;
    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::{Action, ContextType, LogLevel, MetricType};
    use std::rc::Rc;

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Warn);
        proxy_wasm::set_root_context(|_| Box::new(Root::default()));
    }}

    /// The host calls that can be priced, one per kind of work the host does for kvgate.
    #[derive(Clone, Copy)]
    enum Kind {
        /// `get-missing`: a shared-data read of a key never written (the host returns no data).
        GetMissing,
        /// `get-data`: a shared-data read of a 256-byte value (the host asks the VM for memory,
        /// a call into the VM, and copies the value there).
        GetData,
        /// `set`: a 256-byte shared-data write, without compare-and-swap.
        Set,
        /// `header`: a request header set (a distinct name each time).
        Header,
        /// `header-missing`: a read of a request header the request does not carry (the host
        /// finds none and copies nothing), as kvgate's `content-encoding` read on an answer.
        HeaderMissing,
        /// `clock`: the host's clock.
        Clock,
        /// `histogram`: one sample recorded into a histogram metric.
        Histogram,
        /// `response-body`: each chunk of the response read into the VM (the host asks the VM
        /// for memory and copies the chunk there), in the response-body callback.
        ResponseBody,
    }

    impl Kind {
        fn parse(s: &str) -> Option<Kind> {
            Some(match s {
                "get-missing" => Kind::GetMissing,
                "get-data" => Kind::GetData,
                "set" => Kind::Set,
                "header" => Kind::Header,
                "header-missing" => Kind::HeaderMissing,
                "clock" => Kind::Clock,
                "histogram" => Kind::Histogram,
                "response-body" => Kind::ResponseBody,
                _ => return None,
            })
        }
    }

    /// What each request does beyond the floor: `count` calls of `kind`; `metric` is the
    /// histogram's id for [`Kind::Histogram`].
    #[derive(Clone, Copy)]
    struct Extra {
        kind: Kind,
        count: usize,
        metric: u32,
    }

    const VALUE_KEY: &str = "floor.value";
    const MISSING_KEY: &str = "floor.missing";

    #[derive(Default)]
    struct Root {
        extra: Option<Rc<Extra>>,
    }

    impl Context for Root {}

    impl RootContext for Root {
        fn on_configure(&mut self, _size: usize) -> bool {
            let config = self.get_plugin_configuration().unwrap_or_default();
            let text = String::from_utf8_lossy(&config);
            let mut words = text.split_whitespace();
            let (Some(kind), Some(count), None) = (words.next(), words.next(), words.next()) else {
                return true;
            };
            let (Some(kind), Ok(count)) = (Kind::parse(kind), count.parse()) else {
                return true;
            };
            let _ = hostcalls::set_shared_data(VALUE_KEY, Some(&[b'v'; 256]), None);
            let metric = hostcalls::define_metric(MetricType::Histogram, "floor.histogram")
                .unwrap_or_default();
            self.extra = Some(Rc::new(Extra {
                kind,
                count,
                metric,
            }));
            true
        }

        fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
            Some(Box::new(Floor {
                extra: self.extra.clone(),
            }))
        }

        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }
    }

    struct Floor {
        extra: Option<Rc<Extra>>,
    }

    impl Floor {
        fn priced_calls(&self, extra: &Extra) {
            for i in 0..extra.count {
                match extra.kind {
                    Kind::GetMissing => {
                        let _ = hostcalls::get_shared_data(MISSING_KEY);
                    }
                    Kind::GetData => {
                        let _ = hostcalls::get_shared_data(VALUE_KEY);
                    }
                    Kind::Set => {
                        let _ = hostcalls::set_shared_data(VALUE_KEY, Some(&[b'v'; 256]), None);
                    }
                    Kind::Header => {
                        self.set_http_request_header(&format!("x-floor-{i}"), Some("1"));
                    }
                    Kind::HeaderMissing => {
                        let _ = self.get_http_request_header("x-floor-absent");
                    }
                    Kind::Clock => {
                        let _ = hostcalls::get_current_time();
                    }
                    Kind::Histogram => {
                        let _ = hostcalls::record_metric(extra.metric, i as u64);
                    }
                    Kind::ResponseBody => return,
                }
            }
        }
    }

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
            if let Some(extra) = self.extra.clone() {
                self.priced_calls(&extra);
            }
            Action::Continue
        }

        fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
            if let Some(extra) = self
                .extra
                .as_deref()
                .filter(|e| matches!(e.kind, Kind::ResponseBody))
            {
                for _ in 0..extra.count {
                    let _ = self.get_http_response_body(0, body_size);
                }
            }
            Action::Continue
        }
    }
}
