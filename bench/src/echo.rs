//! `kvgate-bench echo`: an upstream that answers at once, for measuring what a proxy adds. POSTs
//! get an OpenAI-shaped chat completion (streamed when the request asks for it); GET /metrics
//! shows an idle vLLM pod with a large KV cache (so kvgate's scraper and budgets see a healthy,
//! unconstrained pod); /health is 200; other GETs get a small server-info object.

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

fn metrics() -> String {
    let l = format!("model_name=\"{MODEL}\",engine=\"0\"");
    format!(
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{l}}} 0.0\n\
         # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{l}}} 0.0\n\
         # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{l}}} 0.0\n\
         # TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"16\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"1000000\"}} 1.0\n"
    )
}

fn json_response(status: u16, body: String, content_type: &str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::OK);
    if let Ok(v) = hyper::header::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r.headers_mut()
        .insert("x-sim-pod", hyper::header::HeaderValue::from_static("echo"));
    r
}

async fn handle(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => Bytes::new(),
    };
    if method != Method::POST {
        return Ok(match path.as_str() {
            "/metrics" => json_response(200, metrics(), "text/plain; version=0.0.4"),
            "/health" | "/ping" | "/health_generate" => json_response(200, String::new(), "text/plain"),
            "/v1/models" => json_response(
                200,
                format!("{{\"object\":\"list\",\"data\":[{{\"id\":\"{MODEL}\",\"object\":\"model\",\"owned_by\":\"vllm\",\"root\":\"{MODEL}\",\"max_model_len\":32768}}]}}"),
                "application/json",
            ),
            _ => json_response(
                200,
                format!("{{\"model_path\":\"{MODEL}\",\"tokenizer_path\":\"{MODEL}\",\"served_model_name\":\"{MODEL}\",\"is_generation\":true,\"max_total_num_tokens\":16000000,\"context_length\":32768,\"page_size\":16}}"),
                "application/json",
            ),
        });
    }
    let prompt_tokens = body.len() / 4;
    let stream = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("stream").and_then(serde_json::Value::as_bool))
        .unwrap_or(false);
    let usage = format!(
        "{{\"prompt_tokens\":{prompt_tokens},\"completion_tokens\":1,\"total_tokens\":{}}}",
        prompt_tokens + 1
    );
    if stream {
        let body = format!(
            "data: {{\"object\":\"chat.completion.chunk\",\"model\":\"{MODEL}\",\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\" ok\"}},\"finish_reason\":\"length\"}}]}}\n\n\
             data: {{\"object\":\"chat.completion.chunk\",\"model\":\"{MODEL}\",\"choices\":[],\"usage\":{usage}}}\n\ndata: [DONE]\n\n"
        );
        return Ok(json_response(200, body, "text/event-stream"));
    }
    Ok(json_response(
        200,
        format!(
            "{{\"id\":\"chatcmpl-echo\",\"object\":\"chat.completion\",\"model\":\"{MODEL}\",\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\" ok\"}},\"finish_reason\":\"length\"}}],\"usage\":{usage}}}"
        ),
        "application/json",
    ))
}

pub async fn serve(host: &str, port: u16) -> Result<(), String> {
    let addr = format!("{host}:{port}");
    let listener = TcpListener::bind(&addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    println!("kvgate-bench echo listening on {addr}");
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(x) => x,
            Err(_) => {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let _ = http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service_fn(handle))
                .await;
        });
    }
}
