//! kvgate-sim: a vLLM-compatible model-server simulator.
//!
//! One process serves `--pods N` pods on consecutive ports. Each pod has its
//! own engine (vLLM V1-style scheduler, paged KV cache with automatic prefix
//! caching, step-time model) running on its own thread against a wall clock
//! scaled by `--time-scale`. See docs/simulator.md.

mod anthropic;
mod config;
mod embeddings;
mod engine;
mod ideal;
mod kv;
mod lax;
mod lora;
mod metrics;
mod pod;
mod pooling;
mod responses;
mod score;
mod server;
mod sglang;
mod tokenizer;
mod tokens;

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::config::Args;
use crate::pod::{Pod, Shared};

async fn serve(listener: TcpListener, pod: Arc<Pod>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                eprintln!("kvgate-sim pod {}: accept failed: {e}", pod.index);
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let pod = pod.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| server::handle(pod.clone(), req));
            let _ = http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

async fn run(g: Arc<Shared>) -> Result<(), String> {
    let a = &g.args;
    let mut listeners = Vec::with_capacity(a.pods);
    for i in 0..a.pods {
        let port = a.base_port + i as u16;
        let addr = format!("{}:{port}", a.host);
        let l = TcpListener::bind(&addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        listeners.push((i, port, addr, l));
    }
    let mut out = std::io::stdout();
    for (i, port, addr, l) in listeners {
        let pod = Pod::new(i, port, g.clone());
        let engine_pod = pod.clone();
        std::thread::Builder::new()
            .name(format!("engine-{i}"))
            .spawn(move || engine_pod.run_engine())
            .map_err(|e| format!("cannot start engine thread: {e}"))?;
        tokio::spawn(serve(l, pod));
        let _ = writeln!(out, "kvgate-sim pod {i} listening on {addr}");
        let _ = out.flush();
    }
    std::future::pending::<()>().await;
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = args.validate() {
        eprintln!("kvgate-sim: {e}");
        return ExitCode::from(2);
    }
    let smallest = (0..args.pods).map(|p| args.blocks(p)).min().unwrap_or(0);
    if args.max_model_len > smallest * args.block_size {
        eprintln!(
            "kvgate-sim: note: --max-model-len {} exceeds the KV capacity of a pod ({} tokens); \
             requests that cannot fit get a 400 (vLLM would refuse to start)",
            args.max_model_len,
            smallest * args.block_size
        );
    }
    let tok = match tokenizer::Tokenizer::new(&args.tokenizer) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("kvgate-sim: {e}");
            return ExitCode::from(2);
        }
    };
    let g = Arc::new(Shared::new(args, tok));
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvgate-sim: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(g)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvgate-sim: {e}");
            ExitCode::FAILURE
        }
    }
}
