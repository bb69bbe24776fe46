//! A small HTTP/1.1 client for OpenAI-style requests: keep-alive connection reuse, SSE parsing,
//! TTFT and inter-token gaps measured as chunks arrive.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde_json::Value;
use tokio::net::TcpStream;

type Sender = SendRequest<Full<Bytes>>;

pub struct Client {
    addr: String,
    pool: Mutex<Vec<Sender>>,
    timeout: Duration,
}

/// What one request got back, as recorded (see `stats::Record`).
#[derive(Debug, Default, Clone, Serialize)]
pub struct Outcome {
    /// HTTP status; 0 when no response came (connection error, timeout).
    pub status: u16,
    /// Seconds to the first content token (streaming only).
    pub ttft: Option<f64>,
    /// Seconds to the end of the response.
    pub e2e: f64,
    /// Gaps between consecutive content chunks, milliseconds.
    pub itl: Vec<f64>,
    pub chunks: u64,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// The generated text, resent as the next turn's history; not recorded.
    #[serde(skip)]
    pub content: String,
    /// `x-sim-pod` response header (which simulator pod served it).
    pub pod: Option<String>,
    /// kvgate's `x-kvgate-ranking` debug header (with `--kvgate-config '{"debugHeaders": true}'`):
    /// every pod's cost and terms for this request, to see why it went where it did.
    pub ranking: Option<String>,
    /// kvgate's `x-kvgate-prompt-tokens` debug header: its prompt estimate, to hold against
    /// `prompt_tokens` (the engine's count) request by request.
    pub estimated_prompt_tokens: Option<u64>,
    /// kvgate's `x-kvgate-cost` debug header: the tokens it reserved for this request.
    pub estimated_cost: Option<u64>,
    /// kvgate's `x-kvgate-queue-ms` debug header: how long the request waited in its line.
    pub queue_ms: Option<u64>,
    pub error: Option<String>,
}

/// Parses `http://host:port[/...]` into `host:port`.
pub fn authority(url: &str) -> Result<String, String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("only http:// URLs are supported: {url}"))?;
    let auth = rest.split('/').next().unwrap_or(rest);
    if auth.contains(':') {
        Ok(auth.to_string())
    } else {
        Ok(format!("{auth}:80"))
    }
}

impl Client {
    pub fn new(addr: String, timeout: Duration) -> Client {
        Client {
            addr,
            pool: Mutex::new(Vec::new()),
            timeout,
        }
    }

    async fn connection(&self) -> Result<Sender, String> {
        loop {
            let idle = match self.pool.lock() {
                Ok(mut p) => p.pop(),
                Err(_) => None,
            };
            match idle {
                Some(s) if s.is_ready() => return Ok(s),
                Some(_) => continue,
                None => break,
            }
        }
        let stream = TcpStream::connect(&self.addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let _ = stream.set_nodelay(true);
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(sender)
    }

    fn release(&self, s: Sender) {
        if !s.is_closed() {
            if let Ok(mut p) = self.pool.lock() {
                p.push(s);
            }
        }
    }

    /// POSTs `body` to `path`; with `stream` the response is read as SSE.
    pub async fn post(
        &self,
        path: &str,
        body: Bytes,
        headers: &[(String, String)],
        stream: bool,
    ) -> Outcome {
        let t0 = Instant::now();
        let res = tokio::time::timeout(
            self.timeout,
            self.post_inner(path, body, headers, stream, t0),
        )
        .await;
        match res {
            Ok(o) => o,
            Err(_) => Outcome {
                e2e: t0.elapsed().as_secs_f64(),
                error: Some("timeout".into()),
                ..Outcome::default()
            },
        }
    }

    async fn post_inner(
        &self,
        path: &str,
        body: Bytes,
        headers: &[(String, String)],
        stream: bool,
        t0: Instant,
    ) -> Outcome {
        let mut out = Outcome::default();
        let fail = |mut out: Outcome, e: String| {
            out.error = Some(e);
            out.e2e = t0.elapsed().as_secs_f64();
            out
        };
        let mut sender = match self.connection().await {
            Ok(s) => s,
            Err(e) => return fail(out, e),
        };
        let mut req = Request::post(path)
            .header("host", &self.addr)
            .header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(k.as_str(), v.as_str());
        }
        let req = match req.body(Full::new(body)) {
            Ok(r) => r,
            Err(e) => return fail(out, format!("request: {e}")),
        };
        if let Err(e) = sender.ready().await {
            return fail(out, format!("not ready: {e}"));
        }
        let resp = match sender.send_request(req).await {
            Ok(r) => r,
            Err(e) => return fail(out, format!("send: {e}")),
        };
        out.status = resp.status().as_u16();
        out.pod = resp
            .headers()
            .get("x-sim-pod")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        out.ranking = resp
            .headers()
            .get("x-kvgate-ranking")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let number = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
        };
        out.estimated_prompt_tokens = number("x-kvgate-prompt-tokens");
        out.estimated_cost = number("x-kvgate-cost");
        out.queue_ms = number("x-kvgate-queue-ms");
        let mut body = resp.into_body();
        if out.status != 200 || !stream {
            let bytes = match body.collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => return fail(out, format!("body: {e}")),
            };
            out.e2e = t0.elapsed().as_secs_f64();
            self.release(sender);
            if out.status != 200 {
                out.error =
                    Some(String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned());
                return out;
            }
            match serde_json::from_slice::<Value>(&bytes) {
                Ok(v) => {
                    read_usage(&v, &mut out);
                    if let Some(c) = v
                        .pointer("/choices/0/message/content")
                        .and_then(Value::as_str)
                    {
                        out.content = c.to_string();
                    } else if let Some(c) = v.pointer("/choices/0/text").and_then(Value::as_str) {
                        out.content = c.to_string();
                    } else if let Some(c) = v.get("text").and_then(Value::as_str) {
                        // An SGLang `/generate` answer.
                        out.content = c.to_string();
                    } else if let Some(blocks) = v.get("content").and_then(Value::as_array) {
                        // An Anthropic Messages answer: its text blocks.
                        let texts = blocks.iter().filter_map(|b| b.get("text")?.as_str());
                        out.content = texts.collect();
                    }
                }
                Err(e) => out.error = Some(format!("bad json: {e}")),
            }
            return out;
        }
        let mut sse = Sse::new(t0);
        let mut done = false;
        while let Some(frame) = body.frame().await {
            let frame = match frame {
                Ok(f) => f,
                Err(e) => return fail(sse.finish(out), format!("stream: {e}")),
            };
            if let Ok(data) = frame.into_data() {
                if sse.feed(&data, Instant::now()) {
                    done = true;
                }
            }
        }
        out = sse.finish(out);
        out.e2e = t0.elapsed().as_secs_f64();
        if !done && out.error.is_none() {
            out.error = Some("stream ended without [DONE]".into());
        }
        self.release(sender);
        out
    }
}

/// A usage object in the OpenAI APIs' names, or in Anthropic's (`input_tokens`, `output_tokens`),
/// or an SGLang `/generate` answer's counts (`meta_info`, so far in a stream).
fn read_usage(v: &Value, out: &mut Outcome) {
    if let Some(m) = v.get("meta_info").filter(|m| m.is_object()) {
        let count = |k: &str| m.get(k).and_then(Value::as_u64);
        out.prompt_tokens = count("prompt_tokens");
        out.completion_tokens = count("completion_tokens");
        out.cached_tokens = count("cached_tokens");
        return;
    }
    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        let either = |openai: &str, anthropic: &str| {
            (u.get(openai).or_else(|| u.get(anthropic))).and_then(Value::as_u64)
        };
        out.prompt_tokens = either("prompt_tokens", "input_tokens");
        out.completion_tokens = either("completion_tokens", "output_tokens");
        out.cached_tokens = u
            .pointer("/prompt_tokens_details/cached_tokens")
            .and_then(Value::as_u64);
    }
}

/// Incremental SSE parser: `data: {...}` lines, `data: [DONE]` (an Anthropic Messages stream's
/// events, `message_stop`).
pub struct Sse {
    t0: Instant,
    buf: Vec<u8>,
    last: Option<Instant>,
    out: Outcome,
}

impl Sse {
    pub fn new(t0: Instant) -> Sse {
        Sse {
            t0,
            buf: Vec::new(),
            last: None,
            out: Outcome::default(),
        }
    }

    /// Feeds bytes received at `now`; true once `[DONE]` was seen.
    pub fn feed(&mut self, data: &[u8], now: Instant) -> bool {
        self.buf.extend_from_slice(data);
        let mut done = false;
        while let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=nl).collect();
            let line = trim(&line);
            let Some(payload) = line.strip_prefix(b"data:") else {
                continue;
            };
            let payload = trim(payload);
            if payload == b"[DONE]" {
                done = true;
                continue;
            }
            let Ok(v) = serde_json::from_slice::<Value>(payload) else {
                self.out.error = Some("bad SSE json".into());
                continue;
            };
            if let Some(e) = v.get("error") {
                self.out.error = Some(e.to_string());
            }
            read_usage(&v, &mut self.out);
            let kind = v.get("type").and_then(Value::as_str);
            done |= kind == Some("message_stop");
            // An Anthropic event's delta is read as a choice's.
            let event = (kind == Some("content_block_delta")).then_some(std::slice::from_ref(&v));
            if v.get("meta_info").is_some() {
                // An SGLang `/generate` chunk: the answer whole so far.
                let text = v.get("text").and_then(Value::as_str).unwrap_or("");
                if let Some(piece) = text.get(self.out.content.len()..).filter(|p| !p.is_empty()) {
                    self.piece(now, piece);
                }
                continue;
            }
            let choices = v.get("choices").and_then(Value::as_array);
            if let Some(choices) = choices.map(Vec::as_slice).or(event) {
                for c in choices {
                    let text = |at: &str| c.pointer(at).and_then(Value::as_str).unwrap_or("");
                    let piece =
                        [text("/text"), text("/delta/content"), text("/delta/text")].concat();
                    // A reasoning model's reasoning (vLLM's `reasoning`, SGLang's
                    // `reasoning_content`, Anthropic's `thinking`) is its first tokens, not its
                    // answer.
                    let reasoning = [
                        text("/delta/reasoning"),
                        text("/delta/reasoning_content"),
                        text("/delta/thinking"),
                    ];
                    if piece.is_empty() && reasoning.iter().all(|r| r.is_empty()) {
                        continue;
                    }
                    self.piece(now, &piece);
                }
            }
        }
        done
    }

    /// A piece of the answer (or of its reasoning: `piece` empty) received at `now`.
    fn piece(&mut self, now: Instant, piece: &str) {
        match self.last {
            None => self.out.ttft = Some(now.duration_since(self.t0).as_secs_f64()),
            Some(l) => self
                .out
                .itl
                .push(now.duration_since(l).as_secs_f64() * 1000.0),
        }
        self.last = Some(now);
        self.out.chunks += 1;
        self.out.content.push_str(piece);
    }

    /// Moves what was parsed into `out` (status and pod stay).
    pub fn finish(self, mut out: Outcome) -> Outcome {
        let p = self.out;
        out.ttft = p.ttft;
        out.itl = p.itl;
        out.chunks = p.chunks;
        out.prompt_tokens = p.prompt_tokens;
        out.completion_tokens = p.completion_tokens;
        out.cached_tokens = p.cached_tokens;
        out.content = p.content;
        if p.error.is_some() {
            out.error = p.error;
        }
        out
    }
}

fn trim(s: &[u8]) -> &[u8] {
    let start = s
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(s.len());
    let end = s
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    &s[start..end.max(start)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_parser_measures_ttft_gaps_usage_and_split_frames() {
        let t0 = Instant::now();
        let mut p = Sse::new(t0);
        let ms = |n| t0 + Duration::from_millis(n);
        assert!(!p.feed(
            b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
            ms(5)
        ));
        assert!(!p.feed(
            b"data: {\"choices\":[{\"delta\":{\"content\":\" the\"}}]}\n\ndata: {\"cho",
            ms(10)
        ));
        assert!(!p.feed(
            b"ices\":[{\"delta\":{\"content\":\" pod\"}}]}\r\n\r\n",
            ms(25)
        ));
        let usage = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\ndata: [DONE]\n\n";
        assert!(p.feed(usage, ms(26)));
        let o = p.finish(Outcome::default());
        assert_eq!(o.chunks, 2);
        assert_eq!(o.content, " the pod");
        assert!((o.ttft.unwrap_or(0.0) - 0.010).abs() < 1e-9);
        assert_eq!(o.itl.len(), 1);
        assert!((o.itl[0] - 15.0).abs() < 1e-6);
        assert_eq!(
            (o.prompt_tokens, o.completion_tokens, o.cached_tokens),
            (Some(7), Some(2), Some(4))
        );
        assert!(o.error.is_none());
    }

    /// A reasoning model's first token is its reasoning's: it sets the TTFT and counts as a
    /// chunk, and only the answer is its content.
    #[test]
    fn reasoning_is_a_token_but_not_the_answer() {
        let t0 = Instant::now();
        let mut p = Sse::new(t0);
        let ms = |n| t0 + Duration::from_millis(n);
        p.feed(
            b"data: {\"choices\":[{\"delta\":{\"reasoning\":\"Hm\"}}]}\n\n",
            ms(4),
        );
        p.feed(
            b"data: {\"choices\":[{\"delta\":{\"reasoning_content\":\".\",\"content\":\"A\"}}]}\n\n",
            ms(9),
        );
        let o = p.finish(Outcome::default());
        assert_eq!((o.chunks, o.content.as_str()), (2, "A"));
        assert!((o.ttft.unwrap_or(0.0) - 0.004).abs() < 1e-9);
    }

    #[test]
    fn completions_text_chunks_count_too() {
        let t0 = Instant::now();
        let mut p = Sse::new(t0);
        p.feed(b"data: {\"choices\":[{\"text\":\" a\"}]}\n\ndata: {\"choices\":[{\"text\":\" b\"}]}\n\n", t0);
        assert_eq!(p.finish(Outcome::default()).chunks, 2);
    }

    /// An Anthropic Messages stream: a piece each thinking or text delta (the signature's is
    /// none), usage in its own names, done at `message_stop`.
    #[test]
    fn anthropic_messages_events_are_read() {
        let t0 = Instant::now();
        let mut p = Sse::new(t0);
        let done = p.feed(
            concat!(
                "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":9,\"output_tokens\":0}}}\n\n",
                "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"thinking_delta\",\"thinking\":\"Hm\"}}\n\n",
                "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"signature_delta\",\"signature\":\"ab\"}}\n\n",
                "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"text_delta\",\"text\":\"A\"}}\n\n",
                "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"input_tokens\":9,\"output_tokens\":2}}\n\n",
                "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
            )
            .as_bytes(),
            t0,
        );
        assert!(done);
        let o = p.finish(Outcome::default());
        assert_eq!((o.chunks, o.content.as_str()), (2, "A"));
        assert_eq!((o.prompt_tokens, o.completion_tokens), (Some(9), Some(2)));
    }

    /// An SGLang `/generate` stream: each chunk the answer whole so far, a piece each time it
    /// grows, the counts so far in `meta_info`.
    #[test]
    fn sglang_generate_chunks_are_read() {
        let t0 = Instant::now();
        let mut p = Sse::new(t0);
        let chunk = |text: &str, made: u64| {
            format!("data: {{\"text\":\"{text}\",\"meta_info\":{{\"prompt_tokens\":9,\"completion_tokens\":{made},\"cached_tokens\":4}}}}\n\n")
        };
        let stream =
            [chunk("He", 1), chunk("He", 1), chunk("Hello", 2)].concat() + "data: [DONE]\n\n";
        assert!(p.feed(stream.as_bytes(), t0));
        let o = p.finish(Outcome::default());
        assert_eq!((o.chunks, o.content.as_str()), (2, "Hello"));
        assert_eq!(
            (o.prompt_tokens, o.completion_tokens, o.cached_tokens),
            (Some(9), Some(2), Some(4))
        );
    }

    #[test]
    fn authority_parsing() {
        assert_eq!(
            authority("http://127.0.0.1:8080").ok(),
            Some("127.0.0.1:8080".into())
        );
        assert_eq!(authority("http://h/x").ok(), Some("h:80".into()));
        assert!(authority("https://h").is_err());
    }
}
