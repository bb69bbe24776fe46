//! The proxy-wasm shell: binds the core to Envoy. Nothing else in the crate imports proxy_wasm.
//! `root` owns the per-VM lifecycle (configure, tick, queues, callouts), `http` moves one request's
//! data between the host and `flow`, `host` is the one place that calls the host, through `raw`
//! (the ABI itself: the SDK's wrappers panic on host statuses they did not expect).

mod host;
mod http;
mod raw;
mod root;

proxy_wasm::main! {{
    host::install_logging(log::LevelFilter::Info);
    proxy_wasm::set_root_context(|_| Box::new(root::Root::default()));
}}
