//! SGLang's native `POST /generate` as SGLang serves it (its `srt/entrypoints/http_server.py`
//! `generate_request`, `srt/managers/io_struct.py` `GenerateReqInput`,
//! `srt/sampling/sampling_params.py` and `srt/managers/tokenizer_manager.py`). The request runs
//! as a completions request does here (a text prompt tokenized without a chat template, ids taken
//! as they are), so this module owns only the shapes around that path: the request read and
//! normalized as `GenerateReqInput.normalize_batch_and_arguments` does it (into the completions
//! body the path reads, with one sampling object per prompt), the answer objects and their
//! `meta_info`, the streamed chunks, and SGLang's two error shapes.

use std::collections::HashSet;

use serde_json::{json, Map, Value};

use crate::engine::FinishReason;
use crate::lax::{count, flag};

/// `SamplingParams.max_new_tokens` when a prompt's sampling object has none.
pub const DEFAULT_MAX_NEW_TOKENS: usize = 128;

/// `ServerArgs.weight_version`'s default, which every `meta_info` reports.
const WEIGHT_VERSION: &str = "default";

/// How SGLang refuses a request.
#[derive(Debug, PartialEq)]
pub enum Refusal {
    /// FastAPI's validation of the body as a `GenerateReqInput` failed: 400 with SGLang's
    /// `ErrorResponse`, streamed or not (nothing has started).
    Invalid(String),
    /// A `ValueError` while the request is handled: `_create_error_response`'s 400
    /// `{"error": {"message"}}`, or, once a stream has started, an error event in it.
    Value(String),
}

/// The body of a validation refusal (the handler of `RequestValidationError`).
pub fn invalid(message: &str) -> Value {
    json!({"object": "error", "message": message, "type": "Bad Request", "param": null,
           "code": 400})
}

/// The body of a `ValueError`'s refusal (`_create_error_response`).
pub fn error(message: &str) -> Value {
    json!({"error": {"message": message}})
}

/// A stream's answer to a `ValueError`: `stream_results` has already answered 200, so the error
/// goes out as an event, then `[DONE]`.
pub fn error_stream(message: &str) -> Vec<u8> {
    format!("data: {}\n\ndata: [DONE]\n\n", error(message)).into_bytes()
}

/// Whether a body asks for a stream (read loosely: a body whose `stream` pydantic refuses is
/// refused before any stream starts).
pub fn streams(body: &Value) -> bool {
    flag(body.get("stream"), "stream").ok().flatten() == Some(true)
}

/// `lora_path` naming an adapter on a server without `--enable-lora`.
pub fn lora_disabled(name: &str) -> String {
    format!(
        "LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server \
         with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter \
         endpoint."
    )
}

/// `lora_path` naming an adapter that is not loaded (`_resolve_lora_path`), the loaded ones as
/// Python prints a dict's keys.
pub fn lora_unknown(name: &str, loaded: &[String]) -> String {
    format!(
        "Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: dict_keys({}).",
        python_list(loaded)
    )
}

/// A list of strings as Python's `repr` writes it.
fn python_list(items: &[String]) -> String {
    let quoted: Vec<String> = items.iter().map(|s| format!("'{s}'")).collect();
    format!("[{}]", quoted.join(", "))
}

/// The prompt field SGLang reads, with pydantic's types (`text`: a string or a list of them,
/// `input_ids`: a list of ints or of lists of ints).
fn prompt(body: &Value) -> Result<Option<(Value, bool)>, Refusal> {
    let bad =
        |field: &str, kind: &str| Refusal::Invalid(format!("{field}: Input should be {kind}"));
    // `_tokenize_one_request` takes `input_ids` before `text`: with both, the ids are the prompt.
    match body.get("input_ids") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) => {
            let id = |x: &Value| x.as_u64().is_some_and(|n| u32::try_from(n).is_ok());
            let batch = a.first().is_some_and(Value::is_array);
            let typed = if batch {
                a.iter()
                    .all(|p| p.as_array().is_some_and(|p| p.iter().all(id)))
            } else {
                a.iter().all(id)
            };
            if !typed {
                return Err(bad(
                    "input_ids",
                    "a list of token ids or a list of lists of them",
                ));
            }
            let empty = |p: &Value| p.as_array().is_some_and(Vec::is_empty);
            if a.is_empty() || (batch && a.iter().any(empty)) {
                return Err(Refusal::Value("input_ids cannot be empty.".into()));
            }
            return Ok(Some((Value::Array(a.clone()), batch)));
        }
        Some(_) => {
            return Err(bad(
                "input_ids",
                "a list of token ids or a list of lists of them",
            ))
        }
    }
    // `_tokenize_texts` refuses an empty text.
    let empty = || Refusal::Value("texts cannot be empty and tokenizer must be initialized".into());
    match body.get("text") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Err(empty()),
        Some(t @ Value::String(_)) => Ok(Some((t.clone(), false))),
        Some(Value::Array(a)) => {
            if !a.iter().all(Value::is_string) {
                return Err(bad("text", "a valid string or a list of strings"));
            }
            if a.is_empty() || a.iter().any(|t| t.as_str() == Some("")) {
                return Err(empty());
            }
            Ok(Some((Value::Array(a.clone()), true)))
        }
        Some(_) => Err(bad("text", "a valid string or a list of strings")),
    }
}

/// A field that is a string, a list of (optional) strings, or absent, as pydantic types it; one
/// value per prompt of the batch out.
fn per_prompt(body: &Value, field: &str, batch: usize) -> Result<Vec<Value>, Refusal> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(vec![Value::Null; batch]),
        Some(s @ Value::String(_)) => Ok(vec![s.clone(); batch]),
        Some(Value::Array(a)) if a.iter().all(|v| v.is_string() || v.is_null()) => {
            if a.len() != batch {
                return Err(Refusal::Value(format!(
                    "The length of {field} should be equal to the batch size."
                )));
            }
            Ok(a.clone())
        }
        Some(_) => Err(Refusal::Invalid(format!(
            "{field}: Input should be a valid string or a list of strings"
        ))),
    }
}

/// The fields `GenerateReqInput` types `Optional[Union[List[str], str]]` that key a prompt's
/// cached blocks: `extra_key` ("Extra cache key for caller-defined request classification")
/// and `cache_salt`, in the order SGLang normalizes them.
const NAMESPACE_FIELDS: [&str; 2] = ["extra_key", "cache_salt"];

/// Such a field as pydantic types it: absent, null, a string or a list of strings (no nulls).
fn typed_key(body: &Value, field: &str) -> Result<(), Refusal> {
    match body.get(field) {
        None | Some(Value::Null | Value::String(_)) => Ok(()),
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => Ok(()),
        Some(_) => Err(Refusal::Invalid(format!(
            "{field}: Input should be a valid string or a list of strings"
        ))),
    }
}

/// Such a field normalized one a prompt, as `_normalize_single_inputs` does it for one prompt
/// (a string, else "`<field>` should be a string for a single request.") and
/// `_normalize_extra_key` / `_normalize_cache_salt` for a batch (a string for every prompt, or
/// a list of one a prompt); `""` is none.
fn per_prompt_key(
    body: &Value,
    field: &str,
    batch_form: bool,
    batch: usize,
) -> Result<Vec<Value>, Refusal> {
    let none_if_empty = |v: &Value| match v.as_str() {
        Some("") => Value::Null,
        _ => v.clone(),
    };
    match body.get(field) {
        None | Some(Value::Null) => Ok(vec![Value::Null; batch]),
        Some(s @ Value::String(_)) => Ok(vec![none_if_empty(s); batch]),
        Some(Value::Array(_)) if !batch_form => Err(Refusal::Value(format!(
            "{field} should be a string for a single request."
        ))),
        Some(Value::Array(a)) if a.len() == batch && a.iter().all(Value::is_string) => {
            Ok(a.iter().map(none_if_empty).collect())
        }
        Some(Value::Array(a)) if a.len() != batch => Err(Refusal::Value(format!(
            "The length of {field} should be equal to the batch size."
        ))),
        Some(_) => Err(Refusal::Value(format!("Every {field} should be a string."))),
    }
}

/// A number of a sampling object as Python prints it in `SamplingParams.verify`'s messages.
fn shown(v: &Value) -> String {
    v.to_string()
}

/// One prompt's sampling object checked as `SamplingParams.__post_init__` and `verify` check it
/// (nulls are the defaults). Fields the simulator does not model are only checked, not used.
fn verify(sp: &Value) -> Result<(), Refusal> {
    let fail = |m: String| Err(Refusal::Value(m));
    let num = |k: &str| sp.get(k).filter(|v| !v.is_null());
    if let Some(t) = num("temperature") {
        if !t.as_f64().is_some_and(|t| t.is_finite() && t >= 0.0) {
            return fail(format!(
                "temperature must be a non-negative finite number, got {}.",
                shown(t)
            ));
        }
    }
    if let Some(p) = num("top_p") {
        if !p.as_f64().is_some_and(|p| p > 0.0 && p <= 1.0) {
            return fail(format!("top_p must be in (0, 1], got {}.", shown(p)));
        }
    }
    if let Some(p) = num("min_p") {
        if !p.as_f64().is_some_and(|p| (0.0..=1.0).contains(&p)) {
            return fail(format!("min_p must be in [0, 1], got {}.", shown(p)));
        }
    }
    // A top_k of -1 is the whole vocabulary; 0 or below -1 is refused.
    if let Some(k) = num("top_k") {
        if !k.as_i64().is_some_and(|k| k == -1 || k >= 1) {
            return fail(format!(
                "top_k must be -1 (disable) or at least 1, got {}.",
                shown(k)
            ));
        }
    }
    let min = match num("min_new_tokens") {
        Some(v) if v.as_i64().is_some_and(|m| m < 0) => {
            return fail(format!(
                "min_new_tokens must be in [0, max_new_tokens], got {}.",
                shown(v)
            ))
        }
        v => count(v, "min_new_tokens")
            .map_err(Refusal::Value)?
            .unwrap_or(0),
    };
    // The default of 128 applies to the check when the field is absent; null is no limit.
    let max = match sp.get("max_new_tokens") {
        None => Some(DEFAULT_MAX_NEW_TOKENS),
        Some(v) => count(Some(v), "max_new_tokens").map_err(Refusal::Value)?,
    };
    if let Some(max) = max.filter(|&max| min > max) {
        return fail(format!(
            "min_new_tokens must be in [0, max_new_tokens({max})], got {min}."
        ));
    }
    Ok(())
}

/// The request as `normalize_batch_and_arguments` leaves it, in the completions body the
/// simulator's path reads: `prompt` (a string or ids, or a batch of them), `sampling_params`
/// (one object per prompt), `n`, `stream`, and per answer or prompt what SGLang sets per request
/// (`rid`: one per answer, null where SGLang draws a uuid; `lora_path`, and the `cache_salt` and
/// `extra_key` its radix cache keys a prompt's blocks by: one per prompt, null for none).
/// `single` says whether the answer is one object (one prompt, one sample) or a list.
pub fn request(body: &Value) -> Result<Value, Refusal> {
    let stream = flag(body.get("stream"), "stream")
        .map_err(Refusal::Invalid)?
        .unwrap_or(false);
    for field in NAMESPACE_FIELDS {
        typed_key(body, field)?;
    }
    let (prompt, batched) = prompt(body)?.ok_or_else(|| {
        Refusal::Value("Either text, input_ids or input_embeds should be provided.".into())
    })?;
    let batch = if batched {
        prompt.as_array().map_or(1, Vec::len)
    } else {
        1
    };
    let sampling: Vec<Value> = match body.get("sampling_params") {
        None | Some(Value::Null) => vec![json!({}); batch],
        Some(o @ Value::Object(_)) => vec![o.clone(); batch],
        Some(Value::Array(a)) if a.iter().all(Value::is_object) => {
            // A list is one object per prompt; SGLang indexes it by prompt.
            if !batched || a.len() != batch {
                return Err(Refusal::Value(
                    "The length of sampling_params should be equal to the batch size.".into(),
                ));
            }
            a.clone()
        }
        Some(_) => {
            return Err(Refusal::Invalid(
                "sampling_params: Input should be a valid dictionary or a list of them".into(),
            ))
        }
    };
    // `_handle_parallel_sampling`: every prompt's `n` must be the first's.
    let n_of = |sp: &Value| count(sp.get("n"), "n").map(|n| n.unwrap_or(1));
    let mut ns = sampling.iter().map(n_of);
    let n = ns.next().transpose().map_err(Refusal::Value)?.unwrap_or(1);
    for other in ns {
        if other.map_err(Refusal::Value)? != n {
            return Err(Refusal::Value(
                "The parallel_sample_num should be the same for all samples in sample params."
                    .into(),
            ));
        }
    }
    // SGLang runs an `n` below 1 as one sample.
    let n = n.max(1);
    // `n` above 1 makes even one prompt a batch (`_handle_parallel_sampling`).
    let batch_form = batched || n > 1;
    let rids = rids(body.get("rid"), batch_form, batch, n)?;
    let lora = per_prompt(body, "lora_path", batch)?;
    let keys = per_prompt_key(body, "extra_key", batch_form, batch)?;
    let salts = per_prompt_key(body, "cache_salt", batch_form, batch)?;
    for sp in &sampling {
        verify(sp)?;
    }
    let mut out = Map::new();
    out.insert("prompt".into(), prompt);
    out.insert("sampling_params".into(), Value::Array(sampling));
    out.insert("n".into(), json!(n));
    out.insert("stream".into(), json!(stream));
    out.insert("single".into(), json!(!batched && n == 1));
    out.insert("rid".into(), Value::Array(rids));
    out.insert("lora_path".into(), Value::Array(lora));
    out.insert("cache_salt".into(), Value::Array(salts));
    out.insert("extra_key".into(), Value::Array(keys));
    Ok(Value::Object(out))
}

/// Each answer's `rid` (`_normalize_rid`, then `regenerate_rid` for parallel samples): a single
/// request's own, a batch's `<rid>_<i>` or its list's, and null where SGLang draws a uuid (no
/// `rid`, and every sample of an `n` above 1).
fn rids(
    rid: Option<&Value>,
    batch_form: bool,
    batch: usize,
    n: usize,
) -> Result<Vec<Value>, Refusal> {
    let answers = batch * n;
    let given: Vec<Value> = match rid {
        None | Some(Value::Null) => vec![Value::Null; answers],
        Some(Value::String(r)) if !batch_form => vec![json!(r)],
        Some(Value::String(r)) => (0..answers).map(|i| json!(format!("{r}_{i}"))).collect(),
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
            if a.len() != batch {
                return Err(Refusal::Value(
                    "The specified rids length mismatch with the batch_size for batch processing."
                        .into(),
                ));
            }
            let mut seen = HashSet::new();
            let mut dup = Vec::new();
            for r in a.iter().filter_map(Value::as_str) {
                if !seen.insert(r) && !dup.contains(&r.to_string()) {
                    dup.push(r.to_string());
                }
            }
            if !dup.is_empty() {
                return Err(Refusal::Value(format!(
                    "Duplicate request IDs detected within the request: {}",
                    python_list(&dup)
                )));
            }
            a.clone()
        }
        Some(_) => {
            return Err(Refusal::Invalid(
                "rid: Input should be a valid string or a list of strings".into(),
            ))
        }
    };
    // Parallel samples get fresh uuids whatever the request named them.
    Ok(if n > 1 {
        vec![Value::Null; answers]
    } else {
        given
    })
}

/// One answer as SGLang reports it, so far or at its end.
pub struct Answer<'a> {
    pub rid: &'a str,
    /// Its text so far (SGLang streams the whole text, not a delta) and its token ids so far.
    pub text: &'a str,
    pub ids: &'a [u32],
    pub finish: Option<FinishReason>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    pub retractions: u32,
    /// Seconds from the request's arrival to the answer's end (its end only).
    pub e2e_latency: Option<f64>,
    /// When the answer's first output went out (`response_sent_to_client_ts`, once).
    pub sent_ts: Option<f64>,
}

/// An answer object (`_handle_batch_output`'s `out_dict`): its text, ids and `meta_info`. A
/// natural end matched the EOS; a length end reports the tokens it was cut at.
pub fn object(a: &Answer, eos: u32) -> Value {
    let finish = match a.finish {
        None => Value::Null,
        Some(FinishReason::Stop) => json!({"type": "stop", "matched": eos}),
        Some(FinishReason::Length) => json!({"type": "length", "length": a.completion_tokens}),
    };
    let mut meta = json!({
        "id": a.rid,
        "finish_reason": finish,
        "prompt_tokens": a.prompt_tokens,
        "weight_version": WEIGHT_VERSION,
        "num_retractions": a.retractions,
        "reasoning_tokens": 0,
        "completion_tokens": a.completion_tokens,
        "cached_tokens": a.cached_tokens,
    });
    if let Some(e) = a.e2e_latency {
        meta["e2e_latency"] = json!(e);
    }
    if let Some(t) = a.sent_ts {
        meta["response_sent_to_client_ts"] = json!(t);
    }
    json!({"text": a.text, "output_ids": a.ids, "meta_info": meta})
}

/// One streamed chunk: the answer object, with its place among a batch's or `n`'s answers
/// (`_stream_batch_responses`; a single request's chunks have none).
pub fn chunk(a: &Answer, eos: u32, index: Option<usize>) -> Vec<u8> {
    let mut v = object(a, eos);
    if let Some(i) = index {
        v["index"] = json!(i);
    }
    format!("data: {v}\n\n").into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(body: Value) -> Refusal {
        match request(&body) {
            Err(r) => r,
            Ok(v) => panic!("accepted: {v}"),
        }
    }

    /// A single text prompt stays one; a batch with `n` keeps one sampling object per prompt and
    /// one rid per answer; ids win over text.
    #[test]
    fn requests_normalize_as_sglang_normalizes_them() {
        let v = request(&json!({"text": "Hi", "rid": "r1"})).unwrap();
        assert_eq!(v["prompt"], "Hi");
        assert_eq!(v["single"], true);
        assert_eq!(v["rid"], json!(["r1"]));
        assert_eq!(v["sampling_params"], json!([{}]));

        let v = request(&json!({
            "text": ["a", "b"],
            "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": null}],
            "rid": "r",
        }))
        .unwrap();
        assert_eq!(v["single"], false);
        assert_eq!(v["rid"], json!(["r_0", "r_1"]));
        assert_eq!(v["sampling_params"][1]["max_new_tokens"], Value::Null);

        let v = request(&json!({"input_ids": [1, 2], "text": "ignored",
                                "sampling_params": {"n": 3}, "rid": "r"}))
        .unwrap();
        assert_eq!(v["prompt"], json!([1, 2]));
        assert_eq!((v["n"].as_u64(), &v["single"]), (Some(3), &json!(false)));
        assert_eq!(v["rid"], json!([null, null, null]));
    }

    /// `extra_key` and `cache_salt`, one a prompt: a string for every prompt, a batch's list one
    /// a prompt, `""` none; one prompt sampled `n` times is a batch of one, so takes a list.
    #[test]
    fn cache_keys_normalize_one_a_prompt() {
        let v = request(&json!({"text": "a", "extra_key": "k", "cache_salt": ""})).unwrap();
        assert_eq!(
            (&v["extra_key"], &v["cache_salt"]),
            (&json!(["k"]), &json!([null]))
        );
        let v = request(
            &json!({"text": ["a", "b", "c"], "extra_key": ["k", "", "j"],
                                "cache_salt": "s"}),
        )
        .unwrap();
        assert_eq!(v["extra_key"], json!(["k", null, "j"]));
        assert_eq!(v["cache_salt"], json!(["s", "s", "s"]));
        let v = request(&json!({"text": "a", "extra_key": ["k"], "sampling_params": {"n": 2}}))
            .unwrap();
        assert_eq!(v["extra_key"], json!(["k"]));
        let v = request(&json!({"input_ids": [[1], [2]]})).unwrap();
        assert_eq!(
            (&v["extra_key"], &v["cache_salt"]),
            (&json!([null, null]), &json!([null, null]))
        );
    }

    #[test]
    fn refusals_are_sglangs() {
        let value = |m: &str| Refusal::Value(m.into());
        assert_eq!(
            refused(json!({})),
            value("Either text, input_ids or input_embeds should be provided.")
        );
        assert_eq!(
            refused(json!({"input_ids": []})),
            value("input_ids cannot be empty.")
        );
        assert_eq!(
            refused(json!({"text": ""})),
            value("texts cannot be empty and tokenizer must be initialized")
        );
        assert_eq!(
            refused(json!({"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 1}]})),
            value("The parallel_sample_num should be the same for all samples in sample params.")
        );
        assert_eq!(
            refused(json!({"text": ["a", "b"], "rid": ["x", "x"]})),
            value("Duplicate request IDs detected within the request: ['x']")
        );
        assert_eq!(
            refused(json!({"text": ["a", "b"], "rid": ["x"]})),
            value("The specified rids length mismatch with the batch_size for batch processing.")
        );
        assert_eq!(
            refused(json!({"text": "a", "sampling_params": {"max_new_tokens": -1}})),
            value("max_new_tokens must be at least 0, got -1.")
        );
        assert_eq!(
            refused(json!({"text": "a", "sampling_params": {"min_new_tokens": 200}})),
            value("min_new_tokens must be in [0, max_new_tokens(128)], got 200.")
        );
        assert_eq!(
            refused(json!({"text": "a", "sampling_params": {"top_p": 0}})),
            value("top_p must be in (0, 1], got 0.")
        );
        // A list for one prompt: the key is named before the salt, as SGLang checks them.
        assert_eq!(
            refused(json!({"text": "a", "extra_key": ["k"]})),
            value("extra_key should be a string for a single request.")
        );
        assert_eq!(
            refused(json!({"text": "a", "extra_key": [], "cache_salt": ["s"]})),
            value("extra_key should be a string for a single request.")
        );
        assert_eq!(
            refused(json!({"text": "a", "cache_salt": ["s"]})),
            value("cache_salt should be a string for a single request.")
        );
        assert_eq!(
            refused(json!({"text": ["a", "b"], "extra_key": ["k"]})),
            value("The length of extra_key should be equal to the batch size.")
        );
        assert_eq!(
            refused(json!({"text": ["a", "b"], "cache_salt": ["s", "t", "u"]})),
            value("The length of cache_salt should be equal to the batch size.")
        );
        // Pydantic's `Optional[Union[List[str], str]]`: no nulls in the list, nothing else.
        for body in [
            json!({"text": ["a", "b"], "extra_key": ["k", null]}),
            json!({"text": ["a", "b"], "cache_salt": [null, "s"]}),
            json!({"text": "a", "extra_key": 5}),
            json!({"text": "a", "cache_salt": {"s": 1}}),
        ] {
            assert!(matches!(refused(body), Refusal::Invalid(_)));
        }
        assert!(matches!(refused(json!({"text": 5})), Refusal::Invalid(_)));
        assert!(matches!(
            refused(json!({"input_ids": [1, "2"]})),
            Refusal::Invalid(_)
        ));
        assert!(matches!(
            refused(json!({"text": "a", "stream": "maybe"})),
            Refusal::Invalid(_)
        ));
        // A null limit is no limit, so any minimum passes.
        assert!(request(&json!({"text": "a", "sampling_params":
                                {"max_new_tokens": null, "min_new_tokens": 500}}))
        .is_ok());
    }

    /// The answer's `meta_info`: a stop matched the EOS, a length end its length, and only an
    /// ended answer has its latency.
    #[test]
    fn answers_carry_sglangs_meta_info() {
        let mut a = Answer {
            rid: "r",
            text: " the",
            ids: &[5, 9],
            finish: Some(FinishReason::Stop),
            prompt_tokens: 7,
            completion_tokens: 2,
            cached_tokens: 4,
            retractions: 1,
            e2e_latency: Some(0.5),
            sent_ts: None,
        };
        let v = object(&a, 9);
        assert_eq!(
            v["meta_info"]["finish_reason"],
            json!({"type": "stop", "matched": 9})
        );
        assert_eq!(
            (
                &v["meta_info"]["cached_tokens"],
                &v["meta_info"]["num_retractions"]
            ),
            (&json!(4), &json!(1))
        );
        assert_eq!(v["meta_info"]["e2e_latency"], 0.5);
        a.finish = None;
        a.e2e_latency = None;
        let text = String::from_utf8(chunk(&a, 9, Some(3))).unwrap();
        let v: Value = serde_json::from_str(text.trim_start_matches("data: ").trim()).unwrap();
        assert_eq!(v["index"], 3);
        assert!(v["meta_info"]["finish_reason"].is_null());
        assert!(v["meta_info"].get("e2e_latency").is_none());
        assert_eq!(
            lora_unknown("x", &["a".into(), "b".into()]),
            "Got LoRA adapter that has never been loaded: x\nAll loaded adapters: \
             dict_keys(['a', 'b'])."
        );
    }
}
