//! vLLM's score APIs (`vllm/entrypoints/pooling/score/`: `api_router.py`, `protocol.py`,
//! `serving.py` `ServingScores`, `utils.py`): `POST /score` (and `/v1/score`) scores pairs of
//! texts, `POST /rerank` (and `/v1/rerank`, `/v2/rerank`) a query's documents, best first. Each
//! pair runs as one pooling request of the engine, a prefill with no output (vLLM's
//! `{request_id}-{i}`), through the path the other pooling endpoints take (`Kind::Pool`: the
//! same truncation, length check, salts, adapters, errors and usage), and its score is what a
//! one-label classifier pools from its prompt (`Pooler`). This module owns what is the score
//! APIs' own: the four forms of a score request and the rerank request as their pydantic models
//! read them, the pairs vLLM makes of their two sides, the prompt of a pair, and `/rerank`'s
//! answer (`/score`'s is the pooling answer, `embeddings::response`).
//!
//! A pair's prompt is its query's tokens followed by its document's: vLLM's default for a
//! decoder used as a reranker (`get_score_prompt`, `full_prompt = prompt_1 + prompt_2`, as
//! Qwen3-Reranker is served), tokenized side by side here so that a query's pairs share its
//! tokens exactly, and with them its KV blocks in the prefix cache.

use serde::Serialize;
use serde_json::Value;

use crate::embeddings::integer;
use crate::pooling::{Endpoint, Pooled};

/// A `ScoreInput`: a text, or a `ScoreMultiModalParam` (an object with a `content` list of
/// parts).
fn input(v: &Value) -> bool {
    v.is_string() || v.get("content").is_some_and(Value::is_array)
}

/// A side's inputs, if it is `ScoreInputs` (one input, or a list of them): one input is a list
/// of one, as vLLM's `validate_score_input` makes it.
fn inputs(v: Option<&Value>) -> Option<Vec<&Value>> {
    match v? {
        Value::Array(list) => list.iter().all(input).then(|| list.iter().collect()),
        one => input(one).then(|| vec![one]),
    }
}

/// The request as its pydantic model validates it, before the model is looked up: one of the
/// endpoint's forms (`Endpoint::models`: `{queries, documents}`, `{queries, items}`,
/// `{data_1, data_2}` or `{text_1, text_2}` for `/score`, `{query, documents}` for `/rerank`),
/// each side `ScoreInputs` (a rerank's `query` one `ScoreInput`), and a rerank's `top_n` an
/// integer. (`truncate_prompt_tokens` and `use_activation` are the pooling fields', read with
/// the other endpoints', `embeddings::options`.)
pub fn check(body: &Value, endpoint: Endpoint) -> Result<(), String> {
    let (_, fields) = endpoint.model(body)?;
    for (i, field) in fields.iter().enumerate() {
        let v = body.get(field);
        // `RerankRequest.query` is a `ScoreInput`; every other side `ScoreInputs`.
        let single = endpoint == Endpoint::Rerank && i == 0;
        let (valid, what) = if single {
            (
                v.is_some_and(input),
                "a string or an object with a list `content`",
            )
        } else {
            (
                inputs(v).is_some(),
                "a string, an object with a list `content`, or a list of them",
            )
        };
        if !valid {
            return Err(format!("{field}: Input should be {what}"));
        }
    }
    if endpoint == Endpoint::Rerank {
        integer(body.get("top_n"), "top_n")?;
    }
    Ok(())
}

/// A side's texts: a text-only model (`architecture`, the simulator's) refuses a
/// `ScoreMultiModalParam`, with `_validate_mm_score_input`'s words.
fn texts<'a>(v: Option<&'a Value>, architecture: &str) -> Result<Vec<&'a str>, String> {
    let refused = || format!("MultiModalParam is not supported for {architecture}");
    inputs(v)
        .unwrap_or_default()
        .into_iter()
        .map(|i| i.as_str().ok_or_else(refused))
        .collect()
}

/// The prompt of each pair a request scores, in order, once the model is known: its two sides
/// (the form's two fields) as `validate_score_input` reads them — each a list of texts, the
/// first side's multimodal inputs refused before the second's, then their lengths checked as
/// `_validate_score_input_lens` checks them — paired 1:N (the one first input with every
/// second) or 1:1 and N:N (pairwise); a pair's prompt `encode`d as the module's header says.
pub fn prompts(
    body: &Value,
    endpoint: Endpoint,
    architecture: &str,
    encode: impl Fn(&str) -> Vec<u32>,
) -> Result<Vec<Vec<u32>>, String> {
    let (_, fields) = endpoint.model(body)?;
    let mut sides = fields.iter().map(|f| texts(body.get(f), architecture));
    let first = sides.next().unwrap_or(Ok(Vec::new()))?;
    let second = sides.next().unwrap_or(Ok(Vec::new()))?;
    if first.len() > 1 && first.len() != second.len() {
        return Err("Input lengths must be either 1:1, 1:N or N:N".into());
    }
    if first.is_empty() {
        return Err("At least one text element must be given".into());
    }
    if second.is_empty() {
        return Err("At least one text_pair element must be given".into());
    }
    let queries: Vec<Vec<u32>> = first.into_iter().map(&encode).collect();
    let pairs = second.into_iter().enumerate().map(|(i, document)| {
        let query = match queries.len() {
            1 => queries.first(),
            _ => queries.get(i),
        };
        let mut prompt = query.cloned().unwrap_or_default();
        prompt.extend(encode(document));
        prompt
    });
    Ok(pairs.collect())
}

/// `RerankDocument`: the document as the request gave it.
#[derive(Serialize)]
struct Document<'a> {
    text: Option<&'a str>,
    multi_modal: Option<&'a Value>,
}

/// `RerankResult`.
#[derive(Serialize)]
struct Ranked<'a> {
    index: usize,
    document: Document<'a>,
    relevance_score: f64,
}

/// `RerankUsage`.
#[derive(Serialize)]
struct Usage {
    prompt_tokens: usize,
    total_tokens: usize,
}

/// `RerankResponse`, in vLLM's order: no `object` or `created`.
#[derive(Serialize)]
struct Reranked<'a> {
    id: &'a str,
    model: &'a str,
    usage: Usage,
    results: Vec<Ranked<'a>>,
}

/// `/rerank`'s answer, as `request_output_to_rerank_response` makes it: each document with its
/// pair's score (`outputs`, in the documents' order) and its index among them, sorted by score,
/// best first (a stable sort: equal scores keep the documents' order), then cut to `top_n` when
/// it is positive; the usage the pairs' prompt tokens.
pub fn rerank(
    id: &str,
    model: &str,
    body: &Value,
    outputs: &[Pooled],
    prompt_tokens: usize,
) -> Result<String, String> {
    let documents = inputs(body.get("documents")).unwrap_or_default();
    let mut results: Vec<Ranked> = documents
        .into_iter()
        .zip(outputs)
        .enumerate()
        .map(|(index, (d, p))| Ranked {
            index,
            document: Document {
                text: d.as_str(),
                multi_modal: d.get("content"),
            },
            relevance_score: p.score(),
        })
        .collect();
    results.sort_by(|a, b| b.relevance_score.total_cmp(&a.relevance_score));
    let top_n = integer(body.get("top_n"), "top_n")?.unwrap_or(0);
    if let Ok(n @ 1..) = usize::try_from(top_n) {
        results.truncate(n);
    }
    let answer = Reranked {
        id,
        model,
        usage: Usage {
            prompt_tokens,
            total_tokens: prompt_tokens,
        },
        results,
    };
    serde_json::to_string(&answer).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const ARCH: &str = "LlamaForCausalLM";

    /// A stand-in tokenizer: a token a byte.
    fn bytes(text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    fn pairs(body: Value, endpoint: Endpoint) -> Result<Vec<String>, String> {
        check(&body, endpoint)?;
        let prompts = prompts(&body, endpoint, ARCH, bytes)?;
        Ok(prompts
            .iter()
            .map(|p| p.iter().map(|&b| char::from(b as u8)).collect())
            .collect())
    }

    /// `/score`'s four forms read alike, tried in vLLM's order; `/rerank`'s `{query,
    /// documents}`; a string side is a list of one; a body of none of them names every missing
    /// field of every form.
    #[test]
    fn each_form_reads_its_two_sides() {
        for (a, b) in [
            ("queries", "documents"),
            ("queries", "items"),
            ("data_1", "data_2"),
            ("text_1", "text_2"),
        ] {
            let body = json!({a: "q", b: ["x", "y"], "model": null});
            assert_eq!(
                pairs(body, Endpoint::Score),
                Ok(vec!["qx".into(), "qy".into()])
            );
        }
        let body = json!({"query": "q", "documents": "x"});
        assert_eq!(pairs(body, Endpoint::Rerank), Ok(vec!["qx".into()]));
        let both = json!({"text_1": "t", "text_2": "u", "queries": "q", "documents": "d"});
        assert_eq!(pairs(both, Endpoint::Score), Ok(vec!["qd".into()]));
        let none = pairs(json!({"queries": "q", "text_2": null}), Endpoint::Score).unwrap_err();
        assert_eq!(
            none,
            "documents: Field required (ScoreQueriesDocumentsRequest); items: Field required \
             (ScoreQueriesItemsRequest); data_1: Field required (ScoreDataRequest); data_2: \
             Field required (ScoreDataRequest); text_1: Field required (ScoreTextRequest); \
             text_2: Field required (ScoreTextRequest)"
        );
        let rerank = pairs(json!({"documents": ["d"]}), Endpoint::Rerank).unwrap_err();
        assert_eq!(rerank, "query: Field required (RerankRequest)");
    }

    /// One first input is paired with every second (1:N), else pairwise (1:1, N:N); other
    /// lengths, and an empty side, are vLLM's refusals, in its order.
    #[test]
    fn pairs_are_one_to_one_one_to_n_or_n_to_n() {
        let score = |a: Value, b: Value| pairs(json!({"text_1": a, "text_2": b}), Endpoint::Score);
        assert_eq!(score(json!("a"), json!("b")), Ok(vec!["ab".into()]));
        assert_eq!(
            score(json!(["a"]), json!(["b", "c", "d"])),
            Ok(vec!["ab".into(), "ac".into(), "ad".into()])
        );
        assert_eq!(
            score(json!(["a", "b"]), json!(["c", "d"])),
            Ok(vec!["ac".into(), "bd".into()])
        );
        let lengths = Err("Input lengths must be either 1:1, 1:N or N:N".to_string());
        assert_eq!(score(json!(["a", "b"]), json!(["c"])), lengths);
        assert_eq!(score(json!(["a", "b"]), json!([])), lengths);
        assert_eq!(
            score(json!([]), json!(["c"])),
            Err("At least one text element must be given".into())
        );
        assert_eq!(
            score(json!("a"), json!([])),
            Err("At least one text_pair element must be given".into())
        );
        let rerank = json!({"query": "q", "documents": []});
        assert_eq!(
            pairs(rerank, Endpoint::Rerank),
            Err("At least one text_pair element must be given".into())
        );
    }

    /// A `{"content": [...]}` input validates, and is refused once the model is known: the
    /// simulated model reads text only. Anything else is no `ScoreInput`.
    #[test]
    fn multimodal_inputs_are_refused_and_others_invalid() {
        let image = json!({"content": [{"type": "image_url", "image_url": {"url": "x"}}]});
        let refused = Err(format!("MultiModalParam is not supported for {ARCH}"));
        for body in [
            json!({"queries": image, "documents": ["a"]}),
            json!({"queries": "q", "documents": ["a", image]}),
            // The first side is refused before the lengths are looked at.
            json!({"queries": ["q", "r"], "documents": image}),
        ] {
            assert_eq!(pairs(body.clone(), Endpoint::Score), refused, "{body}");
        }
        let rerank = json!({"query": image, "documents": ["a"]});
        assert_eq!(pairs(rerank, Endpoint::Rerank), refused);
        for (body, endpoint, message) in [
            (
                json!({"text_1": 1, "text_2": "a"}),
                Endpoint::Score,
                "text_1: Input should be a string, an object with a list `content`, or a list \
                 of them",
            ),
            (
                json!({"text_1": "a", "text_2": ["a", ["b"]]}),
                Endpoint::Score,
                "text_2: Input should be a string, an object with a list `content`, or a list \
                 of them",
            ),
            (
                json!({"text_1": {"content": "a"}, "text_2": "a"}),
                Endpoint::Score,
                "text_1: Input should be a string, an object with a list `content`, or a list \
                 of them",
            ),
            (
                json!({"query": ["q"], "documents": ["a"]}),
                Endpoint::Rerank,
                "query: Input should be a string or an object with a list `content`",
            ),
            (
                json!({"query": "q", "documents": ["a"], "top_n": 1.5}),
                Endpoint::Rerank,
                "top_n should be a valid integer",
            ),
        ] {
            assert_eq!(check(&body, endpoint), Err(message.to_string()), "{body}");
        }
        // `/score` has no `top_n`: an unknown field, ignored.
        assert_eq!(
            check(
                &json!({"text_1": "a", "text_2": "b", "top_n": "x"}),
                Endpoint::Score
            ),
            Ok(())
        );
    }

    fn scores(v: &Value) -> Vec<(u64, f64)> {
        let results = v["results"].as_array().unwrap();
        results
            .iter()
            .map(|r| {
                (
                    r["index"].as_u64().unwrap(),
                    r["relevance_score"].as_f64().unwrap(),
                )
            })
            .collect()
    }

    /// `/rerank`'s answer: vLLM's keys in its order, the documents best first (equal scores in
    /// their order), each with its index and text; `top_n` cuts the list when it is positive.
    #[test]
    fn rerank_sorts_best_first_and_keeps_top_n() {
        let outputs: Vec<Pooled> = [0.25, 0.75, 0.5, 0.75]
            .iter()
            .map(|&s| Pooled::One(vec![s]))
            .collect();
        let answer = |top_n: Value| {
            let body = json!({"query": "q", "documents": ["a", "b", "c", "d"], "top_n": top_n});
            rerank("rerank-x", "m", &body, &outputs, 12).unwrap()
        };
        let raw = answer(json!(null));
        assert!(
            raw.starts_with(
                r#"{"id":"rerank-x","model":"m","usage":{"prompt_tokens":12,"total_tokens":12},"results":[{"index":1,"document":{"text":"b","multi_modal":null},"relevance_score":0.75},"#
            ),
            "{raw}"
        );
        let v: Value = serde_json::from_str(&raw).unwrap();
        let all = vec![(1, 0.75), (3, 0.75), (2, 0.5), (0, 0.25)];
        assert_eq!(scores(&v), all);
        assert_eq!(v["results"][3]["document"]["text"], "a");
        for (top_n, kept) in [
            (json!(0), 4),
            (json!(-1), 4),
            (json!(2), 2),
            (json!("9"), 4),
        ] {
            let v: Value = serde_json::from_str(&answer(top_n)).unwrap();
            assert_eq!(scores(&v), all[..kept]);
        }
        let one = json!({"query": "q", "documents": "a"});
        let v: Value =
            serde_json::from_str(&rerank("r", "m", &one, &outputs[..1], 2).unwrap()).unwrap();
        assert_eq!(scores(&v), [(0, 0.25)]);
    }
}
