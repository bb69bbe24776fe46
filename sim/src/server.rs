//! HTTP front end: OpenAI-compatible endpoints with vLLM's shapes (embeddings, and vLLM's
//! `/pooling`, `/classify`, `/score` and `/rerank`, included), the
//! engines' native generate endpoints (SGLang's `/generate`, vLLM's `/inference/v1/generate`),
//! the endpoints peer routers poll (vLLM, SGLang), and the simulator's own /sim/* endpoints.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderMap, HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::anthropic;
use crate::embeddings;
use crate::engine::FinishReason;
use crate::lax::{count, flag};
use crate::lora::LoraRef;
use crate::metrics::{render, MetricsInput};
use crate::pod::{
    draw_output_len, AbortGuard, Event, Fault, Finish, LoadError, MetricsFault, Pod, Shared, Submit,
};
use crate::pooling::{Endpoint, Pooler};
use crate::responses;
use crate::score;
use crate::tokenizer::{render_chat, Segment, MESSAGE_END};
use crate::{kv, sglang, tokens};

const MAX_BODY: usize = 64 << 20;
/// Bodies larger than this are tokenized on the blocking pool.
const BLOCKING_TOKENIZE_BYTES: usize = 16 << 10;
/// Pooling answers (embeddings, `/pooling`, `/classify`; a score is one float) with more floats
/// than this are made on the blocking pool.
const BLOCKING_EMBED_FLOATS: usize = 64 << 10;
/// vLLM's default `max_tokens` for /v1/completions.
const COMPLETIONS_DEFAULT_MAX_TOKENS: usize = 16;

// ---------------------------------------------------------------- bodies

/// Response body: a complete buffer, or a server-sent-event stream fed by the
/// engine. Dropping a stream before it finished aborts the request.
pub enum SimBody {
    Full(Option<Bytes>),
    Sse(Box<SseBody>),
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            SimBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            SimBody::Sse(s) => s.poll_next(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            SimBody::Full(b) => b.is_none(),
            SimBody::Sse(s) => s.done,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            SimBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            SimBody::Full(None) => SizeHint::with_exact(0),
            SimBody::Sse(_) => SizeHint::default(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
    /// The Responses API (`responses`).
    Responses,
    /// The Anthropic Messages API (`anthropic`): a chat request in its own shapes.
    Messages,
    /// SGLang's native `/generate` (`sglang`): a completions request in SGLang's shapes.
    Generate,
    /// vLLM's tokens-in, tokens-out `/inference/v1/generate` (`tokens`): a completions request of
    /// token ids in its own shapes.
    Tokens,
    /// vLLM's pooling endpoints: those that take the embeddings' inputs, `/v1/embeddings`
    /// (`embeddings`), `/pooling` and `/classify` (`pooling`), and the score APIs, `/score` and
    /// `/rerank` (`score`): each prompt (a score API's pair) a pooling request, a prefill with
    /// no output, answered with what it pools to; never streamed.
    Pool(Endpoint),
}

struct StreamState {
    g: Arc<Shared>,
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    continuous_usage: bool,
    /// The answer's choices (the request's `n`, for each of a batch's prompts), as they are made.
    choices: Vec<Choice>,
    /// Choices not finished yet: the usage chunk and `[DONE]` follow the last one's end.
    unfinished: usize,
    /// The chat roles went out (with the answer's first token).
    roles_sent: bool,
    /// A Responses API answer's own state.
    response: Option<ResponseStream>,
    /// A Messages API answer's events.
    messages: Option<anthropic::Events>,
    /// An SGLang `/generate` answer's own state.
    generate: Option<GenerateStream>,
}

/// What a streamed SGLang answer keeps: when the request came (its answers' `e2e_latency`),
/// whether it is one answer (its chunks carry no `index`), each answer's rid and whole text so
/// far (SGLang streams the text so far, not a delta), and which answers have sent a chunk (the
/// first carries `response_sent_to_client_ts`).
struct GenerateStream {
    started: Instant,
    single: bool,
    rids: Vec<String>,
    texts: Vec<String>,
    sent: Vec<bool>,
}

/// What a streamed Responses API answer keeps until it ends: its events' numbering, its text,
/// and, for the store, the pod and the conversation's tokens (the prompt's, then the answer's).
struct ResponseStream {
    events: responses::Events,
    text: String,
    tokens: Vec<u32>,
    previous: Option<String>,
    store: Option<Arc<Pod>>,
}

/// An answer's text, split as a reasoning parser splits it.
#[derive(Default)]
struct Unsent {
    reasoning: String,
    content: String,
}

/// One choice of an answer as it is made: vLLM V1 makes each of a request's `n` choices an
/// engine request of its own (`ParentRequest`), with its own length, text and end.
#[derive(Default)]
struct Choice {
    /// Its prompt's tokens (the engine's count once it ends), and whether it is the first of
    /// its prompt's `n` choices: the one whose prompt and prefix-cache hits the usage counts.
    prompt_tokens: usize,
    first_of_prompt: bool,
    /// Tokens made so far.
    tokens: usize,
    /// The choice's first tokens that are reasoning (`--reasoning-share`).
    reasoning_tokens: usize,
    /// Text of tokens made and not handed on yet (`--stream-interval`), reasoning and answer,
    /// and how many.
    unsent: Unsent,
    unsent_tokens: usize,
    finish: Option<Finish>,
    /// For the endpoints that answer token ids: the EOS a natural end emits (the engines count
    /// it and return it among the ids, and leave it out of the text), the ids so far, and how
    /// many of them a stream has sent.
    eos: Option<u32>,
    ids: Vec<u32>,
    sent_ids: usize,
    /// An SGLang `max_new_tokens` of 0 (a prefill only, as a cache warm-up sends): the engine
    /// runs it to one token, which the answer does not show.
    prefill_only: bool,
    /// Its request's prefix-cache hit tokens and preemptions so far, and when it ended.
    cached_tokens: usize,
    preemptions: u32,
    ended: Option<Instant>,
}

impl Choice {
    /// A choice that is to make `max_output` tokens, of which a chat answer's first share is
    /// reasoning: what a reasoning parser would split off.
    fn new(g: &Shared, kind: Kind, max_output: usize, prompt_tokens: usize, first: bool) -> Self {
        let reasoning_tokens = match kind {
            Kind::Chat | Kind::Messages => {
                (g.args.reasoning_share * max_output as f64).round() as usize
            }
            Kind::Completion | Kind::Responses | Kind::Generate | Kind::Tokens | Kind::Pool(_) => 0,
        };
        Choice {
            prompt_tokens,
            first_of_prompt: first,
            reasoning_tokens,
            eos: matches!(kind, Kind::Generate | Kind::Tokens).then_some(g.tok.eos),
            prefill_only: max_output == 0,
            ..Choice::default()
        }
    }

    /// Adds a token's text (as reasoning or answer) and id and, with the last token, the
    /// choice's end. A natural end's last token is the EOS where ids are answered.
    fn add(&mut self, ev: &Event, piece: &str) {
        self.cached_tokens = ev.cached_tokens;
        self.preemptions = ev.preemptions;
        self.unsent_tokens += 1;
        if !self.prefill_only {
            self.tokens += 1;
            let stop = ev.finish.is_some_and(|f| f.reason == FinishReason::Stop);
            match self.eos {
                Some(eos) if stop => self.ids.push(eos),
                eos => {
                    if eos.is_some() {
                        self.ids.push(ev.token);
                    }
                    let part = if self.tokens <= self.reasoning_tokens {
                        &mut self.unsent.reasoning
                    } else {
                        &mut self.unsent.content
                    };
                    part.push_str(piece);
                }
            }
        }
        if let Some(f) = ev.finish {
            if !self.prefill_only {
                self.tokens = f.completion_tokens;
            }
            self.prompt_tokens = f.prompt_tokens;
            self.finish = Some(f);
            self.ended = Some(Instant::now());
        }
    }

    /// The text not handed on yet, when its chunk is due: every `interval` tokens, and at the
    /// choice's end.
    fn due(&mut self, interval: usize) -> Option<Unsent> {
        if self.finish.is_none() && self.unsent_tokens < interval.max(1) {
            return None;
        }
        self.unsent_tokens = 0;
        Some(std::mem::take(&mut self.unsent))
    }
}

/// The prompt tokens and prefix-cache hits a usage reports: each prompt's once however many
/// choices it has (its first choice's), summed over a batch's prompts, as vLLM's completions sum
/// them.
fn prompt_usage(choices: &[Choice]) -> (usize, usize) {
    let firsts = choices.iter().filter(|c| c.first_of_prompt);
    firsts.fold((0, 0), |(prompt, cached), c| {
        let hits = c.finish.map_or(0, |f| f.cached_tokens);
        (prompt + c.prompt_tokens, cached + hits)
    })
}

/// vLLM's `UsageInfo`: the prompt counted once however many choices, their tokens summed, and
/// the prefix-cache hit tokens where reported.
fn usage(prompt_tokens: usize, completion_tokens: usize, cached: Option<usize>) -> Value {
    let mut u = json!({
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    });
    if let Some(c) = cached {
        u["prompt_tokens_details"] = json!({ "cached_tokens": c });
    }
    u
}

impl StreamState {
    fn push(buf: &mut Vec<u8>, v: &Value) {
        buf.extend_from_slice(b"data: ");
        buf.extend_from_slice(v.to_string().as_bytes());
        buf.extend_from_slice(b"\n\n");
    }

    /// A chunk with one choice, the `i`-th. Continuous usage counts that choice's tokens so far,
    /// as vLLM's does.
    fn chunk(&self, i: usize, choice: Value) -> Value {
        let object = match self.kind {
            Kind::Completion | Kind::Generate | Kind::Tokens | Kind::Pool(_) => "text_completion",
            Kind::Chat | Kind::Responses | Kind::Messages => "chat.completion.chunk",
        };
        let mut v = json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        if self.continuous_usage {
            let (prompt, tokens) = self
                .choices
                .get(i)
                .map_or((0, 0), |c| (c.prompt_tokens, c.tokens));
            v["usage"] = usage(prompt, tokens, None);
        }
        v
    }

    /// The `i`-th choice's text not sent yet, when its chunk is due.
    fn due(&mut self, i: usize) -> Option<Unsent> {
        let interval = self.g.args.stream_interval;
        self.choices.get_mut(i)?.due(interval)
    }

    fn on_event(&mut self, ev: &Event, buf: &mut Vec<u8>) {
        let i = ev.choice;
        let piece = self.g.tok.piece(ev.token);
        let Some(c) = self.choices.get_mut(i) else {
            return;
        };
        c.add(ev, &piece);
        if ev.finish.is_some() {
            self.unfinished = self.unfinished.saturating_sub(1);
        }
        if self.response.is_some() {
            return self.on_response_event(ev, buf);
        }
        if self.messages.is_some() {
            return self.on_messages_event(ev, buf);
        }
        if self.generate.is_some() {
            return self.on_generate_event(ev, buf);
        }
        if !self.roles_sent && self.kind == Kind::Chat {
            // vLLM sends every choice's role with the answer's first output, however many
            // tokens a chunk carries.
            self.roles_sent = true;
            for j in 0..self.choices.len() {
                let c = self.chunk(
                    j,
                    json!({
                        "index": j,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": null,
                        "finish_reason": null,
                    }),
                );
                Self::push(buf, &c);
            }
        }
        let Some(Unsent { reasoning, content }) = self.due(i) else {
            return;
        };
        let finish = ev.finish.map(|f| f.reason.as_str());
        match self.kind {
            Kind::Tokens => {
                // vLLM's chunk carries the choice's new token ids, not text.
                let Some(c) = self.choices.get_mut(i) else {
                    return;
                };
                let delta = c.ids.get(c.sent_ids..).unwrap_or_default();
                let choice = tokens::choice(i, finish, delta);
                c.sent_ids = c.ids.len();
                let usage = self
                    .continuous_usage
                    .then(|| usage(c.prompt_tokens, c.tokens, None));
                Self::push(buf, &tokens::chunk(&self.id, choice, usage));
            }
            // A pooling answer is never streamed.
            Kind::Completion
            | Kind::Responses
            | Kind::Messages
            | Kind::Generate
            | Kind::Pool(_) => {
                let c = self.chunk(
                    i,
                    json!({
                        "index": i,
                        "text": content,
                        "logprobs": null,
                        "finish_reason": finish,
                        "stop_reason": null,
                    }),
                );
                Self::push(buf, &c);
            }
            Kind::Chat => {
                // vLLM's delta carries the step's reasoning, its answer, or both where a
                // step's text crosses the end of the reasoning.
                let mut delta = json!({});
                if !reasoning.is_empty() {
                    delta["reasoning"] = json!(reasoning);
                }
                if !content.is_empty() || reasoning.is_empty() {
                    delta["content"] = json!(content);
                }
                let mut choice = json!({
                    "index": i,
                    "delta": delta,
                    "logprobs": null,
                    "finish_reason": finish,
                });
                if finish.is_some() {
                    choice["stop_reason"] = Value::Null;
                }
                let c = self.chunk(i, choice);
                Self::push(buf, &c);
            }
        }
        if finish.is_some() && self.unfinished == 0 {
            self.finish(buf, true);
        }
    }

    /// A Responses API answer's token: its opening events with the first, a text delta at each
    /// chunk's end (`--stream-interval`), and at its end the closing events and the store.
    fn on_response_event(&mut self, ev: &Event, buf: &mut Vec<u8>) {
        let Some(r) = self.response.as_mut() else {
            return;
        };
        if ev.first {
            let opened = responses::object(
                &self.id,
                self.created,
                &self.model,
                None,
                r.previous.as_deref(),
            );
            r.events.open(buf, &opened);
        }
        r.tokens.push(ev.token);
        let Some(Unsent { content: piece, .. }) = self.due(ev.choice) else {
            return;
        };
        let Some(r) = self.response.as_mut() else {
            return;
        };
        r.events.delta(buf, &piece);
        r.text.push_str(&piece);
        let Some(f) = ev.finish else {
            return;
        };
        let usage = responses::usage(f.prompt_tokens, f.completion_tokens, f.cached_tokens);
        let done = responses::object(
            &self.id,
            self.created,
            &self.model,
            Some((&r.events.item_id, &r.text, usage)),
            r.previous.as_deref(),
        );
        r.events.close(buf, &r.text, &done);
        if let Some(pod) = r.store.take() {
            let tokens = std::mem::take(&mut r.tokens);
            pod.lock().responses.insert(
                self.id.clone(),
                responses::Stored {
                    tokens,
                    object: done,
                },
            );
        }
    }

    /// A Messages API answer's token: `message_start` with the first (vLLM makes it of the chat
    /// stream's first chunk, whose usage counts the prompt), the chunk's reasoning and text as
    /// block deltas when it is due (`--stream-interval`), and at the end what the usage chunk
    /// and `[DONE]` become.
    fn on_messages_event(&mut self, ev: &Event, buf: &mut Vec<u8>) {
        let prompt = self.choices.get(ev.choice).map_or(0, |c| c.prompt_tokens);
        let unsent = self.due(ev.choice);
        let Some(m) = self.messages.as_mut() else {
            return;
        };
        if ev.first {
            m.start(buf, &self.model, prompt);
        }
        let Some(Unsent { reasoning, content }) = unsent else {
            return;
        };
        m.thinking(buf, &reasoning);
        m.text(buf, &content);
        if let Some(f) = ev.finish {
            m.stop(buf, f.reason, f.prompt_tokens, f.completion_tokens);
        }
    }

    /// An SGLang answer's token: when its chunk is due (`--stream-interval`), the answer so far
    /// (its whole text and ids, its `meta_info`), and after every answer's end `[DONE]`.
    fn on_generate_event(&mut self, ev: &Event, buf: &mut Vec<u8>) {
        let i = ev.choice;
        let Some(Unsent { reasoning, content }) = self.due(i) else {
            return;
        };
        let eos = self.g.tok.eos;
        let (Some(s), Some(c)) = (self.generate.as_mut(), self.choices.get(i)) else {
            return;
        };
        let (Some(text), Some(rid), Some(sent)) =
            (s.texts.get_mut(i), s.rids.get(i), s.sent.get_mut(i))
        else {
            return;
        };
        text.push_str(&reasoning);
        text.push_str(&content);
        let first = !std::mem::replace(sent, true);
        let answer = sglang::Answer {
            rid,
            text,
            ids: &c.ids,
            finish: c.finish.map(|f| f.reason),
            prompt_tokens: c.prompt_tokens,
            completion_tokens: c.tokens,
            cached_tokens: c.cached_tokens,
            retractions: c.preemptions,
            e2e_latency: c.ended.map(|e| e.duration_since(s.started).as_secs_f64()),
            sent_ts: first.then(unix_now_f64),
        };
        buf.extend(sglang::chunk(&answer, eos, (!s.single).then_some(i)));
        if ev.finish.is_some() && self.unfinished == 0 {
            self.finish(buf, true);
        }
    }

    /// The stream's end: after every choice's end (`complete`) the usage chunk, if asked for,
    /// then `[DONE]`.
    fn finish(&mut self, buf: &mut Vec<u8>, complete: bool) {
        if self.response.is_some() || self.messages.is_some() {
            // A Responses or Messages API stream ends with its last event, and one cut short
            // just ends.
            return;
        }
        if self.include_usage && complete {
            let completion_tokens = self.choices.iter().map(|c| c.tokens).sum();
            let (prompt_tokens, cached) = prompt_usage(&self.choices);
            let usage = usage(prompt_tokens, completion_tokens, Some(cached));
            if self.kind == Kind::Tokens {
                Self::push(buf, &tokens::usage_chunk(&self.id, usage));
                buf.extend_from_slice(b"data: [DONE]\n\n");
                return;
            }
            let object = match self.kind {
                Kind::Completion | Kind::Generate | Kind::Tokens | Kind::Pool(_) => {
                    "text_completion"
                }
                Kind::Chat | Kind::Responses | Kind::Messages => "chat.completion.chunk",
            };
            let v = json!({
                "id": self.id,
                "object": object,
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage,
            });
            Self::push(buf, &v);
        }
        buf.extend_from_slice(b"data: [DONE]\n\n");
    }
}

pub struct SseBody {
    rx: UnboundedReceiver<Event>,
    guard: AbortGuard,
    st: StreamState,
    done: bool,
}

impl SseBody {
    fn poll_next(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let mut buf = Vec::new();
        loop {
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some(ev)) => {
                    self.st.on_event(&ev, &mut buf);
                    if self.st.unfinished == 0 {
                        self.guard.disarm();
                        self.done = true;
                        break;
                    }
                }
                Poll::Ready(None) => {
                    // The engine dropped the request (aborted): end the stream.
                    self.st.finish(&mut buf, false);
                    self.done = true;
                    break;
                }
                Poll::Pending => break,
            }
        }
        if buf.is_empty() {
            Poll::Pending
        } else {
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(buf)))))
        }
    }
}

// ---------------------------------------------------------------- helpers

struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    /// The request field vLLM's `ErrorResponse` names (a `VLLMValidationError`'s `parameter`);
    /// none for the refusals the simulator does not name one for.
    param: Option<&'static str>,
}

/// A field that is not what vLLM reads it as (`lax`): its 400.
impl From<String> for ApiError {
    fn from(message: String) -> Self {
        ApiError::bad(message)
    }
}

/// The `kind` of an SGLang request FastAPI's validation refused (rather than SGLang's handler).
const SGLANG_INVALID: &str = "Bad Request";

impl From<sglang::Refusal> for ApiError {
    fn from(r: sglang::Refusal) -> Self {
        match r {
            sglang::Refusal::Invalid(message) => ApiError {
                status: StatusCode::BAD_REQUEST,
                kind: SGLANG_INVALID,
                message,
                param: None,
            },
            sglang::Refusal::Value(message) => ApiError::bad(message),
        }
    }
}

impl ApiError {
    fn bad(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "BadRequestError",
            message: message.into(),
            param: None,
        }
    }
    /// The error as a request of this kind gets it: the Messages API's in its own shape
    /// (vLLM's `translate_error_response`), the status kept; SGLang's in one of its two.
    fn response_for(&self, kind: Kind) -> Response<SimBody> {
        match kind {
            Kind::Messages => {
                json_response(self.status, &anthropic::error(self.kind, &self.message))
            }
            Kind::Generate if self.kind == SGLANG_INVALID => {
                json_response(self.status, &sglang::invalid(&self.message))
            }
            Kind::Generate => json_response(self.status, &sglang::error(&self.message)),
            Kind::Completion | Kind::Chat | Kind::Responses | Kind::Tokens | Kind::Pool(_) => {
                self.response()
            }
        }
    }

    fn response(&self) -> Response<SimBody> {
        // vLLM's ErrorResponse (OpenAI-compatible `{"error": {...}}` form).
        json_response(
            self.status,
            &json!({"error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status.as_u16(),
            }}),
        )
    }
}

fn full(status: StatusCode, content_type: Option<&'static str>, body: Bytes) -> Response<SimBody> {
    let mut r = Response::new(SimBody::Full(if body.is_empty() {
        None
    } else {
        Some(body)
    }));
    *r.status_mut() = status;
    if let Some(ct) = content_type {
        r.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(ct));
    }
    r
}

fn json_response(status: StatusCode, v: &Value) -> Response<SimBody> {
    full(status, Some("application/json"), Bytes::from(v.to_string()))
}

fn ok_json(v: &Value) -> Response<SimBody> {
    json_response(StatusCode::OK, v)
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn unix_now_f64() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

async fn read_json(req: Request<Incoming>) -> Result<(HeaderMap, Value, usize), ApiError> {
    let (parts, body) = req.into_parts();
    let bytes = Limited::new(body, MAX_BODY)
        .collect()
        .await
        .map_err(|e| ApiError::bad(format!("could not read request body: {e}")))?
        .to_bytes();
    let v: Value = if bytes.is_empty() {
        json!({})
    } else {
        serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::bad(format!("invalid JSON body: {e}")))?
    };
    if !v.is_object() {
        return Err(ApiError::bad("request body must be a JSON object"));
    }
    Ok((parts.headers, v, bytes.len()))
}

/// The request's model: a served base model name, or a registered LoRA
/// adapter (its id), as vLLM's `_check_model` / `_maybe_get_adapters` resolve
/// it; anything else is vLLM's 404.
fn check_model(pod: &Pod, body: &Value) -> Result<(String, Option<LoraRef>), ApiError> {
    let g = &pod.g;
    match body.get("model") {
        // vLLM's `_is_model_supported`: no name at all (`not model_name`) is the served model.
        None | Some(Value::Null) => Ok((g.served[0].clone(), None)),
        Some(Value::String(m)) if m.is_empty() => Ok((g.served[0].clone(), None)),
        Some(Value::String(m)) => {
            if g.served.iter().any(|s| s == m) {
                return Ok((m.clone(), None));
            }
            if let Some(l) = pod.adapter(m) {
                return Ok((m.clone(), Some(l)));
            }
            if g.args.any_model {
                return Ok((m.clone(), None));
            }
            Err(ApiError {
                status: StatusCode::NOT_FOUND,
                kind: "NotFoundError",
                message: format!("The model `{m}` does not exist."),
                param: None,
            })
        }
        Some(_) => Err(ApiError::bad("model must be a string")),
    }
}

fn token_ids(v: &[Value]) -> Option<Vec<u32>> {
    v.iter()
        .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}

/// Completions `prompt`: a string, a list of token ids, or a batch (a list of strings, or of
/// lists of token ids), each of whose prompts vLLM answers as a request of its own.
fn completion_prompts(g: &Shared, body: &Value) -> Result<Vec<Vec<u32>>, ApiError> {
    prompt_list(g, body.get("prompt"), "prompt")
}

/// A completions `prompt` or a pooling request's `input` (`field`): its prompts, tokenized.
fn prompt_list(g: &Shared, v: Option<&Value>, field: &str) -> Result<Vec<Vec<u32>>, ApiError> {
    let ids = |a: &[Value]| {
        token_ids(a).ok_or_else(|| ApiError::bad(format!("{field} token ids must be integers")))
    };
    let kinds = || {
        ApiError::bad(format!(
            "{field} must be a string, a list of strings or token ids"
        ))
    };
    match v {
        Some(Value::String(s)) => Ok(vec![g.tok.encode(s)]),
        Some(Value::Array(a)) if a.is_empty() => {
            Err(ApiError::bad(format!("{field} cannot be empty")))
        }
        Some(Value::Array(a)) => match &a[0] {
            Value::Number(_) => Ok(vec![ids(a)?]),
            Value::String(_) => a
                .iter()
                .map(|p| p.as_str().map(|s| g.tok.encode(s)).ok_or_else(kinds))
                .collect(),
            Value::Array(_) => a
                .iter()
                .map(|p| p.as_array().ok_or_else(kinds).and_then(|p| ids(p)))
                .collect(),
            _ => Err(kinds()),
        },
        Some(_) => Err(kinds()),
        None => Err(ApiError::bad(format!("{field} is required"))),
    }
}

/// A pooling request's prompts (`/v1/embeddings`, `/pooling`, `/classify` alike): its
/// `input`'s each (the forms of a completions prompt), or
/// its `messages` rendered by the chat template — `add_generation_prompt` off unless asked for,
/// and with `continue_final_message` the last message left open (its end not rendered); a
/// score API's, the prompt of each of its pairs (`score::prompts`) — then,
/// with `truncate_prompt_tokens`, each prompt's last tokens (its first with `truncation_side:
/// "right"`). A prompt longer than the model's
/// length is refused as vLLM's renderer refuses it (a pooling prompt may fill the context: it
/// asks for no output).
fn pooling_prompts(
    g: &Shared,
    body: &Value,
    endpoint: Endpoint,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let max_len = g.args.max_model_len;
    let truncation = embeddings::truncation(body, max_len)?;
    let prompts = match endpoint {
        Endpoint::Score | Endpoint::Rerank => {
            score::prompts(body, endpoint, ARCHITECTURE, |text| g.tok.encode(text))?
        }
        Endpoint::Embeddings | Endpoint::Pooling | Endpoint::Classify => {
            match embeddings::form(body, endpoint)? {
                embeddings::Form::Completion => prompt_list(g, body.get("input"), "input")?,
                embeddings::Form::Chat => {
                    let mut segs = rendered_chat(g, body, None, false)?;
                    let open = flag(body.get("continue_final_message"), "continue_final_message")?
                        .unwrap_or(false);
                    if open {
                        embeddings::continue_final(&mut segs, MESSAGE_END);
                    }
                    vec![g.tok.encode_segments(&segs)]
                }
            }
        }
    };
    prompts
        .into_iter()
        .map(|mut p| {
            if let Some(t) = truncation {
                t.apply(&mut p);
            }
            if p.len() > max_len {
                let n = p.len();
                return Err(ApiError {
                    status: StatusCode::BAD_REQUEST,
                    kind: "BadRequestError",
                    message: format!(
                        "You passed {n} input tokens and requested 0 output tokens. However, \
                         the model's context length is only {max_len} tokens, resulting in a \
                         maximum input length of {max_len} tokens. Please reduce the length of \
                         the input prompt. (parameter=input_tokens, value={n})"
                    ),
                    param: Some("input_tokens"),
                });
            }
            Ok(p)
        })
        .collect()
}

fn chat_segments(g: &Shared, body: &Value) -> Result<Vec<Segment>, ApiError> {
    rendered_chat(g, body, body.get("tools"), true)
}

/// A body's `messages` through the chat template, with `tools`, and the generation prompt when
/// `add_generation_prompt` says so (`add_gen` when it says nothing: on for a chat, off for the
/// pooling endpoints' chat form).
fn rendered_chat(
    g: &Shared,
    body: &Value,
    tools: Option<&Value>,
    add_gen: bool,
) -> Result<Vec<Segment>, ApiError> {
    let msgs = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::bad("messages must be a list"))?;
    if msgs.is_empty() {
        return Err(ApiError::bad("messages cannot be empty"));
    }
    let add_gen =
        flag(body.get("add_generation_prompt"), "add_generation_prompt")?.unwrap_or(add_gen);
    render_chat(msgs, tools, add_gen, g.args.media_part_tokens).map_err(ApiError::bad)
}

/// Tokenize the request's prompt (blocking; big bodies go to the blocking pool).
/// Its prompts' token ids: one, or a completions batch's each.
fn tokenize_sync(g: &Shared, kind: Kind, body: &Value) -> Result<Vec<Vec<u32>>, ApiError> {
    match kind {
        // SGLang's body is the completions body it became (`sglang::request`).
        Kind::Completion | Kind::Generate => completion_prompts(g, body),
        Kind::Tokens => {
            let ids = body.get("token_ids").and_then(Value::as_array);
            let ids = ids.and_then(|a| token_ids(a));
            Ok(vec![ids.ok_or_else(|| {
                ApiError::bad("token_ids must be token ids")
            })?])
        }
        // A Messages request's body is the chat request it became (`anthropic::chat_request`).
        Kind::Chat | Kind::Messages => Ok(vec![g.tok.encode_segments(&chat_segments(g, body)?)]),
        Kind::Pool(endpoint) => pooling_prompts(g, body, endpoint),
        Kind::Responses => {
            let msgs = responses::messages(body).map_err(ApiError::bad)?;
            let segs = render_chat(&msgs, body.get("tools"), true, g.args.media_part_tokens)
                .map_err(ApiError::bad)?;
            Ok(vec![g.tok.encode_segments(&segs)])
        }
    }
}

async fn tokenize(
    g: &Arc<Shared>,
    kind: Kind,
    body: Value,
    size: usize,
) -> Result<(Vec<Vec<u32>>, Value), ApiError> {
    if size < BLOCKING_TOKENIZE_BYTES {
        return Ok((tokenize_sync(g, kind, &body)?, body));
    }
    let g2 = g.clone();
    tokio::task::spawn_blocking(move || tokenize_sync(&g2, kind, &body).map(|ids| (ids, body)))
        .await
        .map_err(|e| ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "InternalServerError",
            message: format!("tokenizer task failed: {e}"),
            param: None,
        })?
}

/// A request's output limit, read from its sampling fields (`sampling`).
fn requested_max_tokens(kind: Kind, body: &Value) -> Result<Option<usize>, ApiError> {
    let field = |name| count(body.get(name), name);
    Ok(match kind {
        Kind::Chat | Kind::Messages => match field("max_completion_tokens")? {
            Some(v) => Some(v),
            None => field("max_tokens")?,
        },
        Kind::Completion | Kind::Tokens => field("max_tokens")?,
        Kind::Responses => field("max_output_tokens")?,
        Kind::Generate => field("max_new_tokens")?,
        Kind::Pool(_) => None,
    })
}

/// Where a prompt's sampling fields are: the native endpoints' `sampling_params` (SGLang's, one
/// per prompt), the body itself for the OpenAI ones.
fn sampling(kind: Kind, body: &Value, prompt: usize) -> &Value {
    static NONE: Value = Value::Null;
    match kind {
        Kind::Generate => body
            .get("sampling_params")
            .and_then(|s| s.get(prompt))
            .unwrap_or(&NONE),
        Kind::Tokens => body.get("sampling_params").unwrap_or(&NONE),
        Kind::Completion | Kind::Chat | Kind::Responses | Kind::Messages | Kind::Pool(_) => body,
    }
}

/// vLLM's default most choices a request may ask for (`VLLM_MAX_N_SEQUENCES`).
const MAX_N: usize = 16384;
/// Below this temperature vLLM samples greedily (`_SAMPLING_EPS`).
const SAMPLING_EPS: f64 = 1e-5;

/// The request's `n`: how many choices to make, as vLLM's `SamplingParams` checks it. The
/// Responses and Messages APIs have no `n`; SGLang checks only that a batch's agree
/// (`sglang::request`).
fn requested_n(kind: Kind, body: &Value) -> Result<usize, ApiError> {
    let body = match kind {
        Kind::Responses | Kind::Messages | Kind::Pool(_) => return Ok(1),
        Kind::Generate => return Ok(count(body.get("n"), "n")?.unwrap_or(1).max(1)),
        Kind::Tokens => sampling(kind, body, 0),
        Kind::Completion | Kind::Chat => body,
    };
    let n = match count(body.get("n"), "n")? {
        None => 1,
        Some(0) => return Err(ApiError::bad("n must be at least 1, got 0.")),
        Some(n) if n > MAX_N => {
            return Err(ApiError::bad(format!(
                "n must be at most {MAX_N}, got {n}. To increase this limit, set the \
                 VLLM_MAX_N_SEQUENCES environment variable."
            )))
        }
        Some(n) => n,
    };
    // Greedy choices would all be the same answer: vLLM's `_verify_greedy_sampling` refuses them.
    let greedy = body
        .get("temperature")
        .and_then(Value::as_f64)
        .is_some_and(|t| t < SAMPLING_EPS);
    if n > 1 && greedy {
        return Err(ApiError::bad(format!(
            "n must be 1 when using greedy sampling, got {n}."
        )));
    }
    Ok(n)
}

/// Decide how many tokens one choice generates and the finish reason reported, from the
/// request's sampling fields (`body`: `sampling`). An SGLang prefill only plans 0, and so does
/// a pooling request (an embedding, `/pooling`, `/classify`, a score API's pair).
fn plan_output(
    pod: &Pod,
    kind: Kind,
    headers: &HeaderMap,
    body: &Value,
    prompt_len: usize,
) -> Result<(usize, FinishReason), ApiError> {
    let a = &pod.g.args;
    let max_len = a.max_model_len;
    let pod_blocks = a.blocks(pod.index);
    let capacity = pod_blocks * a.block_size;
    if let Kind::Pool(_) = kind {
        // A pooling request is its prefill alone: its prompt may fill the context (its length
        // was checked as it was rendered, `pooling_prompts`), and nothing is sampled.
        if prompt_len == 0 {
            return Err(ApiError::bad("The decoder prompt cannot be empty"));
        }
        let blocks = prompt_len.div_ceil(a.block_size);
        if blocks > pod_blocks {
            return Err(ApiError::bad(format!(
                "kvgate-sim: this request needs {blocks} KV cache blocks ({prompt_len} prompt \
                 tokens, block size {}) but the pod only has {} blocks ({capacity} tokens).",
                a.block_size, pod_blocks
            )));
        }
        return Ok((0, FinishReason::Stop));
    }
    let explicit = requested_max_tokens(kind, body)?;
    if kind == Kind::Generate {
        // SGLang's `_validate_one_request` (its prompts are never empty: `sglang::request`).
        if prompt_len >= max_len {
            return Err(ApiError::bad(format!(
                "The input ({prompt_len} tokens) is longer than the model's context length \
                 ({max_len} tokens)."
            )));
        }
        if let Some(mt) = explicit.filter(|mt| prompt_len + mt > max_len) {
            return Err(ApiError::bad(format!(
                "Requested token count exceeds the model's maximum context length of {max_len} \
                 tokens. You requested a total of {} tokens: {prompt_len} tokens from the input \
                 messages and {mt} tokens for the completion. Please reduce the number of tokens \
                 in the input messages or the completion to fit within the limit.",
                prompt_len + mt
            )));
        }
        if explicit == Some(0) {
            return Ok((0, FinishReason::Length));
        }
    } else {
        if prompt_len == 0 {
            return Err(ApiError::bad("The decoder prompt cannot be empty"));
        }
        if prompt_len >= max_len {
            return Err(ApiError::bad(format!(
                "This model's maximum context length is {max_len} tokens. However, your request \
                 has {prompt_len} input tokens. Please reduce the length of the input messages."
            )));
        }
        if let Some(mt) = explicit {
            if mt == 0 {
                return Err(ApiError::bad("max_tokens must be at least 1, got 0."));
            }
            if prompt_len + mt > max_len {
                return Err(ApiError::bad(format!(
                    "This model's maximum context length is {max_len} tokens. However, you \
                     requested {} tokens ({prompt_len} in the messages, {mt} in the completion). \
                     Please reduce the length of the messages or completion.",
                    prompt_len + mt
                )));
            }
        }
    }
    // SGLang's scheduler caps every answer at `max_req_len - prompt - 1`, its `max_req_len`
    // the context less one: two short of the room vLLM leaves.
    let room = match kind {
        Kind::Generate => (max_len - prompt_len).saturating_sub(2).max(1),
        _ => max_len - prompt_len,
    };
    let explicit = explicit.map(|mt| mt.min(room));
    let header = match headers.get("x-sim-output-tokens") {
        Some(h) => Some(
            h.to_str()
                .ok()
                .and_then(|s| s.trim().parse::<usize>().ok())
                .filter(|&n| n >= 1)
                .ok_or_else(|| ApiError::bad("x-sim-output-tokens must be a positive integer"))?,
        ),
        None => None,
    };
    let ignore_eos = flag(body.get("ignore_eos"), "ignore_eos")?.unwrap_or(false);
    let min_field = match kind {
        Kind::Generate => "min_new_tokens",
        _ => "min_tokens",
    };
    let min_tokens = count(body.get(min_field), min_field)?.unwrap_or(0);
    // vLLM's completions stop at 16 tokens when the body has no `max_tokens` at all, SGLang at
    // 128 when a prompt's sampling has no `max_new_tokens` (one given as null: at the model's
    // room), whatever length the model would have run to. vLLM's tokens endpoint fills in the
    // room itself (`get_max_tokens`): no cap but the context.
    let default_cap = match kind {
        Kind::Completion => body
            .get("max_tokens")
            .is_none()
            .then_some(COMPLETIONS_DEFAULT_MAX_TOKENS),
        Kind::Generate => body
            .get("max_new_tokens")
            .is_none()
            .then_some(sglang::DEFAULT_MAX_NEW_TOKENS),
        Kind::Chat | Kind::Responses | Kind::Messages | Kind::Tokens | Kind::Pool(_) => None,
    };
    let (out, reason) = if let Some(n) = header {
        match explicit.or(default_cap) {
            Some(mt) if n >= mt => (mt, FinishReason::Length),
            _ if n >= room => (room, FinishReason::Length),
            _ => (n, FinishReason::Stop),
        }
    } else {
        let cap = match (explicit, kind) {
            (Some(mt), _) => mt,
            (None, _) => default_cap.unwrap_or(room).min(room),
        };
        // Without --eos-before-max-tokens an explicit max_tokens is generated in full
        // (benchmark-style, EOS ignored); otherwise EOS (the drawn length) may come first.
        let eos = explicit.is_none() || a.eos_before_max_tokens;
        if ignore_eos || !eos {
            (cap, FinishReason::Length)
        } else {
            let drawn = {
                let mut inner = pod.lock();
                draw_output_len(
                    &mut inner.rng,
                    &a.output_len_dist,
                    a.output_len_mean,
                    a.output_len_sigma,
                )
            }
            .max(min_tokens);
            if drawn >= cap {
                (cap, FinishReason::Length)
            } else {
                (drawn, FinishReason::Stop)
            }
        }
    };
    let blocks = (prompt_len + out).div_ceil(a.block_size);
    if blocks > pod_blocks {
        if explicit.is_none() && header.is_none() && prompt_len < capacity {
            // A natural-length answer simply stops when the pod is full.
            return Ok((capacity - prompt_len, FinishReason::Length));
        }
        return Err(ApiError::bad(format!(
            "kvgate-sim: this request needs {blocks} KV cache blocks ({prompt_len} prompt + {out} \
             output tokens, block size {}) but the pod only has {} blocks ({capacity} tokens).",
            a.block_size, pod_blocks
        )));
    }
    Ok((out.max(1), reason))
}

// ---------------------------------------------------------------- handlers

async fn generate(pod: Arc<Pod>, req: Request<Incoming>, kind: Kind) -> Response<SimBody> {
    match read_json(req).await {
        Ok((headers, body, size)) => respond(pod, kind, &headers, body, size).await,
        // A body SGLang cannot read fails FastAPI's validation.
        Err(e) if kind == Kind::Generate => ApiError {
            kind: SGLANG_INVALID,
            ..e
        }
        .response_for(kind),
        Err(e) => e.response_for(kind),
    }
}

/// A generation request's answer, or its refusal in its API's shape. SGLang has answered a
/// stream 200 before its handler can refuse it (`stream_results`): the refusal is an event.
async fn respond(
    pod: Arc<Pod>,
    kind: Kind,
    headers: &HeaderMap,
    body: Value,
    size: usize,
) -> Response<SimBody> {
    let streamed = kind == Kind::Generate && sglang::streams(&body);
    match generate_inner(pod, kind, headers, body, size).await {
        Ok(r) => r,
        Err(e) if streamed && e.kind != SGLANG_INVALID => full(
            StatusCode::OK,
            Some("text/event-stream; charset=utf-8"),
            Bytes::from(sglang::error_stream(&e.message)),
        ),
        Err(e) => e.response_for(kind),
    }
}

/// The adapter of each prompt of an SGLang request (its `lora_path`, one per prompt: null or
/// empty is the base model), refused as SGLang's `_validate_and_resolve_lora` refuses it.
fn sglang_adapters(pod: &Pod, body: &Value) -> Result<Vec<Option<LoraRef>>, ApiError> {
    let paths = body.get("lora_path").and_then(Value::as_array);
    let names = paths.map_or(&[][..], Vec::as_slice);
    names
        .iter()
        .map(|p| match p.as_str().filter(|n| !n.is_empty()) {
            None => Ok(None),
            Some(name) if !pod.g.args.enable_lora => {
                Err(ApiError::bad(sglang::lora_disabled(name)))
            }
            Some(name) => pod.adapter(name).map(Some).ok_or_else(|| {
                let loaded: Vec<String> =
                    pod.lock().adapters.iter().map(|a| a.name.clone()).collect();
                ApiError::bad(sglang::lora_unknown(name, &loaded))
            }),
        })
        .collect()
}

/// What a request whose answer is cut short gets.
fn aborted() -> ApiError {
    ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        kind: "InternalServerError",
        message: "request was aborted".into(),
        param: None,
    }
}

/// The header vLLM's main reads a request's cache salt from, over the body's `cache_salt`: a
/// gateway sets it from the tenant's identity, so that tenants' prompts share no cached block.
const CACHE_SALT_HEADER: &str = "x-cache-salt";

/// The most characters vLLM takes in a salt (`_MAX_CACHE_SALT_LENGTH`).
const CACHE_SALT_MAX_CHARS: usize = 128;

/// The characters vLLM refuses in a salt (`_CACHE_SALT_FORBIDDEN_CHARS`): `@`, `/`, `\`, NUL.
const CACHE_SALT_FORBIDDEN: [char; 4] = ['@', '/', '\\', '\0'];

/// The `X-Cache-Salt` header's salt, if the request has one, checked as vLLM checks it.
///
/// vLLM's main (`resolve_cache_salt_header` in `vllm/entrypoints/serve/engine/serving.py`,
/// vllm-project/vllm#57609) sets the request's `cache_salt` from the header, over the body's,
/// before the prompt is rendered; without the header the body's salt stands. Confirmed from
/// vLLM's sources: its contract tests (`test_cache_salt_header.py`: the header sets the salt and
/// overrides the body's; `""`, `with/slash`, `with@at` and 129 characters are refused with a
/// `VLLMValidationError` matching `cache_salt`), the PR's description (a header salt that is
/// empty, longer than 128 characters or has `@`, `/`, `\` or NUL is refused, a 400, through the
/// body's existing validator), and that validator, `validate_cache_salt` in
/// `vllm/entrypoints/generate/base/protocol.py`, with its two messages and
/// `parameter="cache_salt"`, which `create_error_response` answers as a 400 `BadRequestError`
/// with `param` `cache_salt` and `str(exc)` as the message (`VLLMValidationError.__str__`
/// appends ` (parameter=cache_salt)`). Not read: the resolver's own body (no copy of it was
/// found), so that it calls `validate_cache_salt` rather than a copy of its rule is the PR's
/// word; nor whether `sanitize_message` changes these messages (the simulator leaves them as
/// they are). Starlette reads a header's bytes as Latin-1, so each byte is one character.
fn salt_header(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get(CACHE_SALT_HEADER) else {
        return Ok(None);
    };
    let salt: String = value.as_bytes().iter().map(|&b| char::from(b)).collect();
    check_salt(Some(&salt))?;
    Ok(Some(salt))
}

/// A body's `cache_salt`, checked by the same validator before anything else of the request
/// (`validate_cache_salt`, which the request models' `check_cache_salt_support` calls): absent
/// or null is none; anything else must be a salt `check_salt` takes. The Messages API's passes
/// through to the chat request it becomes (vllm-project/vllm#49498), and is checked there.
fn body_salt(body: &Value) -> Result<(), ApiError> {
    match body.get("cache_salt") {
        None | Some(Value::Null) => Ok(()),
        Some(v) => check_salt(v.as_str()),
    }
}

/// `validate_cache_salt`: a salt is a non-empty string of at most `CACHE_SALT_MAX_CHARS`
/// characters, none of them `CACHE_SALT_FORBIDDEN`; a 400 with `param` `cache_salt` otherwise.
fn check_salt(salt: Option<&str>) -> Result<(), ApiError> {
    let refuse = |message: &str| ApiError {
        status: StatusCode::BAD_REQUEST,
        kind: "BadRequestError",
        message: format!("{message} (parameter=cache_salt)"),
        param: Some("cache_salt"),
    };
    match salt {
        None | Some("") => Err(refuse(
            "Parameter 'cache_salt' must be a non-empty string if provided.",
        )),
        Some(s) if s.chars().count() > CACHE_SALT_MAX_CHARS || s.contains(CACHE_SALT_FORBIDDEN) => {
            Err(refuse(
                "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', \
                 '/', '\\\\', or NUL.",
            ))
        }
        Some(_) => Ok(()),
    }
}

async fn generate_inner(
    pod: Arc<Pod>,
    kind: Kind,
    headers: &HeaderMap,
    body: Value,
    size: usize,
) -> Result<Response<SimBody>, ApiError> {
    let g = pod.g.clone();
    let started = Instant::now();
    // A pooling request's options, checked as its model validates them.
    let pooling = match kind {
        Kind::Pool(endpoint) => Some(embeddings::options(&body, endpoint)?),
        _ => None,
    };
    // vLLM runs a Messages request as the chat request it converts it to; SGLang's request is
    // a completions request, read as SGLang normalizes it.
    let body = match kind {
        Kind::Messages => anthropic::chat_request(&body)?,
        Kind::Generate => sglang::request(&body)?,
        Kind::Tokens => {
            tokens::check(&body)?;
            body
        }
        Kind::Completion | Kind::Chat | Kind::Responses | Kind::Pool(_) => body,
    };
    // A body's salt is part of the request's validation, before its model is looked up.
    if kind != Kind::Generate {
        body_salt(&body)?;
    }
    // The adapter each prompt runs with: SGLang names one per prompt, the others one a request.
    let (model, loras) = match kind {
        Kind::Generate => (g.served[0].clone(), sglang_adapters(&pod, &body)?),
        _ => {
            let (model, lora) = check_model(&pod, &body)?;
            (model, vec![lora])
        }
    };
    // vLLM's main takes a request's salt from the `X-Cache-Salt` header over the body's (each
    // checked by the same validator), before it renders the prompt; SGLang reads no such
    // header, and keys a prompt by its own fields (below).
    let header_salt = match kind {
        Kind::Generate => None,
        _ => salt_header(headers)?,
    };
    // A Responses API follow-up's prompt starts with its conversation so far, from this pod's
    // store: a response another pod stored is not found here, as in vLLM.
    let previous = match body.get("previous_response_id") {
        Some(Value::String(id)) if kind == Kind::Responses => {
            let history = pod.lock().responses.get(id).map(|s| s.tokens.clone());
            let history = history.ok_or_else(|| ApiError {
                status: StatusCode::NOT_FOUND,
                kind: "invalid_request_error",
                message: responses::not_found_message(id),
                param: None,
            })?;
            Some((id.clone(), history))
        }
        _ => None,
    };
    let (mut prompts, body) = tokenize(&g, kind, body, size).await?;
    let previous = previous.map(|(id, mut history)| {
        if let Some(prompt) = prompts.first_mut() {
            history.append(prompt);
            *prompt = history;
        }
        id
    });
    // Each choice plans its own output, as each of vLLM's child requests meets EOS on its own:
    // `n` of them for each prompt, a batch's prompts in order (an answer's `index` is prompt ×
    // `n` + choice).
    let n = requested_n(kind, &body)?;
    let max_num_seqs = g.args.max_num_seqs;
    if kind == Kind::Tokens && n > max_num_seqs {
        return Err(ApiError::bad(format!(
            "sampling_params.n must be at most the server's max_num_seqs ({max_num_seqs}), got \
             {n}."
        )));
    }
    let plans = prompts
        .iter()
        .enumerate()
        .flat_map(|(i, p)| std::iter::repeat_n((i, p.len()), n))
        .map(|(i, len)| plan_output(&pod, kind, headers, sampling(kind, &body, i), len))
        .collect::<Result<Vec<_>, _>>()?;
    // A pooling request's task and `dimensions`, checked as vLLM's pooling serving and the
    // engine's `PoolingParams.verify` check them.
    let pooler = match &pooling {
        Some(o) => Some(Pooler::new(o, g.args.embedding_size, g.args.num_classes)?),
        None => None,
    };
    let stores = kind == Kind::Responses && flag(body.get("store"), "store")? != Some(false);
    // The pooling APIs have no `stream` (an unknown field, ignored): an answer is one object.
    let (stream, include_usage, continuous_usage) = match kind {
        Kind::Pool(_) => (false, false, false),
        _ => {
            let stream = flag(body.get("stream"), "stream")?.unwrap_or(false);
            let opts = body.get("stream_options");
            let include_usage =
                flag(opts.and_then(|o| o.get("include_usage")), "include_usage")?.unwrap_or(false);
            let continuous = opts.and_then(|o| o.get("continuous_usage_stats"));
            let continuous_usage =
                include_usage && flag(continuous, "continuous_usage_stats")?.unwrap_or(false);
            (stream, include_usage, continuous_usage)
        }
    };
    // A prompt's cache namespace. vLLM's is a request's salt, the `X-Cache-Salt` header's over
    // the body's. SGLang's is a prompt's: its radix cache keys a prompt's blocks by its
    // `cache_salt` and its `extra_key` (with the adapter, below), each normalized one a prompt.
    let cache_salt = |prompt: usize| match kind {
        Kind::Generate => {
            let per_prompt = |field: &str| {
                body.get(field)
                    .and_then(|v| v.get(prompt))
                    .and_then(Value::as_str)
            };
            kv::sglang_namespace(per_prompt("cache_salt"), per_prompt("extra_key"))
        }
        _ => header_salt.clone().or_else(|| {
            body.get("cache_salt")
                .and_then(Value::as_str)
                .map(str::to_string)
        }),
    };
    let lora = |prompt: usize| {
        let named = match kind {
            Kind::Generate => loras.get(prompt),
            _ => loras.first(),
        };
        named.cloned().flatten()
    };
    let id = {
        let mut inner = pod.lock();
        let suffix = inner.next_response_id();
        match kind {
            Kind::Completion => format!("cmpl-{suffix}"),
            // vLLM's Messages answer keeps its chat request's id.
            Kind::Chat | Kind::Messages => format!("chatcmpl-{suffix}"),
            Kind::Responses => format!("resp_{suffix}"),
            Kind::Tokens => {
                let header = headers.get("x-request-id").and_then(|h| h.to_str().ok());
                tokens::request_id(header, &body, suffix)
            }
            // Each SGLang answer has its own rid (`rids`).
            Kind::Generate => suffix,
            // vLLM's pooling serving: `embd-` (`pool-`, `classify-`, `score-`, `rerank-`) and
            // the `X-Request-Id` header's value, else a uuid.
            Kind::Pool(endpoint) => {
                let header = headers.get("x-request-id").and_then(|h| h.to_str().ok());
                let prefix = endpoint.id_prefix();
                format!("{prefix}-{}", header.map_or(suffix, str::to_string))
            }
        }
    };
    // SGLang's answers' rids: the request's, else fresh uuids, as `normalize_batch_and_arguments`
    // and `regenerate_rid` draw them.
    let rids: Vec<String> = match kind {
        Kind::Generate => {
            let given = body.get("rid").and_then(Value::as_array);
            (0..plans.len())
                .map(
                    |i| match given.and_then(|r| r.get(i)).and_then(Value::as_str) {
                        Some(r) => r.to_string(),
                        None => pod.lock().next_response_id(),
                    },
                )
                .collect()
        }
        _ => Vec::new(),
    };
    let single = body.get("single").and_then(Value::as_bool).unwrap_or(true);
    let created = unix_now();
    let mut choices: Vec<Choice> = plans
        .iter()
        .enumerate()
        .map(|(i, &(max_output, _))| {
            let prompt = prompts.get(i / n).map_or(0, Vec::len);
            Choice::new(&g, kind, max_output, prompt, i % n == 0)
        })
        .collect();
    let conversation = stores.then(|| prompts.first().cloned().unwrap_or_default());
    // vLLM V1's `ParentRequest`: a child request per choice, in order, each with its prompt
    // (shared among a prompt's choices only through the prefix cache) and its own output.
    let (tx, mut rx) = unbounded_channel();
    let ids = plans
        .into_iter()
        .enumerate()
        .map(|(choice, (max_output, finish_reason))| {
            let s = Submit {
                prompt: prompts.get(choice / n).cloned().unwrap_or_default(),
                max_output,
                finish_reason,
                cache_salt: cache_salt(choice / n),
                lora: lora(choice / n),
                choice,
                pooling: matches!(kind, Kind::Pool(_)),
            };
            pod.submit(s, &tx)
        })
        .collect();
    // The channel closes once every choice's request has ended or was aborted.
    drop(tx);
    let mut guard = AbortGuard::new(pod.clone(), ids);

    if stream {
        let messages = (kind == Kind::Messages).then(|| anthropic::Events::new(&id));
        let st = StreamState {
            g,
            kind,
            id,
            created,
            model,
            include_usage,
            continuous_usage,
            unfinished: choices.len(),
            choices,
            roles_sent: false,
            response: (kind == Kind::Responses).then(|| ResponseStream {
                events: responses::Events::new(format!("msg_{}", pod.lock().next_response_id())),
                text: String::new(),
                tokens: conversation.clone().unwrap_or_default(),
                previous: previous.clone(),
                store: stores.then(|| pod.clone()),
            }),
            messages,
            generate: (kind == Kind::Generate).then(|| GenerateStream {
                started,
                single,
                texts: vec![String::new(); rids.len()],
                sent: vec![false; rids.len()],
                rids,
            }),
        };
        let mut r = Response::new(SimBody::Sse(Box::new(SseBody {
            rx,
            guard,
            st,
            done: false,
        })));
        r.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream; charset=utf-8"),
        );
        r.headers_mut()
            .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        return Ok(r);
    }

    // The answer goes out when every choice has ended.
    let mut unfinished = choices.len();
    let mut conversation = conversation;
    while unfinished > 0 {
        let Some(ev) = rx.recv().await else {
            break;
        };
        if let Some(c) = &mut conversation {
            c.push(ev.token);
        }
        if let Some(c) = choices.get_mut(ev.choice) {
            c.add(&ev, &g.tok.piece(ev.token));
        }
        if ev.finish.is_some() {
            unfinished -= 1;
        }
    }
    guard.disarm();
    // Each prompt once, every choice's tokens, and each prompt's first choice's prefix-cache hits
    // (vLLM's usage of a request with `n` choices, summed over a batch's prompts).
    let (prompt_tokens, cached) = prompt_usage(&choices);
    let ended = choices
        .iter()
        .map(|c| c.finish.map(|f| (&c.unsent, f)))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(aborted)?;
    let completion_tokens = ended.iter().map(|(_, f)| f.completion_tokens).sum();
    let v = match kind {
        Kind::Completion => json!({
            "id": id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": ended.into_iter().enumerate().map(|(i, (text, f))| json!({
                "index": i,
                "text": text.content,
                "logprobs": null,
                "finish_reason": f.reason.as_str(),
                "stop_reason": null,
                "prompt_logprobs": null,
            })).collect::<Vec<_>>(),
            "usage": usage(prompt_tokens, completion_tokens, Some(cached)),
        }),
        Kind::Chat => json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": ended.into_iter().enumerate().map(|(i, (text, f))| json!({
                "index": i,
                "message": {"role": "assistant", "content": text.content, "refusal": null,
                            "annotations": null, "audio": null, "function_call": null,
                            "tool_calls": [],
                            "reasoning": (!text.reasoning.is_empty()).then_some(&text.reasoning)},
                "logprobs": null,
                "finish_reason": f.reason.as_str(),
                "stop_reason": null,
            })).collect::<Vec<_>>(),
            "usage": usage(prompt_tokens, completion_tokens, Some(cached)),
            "prompt_logprobs": null,
        }),
        Kind::Responses => {
            // The Responses API has no `n`: its one choice is the answer.
            let text = ended.first().map_or("", |(t, _)| t.content.as_str());
            let item_id = format!("msg_{}", pod.lock().next_response_id());
            let usage = responses::usage(prompt_tokens, completion_tokens, cached);
            let answer = Some((item_id.as_str(), text, usage));
            let v = responses::object(&id, created, &model, answer, previous.as_deref());
            if let Some(tokens) = conversation {
                let stored = responses::Stored {
                    tokens,
                    object: v.clone(),
                };
                pod.lock().responses.insert(id.clone(), stored);
            }
            v
        }
        Kind::Messages => {
            // No `n`: its one choice is the answer.
            let (text, f) = ended.first().ok_or_else(aborted)?;
            anthropic::message(
                &id,
                &model,
                &text.reasoning,
                &text.content,
                f.reason,
                prompt_tokens,
                completion_tokens,
            )
        }
        Kind::Generate => {
            let eos = g.tok.eos;
            let now = unix_now_f64();
            let mut objects = choices.iter().zip(&rids).map(|(c, rid)| {
                let text = format!("{}{}", c.unsent.reasoning, c.unsent.content);
                let answer = sglang::Answer {
                    rid,
                    text: &text,
                    ids: &c.ids,
                    finish: c.finish.map(|f| f.reason),
                    prompt_tokens: c.prompt_tokens,
                    completion_tokens: c.tokens,
                    cached_tokens: c.cached_tokens,
                    retractions: c.preemptions,
                    e2e_latency: c.ended.map(|e| e.duration_since(started).as_secs_f64()),
                    sent_ts: Some(now),
                };
                sglang::object(&answer, eos)
            });
            // One prompt sampled once answers an object; anything else a list, prompt by
            // prompt and each prompt's samples together (`_handle_batch_request`).
            match single {
                true => objects.next().unwrap_or_default(),
                false => Value::Array(objects.collect()),
            }
        }
        Kind::Tokens => {
            // The answer counts each choice's tokens as it returns them (a prefill only is
            // SGLang's alone).
            let completion_tokens = choices.iter().map(|c| c.tokens).sum();
            let answers = ended
                .iter()
                .enumerate()
                .map(|(i, (_, f))| tokens::choice(i, Some(f.reason.as_str()), &choices[i].ids));
            let usage = usage(prompt_tokens, completion_tokens, Some(cached));
            tokens::response(&id, &model, created, answers.collect(), usage)
        }
        Kind::Pool(_) => {
            // Each prompt's output, in the prompts' order; the usage sums the prompts' tokens as
            // the engine prefilled them (after any truncation). A big batch's outputs are made
            // and written on the blocking pool, as big prompts are tokenized.
            // (Always there for a pooling request: made with its options above.)
            let Some(p) = pooler else {
                return Err(aborted());
            };
            let floats = prompts
                .iter()
                .fold(0usize, |n, ids| n.saturating_add(p.floats(ids.len())));
            // vLLM's score serving answers the served model's name (`models.model_name()`),
            // whatever name the request gave.
            let model = match p.endpoint {
                Endpoint::Score | Endpoint::Rerank => g.served[0].clone(),
                Endpoint::Embeddings | Endpoint::Pooling | Endpoint::Classify => model,
            };
            let write = move || {
                let outputs: Vec<_> = prompts.iter().map(|ids| p.pool(ids)).collect();
                match p.endpoint {
                    Endpoint::Rerank => score::rerank(&id, &model, &body, &outputs, prompt_tokens),
                    endpoint => embeddings::response(
                        &id,
                        created,
                        &model,
                        endpoint,
                        &outputs,
                        p.encoding,
                        prompt_tokens,
                    ),
                }
            };
            let written = if floats < BLOCKING_EMBED_FLOATS {
                write()
            } else {
                tokio::task::spawn_blocking(write)
                    .await
                    .unwrap_or_else(|e| Err(e.to_string()))
            };
            let text = written.map_err(|e| ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                kind: "InternalServerError",
                message: format!("could not write the answer: {e}"),
                param: None,
            })?;
            return Ok(full(
                StatusCode::OK,
                Some("application/json"),
                Bytes::from(text),
            ));
        }
    };
    Ok(ok_json(&v))
}

/// `GET /v1/responses/{id}`: a response this pod stored.
fn retrieve_response(pod: &Pod, id: &str) -> Response<SimBody> {
    match pod.lock().responses.get(id) {
        Some(s) => ok_json(&s.object),
        None => ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: responses::not_found_message(id),
            param: None,
        }
        .response(),
    }
}

/// vLLM's /v1/completions/render and /v1/chat/completions/render: the rendered
/// prompt's token ids in GenerateRequest form (a list for completions, one per
/// prompt of a batch, `-<i>` after each one's id; one object for chat).
async fn render_endpoint(
    pod: Arc<Pod>,
    req: Request<Incoming>,
    kind: Kind,
) -> Result<Response<SimBody>, ApiError> {
    let (_headers, body, size) = read_json(req).await?;
    let g = pod.g.clone();
    let (model, _) = check_model(&pod, &body)?;
    let (prompts, body) = tokenize(&g, kind, body, size).await?;
    let max_tokens = requested_max_tokens(kind, &body)?;
    let n = requested_n(kind, &body)?;
    let suffix = pod.lock().next_response_id();
    let (rid, max_tokens) = match kind {
        Kind::Completion | Kind::Generate | Kind::Tokens | Kind::Pool(_) => (
            format!("cmpl-{suffix}"),
            Some(max_tokens.unwrap_or(COMPLETIONS_DEFAULT_MAX_TOKENS)),
        ),
        Kind::Chat | Kind::Responses | Kind::Messages => (format!("chatcmpl-{suffix}"), max_tokens),
    };
    let stream = flag(body.get("stream"), "stream")?.unwrap_or(false);
    let batch = prompts.len() > 1;
    let mut gens = prompts.into_iter().enumerate().map(|(i, ids)| {
        json!({
            "request_id": if batch { format!("{rid}-{i}") } else { rid.clone() },
            "token_ids": ids,
            "features": null,
            "sampling_params": {"n": n, "max_tokens": max_tokens},
            "model": model,
            "stream": stream,
            "cache_salt": body.get("cache_salt").cloned().unwrap_or(Value::Null),
            "priority": 0,
        })
    });
    Ok(ok_json(&match kind {
        Kind::Completion | Kind::Generate | Kind::Tokens | Kind::Pool(_) => {
            json!(gens.collect::<Vec<_>>())
        }
        Kind::Chat | Kind::Responses | Kind::Messages => gens.next().unwrap_or_default(),
    }))
}

/// `POST /v1/messages/count_tokens`: the prompt tokens of the conversation, as vLLM renders
/// the chat request a Messages request of it would become.
async fn count_tokens_endpoint(
    pod: Arc<Pod>,
    req: Request<Incoming>,
) -> Result<Response<SimBody>, ApiError> {
    let (_headers, body, size) = read_json(req).await?;
    let body = anthropic::chat_body(&body)?;
    check_model(&pod, &body)?;
    let (prompts, _) = tokenize(&pod.g, Kind::Chat, body, size).await?;
    Ok(ok_json(&anthropic::token_count(
        prompts.iter().map(Vec::len).sum(),
    )))
}

async fn tokenize_endpoint(
    pod: Arc<Pod>,
    req: Request<Incoming>,
) -> Result<Response<SimBody>, ApiError> {
    let (_headers, body, size) = read_json(req).await?;
    let g = pod.g.clone();
    check_model(&pod, &body)?;
    let kind = if body.get("messages").is_some() {
        Kind::Chat
    } else {
        Kind::Completion
    };
    let (prompts, body) = tokenize(&g, kind, body, size).await?;
    // vLLM's /tokenize takes one prompt.
    let [ids] = <[Vec<u32>; 1]>::try_from(prompts)
        .map_err(|_| ApiError::bad("/tokenize takes one prompt"))?;
    let strs = if flag(body.get("return_token_strs"), "return_token_strs")?.unwrap_or(false) {
        json!(ids.iter().map(|&i| g.tok.piece(i)).collect::<Vec<_>>())
    } else {
        Value::Null
    };
    Ok(ok_json(&json!({
        "count": ids.len(),
        "max_model_len": g.args.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    })))
}

async fn detokenize_endpoint(
    pod: Arc<Pod>,
    req: Request<Incoming>,
) -> Result<Response<SimBody>, ApiError> {
    let (_headers, body, _) = read_json(req).await?;
    check_model(&pod, &body)?;
    let ids = body
        .get("tokens")
        .and_then(Value::as_array)
        .and_then(|a| token_ids(a))
        .ok_or_else(|| ApiError::bad("tokens must be a list of token ids"))?;
    Ok(ok_json(&json!({"prompt": pod.g.tok.decode(&ids)})))
}

/// vLLM's `show_available_models`: a card per served base model name, then
/// one per registered adapter (`root` = its path, `parent` = its base model,
/// no `max_model_len`).
fn models(pod: &Pod) -> Response<SimBody> {
    let g = &pod.g;
    let created = g.start_unix as u64;
    let card = |id: &str, root: &str, parent: Option<&str>, max_model_len: Option<usize>| {
        json!({
            "id": id,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            "max_model_len": max_model_len,
            "permission": [{
                "id": format!("modelperm-{:016x}", crate::kv::mix64(created)),
                "object": "model_permission",
                "created": created,
                "allow_create_engine": false,
                "allow_sampling": true,
                "allow_logprobs": true,
                "allow_search_indices": false,
                "allow_view": true,
                "allow_fine_tuning": false,
                "organization": "*",
                "group": null,
                "is_blocking": false,
            }],
        })
    };
    let mut data: Vec<Value> = g
        .served
        .iter()
        .map(|name| card(name, &g.args.model, None, Some(g.args.max_model_len)))
        .collect();
    let adapters = pod.lock().adapters.clone();
    data.extend(
        adapters
            .iter()
            .map(|a| card(&a.name, &a.path, Some(&a.parent), None)),
    );
    ok_json(&json!({"object": "list", "data": data}))
}

/// vLLM's `InvalidUserInput` 400.
fn invalid_input(message: String) -> ApiError {
    ApiError {
        status: StatusCode::BAD_REQUEST,
        kind: "InvalidUserInput",
        message,
        param: None,
    }
}

/// A string field of a request body; empty or absent reads as missing.
fn str_field<'a>(body: &'a Value, key: &str) -> Option<&'a str> {
    body.get(key)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

/// vLLM's answer to a successful adapter load/unload: 200, the message as a
/// plain body (FastAPI `Response(content=...)`, no content type).
fn lora_success(message: String) -> Response<SimBody> {
    full(StatusCode::OK, None, Bytes::from(message))
}

/// `POST /v1/load_lora_adapter` (`OpenAIServingModels.load_lora_adapter`).
async fn load_lora_endpoint(
    pod: Arc<Pod>,
    req: Request<Incoming>,
) -> Result<Response<SimBody>, ApiError> {
    let (_h, body, _) = read_json(req).await?;
    let (Some(name), Some(path)) = (str_field(&body, "lora_name"), str_field(&body, "lora_path"))
    else {
        return Err(invalid_input(
            "Both 'lora_name' and 'lora_path' must be provided.".into(),
        ));
    };
    let inplace = flag(body.get("load_inplace"), "load_inplace")?.unwrap_or(false);
    match pod.load_adapter(name, path, inplace) {
        Ok(()) => Ok(lora_success(format!(
            "Success: LoRA adapter '{name}' added successfully."
        ))),
        Err(LoadError::AlreadyLoaded) => Err(invalid_input(format!(
            "The lora adapter '{name}' has already been loaded."
        ))),
        // The engine's add_lora fails without --enable-lora; vLLM answers 400.
        Err(LoadError::LoraDisabled) => Err(ApiError::bad("LoRA is not enabled.")),
    }
}

/// `POST /v1/unload_lora_adapter` (`OpenAIServingModels.unload_lora_adapter`).
async fn unload_lora_endpoint(
    pod: Arc<Pod>,
    req: Request<Incoming>,
) -> Result<Response<SimBody>, ApiError> {
    let (_h, body, _) = read_json(req).await?;
    let Some(name) = str_field(&body, "lora_name") else {
        return Err(invalid_input(
            "either 'lora_name' and 'lora_int_id' needs to be provided.".into(),
        ));
    };
    if !pod.unload_adapter(name) {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            message: format!("The lora adapter '{name}' cannot be found."),
            param: None,
        });
    }
    Ok(lora_success(format!(
        "Success: LoRA adapter '{name}' removed successfully."
    )))
}

/// Load as SGLang reports it: tokens held by running requests plus the prompt
/// tokens of queued requests.
fn sglang_load(pod: &Pod) -> (usize, usize, usize) {
    let inner = pod.lock();
    let e = &inner.engine;
    let used = e.kv.pool.num_used() * e.cfg.block_size;
    let queued: usize = e
        .waiting
        .iter()
        .filter_map(|id| e.reqs.get(id))
        .map(|r| r.prompt_len)
        .sum();
    (e.num_running(), e.num_waiting(), used + queued)
}

fn get_load(pod: &Pod) -> Response<SimBody> {
    let (running, waiting, tokens) = sglang_load(pod);
    if pod.g.args.get_load_format == "legacy" {
        return ok_json(&json!({"load": tokens}));
    }
    ok_json(&json!([{
        "dp_rank": 0,
        "num_reqs": running + waiting,
        "num_waiting_reqs": waiting,
        "num_tokens": tokens,
    }]))
}

/// The simulated model's architecture, as its Hugging Face config names it (a text-only model:
/// the score APIs refuse multimodal inputs with its name).
const ARCHITECTURE: &str = "LlamaForCausalLM";

fn model_info(g: &Shared) -> Response<SimBody> {
    ok_json(&json!({
        "model_path": g.args.model,
        "tokenizer_path": g.args.model,
        "is_generation": true,
        "preferred_sampling_params": null,
        "weight_version": "default",
        "has_image_understanding": false,
        "has_audio_understanding": false,
        "model_type": "llama",
        "architectures": [ARCHITECTURE],
    }))
}

fn server_info(pod: &Pod) -> Response<SimBody> {
    let a = &pod.g.args;
    let (running, waiting, tokens) = sglang_load(pod);
    let usage = pod.lock().engine.kv.pool.usage();
    ok_json(&json!({
        "model_path": a.model,
        "tokenizer_path": a.model,
        "served_model_name": pod.g.served[0],
        "host": a.host,
        "port": pod.port,
        "context_length": a.max_model_len,
        "page_size": a.block_size,
        "max_running_requests": a.max_num_seqs,
        "chunked_prefill_size": a.max_num_batched_tokens,
        "max_total_num_tokens": a.blocks(pod.index) * a.block_size,
        "disable_radix_cache": a.no_enable_prefix_caching,
        "tp_size": 1,
        "dp_size": 1,
        "is_embedding": false,
        "skip_tokenizer_init": false,
        "tokenizer": pod.g.tok.name,
        "internal_states": [{
            "load": tokens,
            "#running-req": running,
            "#queue-req": waiting,
            "token_usage": usage,
            "max_total_num_tokens": a.blocks(pod.index) * a.block_size,
        }],
        "version": concat!("kvgate-sim-", env!("CARGO_PKG_VERSION")),
    }))
}

fn sim_stats(pod: &Pod) -> Response<SimBody> {
    let inner = pod.lock();
    let e = &inner.engine;
    let c = &e.counters;
    ok_json(&json!({
        "pod": pod.index,
        "port": pod.port,
        "prefix_cache_hit_tokens": c.admitted_hit_tokens,
        "prefix_cache_query_tokens": c.admitted_query_tokens,
        "vllm_prefix_cache_hits": c.prefix_hits,
        "vllm_prefix_cache_queries": c.prefix_queries,
        "request_cache_hits": c.request_cache_hits,
        "request_cache_misses": c.request_cache_misses,
        "preemptions": c.preemptions,
        "peak_kv_blocks_used": c.peak_used_blocks,
        "kv_blocks_used": e.kv.pool.num_used(),
        "kv_blocks_cached": e.kv.pool.num_cached(),
        "kv_evictions": e.kv.pool.evictions,
        "num_gpu_blocks": e.cfg.num_gpu_blocks,
        "block_size": e.cfg.block_size,
        "running": e.num_running(),
        "waiting": e.num_waiting(),
        "finished": e.finished_total(),
        "finished_stop": c.finished_stop,
        "finished_length": c.finished_length,
        "aborted": c.finished_abort,
        "admitted": c.admitted_requests,
        "prompt_tokens": c.prompt_tokens,
        "generation_tokens": c.generation_tokens,
        "prefill_tokens_computed": c.prefill_tokens_computed,
        "steps": c.steps,
        "busy_seconds": c.busy_time,
        "virtual_seconds": e.now,
        "time_scale": pod.g.args.time_scale,
        "clock_resyncs": pod.clock_resyncs(),
        "ideal_query_tokens": pod.ideal_tokens().0,
        "ideal_hit_tokens": pod.ideal_tokens().1,
        "lora_loads": c.lora_loads,
        "lora_activations": c.lora_activations,
        "loras_active": e.loras.as_ref().map(|l| inner.lora_names_of(l.active())),
        "loras_loaded": e.loras.as_ref().map(|l| inner.lora_names_of(l.loaded())),
        "ttft_count": inner.ttft.count(),
        "ttft_sum_seconds": inner.ttft.sum(),
    }))
}

fn fault_json(f: &Fault) -> Value {
    json!({"metrics": f.metrics.as_str(), "metricsDelayMs": f.metrics_delay_ms,
           "retrieveDelayMs": f.retrieve_delay_ms})
}

async fn set_fault(pod: Arc<Pod>, req: Request<Incoming>) -> Result<Response<SimBody>, ApiError> {
    let (_h, body, _) = read_json(req).await?;
    let mut f = pod.fault();
    if let Some(m) = body.get("metrics") {
        f.metrics = match m.as_str() {
            Some("ok") => MetricsFault::Ok,
            Some("garbage") => MetricsFault::Garbage,
            Some("500") => MetricsFault::Error500,
            Some("404") => MetricsFault::NotFound,
            Some("slow") => MetricsFault::Slow,
            _ => {
                return Err(ApiError::bad(
                    "metrics must be one of ok, garbage, 500, 404, slow",
                ))
            }
        };
        if f.metrics == MetricsFault::Ok && body.get("metricsDelayMs").is_none() {
            f.metrics_delay_ms = 0;
        }
    }
    if let Some(d) = count(body.get("metricsDelayMs"), "metricsDelayMs")? {
        f.metrics_delay_ms = d as u64;
    }
    if let Some(d) = count(body.get("retrieveDelayMs"), "retrieveDelayMs")? {
        f.retrieve_delay_ms = d as u64;
    }
    pod.set_fault(f);
    Ok(ok_json(&fault_json(&f)))
}

async fn metrics_endpoint(pod: Arc<Pod>) -> Response<SimBody> {
    let f = pod.fault();
    let delay = match (f.metrics, f.metrics_delay_ms) {
        (MetricsFault::Slow, 0) => 2000,
        (_, d) => d,
    };
    if delay > 0 {
        // Wall-clock delay, deliberately not scaled by --time-scale.
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    match f.metrics {
        MetricsFault::Error500 => full(
            StatusCode::INTERNAL_SERVER_ERROR,
            Some("text/plain; charset=utf-8"),
            Bytes::from_static(b"Internal Server Error"),
        ),
        MetricsFault::NotFound => full(
            StatusCode::NOT_FOUND,
            Some("application/json"),
            Bytes::from_static(b"{\"detail\":\"Not Found\"}"),
        ),
        MetricsFault::Garbage => full(
            StatusCode::OK,
            Some("text/plain; version=0.0.4; charset=utf-8"),
            Bytes::from_static(
                b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"x\" NaN garbage\n\x7f{{{ not prometheus }}}\nvllm:kv_cache_usage_perc -- 1e999e9\n",
            ),
        ),
        MetricsFault::Ok | MetricsFault::Slow => {
            let g = pod.g.clone();
            let text = {
                let inner = pod.lock();
                let e = &inner.engine;
                render(&MetricsInput {
                    model_name: &g.served[0],
                    running: e.num_running(),
                    waiting: e.num_waiting(),
                    kv_usage: e.kv.pool.usage(),
                    block_size: e.cfg.block_size,
                    num_gpu_blocks: e.cfg.num_gpu_blocks,
                    enable_prefix_caching: e.cfg.enable_prefix_caching,
                    counters: &e.counters,
                    ttft: &inner.ttft,
                    e2e: &inner.e2e,
                    itl: &inner.itl,
                    generation: &inner.generation,
                    max_lora: e.cfg.lora.map_or(0, |l| l.max_loras),
                    lora_info: &inner.lora_info,
                    sglang: g.args.metrics_flavor == "sglang",
                })
            };
            full(
                StatusCode::OK,
                Some("text/plain; version=0.0.4; charset=utf-8"),
                Bytes::from(text),
            )
        }
    }
}

fn not_found() -> Response<SimBody> {
    json_response(StatusCode::NOT_FOUND, &json!({"detail": "Not Found"}))
}

fn method_not_allowed() -> Response<SimBody> {
    json_response(
        StatusCode::METHOD_NOT_ALLOWED,
        &json!({"detail": "Method Not Allowed"}),
    )
}

fn flatten(r: Result<Response<SimBody>, ApiError>) -> Response<SimBody> {
    r.unwrap_or_else(|e| e.response())
}

async fn route(pod: Arc<Pod>, req: Request<Incoming>) -> Response<SimBody> {
    let path = req.uri().path().to_string();
    let m = req.method().clone();
    let get = m == Method::GET || m == Method::HEAD;
    let post = m == Method::POST;
    match path.as_str() {
        "/health" | "/ping" if get => full(StatusCode::OK, None, Bytes::new()),
        "/metrics" if get => metrics_endpoint(pod).await,
        "/v1/models" if get => models(&pod),
        "/v1/load_lora_adapter" if post => flatten(load_lora_endpoint(pod, req).await),
        "/v1/unload_lora_adapter" if post => flatten(unload_lora_endpoint(pod, req).await),
        "/version" if get => {
            ok_json(&json!({"version": concat!("0.0.0+kvgate-sim.", env!("CARGO_PKG_VERSION"))}))
        }
        "/v1/completions" if post => generate(pod, req, Kind::Completion).await,
        "/v1/chat/completions" if post => generate(pod, req, Kind::Chat).await,
        "/v1/responses" if post => generate(pod, req, Kind::Responses).await,
        "/v1/messages" if post => generate(pod, req, Kind::Messages).await,
        // SGLang routes its `/generate` for PUT as well.
        "/generate" if post || m == Method::PUT => generate(pod, req, Kind::Generate).await,
        "/inference/v1/generate" if post => generate(pod, req, Kind::Tokens).await,
        "/v1/embeddings" if post => generate(pod, req, Kind::Pool(Endpoint::Embeddings)).await,
        "/pooling" if post => generate(pod, req, Kind::Pool(Endpoint::Pooling)).await,
        "/classify" if post => generate(pod, req, Kind::Pool(Endpoint::Classify)).await,
        "/score" | "/v1/score" if post => generate(pod, req, Kind::Pool(Endpoint::Score)).await,
        "/rerank" | "/v1/rerank" | "/v2/rerank" if post => {
            generate(pod, req, Kind::Pool(Endpoint::Rerank)).await
        }
        "/v1/messages/count_tokens" if post => count_tokens_endpoint(pod, req)
            .await
            .unwrap_or_else(|e| e.response_for(Kind::Messages)),
        p if get && p.starts_with("/v1/responses/") => {
            let delay = pod.fault().retrieve_delay_ms;
            if delay > 0 {
                // Wall-clock, like the metrics' delay.
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            retrieve_response(&pod, &p["/v1/responses/".len()..])
        }
        "/v1/completions/render" if post => {
            flatten(render_endpoint(pod, req, Kind::Completion).await)
        }
        "/v1/chat/completions/render" if post => {
            flatten(render_endpoint(pod, req, Kind::Chat).await)
        }
        "/tokenize" if post => flatten(tokenize_endpoint(pod, req).await),
        "/detokenize" if post => flatten(detokenize_endpoint(pod, req).await),
        "/get_load" if get => get_load(&pod),
        "/model_info" | "/get_model_info" if get => model_info(&pod.g),
        "/server_info" | "/get_server_info" if get => server_info(&pod),
        "/reset_prefix_cache" if post => {
            if pod.lock().engine.reset_prefix_cache() {
                full(StatusCode::OK, None, Bytes::new())
            } else {
                ApiError::bad("cannot reset the prefix cache while requests hold KV blocks")
                    .response()
            }
        }
        "/sim/stats" if get => sim_stats(&pod),
        "/sim/fault" if get => ok_json(&fault_json(&pod.fault())),
        "/sim/fault" if post => flatten(set_fault(pod, req).await),
        "/health"
        | "/ping"
        | "/metrics"
        | "/v1/models"
        | "/v1/load_lora_adapter"
        | "/v1/unload_lora_adapter"
        | "/version"
        | "/v1/completions"
        | "/v1/chat/completions"
        | "/v1/responses"
        | "/v1/messages"
        | "/v1/messages/count_tokens"
        | "/generate"
        | "/inference/v1/generate"
        | "/v1/embeddings"
        | "/pooling"
        | "/classify"
        | "/score"
        | "/v1/score"
        | "/rerank"
        | "/v1/rerank"
        | "/v2/rerank"
        | "/v1/completions/render"
        | "/v1/chat/completions/render"
        | "/tokenize"
        | "/detokenize"
        | "/get_load"
        | "/model_info"
        | "/get_model_info"
        | "/server_info"
        | "/get_server_info"
        | "/reset_prefix_cache"
        | "/sim/stats"
        | "/sim/fault" => method_not_allowed(),
        _ => not_found(),
    }
}

/// hyper service entry point: every response carries `x-sim-pod`.
pub async fn handle(
    pod: Arc<Pod>,
    req: Request<Incoming>,
) -> Result<Response<SimBody>, Infallible> {
    let index = pod.index;
    let mut resp = route(pod, req).await;
    resp.headers_mut()
        .insert("x-sim-pod", HeaderValue::from(index));
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn pod_with(flags: &[&str]) -> Arc<Pod> {
        let argv = std::iter::once("kvgate-sim").chain(flags.iter().copied());
        let args = <crate::config::Args as clap::Parser>::parse_from(argv);
        let tok = crate::tokenizer::Tokenizer::new("o200k_base").unwrap();
        Pod::new(0, 0, Arc::new(Shared::new(args, tok)))
    }

    /// (length, finish reason) of 400 chat requests with this body and headers.
    fn plans(pod: &Pod, headers: &HeaderMap, body: Value) -> Vec<(usize, FinishReason)> {
        (0..400)
            .map(
                |_| match plan_output(pod, Kind::Chat, headers, &body, 100) {
                    Ok(p) => p,
                    Err(e) => panic!("{}", e.message),
                },
            )
            .collect()
    }

    /// vLLM's completions stop at 16 tokens without `max_tokens`, whatever the model would say
    /// (the test header included); an explicit null is no limit; a chat has none either way.
    #[test]
    fn completions_without_max_tokens_stop_at_sixteen() {
        let pod = pod_with(&[]);
        let mut long = HeaderMap::new();
        long.insert("x-sim-output-tokens", "300".parse().unwrap());
        let plan = |kind, body: Value| match plan_output(&pod, kind, &long, &body, 100) {
            Ok(p) => p,
            Err(e) => panic!("{}", e.message),
        };
        let length = FinishReason::Length;
        assert_eq!(plan(Kind::Completion, json!({})), (16, length));
        assert_eq!(
            plan(Kind::Completion, json!({"max_tokens": null})),
            (300, FinishReason::Stop)
        );
        assert_eq!(
            plan(Kind::Completion, json!({"max_tokens": 40})),
            (40, length)
        );
        assert_eq!(plan(Kind::Chat, json!({})), (300, FinishReason::Stop));
        let drawn = (0..200)
            .map(|_| plan_output(&pod, Kind::Completion, &HeaderMap::new(), &json!({}), 100));
        assert!(drawn
            .into_iter()
            .all(|p| p.is_ok_and(|(n, _)| (1..=16).contains(&n))));
    }

    #[test]
    fn eos_before_max_tokens_draws_and_caps() {
        let none = HeaderMap::new();
        let bounded = json!({"max_tokens": 300});
        // Off (the default): max_tokens is generated in full.
        let off = pod_with(&[]);
        assert!(plans(&off, &none, bounded.clone())
            .iter()
            .all(|&p| p == (300, FinishReason::Length)));
        // On: drawn lengths (lognormal, mean 256), capped at max_tokens with "length".
        let on = pod_with(&["--eos-before-max-tokens"]);
        let got = plans(&on, &none, bounded.clone());
        assert!(got
            .iter()
            .all(|&(n, r)| (1..=300).contains(&n) && (r == FinishReason::Length) == (n == 300)));
        let capped = got.iter().filter(|p| p.1 == FinishReason::Length).count();
        assert!((40..360).contains(&capped), "{capped} of 400 capped");
        // ignore_eos still generates up to the cap.
        assert!(
            plans(&on, &none, json!({"max_tokens": 300, "ignore_eos": true}))
                .iter()
                .all(|&p| p == (300, FinishReason::Length))
        );
        // The test header still wins.
        let mut fixed = HeaderMap::new();
        fixed.insert("x-sim-output-tokens", "7".parse().unwrap());
        assert!(plans(&on, &fixed, bounded)
            .iter()
            .all(|&p| p == (7, FinishReason::Stop)));
    }

    /// A chat stream with usage, from a simulator started with `flags`.
    fn chat_stream(flags: &[&str]) -> StreamState {
        let args = <crate::config::Args as clap::Parser>::parse_from(
            std::iter::once("kvgate-sim").chain(flags.iter().copied()),
        );
        let tok = crate::tokenizer::Tokenizer::new("o200k_base").unwrap();
        StreamState {
            g: Arc::new(Shared::new(args, tok)),
            kind: Kind::Chat,
            id: "chatcmpl-x".into(),
            created: 1,
            model: "m".into(),
            include_usage: true,
            continuous_usage: false,
            choices: vec![Choice {
                prompt_tokens: 5,
                first_of_prompt: true,
                ..Choice::default()
            }],
            unfinished: 1,
            roles_sent: false,
            response: None,
            messages: None,
            generate: None,
        }
    }

    #[test]
    fn sse_chunks_for_chat_and_usage() {
        let mut st = chat_stream(&[]);
        let t0 = st.g.tok.filler()[0];
        let mut buf = Vec::new();
        st.on_event(
            &Event {
                choice: 0,
                token: t0,
                first: true,
                finish: None,
                cached_tokens: 0,
                preemptions: 0,
            },
            &mut buf,
        );
        st.on_event(
            &Event {
                choice: 0,
                token: t0,
                first: false,
                finish: Some(Finish {
                    reason: FinishReason::Length,
                    prompt_tokens: 5,
                    completion_tokens: 2,
                    cached_tokens: 0,
                }),
                cached_tokens: 0,
                preemptions: 0,
            },
            &mut buf,
        );
        let text = String::from_utf8(buf).unwrap();
        let events: Vec<&str> = text.split("\n\n").filter(|s| !s.is_empty()).collect();
        assert_eq!(events.len(), 5, "{text}");
        assert!(events[0].contains("\"role\":\"assistant\""));
        assert!(events[2].contains("\"finish_reason\":\"length\""));
        let usage: Value = serde_json::from_str(events[3].trim_start_matches("data: ")).unwrap();
        assert_eq!(usage["usage"]["completion_tokens"], 2);
        assert_eq!(usage["usage"]["total_tokens"], 7);
        assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        assert_eq!(events[4], "data: [DONE]");
    }

    /// The chunks of an answer of `n` tokens (each the tokenizer's first filler), parsed, and
    /// that token's text.
    fn stream_of(st: &mut StreamState, n: usize) -> (Vec<Value>, String) {
        let t0 = st.g.tok.filler()[0];
        let mut buf = Vec::new();
        for i in 0..n {
            let finish = (i + 1 == n).then_some(Finish {
                reason: FinishReason::Stop,
                prompt_tokens: 5,
                completion_tokens: n,
                cached_tokens: 0,
            });
            st.on_event(
                &Event {
                    choice: 0,
                    token: t0,
                    first: i == 0,
                    finish,
                    cached_tokens: 0,
                    preemptions: 0,
                },
                &mut buf,
            );
        }
        let events = String::from_utf8(buf)
            .unwrap()
            .split("\n\n")
            .filter(|s| !s.is_empty() && *s != "data: [DONE]")
            .map(|s| serde_json::from_str(s.trim_start_matches("data: ")).unwrap())
            .collect();
        (events, st.g.tok.piece(t0))
    }

    /// Each chunk's delta field `key`, where it has one.
    fn deltas<'a>(events: &'a [Value], key: &str) -> Vec<&'a str> {
        events
            .iter()
            .filter_map(|e| e["choices"][0]["delta"][key].as_str())
            .collect()
    }

    /// With `--stream-interval 3` seven tokens come as chunks of 3, 3 and 1, the role first
    /// and usage counting all seven.
    #[test]
    fn a_stream_interval_sends_several_tokens_a_chunk() {
        let mut st = chat_stream(&["--stream-interval", "3"]);
        let (events, piece) = stream_of(&mut st, 7);
        assert_eq!(
            deltas(&events, "content"),
            ["", &piece.repeat(3), &piece.repeat(3), &piece],
            "{events:?}"
        );
        assert_eq!(events.last().unwrap()["usage"]["completion_tokens"], 7);
    }

    /// A reasoning answer streams its first tokens as `delta.reasoning`, as vLLM's reasoning
    /// parser does, the rest as content, and a chunk that crosses the end carries both; usage
    /// counts them all.
    #[test]
    fn reasoning_streams_as_vllm_streams_it() {
        let mut st = chat_stream(&["--stream-interval", "2"]);
        st.choices[0].reasoning_tokens = 3;
        let (events, piece) = stream_of(&mut st, 6);
        assert_eq!(
            deltas(&events, "reasoning"),
            [piece.repeat(2), piece.clone()]
        );
        assert_eq!(
            deltas(&events, "content"),
            ["", &piece, &piece.repeat(2)],
            "{events:?}"
        );
        assert!(events[1]["choices"][0]["delta"].get("content").is_none());
        assert_eq!(events.last().unwrap()["usage"]["completion_tokens"], 6);
    }

    /// A pod whose engine runs on a thread of its own, as `main` starts it.
    fn running_pod(flags: &[&str]) -> Arc<Pod> {
        let pod = pod_with(flags);
        let engine = pod.clone();
        std::thread::spawn(move || engine.run_engine());
        pod
    }

    /// The answer to a generation request with these headers and body.
    async fn post(
        pod: &Arc<Pod>,
        kind: Kind,
        headers: &HeaderMap,
        body: Value,
    ) -> Response<SimBody> {
        respond(pod.clone(), kind, headers, body, 0).await
    }

    /// An answer's status and body.
    async fn read(r: Response<SimBody>) -> (StatusCode, String) {
        let status = r.status();
        let bytes = r.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8(bytes.to_vec()).unwrap())
    }

    /// A stream's chunks, parsed; it must end with one `[DONE]`.
    fn chunks(text: &str) -> Vec<Value> {
        let events: Vec<&str> = text.split("\n\n").filter(|s| !s.is_empty()).collect();
        assert_eq!(events.last(), Some(&"data: [DONE]"), "{text}");
        assert_eq!(events.iter().filter(|e| **e == "data: [DONE]").count(), 1);
        events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
            .collect()
    }

    /// The prompt tokens of a one-choice answer to `body`.
    async fn prompt_tokens(pod: &Arc<Pod>, kind: Kind, body: &Value) -> u64 {
        let (_, text) = read(post(pod, kind, &HeaderMap::new(), body.clone()).await).await;
        let v: Value = serde_json::from_str(&text).unwrap();
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    }

    /// `n` is vLLM's `SamplingParams.n`: 1 when absent or null, at least 1 and at most
    /// `VLLM_MAX_N_SEQUENCES`, a count as pydantic reads one, 1 for greedy sampling; the
    /// Responses API has none.
    #[test]
    fn n_is_checked_as_vllm_checks_it() {
        let n = |body: Value| requested_n(Kind::Chat, &body).map_err(|e| e.message);
        assert_eq!(n(json!({})), Ok(1));
        assert_eq!(n(json!({"n": null})), Ok(1));
        assert_eq!(n(json!({"n": 3})), Ok(3));
        assert_eq!(n(json!({"n": 3, "temperature": 0.7})), Ok(3));
        assert_eq!(n(json!({"n": 1, "temperature": 0})), Ok(1));
        assert_eq!(
            n(json!({"n": 0})),
            Err("n must be at least 1, got 0.".into())
        );
        // pydantic's lax reading (`lax`): a whole float or a string of digits is a count.
        assert_eq!(n(json!({"n": "2"})), Ok(2));
        assert_eq!(n(json!({"n": 2.0})), Ok(2));
        for bad in [json!(-1), json!(1.5), json!("2.5"), json!(MAX_N + 1)] {
            assert!(n(json!({ "n": bad })).is_err(), "{bad}");
        }
        assert_eq!(
            n(json!({"n": 2, "temperature": 0.0})),
            Err("n must be 1 when using greedy sampling, got 2.".into())
        );
        assert_eq!(requested_n(Kind::Responses, &json!({"n": 5})).ok(), Some(1));
    }

    /// n = 0 is vLLM's 400, in its error shape.
    #[tokio::test]
    async fn n_zero_is_a_bad_request() {
        let pod = pod_with(&[]);
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "n": 0});
        let (status, text) = read(post(&pod, Kind::Chat, &HeaderMap::new(), body).await).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["type"], "BadRequestError");
        assert_eq!(v["error"]["code"], 400);
        assert_eq!(pod.lock().engine.num_waiting(), 0);
    }

    /// n = 3 with max_tokens: three choices (indices 0..2), each an engine request of its own
    /// that runs to the limit; usage counts the prompt once and sums the choices' tokens. The
    /// test header fixes every choice's length.
    #[tokio::test]
    async fn n_choices_answer_together_and_count_the_prompt_once() {
        let pod = running_pod(&["--time-scale", "1000"]);
        let none = HeaderMap::new();
        let bodies = [
            (
                Kind::Completion,
                json!({"prompt": "Tell me a story", "max_tokens": 8}),
            ),
            (
                Kind::Chat,
                json!({"messages": [{"role": "user", "content": "Tell me a story"}],
                       "max_tokens": 8}),
            ),
        ];
        for (kind, body) in bodies {
            let prompt = prompt_tokens(&pod, kind, &body).await;
            let admitted = pod.lock().engine.counters.admitted_requests;
            let mut three = body.clone();
            three["n"] = json!(3);
            let (status, text) = read(post(&pod, kind, &none, three).await).await;
            assert_eq!(status, StatusCode::OK, "{text}");
            let v: Value = serde_json::from_str(&text).unwrap();
            let choices = v["choices"].as_array().unwrap();
            assert_eq!(choices.len(), 3, "{text}");
            for (i, c) in choices.iter().enumerate() {
                assert_eq!(c["index"], i);
                assert_eq!(c["finish_reason"], "length");
                let text = match kind {
                    Kind::Completion => &c["text"],
                    _ => &c["message"]["content"],
                };
                assert!(!text.as_str().unwrap().is_empty());
            }
            assert_eq!(v["usage"]["prompt_tokens"], prompt);
            assert_eq!(v["usage"]["completion_tokens"], 24);
            assert_eq!(v["usage"]["total_tokens"], prompt + 24);
            assert!(v["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
            assert_eq!(pod.lock().engine.counters.admitted_requests, admitted + 3);
        }
        let mut fixed = HeaderMap::new();
        fixed.insert("x-sim-output-tokens", "5".parse().unwrap());
        let body = json!({"prompt": "Tell me a story", "max_tokens": 8, "n": 2});
        let (_, text) = read(post(&pod, Kind::Completion, &fixed, body).await).await;
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["choices"][1]["finish_reason"], "stop");
        assert_eq!(v["usage"]["completion_tokens"], 10);
    }

    /// Streamed, every chunk names its choice; each choice ends with its own finish chunk, and
    /// the one usage chunk (prompt once, tokens summed) and `[DONE]` follow the last. Chat
    /// sends every choice's role first, as vLLM does.
    #[tokio::test]
    async fn n_choices_stream_with_one_usage_chunk() {
        let pod = running_pod(&["--time-scale", "1000"]);
        let bodies = [
            (Kind::Completion, json!({"prompt": "Tell me a story"})),
            (
                Kind::Chat,
                json!({"messages": [{"role": "user", "content": "Tell me a story"}]}),
            ),
        ];
        for (kind, mut body) in bodies {
            body["max_tokens"] = json!(4);
            let prompt = prompt_tokens(&pod, kind, &body).await;
            body["n"] = json!(3);
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
            let (_, text) = read(post(&pod, kind, &HeaderMap::new(), body).await).await;
            let chunks = chunks(&text);
            let (usage, choices) = chunks.split_last().unwrap();
            assert_eq!(usage["choices"], json!([]), "{text}");
            assert_eq!(usage["usage"]["prompt_tokens"], prompt);
            assert_eq!(usage["usage"]["completion_tokens"], 12);
            assert_eq!(usage["usage"]["total_tokens"], prompt + 12);
            let mut roles = Vec::new();
            let mut tokens = [0; 3];
            let mut ended = [false; 3];
            for c in choices {
                let choice = &c["choices"][0];
                let i = choice["index"].as_u64().unwrap() as usize;
                assert!(c.get("usage").is_none() && !ended[i], "{text}");
                if choice["delta"].get("role").is_some() {
                    roles.push(i);
                    continue;
                }
                tokens[i] += 1;
                ended[i] = !choice["finish_reason"].is_null();
                if ended[i] {
                    assert_eq!(choice["finish_reason"], "length");
                }
            }
            assert_eq!(tokens, [4; 3], "{text}");
            assert_eq!(ended, [true; 3]);
            if kind == Kind::Chat {
                assert_eq!(roles, [0, 1, 2]);
                assert!(choices[..3]
                    .iter()
                    .all(|c| c["choices"][0]["delta"]["role"] == "assistant"));
            } else {
                assert!(roles.is_empty());
            }
        }
    }

    /// A completions batch (a list of strings, or of lists of ids): each prompt answered `n`
    /// times, as engine requests of their own, an answer's `index` prompt × `n` + choice; usage
    /// sums every prompt (once each) and every answer, streamed or not.
    #[tokio::test]
    async fn a_batch_of_prompts_answers_each_n_times() {
        let pod = running_pod(&["--time-scale", "1000"]);
        let kind = Kind::Completion;
        let one = |p: &str| json!({"prompt": p, "max_tokens": 4});
        let (a, b) = (
            prompt_tokens(&pod, kind, &one("Tell me a story")).await,
            prompt_tokens(&pod, kind, &one("Hello there, how are you today")).await,
        );
        let ids = json!([[1, 2, 3], [4, 5], [6]]);
        for (prompt, prompts, n) in [
            (
                json!(["Tell me a story", "Hello there, how are you today"]),
                a + b,
                2,
            ),
            (ids.clone(), 6, 1),
        ] {
            let admitted = pod.lock().engine.counters.admitted_requests;
            let lists = prompt.as_array().unwrap().len();
            let body = json!({"prompt": prompt, "max_tokens": 4, "n": n});
            let (status, text) =
                read(post(&pod, kind, &HeaderMap::new(), body.clone()).await).await;
            assert_eq!(status, StatusCode::OK, "{text}");
            let v: Value = serde_json::from_str(&text).unwrap();
            let indices: Vec<u64> = v["choices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["index"].as_u64().unwrap())
                .collect();
            assert_eq!(indices, (0..(lists * n) as u64).collect::<Vec<_>>());
            assert_eq!(v["usage"]["prompt_tokens"], prompts, "{text}");
            assert_eq!(v["usage"]["completion_tokens"], 4 * lists * n);
            assert_eq!(
                pod.lock().engine.counters.admitted_requests,
                admitted + (lists * n) as u64
            );
            let mut streamed = body;
            streamed["stream"] = json!(true);
            streamed["stream_options"] = json!({"include_usage": true});
            let (_, text) = read(post(&pod, kind, &HeaderMap::new(), streamed).await).await;
            let usage = chunks(&text).pop().unwrap();
            assert_eq!(usage["usage"]["prompt_tokens"], prompts, "{text}");
            assert_eq!(usage["usage"]["completion_tokens"], 4 * lists * n);
        }
        let (status, _) =
            read(post(&pod, kind, &HeaderMap::new(), json!({"prompt": ["a", 1]})).await).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
    }

    /// Without max_tokens each choice draws its own length (seeded); usage sums them, and a
    /// choice's continuous usage counts its own tokens, as vLLM's does.
    #[tokio::test]
    async fn each_choice_draws_its_own_length() {
        let pod = running_pod(&["--time-scale", "1000", "--output-len-mean", "12"]);
        let body = json!({
            "messages": [{"role": "user", "content": "Tell me a story"}],
            "n": 4,
            "stream": true,
            "stream_options": {"include_usage": true, "continuous_usage_stats": true},
        });
        let (_, text) = read(post(&pod, Kind::Chat, &HeaderMap::new(), body).await).await;
        let chunks = chunks(&text);
        let (usage, choices) = chunks.split_last().unwrap();
        let mut lengths = [0; 4];
        for c in choices {
            let choice = &c["choices"][0];
            if choice["delta"].get("role").is_some() {
                continue;
            }
            let i = choice["index"].as_u64().unwrap() as usize;
            lengths[i] += 1;
            assert_eq!(c["usage"]["completion_tokens"], lengths[i], "{text}");
            if !choice["finish_reason"].is_null() {
                assert_eq!(choice["finish_reason"], "stop");
            }
        }
        assert_eq!(
            usage["usage"]["completion_tokens"],
            lengths.iter().sum::<u64>()
        );
        assert!(lengths.iter().any(|&l| l != lengths[0]), "{lengths:?}");
    }

    /// Each choice runs as a request of its own, holding its own KV, in vLLM's gauges; a client
    /// that goes away aborts them all.
    #[tokio::test]
    async fn choices_run_as_requests_and_abort_together() {
        let pod = running_pod(&[]);
        let body = json!({
            "messages": [{"role": "user", "content": "Tell me a story"}],
            "n": 3,
            "max_tokens": 5000,
            "stream": true,
        });
        let r = post(&pod, Kind::Chat, &HeaderMap::new(), body).await;
        let mut stream = r.into_body();
        assert!(stream.frame().await.is_some());
        for _ in 0..500 {
            if pod.lock().engine.num_running() == 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (_, metrics) = read(metrics_endpoint(pod.clone()).await).await;
        let running = metrics
            .lines()
            .find(|l| l.starts_with("vllm:num_requests_running{"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok());
        assert_eq!(running, Some(3.0), "{metrics}");
        assert!(pod.lock().engine.kv.pool.num_used() >= 3);
        drop(stream);
        let inner = pod.lock();
        let e = &inner.engine;
        assert_eq!((e.num_running(), e.num_waiting()), (0, 0));
        assert_eq!(e.counters.finished_abort, 3);
        assert_eq!(e.kv.pool.num_used(), 0);
    }

    /// A conversation with a hoisted system text (less the billing header), an image, a tool
    /// call and its result, as /v1/messages takes it...
    fn anthropic_conversation() -> Value {
        json!({
            "model": "m",
            "max_tokens": 6,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=42;"},
                       {"type": "text", "text": "You are terse."}],
            "messages": [
                {"role": "user", "content": [
                    {"type": "image", "source": {"type": "url", "url": "https://x/cat.png"}},
                    {"type": "text", "text": "What is it?"}]},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "t1", "name": "look", "input": {"at": "cat"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "a cat"}]},
            ],
            "tools": [{"name": "look", "description": "Looks.",
                       "input_schema": {"type": "object"}}],
        })
    }

    /// ...and as /v1/chat/completions takes it.
    fn chat_conversation() -> Value {
        json!({
            "max_tokens": 6,
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "https://x/cat.png"}},
                    {"type": "text", "text": "What is it?"}]},
                {"role": "assistant", "tool_calls": [{"id": "t1", "type": "function",
                    "function": {"name": "look", "arguments": "{\"at\":\"cat\"}"}}]},
                {"role": "tool", "tool_call_id": "t1", "content": "a cat"},
            ],
            "tools": [{"type": "function", "function": {"name": "look", "description": "Looks.",
                       "parameters": {"type": "object"}}}],
        })
    }

    /// A Messages API stream's events, parsed, each's `event:` line its JSON's type.
    fn anthropic_events(text: &str) -> Vec<Value> {
        assert!(!text.contains("[DONE]"), "{text}");
        text.split("\n\n")
            .filter(|s| !s.is_empty())
            .map(|e| {
                let (kind, data) = e.split_once("\ndata: ").unwrap();
                let v: Value = serde_json::from_str(data).unwrap();
                assert_eq!(kind.strip_prefix("event: "), v["type"].as_str(), "{text}");
                v
            })
            .collect()
    }

    /// The same conversation counts the same prompt tokens through /v1/messages as through
    /// /v1/chat/completions (its image a media part), and its answer is vLLM's message object:
    /// the chat id, its text, `max_tokens` at the limit and `end_turn` before it, no `None`s.
    #[tokio::test]
    async fn a_messages_answer_is_its_chat_answer_in_anthropic_shape() {
        let pod = running_pod(&[
            "--time-scale",
            "1000",
            "--media-part-tokens",
            "100",
            "--served-model-name",
            "m",
        ]);
        let chat = prompt_tokens(&pod, Kind::Chat, &chat_conversation()).await;
        let none = HeaderMap::new();
        let (status, text) =
            read(post(&pod, Kind::Messages, &none, anthropic_conversation()).await).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            v["usage"],
            json!({"input_tokens": chat, "output_tokens": 6})
        );
        assert!(chat > 100, "the image counts: {chat}");
        assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
        assert_eq!(
            (&v["type"], &v["role"]),
            (&json!("message"), &json!("assistant"))
        );
        assert_eq!(v["model"], "m");
        assert_eq!(v["stop_reason"], "max_tokens");
        assert!(v.get("stop_sequence").is_none(), "{text}");
        let content = v["content"].as_array().unwrap();
        assert_eq!(content.len(), 1);
        assert_eq!(content[0]["type"], "text");
        assert!(!content[0]["text"].as_str().unwrap().is_empty());
        let mut short = HeaderMap::new();
        short.insert("x-sim-output-tokens", "2".parse().unwrap());
        let (_, text) =
            read(post(&pod, Kind::Messages, &short, anthropic_conversation()).await).await;
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["stop_reason"], "end_turn");
        assert_eq!(v["usage"]["output_tokens"], 2);
    }

    /// Streamed: `message_start` with the prompt's tokens, a text block with a delta per chat
    /// chunk (`--stream-interval 2`: 7 tokens in 4), then its stop, `message_delta` with the
    /// tokens made and `message_stop`, no `[DONE]`. A reasoning share streams a thinking block
    /// first, closed with its signature.
    #[tokio::test]
    async fn a_messages_stream_is_its_chat_stream_as_events() {
        let pod = running_pod(&[
            "--time-scale",
            "1000",
            "--stream-interval",
            "2",
            "--served-model-name",
            "m",
        ]);
        let mut body = anthropic_conversation();
        body["max_tokens"] = json!(7);
        let mut chat = chat_conversation();
        chat["max_tokens"] = json!(7);
        let prompt = prompt_tokens(&pod, Kind::Chat, &chat).await;
        body["stream"] = json!(true);
        let r = post(&pod, Kind::Messages, &HeaderMap::new(), body.clone()).await;
        assert_eq!(
            r.headers().get(CONTENT_TYPE).unwrap(),
            "text/event-stream; charset=utf-8"
        );
        let (_, text) = read(r).await;
        let events = anthropic_events(&text);
        let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds[..2],
            ["message_start", "content_block_start"],
            "{text}"
        );
        assert_eq!(
            kinds[kinds.len() - 3..],
            ["content_block_stop", "message_delta", "message_stop"]
        );
        let start = &events[0]["message"];
        assert_eq!(
            start["usage"],
            json!({"input_tokens": prompt, "output_tokens": 0})
        );
        assert!(start["id"].as_str().unwrap().starts_with("chatcmpl-"));
        assert_eq!(
            events[1]["content_block"],
            json!({"type": "text", "text": ""})
        );
        let deltas: Vec<&Value> = events
            .iter()
            .filter(|e| e["type"] == "content_block_delta")
            .collect();
        assert_eq!(deltas.len(), 4, "{text}");
        assert!(deltas
            .iter()
            .all(|d| d["delta"]["type"] == "text_delta" && d["index"] == 0));
        assert_eq!(
            events[events.len() - 2],
            json!({"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                   "usage": {"input_tokens": prompt, "output_tokens": 7}})
        );

        let pod = running_pod(&[
            "--time-scale",
            "1000",
            "--reasoning-share",
            "0.5",
            "--served-model-name",
            "m",
        ]);
        body["max_tokens"] = json!(4);
        let (_, text) = read(post(&pod, Kind::Messages, &HeaderMap::new(), body).await).await;
        let events = anthropic_events(&text);
        let blocks: Vec<(&Value, &Value)> = events
            .iter()
            .filter(|e| e["type"] == "content_block_delta")
            .map(|e| (&e["index"], &e["delta"]["type"]))
            .collect();
        let (thinking, text_delta, signature) = (
            json!("thinking_delta"),
            json!("text_delta"),
            json!("signature_delta"),
        );
        let (zero, one) = (json!(0), json!(1));
        assert_eq!(
            blocks,
            [
                (&zero, &thinking),
                (&zero, &thinking),
                (&zero, &signature),
                (&one, &text_delta),
                (&one, &text_delta)
            ],
            "{text}"
        );
    }

    /// A Messages request's errors come in its API's shape with the chat path's status: a
    /// missing or non-positive `max_tokens` (nothing reaches the engine), an unknown model.
    #[tokio::test]
    async fn messages_errors_are_anthropic_shaped() {
        let pod = pod_with(&["--served-model-name", "m"]);
        let none = HeaderMap::new();
        let mut missing = anthropic_conversation();
        missing.as_object_mut().unwrap().remove("max_tokens");
        let mut zero = anthropic_conversation();
        zero["max_tokens"] = json!(0);
        let mut unknown = anthropic_conversation();
        unknown["model"] = json!("nope");
        let cases = [
            (
                missing,
                StatusCode::BAD_REQUEST,
                "BadRequestError",
                "max_tokens: Field required",
            ),
            (
                zero,
                StatusCode::BAD_REQUEST,
                "BadRequestError",
                "max_tokens must be positive",
            ),
            (
                unknown,
                StatusCode::NOT_FOUND,
                "NotFoundError",
                "The model `nope` does not exist.",
            ),
        ];
        for (body, status, kind, message) in cases {
            let (got, text) = read(post(&pod, Kind::Messages, &none, body).await).await;
            assert_eq!(got, status, "{text}");
            let v: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(
                v,
                json!({"type": "error", "error": {"type": kind, "message": message}})
            );
        }
        assert_eq!(pod.lock().engine.num_waiting(), 0);
    }

    /// A native request's JSON answer, with these headers.
    async fn answer(pod: &Arc<Pod>, kind: Kind, headers: &HeaderMap, body: Value) -> Value {
        let (status, text) = read(post(pod, kind, headers, body).await).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        serde_json::from_str(&text).unwrap()
    }

    /// A header map that fixes the length the model would run to.
    fn runs_to(n: usize) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("x-sim-output-tokens", n.to_string().parse().unwrap());
        h
    }

    /// SGLang's `/generate` answers one object for one prompt: its text, its ids and its
    /// `meta_info`; a limit ends it with its length, a natural end with the EOS matched (counted
    /// and among the ids, not in the text); a prompt counts as the completions prompt of its
    /// text.
    #[tokio::test]
    async fn sglang_generate_answers_as_sglang_does() {
        let pod = running_pod(&["--time-scale", "1000"]);
        let eos = pod.g.tok.eos;
        let none = HeaderMap::new();
        let prompt = "Tell me a story about caches";
        let completions = json!({"prompt": prompt, "max_tokens": 5});
        let p = prompt_tokens(&pod, Kind::Completion, &completions).await;
        let body = json!({"text": prompt, "sampling_params": {"max_new_tokens": 5}, "rid": "r1"});
        let v = answer(&pod, Kind::Generate, &none, body.clone()).await;
        let ids = v["output_ids"].as_array().unwrap();
        assert_eq!(ids.len(), 5, "{v}");
        let m = &v["meta_info"];
        assert_eq!(m["id"], "r1");
        assert_eq!(m["finish_reason"], json!({"type": "length", "length": 5}));
        assert_eq!(
            (m["prompt_tokens"].as_u64(), &m["completion_tokens"]),
            (Some(p), &json!(5))
        );
        assert_eq!(
            (&m["weight_version"], &m["num_retractions"]),
            (&json!("default"), &json!(0))
        );
        assert!(
            m["cached_tokens"].is_u64() && m["e2e_latency"].as_f64().unwrap() > 0.0,
            "{v}"
        );
        let words: Vec<u32> = ids.iter().map(|i| i.as_u64().unwrap() as u32).collect();
        assert_eq!(v["text"], pod.g.tok.decode(&words));

        let v = answer(&pod, Kind::Generate, &runs_to(3), body).await;
        let ids: Vec<u32> = v["output_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap() as u32)
            .collect();
        assert_eq!((ids.len(), ids[2]), (3, eos), "{v}");
        assert_eq!(v["text"], pod.g.tok.decode(&ids[..2]));
        assert_eq!(v["meta_info"]["completion_tokens"], 3);
        assert_eq!(
            v["meta_info"]["finish_reason"],
            json!({"type": "stop", "matched": eos})
        );
    }

    /// Without `max_new_tokens` SGLang stops at 128, whatever the model would run to; a null
    /// one is no limit but the context (less SGLang's two); 0 is a prefill only.
    #[tokio::test]
    async fn sglang_limits_default_to_128_and_null_to_the_context() {
        let pod = running_pod(&["--time-scale", "1000", "--max-model-len", "1000"]);
        let limit = |sp: Value| json!({"input_ids": [1, 2, 3, 4], "sampling_params": sp});
        let v = answer(&pod, Kind::Generate, &runs_to(300), limit(json!({}))).await;
        assert_eq!(
            v["meta_info"]["finish_reason"],
            json!({"type": "length", "length": 128})
        );
        let no_params = json!({"input_ids": [1, 2, 3, 4]});
        let v = answer(&pod, Kind::Generate, &runs_to(300), no_params).await;
        assert_eq!(v["meta_info"]["completion_tokens"], 128);
        let v = answer(
            &pod,
            Kind::Generate,
            &runs_to(300),
            limit(json!({"max_new_tokens": null})),
        )
        .await;
        assert_eq!(v["meta_info"]["completion_tokens"], 300);
        let to_context = answer(
            &pod,
            Kind::Generate,
            &runs_to(5000),
            limit(json!({"max_new_tokens": null})),
        )
        .await;
        assert_eq!(
            to_context["meta_info"]["finish_reason"],
            json!({"type": "length", "length": 994})
        );
        let v = answer(
            &pod,
            Kind::Generate,
            &none(),
            limit(json!({"max_new_tokens": 0})),
        )
        .await;
        assert_eq!(
            (
                &v["text"],
                &v["output_ids"],
                &v["meta_info"]["completion_tokens"]
            ),
            (&json!(""), &json!([]), &json!(0))
        );
        assert_eq!(
            v["meta_info"]["finish_reason"],
            json!({"type": "length", "length": 0})
        );
    }

    fn none() -> HeaderMap {
        HeaderMap::new()
    }

    /// A batch, or `n` samples, answers a list: prompt by prompt, each prompt's samples
    /// together, each an engine request of its own with its own rid (a uuid for samples, the
    /// request's `<rid>_<i>` for a batch's prompts), its own sampling object.
    #[tokio::test]
    async fn sglang_batches_and_samples_answer_lists() {
        let pod = running_pod(&["--time-scale", "1000"]);
        let admitted = pod.lock().engine.counters.admitted_requests;
        let body = json!({"text": ["Tell me a story", "Hello there, how are you today"],
                          "sampling_params": {"max_new_tokens": 3, "n": 2}, "rid": "x"});
        let v = answer(&pod, Kind::Generate, &none(), body).await;
        let list = v.as_array().unwrap();
        assert_eq!(list.len(), 4, "{v}");
        assert_eq!(pod.lock().engine.counters.admitted_requests, admitted + 4);
        let prompts: Vec<u64> = list
            .iter()
            .map(|o| o["meta_info"]["prompt_tokens"].as_u64().unwrap())
            .collect();
        assert_eq!(prompts[0], prompts[1]);
        assert_eq!(prompts[2], prompts[3]);
        assert_ne!(prompts[0], prompts[2]);
        let rids: HashSet<&str> = list
            .iter()
            .map(|o| o["meta_info"]["id"].as_str().unwrap())
            .collect();
        assert_eq!(rids.len(), 4);
        assert!(rids.iter().all(|r| r.len() == 32), "{rids:?}");
        assert!(list.iter().all(|o| o.get("index").is_none()));

        let body = json!({"input_ids": [[1, 2, 3], [4, 5]], "rid": "x",
                          "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 4}]});
        let v = answer(&pod, Kind::Generate, &none(), body).await;
        let got: Vec<(&Value, &Value, &Value)> = v
            .as_array()
            .unwrap()
            .iter()
            .map(|o| {
                let m = &o["meta_info"];
                (&m["id"], &m["prompt_tokens"], &m["completion_tokens"])
            })
            .collect();
        assert_eq!(
            got,
            [
                (&json!("x_0"), &json!(3), &json!(2)),
                (&json!("x_1"), &json!(2), &json!(4))
            ]
        );
        let one = json!({"text": "Hi", "sampling_params": {"max_new_tokens": 2, "n": 3}});
        let v = answer(&pod, Kind::Generate, &none(), one).await;
        assert_eq!(
            v.as_array().map(Vec::len),
            Some(3),
            "n > 1 answers a list: {v}"
        );
    }

    /// SGLang streams the answer so far: its whole text and ids, its tokens so far, a null
    /// finish until the last chunk (`--stream-interval` tokens a chunk); a batch's or `n`'s
    /// chunks carry their answer's `index`; then `[DONE]`.
    #[tokio::test]
    async fn sglang_streams_the_answer_so_far() {
        let pod = running_pod(&["--time-scale", "1000", "--stream-interval", "2"]);
        let body = json!({"text": "Tell me a story", "stream": true,
                          "sampling_params": {"max_new_tokens": 5}});
        let r = post(&pod, Kind::Generate, &none(), body).await;
        assert_eq!(
            r.headers().get(CONTENT_TYPE).unwrap(),
            "text/event-stream; charset=utf-8"
        );
        let (_, text) = read(r).await;
        let sent = chunks(&text);
        let counts: Vec<(u64, usize)> = sent
            .iter()
            .map(|c| {
                let ids = c["output_ids"].as_array().unwrap().len();
                (c["meta_info"]["completion_tokens"].as_u64().unwrap(), ids)
            })
            .collect();
        assert_eq!(counts, [(2, 2), (4, 4), (5, 5)], "{text}");
        for pair in sent.windows(2) {
            let (a, b) = (
                pair[0]["text"].as_str().unwrap(),
                pair[1]["text"].as_str().unwrap(),
            );
            assert!(b.starts_with(a) && b.len() > a.len(), "{text}");
        }
        let (last, rest) = sent.split_last().unwrap();
        assert!(rest
            .iter()
            .all(|c| c["meta_info"]["finish_reason"].is_null()));
        assert!(rest
            .iter()
            .all(|c| c["meta_info"].get("e2e_latency").is_none()));
        assert_eq!(
            last["meta_info"]["finish_reason"],
            json!({"type": "length", "length": 5})
        );
        assert!(last["meta_info"]["e2e_latency"].is_f64());
        assert!(sent[0]["meta_info"]["response_sent_to_client_ts"].is_f64());
        assert!(sent.iter().all(|c| c.get("index").is_none()));

        let body = json!({"text": ["a b c", "d e f"], "stream": true,
                          "sampling_params": {"max_new_tokens": 2}});
        let (_, text) = read(post(&pod, Kind::Generate, &none(), body).await).await;
        let mut indices: Vec<u64> = chunks(&text)
            .iter()
            .map(|c| c["index"].as_u64().unwrap())
            .collect();
        indices.sort_unstable();
        assert_eq!(indices, [0, 1], "{text}");
    }

    /// A prompt sent again hits the prefix cache: SGLang's `cached_tokens` and vLLM's
    /// `prompt_tokens_details` report the hit (whole blocks, the last token recomputed).
    #[tokio::test]
    async fn native_answers_report_prefix_cache_hits() {
        let pod = running_pod(&["--time-scale", "1000"]);
        let ids: Vec<u32> = (1..=100).collect();
        let body = json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 2}});
        let first = answer(&pod, Kind::Generate, &none(), body.clone()).await;
        assert_eq!(first["meta_info"]["cached_tokens"], 0);
        let again = answer(&pod, Kind::Generate, &none(), body).await;
        assert_eq!(again["meta_info"]["cached_tokens"], 96, "{again}");

        let ids: Vec<u32> = (200..300).collect();
        let body = json!({"token_ids": ids, "sampling_params": {"max_tokens": 2}});
        let first = answer(&pod, Kind::Tokens, &none(), body.clone()).await;
        assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        let again = answer(&pod, Kind::Tokens, &none(), body).await;
        assert_eq!(
            again["usage"]["prompt_tokens_details"]["cached_tokens"], 96,
            "{again}"
        );
    }

    /// vLLM's main keys a prompt's cached blocks by the `X-Cache-Salt` header over the body's
    /// `cache_salt`: another header's salt misses, the same one hits whatever the body says, a
    /// body's salt of the same text is the same namespace, and an invalid header is refused.
    #[tokio::test]
    async fn the_cache_salt_header_keys_the_prefix_cache_over_the_body() {
        let pod = running_pod(&["--time-scale", "1000"]);
        let cached = |salt: Option<&str>, body_salt: Option<&str>| {
            let mut h = HeaderMap::new();
            if let Some(s) = salt {
                h.insert(CACHE_SALT_HEADER, s.parse().unwrap());
            }
            let ids: Vec<u32> = (1..=100).collect();
            let mut body = json!({"token_ids": ids, "sampling_params": {"max_tokens": 2}});
            if let Some(s) = body_salt {
                body["cache_salt"] = json!(s);
            }
            let pod = pod.clone();
            async move {
                let v = answer(&pod, Kind::Tokens, &h, body).await;
                v["usage"]["prompt_tokens_details"]["cached_tokens"].clone()
            }
        };
        assert_eq!(cached(Some("tenant-a"), None).await, 0);
        assert_eq!(cached(Some("tenant-b"), Some("tenant-a")).await, 0);
        assert_eq!(cached(Some("tenant-a"), Some("tenant-b")).await, 96);
        assert_eq!(cached(None, Some("tenant-a")).await, 96);
        assert_eq!(cached(None, None).await, 0);
        for bad in ["", "with/slash", "with@at", &"x".repeat(129)] {
            let mut h = HeaderMap::new();
            h.insert(CACHE_SALT_HEADER, bad.parse().unwrap());
            let body = json!({"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}});
            let (status, text) = read(post(&pod, Kind::Tokens, &h, body).await).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {text}");
            assert!(text.contains("cache_salt"), "{text}");
        }
    }

    /// A chat's prompt is keyed by its `X-Cache-Salt` header as vLLM's main keys it: another
    /// header's salt misses, the same one hits, the header wins over the body's `cache_salt`,
    /// the body's salt stands without a header (the same text, the same namespace), and an
    /// invalid header is refused as `validate_cache_salt` refuses it, before the engine.
    #[tokio::test]
    async fn chat_prefix_cache_is_keyed_by_the_cache_salt_header() {
        let pod = running_pod(&["--time-scale", "1000"]);
        let content = "the quick brown fox jumps over the lazy dog ".repeat(20);
        let chat = |header: Option<&str>, body_salt: Option<&str>| {
            let mut h = runs_to(2);
            if let Some(s) = header {
                h.insert(CACHE_SALT_HEADER, s.parse().unwrap());
            }
            let mut body = json!({"messages": [{"role": "user", "content": content}],
                                  "max_tokens": 2});
            if let Some(s) = body_salt {
                body["cache_salt"] = json!(s);
            }
            let pod = pod.clone();
            async move {
                let v = answer(&pod, Kind::Chat, &h, body).await;
                v["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap()
            }
        };
        assert_eq!(chat(Some("b"), None).await, 0);
        assert_eq!(
            chat(Some("a"), None).await,
            0,
            "another header's salt misses"
        );
        let hit = chat(Some("a"), None).await;
        assert!(hit > 0, "the same header's salt hits");
        assert_eq!(chat(Some("a"), Some("c")).await, hit, "the header wins");
        assert_eq!(
            chat(None, Some("c")).await,
            0,
            "the body's own salt was never used"
        );
        assert_eq!(
            chat(None, Some("b")).await,
            hit,
            "the body's salt is the header's"
        );
        // Starlette reads a header as Latin-1: a byte past ASCII is one character of the salt.
        let mut latin = HeaderMap::new();
        latin.insert(
            CACHE_SALT_HEADER,
            HeaderValue::from_bytes(b"caf\xe9").unwrap(),
        );
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        answer(&pod, Kind::Chat, &latin, body).await;

        let long = "x".repeat(129);
        let bad = [
            (
                "",
                "Parameter 'cache_salt' must be a non-empty string if provided.",
            ),
            ("with/slash", TOO_LONG_OR_FORBIDDEN),
            ("with@at", TOO_LONG_OR_FORBIDDEN),
            ("with\\backslash", TOO_LONG_OR_FORBIDDEN),
            (long.as_str(), TOO_LONG_OR_FORBIDDEN),
        ];
        let admitted = pod.lock().engine.counters.admitted_requests;
        for (salt, message) in bad {
            let mut h = HeaderMap::new();
            h.insert(CACHE_SALT_HEADER, salt.parse().unwrap());
            let body = json!({"messages": [{"role": "user", "content": "hi"}],
                              "cache_salt": "fine"});
            let (status, text) = read(post(&pod, Kind::Chat, &h, body).await).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{salt}: {text}");
            let v: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(
                v,
                json!({"error": {"message": format!("{message} (parameter=cache_salt)"),
                                 "type": "BadRequestError", "param": "cache_salt",
                                 "code": 400}}),
                "{salt}"
            );
        }
        assert_eq!(pod.lock().engine.counters.admitted_requests, admitted);
        // 128 characters are taken; SGLang's `/generate` reads no such header.
        let mut h = runs_to(2);
        h.insert(CACHE_SALT_HEADER, "x".repeat(128).parse().unwrap());
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        answer(&pod, Kind::Chat, &h, body).await;
        h.insert(CACHE_SALT_HEADER, "with@at".parse().unwrap());
        let body = json!({"text": "hi", "sampling_params": {"max_new_tokens": 2}});
        answer(&pod, Kind::Generate, &h, body).await;
    }

    /// A body's `cache_salt` is checked as the header's is, on every vLLM path, and a Messages
    /// request's keys its prompt as its chat request's does (vllm-project/vllm#49498): the same
    /// salt hits, another misses.
    #[tokio::test]
    async fn a_body_salt_is_checked_and_keys_a_messages_prompt() {
        let pod = running_pod(&["--time-scale", "1000", "--served-model-name", "m"]);
        let none = HeaderMap::new();
        for (kind, body) in [
            (
                Kind::Chat,
                json!({"messages": [{"role": "user", "content": "hi"}]}),
            ),
            (Kind::Completion, json!({"prompt": "hi"})),
            (
                Kind::Messages,
                json!({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
            ),
        ] {
            for salt in [
                json!(""),
                json!(7),
                json!("with/slash"),
                json!("x".repeat(129)),
            ] {
                let mut body = body.clone();
                body["cache_salt"] = salt.clone();
                let (status, text) = read(post(&pod, kind, &none, body).await).await;
                assert_eq!(status, StatusCode::BAD_REQUEST, "{salt}: {text}");
                assert!(text.contains("cache_salt"), "{text}");
            }
            let mut body = body.clone();
            body["cache_salt"] = Value::Null;
            answer(&pod, kind, &runs_to(2), body).await;
        }
        let content = "the quick brown fox jumps over the lazy dog ".repeat(20);
        let hits = |salt: Option<&str>| {
            let mut body = json!({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": content}]});
            if let Some(s) = salt {
                body["cache_salt"] = json!(s);
            }
            let pod = pod.clone();
            async move {
                let before = pod.lock().engine.counters.admitted_hit_tokens;
                answer(&pod, Kind::Messages, &runs_to(2), body).await;
                pod.lock().engine.counters.admitted_hit_tokens - before
            }
        };
        assert_eq!(hits(Some("a")).await, 0);
        assert!(hits(Some("a")).await > 0, "the same salt hits");
        assert_eq!(hits(Some("b")).await, 0, "another salt misses");
        assert_eq!(hits(None).await, 0, "no salt is a namespace of its own");
    }

    /// vLLM's message for a salt too long or with a character it refuses.
    const TOO_LONG_OR_FORBIDDEN: &str = "Parameter 'cache_salt' must be at most 128 characters \
                                         and must not contain '@', '/', '\\\\', or NUL.";

    /// SGLang's `/generate` keys a prompt's blocks by its namespace: `extra_key`, `cache_salt`
    /// and adapter. Another `extra_key` misses, the same one hits, an `extra_key` is not a salt
    /// of the same text, `""` is none, a batch's list names one a prompt, and a list for one
    /// prompt is refused with SGLang's message.
    #[tokio::test]
    async fn sglang_extra_key_keys_the_radix_cache() {
        let pod = sql_pod();
        let ids: Vec<u32> = (1..=100).collect();
        let one = |fields: Value| {
            let mut body = json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 2}});
            for (k, v) in fields.as_object().unwrap() {
                body[k] = v.clone();
            }
            let pod = pod.clone();
            async move {
                let v = answer(&pod, Kind::Generate, &none(), body).await;
                v["meta_info"]["cached_tokens"].as_u64().unwrap()
            }
        };
        assert_eq!(one(json!({"extra_key": "k1"})).await, 0);
        assert_eq!(
            one(json!({"extra_key": "k2"})).await,
            0,
            "another extra_key misses"
        );
        assert_eq!(
            one(json!({"extra_key": "k1"})).await,
            96,
            "the same extra_key hits"
        );
        assert_eq!(
            one(json!({"cache_salt": "k1"})).await,
            0,
            "a salt is not a key"
        );
        assert_eq!(one(json!({"cache_salt": "k1", "extra_key": "k1"})).await, 0);
        assert_eq!(
            one(json!({"cache_salt": "k1", "extra_key": "k1"})).await,
            96,
            "salt and key both equal"
        );
        assert_eq!(one(json!({"extra_key": "k1", "lora_path": "sql"})).await, 0);
        assert_eq!(
            one(json!({"extra_key": "k1", "lora_path": "sql"})).await,
            96
        );
        assert_eq!(one(json!({})).await, 0);
        assert_eq!(
            one(json!({"extra_key": ""})).await,
            96,
            "an empty key is none"
        );

        // A batch's list: one key a prompt (the same ids, under k1 cached and k3 not).
        let body = json!({"input_ids": [ids, ids], "extra_key": ["k1", "k3"],
                          "sampling_params": {"max_new_tokens": 2}});
        let v = answer(&pod, Kind::Generate, &none(), body).await;
        let cached: Vec<u64> = v
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["meta_info"]["cached_tokens"].as_u64().unwrap())
            .collect();
        assert_eq!(cached, [96, 0]);
        assert_eq!(one(json!({"extra_key": "k3"})).await, 96);

        let admitted = pod.lock().engine.counters.admitted_requests;
        let refusals = [
            (
                json!({"text": "a", "extra_key": ["k1"]}),
                json!({"error": {"message": "extra_key should be a string for a single request."}}),
            ),
            (
                json!({"text": ["a", "b"], "extra_key": ["k1"]}),
                json!({"error": {"message": "The length of extra_key should be equal to the batch size."}}),
            ),
        ];
        for (body, want) in refusals {
            let (status, text) = read(post(&pod, Kind::Generate, &none(), body).await).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
            assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), want);
        }
        invalid_generate(&pod, json!({"text": ["a", "b"], "extra_key": ["k1", null]})).await;
        assert_eq!(pod.lock().engine.counters.admitted_requests, admitted);
    }

    /// `sql_pod`, its model served as `m`.
    fn m_sql_pod() -> Arc<Pod> {
        running_pod(&[
            "--time-scale",
            "1000",
            "--served-model-name",
            "m",
            "--enable-lora",
            "--lora-modules",
            "sql=/a",
        ])
    }

    /// A running pod, quick, that serves the adapter `sql`.
    fn sql_pod() -> Arc<Pod> {
        running_pod(&[
            "--time-scale",
            "1000",
            "--enable-lora",
            "--lora-modules",
            "sql=/a",
        ])
    }

    /// A `/generate` body FastAPI's validation refuses: a 400 in SGLang's `ErrorResponse`.
    async fn invalid_generate(pod: &Arc<Pod>, body: Value) {
        let (status, text) = read(post(pod, Kind::Generate, &none(), body).await).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            (&v["object"], &v["code"]),
            (&json!("error"), &json!(400)),
            "{v}"
        );
    }

    /// SGLang's refusals: its handler's `ValueError`s as `{"error": {"message"}}` 400s (in a
    /// stream, once it has answered 200, as an event before `[DONE]`), FastAPI's validation as
    /// its `ErrorResponse`; a `lora_path` as SGLang resolves it. Nothing reaches the engine.
    #[tokio::test]
    async fn sglang_errors_are_sglangs() {
        let pod = pod_with(&["--max-model-len", "64"]);
        let long = "cache ".repeat(80);
        let cases = [
            (
                json!({"sampling_params": {}}),
                "Either text, input_ids or input_embeds should be provided.".to_string(),
            ),
            (
                json!({"text": long.clone()}),
                format!(
                    "The input ({} tokens) is longer than the model's context length (64 \
                     tokens).",
                    pod.g.tok.encode(&long).len()
                ),
            ),
            (
                json!({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 62}}),
                "Requested token count exceeds the model's maximum context length of 64 \
                 tokens. You requested a total of 65 tokens: 3 tokens from the input messages \
                 and 62 tokens for the completion. Please reduce the number of tokens in the \
                 input messages or the completion to fit within the limit."
                    .to_string(),
            ),
            (
                json!({"text": "a", "lora_path": "sql"}),
                sglang::lora_disabled("sql"),
            ),
        ];
        for (body, message) in cases {
            let (status, text) =
                read(post(&pod, Kind::Generate, &none(), body.clone()).await).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
            let v: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v, json!({"error": {"message": message}}));
            let mut streamed = body;
            streamed["stream"] = json!(true);
            let (status, text) = read(post(&pod, Kind::Generate, &none(), streamed).await).await;
            assert_eq!(status, StatusCode::OK);
            assert_eq!(chunks(&text), [json!({"error": {"message": message}})]);
        }
        for body in [json!({"text": 5}), json!({"text": 5, "stream": true})] {
            invalid_generate(&pod, body).await;
        }
        assert_eq!(pod.lock().engine.num_waiting(), 0);

        let pod = sql_pod();
        let (status, text) = read(
            post(
                &pod,
                Kind::Generate,
                &none(),
                json!({"text": "a", "lora_path": "nope"}),
            )
            .await,
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            v["error"]["message"],
            sglang::lora_unknown("nope", &["sql".into()])
        );
        // A prompt cached under the adapter is a miss for the base model, a hit for the adapter.
        let ids: Vec<u32> = (1..=100).collect();
        let mut cached = Vec::new();
        for lora in [json!("sql"), Value::Null, json!("sql")] {
            let body = json!({"input_ids": [ids], "lora_path": [lora],
                              "sampling_params": {"max_new_tokens": 2}});
            let v = answer(&pod, Kind::Generate, &none(), body).await;
            cached.push(v[0]["meta_info"]["cached_tokens"].as_u64().unwrap());
        }
        assert_eq!(cached, [0, 0, 96]);
    }

    /// vLLM's `/inference/v1/generate`: token ids in, each choice's token ids out (a stop's last
    /// the EOS), usage with the prompt once; the id `generate-tokens-` and the `X-Request-Id`
    /// header's, else the body's `request_id`; a loaded adapter named as the model.
    #[tokio::test]
    async fn vllm_tokens_generate_answers_as_vllm_does() {
        let pod = m_sql_pod();
        let eos = pod.g.tok.eos;
        let body = json!({"token_ids": [1, 2, 3, 4, 5, 6, 7], "request_id": "abc",
                          "sampling_params": {"max_tokens": 5, "n": 2}});
        let v = answer(&pod, Kind::Tokens, &none(), body.clone()).await;
        assert_eq!(v["request_id"], "generate-tokens-abc");
        assert_eq!(v["model"], "m");
        assert!(v["created"].is_u64());
        assert_eq!(
            (&v["prompt_logprobs"], &v["kv_transfer_params"]),
            (&Value::Null, &Value::Null)
        );
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": 7, "completion_tokens": 10, "total_tokens": 17,
                   "prompt_tokens_details": {"cached_tokens": v["usage"]["prompt_tokens_details"]["cached_tokens"]}})
        );
        let choices = v["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 2);
        for (i, c) in choices.iter().enumerate() {
            assert_eq!(
                (&c["index"], &c["logprobs"], &c["finish_reason"]),
                (&json!(i), &Value::Null, &json!("length"))
            );
            assert_eq!(c["token_ids"].as_array().unwrap().len(), 5);
        }
        let mut header = runs_to(3);
        header.insert("x-request-id", "h1".parse().unwrap());
        let mut adapter = body;
        adapter["model"] = json!("sql");
        adapter["sampling_params"] = json!({"max_tokens": 5});
        let v = answer(&pod, Kind::Tokens, &header, adapter).await;
        assert_eq!(
            (&v["request_id"], &v["model"]),
            (&json!("generate-tokens-h1"), &json!("sql"))
        );
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["choices"][0]["token_ids"][2], eos);
        assert_eq!(v["usage"]["completion_tokens"], 3);
    }

    /// Without `max_tokens` vLLM's tokens endpoint fills in the context's room (not
    /// `SamplingParams`' 16), as a null one is: the drawn length runs out.
    #[tokio::test]
    async fn vllm_tokens_limits_default_to_the_context() {
        let pod = running_pod(&[
            "--time-scale",
            "1000",
            "--output-len-dist",
            "fixed",
            "--output-len-mean",
            "40",
        ]);
        for sp in [json!({}), json!({"max_tokens": null})] {
            let body = json!({"token_ids": [1, 2, 3], "sampling_params": sp});
            let v = answer(&pod, Kind::Tokens, &none(), body).await;
            assert_eq!(v["usage"]["completion_tokens"], 40, "{v}");
            assert_eq!(v["choices"][0]["finish_reason"], "stop");
        }
        let body = json!({"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 16}});
        let v = answer(&pod, Kind::Tokens, &none(), body).await;
        assert_eq!(v["choices"][0]["finish_reason"], "length");
    }

    /// Streamed: each chunk one choice's new token ids (`--stream-interval` of them) and a null
    /// usage, or its usage so far with `continuous_usage_stats`; the usage chunk after the last
    /// choice's end; then `[DONE]`.
    #[tokio::test]
    async fn vllm_tokens_streams_token_deltas() {
        let pod = running_pod(&["--time-scale", "1000", "--stream-interval", "2"]);
        let body = json!({"token_ids": [1, 2, 3], "stream": true, "request_id": "s",
                          "stream_options": {"include_usage": true},
                          "sampling_params": {"max_tokens": 5}});
        let (_, text) = read(post(&pod, Kind::Tokens, &none(), body).await).await;
        let sent = chunks(&text);
        let (usage, data) = sent.split_last().unwrap();
        assert_eq!(
            *usage,
            json!({"request_id": "generate-tokens-s", "choices": [],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}})
        );
        let sizes: Vec<usize> = data
            .iter()
            .map(|c| c["choices"][0]["token_ids"].as_array().unwrap().len())
            .collect();
        assert_eq!(sizes, [2, 2, 1], "{text}");
        assert!(data.iter().all(|c| c["usage"].is_null()));
        assert_eq!(data[2]["choices"][0]["finish_reason"], "length");
        assert!(data[0]["choices"][0]["finish_reason"].is_null());

        let body = json!({"token_ids": [1, 2, 3], "stream": true,
                          "stream_options": {"include_usage": true, "continuous_usage_stats": true},
                          "sampling_params": {"max_tokens": 4}});
        let (_, text) = read(post(&pod, Kind::Tokens, &none(), body).await).await;
        let counts: Vec<u64> = chunks(&text)
            .iter()
            .filter(|c| !c["choices"].as_array().unwrap().is_empty())
            .map(|c| c["usage"]["completion_tokens"].as_u64().unwrap())
            .collect();
        assert_eq!(counts, [2, 4]);
    }

    /// vLLM's refusals in its OpenAI error shape: a body its model refuses, an unknown model,
    /// a limit of 0, more choices than it runs at once.
    #[tokio::test]
    async fn vllm_tokens_errors_are_vllms() {
        let pod = pod_with(&["--served-model-name", "m", "--max-num-seqs", "4"]);
        let cases = [
            (
                json!({"token_ids": [1]}),
                StatusCode::BAD_REQUEST,
                "BadRequestError",
                "sampling_params: Field required",
            ),
            (
                json!({"token_ids": [1], "sampling_params": {}, "model": "nope"}),
                StatusCode::NOT_FOUND,
                "NotFoundError",
                "The model `nope` does not exist.",
            ),
            (
                json!({"token_ids": [1], "sampling_params": {"max_tokens": 0}}),
                StatusCode::BAD_REQUEST,
                "BadRequestError",
                "max_tokens must be at least 1, got 0.",
            ),
            (
                json!({"token_ids": [1], "sampling_params": {"n": 5}}),
                StatusCode::BAD_REQUEST,
                "BadRequestError",
                "sampling_params.n must be at most the server's max_num_seqs (4), got 5.",
            ),
        ];
        for (body, status, kind, message) in cases {
            let (got, text) = read(post(&pod, Kind::Tokens, &none(), body).await).await;
            assert_eq!(got, status, "{text}");
            let v: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(
                v,
                json!({"error": {"message": message, "type": kind, "param": null,
                                 "code": status.as_u16()}})
            );
        }
        assert_eq!(pod.lock().engine.num_waiting(), 0);
    }

    // ------------------------------------------------------------ /v1/embeddings

    /// A pooling endpoint's answer: its raw text and parsed JSON (a 200).
    async fn pool_answer(
        pod: &Arc<Pod>,
        endpoint: Endpoint,
        headers: &HeaderMap,
        body: Value,
    ) -> (String, Value) {
        let (status, text) = read(post(pod, Kind::Pool(endpoint), headers, body).await).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        let v = serde_json::from_str(&text).unwrap();
        (text, v)
    }

    /// An embeddings answer's raw text and parsed JSON (a 200).
    async fn embed_answer(pod: &Arc<Pod>, headers: &HeaderMap, body: Value) -> (String, Value) {
        pool_answer(pod, Endpoint::Embeddings, headers, body).await
    }

    /// An answer's vectors, as the float32s they are (serde_json's parser may miss a double by
    /// a unit in the last place, never a float32).
    fn vectors(v: &Value) -> Vec<Vec<f32>> {
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| {
                d["embedding"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap() as f32)
                    .collect()
            })
            .collect()
    }

    fn l2(v: &[f32]) -> f64 {
        v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt()
    }

    /// The value of a sample of `/metrics` whose line starts `name{` and has `label` in it.
    async fn metric(pod: &Arc<Pod>, name: &str, label: &str) -> f64 {
        let (_, text) = read(metrics_endpoint(pod.clone()).await).await;
        text.lines()
            .find(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} {label} in {text}"))
    }

    /// One string: vLLM's `EmbeddingResponse`, its keys in vLLM's order, the model as named
    /// (an adapter's name too), a unit vector of `--embedding-size` floats that is the prompt's
    /// alone, usage counting the prompt's tokens and nothing else; the id is `embd-` and the
    /// `X-Request-Id` header's value, else a fresh hex one.
    #[tokio::test]
    async fn embeddings_answer_as_vllm_does() {
        let pod = m_sql_pod();
        let text = "The quick brown fox jumps over the lazy dog";
        let n = pod.g.tok.encode(text).len();
        let body = json!({"model": "m", "input": text});
        let (raw, v) = embed_answer(&pod, &none(), body.clone()).await;
        assert!(raw.starts_with(r#"{"id":"embd-"#), "{}", &raw[..80]);
        let keys = [
            "\"object\":\"list\",\"created\":",
            "\"model\":\"m\",\"data\":[{\"index\":0,\"object\":\"embedding\",\"embedding\":[",
            "\"usage\":{\"prompt_tokens\":",
        ];
        let at: Vec<usize> = keys.iter().map(|k| raw.find(k).unwrap()).collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{at:?}");
        let id = v["id"].as_str().unwrap();
        assert!(
            id.len() == 5 + 32 && id[5..].bytes().all(|b| b.is_ascii_hexdigit()),
            "{id}"
        );
        assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
                   "prompt_tokens_details": null})
        );
        let vs = vectors(&v);
        assert_eq!((vs.len(), vs[0].len()), (1, 4096));
        assert!((l2(&vs[0]) - 1.0).abs() < 1e-6);
        // Each float is a float32's value, written as the double it widens to (as Python
        // prints a float32 tensor's `tolist()`).
        let start = raw.find("\"embedding\":[").unwrap() + "\"embedding\":[".len();
        let end = start + raw[start..].find(']').unwrap();
        let written: Vec<f64> = raw[start..end]
            .split(',')
            .map(|x| x.parse().unwrap())
            .collect();
        assert_eq!(written.len(), 4096);
        assert!(written.iter().all(|&x| f64::from(x as f32) == x));

        let mut h = HeaderMap::new();
        h.insert("x-request-id", "r-1".parse().unwrap());
        let mut adapter = body;
        adapter["model"] = json!("sql");
        let (_, again) = embed_answer(&pod, &h, adapter).await;
        assert_eq!(
            (&again["id"], &again["model"]),
            (&json!("embd-r-1"), &json!("sql"))
        );
        assert_eq!(vectors(&again), vs, "the same prompt, the same vector");
        let (_, other) = embed_answer(&pod, &none(), json!({"input": "Another text"})).await;
        assert_eq!(other["model"], "m", "no model: the served one");
        assert_ne!(vectors(&other), vs);
    }

    /// A batch of three prompts, the first and last alike.
    const BATCH: [&str; 3] = [
        "Hello there",
        "How are caches shared between pods?",
        "Hello there",
    ];

    /// A batch: each prompt an engine request of its own, answered in order with its own
    /// `index` and the vector it has alone; the usage sums the prompts. A list of ids is one
    /// prompt, a list of lists of ids a batch; a string and its ids embed alike.
    #[tokio::test]
    async fn embeddings_batches_answer_each_prompt() {
        let pod = running_pod(&["--time-scale", "1000", "--embedding-size", "32"]);
        let texts = BATCH;
        let counts: Vec<usize> = texts.iter().map(|t| pod.g.tok.encode(t).len()).collect();
        let admitted = pod.lock().engine.counters.admitted_requests;
        let (_, v) = embed_answer(&pod, &none(), json!({"input": texts})).await;
        assert_eq!(pod.lock().engine.counters.admitted_requests, admitted + 3);
        let data = v["data"].as_array().unwrap();
        let indices: Vec<&Value> = data.iter().map(|d| &d["index"]).collect();
        assert_eq!(indices, [&json!(0), &json!(1), &json!(2)]);
        assert!(data.iter().all(|d| d["object"] == "embedding"));
        let sum: usize = counts.iter().sum();
        assert_eq!(
            (&v["usage"]["prompt_tokens"], &v["usage"]["total_tokens"]),
            (&json!(sum), &json!(sum))
        );
        let vs = vectors(&v);
        assert_eq!(vs[0], vs[2]);
        assert_ne!(vs[0], vs[1]);
        for (i, t) in texts.iter().enumerate() {
            let (_, one) = embed_answer(&pod, &none(), json!({"input": t})).await;
            assert_eq!(vectors(&one)[0], vs[i]);
            let ids = pod.g.tok.encode(t);
            let (_, by_ids) = embed_answer(&pod, &none(), json!({"input": ids})).await;
            assert_eq!(vectors(&by_ids), [vs[i].clone()]);
        }
        let ids: Vec<Vec<u32>> = texts[..2].iter().map(|t| pod.g.tok.encode(t)).collect();
        let (_, v) = embed_answer(&pod, &none(), json!({"input": ids})).await;
        assert_eq!(vectors(&v), vs[..2]);
        assert_eq!(v["usage"]["prompt_tokens"], counts[0] + counts[1]);
    }

    /// The chat form: `messages` rendered by the chat template with no generation prompt
    /// unless asked for (the prompt a chat completion of the same messages counts, less its
    /// assistant opener), `continue_final_message` leaving the last message open; its vector is
    /// its rendered ids'.
    #[tokio::test]
    async fn embeddings_chat_form_renders_without_a_generation_prompt() {
        let pod = running_pod(&["--time-scale", "1000", "--embedding-size", "16"]);
        let messages = json!([{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "What is a KV cache?"}]);
        let rendered = |add_gen| {
            let segs = render_chat(messages.as_array().unwrap(), None, add_gen, 0).unwrap();
            pod.g.tok.encode_segments(&segs)
        };
        let (plain, with_gen) = (rendered(false), rendered(true));
        let (_, v) = embed_answer(&pod, &none(), json!({"messages": messages})).await;
        assert_eq!(v["usage"]["prompt_tokens"], plain.len());
        let (_, by_ids) = embed_answer(&pod, &none(), json!({"input": plain})).await;
        assert_eq!(vectors(&v), vectors(&by_ids));
        let chat = json!({"messages": messages, "max_tokens": 1});
        assert_eq!(
            prompt_tokens(&pod, Kind::Chat, &chat).await,
            with_gen.len() as u64
        );
        let body = json!({"messages": messages, "add_generation_prompt": true});
        let (_, v) = embed_answer(&pod, &none(), body).await;
        assert_eq!(v["usage"]["prompt_tokens"], with_gen.len());
        let body = json!({"messages": messages, "continue_final_message": true,
                          "chat_template_kwargs": {"enable_thinking": false}});
        let (_, v) = embed_answer(&pod, &none(), body).await;
        let text: String = render_chat(messages.as_array().unwrap(), None, false, 0)
            .unwrap()
            .iter()
            .map(|s| match s {
                Segment::Text(t) => t.clone(),
                Segment::Media { .. } => unreachable!(),
            })
            .collect();
        let open = pod.g.tok.encode(text.strip_suffix(MESSAGE_END).unwrap());
        assert!(open.len() < plain.len());
        assert_eq!(v["usage"]["prompt_tokens"], open.len());
        let (_, by_ids) = embed_answer(&pod, &none(), json!({"input": open})).await;
        assert_eq!(vectors(&v), vectors(&by_ids));
    }

    /// `encoding_format: "base64"`: each vector's float32 bytes (little-endian, vLLM's native
    /// on its hosts; big with `endianness: "big"`) in base64, the same floats as "float" gives.
    #[tokio::test]
    async fn embeddings_base64_decodes_to_the_same_floats() {
        let pod = running_pod(&["--time-scale", "1000"]);
        let body = json!({"input": ["one prompt", "and another"]});
        let (_, floats) = embed_answer(&pod, &none(), body.clone()).await;
        for (endianness, big) in [("little", false), ("big", true), ("native", false)] {
            let mut b64 = body.clone();
            b64["encoding_format"] = json!("base64");
            b64["endianness"] = json!(endianness);
            let (_, v) = embed_answer(&pod, &none(), b64).await;
            assert_eq!(v["usage"], floats["usage"]);
            for (i, want) in vectors(&floats).iter().enumerate() {
                let text = v["data"][i]["embedding"].as_str().unwrap();
                let bytes = crate::embeddings::tests::unbase64(text);
                assert_eq!(bytes.len(), 4 * 4096);
                let got: Vec<f32> = bytes
                    .chunks(4)
                    .map(|c| {
                        let c = <[u8; 4]>::try_from(c).unwrap();
                        if big {
                            f32::from_be_bytes(c)
                        } else {
                            f32::from_le_bytes(c)
                        }
                    })
                    .collect();
                assert_eq!(&got, want, "{endianness}");
            }
        }
    }

    /// `dimensions`: the vector's first components, normalized again (a Matryoshka model's
    /// truncation); below 1 or above the model's size a 400 before the engine sees anything.
    #[tokio::test]
    async fn embeddings_dimensions_truncate_and_are_checked() {
        let pod = running_pod(&["--time-scale", "1000", "--embedding-size", "64"]);
        let (_, full) = embed_answer(&pod, &none(), json!({"input": "a prompt"})).await;
        let full = vectors(&full).remove(0);
        let body = json!({"input": "a prompt", "dimensions": 8});
        let (_, v) = embed_answer(&pod, &none(), body).await;
        let cut = vectors(&v).remove(0);
        assert_eq!(cut.len(), 8);
        assert!((l2(&cut) - 1.0).abs() < 1e-6);
        let scale = l2(&full[..8]);
        for (&x, &y) in cut.iter().zip(&full[..8]) {
            assert!(
                (f64::from(x) * scale - f64::from(y)).abs() < 1e-6,
                "{x} {y}"
            );
        }
        let (_, all) = embed_answer(
            &pod,
            &none(),
            json!({"input": "a prompt", "dimensions": 64}),
        )
        .await;
        assert_eq!(vectors(&all)[0].len(), 64);
        let admitted = pod.lock().engine.counters.admitted_requests;
        for (d, message) in [
            (json!(0), "Dimensions must be greater than 0".to_string()),
            (json!(-4), "Dimensions must be greater than 0".to_string()),
            (
                json!(65),
                "kvgate-sim: dimensions (65) is greater than the model's embedding size (64)."
                    .to_string(),
            ),
        ] {
            let body = json!({"input": "a prompt", "dimensions": d});
            let (status, text) =
                read(post(&pod, Kind::Pool(Endpoint::Embeddings), &none(), body).await).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
            let v: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v["error"]["message"], message);
        }
        assert_eq!(pod.lock().engine.counters.admitted_requests, admitted);
    }

    /// `truncate_prompt_tokens`: each prompt's last k tokens are what runs, counts and embeds;
    /// -1 is the model's length; more than that is vLLM's 400. A prompt longer than the model's
    /// length without it is refused; one of the whole length runs (no room for output needed).
    #[tokio::test]
    async fn embeddings_truncate_prompt_tokens_keeps_the_last_tokens() {
        let pod = running_pod(&[
            "--time-scale",
            "1000",
            "--max-model-len",
            "64",
            "--embedding-size",
            "8",
        ]);
        let ids: Vec<u32> = (1..=100).collect();
        let body = json!({"input": [ids, [5, 6, 7]], "truncate_prompt_tokens": 10});
        let (_, v) = embed_answer(&pod, &none(), body).await;
        assert_eq!(v["usage"]["prompt_tokens"], 13);
        let (_, last) = embed_answer(&pod, &none(), json!({"input": ids[90..]})).await;
        assert_eq!(vectors(&v)[0], vectors(&last)[0]);
        let body = json!({"input": ids, "truncate_prompt_tokens": 3, "truncation_side": "right"});
        let (_, first) = embed_answer(&pod, &none(), body).await;
        let (_, by_ids) = embed_answer(&pod, &none(), json!({"input": [1, 2, 3]})).await;
        assert_eq!(vectors(&first), vectors(&by_ids));
        let body = json!({"input": ids, "truncate_prompt_tokens": -1});
        let (_, v) = embed_answer(&pod, &none(), body).await;
        assert_eq!(v["usage"]["prompt_tokens"], 64);
        let (_, v) = embed_answer(&pod, &none(), json!({"input": ids[..64]})).await;
        assert_eq!(v["usage"]["prompt_tokens"], 64, "the whole context");

        let cases = [
            (
                json!({"input": ids, "truncate_prompt_tokens": 65}),
                "truncate_prompt_tokens value is greater than max_model_len. Please, select a \
                 smaller truncation size.",
                Value::Null,
            ),
            (
                json!({"input": ids[..65]}),
                "You passed 65 input tokens and requested 0 output tokens. However, the \
                 model's context length is only 64 tokens, resulting in a maximum input length \
                 of 64 tokens. Please reduce the length of the input prompt. \
                 (parameter=input_tokens, value=65)",
                json!("input_tokens"),
            ),
            (
                json!({"input": ids, "truncate_prompt_tokens": -2}),
                "truncate_prompt_tokens: Input should be greater than or equal to -1",
                Value::Null,
            ),
            (
                json!({"input": ids, "truncate_prompt_tokens": 0}),
                "The decoder prompt cannot be empty",
                Value::Null,
            ),
        ];
        for (body, message, param) in cases {
            let (status, text) =
                read(post(&pod, Kind::Pool(Endpoint::Embeddings), &none(), body).await).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
            let v: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(
                v,
                json!({"error": {"message": message, "type": "BadRequestError",
                                 "param": param, "code": 400}})
            );
        }
    }

    /// Refusals in vLLM's OpenAI error shape: neither form, an empty batch, an unknown model
    /// (404), an encoding vLLM does not know, a salt its validator refuses; none reaches the
    /// engine. `stream` is no field of this API: a body with it is answered as any other.
    #[tokio::test]
    async fn embeddings_refusals_are_vllms() {
        let pod = running_pod(&["--time-scale", "1000", "--served-model-name", "m"]);
        let admitted = pod.lock().engine.counters.admitted_requests;
        let cases = [
            (
                json!({"model": "m"}),
                StatusCode::BAD_REQUEST,
                "BadRequestError",
            ),
            (
                json!({"input": null, "messages": null}),
                StatusCode::BAD_REQUEST,
                "BadRequestError",
            ),
            (
                json!({"input": []}),
                StatusCode::BAD_REQUEST,
                "BadRequestError",
            ),
            (
                json!({"messages": []}),
                StatusCode::BAD_REQUEST,
                "BadRequestError",
            ),
            (
                json!({"input": [1.5]}),
                StatusCode::BAD_REQUEST,
                "BadRequestError",
            ),
            (
                json!({"input": "a", "model": "nope"}),
                StatusCode::NOT_FOUND,
                "NotFoundError",
            ),
            (
                json!({"input": "a", "encoding_format": "hex"}),
                StatusCode::BAD_REQUEST,
                "BadRequestError",
            ),
            (
                json!({"input": "a", "cache_salt": ""}),
                StatusCode::BAD_REQUEST,
                "BadRequestError",
            ),
            (
                json!({"messages": [{"role": "user", "content": "a"}],
                       "add_generation_prompt": true, "continue_final_message": true}),
                StatusCode::BAD_REQUEST,
                "BadRequestError",
            ),
        ];
        for (body, status, kind) in cases {
            let (got, text) = read(
                post(
                    &pod,
                    Kind::Pool(Endpoint::Embeddings),
                    &none(),
                    body.clone(),
                )
                .await,
            )
            .await;
            assert_eq!(got, status, "{body}: {text}");
            let v: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(
                (&v["error"]["type"], &v["error"]["code"]),
                (&json!(kind), &json!(status.as_u16())),
                "{v}"
            );
        }
        assert_eq!(pod.lock().engine.counters.admitted_requests, admitted);
        let (_, v) =
            embed_answer(&pod, &none(), json!({"input": "a", "stream": true, "n": 3})).await;
        assert_eq!(v["data"].as_array().unwrap().len(), 1);
    }

    /// What the metrics say after `requests` pooling requests of `prompt_tokens` in all ran as
    /// prefills alone: their prompt tokens, a `stop` and a first token each, no generation
    /// token, and nothing running or holding KV afterwards.
    async fn ran_as_prefills(pod: &Arc<Pod>, prompt_tokens: f64, requests: f64) {
        let labels = "model_name=";
        let count = |name| metric(pod, name, labels);
        assert_eq!(count("vllm:prompt_tokens_total").await, prompt_tokens);
        assert_eq!(count("vllm:generation_tokens_total").await, 0.0);
        let stop = "finished_reason=\"stop\"";
        assert_eq!(
            metric(pod, "vllm:request_success_total", stop).await,
            requests
        );
        assert_eq!(count("vllm:kv_cache_usage_perc").await, 0.0);
        assert_eq!(count("vllm:num_requests_running").await, 0.0);
        let firsts = count("vllm:time_to_first_token_seconds_count").await;
        assert_eq!(firsts, requests);
        let none_made = metric(pod, "vllm:request_generation_tokens_bucket", "le=\"1.0\"").await;
        assert_eq!(none_made, requests, "each answer generated no token");
        assert_eq!(pod.lock().engine.kv.pool.num_used(), 0);
    }

    /// Each prompt runs in the engine as vLLM runs a pooling request: a prefill holding its KV
    /// while it runs, no output token; the metrics count its prompt tokens, a `stop`, no
    /// generation token, and a repeat of it hits the prefix cache; afterwards no block is held.
    #[tokio::test]
    async fn embeddings_run_as_prefills_in_the_engine() {
        let pod = running_pod(&["--time-scale", "1000"]);
        let ids: Vec<u32> = (1..=200).collect();
        let (_, v) = embed_answer(&pod, &none(), json!({"input": [ids, ids[..50]]})).await;
        assert_eq!(v["usage"]["prompt_tokens"], 250);
        ran_as_prefills(&pod, 250.0, 2.0).await;
        let labels = "model_name=";
        let hits = metric(&pod, "vllm:prefix_cache_hits_total", labels).await;
        let (_, _) = embed_answer(&pod, &none(), json!({"input": ids})).await;
        let hits = metric(&pod, "vllm:prefix_cache_hits_total", labels).await - hits;
        assert_eq!(hits, 192.0, "all but the last block cached");
        let inner = pod.lock();
        assert_eq!(inner.engine.kv.pool.num_used(), 0);
        assert!(inner.engine.counters.peak_used_blocks >= 13);
    }

    /// A client that goes away while its prompts are prefilled aborts them all, as for the
    /// other endpoints: their blocks are freed at once.
    #[tokio::test]
    async fn an_embeddings_client_that_goes_away_aborts_its_prefills() {
        let pod = running_pod(&["--embedding-size", "8"]);
        let long: Vec<u32> = (1..=8000).collect();
        let body = json!({"input": [long, long.iter().map(|t| t + 10_000).collect::<Vec<_>>()]});
        let p = pod.clone();
        let handler = tokio::spawn(async move {
            let _ = post(&p, Kind::Pool(Endpoint::Embeddings), &none(), body).await;
        });
        for _ in 0..500 {
            if pod.lock().engine.kv.pool.num_used() > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(
            pod.lock().engine.kv.pool.num_used() > 0,
            "a prefill holds blocks"
        );
        handler.abort();
        assert!(handler.await.unwrap_err().is_cancelled());
        let inner = pod.lock();
        let e = &inner.engine;
        assert_eq!((e.num_running(), e.num_waiting()), (0, 0));
        assert_eq!(e.counters.finished_abort, 2);
        assert_eq!(e.kv.pool.num_used(), 0);
    }

    // ------------------------------------------------------------ /pooling, /classify

    /// The items' outputs of a pooling answer under `key` (`data`, `embedding`, `probs`).
    fn items<'a>(v: &'a Value, key: &str) -> Vec<&'a Value> {
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| &d[key])
            .collect()
    }

    /// A base64 output's float32s (little-endian).
    fn unbase64_f32(v: &Value) -> Vec<f32> {
        crate::embeddings::tests::unbase64(v.as_str().unwrap())
            .chunks(4)
            .map(|c| f32::from_le_bytes(<[u8; 4]>::try_from(c).unwrap()))
            .collect()
    }

    fn floats(v: &Value) -> Vec<f32> {
        let a = v.as_array().unwrap();
        a.iter().map(|x| x.as_f64().unwrap() as f32).collect()
    }

    /// One string: vLLM's `PoolingResponse` and `ClassificationResponse`, their keys in vLLM's
    /// order, ids `pool-` / `classify-` and the `X-Request-Id` header's value (else a fresh hex
    /// one), the model as named, usage counting the prompt alone; `/classify`'s item the
    /// `--num-classes` probabilities of the prompt, its label their argmax.
    #[tokio::test]
    async fn pooling_and_classify_answer_as_vllm_does() {
        let pod = running_pod(&[
            "--time-scale",
            "1000",
            "--served-model-name",
            "m",
            "--embedding-size",
            "16",
            "--num-classes",
            "3",
        ]);
        let text = "The quick brown fox jumps over the lazy dog";
        let n = pod.g.tok.encode(text).len();
        let body = json!({"model": "m", "input": text});
        let usage = json!({"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
                           "prompt_tokens_details": null});
        let in_order = |raw: &str, keys: &[&str]| {
            let at: Vec<usize> = keys.iter().map(|k| raw.find(k).expect(k)).collect();
            assert!(at.windows(2).all(|w| w[0] < w[1]), "{at:?} {raw}");
        };
        let (raw, v) = pool_answer(&pod, Endpoint::Pooling, &none(), body.clone()).await;
        assert!(raw.starts_with(r#"{"id":"pool-"#), "{raw}");
        in_order(
            &raw,
            &[
                "\"object\":\"list\",\"created\":",
                "\"model\":\"m\",\"data\":[{\"index\":0,\"object\":\"pooling\",\"data\":[",
                "\"usage\":{\"prompt_tokens\":",
            ],
        );
        let id = v["id"].as_str().unwrap();
        assert!(id.len() == 5 + 32 && id[5..].bytes().all(|b| b.is_ascii_hexdigit()));
        assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
        assert_eq!(v["usage"], usage);
        let vector = floats(items(&v, "data")[0]);
        assert_eq!(vector.len(), 16);
        assert!((l2(&vector) - 1.0).abs() < 1e-6);

        let mut h = HeaderMap::new();
        h.insert("x-request-id", "r-2".parse().unwrap());
        let (raw, v) = pool_answer(&pod, Endpoint::Classify, &h, body.clone()).await;
        in_order(
            &raw,
            &[
                r#"{"id":"classify-r-2","object":"list","created":"#,
                r#""model":"m","data":[{"index":0,"label":"LABEL_"#,
                r#"","probs":["#,
                r#"],"num_classes":3}],"usage":{"prompt_tokens":"#,
            ],
        );
        assert_eq!(v["usage"], usage);
        let probs = floats(items(&v, "probs")[0]);
        assert_eq!(probs.len(), 3);
        let sum: f64 = probs.iter().map(|&p| f64::from(p)).sum();
        assert!((sum - 1.0).abs() < 1e-6, "{probs:?}");
        let best = (0..3).fold(0, |b, i| if probs[i] > probs[b] { i } else { b });
        assert_eq!(v["data"][0]["label"], format!("LABEL_{best}"));
        let (_, again) = pool_answer(&pod, Endpoint::Classify, &none(), body).await;
        assert_eq!(
            items(&again, "probs"),
            items(&v, "probs"),
            "the same prompt, alike"
        );
        let other = json!({"input": "Another text"});
        let (_, other) = pool_answer(&pod, Endpoint::Classify, &none(), other).await;
        assert_eq!(other["model"], "m", "no model: the served one");
        assert_ne!(items(&other, "probs"), items(&v, "probs"));
    }

    /// Batches (strings, lists of ids), the chat form and `truncate_prompt_tokens`, read as the
    /// embeddings read them: each prompt an engine request, answered in order with its own
    /// `index` and the output it has alone; the usage sums the prompts as they were prefilled.
    #[tokio::test]
    async fn pooling_and_classify_take_the_embeddings_inputs() {
        let pod = running_pod(&["--time-scale", "1000", "--embedding-size", "8"]);
        let texts = BATCH;
        let counts: Vec<usize> = texts.iter().map(|t| pod.g.tok.encode(t).len()).collect();
        let messages = json!([{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "What is a KV cache?"}]);
        let segs = render_chat(messages.as_array().unwrap(), None, false, 0).unwrap();
        let rendered = pod.g.tok.encode_segments(&segs);
        let long: Vec<u32> = (1..=100).collect();
        for (endpoint, key) in [(Endpoint::Pooling, "data"), (Endpoint::Classify, "probs")] {
            let h = none();
            let answer = |body| pool_answer(&pod, endpoint, &h, body);
            let admitted = pod.lock().engine.counters.admitted_requests;
            let (_, v) = answer(json!({"input": texts})).await;
            assert_eq!(pod.lock().engine.counters.admitted_requests, admitted + 3);
            let indices: Vec<&Value> = v["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| &d["index"])
                .collect();
            assert_eq!(indices, [&json!(0), &json!(1), &json!(2)]);
            let sum: usize = counts.iter().sum();
            assert_eq!(v["usage"]["prompt_tokens"], sum);
            assert_eq!(v["usage"]["total_tokens"], sum);
            let out = items(&v, key);
            assert_eq!(out[0], out[2]);
            assert_ne!(out[0], out[1]);
            let ids: Vec<Vec<u32>> = texts.iter().map(|t| pod.g.tok.encode(t)).collect();
            let (_, by_ids) = answer(json!({"input": ids[..2]})).await;
            assert_eq!(items(&by_ids, key), out[..2]);
            let (_, one) = answer(json!({"input": texts[1]})).await;
            assert_eq!(items(&one, key), [out[1]]);

            let (_, chat) = answer(json!({"messages": messages})).await;
            assert_eq!(chat["usage"]["prompt_tokens"], rendered.len());
            let (_, by_ids) = answer(json!({"input": rendered})).await;
            assert_eq!(items(&chat, key), items(&by_ids, key));

            let body = json!({"input": long, "truncate_prompt_tokens": 10});
            let (_, cut) = answer(body).await;
            assert_eq!(cut["usage"]["prompt_tokens"], 10);
            let (_, last) = answer(json!({"input": long[90..]})).await;
            assert_eq!(items(&cut, key), items(&last, key));
        }
    }

    /// `/pooling`'s tasks: none or `embed` is `/v1/embeddings`' vector, `classify` `/classify`'s
    /// probabilities, in floats or base64 (float32, little-endian); `token_embed` and
    /// `token_classify` an output a prompt token (`token_embed`'s 8 long).
    #[tokio::test]
    async fn pooling_tasks_answer_what_the_other_endpoints_do() {
        let pod = running_pod(&[
            "--time-scale",
            "1000",
            "--embedding-size",
            "32",
            "--num-classes",
            "4",
        ]);
        let body = json!({"input": ["one prompt", "and another"]});
        let with = |extra: Value| {
            let mut b = body.clone();
            b.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            b
        };
        let h = none();
        let pooling = |b| pool_answer(&pod, Endpoint::Pooling, &h, b);
        let (_, embedded) = embed_answer(&pod, &none(), body.clone()).await;
        let (_, classified) = pool_answer(&pod, Endpoint::Classify, &none(), body.clone()).await;
        let (_, default) = pooling(body.clone()).await;
        let (_, embed) = pooling(with(json!({"task": "embed"}))).await;
        let (_, classify) = pooling(with(json!({"task": "classify"}))).await;
        assert_eq!(items(&default, "data"), items(&embedded, "embedding"));
        assert_eq!(items(&embed, "data"), items(&embedded, "embedding"));
        assert_eq!(items(&classify, "data"), items(&classified, "probs"));
        assert_eq!(classify["usage"], classified["usage"]);

        let b64 = json!({"encoding_format": "base64"});
        let (_, v) = pooling(with(b64.clone())).await;
        for (got, want) in items(&v, "data").into_iter().zip(vectors(&embedded)) {
            assert_eq!(unbase64_f32(got), want);
        }
        let (_, v) = pooling(with(
            json!({"task": "classify", "encoding_format": "base64"}),
        ))
        .await;
        for (got, want) in items(&v, "data")
            .into_iter()
            .zip(items(&classified, "probs"))
        {
            assert_eq!(unbase64_f32(got), floats(want));
        }

        let n = pod.g.tok.encode("one prompt").len();
        let one = |task| json!({"input": "one prompt", "task": task});
        let (_, v) = pooling(one("token_embed")).await;
        let rows = v["data"][0]["data"].as_array().unwrap();
        assert_eq!(rows.len(), n);
        assert!(rows
            .iter()
            .all(|r| (l2(&floats(r)) - 1.0).abs() < 1e-6 && floats(r).len() == 8));
        assert_eq!(v["usage"]["prompt_tokens"], n);
        let (_, v) = pooling(one("token_classify")).await;
        let rows = v["data"][0]["data"].as_array().unwrap();
        assert_eq!(rows.len(), n);
        for r in rows {
            let p = floats(r);
            let sum: f64 = p.iter().map(|&x| f64::from(x)).sum();
            assert!(p.len() == 4 && (sum - 1.0).abs() < 1e-6, "{p:?}");
        }
        let mut b = one("token_classify");
        b["encoding_format"] = json!("base64");
        let (_, v) = pooling(b).await;
        assert_eq!(
            unbase64_f32(&v["data"][0]["data"]).len(),
            4 * n,
            "flattened"
        );
    }

    /// Refusals in vLLM's OpenAI error shape, none reaching the engine: a task the model does
    /// not serve (`score`: vLLM's `Unsupported task`), one that is no `PoolingTask`,
    /// `dimensions` with a classify task, neither form (naming the endpoint's models), an
    /// unknown model (404), a `truncate_prompt_tokens` past the model's length. `/classify`
    /// has no `dimensions` or `encoding_format`: a body with them is answered as any other.
    #[tokio::test]
    async fn pooling_and_classify_refusals_are_vllms() {
        let pod = running_pod(&[
            "--time-scale",
            "1000",
            "--served-model-name",
            "m",
            "--max-model-len",
            "64",
        ]);
        let admitted = pod.lock().engine.counters.admitted_requests;
        let bad = StatusCode::BAD_REQUEST;
        let cases = [
            (
                Endpoint::Pooling,
                json!({"input": "a", "task": "score"}),
                bad,
                "Unsupported task: 'score' Supported tasks: ('embed', 'classify', \
                 'token_embed', 'token_classify')",
            ),
            (
                Endpoint::Pooling,
                json!({"input": "a", "task": "generate"}),
                bad,
                "task: Input should be 'embed', 'classify', 'score', 'token_embed', \
                 'token_classify' or 'plugin'",
            ),
            (
                Endpoint::Pooling,
                json!({"input": "a", "task": "classify", "dimensions": 2}),
                bad,
                "Task classify only supports ['use_activation'] parameters, does not \
                 support ['dimensions'] parameters",
            ),
            (
                Endpoint::Pooling,
                json!({"model": "m"}),
                bad,
                "input: Field required (PoolingCompletionRequest); messages: Field required \
                 (PoolingChatRequest)",
            ),
            (
                Endpoint::Classify,
                json!({"model": "m"}),
                bad,
                "input: Field required (ClassificationCompletionRequest); messages: Field \
                 required (ClassificationChatRequest)",
            ),
            (
                Endpoint::Pooling,
                json!({"input": "a", "model": "nope"}),
                StatusCode::NOT_FOUND,
                "The model `nope` does not exist.",
            ),
            (
                Endpoint::Classify,
                json!({"input": "a", "model": "nope"}),
                StatusCode::NOT_FOUND,
                "The model `nope` does not exist.",
            ),
            (
                Endpoint::Classify,
                json!({"input": "a", "truncate_prompt_tokens": 65}),
                bad,
                "truncate_prompt_tokens value is greater than max_model_len. Please, select a \
                 smaller truncation size.",
            ),
        ];
        for (endpoint, body, status, message) in cases {
            let (got, text) =
                read(post(&pod, Kind::Pool(endpoint), &none(), body.clone()).await).await;
            assert_eq!(got, status, "{body}: {text}");
            let v: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v["error"]["message"], message, "{body}");
            assert_eq!(v["error"]["code"], status.as_u16());
        }
        assert_eq!(pod.lock().engine.counters.admitted_requests, admitted);
        let body =
            json!({"input": "a", "dimensions": 2, "encoding_format": "base64", "stream": true});
        let (_, v) = pool_answer(&pod, Endpoint::Classify, &none(), body).await;
        assert_eq!(v["data"][0]["num_classes"], 2, "--num-classes' default");
        assert!(v["data"][0]["probs"].is_array());
    }

    /// Each prompt runs in the engine as an embedding's does: a prefill holding its KV while it
    /// runs, no output token; the metrics count the prompt tokens and a `stop` each, and no
    /// block is held afterwards.
    #[tokio::test]
    async fn pooling_and_classify_run_as_prefills_in_the_engine() {
        let pod = running_pod(&["--time-scale", "1000", "--embedding-size", "8"]);
        let ids: Vec<u32> = (1..=200).collect();
        let body = json!({"input": [ids, ids[..50]], "task": "token_classify"});
        let (_, v) = pool_answer(&pod, Endpoint::Pooling, &none(), body).await;
        assert_eq!(v["usage"]["prompt_tokens"], 250);
        let body = json!({"input": ids[100..]});
        let (_, v) = pool_answer(&pod, Endpoint::Classify, &none(), body).await;
        assert_eq!(v["usage"]["prompt_tokens"], 100);
        ran_as_prefills(&pod, 350.0, 3.0).await;
        assert!(pod.lock().engine.counters.peak_used_blocks >= 13);
    }

    // ------------------------------------------------------------ /score, /rerank

    /// A running pod with a one-label `/classify` (as the score APIs' reranker is), the
    /// served names `m` and `n`, and a short context.
    fn scoring_pod() -> Arc<Pod> {
        running_pod(&[
            "--time-scale",
            "1000",
            "--served-model-name",
            "m",
            "n",
            "--num-classes",
            "1",
            "--max-model-len",
            "64",
        ])
    }

    /// What `/classify` answers these token ids: the one label's probability.
    async fn classified(pod: &Arc<Pod>, ids: &[u32]) -> f64 {
        let body = json!({"input": ids});
        let (_, v) = pool_answer(pod, Endpoint::Classify, &none(), body).await;
        v["data"][0]["probs"][0].as_f64().unwrap()
    }

    /// The tokens of a pair's prompt: its query's, then its document's.
    fn pair(pod: &Pod, query: &str, document: &str) -> Vec<u32> {
        let mut ids = pod.g.tok.encode(query);
        ids.extend(pod.g.tok.encode(document));
        ids
    }

    /// `/score`: vLLM's `ScoreResponse`, its keys in vLLM's order, id `score-` and the
    /// `X-Request-Id` header's value (else a fresh hex one), the first served name whatever the
    /// request named, an item a pair in order; a pair's score is what `/classify` answers its
    /// prompt (the query's tokens then the document's) on a one-label model, the same each
    /// time; the usage sums the pairs' prompts. `use_activation: false` gives the logits.
    #[tokio::test]
    async fn score_answers_as_vllm_does() {
        let pod = scoring_pod();
        let (query, documents) = ("What is a KV cache?", ["Blocks of keys.", "A fruit."]);
        let mut h = HeaderMap::new();
        h.insert("x-request-id", "r-1".parse().unwrap());
        let body = json!({"model": "n", "queries": query, "documents": documents});
        let (raw, v) = pool_answer(&pod, Endpoint::Score, &h, body.clone()).await;
        let prompts: Vec<Vec<u32>> = documents.iter().map(|d| pair(&pod, query, d)).collect();
        let n = prompts[0].len() + prompts[1].len();
        assert!(
            raw.starts_with(r#"{"id":"score-r-1","object":"list","created":"#),
            "{raw}"
        );
        assert!(
            raw.contains(r#","model":"m","data":[{"index":0,"object":"score","score":"#),
            "{raw}"
        );
        assert!(
            raw.ends_with(&format!(
                r#"}}],"usage":{{"prompt_tokens":{n},"total_tokens":{n},"completion_tokens":0,"prompt_tokens_details":null}}}}"#
            )),
            "{raw}"
        );
        assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
        let scores: Vec<f64> = v["data"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, d)| {
                assert_eq!((&d["index"], &d["object"]), (&json!(i), &json!("score")));
                d["score"].as_f64().unwrap()
            })
            .collect();
        assert_eq!(scores.len(), 2);
        assert!(scores.iter().all(|s| (0.0..=1.0).contains(s)), "{scores:?}");
        assert_ne!(scores[0], scores[1]);
        for (prompt, score) in prompts.iter().zip(&scores) {
            assert_eq!(classified(&pod, prompt).await, *score);
        }
        let (_, again) = pool_answer(&pod, Endpoint::Score, &none(), body.clone()).await;
        assert_eq!(again["data"], v["data"], "the same pairs, alike");
        let id = again["id"].as_str().unwrap();
        assert!(id.len() == 6 + 32 && id[6..].bytes().all(|b| b.is_ascii_hexdigit()));
        let mut raw_logits = body;
        raw_logits["use_activation"] = json!(false);
        let (_, logits) = pool_answer(&pod, Endpoint::Score, &none(), raw_logits).await;
        let logit = logits["data"][0]["score"].as_f64().unwrap();
        assert!((1.0 / (1.0 + (-logit).exp()) - scores[0]).abs() < 1e-6);
    }

    /// `/rerank`: vLLM's `RerankResponse` (no `object` or `created`), id `rerank-`, each
    /// document with its index, its text and its pair's `/score` score, best first; `top_n`
    /// keeps the best ones; the usage counts every pair, kept or not.
    #[tokio::test]
    async fn rerank_answers_the_best_documents_first() {
        let pod = scoring_pod();
        let query = "Which fruit is red?";
        let documents = ["An apple.", "A banana.", "A cherry.", "A lime.", "A plum."];
        let body = json!({"queries": query, "documents": documents});
        let (_, scored) = pool_answer(&pod, Endpoint::Score, &none(), body).await;
        let score = |i: usize| scored["data"][i]["score"].as_f64().unwrap();
        let mut best: Vec<usize> = (0..documents.len()).collect();
        best.sort_by(|&a, &b| score(b).total_cmp(&score(a)));
        let body = json!({"model": "n", "query": query, "documents": documents, "top_n": 2});
        let (raw, v) = pool_answer(&pod, Endpoint::Rerank, &none(), body).await;
        let n = scored["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(raw.starts_with(r#"{"id":"rerank-"#), "{raw}");
        assert!(
            raw.contains(&format!(
                r#","model":"m","usage":{{"prompt_tokens":{n},"total_tokens":{n}}},"results":[{{"index":{},"document":{{"text":"#,
                best[0]
            )),
            "{raw}"
        );
        let results = v["results"].as_array().unwrap();
        assert_eq!(results.len(), 2);
        for (r, &i) in results.iter().zip(&best) {
            assert_eq!(r["index"], i);
            assert_eq!(
                r["document"],
                json!({"text": documents[i], "multi_modal": null})
            );
            assert_eq!(r["relevance_score"].as_f64().unwrap(), score(i));
        }
        let body = json!({"query": query, "documents": documents});
        let (_, all) = pool_answer(&pod, Endpoint::Rerank, &none(), body).await;
        let order: Vec<u64> = all["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["index"].as_u64().unwrap())
            .collect();
        assert_eq!(order, best.iter().map(|&i| i as u64).collect::<Vec<_>>());
    }

    /// The pairs run as prefills alone, one engine request each, and a query's pairs share
    /// its full blocks in the prefix cache: the second pair hits them.
    #[tokio::test]
    async fn a_querys_pairs_share_its_blocks_in_the_prefix_cache() {
        let pod = running_pod(&["--time-scale", "1000"]);
        let query = "Rank these passages about paged attention, prefix caching and the block \
                     tables of a serving engine by how well each one of them answers the \
                     question of why a router that sends a prompt to the pod already holding \
                     its prefix saves prefill time.";
        let q = pod.g.tok.encode(query).len();
        assert!(q >= 32, "{q}");
        let documents = [
            "Paged attention stores keys in blocks.",
            "Bananas are yellow.",
        ];
        let labels = "model_name=";
        let hits = metric(&pod, "vllm:prefix_cache_hits_total", labels).await;
        let body = json!({"text_1": [query], "text_2": documents});
        let (_, v) = pool_answer(&pod, Endpoint::Score, &none(), body).await;
        let hits = metric(&pod, "vllm:prefix_cache_hits_total", labels).await - hits;
        assert_eq!(hits, (q / 16 * 16) as f64, "the query's full blocks, once");
        let n: usize = documents.iter().map(|d| pair(&pod, query, d).len()).sum();
        assert_eq!(v["usage"]["prompt_tokens"], n);
        ran_as_prefills(&pod, n as f64, 2.0).await;
    }

    /// `truncate_prompt_tokens` cuts each pair's prompt (its last tokens kept, unless
    /// `truncation_side: "right"`), and the model's length bounds each pair, not their sum.
    #[tokio::test]
    async fn truncation_and_the_context_apply_to_each_pair() {
        let pod = scoring_pod();
        let query = "How does a router pick the pod that already holds a prompt's prefix?";
        let documents = ["By hashing blocks.", "By asking each pod."];
        let prompts: Vec<Vec<u32>> = documents.iter().map(|d| pair(&pod, query, d)).collect();
        let with = |body: Value, extra: Value| {
            let mut body = body;
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            body
        };
        let body = json!({"data_1": query, "data_2": documents});
        let (_, v) = pool_answer(
            &pod,
            Endpoint::Score,
            &none(),
            with(body.clone(), json!({"truncate_prompt_tokens": 5})),
        )
        .await;
        assert_eq!(v["usage"]["prompt_tokens"], 10);
        for (i, p) in prompts.iter().enumerate() {
            let score = v["data"][i]["score"].as_f64().unwrap();
            assert_eq!(score, classified(&pod, &p[p.len() - 5..]).await);
        }
        let first = json!({"truncate_prompt_tokens": 3, "truncation_side": "right"});
        let (_, v) = pool_answer(&pod, Endpoint::Score, &none(), with(body.clone(), first)).await;
        assert_eq!(v["usage"]["prompt_tokens"], 6);
        let shared = v["data"][0]["score"].as_f64().unwrap();
        assert_eq!(
            shared,
            v["data"][1]["score"].as_f64().unwrap(),
            "the query's"
        );
        assert_eq!(shared, classified(&pod, &prompts[0][..3]).await);

        // Each pair fits the 64-token context; both together would not.
        let long = "word ".repeat(40);
        let q = pod.g.tok.encode(&long).len();
        let body = json!({"text_1": long, "text_2": ["a", "b"]});
        let (_, v) = pool_answer(&pod, Endpoint::Score, &none(), body).await;
        assert_eq!(v["usage"]["prompt_tokens"], 2 * (q + 1));
        let longer = "word ".repeat(70);
        let n = pod.g.tok.encode(&longer).len() + 1;
        let body = json!({"text_1": longer, "text_2": ["a", "b"]});
        let (status, text) =
            read(post(&pod, Kind::Pool(Endpoint::Score), &none(), body.clone()).await).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["param"], "input_tokens");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with(&format!("You passed {n} input tokens")),
            "{text}"
        );
        let (_, v) = pool_answer(
            &pod,
            Endpoint::Score,
            &none(),
            with(body, json!({"truncate_prompt_tokens": -1})),
        )
        .await;
        assert_eq!(v["usage"]["prompt_tokens"], 128);
    }

    /// Refusals in vLLM's OpenAI error shape, none reaching the engine: a body of no form, a
    /// side of the wrong type, an unknown model (404, before the inputs are looked at),
    /// multimodal inputs, lengths that do not pair, a salt its validator refuses.
    #[tokio::test]
    async fn score_and_rerank_refusals_are_vllms() {
        let pod = scoring_pod();
        let admitted = pod.lock().engine.counters.admitted_requests;
        let bad = StatusCode::BAD_REQUEST;
        let image = json!({"content": [{"type": "image_url", "image_url": {"url": "x"}}]});
        let cases = [
            (
                Endpoint::Rerank,
                json!({"query": "q"}),
                bad,
                "documents: Field required (RerankRequest)",
            ),
            (
                Endpoint::Rerank,
                json!({"query": "q", "documents": [1]}),
                bad,
                "documents: Input should be a string, an object with a list `content`, or a \
                 list of them",
            ),
            (
                Endpoint::Score,
                json!({"text_1": image, "text_2": "a", "model": "nope"}),
                StatusCode::NOT_FOUND,
                "The model `nope` does not exist.",
            ),
            (
                Endpoint::Score,
                json!({"text_1": "q", "text_2": [image]}),
                bad,
                "MultiModalParam is not supported for LlamaForCausalLM",
            ),
            (
                Endpoint::Rerank,
                json!({"query": image, "documents": "a"}),
                bad,
                "MultiModalParam is not supported for LlamaForCausalLM",
            ),
            (
                Endpoint::Score,
                json!({"queries": ["a", "b", "c"], "items": ["d", "e"]}),
                bad,
                "Input lengths must be either 1:1, 1:N or N:N",
            ),
            (
                Endpoint::Score,
                json!({"queries": [], "items": ["d"]}),
                bad,
                "At least one text element must be given",
            ),
            (
                Endpoint::Rerank,
                json!({"query": "q", "documents": []}),
                bad,
                "At least one text_pair element must be given",
            ),
            (
                Endpoint::Score,
                json!({"text_1": "q", "text_2": "a", "truncate_prompt_tokens": -2}),
                bad,
                "truncate_prompt_tokens: Input should be greater than or equal to -1",
            ),
            (
                Endpoint::Score,
                json!({"text_1": "q", "text_2": "a", "cache_salt": ""}),
                bad,
                "Parameter 'cache_salt' must be a non-empty string if provided. \
                 (parameter=cache_salt)",
            ),
        ];
        for (endpoint, body, status, message) in cases {
            let (got, text) =
                read(post(&pod, Kind::Pool(endpoint), &none(), body.clone()).await).await;
            assert_eq!(got, status, "{body}: {text}");
            let v: Value = serde_json::from_str(&text).unwrap();
            let kind = match status {
                StatusCode::NOT_FOUND => "NotFoundError",
                _ => "BadRequestError",
            };
            assert_eq!(v["error"]["message"], message, "{body}");
            assert_eq!(v["error"]["type"], kind, "{body}");
            assert_eq!(v["error"]["code"], status.as_u16());
        }
        assert_eq!(pod.lock().engine.counters.admitted_requests, admitted);
    }
}
