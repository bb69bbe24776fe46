//! What differs between vLLM's pooling endpoints (`vllm/entrypoints/pooling/`), whose requests
//! are read, run and answered by one path (`Kind::Pool` in the server: prefill-only engine
//! requests, truncation, errors and usage alike): the two others that take the Embeddings API's
//! inputs (`embeddings`), `POST /pooling` (`pooling/pooling/`: `PoolingCompletionRequest` /
//! `PoolingChatRequest` / `PoolingResponse`, with its `task`) and `POST /classify`
//! (`pooling/classify/`: `ClassificationCompletionRequest` / `ClassificationChatRequest` /
//! `ClassificationResponse`), and the score APIs, `/score` and `/rerank` (`score`, whose pairs
//! are pooled as a one-label classifier pools a prompt). This module owns which endpoint a
//! request came to and the request models it validates as, the task its prompts are pooled for,
//! and what a prompt pools to.

use serde_json::Value;

use crate::embeddings::{check_dimensions, embed, seed, vector, Encoding, Options};
use crate::kv::mix64;
use crate::pod::Rng;

/// Which of vLLM's pooling endpoints a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/embeddings`: a vector a prompt.
    Embeddings,
    /// `/pooling`: the pooler's output for the request's `task`.
    Pooling,
    /// `/classify`: the class probabilities a prompt, with their label.
    Classify,
    /// `/score` (`/v1/score`): a score a pair of texts.
    Score,
    /// `/rerank` (`/v1/rerank`, `/v2/rerank`): a query's documents, by their scores.
    Rerank,
}

/// A request model: its name, as pydantic names it in a complaint, and the fields it requires.
type Model = (&'static str, &'static [&'static str]);

impl Endpoint {
    /// The prefix of the answer's id (vLLM's `embd-`, `pool-`, `classify-`, `score-`,
    /// `rerank-`).
    pub fn id_prefix(self) -> &'static str {
        match self {
            Endpoint::Embeddings => "embd",
            Endpoint::Pooling => "pool",
            Endpoint::Classify => "classify",
            Endpoint::Score => "score",
            Endpoint::Rerank => "rerank",
        }
    }

    /// The request models a body may validate as (the endpoint's request is their union), in
    /// the order they are tried: the embeddings' inputs' completion form, then their chat form;
    /// the score request's four forms, each of two sides (`score`).
    pub fn models(self) -> &'static [Model] {
        match self {
            Endpoint::Embeddings => &[
                ("EmbeddingCompletionRequest", &["input"]),
                ("EmbeddingChatRequest", &["messages"]),
            ],
            Endpoint::Pooling => &[
                ("PoolingCompletionRequest", &["input"]),
                ("PoolingChatRequest", &["messages"]),
            ],
            Endpoint::Classify => &[
                ("ClassificationCompletionRequest", &["input"]),
                ("ClassificationChatRequest", &["messages"]),
            ],
            Endpoint::Score => &[
                ("ScoreQueriesDocumentsRequest", &["queries", "documents"]),
                ("ScoreQueriesItemsRequest", &["queries", "items"]),
                ("ScoreDataRequest", &["data_1", "data_2"]),
                ("ScoreTextRequest", &["text_1", "text_2"]),
            ],
            Endpoint::Rerank => &[("RerankRequest", &["query", "documents"])],
        }
    }

    /// The first of its `models` whose required fields a body all gives (null is not given):
    /// its index and those fields; with none, every model's missing fields, as pydantic lists
    /// them.
    pub fn model(self, body: &Value) -> Result<(usize, &'static [&'static str]), String> {
        let given = |k: &&str| body.get(k).is_some_and(|v| !v.is_null());
        let models = self.models();
        let found = models
            .iter()
            .enumerate()
            .find(|(_, (_, f))| f.iter().all(given));
        if let Some((index, &(_, fields))) = found {
            return Ok((index, fields));
        }
        let missing: Vec<String> = models
            .iter()
            .flat_map(|(name, fields)| {
                let absent = fields.iter().filter(|f| !given(f));
                absent.map(move |f| format!("{f}: Field required ({name})"))
            })
            .collect();
        Err(missing.join("; "))
    }
}

/// A pooling task the simulated model serves (vLLM's `PoolingTask`, less `score` and `plugin`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// The last token's hidden state, normalized: `/v1/embeddings`' vector.
    Embed,
    /// The class probabilities of the sequence.
    Classify,
    /// A normalized vector for each prompt token.
    TokenEmbed,
    /// Class probabilities for each prompt token.
    TokenClassify,
}

/// The tasks the simulated model supports, as vLLM's refusal lists them.
const SUPPORTED: &str = "('embed', 'classify', 'token_embed', 'token_classify')";

/// `/pooling`'s `task`: none is the model's own (`embed`, an embedding model's); a `PoolingTask`
/// the model does not serve (`score`, `plugin`) is a refusal kept for after the model is looked
/// up, as vLLM's serving refuses it (`Err`, its name); anything else fails the request's
/// validation.
pub fn task(body: &Value) -> Result<Result<Task, &'static str>, String> {
    Ok(match body.get("task") {
        None | Some(Value::Null) => Ok(Task::Embed),
        Some(v) => match v.as_str() {
            Some("embed") => Ok(Task::Embed),
            Some("classify") => Ok(Task::Classify),
            Some("token_embed") => Ok(Task::TokenEmbed),
            Some("token_classify") => Ok(Task::TokenClassify),
            Some("score") => Err("score"),
            Some("plugin") => Err("plugin"),
            _ => {
                return Err(
                    "task: Input should be 'embed', 'classify', 'score', 'token_embed', \
                     'token_classify' or 'plugin'"
                        .into(),
                )
            }
        },
    })
}

/// Length of each prompt token's vector for `token_embed` (a simplification: a real model's is
/// its hidden size, which would make an answer of a long prompt hundreds of megabytes).
pub const TOKEN_EMBED_SIZE: usize = 8;

/// What the model's pooler gives a prompt: one output, or one for each of its tokens.
#[derive(Debug, Clone, PartialEq)]
pub enum Pooled {
    One(Vec<f32>),
    PerToken(Vec<Vec<f32>>),
}

impl Pooled {
    /// Its floats in order (a tensor's flattened bytes, for base64).
    pub fn flat(&self) -> impl Iterator<Item = f32> + '_ {
        let rows: &[Vec<f32>] = match self {
            Pooled::One(v) => std::slice::from_ref(v),
            Pooled::PerToken(rows) => rows,
        };
        rows.iter().flatten().copied()
    }

    /// A one-label classifier's output as the score APIs answer it: its one float, widened to
    /// a double as Python's `.item()` of a float32 tensor gives it.
    pub fn score(&self) -> f64 {
        self.flat().next().map_or(0.0, f64::from)
    }
}

/// How a request's prompts are pooled and answered, once its options passed every check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pooler {
    pub endpoint: Endpoint,
    pub task: Task,
    pub encoding: Encoding,
    /// `use_activation` for the classify tasks: off, the raw logits instead of probabilities.
    pub activation: bool,
    pub dimensions: Option<usize>,
    /// The model's sizes: `--embedding-size`, `--num-classes` (one for the score APIs').
    pub embedding_size: usize,
    pub num_classes: usize,
}

impl Pooler {
    /// The request's options checked as vLLM checks them once the model is known: its task
    /// served, and `dimensions` as `PoolingParams.verify` takes it (an embed task's, at most the
    /// vector's size; the classify tasks take none).
    pub fn new(o: &Options, embedding_size: usize, num_classes: usize) -> Result<Self, String> {
        let task = o.task.map_err(|name| match name {
            "plugin" => "No IOProcessor plugin installed. Please refer to the documentation and \
                         to the 'prithvi_geospatial_mae_io_processor' offline inference example \
                         for more details."
                .to_string(),
            _ => format!("Unsupported task: '{name}' Supported tasks: {SUPPORTED}"),
        })?;
        let dimensions = match task {
            Task::Embed => check_dimensions(o.dimensions, embedding_size)?,
            Task::TokenEmbed => check_dimensions(o.dimensions, TOKEN_EMBED_SIZE)?,
            Task::Classify | Task::TokenClassify => match o.dimensions {
                None => None,
                Some(_) => {
                    let name = match task {
                        Task::Classify => "classify",
                        _ => "token_classify",
                    };
                    return Err(format!(
                        "Task {name} only supports ['use_activation'] parameters, does not \
                         support ['dimensions'] parameters"
                    ));
                }
            },
        };
        // The score APIs' model is a reranker: a sequence classifier of one label (vLLM's
        // cross-encoders, and a decoder "LLM as reranker" such as Qwen3-Reranker), whose
        // score is that label's probability, the sigmoid of its logit.
        let num_classes = match o.endpoint {
            Endpoint::Score | Endpoint::Rerank => 1,
            Endpoint::Embeddings | Endpoint::Pooling | Endpoint::Classify => num_classes,
        };
        Ok(Pooler {
            endpoint: o.endpoint,
            task,
            encoding: o.encoding,
            activation: o.activation,
            dimensions,
            embedding_size,
            num_classes,
        })
    }

    /// What a prompt of these token ids pools to: deterministic in them, on any pod.
    pub fn pool(&self, ids: &[u32]) -> Pooled {
        let classes = |seed| classify(seed, self.num_classes, self.activation);
        match self.task {
            Task::Embed => Pooled::One(embed(ids, self.embedding_size, self.dimensions)),
            Task::Classify => Pooled::One(classes(seed(ids, CLASSIFY_SEED))),
            Task::TokenEmbed => Pooled::PerToken(
                prefix_seeds(ids, TOKEN_EMBED_SEED)
                    .map(|s| vector(s, TOKEN_EMBED_SIZE, self.dimensions))
                    .collect(),
            ),
            Task::TokenClassify => Pooled::PerToken(
                prefix_seeds(ids, TOKEN_CLASSIFY_SEED)
                    .map(classes)
                    .collect(),
            ),
        }
    }

    /// How many floats a prompt of `len` tokens answers (to tell a big answer from a small).
    pub fn floats(&self, len: usize) -> usize {
        let one = match self.task {
            Task::Embed => self.dimensions.unwrap_or(self.embedding_size),
            Task::TokenEmbed => self.dimensions.unwrap_or(TOKEN_EMBED_SIZE),
            Task::Classify | Task::TokenClassify => self.num_classes,
        };
        match self.task {
            Task::Embed | Task::Classify => one,
            Task::TokenEmbed | Task::TokenClassify => one.saturating_mul(len),
        }
    }
}

const CLASSIFY_SEED: u64 = 0x636c_6173_7369_6679;
const TOKEN_EMBED_SEED: u64 = 0x746f_6b65_6d62_6564;
const TOKEN_CLASSIFY_SEED: u64 = 0x746f_6b63_6c61_7373;

/// A seed for each prompt token, of the prompt up to it (a causal model's hidden state there),
/// chained so a long prompt costs one hash a token.
fn prefix_seeds(ids: &[u32], salt: u64) -> impl Iterator<Item = u64> + '_ {
    ids.iter().enumerate().scan(salt, |h, (i, &t)| {
        *h = mix64(*h ^ u64::from(t));
        Some(mix64(*h ^ i as u64))
    })
}

/// A classifier's output for `seed`: `classes` seeded logits through its activation (vLLM's
/// default for a sequence classifier: softmax, or a sigmoid for a one-label model), float32.
fn classify(seed: u64, classes: usize, activation: bool) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let logits: Vec<f64> = (0..classes).map(|_| 2.0 * rng.normal()).collect();
    let out = if !activation {
        logits
    } else if classes == 1 {
        logits.iter().map(|x| 1.0 / (1.0 + (-x).exp())).collect()
    } else {
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let exps: Vec<f64> = logits.iter().map(|x| (x - max).exp()).collect();
        let sum: f64 = exps.iter().sum();
        exps.iter().map(|e| e / sum).collect()
    };
    out.into_iter().map(|x| x as f32).collect()
}

/// The label of a classifier's output: its most likely class (the first of equals), named as
/// a Hugging Face config without `id2label` names it.
pub fn label(probs: &[f32]) -> String {
    let best = probs
        .iter()
        .enumerate()
        .fold(None::<(usize, f32)>, |best, (i, &p)| match best {
            Some((_, b)) if b >= p => best,
            _ => Some((i, p)),
        });
    format!("LABEL_{}", best.map_or(0, |(i, _)| i))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embeddings::options;
    use serde_json::json;

    fn pooler(body: Value, endpoint: Endpoint) -> Result<Pooler, String> {
        Pooler::new(&options(&body, endpoint)?, 16, 3)
    }

    /// `task` as `/pooling` reads it: the model's four, none for `embed`; `score` and `plugin`
    /// validate and are refused once the model is known; anything else fails validation.
    #[test]
    fn tasks_are_read_and_refused_as_vllm_does() {
        let t = |task: Value| pooler(json!({"input": "a", "task": task}), Endpoint::Pooling);
        for (name, want) in [
            (json!(null), Task::Embed),
            (json!("embed"), Task::Embed),
            (json!("classify"), Task::Classify),
            (json!("token_embed"), Task::TokenEmbed),
            (json!("token_classify"), Task::TokenClassify),
        ] {
            assert_eq!(t(name).map(|p| p.task), Ok(want));
        }
        let score = t(json!("score")).unwrap_err();
        assert!(score.starts_with("Unsupported task: 'score'"), "{score}");
        assert!(score.ends_with(SUPPORTED), "{score}");
        assert!(t(json!("plugin")).unwrap_err().contains("IOProcessor"));
        let bad = options(
            &json!({"input": "a", "task": "generate"}),
            Endpoint::Pooling,
        );
        assert!(bad.unwrap_err().starts_with("task: Input should be"));
        // `/classify` and `/v1/embeddings` have no `task` (an unknown field, ignored).
        let c = pooler(json!({"input": "a", "task": "x"}), Endpoint::Classify).unwrap();
        assert_eq!((c.task, c.endpoint), (Task::Classify, Endpoint::Classify));
        let dims = |task, d| {
            pooler(
                json!({"input": "a", "task": task, "dimensions": d}),
                Endpoint::Pooling,
            )
        };
        assert_eq!(dims("embed", 4).unwrap().dimensions, Some(4));
        assert_eq!(dims("token_embed", 8).unwrap().dimensions, Some(8));
        assert!(dims("token_embed", 9).is_err());
        assert_eq!(
            dims("classify", 2).unwrap_err(),
            "Task classify only supports ['use_activation'] parameters, does not support \
             ['dimensions'] parameters"
        );
        // `/classify` has no `dimensions` either: ignored.
        let c = pooler(json!({"input": "a", "dimensions": 2}), Endpoint::Classify).unwrap();
        assert_eq!(c.dimensions, None);
    }

    /// A prompt's classes: deterministic in its ids, probabilities summing to one (a sigmoid's
    /// one for a one-label model), the raw logits without activation; the label is the argmax.
    #[test]
    fn classes_are_seeded_probabilities() {
        let p = classify(seed(&[1, 2, 3], CLASSIFY_SEED), 4, true);
        assert_eq!(p, classify(seed(&[1, 2, 3], CLASSIFY_SEED), 4, true));
        assert_ne!(p, classify(seed(&[1, 2, 4], CLASSIFY_SEED), 4, true));
        assert_eq!(p.len(), 4);
        assert!((p.iter().map(|&x| f64::from(x)).sum::<f64>() - 1.0).abs() < 1e-6);
        assert!(p.iter().all(|&x| (0.0..=1.0).contains(&x)));
        let logits = classify(seed(&[1, 2, 3], CLASSIFY_SEED), 4, false);
        assert_eq!(label(&logits), label(&p));
        assert!(logits.iter().any(|&x| !(0.0..=1.0).contains(&x)));
        let one = classify(7, 1, true);
        assert!(one.len() == 1 && one[0] > 0.0 && one[0] < 1.0);
        assert_eq!(label(&[0.1, 0.7, 0.2]), "LABEL_1");
        assert_eq!(label(&[0.5, 0.5]), "LABEL_0");
    }

    /// The per-token tasks answer one output a prompt token, each of the prompt up to it: a
    /// longer prompt's first outputs are a shorter one's.
    #[test]
    fn token_tasks_answer_each_token_of_its_prefix() {
        let p = |task| {
            let body = json!({"input": "a", "task": task});
            pooler(body, Endpoint::Pooling).unwrap()
        };
        let Pooled::PerToken(long) = p("token_embed").pool(&[5, 6, 7]) else {
            panic!("per token")
        };
        let Pooled::PerToken(short) = p("token_embed").pool(&[5, 6]) else {
            panic!("per token")
        };
        assert_eq!((long.len(), long[0].len()), (3, TOKEN_EMBED_SIZE));
        assert_eq!(long[..2], short[..]);
        assert_ne!(long[0], long[1]);
        let Pooled::PerToken(classes) = p("token_classify").pool(&[5, 6, 7]) else {
            panic!("per token")
        };
        assert_eq!((classes.len(), classes[2].len()), (3, 3));
        assert_eq!(p("token_classify").floats(3), 9);
        assert_eq!(p("embed").floats(3), 16);
        assert_eq!(
            Pooled::PerToken(vec![vec![1.0], vec![2.0, 3.0]])
                .flat()
                .collect::<Vec<_>>(),
            [1.0, 2.0, 3.0]
        );
    }
}
