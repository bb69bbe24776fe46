//! OpenAI-compatible request bodies, the Anthropic Messages API vLLM and SGLang also serve, and
//! the engines' own generate APIs (SGLang's `/generate`, vLLM's `/inference/v1/generate`): which
//! API a path is, and the fields kvgate decides on (model, prompt content, output limits,
//! streaming, cache salt). Content is kept as a canonical text rendering in which earlier chat
//! turns are a true prefix of later ones, so the same text serves token estimation and prefix
//! hashing.

use super::lax::{Count, Flag};
use super::render::{with_room, Rendering};
use super::shapes::{
    Content, Input, Json, Prompt, ScoreInputs, SystemApart, SystemInline, SystemRule, Text, Turns,
};
use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;
use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Completions,
    ChatCompletions,
    Responses,
    /// vLLM's pooling APIs that take a prompt and generate nothing: `/v1/embeddings` and
    /// `/classify` (its `input`, or `messages` through the chat template).
    Embeddings,
    /// vLLM's `/pooling`: read as the embeddings are, but it also serves an IO processor plugin's
    /// requests (`data`, no prompt), which kvgate leaves unread (`BadRequest::names_no_prompt`).
    Pooling,
    /// Anthropic's Messages API (`/v1/messages`), which vLLM (its `vllm/entrypoints/anthropic`)
    /// and SGLang serve as a chat completion of the same conversation.
    Messages,
    /// SGLang's native `/generate` (its `GenerateReqInput`): a raw `text` or `input_ids`
    /// prompt, no chat template, limits in `sampling_params`; what RL rollouts and SGLang's own
    /// router send.
    Generate,
    /// vLLM's tokens-in, tokens-out `/inference/v1/generate` (its `serve/disagg`
    /// `GenerateRequest`): `token_ids` and `sampling_params`.
    Tokens,
    /// vLLM's score APIs (its `pooling/score`): `/score` and `/v1/score` (`queries` and
    /// `documents`, or `items`; `data_1` and `data_2`; `text_1` and `text_2`), `/rerank`,
    /// `/v1/rerank` and `/v2/rerank` (Jina's and Cohere's shape: `query` and `documents`). Each
    /// pair is a prompt the engine prefills and generates nothing for.
    Score,
}

impl Api {
    /// Matches by suffix, so a route prefix such as `/openai/v1/chat/completions` still works; the
    /// query string is ignored. SGLang's `/generate` and vLLM's `/pooling`, `/classify`,
    /// `/score` and `/rerank` only as the whole path: other servers end paths of their own so
    /// (Ollama's `/api/generate`), whose bodies are not the engines'.
    pub fn from_path(path: &str) -> Option<Api> {
        let path = path.split(['?', '#']).next().unwrap_or("");
        let path = path.trim_end_matches('/');
        match path {
            "/generate" => return Some(Api::Generate),
            "/classify" => return Some(Api::Embeddings),
            "/pooling" => return Some(Api::Pooling),
            "/score" | "/rerank" => return Some(Api::Score),
            _ => {}
        }
        [
            ("/v1/chat/completions", Api::ChatCompletions),
            ("/v1/completions", Api::Completions),
            ("/v1/responses", Api::Responses),
            ("/v1/embeddings", Api::Embeddings),
            ("/v1/messages", Api::Messages),
            ("/inference/v1/generate", Api::Tokens),
            ("/v1/score", Api::Score),
            ("/v1/rerank", Api::Score),
            ("/v2/rerank", Api::Score),
        ]
        .into_iter()
        .find(|(suffix, _)| path.ends_with(suffix))
        .map(|(_, api)| api)
    }
}

/// What kvgate needs from a request body.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Request {
    /// Empty when the body names none: the engine's own model (`flow`'s `choose_model`).
    pub model: String,
    /// The LoRA adapter an SGLang `/generate` body names by its `lora_path` (the first prompt's),
    /// which names no model: the model it runs as when the pods serve an adapter of that name.
    pub adapter: Option<String>,
    /// Where the `model` value (a JSON string, quotes included) lies in the body, for a rewrite
    /// (never of a body that names no model).
    pub model_span: (usize, usize),
    /// Canonical text of everything the engine will prefill, in order.
    pub text: String,
    /// How much of `text` (bytes, from its start) is the application's rather than the
    /// conversation's: the tools and the system or developer turns (a Responses request's
    /// `instructions`) before any other turn. 0 when there are none, and for a completions or
    /// embeddings prompt, which has no turns to tell apart.
    pub opening: usize,
    /// Prompt given as token ids: counted exactly, never estimated.
    pub token_ids: u64,
    /// A prompt that is one list of token ids, and nothing before it: its first ids, four
    /// little-endian bytes each, whose blocks are the engine's own (`routing::prefix::
    /// id_block_hashes`). Empty for a text prompt (hashed on `text`) and for a batch of lists.
    pub ids: Vec<u8>,
    /// Of a batch of text prompts, how much of `text` (bytes, from its start) is the first
    /// prompt (`prefix_text`).
    pub first_prompt: Option<usize>,
    /// A score request's one query, paired with each of its documents: how much of `text` it
    /// is (from its start), and how many pairs after the first prefill it again. `text` holds it
    /// once (a long query and many documents would otherwise copy it many times over);
    /// `estimate::reservation::StaticCount` counts it each time.
    pub repeated: Option<(usize, u64)>,
    /// The engine renders the prompt through the model's chat template (chat completions,
    /// responses), which adds tokens of its own to every prompt; a completions or embeddings
    /// prompt is taken as it is (`calibration::PromptFit`: each is fitted on its own).
    pub templated: bool,
    /// Non-text content parts (images, audio, files), charged a configured cost each.
    pub non_text_parts: u64,
    /// The answers it asks for, at least 1: `n` (parallel sampling) for each of its `prompts`.
    /// The engine runs each as its own sequence, a prompt's `n` on that shared prompt (vLLM V1's
    /// `ParentRequest`), so its output grows this many tokens a step.
    pub choices: u64,
    /// The prompts it carries, at least 1: a completions `prompt` that is a list of strings or
    /// of lists of ids is a batch, each prompt prefilled and answered as a request of its own
    /// (vLLM's and SGLang's completions; its answers' `index` is prompt × `n` + choice).
    pub prompts: u64,
    /// The request's own output limit, from whichever max-tokens field it used, over all its
    /// choices (each may run to the field's value).
    pub max_output_tokens: Option<u64>,
    /// What its answer runs at least, whatever the model would say: vLLM's and SGLang's
    /// `min_tokens`, or its whole limit (`u64::MAX`: the limit, whatever it is) under
    /// `ignore_eos`, as benchmark clients send (`vllm bench serve`, genai-perf).
    pub min_output_tokens: u64,
    /// A Responses API follow-up's `previous_response_id`: the engine prepends that response's
    /// conversation, which only the server that stored it holds (`routing::stored`).
    pub previous_response: Option<String>,
    /// The engine stores the answer (the Responses API's `store`, on unless turned off).
    pub stored: bool,
    pub stream: bool,
    pub cache_salt: Option<String>,
}

/// Why a body on a known path was refused; becomes a 400 with an OpenAI-style error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadRequest {
    pub message: String,
    /// The offending parameter, as OpenAI's error object names it.
    pub param: Option<String>,
    /// The body names no prompt of the kind its path takes, where the path also serves requests
    /// kvgate does not read (`names_no_prompt`).
    no_prompt: bool,
}

impl fmt::Display for BadRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// A body of the OpenAI-compatible APIs and Anthropic's Messages API, whose system messages
/// join its system prompt (`SystemApart`).
#[derive(Deserialize, Default)]
#[serde(default)]
struct Body<'a, S: SystemRule> {
    /// Kept raw: its place in the body is where a rename writes the target model.
    #[serde(borrow)]
    model: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow)]
    prompt: Option<Prompt<'a>>,
    #[serde(borrow)]
    suffix: Option<Text<'a>>,
    #[serde(bound(deserialize = ""))]
    messages: Option<Turns<S>>,
    #[serde(borrow)]
    input: Option<Input<'a>>,
    #[serde(borrow)]
    instructions: Option<Text<'a>>,
    /// An Anthropic Messages request's system prompt: a string or text blocks.
    #[serde(borrow)]
    system: Option<Content<'a>>,
    tools: Option<Json>,
    /// Absent (`None`), null (`Some(None)`) or a count: a completions request that has none at
    /// all stops at `COMPLETIONS_DEFAULT_MAX_TOKENS`.
    ///
    /// This and the other counts and flags kvgate decides on (the max-tokens fields, `n`,
    /// `stream`) are read as the engines read them (`lax`), and refused only where the engine
    /// would refuse them.
    #[serde(deserialize_with = "present")]
    max_tokens: Option<Option<Count>>,
    max_completion_tokens: Option<Count>,
    max_output_tokens: Option<Count>,
    n: Option<Count>,
    /// The engine's parameters, read as values: one that is not a flag or a count is the
    /// engine's to refuse, not a reason for kvgate to refuse the body.
    #[serde(borrow)]
    ignore_eos: Option<&'a RawValue>,
    #[serde(borrow)]
    min_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    previous_response_id: Option<&'a RawValue>,
    #[serde(borrow)]
    store: Option<&'a RawValue>,
    stream: Option<Flag>,
    cache_salt: Option<String>,
}

/// A body of the engines' native generate APIs (`Api::Generate`, `Api::Tokens`), read apart
/// from `Body`: their `text` is a prompt where the Responses API's is an output setting.
#[derive(Deserialize, Default)]
#[serde(default)]
struct NativeBody<'a> {
    /// vLLM's only: SGLang's `/generate` names no model.
    #[serde(borrow)]
    model: Option<&'a serde_json::value::RawValue>,
    /// SGLang's adapter, by the name it was loaded under (`--lora-paths name=path`), for the
    /// whole request or one a prompt.
    lora_path: Option<PerPrompt>,
    /// SGLang's prompt: a string, or a batch of them.
    #[serde(borrow)]
    text: Option<Prompt<'a>>,
    /// SGLang's prompt as ids: a list, or a batch of lists.
    #[serde(borrow)]
    input_ids: Option<Prompt<'a>>,
    /// vLLM's prompt: one list of ids.
    #[serde(borrow)]
    token_ids: Option<Prompt<'a>>,
    sampling_params: Option<SamplingSet>,
    stream: Option<Flag>,
    /// vLLM's a string; SGLang's a string, or one a prompt of a batch.
    cache_salt: Option<PerPrompt>,
    /// SGLang's further key of the prompt's cached blocks, of the same shapes: its radix cache
    /// shares blocks only between requests of one `extra_key` (and salt, and adapter).
    extra_key: Option<PerPrompt>,
}

/// A body of vLLM's score APIs (`Api::Score`), in any of its forms: a pair's first side is
/// `query` (`/rerank`), `queries`, `data_1` or `text_1`, its second `documents`, `items`,
/// `data_2` or `text_2` (vLLM's `ScoreRequest` union and `RerankRequest`).
#[derive(Deserialize, Default)]
#[serde(default)]
struct ScoreBody<'a> {
    #[serde(borrow)]
    model: Option<&'a serde_json::value::RawValue>,
    query: Option<ScoreInputs>,
    queries: Option<ScoreInputs>,
    data_1: Option<ScoreInputs>,
    text_1: Option<ScoreInputs>,
    documents: Option<ScoreInputs>,
    items: Option<ScoreInputs>,
    data_2: Option<ScoreInputs>,
    text_2: Option<ScoreInputs>,
    /// vLLM's pooling requests take one, as its generation requests do.
    cache_salt: Option<String>,
}

/// A value SGLang's `/generate` takes for the whole request or one a prompt (null where a prompt
/// has none): kept only for the first prompt, which a batch is routed by; empty is none, as
/// SGLang reads it.
struct PerPrompt(Option<String>);

impl PerPrompt {
    fn first(self) -> Option<String> {
        self.0.filter(|s| !s.is_empty())
    }
}

impl<'de> Deserialize<'de> for PerPrompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PerPrompt;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of strings and nulls")
            }

            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(PerPrompt(Some(s.to_owned())))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let first = seq.next_element::<Option<Text>>()?.flatten();
                while seq.next_element::<Option<Text>>()?.is_some() {}
                Ok(PerPrompt(first.map(|t| t.as_str().to_owned())))
            }
        }
        d.deserialize_any(V)
    }
}

/// SGLang takes one `sampling_params` for every prompt of a batch, or a list of one a prompt,
/// summed as read: the answers of those that set a limit, and of those left at the API's
/// default (`Answers::at_default`), which differs between the native APIs.
enum SamplingSet {
    All(Sampling),
    Each {
        limited: Answers,
        defaulted: Answers,
    },
}

impl<'de> Deserialize<'de> for SamplingSet {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = SamplingSet;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object of sampling parameters, or an array of them")
            }

            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                Sampling::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(SamplingSet::All)
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let (mut limited, mut defaulted) = (Answers::NONE, Answers::NONE);
                while let Some(s) = seq.next_element::<Sampling>()? {
                    match s.limit() {
                        Some(max) => limited = limited.and(s.answers(max)),
                        None => defaulted = defaulted.and(s.answers(Some(0))),
                    }
                }
                Ok(SamplingSet::Each { limited, defaulted })
            }
        }
        d.deserialize_any(V)
    }
}

/// The sampling parameters kvgate decides on, under either engine's names: SGLang's
/// `max_new_tokens` and `min_new_tokens`, vLLM's `SamplingParams` `max_tokens` and `min_tokens`.
/// Its flags and counts are kept as read (a value that is neither is the engine's to refuse).
#[derive(Deserialize, Default)]
#[serde(default)]
struct Sampling {
    /// Absent (the engine's default), null (no limit but the context) or a count.
    #[serde(deserialize_with = "present")]
    max_new_tokens: Option<Option<Count>>,
    #[serde(deserialize_with = "present")]
    max_tokens: Option<Option<Count>>,
    #[serde(deserialize_with = "lax_count")]
    min_new_tokens: Option<u64>,
    #[serde(deserialize_with = "lax_count")]
    min_tokens: Option<u64>,
    #[serde(deserialize_with = "lax_flag")]
    ignore_eos: bool,
    n: Option<Count>,
}

impl Sampling {
    /// The limit it sets (`Some(None)`: none but the context), or `None` for the API's default.
    fn limit(&self) -> Option<Option<u64>> {
        self.max_new_tokens
            .or(self.max_tokens)
            .map(|set| set.map(|c| c.0))
    }

    /// Its answers under the limit `max`.
    fn answers(&self, max: Option<u64>) -> Answers {
        let min = self.min_new_tokens.or(self.min_tokens);
        Answers::of(self.n.map(|n| n.0), max, self.ignore_eos, min)
    }
}

/// A flag read as the engine reads it, anything else off (the engine's to refuse).
fn lax_flag<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    <&RawValue>::deserialize(d).map(Flag::on)
}

/// A count read as the engine reads it, anything else none (the engine's to refuse).
fn lax_count<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    <&RawValue>::deserialize(d).map(Count::of)
}

/// The salt a prompt's blocks are hashed by: its cache salt, and an SGLang `extra_key` after
/// it, apart (an `extra_key` alone is not the same namespace as a salt of the same text).
fn namespace(salt: Option<String>, extra_key: Option<String>) -> Option<String> {
    match extra_key {
        None => salt,
        Some(key) => Some(format!("{}\u{1f}{key}", salt.unwrap_or_default())),
    }
}

/// Where SGLang's `/generate` stops without `max_new_tokens` (its `SamplingParams`).
const SGLANG_DEFAULT_MAX_NEW_TOKENS: u64 = 128;

/// The answers of one prompt under its sampling parameters, or of several summed: how many
/// (each prompt's `n` choices, each run as a sequence of its own on the prompt prefilled once),
/// the most tokens they may run to together (`None`: no limit), and the least.
#[derive(Clone, Copy)]
struct Answers {
    choices: u64,
    max: Option<u64>,
    /// `u64::MAX` under `ignore_eos`: the whole limit, whatever it is.
    min: u64,
}

impl Answers {
    /// None at all: what `and` adds to.
    const NONE: Answers = Answers {
        choices: 0,
        max: Some(0),
        min: 0,
    };

    /// One prompt's: `n` choices, each up to `max` and at least `min_tokens`, or its whole
    /// limit under `ignore_eos`.
    fn of(n: Option<u64>, max: Option<u64>, ignore_eos: bool, min_tokens: Option<u64>) -> Answers {
        let choices = n.unwrap_or(1).clamp(1, MAX_CHOICES);
        let min = if ignore_eos {
            u64::MAX
        } else {
            min_tokens.unwrap_or(0)
        };
        Answers {
            choices,
            max: max.map(|m| m.saturating_mul(choices)),
            min: min.saturating_mul(choices),
        }
    }

    /// The same for each of `prompts` prompts.
    fn times(self, prompts: u64) -> Answers {
        Answers {
            choices: self.choices.saturating_mul(prompts),
            max: self.max.map(|m| m.saturating_mul(prompts)),
            min: self.min.saturating_mul(prompts),
        }
    }

    /// Answers summed with no limit of their own (`max` 0), each choice at the API's `default`.
    fn at_default(self, default: Option<u64>) -> Answers {
        Answers {
            max: match self.choices {
                0 => Some(0),
                choices => default.map(|m| m.saturating_mul(choices)),
            },
            ..self
        }
    }

    /// Two prompts' answers together.
    fn and(self, other: Answers) -> Answers {
        Answers {
            choices: self.choices.saturating_add(other.choices),
            max: self.max.zip(other.max).map(|(a, b)| a.saturating_add(b)),
            min: self.min.saturating_add(other.min),
        }
    }
}

const MAX_MODEL_CHARS: usize = 256;
/// The most answers a request is read to ask for: vLLM's default limit
/// (`VLLM_MAX_N_SEQUENCES`), past which the engine refuses it.
const MAX_CHOICES: u64 = 16_384;
/// Where a completions request without `max_tokens` stops: the OpenAI API's default, which vLLM
/// (`CompletionRequest.max_tokens = 16`) and SGLang keep. Only when the field is absent: vLLM
/// takes an explicit null as no limit but the model's length.
const COMPLETIONS_DEFAULT_MAX_TOKENS: u64 = 16;

/// A field that is there, null or not: `Some(None)` for null, where serde's default reads
/// absent and null alike.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<Count>>, D::Error> {
    Option::<Count>::deserialize(d).map(Some)
}

fn bad(message: impl Into<String>, param: Option<&str>) -> BadRequest {
    BadRequest {
        message: message.into(),
        param: param.map(str::to_string),
        no_prompt: false,
    }
}

fn missing(field: &str) -> BadRequest {
    bad(format!("missing required field `{field}`"), Some(field))
}

impl BadRequest {
    /// A body that names no prompt at all: on `/pooling` neither `input` nor `messages`, a
    /// request for the engine's IO processor plugin (its `data`); on a score path not both of a
    /// pair's sides in any of vLLM's forms, perhaps another server's (Hugging Face TEI's
    /// `/rerank` takes `texts`). The engine takes it, and kvgate does not read it.
    pub fn names_no_prompt(&self) -> bool {
        self.no_prompt
    }

    fn of_no_prompt(self) -> BadRequest {
        BadRequest {
            no_prompt: true,
            ..self
        }
    }
}

impl Request {
    /// The body, from a whole-text deserializer (trailing text is an error).
    fn deserialize<'b, T: Deserialize<'b>>(body: &'b str) -> Result<T, serde_json::Error> {
        let de = &mut serde_json::Deserializer::from_str(body);
        let parsed = T::deserialize(&mut *de)?;
        de.end()?;
        Ok(parsed)
    }

    /// Why a body did not parse, naming the field when it was a field's fault.
    fn explain_error<'b, T: Deserialize<'b>>(body: &'b str) -> BadRequest {
        let de = &mut serde_json::Deserializer::from_str(body);
        let tracked: Result<T, _> = serde_path_to_error::deserialize(&mut *de);
        let e = match tracked {
            Err(e) => e,
            // Only trailing text is left to be wrong.
            Ok(_) => {
                return match de.end() {
                    Err(e) => bad(format!("request body is not valid JSON: {e}"), None),
                    Ok(()) => bad("request body is not valid JSON", None),
                }
            }
        };
        let path = e.path().to_string();
        let inner = e.into_inner();
        let syntax = inner.is_syntax() || inner.is_eof();
        let param = (!syntax && path != "." && path != "?").then_some(path.as_str());
        let what = if syntax {
            "request body is not valid JSON"
        } else {
            "request body has an invalid field"
        };
        match param {
            Some(p) => bad(format!("{what}: `{p}`: {inner}"), Some(p)),
            None => bad(format!("{what}: {inner}"), None),
        }
    }

    /// The body as `T`. From the validated text, so strings are neither checked again nor
    /// copied when they have no escapes. The path of a bad field is tracked only to explain an
    /// error: a body that parses pays nothing for it (the tracking allocates at every field).
    fn read<'b, T: Deserialize<'b>>(body: &'b str) -> Result<T, BadRequest> {
        Self::deserialize(body).map_err(|_| Self::explain_error::<T>(body))
    }

    /// Parses a body for `api`. Fields kvgate does not use are ignored (clients send many).
    pub fn parse(api: Api, body: &[u8]) -> Result<Request, BadRequest> {
        // The text is about as long as the body that carries it: grown by doublings instead, a
        // long prompt was copied several times over (and once more for its last newline).
        with_room(body.len(), || Self::parse_body(api, body))
    }

    fn parse_body(api: Api, body: &[u8]) -> Result<Request, BadRequest> {
        let Ok(body) = std::str::from_utf8(body) else {
            return Err(bad("request body is not valid UTF-8", None));
        };
        // serde would accept a JSON array for a struct; OpenAI bodies are objects.
        if body.bytes().find(|b| !b.is_ascii_whitespace()) != Some(b'{') {
            return Err(bad("request body must be a JSON object", None));
        }
        if matches!(api, Api::Generate | Api::Tokens) {
            let parsed: NativeBody = Self::read(body)?;
            let model = parsed.model.filter(|_| api == Api::Tokens);
            let (model, model_span) = Self::model_of(model, body)?;
            return Self::from_native(api, parsed, model, model_span);
        }
        if api == Api::Score {
            let parsed: ScoreBody = Self::read(body)?;
            let (model, model_span) = Self::model_of(parsed.model, body)?;
            return Self::from_score(parsed, model, model_span);
        }
        if api == Api::Messages {
            let parsed: Body<SystemApart> = Self::read(body)?;
            let (model, model_span) = Self::model_of(parsed.model, body)?;
            return Self::from_body(api, parsed, model, model_span);
        }
        let parsed: Body<SystemInline> = Self::read(body)?;
        let (model, model_span) = Self::model_of(parsed.model, body)?;
        Self::from_body(api, parsed, model, model_span)
    }

    /// The `model` of a JSON object on a path kvgate does not read (vLLM's `/tokenize`,
    /// a plugin's `/pooling` …), for its pod alone: that and where it lies in the
    /// body (`with_model`), the rest left default. `None` when the body is not a JSON object
    /// naming a model as a string: the request then goes on as it came.
    pub fn model_only(body: &[u8]) -> Option<Request> {
        #[derive(Deserialize, Default)]
        #[serde(default)]
        struct Named<'a> {
            #[serde(borrow)]
            model: Option<&'a serde_json::value::RawValue>,
        }
        let body = std::str::from_utf8(body).ok()?;
        if body.bytes().find(|b| !b.is_ascii_whitespace()) != Some(b'{') {
            return None;
        }
        let named: Named = Self::deserialize(body).ok()?;
        let (model, model_span) = Self::model_of(named.model, body).ok()?;
        (!model.is_empty()).then(|| Request {
            model,
            model_span,
            ..Request::default()
        })
    }

    /// The `model` a body names, and where its value lies in the body. No model (absent, null
    /// or empty) is the engine's own: vLLM and SGLang then serve the model they were started
    /// with (`Request::model` empty; the gateway works out which).
    fn model_of(
        raw: Option<&serde_json::value::RawValue>,
        body: &str,
    ) -> Result<(String, (usize, usize)), BadRequest> {
        let Some(raw) = raw.filter(|m| m.get() != "null") else {
            return Ok((String::new(), (0, 0)));
        };
        let start = raw.get().as_ptr() as usize - body.as_ptr() as usize;
        let model: String = serde_json::from_str(raw.get()).map_err(|_| {
            bad(
                "request body has an invalid field: `model` must be a string",
                Some("model"),
            )
        })?;
        // Model names key per-VM caches and may appear in a debug header: bound them.
        if model.chars().count() > MAX_MODEL_CHARS {
            return Err(bad(
                format!("`model` is longer than {MAX_MODEL_CHARS} characters"),
                Some("model"),
            ));
        }
        Ok((model, (start, start + raw.get().len())))
    }

    /// The text its prefix is hashed on: all of it, but a batch's first prompt, whose blocks are
    /// the engine's (each prompt of a batch is prefilled on its own, so blocks read across two
    /// of them are in no cache).
    pub fn prefix_text(&self) -> &str {
        self.first_prompt
            .and_then(|end| self.text.get(..end))
            .unwrap_or(&self.text)
    }

    /// The body with its `model` set to `model`, every other byte as the client sent it (so
    /// numbers, key order and spacing are untouched; only the length changes).
    pub fn with_model(&self, body: &[u8], model: &str) -> Vec<u8> {
        let (start, end) = self.model_span;
        let value = serde_json::Value::String(model.to_string()).to_string();
        let mut out = Vec::with_capacity(body.len() + value.len());
        out.extend_from_slice(body.get(..start).unwrap_or_default());
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(body.get(end..).unwrap_or_default());
        out
    }

    fn from_body<S: SystemRule>(
        api: Api,
        b: Body<S>,
        model: String,
        model_span: (usize, usize),
    ) -> Result<Request, BadRequest> {
        let mut out = Request {
            model,
            model_span,
            prompts: 1,
            templated: matches!(api, Api::ChatCompletions | Api::Responses | Api::Messages),
            stream: b.stream.is_some_and(|f| f.0),
            cache_salt: b.cache_salt,
            ..Request::default()
        };
        // The body's room, unless a list took it as it was read (`Rendering::append` then takes
        // the list's rendering whole).
        let mut r = Rendering::new();
        let count = |c: Option<Count>| c.map(|c| c.0);
        let max = match api {
            Api::Completions => match b.max_tokens {
                None => Some(COMPLETIONS_DEFAULT_MAX_TOKENS),
                Some(set) => count(set),
            },
            Api::ChatCompletions => count(b.max_completion_tokens.or(b.max_tokens.flatten())),
            Api::Responses => count(b.max_output_tokens),
            Api::Embeddings | Api::Pooling => Some(0),
            // Required, as Anthropic's API and the engines' models of it require it.
            Api::Messages => match b.max_tokens {
                Some(Some(set)) => Some(set.0),
                _ => return Err(missing("max_tokens")),
            },
            // Their bodies are `from_native`'s and `from_score`'s.
            Api::Generate | Api::Tokens | Api::Score => None,
        };
        if api == Api::Responses {
            out.previous_response = b
                .previous_response_id
                .and_then(|id| serde_json::from_str::<String>(id.get()).ok());
            out.stored = b.store.is_none_or(Flag::on);
        }
        if let Some(tools) = &b.tools {
            r.push_turn("tools", &tools.0);
        }
        let conversation = |turns: Option<Turns<S>>| match turns {
            None => Err(missing("messages")),
            Some(t) if t.count == 0 => Err(bad("`messages` must not be empty", Some("messages"))),
            Some(t) => Ok(t),
        };
        match api {
            Api::Completions => {
                let prompt = b.prompt.ok_or_else(|| missing("prompt"))?;
                out.prompts = out.push_input(&mut r, prompt.0).max(1);
                if let Some(suffix) = &b.suffix {
                    r.text.push_str(suffix.as_str());
                }
            }
            Api::ChatCompletions => r.append(conversation(b.messages)?.rendering),
            Api::Responses => {
                if let Some(instructions) = &b.instructions {
                    r.push_turn("system", instructions.as_str());
                }
                out.push_input(&mut r, b.input.ok_or_else(|| missing("input"))?);
            }
            // vLLM's chat embeddings (`EmbeddingChatRequest`): `messages` in place of `input`,
            // rendered through the model's chat template.
            Api::Embeddings | Api::Pooling => match (b.input, b.messages) {
                (Some(input), _) => _ = out.push_input(&mut r, input),
                (None, Some(messages)) => {
                    out.templated = true;
                    r.append(conversation(Some(messages))?.rendering);
                }
                (None, None) if api == Api::Pooling => return Err(missing("input").of_no_prompt()),
                (None, None) => return Err(missing("input")),
            },
            Api::Messages => {
                let turns = conversation(b.messages)?;
                r.push_system(b.system.as_ref(), &turns.system);
                r.append(turns.rendering);
            }
            Api::Generate | Api::Tokens | Api::Score => {}
        }
        // The Responses and Messages APIs have no `n`: one answer, whatever the body says.
        let n = if matches!(api, Api::Responses | Api::Messages) {
            None
        } else {
            count(b.n)
        };
        let ignore_eos = b.ignore_eos.is_some_and(Flag::on);
        let answers = Answers::of(n, max, ignore_eos, b.min_tokens.and_then(Count::of));
        out.set_answers(answers.times(out.prompts));
        out.set_rendering(r);
        Ok(out)
    }

    /// A body of the engines' native generate APIs: its prompt as the engine takes it (raw
    /// text or ids, no chat template), its answers under their sampling parameters.
    fn from_native(
        api: Api,
        b: NativeBody,
        model: String,
        model_span: (usize, usize),
    ) -> Result<Request, BadRequest> {
        let mut out = Request {
            model,
            model_span,
            stream: b.stream.is_some_and(|f| f.0),
            cache_salt: namespace(
                b.cache_salt.and_then(PerPrompt::first),
                b.extra_key.and_then(PerPrompt::first),
            ),
            adapter: b.lora_path.and_then(PerPrompt::first),
            ..Request::default()
        };
        let mut r = Rendering::new();
        // vLLM's releases stopped at its `SamplingParams` default of 16 without `max_tokens`,
        // its main runs to the context as on its OpenAI paths: read as no limit, the safe side.
        let (prompt, default_max) = match api {
            Api::Tokens => (b.token_ids.ok_or_else(|| missing("token_ids"))?, None),
            // The engine prefills the ids when it is given both.
            _ => (
                b.input_ids
                    .or(b.text)
                    .ok_or_else(|| bad("either `text` or `input_ids` is required", Some("text")))?,
                Some(SGLANG_DEFAULT_MAX_NEW_TOKENS),
            ),
        };
        out.prompts = out.push_input(&mut r, prompt.0).max(1);
        let params = match b.sampling_params {
            Some(set) => set,
            None if api == Api::Tokens => return Err(missing("sampling_params")),
            None => SamplingSet::All(Sampling::default()),
        };
        let all = match &params {
            SamplingSet::All(s) => s
                .answers(s.limit().unwrap_or(default_max))
                .times(out.prompts),
            // One a prompt (the engine refuses a list of another length).
            SamplingSet::Each { limited, defaulted } => {
                limited.and(defaulted.at_default(default_max))
            }
        };
        out.set_answers(all);
        out.set_rendering(r);
        Ok(out)
    }

    /// A score body: each pair a prompt (one query paired with every document, or each query
    /// with its document), refused as the engine refuses pairs of lists of other lengths.
    fn from_score(
        b: ScoreBody,
        model: String,
        model_span: (usize, usize),
    ) -> Result<Request, BadRequest> {
        let first = b.query.or(b.queries).or(b.data_1).or(b.text_1);
        let second = b.documents.or(b.items).or(b.data_2).or(b.text_2);
        let (Some(ones), Some(twos)) = (first, second) else {
            return Err(missing("documents").of_no_prompt());
        };
        // vLLM's `_validate_score_input_lens`, word for word.
        if ones.len() == 0 {
            return Err(bad("At least one text element must be given", None));
        }
        if twos.len() == 0 {
            return Err(bad("At least one text_pair element must be given", None));
        }
        if ones.len() > 1 && ones.len() != twos.len() {
            return Err(bad("Input lengths must be either 1:1, 1:N or N:N", None));
        }
        let mut out = Request {
            model,
            model_span,
            cache_salt: b.cache_salt,
            ..Request::default()
        };
        let mut r = Rendering::new();
        let pairs = twos.len() as u64;
        let mut non_text = ones.non_text_parts.saturating_add(twos.non_text_parts);
        if ones.len() == 1 {
            r.text.push_str(ones.get(0));
            let query_len = r.text.len();
            if pairs > 1 {
                out.first_prompt = Some(query_len + twos.get(0).len());
                out.repeated = Some((query_len, pairs - 1));
                let again = ones.first_non_text_parts.saturating_mul(pairs - 1);
                non_text = non_text.saturating_add(again);
            }
            r.text.push_str(twos.rest(0));
        } else {
            for i in 0..ones.len() {
                if i == 1 {
                    out.first_prompt = Some(r.text.len());
                }
                r.text.push_str(ones.get(i));
                r.text.push_str(twos.get(i));
            }
        }
        r.non_text_parts = non_text;
        out.prompts = pairs;
        out.set_answers(Answers::of(None, Some(0), false, None).times(pairs));
        out.set_rendering(r);
        Ok(out)
    }

    fn set_answers(&mut self, a: Answers) {
        self.choices = a.choices.max(1);
        self.max_output_tokens = a.max;
        self.min_output_tokens = a.min;
    }

    fn set_rendering(&mut self, r: Rendering) {
        self.text = r.text;
        self.opening = r.opening;
        self.non_text_parts = r.non_text_parts;
    }

    /// Adds an input's text or ids to `r`; returns how many prompts it is (a completions batch:
    /// a list of strings, or of lists of ids).
    fn push_input(&mut self, r: &mut Rendering, input: Input) -> u64 {
        match input {
            Input::Text(t) => r.text.push_str(t.as_str()),
            Input::Texts { text, first, count } => {
                if count > 1 {
                    self.first_prompt = Some(r.text.len() + first);
                }
                r.text.push_str(&text);
                return count;
            }
            Input::Tokens { ids, lists, first } => {
                self.token_ids += ids;
                if r.text.is_empty() {
                    self.ids = first.bytes;
                }
                return lists;
            }
            Input::Ids(ids) => {
                self.token_ids += ids.count;
                if r.text.is_empty() {
                    self.ids = ids.bytes;
                }
            }
            Input::Items(items) => r.append(items.rendering),
        }
        1
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    fn chat(body: &str) -> Result<Request, BadRequest> {
        Request::parse(Api::ChatCompletions, body.as_bytes())
    }

    /// Chat and responses prompts go through the model's chat template; completions and
    /// embeddings inputs are taken as they are.
    #[test]
    fn templated_prompts_are_those_of_chat_and_responses() {
        for (api, body, templated) in [
            (
                Api::ChatCompletions,
                r#"{"messages":[{"role":"user","content":"hi"}]}"#,
                true,
            ),
            (Api::Responses, r#"{"input":"hi"}"#, true),
            (Api::Completions, r#"{"prompt":"hi"}"#, false),
            (Api::Embeddings, r#"{"input":"hi"}"#, false),
            (
                Api::Embeddings,
                r#"{"messages":[{"role":"user","content":"hi"}]}"#,
                true,
            ),
        ] {
            let req = Request::parse(api, body.as_bytes()).unwrap();
            assert_eq!(req.templated, templated, "{api:?}");
        }
    }

    /// vLLM's other pooling endpoints, at the root as it serves them: read as the embeddings
    /// are; other servers' paths that end alike are not theirs.
    #[test]
    fn score_paths_read_every_form_of_vllms_pairs() {
        for path in [
            "/score",
            "/v1/score",
            "/rerank/",
            "/v1/rerank",
            "/v2/rerank",
            "/jina/v1/rerank",
        ] {
            assert_eq!(Api::from_path(path), Some(Api::Score), "{path}");
        }
        for other in ["/api/score", "/score/x", "/x/rerank"] {
            assert_eq!(Api::from_path(other), None, "{other}");
        }
        let parse = |body: &str| Request::parse(Api::Score, body.as_bytes());
        // A rerank: the query once in the text, paired again with each document after the first.
        let r =
            parse(r#"{"model":"r","query":"qq","documents":["d1","d2","d3"],"top_n":1}"#).unwrap();
        assert_eq!(r.text, "qqd1d2d3");
        assert_eq!((r.prompts, r.choices, r.max_output_tokens), (3, 3, Some(0)));
        assert_eq!((r.prefix_text(), r.repeated), ("qqd1", Some((2, 2))));
        // Each of vLLM's score forms, 1:1 and N:N.
        for body in [
            r#"{"queries":["q1","q2"],"documents":["d1","d2"]}"#,
            r#"{"queries":["q1","q2"],"items":["d1","d2"]}"#,
            r#"{"data_1":["q1","q2"],"data_2":["d1","d2"]}"#,
            r#"{"text_1":["q1","q2"],"text_2":["d1","d2"]}"#,
        ] {
            let r = parse(body).unwrap();
            assert_eq!(
                (r.text.as_str(), r.prefix_text(), r.prompts),
                ("q1d1q2d2", "q1d1", 2)
            );
            assert_eq!(r.repeated, None, "{body}");
        }
        let r = parse(r#"{"text_1":"q","text_2":"d","cache_salt":"t"}"#).unwrap();
        assert_eq!((r.text.as_str(), r.prompts, r.repeated), ("qd", 1, None));
        assert_eq!(r.cache_salt.as_deref(), Some("t"));
        // Images counted as parts, the query's once for each pair.
        let r = parse(
            r#"{"query":{"content":[{"type":"image_url","image_url":{"url":"u"}}]},
            "documents":["a",{"content":[{"type":"text","text":"b"}]}]}"#,
        )
        .unwrap();
        assert_eq!((r.text.as_str(), r.non_text_parts, r.prompts), ("ab", 2, 2));
        // Refused as the engine refuses them.
        for (body, message) in [
            (
                r#"{"queries":["a","b"],"documents":["c","d","e"]}"#,
                "1:1, 1:N or N:N",
            ),
            (
                r#"{"queries":[],"documents":["c"]}"#,
                "At least one text element",
            ),
            (
                r#"{"query":"a","documents":[]}"#,
                "At least one text_pair element",
            ),
            (r#"{"query":"a","documents":[5]}"#, "documents"),
        ] {
            let e = parse(body).unwrap_err();
            assert!(
                e.message.contains(message) && !e.names_no_prompt(),
                "{body}: {e}"
            );
        }
        // Without both sides it is not a score body of vLLM's (Hugging Face TEI's `/rerank`
        // takes `texts`): left unread.
        for body in [
            r#"{"model":"r","query":"a","texts":["b"]}"#,
            r#"{"documents":["b"]}"#,
        ] {
            assert!(parse(body).unwrap_err().names_no_prompt(), "{body}");
        }
    }

    #[test]
    fn pooling_paths_match_whole() {
        assert_eq!(Api::from_path("/classify"), Some(Api::Embeddings));
        assert_eq!(Api::from_path("/pooling/?x=1"), Some(Api::Pooling));
        for other in ["/api/classify", "/v1/pooling", "/classify/x"] {
            assert_eq!(Api::from_path(other), None, "{other}");
        }
        // An IO processor plugin's body names no prompt; one that names a bad one is refused.
        let e = Request::parse(Api::Pooling, br#"{"model":"p","data":{"url":"x"}}"#).unwrap_err();
        assert!(e.names_no_prompt());
        let e = Request::parse(Api::Pooling, br#"{"model":"p","input":3}"#).unwrap_err();
        assert!(!e.names_no_prompt());
        let r = Request::parse(
            Api::Pooling,
            br#"{"model":"p","input":[[1,2,3]],"task":"token_classify"}"#,
        );
        assert_eq!(
            r.map(|r| (r.token_ids, r.max_output_tokens)),
            Ok((3, Some(0)))
        );
    }

    #[test]
    fn paths_match_by_suffix() {
        assert_eq!(
            Api::from_path("/v1/chat/completions"),
            Some(Api::ChatCompletions)
        );
        assert_eq!(
            Api::from_path("/team-a/openai/v1/chat/completions?x=1"),
            Some(Api::ChatCompletions)
        );
        assert_eq!(Api::from_path("/v1/completions/"), Some(Api::Completions));
        assert_eq!(Api::from_path("/v1/responses"), Some(Api::Responses));
        assert_eq!(Api::from_path("/v1/embeddings"), Some(Api::Embeddings));
        assert_eq!(Api::from_path("/v1/models"), None);
        assert_eq!(Api::from_path("/v1/completions/render"), None);
        assert_eq!(Api::from_path("/"), None);
    }

    /// A part whose text field is there but empty is text (none), not a media part: as before
    /// the Messages API's blocks were read.
    #[test]
    fn an_empty_text_part_is_no_media() {
        let r = chat(r#"{"messages":[{"role":"user","content":[{"type":"text","text":""},{"type":"text","text":"hi"}]}]}"#)
            .unwrap();
        assert_eq!((r.non_text_parts, r.text.as_str()), (0, "<user>\nhi\n"));
    }

    #[test]
    fn chat_with_string_and_part_contents() {
        let r = chat(
            r#"{"model":"m","messages":[
                {"role":"system","content":"Be brief."},
                {"role":"user","content":[{"type":"text","text":"What is "},
                  {"type":"image_url","image_url":{"url":"data:..."}},{"type":"text","text":"this?"}]}],
              "max_completion_tokens":50,"stream":true,"stream_options":{"include_usage":true},
              "user":"u1","temperature":0.2}"#,
        )
        .unwrap();
        assert_eq!(r.model, "m");
        assert_eq!(r.text, "<system>\nBe brief.\n<user>\nWhat is this?\n");
        assert_eq!(r.non_text_parts, 1);
        assert_eq!(r.max_output_tokens, Some(50));
        assert!(r.stream);
    }

    /// A body the engine serves is served: its counts and flags as vLLM's pydantic models read
    /// them (a float with no fraction, a string of digits, a flag's word), and refused, naming
    /// the field, only where the engine refuses them too.
    #[test]
    fn counts_and_flags_are_read_as_the_engines_read_them() {
        let msgs = r#""messages":[{"role":"user","content":"x"}]"#;
        let chat = |extra: &str| chat(&format!(r#"{{"model":"m",{msgs},{extra}}}"#));
        let r = chat(r#""max_tokens":100.0,"n":"2","stream":"true""#).unwrap();
        assert_eq!(
            (r.max_output_tokens, r.choices, r.stream),
            (Some(200), 2, true)
        );
        let r = chat(r#""max_completion_tokens":" 1_000 ","stream":0"#).unwrap();
        assert_eq!((r.max_output_tokens, r.stream), (Some(1000), false));
        let r = chat(r#""stream_options":{"include_usage":"yes"},"min_tokens":"20""#).unwrap();
        assert_eq!(r.min_output_tokens, 20);
        let r = Request::parse(
            Api::Completions,
            br#"{"model":"m","prompt":"x","max_tokens":"64","n":1.0}"#,
        )
        .unwrap();
        assert_eq!((r.max_output_tokens, r.choices), (Some(64), 1));
        let r = Request::parse(
            Api::Responses,
            br#"{"model":"m","input":"x","max_output_tokens":"9","store":"off"}"#,
        )
        .unwrap();
        assert_eq!((r.max_output_tokens, r.stored), (Some(9), false));
        for (extra, param) in [
            (r#""max_tokens":100.5"#, "max_tokens"),
            (r#""max_tokens":"lots""#, "max_tokens"),
            (r#""max_completion_tokens":-5"#, "max_completion_tokens"),
            (r#""n":"2.5""#, "n"),
            (r#""stream":"maybe""#, "stream"),
        ] {
            let e = chat(extra).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{extra}: {}", e.message);
        }
    }

    /// The opening is what the application sends every time: tools, then system and developer
    /// turns until the first other one; never a user's words, never a turn after them.
    #[test]
    fn the_opening_is_the_tools_and_instructions_before_the_conversation() {
        let opening = |api, body: &str| {
            let r = Request::parse(api, body.as_bytes()).unwrap();
            r.text[..r.opening].to_string()
        };
        let chat = |body| opening(Api::ChatCompletions, body);
        assert_eq!(
            chat(
                r#"{"messages":[{"role":"system","content":"Be brief."},{"role":"developer","content":"JSON."},{"role":"user","content":"q"},{"role":"system","content":"later"}]}"#
            ),
            "<system>\nBe brief.\n<developer>\nJSON.\n"
        );
        assert_eq!(
            chat(r#"{"tools":[{"type":"function"}],"messages":[{"role":"user","content":"q"}]}"#),
            "<tools>\n[{\"type\":\"function\"}]\n"
        );
        assert_eq!(
            chat(r#"{"messages":[{"role":"user","content":"q"},{"role":"system","content":"s"}]}"#),
            ""
        );
        assert_eq!(
            opening(
                Api::Responses,
                r#"{"instructions":"Be kind.","input":"hi"}"#
            ),
            "<system>\nBe kind.\n"
        );
        assert_eq!(
            opening(
                Api::Responses,
                r#"{"input":[{"role":"developer","content":"d"},{"role":"user","content":"u"}]}"#
            ),
            "<developer>\nd\n"
        );
        assert_eq!(
            opening(
                Api::Completions,
                r#"{"prompt":"Instructions: classify. Text: x"}"#
            ),
            ""
        );
    }

    #[test]
    fn a_rename_rewrites_only_the_model_value() {
        let body = r#"{"messages":[{"role":"user","content":"\"model\": x"}], "model" : "pub\u00e9lic","temperature":0.10000000000000001}"#;
        let r = chat(body).unwrap();
        assert_eq!(r.model, "pubélic");
        let out = r.with_model(body.as_bytes(), "tgt \"v2\"");
        let expected = body.replace(r#""pub\u00e9lic""#, r#""tgt \"v2\"""#);
        assert_eq!(String::from_utf8(out.clone()).unwrap(), expected);
        assert_eq!(
            chat(std::str::from_utf8(&out).unwrap()).unwrap().model,
            "tgt \"v2\""
        );
        let e = Request::parse(Api::Completions, br#"{"model":7,"prompt":"x"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("model"));
        // No model is the engine's own, as vLLM and SGLang take it.
        for none in [
            r#"{"prompt":"x"}"#,
            r#"{"model":null,"prompt":"x"}"#,
            r#"{"model":"","prompt":"x"}"#,
        ] {
            let r = Request::parse(Api::Completions, none.as_bytes()).unwrap();
            assert_eq!((r.model.as_str(), r.text.as_str()), ("", "x"), "{none}");
        }
    }

    /// `ignore_eos` holds the answer to its whole limit and `min_tokens` to a floor, each choice;
    /// a value of another type is read as the engines' lax parsing reads it, or left to them,
    /// never refused here.
    #[test]
    fn ignore_eos_and_min_tokens_set_the_answer_s_floor() {
        let floor = |extra: &str| {
            chat(&format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"max_tokens":300{extra}}}"#
            ))
            .map(|r| r.min_output_tokens)
        };
        assert_eq!(floor(""), Ok(0));
        assert_eq!(floor(r#","ignore_eos":true"#), Ok(u64::MAX));
        assert_eq!(floor(r#","ignore_eos":"True""#), Ok(u64::MAX));
        assert_eq!(floor(r#","ignore_eos":false,"min_tokens":20"#), Ok(20));
        assert_eq!(floor(r#","min_tokens":20,"n":3"#), Ok(60));
        assert_eq!(floor(r#","ignore_eos":null,"min_tokens":"x""#), Ok(0));
        assert_eq!(floor(r#","ignore_eos":{},"min_tokens":-1"#), Ok(0));
    }

    /// A Responses API request is stored unless it says not, and a follow-up names the response
    /// it continues; other APIs store nothing.
    #[test]
    fn a_responses_follow_up_names_its_previous_response() {
        let p = |api, s: &str| Request::parse(api, s.as_bytes()).unwrap();
        let r = p(
            Api::Responses,
            r#"{"model":"m","input":"more","previous_response_id":"resp_1"}"#,
        );
        assert_eq!(
            (r.previous_response.as_deref(), r.stored),
            (Some("resp_1"), true)
        );
        let off = p(Api::Responses, r#"{"model":"m","input":"x","store":false}"#);
        assert_eq!((off.previous_response, off.stored), (None, false));
        let chat = p(
            Api::ChatCompletions,
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"previous_response_id":"resp_1"}"#,
        );
        assert_eq!((chat.previous_response, chat.stored), (None, false));
    }

    #[test]
    fn later_turns_extend_earlier_ones() {
        let one = chat(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#).unwrap();
        let two = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"},
               {"role":"assistant","content":"hello"},{"role":"user","content":"more"}]}"#,
        )
        .unwrap();
        assert!(two.text.starts_with(&one.text));
    }

    fn messages(body: &str) -> Result<Request, BadRequest> {
        Request::parse(Api::Messages, body.as_bytes())
    }

    /// An Anthropic Messages request reads as the engine renders it (vLLM's
    /// `anthropic/serving.py`): one system turn first (the top-level `system`, then the system
    /// messages', Claude Code's attribution block dropped), each block's text where the engine
    /// finds it, a tool result's own blocks, and the dropped blocks neither text nor media.
    #[test]
    fn an_anthropic_messages_request_reads_as_the_engine_renders_it() {
        let r = messages(
            r#"{"model":"m","max_tokens":100,"stream":true,
              "system":[{"type":"text","text":"x-anthropic-billing-header: cc_version=2.1; cch=9f3e;"},
                        {"type":"text","text":"You are terse.","cache_control":{"type":"ephemeral"}}],
              "tools":[{"name":"f","input_schema":{"type":"object"}}],
              "messages":[
                {"role":"user","content":"hi"},
                {"role":"system","content":" Also kind."},
                {"role":"assistant","content":[
                  {"type":"thinking","thinking":"hmm","signature":"s"},
                  {"type":"redacted_thinking","data":"opaque"},
                  {"type":"text","text":"Let me look."},
                  {"type":"tool_use","id":"toolu_1","name":"f","input":{"q":1}}]},
                {"role":"user","content":[
                  {"type":"tool_result","tool_use_id":"toolu_1",
                   "content":[{"type":"text","text":"42"},{"type":"image","source":{"type":"url","url":"u"}}]},
                  {"type":"text","text":"thanks"}]}]}"#,
        )
        .unwrap();
        // JSON compact, keys in the client's order, as transformers' `tojson` renders them.
        let tools = r#"<tools>
[{"name":"f","input_schema":{"type":"object"}}]
"#;
        let opening = format!("{tools}<system>\nYou are terse. Also kind.\n");
        assert_eq!(
            r.text,
            format!(
                "{opening}<user>\nhi\n<assistant>\nhmmLet me look.f{{\"q\":1}}\n<user>\n42thanks\n"
            )
        );
        assert_eq!(r.opening, opening.len());
        assert_eq!(r.non_text_parts, 1);
        assert_eq!(r.max_output_tokens, Some(100));
        assert_eq!((r.choices, r.prompts), (1, 1));
        assert!(r.templated && r.stream);
        // The next turn extends this one's text, whatever its attribution block says.
        let next = messages(
            r#"{"model":"m","max_tokens":100,"system":"You are terse.",
              "messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"hello"},
                          {"role":"user","content":"more"}]}"#,
        )
        .unwrap();
        let first = messages(
            r#"{"model":"m","max_tokens":5,"n":3,"system":[
                {"type":"text","text":"x-anthropic-billing-header: cch=0000;"},
                {"type":"text","text":"You are terse."}],
              "messages":[{"role":"user","content":"hi"}]}"#,
        )
        .unwrap();
        assert!(next.text.starts_with(&first.text), "{first:?}");
        // No `n` in this API: one answer.
        assert_eq!(first.max_output_tokens, Some(5));
        assert_eq!(first.choices, 1);
    }

    /// SGLang's `/generate` (only as the whole path) and vLLM's `/inference/v1/generate` (by
    /// suffix, as the OpenAI paths).
    #[test]
    fn the_engines_generate_paths_are_known() {
        assert_eq!(Api::from_path("/generate"), Some(Api::Generate));
        assert_eq!(Api::from_path("/generate/?x=1"), Some(Api::Generate));
        assert_eq!(Api::from_path("/api/generate"), None);
        assert_eq!(Api::from_path("/inference/v1/generate"), Some(Api::Tokens));
        assert_eq!(
            Api::from_path("/pool-a/inference/v1/generate"),
            Some(Api::Tokens)
        );
    }

    /// SGLang's `/generate`: a raw prompt of text or ids (no template, no model), its limits
    /// and answers in `sampling_params` (one for all prompts of a batch, or one each), 128
    /// tokens when it names none and the context when it names null.
    #[test]
    fn an_sglang_generate_request_is_read_as_sglang_reads_it() {
        let p = |s: &str| Request::parse(Api::Generate, s.as_bytes());
        let r = p(r#"{"model":"m","text":"Hello world","sampling_params":{"max_new_tokens":64,"n":2,"temperature":0.7},"stream":true,"rid":"r1"}"#).unwrap();
        assert_eq!(
            (r.model.as_str(), r.text.as_str(), r.templated, r.stream),
            ("", "Hello world", false, true)
        );
        assert_eq!((r.choices, r.max_output_tokens), (2, Some(128)));
        assert_eq!(p(r#"{"text":"x"}"#).unwrap().max_output_tokens, Some(128));
        let unbounded = p(r#"{"text":"x","sampling_params":{"max_new_tokens":null}}"#).unwrap();
        assert_eq!(unbounded.max_output_tokens, None);
        let batch =
            p(r#"{"text":["ab","c","d"],"sampling_params":{"max_new_tokens":10}}"#).unwrap();
        assert_eq!(
            (batch.prompts, batch.choices, batch.max_output_tokens),
            (3, 3, Some(30))
        );
        assert_eq!(batch.prefix_text(), "ab");
        let each = p(r#"{"input_ids":[[1,2],[3,4,5]],"sampling_params":[{"max_new_tokens":5},{"max_new_tokens":7,"n":2,"min_new_tokens":3}]}"#).unwrap();
        assert_eq!((each.token_ids, each.prompts, each.choices), (5, 2, 3));
        assert_eq!(
            (each.max_output_tokens, each.min_output_tokens),
            (Some(19), 6)
        );
        let ids = p(r#"{"input_ids":[7,8,9],"sampling_params":{"ignore_eos":true}}"#).unwrap();
        assert_eq!((ids.token_ids, ids.ids.len()), (3, 12));
        assert_eq!(ids.min_output_tokens, u64::MAX);
        let e = p(r#"{"sampling_params":{}}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("text"));
        let e = p(r#"{"text":"x","sampling_params":{"max_new_tokens":"lots"}}"#).unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("sampling_params.max_new_tokens"),
            "{}",
            e.message
        );
        // A prompt whose parameters set no limit runs to the API's default.
        let mixed =
            r#"{"input_ids":[[1],[2],[3]],"sampling_params":[{"max_new_tokens":5},{},{"n":2}]}"#;
        let mixed = p(mixed).unwrap();
        assert_eq!(
            (mixed.choices, mixed.max_output_tokens),
            (4, Some(5 + 128 * 3))
        );
        let tokens = |body: &str| Request::parse(Api::Tokens, body.as_bytes()).unwrap();
        let vllm = tokens(r#"{"token_ids":[1],"sampling_params":[{"max_tokens":5},{}]}"#);
        assert_eq!((vllm.choices, vllm.max_output_tokens), (2, None));
        let vllm = tokens(r#"{"token_ids":[1],"sampling_params":[{"max_tokens":5}]}"#);
        assert_eq!((vllm.choices, vllm.max_output_tokens), (1, Some(5)));
    }

    /// SGLang's cache namespace and adapter, as its `/generate` takes them: `cache_salt`,
    /// `extra_key` and `lora_path` each a string or one a prompt of a batch (the first prompt's
    /// read, which the batch is routed by), an empty one none.
    #[test]
    fn an_sglang_generate_requests_cache_namespace_and_adapter_are_read() {
        let p = |s: &str| Request::parse(Api::Generate, s.as_bytes()).unwrap();
        let salted = p(r#"{"text":"x","cache_salt":"t1"}"#);
        assert_eq!(salted.cache_salt.as_deref(), Some("t1"));
        // A batch's salts and keys, one a prompt (refused before as not a string).
        let batch = p(
            r#"{"text":["a","b"],"cache_salt":["t1","t2"],"extra_key":["k",null],"lora_path":["sql",null]}"#,
        );
        let keyed = batch.cache_salt.as_deref();
        assert!(
            keyed.is_some_and(|k| k != "t1" && k.starts_with("t1")),
            "{keyed:?}"
        );
        assert_eq!(batch.adapter.as_deref(), Some("sql"));
        // A key alone, a salt alone and both are three namespaces.
        let key = p(r#"{"text":"x","extra_key":"t1"}"#).cache_salt;
        let both = p(r#"{"text":"x","cache_salt":"t1","extra_key":"t1"}"#).cache_salt;
        assert!(
            key.is_some() && key != salted.cache_salt && both != key && both != salted.cache_salt
        );
        let none = p(r#"{"text":"x","cache_salt":"","extra_key":"","lora_path":""}"#);
        assert_eq!((none.cache_salt, none.adapter), (None, None));
        for field in ["cache_salt", "extra_key", "lora_path"] {
            let body = format!(r#"{{"text":"x","{field}":7}}"#);
            let e = Request::parse(Api::Generate, body.as_bytes()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{}", e.message);
        }
    }

    /// vLLM's `/inference/v1/generate`: `token_ids` and `sampling_params` required, no limit
    /// but the context when no `max_tokens` is given (vLLM's main; its releases stopped at 16).
    #[test]
    fn a_vllm_tokens_request_is_read_as_vllm_reads_it() {
        let p = |s: &str| Request::parse(Api::Tokens, s.as_bytes());
        let r = p(r#"{"model":"m","token_ids":[1,2,3],"sampling_params":{"max_tokens":8,"min_tokens":2,"n":3},"stream":true,"cache_salt":"s"}"#).unwrap();
        assert_eq!(
            (r.model.as_str(), r.token_ids, r.ids.len(), r.stream),
            ("m", 3, 12, true)
        );
        assert_eq!(
            (r.choices, r.max_output_tokens, r.min_output_tokens),
            (3, Some(24), 6)
        );
        assert_eq!(r.cache_salt.as_deref(), Some("s"));
        let out = r.with_model(br#"{"model":"m","token_ids":[1]}"#, "t");
        assert_eq!(out, br#"{"model":"t","token_ids":[1]}"#);
        let default = p(r#"{"token_ids":[1],"sampling_params":{}}"#).unwrap();
        assert_eq!(
            (default.model.as_str(), default.max_output_tokens),
            ("", None)
        );
        let null = p(r#"{"token_ids":[1],"sampling_params":{"max_tokens":null}}"#).unwrap();
        assert_eq!(null.max_output_tokens, None);
        for (body, param) in [
            (r#"{"sampling_params":{}}"#, "token_ids"),
            (r#"{"token_ids":[1]}"#, "sampling_params"),
        ] {
            assert_eq!(p(body).unwrap_err().param.as_deref(), Some(param), "{body}");
        }
    }

    /// `max_tokens` is required, as the engines' models of the API require it; so are the
    /// messages.
    #[test]
    fn an_anthropic_messages_request_needs_its_max_tokens_and_messages() {
        for (body, param) in [
            (
                r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
                "max_tokens",
            ),
            (
                r#"{"model":"m","max_tokens":null,"messages":[{"role":"user","content":"hi"}]}"#,
                "max_tokens",
            ),
            (r#"{"model":"m","max_tokens":9}"#, "messages"),
            (r#"{"model":"m","max_tokens":9,"messages":[]}"#, "messages"),
        ] {
            let e = messages(body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
        assert_eq!(Api::from_path("/v1/messages"), Some(Api::Messages));
        assert_eq!(
            Api::from_path("/anthropic/v1/messages?beta=true"),
            Some(Api::Messages)
        );
        // Counting tokens generates nothing: it passes through.
        assert_eq!(Api::from_path("/v1/messages/count_tokens"), None);
    }

    #[test]
    fn completions_prompt_shapes() {
        let p = |s: &str| Request::parse(Api::Completions, s.as_bytes()).unwrap();
        assert_eq!(p(r#"{"model":"m","prompt":"abc"}"#).text, "abc");
        assert_eq!(p(r#"{"model":"m","prompt":["ab","cd"]}"#).text, "abcd");
        let ids = p(r#"{"model":"m","prompt":[1,2,3]}"#);
        assert_eq!(
            (ids.token_ids, ids.ids.len(), ids.text.as_str()),
            (3, 12, "")
        );
        // A batch of lists keeps its first list, whose prefix it is routed by.
        let batch = p(r#"{"model":"m","prompt":[[1,2],[3]]}"#);
        assert_eq!((batch.token_ids, batch.ids.len()), (3, 8));
        let r = p(r#"{"model":"m","prompt":"x","max_tokens":7,"n":3}"#);
        assert_eq!((r.max_output_tokens, r.choices), (Some(21), 3));
        // Without `max_tokens`, the engine stops at 16 tokens an answer; with it null, at the
        // model's length (vLLM).
        let one = p(r#"{"model":"m","prompt":"x"}"#);
        assert_eq!((one.max_output_tokens, one.choices), (Some(16), 1));
        let three = p(r#"{"model":"m","prompt":"x","n":3}"#);
        assert_eq!(three.max_output_tokens, Some(48));
        let null = p(r#"{"model":"m","prompt":"x","max_tokens":null}"#);
        assert_eq!(null.max_output_tokens, None);
        // A chat's absent or null `max_tokens` is no limit alike.
        let chat = |s: &str| Request::parse(Api::ChatCompletions, s.as_bytes()).unwrap();
        let msgs = r#""messages":[{"role":"user","content":"x"}]"#;
        assert_eq!(
            chat(&format!(r#"{{"model":"m",{msgs}}}"#)).max_output_tokens,
            None
        );
        let null = chat(&format!(r#"{{"model":"m",{msgs},"max_tokens":null}}"#));
        assert_eq!(null.max_output_tokens, None);
        let set = chat(&format!(r#"{{"model":"m",{msgs},"max_tokens":5}}"#));
        assert_eq!(set.max_output_tokens, Some(5));
        // A batch of prompts: each prefilled and answered on its own, `n` answers each.
        // Its prefix is its first prompt's, which the engine prefills as it is.
        let batch = p(r#"{"model":"m","prompt":["ab","cd","ef"],"max_tokens":10,"n":2}"#);
        assert_eq!(
            (batch.prompts, batch.choices, batch.max_output_tokens),
            (3, 6, Some(60))
        );
        assert_eq!((batch.text.as_str(), batch.prefix_text()), ("abcdef", "ab"));
        let ids = p(r#"{"model":"m","prompt":[[1,2],[3]],"max_tokens":5,"min_tokens":2}"#);
        assert_eq!(
            (
                ids.prompts,
                ids.choices,
                ids.max_output_tokens,
                ids.min_output_tokens
            ),
            (2, 2, Some(10), 4)
        );
        assert_eq!(ids.ids, [1, 0, 0, 0, 2, 0, 0, 0]);
        let one = p(r#"{"model":"m","prompt":["ab"],"max_tokens":10}"#);
        assert_eq!((one.prompts, one.max_output_tokens), (1, Some(10)));
        assert_eq!(one.prefix_text(), "ab");
        assert_eq!(p(r#"{"model":"m","prompt":[1,2]}"#).prompts, 1);
        assert_eq!(p(r#"{"model":"m","prompt":"x","n":0}"#).choices, 1);
        let many = p(r#"{"model":"m","prompt":"x","max_tokens":2,"n":18446744073709551615}"#);
        assert_eq!(
            (many.choices, many.max_output_tokens),
            (16_384, Some(32_768))
        );
    }

    #[test]
    fn responses_and_embeddings() {
        let r = Request::parse(
            Api::Responses,
            br#"{"model":"m","instructions":"sys","input":[{"role":"user","content":[{"type":"input_text","text":"q"}]},
                {"type":"function_call_output","call_id":"c","output":"42"}],"max_output_tokens":9,"n":3}"#,
        )
        .unwrap();
        assert_eq!(
            r.text,
            "<system>\nsys\n<user>\nq\n<function_call_output>\n42\n"
        );
        assert_eq!(
            (r.max_output_tokens, r.choices),
            (Some(9), 1),
            "no `n` there"
        );
        let r = Request::parse(Api::Responses, br#"{"model":"m","input":"plain"}"#).unwrap();
        assert_eq!(r.text, "plain");
        let r = Request::parse(Api::Embeddings, br#"{"model":"e","input":["a","b"]}"#).unwrap();
        assert_eq!(r.text, "ab");
        assert_eq!(r.max_output_tokens, Some(0));
        // vLLM's chat embeddings: the conversation as a chat request's, nothing to answer.
        let body = br#"{"model":"e","messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"q"}]}],"encoding_format":"base64"}"#;
        let r = Request::parse(Api::Embeddings, body).unwrap();
        let c = chat(r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"q"}]}]}"#).unwrap();
        assert_eq!(
            (r.text.as_str(), r.max_output_tokens),
            (c.text.as_str(), Some(0))
        );
        // `input` is the completion form's, whatever else the body carries (vLLM tries it first).
        let r = Request::parse(
            Api::Embeddings,
            br#"{"input":"i","messages":[{"role":"user","content":"m"}]}"#,
        )
        .unwrap();
        assert_eq!((r.text.as_str(), r.templated), ("i", false));
        for (body, param) in [
            (&br#"{"messages":[]}"#[..], "messages"),
            (br#"{"model":"e"}"#, "input"),
        ] {
            let e = Request::parse(Api::Embeddings, body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param));
        }
    }

    #[test]
    fn unicode_and_escapes_decode() {
        let r = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"caf\u00e9 \"q\" 你好 😀"}]}"#,
        )
        .unwrap();
        assert!(r.text.contains("café \"q\" 你好 😀"));
    }

    #[test]
    fn malformed_bodies_are_bad_requests() {
        let long_model = format!(
            r#"{{"model":"{}","messages":[{{"role":"user","content":"x"}}]}}"#,
            "m".repeat(257)
        );
        let cases: &[(&str, Option<&str>)] = &[
            ("", None),
            ("{", None),
            ("not json", None),
            ("[]", None),
            (r#"{"model":"m"}"#, Some("messages")),
            (r#"{"model":"m","messages":[]}"#, Some("messages")),
            (r#"{"model":"m","messages":"hi"}"#, Some("messages")),
            (
                r#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
                Some("messages[0].content"),
            ),
            (&long_model, Some("model")),
            (r#"{"model":7,"messages":[]}"#, Some("model")),
            (
                r#"{"model":"m","messages":[],"max_tokens":-1}"#,
                Some("max_tokens"),
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}]} trailing"#,
                None,
            ),
        ];
        for (body, param) in cases {
            let err = chat(body).expect_err(body);
            assert_eq!(err.param.as_deref(), *param, "{body}: {err}");
        }
        let err = Request::parse(Api::ChatCompletions, b"{\"model\":\"\xff\"}").unwrap_err();
        assert!(err.message.contains("UTF-8"));
    }

    #[test]
    fn a_prompt_of_the_wrong_shape_names_the_element_at_fault() {
        for (api, body, param) in [
            (
                Api::Completions,
                r#"{"model":"m","prompt":["a",1]}"#,
                "prompt[1]",
            ),
            (
                Api::Completions,
                r#"{"model":"m","prompt":[{"a":1}]}"#,
                "prompt[0]",
            ),
            (
                Api::Completions,
                r#"{"model":"m","prompt":[1,-1]}"#,
                "prompt[1]",
            ),
            (
                Api::Responses,
                r#"{"model":"m","input":[[1],[2,"a"]]}"#,
                "input[1][1]",
            ),
            (Api::Embeddings, r#"{"model":"m","input":true}"#, "input"),
            (
                Api::Responses,
                r#"{"model":"m","input":[{"role":"user","content":5}]}"#,
                "input[0].content",
            ),
            (
                Api::Responses,
                r#"{"model":"m","input":[{"role":"user"},{"content":[{"text":1}]}]}"#,
                "input[1].content[0].text",
            ),
        ] {
            let err = Request::parse(api, body.as_bytes()).expect_err(body);
            assert_eq!(err.param.as_deref(), Some(param), "{body}: {err}");
        }
    }

    /// Refused at serde_json's depth limit, whether read part by part (content) or kept as
    /// written (`tools`, `tool_calls`), and without recursion.
    #[test]
    fn deeply_nested_json_is_refused_not_overflowed() {
        let tools = |open: &str, close: &str, times| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"tools":{}0{}}}"#,
                open.repeat(times),
                close.repeat(times)
            )
        };
        assert!(chat(&tools("[", "]", 100_000)).is_err());
        assert!(chat(&tools(r#"{"a":"#, "}", 129)).is_err());
        assert!(chat(&tools(r#"{"a":["#, "]}", 64)).is_ok());
        // Brackets inside strings are text.
        assert!(chat(&tools(r#"["[{\"\\[","#, "]", 128)).is_ok());
        assert!(chat(&tools(r#"["[{\"\\[","#, "]", 129)).is_err());
        let deep = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":{}"x"{}}}]}}"#,
            r#"[{"content":"#.repeat(100_000),
            "}]".repeat(100_000)
        );
        assert!(chat(&deep).is_err());
        let deep = format!(
            r#"{{"model":"m","messages":[{{"role":"assistant","tool_calls":{}1{}}}]}}"#,
            r#"{"a":"#.repeat(40_000),
            "}".repeat(40_000)
        );
        assert!(chat(&deep).is_err());
    }

    #[test]
    fn huge_prompt_parses() {
        let big = "word ".repeat(200_000);
        let body = format!(r#"{{"model":"m","prompt":"{big}"}}"#);
        let r = Request::parse(Api::Completions, body.as_bytes()).unwrap();
        assert_eq!(r.text.len(), big.len());
    }
}
