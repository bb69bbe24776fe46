//! The reservation formula: a request's expected size, from its prompt (the static rule in
//! `text`, scaled by what `calibration` learned for the model) and its expected output (the
//! model's output-length distribution, `output_dist`, up to the request's own limit, for each of
//! its `n` answers). Its `cost`
//! is what the line's fair queuing charges a tenant; the pod's forecast (`admission::forecast`)
//! uses the outlook the distribution gives instead.

use crate::config::EstimatorConfig;
use crate::estimate::calibration::{Prior, PromptFit};
use crate::estimate::output_dist::{Outlook, OutputDist};
use crate::estimate::text::static_prompt_tokens;
use crate::openai::request::Request;

/// What was learned for a model from responses, if enough has been seen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Learned {
    /// How the engine counts a prompt's text, through the chat template and without it.
    pub templated: PromptFit,
    pub raw: PromptFit,
    /// Tokens one non-text content part takes, once a response of a request with parts taught
    /// it (`estimator.nonTextPartTokens` until then).
    pub part_tokens: Option<f64>,
    /// The scaled estimate's relative error, one standard deviation.
    pub prompt_spread: f64,
    /// How long the model's answers run.
    pub output: OutputDist,
    /// Output tokens per streamed piece of text (`calibration`): what a stream's pieces count.
    pub tokens_per_piece: f64,
}

/// The estimate for one request, in tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    pub prompt_tokens: u64,
    /// How far `prompt_tokens` may be off, one standard deviation: the model's measured spread
    /// (`estimator.promptSpread` until measured) of the part estimated by rule.
    pub prompt_sigma: u64,
    /// What the prompt is held at on its pod, per estimated token: `1 + promptSpread` until
    /// calibration has measured the model, 1 after. Until then the rule's error is one bias shared
    /// by every request of the model (its text's tokens per character), which pooling requests does
    /// not shrink, so each prompt carries it; once the scale has removed the bias, what is left
    /// differs from request to request and the forecast pools it (`prompt_sigma`).
    pub prompt_margin: f64,
    /// Expected output: the model's mean answer length, up to the request's own limit, over all
    /// its choices.
    pub output_tokens: u64,
    /// The hard limit: the request's max-tokens field, or `estimator.outputCapTokens`, over all
    /// its choices.
    pub max_output_tokens: u64,
    /// Its answers (`n` for each of its prompts): each a sequence of its own on its prompt, so
    /// its output grows this many tokens a decode step, and `output` is one answer's length.
    pub choices: u64,
    /// Its prompts (a completions batch, `Request::prompts`): `choices ÷ prompts` answers share
    /// each one.
    pub prompts: u64,
    /// A part of its prompts counted in `prompt_tokens` for each of them: a score request's
    /// query (`Request::repeated`), its tokens and how many prompts after the first repeat it.
    /// A pod that caches prefixes holds its whole blocks once (`held_prompt_tokens`).
    pub repeated: (u64, u64),
    /// The request set its own limit (a max-tokens field).
    pub bounded: bool,
    /// Without a limit, its outlook is the output prior's and the prior is a guess
    /// (`calibration::Prior::guessed`): the forecast counts the guess's error, which all such
    /// requests share, once over the pod's (`admission::forecast`).
    pub output_guessed: bool,
    /// The answer streams, so its first token is seen when it comes (`routing::router`: until
    /// then its prompt is work its pod still has to do).
    pub streams: bool,
    /// How long the model's answers run: the request's outlook on its pod comes from this.
    pub output: OutputDist,
    /// Its expected size when done, prompt × safety factor + expected output, clamped: what the
    /// line's fair queuing charges its tenant and the `x-kvgate-cost` header shows.
    pub cost: u64,
    /// The one pod that can answer it, by a hash of its address (`hash::fnv1a`): a Responses API
    /// follow-up's, where its previous response is stored (`routing::stored`).
    pub only_on: Option<u64>,
    /// The pods it may go to now, as the line's bits (`admission::line::pod_bits`):
    /// `line::ANYWHERE` for every pod serving its model, fewer where it heads the line on some
    /// of its pods only (`QueueRecord::leaders`: tickets ahead of it wait for the others).
    pub within: u64,
}

impl Estimate {
    /// A request whose prompt and output lengths are known exactly: it runs to `output` tokens,
    /// no more, no less. For tests and the fuzz targets.
    #[cfg(any(test, feature = "fake-host"))]
    pub fn exact(prompt_tokens: u64, output_tokens: u64) -> Estimate {
        Estimate {
            prompt_tokens,
            prompt_sigma: 0,
            prompt_margin: 1.0,
            output_tokens,
            max_output_tokens: output_tokens,
            choices: 1,
            prompts: 1,
            repeated: (0, 0),
            bounded: true,
            output_guessed: false,
            streams: false,
            output: OutputDist::never_stops(),
            cost: prompt_tokens + output_tokens,
            only_on: None,
            within: crate::admission::line::ANYWHERE,
        }
    }
}

/// The answers of a request for several that have ended (`n`: the engine frees each one's
/// tokens as it ends, the others running on), and the tokens they made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ended {
    pub answers: u64,
    pub tokens: u64,
}

impl Estimate {
    /// The prompt tokens it holds on a pod (before the safety factor): all of them, but on a pod
    /// that caches prefixes, the whole blocks of `block_tokens` of a part its prompts repeat are
    /// held once (a score request's pairs share their query's blocks, as the engine's prefix
    /// cache hands each pair after the first the blocks the first computed; counted for each
    /// pair, a rerank of a long query held the query once a document).
    pub fn held_prompt_tokens(&self, block_tokens: u64, caches_prefixes: bool) -> f64 {
        let (tokens, times) = self.repeated;
        let bt = block_tokens.max(1);
        let again = if caches_prefixes {
            (tokens / bt * bt).saturating_mul(times)
        } else {
            0
        };
        self.prompt_tokens.saturating_sub(again) as f64
    }

    /// The answers that share each of its prompts (`n`): each reads that prompt every step, and
    /// holds a copy of it on a pod that caches no prefix.
    pub fn answers_per_prompt(&self) -> u64 {
        (self.choices / self.prompts.max(1)).max(1)
    }

    /// Its outlook (`output_dist`) with `running` of its answers still running, having made
    /// `made` tokens between them: each one's, from where they stand on average.
    pub fn outlook(&self, running: u64, made: u64) -> Outlook {
        let n = running.max(1);
        self.output
            .outlook(made / n, self.max_output_tokens / self.choices.max(1))
    }

    /// Decode steps until its limit stops `running` answers that have made `made` tokens between
    /// them: each makes a token a step, up to each one's limit.
    pub fn steps_left(&self, running: u64, made: u64) -> u64 {
        let n = running.max(1);
        let limit = self.max_output_tokens / self.choices.max(1) * n;
        limit.saturating_sub(made).div_ceil(n)
    }
}

/// What the static rule (`static_prompt_tokens`) counts of a request: everything the engine
/// will prefill, a score request's query once for each pair (`all`), and that query once
/// (`query`; 0 for any other request, `Request::repeated`). Counted once a request: the rule is
/// the costliest step for long prompts, and calibration needs `all` too.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StaticCount {
    pub all: f64,
    pub query: f64,
}

impl StaticCount {
    pub fn of(req: &Request) -> StaticCount {
        let all = static_prompt_tokens(&req.text);
        let Some((len, times)) = req.repeated else {
            return StaticCount { all, query: 0.0 };
        };
        let query = static_prompt_tokens(req.text.get(..len).unwrap_or_default());
        StaticCount {
            all: all + times as f64 * query,
            query,
        }
    }
}

/// The estimate with the configured output prior (`estimator.defaultOutputTokens`).
pub fn estimate(req: &Request, learned: Option<Learned>, cfg: &EstimatorConfig) -> Estimate {
    estimate_from(
        req,
        StaticCount::of(req),
        learned,
        Prior::configured(cfg),
        cfg,
    )
}

/// `estimate` for a caller that already ran the static rule over the request's text
/// (`StaticCount::of`), with the output prior calibration gives (`Known::prior`: the engines'
/// mean where longer).
pub fn estimate_from(
    req: &Request,
    counted: StaticCount,
    learned: Option<Learned>,
    prior: Prior,
    cfg: &EstimatorConfig,
) -> Estimate {
    let fit = learned.map_or(PromptFit::RULE, |l| {
        if req.templated {
            l.templated
        } else {
            l.raw
        }
    });
    let spread = learned.map_or(cfg.prompt_spread, |l| l.prompt_spread);
    let text_tokens = fit.tokens_each(counted.all, req.prompts).round() as u64;
    let part_tokens = learned
        .and_then(|l| l.part_tokens)
        .map_or(cfg.non_text_part_tokens, |t| t.round() as u64);
    // Token ids are counted exactly; text and non-text parts by rule.
    let by_rule = text_tokens.saturating_add(req.non_text_parts.saturating_mul(part_tokens));
    let prompt_tokens = by_rule.saturating_add(req.token_ids);
    let prompt_sigma = (by_rule as f64 * spread * cfg.safety_factor).round() as u64;
    // One answer's limit: the field's value (the request's total over its choices, split), the
    // output cap without one.
    let choices = req.choices.max(1);
    let per_choice = req.max_output_tokens.map_or(cfg.output_cap_tokens, |m| {
        (m / choices).min(cfg.output_cap_tokens)
    });
    let output = learned
        .map_or_else(|| OutputDist::prior(prior.tokens), |l| l.output)
        .of_request(
            req.max_output_tokens.is_some(),
            req.min_output_tokens / choices,
        );
    let output_tokens = output
        .expected(0, per_choice)
        .max(cfg.output_floor_tokens)
        .min(per_choice)
        .saturating_mul(choices);
    let max_output_tokens = per_choice.saturating_mul(choices);
    // The query a score request pairs with each document, by the rule and the fit's scale (its
    // fixed part is each pair's own).
    let repeated = req.repeated.map_or((0, 0), |(_, times)| {
        ((counted.query * fit.scale).round() as u64, times)
    });
    let raw = prompt_tokens as f64 * cfg.safety_factor + output_tokens as f64;
    let cost = (raw.ceil() as u64).clamp(cfg.min_reservation_tokens, cfg.max_reservation_tokens);
    Estimate {
        prompt_tokens,
        prompt_sigma,
        prompt_margin: if learned.is_some() {
            1.0
        } else {
            1.0 + cfg.prompt_spread
        },
        output_tokens,
        max_output_tokens,
        choices,
        prompts: req.prompts.clamp(1, choices),
        repeated,
        bounded: req.max_output_tokens.is_some(),
        output_guessed: learned.is_none() && prior.guessed && req.max_output_tokens.is_none(),
        streams: req.stream,
        output,
        cost,
        only_on: None,
        within: crate::admission::line::ANYWHERE,
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    fn req(text: &str, max: Option<u64>) -> Request {
        Request {
            model: "m".into(),
            text: text.into(),
            max_output_tokens: max,
            ..Request::default()
        }
    }

    /// What the model learned from `n` answers of `len` tokens each.
    fn learned_all(len: u64, n: f64) -> Learned {
        let mut ended = [0.0; crate::estimate::output_dist::BUCKETS];
        ended[crate::estimate::output_dist::bucket(len)] = n;
        Learned {
            templated: PromptFit::RULE,
            raw: PromptFit::RULE,
            part_tokens: None,
            prompt_spread: 0.0,
            output: OutputDist::learned(
                &ended,
                &[0.0; crate::estimate::output_dist::BUCKETS],
                256,
                0,
            ),
            tokens_per_piece: 1.0,
        }
    }

    /// A rerank's query is prefilled with each document: counted as often as it is paired.
    #[test]
    fn a_score_requests_query_is_counted_for_each_pair() {
        let query = "what does the reranker weigh most heavily in a long query like this one? ";
        let documents = [
            "first document text. ",
            "second one, longer than the first. ",
            "3",
        ];
        let text: String = std::iter::once(query).chain(documents).collect();
        let paired = Request {
            repeated: Some((query.len(), 2)),
            ..req(&text, Some(0))
        };
        let each: f64 = documents
            .iter()
            .map(|d| static_prompt_tokens(&format!("{query}{d}")))
            .sum();
        let counted = StaticCount::of(&paired).all;
        assert!((counted - each).abs() <= 3.0, "{counted} vs {each}");
        assert_eq!(
            StaticCount::of(&req(&text, Some(0))).all,
            static_prompt_tokens(&text)
        );
        let est = estimate(&paired, None, &EstimatorConfig::default());
        assert_eq!(est.prompt_tokens, counted.round() as u64);
    }

    /// A batch of prompts with `n` answers each: every answer its own limit and length, like `n`
    /// answers on one prompt, and `n` of them on each prompt.
    #[test]
    fn a_batch_of_prompts_answers_each() {
        let cfg = EstimatorConfig::default();
        let learned = Some(learned_all(100, 1_000.0));
        let batch = Request {
            choices: 6,
            prompts: 3,
            max_output_tokens: Some(6 * 50),
            ..req("x", None)
        };
        let one = Request {
            max_output_tokens: Some(50),
            ..req("x", None)
        };
        let (batch, one) = (
            estimate(&batch, learned, &cfg),
            estimate(&one, learned, &cfg),
        );
        assert_eq!((batch.choices, batch.answers_per_prompt()), (6, 2));
        assert_eq!(batch.output_tokens, 6 * one.output_tokens);
        assert_eq!(batch.max_output_tokens, 300);
        assert_eq!(batch.steps_left(6, 0), 50);
        assert_eq!(one.answers_per_prompt(), 1);
    }

    /// `n` answers on one prompt: each its own limit and length, so `n` times one answer's
    /// expected output within `n` times its limit, its outlook one answer's, and its steps to
    /// the limit one answer's too.
    #[test]
    fn several_choices_are_each_an_answer() {
        let cfg = EstimatorConfig::default();
        let learned = Some(learned_all(100, 1_000.0));
        let n = |max: Option<u64>, choices: u64| Request {
            choices,
            max_output_tokens: max.map(|m| m * choices),
            ..req("x", None)
        };
        let (one, four) = (
            estimate(&n(None, 1), learned, &cfg),
            estimate(&n(None, 4), learned, &cfg),
        );
        assert_eq!(four.choices, 4);
        assert_eq!(four.output_tokens, 4 * one.output_tokens);
        assert_eq!(four.max_output_tokens, 4 * cfg.output_cap_tokens);
        assert_eq!(four.outlook(4, 0), one.outlook(1, 0));
        let far = four.outlook(4, 400);
        assert_eq!(far, one.outlook(1, 100), "as far as each has run");
        assert_eq!(four.outlook(2, 200), far, "two of them ended");
        assert_eq!(four.steps_left(4, 0), cfg.output_cap_tokens);
        let bounded = estimate(&n(Some(50), 4), learned, &cfg);
        assert_eq!(bounded.max_output_tokens, 200);
        assert_eq!(bounded.steps_left(4, 0), 50);
        assert_eq!(bounded.steps_left(4, 199), 1);
        let two = bounded.steps_left(2, 60);
        assert_eq!(two, 20, "two left, 30 tokens into their 50");
        // A client's limit past the output cap is each answer's, capped each.
        let long = estimate(&n(Some(cfg.output_cap_tokens * 2), 3), learned, &cfg);
        assert_eq!(long.max_output_tokens, 3 * cfg.output_cap_tokens);
    }

    /// Only a request without a limit, of a model nothing has measured, is on the prior's guess:
    /// not once the model has learned, nor with a limit (it runs to it), nor on a prior its
    /// engines measured, nor without calibration (the configured mean is then the operator's).
    #[test]
    fn the_output_is_guessed_only_where_nothing_measured_the_prior() {
        let cfg = EstimatorConfig::default();
        let ten = StaticCount {
            all: 10.0,
            query: 0.0,
        };
        let on = |r: &Request, learned, prior| estimate_from(r, ten, learned, prior, &cfg);
        let guess = Prior::configured(&cfg);
        assert!(guess.guessed);
        let free = req("x", None);
        assert!(on(&free, None, guess).output_guessed);
        assert!(!on(&req("x", Some(300)), None, guess).output_guessed);
        assert!(!on(&free, Some(learned_all(300, 1000.0)), guess).output_guessed);
        let measured = Prior {
            tokens: 600,
            guessed: false,
        };
        assert!(!on(&free, None, measured).output_guessed);
        let off = EstimatorConfig {
            calibrate: false,
            ..cfg.clone()
        };
        assert!(!Prior::configured(&off).guessed);
    }

    #[test]
    fn output_is_the_expected_length_within_the_limit() {
        let cfg = EstimatorConfig::default();
        let e = estimate(&req("x", Some(10)), None, &cfg);
        assert_eq!((e.output_tokens, e.max_output_tokens), (10, 10));
        assert_eq!(
            estimate(&req("x", Some(1000)), None, &cfg).output_tokens,
            1000,
            "nothing learned yet: a request with a limit runs to it"
        );
        let prior = estimate(&req("x", None), None, &cfg).output_tokens;
        assert!(
            (248..=260).contains(&prior),
            "the prior's mean, 256: {prior}"
        );
        assert_eq!(
            estimate(&req("x", None), None, &cfg).max_output_tokens,
            8192,
            "no limit: the output cap"
        );
        let long = estimate(&req("x", None), Some(learned_all(900, 1000.0)), &cfg);
        assert!((850..=960).contains(&long.output_tokens), "{long:?}");
        assert_eq!(estimate(&req("x", Some(0)), None, &cfg).output_tokens, 0);
        let short = estimate(&req("x", None), Some(learned_all(3, 1000.0)), &cfg);
        assert_eq!(short.output_tokens, 16, "the floor");
        // Answers of 100 tokens learned; this one's end is held back to its limit, or to 250.
        let held = |min_output_tokens| Request {
            min_output_tokens,
            ..req("x", Some(600))
        };
        let exact = estimate(&held(u64::MAX), Some(learned_all(100, 1000.0)), &cfg);
        assert_eq!(exact.output_tokens, 600, "ignore_eos: runs to its limit");
        let floored = estimate(&held(250), Some(learned_all(100, 1000.0)), &cfg);
        let at_least = floored.output_tokens;
        assert!(
            (250..=260).contains(&at_least),
            "min_tokens: its floor: {at_least}"
        );
    }

    #[test]
    fn cost_applies_safety_to_the_prompt_and_clamps() {
        let cfg = EstimatorConfig {
            safety_factor: 1.1,
            ..EstimatorConfig::default()
        };
        let e = estimate(&req(&"word ".repeat(1000), Some(1000)), None, &cfg);
        assert_eq!(e.prompt_tokens, 1000);
        assert_eq!(
            e.prompt_sigma, 110,
            "nothing measured yet: the prior spread, 10 %, of the prompt with its margin"
        );
        assert!(
            (e.prompt_margin - 1.1).abs() < 1e-12,
            "nothing measured yet: the rule's bias is carried by each prompt"
        );
        let calibrated = estimate(
            &req(&"word ".repeat(1000), Some(1000)),
            Some(learned_all(100, 100.0)),
            &cfg,
        );
        assert_eq!(calibrated.prompt_margin, 1.0, "measured: pooled instead");
        assert_eq!(e.cost, 1100 + 1000);
        let ids = Request {
            token_ids: 500,
            ..req("", Some(1))
        };
        assert_eq!(
            estimate(&ids, None, &cfg).prompt_sigma,
            0,
            "token ids are counted, not estimated"
        );
        let unbounded = estimate(&req(&"word ".repeat(1000), None), None, &cfg);
        assert_eq!(unbounded.cost, 1100 + unbounded.output_tokens);
        assert_eq!(estimate(&req("", Some(1)), None, &cfg).cost, 64);
        let huge = Request {
            token_ids: 10_000_000,
            ..req("", Some(1))
        };
        assert_eq!(estimate(&huge, None, &cfg).cost, 131_072);
    }

    #[test]
    fn token_ids_are_exact_and_parts_charged() {
        let cfg = EstimatorConfig::default();
        let r = Request {
            token_ids: 123,
            non_text_parts: 2,
            ..req("", Some(0))
        };
        assert_eq!(estimate(&r, None, &cfg).prompt_tokens, 123 + 1024);
    }
}
