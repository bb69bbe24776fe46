//! vLLM's Embeddings API, `POST /v1/embeddings`, as vLLM serves it (its
//! `vllm/entrypoints/pooling/embed/openai_protocol.py` `EmbeddingCompletionRequest` /
//! `EmbeddingChatRequest` / `EmbeddingResponse`, the request fields of
//! `pooling/base/protocol.py`, and `embed/serving.py` `ServingEmbedding`). Each prompt runs as a
//! pooling request of the engine, a prefill with no output, through the generation path
//! (`Kind::Pool`), so this module owns only the shapes around that path: the request's form
//! and options as its pydantic models read them, the vector a prompt embeds to, and the answer in
//! vLLM's key order (a struct's, where the simulator's other answers come out sorted). vLLM's
//! other pooling endpoints that take these inputs, `/pooling` and `/classify` (`pooling`), are
//! read and answered by the same functions, given the endpoint; so are the score APIs' pooling
//! options and `/score`'s answer (`score` reads their pairs and answers `/rerank`).

use base64::Engine as _;
use serde::Serialize;
use serde_json::Value;

use crate::kv::mix64;
use crate::lax::{count, flag};
use crate::pod::Rng;
use crate::pooling::{self, Endpoint, Pooled, Task};
use crate::score;
use crate::tokenizer::Segment;

/// Which of vLLM's two request models a body is (`EmbeddingRequest` is their union, and so
/// are `PoolingRequest` and `ClassificationRequest`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// `EmbeddingCompletionRequest`: `input`, each string or id list a prompt.
    Completion,
    /// `EmbeddingChatRequest`: `messages`, one prompt rendered by the chat template.
    Chat,
}

/// A body with `input` is the completion form, one with `messages` and no `input` the chat
/// form; one with neither validates as neither of the endpoint's models (`Endpoint::model`).
pub fn form(body: &Value, endpoint: Endpoint) -> Result<Form, String> {
    Ok(match endpoint.model(body)? {
        (0, _) => Form::Completion,
        _ => Form::Chat,
    })
}

/// How the answer's vectors are written: JSON floats, or each vector's float32 bytes in base64.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Float,
    Base64 { big_endian: bool },
}

/// What the answer is made with, read as the request's pydantic model reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    pub endpoint: Endpoint,
    pub encoding: Encoding,
    /// The `dimensions` asked for (checked against the model's size by `check_dimensions`).
    pub dimensions: Option<i64>,
    /// The task the prompts are pooled for (`/pooling`'s `task`; the endpoint's own elsewhere),
    /// or the name of one the model does not serve (refused once the model is known).
    pub task: Result<Task, &'static str>,
    /// `use_activation` (on unless turned off).
    pub activation: bool,
}

/// The request's options, checked as its model validates them before the request goes on:
/// its form, `encoding_format` (`float`, `base64`; vLLM's binary `bytes` and `bytes_only` are not
/// simulated), `embed_dtype` (`float32` only here) and `endianness`, `dimensions` an integer,
/// `/pooling`'s `task`, `truncate_prompt_tokens` at least -1, the flags, and a chat's
/// `continue_final_message` and `add_generation_prompt` not both set. `/classify`'s models have
/// no encoding fields and no `dimensions` (unknown fields, ignored); the score APIs' models
/// (`score::check`) have neither, nor the inputs' flags.
pub fn options(body: &Value, endpoint: Endpoint) -> Result<Options, String> {
    let chat = match endpoint {
        Endpoint::Score | Endpoint::Rerank => {
            score::check(body, endpoint)?;
            false
        }
        Endpoint::Embeddings | Endpoint::Pooling | Endpoint::Classify => {
            let chat = form(body, endpoint)? == Form::Chat;
            for name in [
                "add_special_tokens",
                "add_generation_prompt",
                "continue_final_message",
            ] {
                flag(body.get(name), name)?;
            }
            chat
        }
    };
    let (encoding, dimensions) = match endpoint {
        Endpoint::Classify | Endpoint::Score | Endpoint::Rerank => (Encoding::Float, None),
        Endpoint::Embeddings | Endpoint::Pooling => (
            encoding(body)?,
            integer(body.get("dimensions"), "dimensions")?,
        ),
    };
    let task = match endpoint {
        Endpoint::Embeddings => Ok(Task::Embed),
        // The score APIs' pairs are classified by a one-label model (`Pooler::new`).
        Endpoint::Classify | Endpoint::Score | Endpoint::Rerank => Ok(Task::Classify),
        Endpoint::Pooling => pooling::task(body)?,
    };
    truncate_prompt_tokens(body)?;
    keeps_first(body)?;
    let activation = flag(body.get("use_activation"), "use_activation")?.unwrap_or(true);
    if chat {
        let on = |name| flag(body.get(name), name).map(|f| f.unwrap_or(false));
        if on("continue_final_message")? && on("add_generation_prompt")? {
            return Err(
                "Cannot set both `continue_final_message` and `add_generation_prompt` \
                        to True."
                    .into(),
            );
        }
        match body.get("chat_template_kwargs") {
            None | Some(Value::Null | Value::Object(_)) => {}
            Some(_) => {
                return Err("chat_template_kwargs: Input should be a valid dictionary".into())
            }
        }
    }
    Ok(Options {
        endpoint,
        encoding,
        dimensions,
        task,
        activation,
    })
}

/// `encoding_format`, `endianness` and `embed_dtype`: how the answer writes its floats.
fn encoding(body: &Value) -> Result<Encoding, String> {
    let encoding = match body.get("encoding_format") {
        None | Some(Value::Null) => "float",
        Some(Value::String(s)) => s.as_str(),
        Some(_) => "",
    };
    let big_endian = match body.get("endianness") {
        None | Some(Value::Null) => false,
        Some(v) => match v.as_str() {
            // vLLM's default, `native`, is the host's: little-endian on the x86 and Arm hosts
            // it runs on.
            Some("native" | "little") => false,
            Some("big") => true,
            _ => return Err("endianness: Input should be 'native', 'big' or 'little'".to_string()),
        },
    };
    let encoding = match encoding {
        "float" => Encoding::Float,
        "base64" => Encoding::Base64 { big_endian },
        "bytes" | "bytes_only" => {
            return Err(format!(
                "kvgate-sim: encoding_format {encoding} (a binary response) is not simulated; \
                 use float or base64"
            ))
        }
        _ => {
            return Err(
                "encoding_format: Input should be 'float', 'base64', 'bytes' or \
                        'bytes_only'"
                    .into(),
            )
        }
    };
    match body.get("embed_dtype") {
        None | Some(Value::Null) => Ok(encoding),
        Some(Value::String(s)) if s == "float32" => Ok(encoding),
        Some(v) => Err(format!(
            "kvgate-sim: embed_dtype {v} is not simulated; float32 (the default) only"
        )),
    }
}

/// An integer field as pydantic's lax mode reads one (`lax::count`), negative ones included.
pub fn integer(v: Option<&Value>, name: &str) -> Result<Option<i64>, String> {
    let negative = match v {
        Some(Value::Number(n)) => n
            .as_i64()
            .or_else(|| n.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64))
            .filter(|&i| i < 0),
        Some(Value::String(s)) => s.trim().parse::<i64>().ok().filter(|&i| i < 0),
        _ => None,
    };
    if negative.is_some() {
        return Ok(negative);
    }
    Ok(count(v, name)?.map(|c| i64::try_from(c).unwrap_or(i64::MAX)))
}

/// `truncate_prompt_tokens`: an integer of at least -1, or none.
pub fn truncate_prompt_tokens(body: &Value) -> Result<Option<i64>, String> {
    match integer(body.get("truncate_prompt_tokens"), "truncate_prompt_tokens")? {
        Some(t) if t < -1 => {
            Err("truncate_prompt_tokens: Input should be greater than or equal to -1".into())
        }
        t => Ok(t),
    }
}

/// `truncation_side`: `right` keeps a prompt's first tokens; `left`, or none (vLLM loads its
/// tokenizers with `truncation_side="left"`), its last.
fn keeps_first(body: &Value) -> Result<bool, String> {
    match body.get("truncation_side") {
        None | Some(Value::Null) => Ok(false),
        Some(v) => match v.as_str() {
            Some("left") => Ok(false),
            Some("right") => Ok(true),
            _ => Err("truncation_side: Input should be 'left' or 'right'".into()),
        },
    }
}

/// How a prompt is cut to `truncate_prompt_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Truncation {
    /// Tokens kept.
    pub keep: usize,
    /// Whether they are the prompt's first (`truncation_side: "right"`) rather than its last.
    pub first: bool,
}

impl Truncation {
    pub fn apply(self, prompt: &mut Vec<u32>) {
        if self.first {
            prompt.truncate(self.keep);
        } else {
            prompt.drain(..prompt.len().saturating_sub(self.keep));
        }
    }
}

/// How the request's prompts are cut, from `truncate_prompt_tokens` (and `truncation_side`):
/// -1 is the model's length; more than the model's length is refused as vLLM's pooling serving
/// refuses it (`_validate_request`).
pub fn truncation(body: &Value, max_model_len: usize) -> Result<Option<Truncation>, String> {
    let keep = match truncate_prompt_tokens(body)? {
        None => return Ok(None),
        Some(-1) => max_model_len,
        Some(t) => match usize::try_from(t) {
            Ok(t) if t <= max_model_len => t,
            _ => {
                return Err(
                    "truncate_prompt_tokens value is greater than max_model_len. \
                            Please, select a smaller truncation size."
                        .into(),
                )
            }
        },
    };
    Ok(Some(Truncation {
        keep,
        first: keeps_first(body)?,
    }))
}

/// A chat's prompt as the embeddings request renders it: the chat template with
/// `add_generation_prompt` off unless asked for, and with `continue_final_message` the last
/// message left open (its end marker not rendered).
pub fn continue_final(segs: &mut [Segment], end: &str) {
    if let Some(Segment::Text(t)) = segs.last_mut() {
        if let Some(open) = t.strip_suffix(end) {
            let open = open.to_string();
            *t = open;
        }
    }
}

/// `dimensions` as vLLM's `PoolingParams.verify` checks it for a Matryoshka model: at least 1,
/// and here at most the model's size (`--embedding-size`).
pub fn check_dimensions(dimensions: Option<i64>, size: usize) -> Result<Option<usize>, String> {
    match dimensions {
        None => Ok(None),
        Some(d) if d < 1 => Err("Dimensions must be greater than 0".into()),
        Some(d) => match usize::try_from(d) {
            Ok(d) if d <= size => Ok(Some(d)),
            _ => Err(format!(
                "kvgate-sim: dimensions ({d}) is greater than the model's embedding size \
                 ({size})."
            )),
        },
    }
}

/// The vector a prompt embeds to: deterministic in its token ids (their hash seeds its
/// components), `size` long and of unit length (the pooler's normalized output); with
/// `dimensions`, that vector's first `dimensions` components normalized again, as vLLM's pooler
/// truncates a Matryoshka model's embedding. Float32, as the model answers it.
pub fn embed(ids: &[u32], size: usize, dimensions: Option<usize>) -> Vec<f32> {
    vector(seed(ids, 0x656d_6265_6464_696e), size, dimensions)
}

/// A hash of a prompt's token ids (and `salt`): what seeds its outputs.
pub fn seed(ids: &[u32], salt: u64) -> u64 {
    ids.iter()
        .fold(salt ^ ids.len() as u64, |h, &t| mix64(h ^ u64::from(t)))
}

/// `embed`'s vector for a seed: `size` normal components scaled to unit length, and with
/// `dimensions` its first ones normalized again.
pub fn vector(seed: u64, size: usize, dimensions: Option<usize>) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let full = unit((0..size).map(|_| rng.normal()).collect());
    let kept = dimensions.map_or(full.len(), |d| d.min(full.len()));
    let mut v = full;
    v.truncate(kept);
    unit(v).into_iter().map(|x| x as f32).collect()
}

/// `v` scaled to unit L2 norm (a zero vector left as it is).
fn unit(mut v: Vec<f64>) -> Vec<f64> {
    let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    }
    v
}

/// Standard base64 with padding (Python's `base64.b64encode`).
fn base64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// One prompt's output as the answer writes it: floats (each float32 widened to a double, as
/// Python's `tolist()` of a float32 tensor gives them; a list a token for the per-token tasks),
/// or its float32 bytes in base64 (a per-token output's flattened).
fn encode(p: &Pooled, encoding: Encoding) -> Encoded {
    let floats = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect();
    match (encoding, p) {
        (Encoding::Float, Pooled::One(v)) => Encoded::Float(floats(v)),
        (Encoding::Float, Pooled::PerToken(rows)) => {
            Encoded::PerToken(rows.iter().map(|v| floats(v)).collect())
        }
        (Encoding::Base64 { big_endian }, _) => {
            let bytes: Vec<u8> = p
                .flat()
                .flat_map(|x| {
                    if big_endian {
                        x.to_be_bytes()
                    } else {
                        x.to_le_bytes()
                    }
                })
                .collect();
            Encoded::Base64(base64(&bytes))
        }
    }
}

#[derive(Serialize)]
#[serde(untagged)]
enum Encoded {
    Float(Vec<f64>),
    PerToken(Vec<Vec<f64>>),
    Base64(String),
}

/// An answer's item: `EmbeddingResponseData`, `PoolingResponseData`, `ClassificationData` or
/// `ScoreResponseData`.
#[derive(Serialize)]
#[serde(untagged)]
enum Data {
    Embedding {
        index: usize,
        object: &'static str,
        embedding: Encoded,
    },
    Pooling {
        index: usize,
        object: &'static str,
        data: Encoded,
    },
    Classification {
        index: usize,
        label: String,
        probs: Encoded,
        num_classes: usize,
    },
    Score {
        index: usize,
        object: &'static str,
        score: f64,
    },
}

impl Data {
    /// The `index`-th prompt's item as `endpoint` answers it.
    fn new(endpoint: Endpoint, index: usize, p: &Pooled, encoding: Encoding) -> Self {
        match endpoint {
            Endpoint::Embeddings => Data::Embedding {
                index,
                object: "embedding",
                embedding: encode(p, encoding),
            },
            Endpoint::Pooling => Data::Pooling {
                index,
                object: "pooling",
                data: encode(p, encoding),
            },
            Endpoint::Classify => {
                let probs: Vec<f32> = p.flat().collect();
                Data::Classification {
                    index,
                    label: pooling::label(&probs),
                    num_classes: probs.len(),
                    probs: encode(p, Encoding::Float),
                }
            }
            // A pair's score; `/rerank` answers the same scores in its own shape
            // (`score::rerank`).
            Endpoint::Score | Endpoint::Rerank => Data::Score {
                index,
                object: "score",
                score: p.score(),
            },
        }
    }
}

/// `UsageInfo` as a pooling answer fills it: prompt tokens only.
#[derive(Serialize)]
struct Usage {
    prompt_tokens: usize,
    total_tokens: usize,
    completion_tokens: usize,
    prompt_tokens_details: Option<()>,
}

/// `EmbeddingResponse`, `PoolingResponse`, `ClassificationResponse` or `ScoreResponse` (the
/// same fields), in vLLM's order.
#[derive(Serialize)]
struct Answer<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    data: Vec<Data>,
    usage: Usage,
}

/// The answer's JSON as `endpoint` gives it: an item a prompt's output, in the prompts' order,
/// and the prompts' tokens summed.
pub fn response(
    id: &str,
    created: u64,
    model: &str,
    endpoint: Endpoint,
    outputs: &[Pooled],
    encoding: Encoding,
    prompt_tokens: usize,
) -> Result<String, String> {
    let answer = Answer {
        id,
        object: "list",
        created,
        model,
        data: outputs
            .iter()
            .enumerate()
            .map(|(index, p)| Data::new(endpoint, index, p, encoding))
            .collect(),
        usage: Usage {
            prompt_tokens,
            total_tokens: prompt_tokens,
            completion_tokens: 0,
            prompt_tokens_details: None,
        },
    };
    serde_json::to_string(&answer).map_err(|e| e.to_string())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    /// Python's `base64.b64decode`, for the tests.
    pub fn unbase64(s: &str) -> Vec<u8> {
        base64::engine::general_purpose::STANDARD.decode(s).unwrap()
    }

    #[test]
    fn base64_is_pythons() {
        for (bytes, want) in [
            (&b""[..], ""),
            (b"f", "Zg=="),
            (b"fo", "Zm8="),
            (b"foo", "Zm9v"),
            (b"foobar", "Zm9vYmFy"),
            (&[0xff, 0xfe, 0x00, 0x80], "//4AgA=="),
        ] {
            assert_eq!(base64(bytes), want);
            assert_eq!(unbase64(want), bytes);
        }
    }

    /// A prompt's vector is its ids' alone, unit length, of the model's size; `dimensions`
    /// keeps the full vector's first components, normalized again.
    #[test]
    fn vectors_are_deterministic_unit_and_truncate_as_matryoshka() {
        let a = embed(&[1, 2, 3], 64, None);
        assert_eq!(a, embed(&[1, 2, 3], 64, None));
        assert_ne!(a, embed(&[1, 2, 4], 64, None));
        assert_ne!(embed(&[1, 2], 64, None), embed(&[2, 1], 64, None));
        assert_eq!(a.len(), 64);
        let norm = |v: &[f32]| v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
        assert!((norm(&a) - 1.0).abs() < 1e-6);
        let d = embed(&[1, 2, 3], 64, Some(8));
        assert_eq!(d.len(), 8);
        assert!((norm(&d) - 1.0).abs() < 1e-6);
        let scale = norm(&a[..8]);
        for (x, y) in d.iter().zip(&a[..8]) {
            assert!((f64::from(*x) * scale - f64::from(*y)).abs() < 1e-6);
        }
    }

    #[test]
    fn forms_and_options_are_read_as_vllms_models_read_them() {
        let e = Endpoint::Embeddings;
        assert_eq!(
            form(&json!({"input": "a", "messages": []}), e),
            Ok(Form::Completion)
        );
        assert_eq!(form(&json!({"messages": []}), e), Ok(Form::Chat));
        assert!(form(&json!({"input": null}), e)
            .unwrap_err()
            .ends_with("(EmbeddingChatRequest)"));
        let missing = form(&json!({}), Endpoint::Classify).unwrap_err();
        assert!(
            missing.contains("(ClassificationCompletionRequest)"),
            "{missing}"
        );
        let o = |body: Value| options(&body, e);
        assert_eq!(o(json!({"input": "a"})).unwrap().encoding, Encoding::Float);
        assert_eq!(
            o(json!({"input": "a", "encoding_format": "base64", "endianness": "big"}))
                .unwrap()
                .encoding,
            Encoding::Base64 { big_endian: true }
        );
        assert_eq!(
            o(json!({"input": "a", "dimensions": "-3"}))
                .unwrap()
                .dimensions,
            Some(-3)
        );
        for bad in [
            json!({"input": "a", "encoding_format": "hex"}),
            json!({"input": "a", "encoding_format": "bytes"}),
            json!({"input": "a", "embed_dtype": "float16"}),
            json!({"input": "a", "dimensions": 1.5}),
            json!({"input": "a", "truncate_prompt_tokens": -2}),
            json!({"input": "a", "add_special_tokens": "maybe"}),
            json!({"input": "a", "use_activation": "maybe"}),
            json!({"messages": [], "add_generation_prompt": true,
                   "continue_final_message": true}),
            json!({"messages": [], "chat_template_kwargs": [1]}),
        ] {
            assert!(o(bad.clone()).is_err(), "{bad}");
        }
        let cut = |body: Value| truncation(&body, 100).map(|t| t.map(|t| (t.keep, t.first)));
        assert_eq!(
            cut(json!({"truncate_prompt_tokens": -1})),
            Ok(Some((100, false)))
        );
        assert_eq!(
            cut(json!({"truncate_prompt_tokens": 7})),
            Ok(Some((7, false)))
        );
        assert_eq!(
            cut(json!({"truncate_prompt_tokens": 7, "truncation_side": "right"})),
            Ok(Some((7, true)))
        );
        assert_eq!(cut(json!({"truncation_side": "right"})), Ok(None));
        assert!(cut(json!({"truncate_prompt_tokens": 101})).is_err());
        assert!(o(json!({"input": "a", "truncation_side": "middle"})).is_err());
        let mut p = vec![1, 2, 3, 4];
        Truncation {
            keep: 2,
            first: false,
        }
        .apply(&mut p);
        assert_eq!(p, [3, 4]);
        let mut p = vec![1, 2, 3, 4];
        Truncation {
            keep: 2,
            first: true,
        }
        .apply(&mut p);
        assert_eq!(p, [1, 2]);
        assert_eq!(
            check_dimensions(Some(0), 8),
            Err("Dimensions must be greater than 0".into())
        );
        assert!(check_dimensions(Some(9), 8).is_err());
        assert_eq!(check_dimensions(Some(8), 8), Ok(Some(8)));
    }

    /// The answer's keys in vLLM's order, and its usage, as each endpoint writes its items.
    #[test]
    fn the_answer_keeps_vllms_key_order() {
        let one = [Pooled::One(vec![0.5, -0.25])];
        let answer = |endpoint, outputs: &[Pooled], encoding| {
            response("x", 7, "m", endpoint, outputs, encoding, 3).unwrap()
        };
        let text = answer(Endpoint::Embeddings, &one, Encoding::Float);
        let usage = r#""usage":{"prompt_tokens":3,"total_tokens":3,"completion_tokens":0,"prompt_tokens_details":null}}"#;
        let head = r#"{"id":"x","object":"list","created":7,"model":"m","data":"#;
        assert_eq!(
            text,
            format!(
                r#"{head}[{{"index":0,"object":"embedding","embedding":[0.5,-0.25]}}],{usage}"#
            )
        );
        let text = answer(Endpoint::Pooling, &one, Encoding::Float);
        assert_eq!(
            text,
            format!(r#"{head}[{{"index":0,"object":"pooling","data":[0.5,-0.25]}}],{usage}"#)
        );
        let rows = [Pooled::PerToken(vec![vec![0.5], vec![-0.25]])];
        let text = answer(Endpoint::Pooling, &rows, Encoding::Float);
        assert_eq!(
            text,
            format!(r#"{head}[{{"index":0,"object":"pooling","data":[[0.5],[-0.25]]}}],{usage}"#)
        );
        let b64 = Encoding::Base64 { big_endian: false };
        let (flat, nested) = (
            answer(Endpoint::Pooling, &one, b64),
            answer(Endpoint::Pooling, &rows, b64),
        );
        assert_eq!(
            flat, nested,
            "a per-token output's base64 is its flattened floats'"
        );
        let probs = [Pooled::One(vec![0.25, 0.75])];
        let text = answer(Endpoint::Classify, &probs, b64);
        assert_eq!(
            text,
            format!(
                r#"{head}[{{"index":0,"label":"LABEL_1","probs":[0.25,0.75],"num_classes":2}}],{usage}"#
            )
        );
    }
}
