//! Seeded workload generators. A workload is a list of jobs; a job is a conversation of one or
//! more turns sent one after another (single requests are one-turn jobs). In open-loop mode each
//! job starts at its `start` offset; in closed-loop mode the offsets are ignored.

use serde::Serialize;

use crate::rng::Rng;

/// Common English words that are one token each (with their leading space) in the usual BPE
/// vocabularies, so `n` words are close to `n` tokens.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "model", "token", "cache",
    "prefix", "block", "route", "pod", "queue", "time", "first", "large", "language", "simple",
    "system", "value", "state", "data", "order", "policy", "rule", "case", "part", "world",
    "group", "number", "point", "home", "water", "room", "mother", "area", "money", "story",
    "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business", "issue",
    "side", "kind", "head", "house", "service", "friend", "father", "power", "hour", "game",
    "line", "end", "member", "law", "car", "city", "name", "team", "minute", "idea", "body",
];

/// `n` words drawn from the vocabulary, each with a leading space (≈ n tokens).
pub fn words(rng: &mut Rng, n: usize) -> String {
    let mut s = String::with_capacity(n * 6);
    for _ in 0..n {
        s.push(' ');
        s.push_str(WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]);
    }
    s
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Turn {
    pub user: String,
    /// None: the request carries no `max_tokens` (the server decides when to stop).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Wall seconds to wait after this turn's answer before sending the next turn.
    pub think: f64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Job {
    pub id: usize,
    /// Seconds after the start of the run (open loop).
    pub start: f64,
    pub system: Option<String>,
    pub turns: Vec<Turn>,
    pub headers: Vec<(String, String)>,
    /// The `model` its requests name; `None`: the run's `--model`.
    pub model: Option<String>,
    /// Labels copied into every result record (group, class, tenant, ...).
    pub tags: Vec<(String, String)>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrival {
    /// Poisson process with this rate (jobs per second).
    Poisson(f64),
    /// Everything at t = 0.
    Burst,
    /// No schedule: closed-loop workers take jobs as they free up.
    Closed,
}

/// Start offsets for `n` jobs.
pub fn arrivals(rng: &mut Rng, n: usize, arrival: Arrival) -> Vec<f64> {
    match arrival {
        Arrival::Poisson(rate) if rate > 0.0 => {
            let mut t = 0.0;
            (0..n)
                .map(|_| {
                    t += rng.exp(1.0 / rate);
                    t
                })
                .collect()
        }
        _ => vec![0.0; n],
    }
}

#[derive(Debug, Clone)]
pub struct SharedPrefix {
    pub groups: usize,
    pub questions: usize,
    pub system_tokens: usize,
    pub question_tokens: usize,
    pub output_tokens: u32,
    /// The groups are tenants of one application: the same system prompt, each group's cache
    /// kept apart by the engine under its own salt (vLLM's `X-Cache-Salt` header, which a gateway
    /// sets from the tenant's identity).
    pub salted: bool,
}

/// The header vLLM keys a prompt's cached blocks by, over the body's `cache_salt`.
const CACHE_SALT_HEADER: &str = "x-cache-salt";

/// G groups × Q questions: every question of a group starts with the group's system prompt.
/// Requests are sent in a seeded random order.
pub fn shared_prefix(seed: u64, w: &SharedPrefix, arrival: Arrival) -> Vec<Job> {
    let systems: Vec<String> = (0..w.groups)
        .map(|g| {
            // Salted, every tenant's prompt is group 0's text.
            let g = if w.salted { 0 } else { g };
            let mut r = Rng::derive(seed, &[1, g as u64]);
            format!(
                "Group {g} handbook.{}",
                words(&mut r, w.system_tokens.saturating_sub(4))
            )
        })
        .collect();
    let mut order: Vec<(usize, usize)> = (0..w.groups)
        .flat_map(|g| (0..w.questions).map(move |q| (g, q)))
        .collect();
    let mut r = Rng::derive(seed, &[2]);
    r.shuffle(&mut order);
    let starts = arrivals(&mut Rng::derive(seed, &[3]), order.len(), arrival);
    order
        .into_iter()
        .zip(starts)
        .enumerate()
        .map(|(id, ((g, q), start))| {
            let mut qr = Rng::derive(seed, &[4, g as u64, q as u64]);
            Job {
                id,
                start,
                system: systems.get(g).cloned(),
                turns: vec![Turn {
                    user: format!(
                        "Question {q}:{}",
                        words(&mut qr, w.question_tokens.saturating_sub(3))
                    ),
                    max_tokens: Some(w.output_tokens),
                    think: 0.0,
                }],
                headers: if w.salted {
                    vec![(CACHE_SALT_HEADER.into(), format!("tenant-{g}"))]
                } else {
                    vec![]
                },
                model: None,
                tags: vec![("group".into(), g.to_string())],
            }
        })
        .collect()
}

#[derive(Debug, Clone)]
pub struct MultiTurn {
    pub sessions: usize,
    pub turns: usize,
    /// A system prompt shared by every session.
    pub system_tokens: usize,
    /// The first user message (a document to discuss), unique per session.
    pub first_tokens: usize,
    pub followup_tokens: usize,
    pub output_tokens: u32,
    /// Mean think time between turns (exponential), wall seconds.
    pub think_mean: f64,
}

/// Chat sessions: each turn resends the whole history (with the answers the server gave), with
/// a think time between turns and an `x-session-id` header.
pub fn multi_turn(seed: u64, w: &MultiTurn, arrival: Arrival) -> Vec<Job> {
    let system = format!(
        "You are a support assistant.{}",
        words(
            &mut Rng::derive(seed, &[10]),
            w.system_tokens.saturating_sub(5)
        )
    );
    let starts = arrivals(&mut Rng::derive(seed, &[11]), w.sessions, arrival);
    starts
        .into_iter()
        .enumerate()
        .map(|(s, start)| {
            let mut r = Rng::derive(seed, &[12, s as u64]);
            let turns = (0..w.turns)
                .map(|t| {
                    let user = if t == 0 {
                        format!(
                            "Session {s} document:{}",
                            words(&mut r, w.first_tokens.saturating_sub(4))
                        )
                    } else {
                        format!(
                            "Follow-up {t}:{}",
                            words(&mut r, w.followup_tokens.saturating_sub(3))
                        )
                    };
                    let think = if t + 1 < w.turns {
                        r.exp(w.think_mean)
                    } else {
                        0.0
                    };
                    Turn {
                        user,
                        max_tokens: Some(w.output_tokens),
                        think,
                    }
                })
                .collect();
            Job {
                id: s,
                start,
                system: Some(system.clone()),
                turns,
                headers: vec![("x-session-id".into(), format!("session-{seed}-{s}"))],
                model: None,
                tags: vec![("session".into(), s.to_string())],
            }
        })
        .collect()
}

#[derive(Debug, Clone)]
pub struct Mixed {
    pub requests: usize,
    /// Fraction of long requests.
    pub long_fraction: f64,
    pub short_prompt: (u64, u64),
    pub short_output: (u64, u64),
    pub long_prompt: (u64, u64),
    pub long_output: (u64, u64),
}

pub const CLASSES: [(&str, f64); 3] = [("critical", 0.2), ("standard", 0.5), ("batch", 0.3)];
pub const TENANTS: [(&str, f64); 2] = [("tenant-a", 0.75), ("tenant-b", 0.25)];

/// Short and very long prompts and outputs; each request has an objective (critical, standard,
/// batch) in `x-gateway-inference-objective` and a tenant in `x-gateway-inference-fairness-id`.
/// Prompts are unique (no shared prefix).
pub fn mixed(seed: u64, w: &Mixed, arrival: Arrival) -> Vec<Job> {
    let starts = arrivals(&mut Rng::derive(seed, &[20]), w.requests, arrival);
    let class_w: Vec<f64> = CLASSES.iter().map(|c| c.1).collect();
    let tenant_w: Vec<f64> = TENANTS.iter().map(|t| t.1).collect();
    starts
        .into_iter()
        .enumerate()
        .map(|(i, start)| {
            let mut r = Rng::derive(seed, &[21, i as u64]);
            let long = r.f64() < w.long_fraction;
            let (p, o) = if long {
                (w.long_prompt, w.long_output)
            } else {
                (w.short_prompt, w.short_output)
            };
            let prompt = r.range(p.0, p.1) as usize;
            let output = r.range(o.0, o.1) as u32;
            let class = CLASSES[r.weighted(&class_w)].0;
            let tenant = TENANTS[r.weighted(&tenant_w)].0;
            Job {
                id: i,
                start,
                system: None,
                turns: vec![Turn {
                    user: format!("Request {i}:{}", words(&mut r, prompt.saturating_sub(3))),
                    max_tokens: Some(output),
                    think: 0.0,
                }],
                headers: vec![
                    ("x-gateway-inference-objective".into(), class.into()),
                    ("x-gateway-inference-fairness-id".into(), tenant.into()),
                ],
                model: None,
                tags: vec![
                    ("class".into(), class.into()),
                    ("tenant".into(), tenant.into()),
                    ("cost".into(), if long { "long" } else { "short" }.into()),
                ],
            }
        })
        .collect()
}

#[derive(Debug, Clone)]
pub struct Chat {
    pub requests: usize,
    /// Prompt length range, tokens, drawn log-uniformly (many short prompts, a long tail).
    pub prompt: (u64, u64),
    /// Fraction of requests sent without `max_tokens`.
    pub unbounded_fraction: f64,
    /// Range of the `max_tokens` the others carry (uniform).
    pub max_tokens: (u64, u64),
    /// Applications sharing the model (0: none, the simulator draws every answer's length).
    pub apps: Option<Apps>,
}

/// Several applications behind one model, each with its own system prompt and its own answer
/// lengths: lognormal within an application, with medians spread lognormally between them.
#[derive(Debug, Clone, Copy)]
pub struct Apps {
    pub count: usize,
    /// The answers' mean over all applications, tokens.
    pub mean: f64,
    /// σ of the applications' log-medians.
    pub between: f64,
    /// σ of one application's log-lengths.
    pub within: f64,
    /// Words every application's system prompt opens with (one organisation's house rules, as
    /// a fleet of applications behind one gateway often shares), before its own.
    pub opening: usize,
    /// Each application's own words after the opening (a one-line system prompt to a page).
    pub words: usize,
    /// Words of each request's own at the end of its system prompt (a user's profile,
    /// retrieved passages, the time): its opening is its application's only up to them.
    pub context: usize,
}

impl Apps {
    /// Application `k`'s system prompt (the shared opening, then its own words, naming it first)
    /// and the log-median of its answers.
    fn app(&self, seed: u64, k: usize) -> (String, f64) {
        let opening = words(&mut Rng::derive(seed, &[43]), self.opening);
        let opening = match opening.trim_start() {
            "" => String::new(),
            words => format!("{words}. "),
        };
        let mut r = Rng::derive(seed, &[42, k as u64]);
        let spread = self.between * self.between + self.within * self.within;
        let median = self.mean.ln() - spread / 2.0 + self.between * r.normal();
        let own = words(&mut r, self.words);
        (
            format!("{opening}Application {k} instructions:{own}"),
            median,
        )
    }
}

/// Chat traffic in a KV-bound pool: unique prompts (no shared prefix) of log-uniform length,
/// some requests bounded by `max_tokens` and the rest left to stop on their own, tagged
/// `bound` = `max_tokens` or `none`. With `apps`, each request is one application's (its system
/// prompt in front, tagged `app`), and its answer's length is drawn from that application's and
/// sent to the simulator (`x-sim-output-tokens`: it ends there, or at `max_tokens` first).
pub fn chat(seed: u64, w: &Chat, arrival: Arrival) -> Vec<Job> {
    let starts = arrivals(&mut Rng::derive(seed, &[40]), w.requests, arrival);
    let (lo, hi) = (w.prompt.0.max(4) as f64, w.prompt.1.max(4) as f64);
    starts
        .into_iter()
        .enumerate()
        .map(|(i, start)| {
            let mut r = Rng::derive(seed, &[41, i as u64]);
            let prompt = (lo * (hi / lo).powf(r.f64())).round() as usize;
            let max_tokens = (r.f64() >= w.unbounded_fraction)
                .then(|| r.range(w.max_tokens.0, w.max_tokens.1) as u32);
            let bound = if max_tokens.is_some() {
                "max_tokens"
            } else {
                "none"
            };
            let mut tags = vec![("bound".into(), bound.into())];
            let (mut system, mut headers) = (None, vec![]);
            if let Some(apps) = w.apps.filter(|a| a.count > 0) {
                let k = r.range(0, apps.count as u64 - 1) as usize;
                let (prompt, median) = apps.app(seed, k);
                let length = (median + apps.within * r.normal()).exp().round().max(1.0);
                system = Some(match apps.context {
                    0 => prompt,
                    n => format!("{prompt} Context for request {i}:{}", words(&mut r, n)),
                });
                headers.push(("x-sim-output-tokens".into(), format!("{length}")));
                tags.push(("app".into(), k.to_string()));
            }
            Job {
                id: i,
                start,
                system,
                turns: vec![Turn {
                    user: format!("Chat {i}:{}", words(&mut r, prompt.saturating_sub(3))),
                    max_tokens,
                    think: 0.0,
                }],
                headers,
                model: None,
                tags,
            }
        })
        .collect()
}

#[derive(Debug, Clone)]
pub struct Lora {
    pub requests: usize,
    /// Adapters `lora-0` .. `lora-<n-1>`, the pods' `--lora-modules`.
    pub adapters: usize,
    /// Popularity: adapter `k` is drawn with weight `1 / (k + 1)^zipf` (0: all alike).
    pub zipf: f64,
    /// Prompt length range, tokens (uniform); prompts are unique, so only adapters are shared.
    pub prompt: (u64, u64),
    pub output_tokens: u32,
}

/// Requests for many LoRA adapters of one base model, more than the pods have adapter slots:
/// unique prompts (no prefix to share), each job's model an adapter drawn by Zipf popularity,
/// tagged `adapter`. Where an adapter runs decides whether a request waits for its load.
pub fn lora(seed: u64, w: &Lora, arrival: Arrival) -> Vec<Job> {
    let starts = arrivals(&mut Rng::derive(seed, &[50]), w.requests, arrival);
    let weights: Vec<f64> = (0..w.adapters.max(1))
        .map(|k| 1.0 / ((k + 1) as f64).powf(w.zipf))
        .collect();
    starts
        .into_iter()
        .enumerate()
        .map(|(i, start)| {
            let mut r = Rng::derive(seed, &[51, i as u64]);
            let adapter = format!("lora-{}", r.weighted(&weights));
            let prompt = r.range(w.prompt.0.max(4), w.prompt.1.max(4)) as usize;
            Job {
                id: i,
                start,
                system: None,
                turns: vec![Turn {
                    user: format!("Task {i}:{}", words(&mut r, prompt.saturating_sub(3))),
                    max_tokens: Some(w.output_tokens),
                    think: 0.0,
                }],
                headers: vec![],
                model: Some(adapter.clone()),
                tags: vec![("adapter".into(), adapter)],
            }
        })
        .collect()
}

/// The same chat request `requests` times, its user message padded so the JSON body is about
/// `body_bytes` long (filter-overhead runs).
pub fn fixed(seed: u64, requests: usize, body_bytes: usize, output_tokens: u32) -> Vec<Job> {
    let mut r = Rng::derive(seed, &[30]);
    let mut text = String::new();
    while text.len() + 160 < body_bytes {
        text.push_str(&words(&mut r, 32));
    }
    (0..requests)
        .map(|i| Job {
            id: i,
            start: 0.0,
            system: None,
            turns: vec![Turn {
                user: text.clone(),
                max_tokens: Some(output_tokens),
                think: 0.0,
            }],
            headers: vec![],
            model: None,
            tags: vec![],
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sp() -> SharedPrefix {
        SharedPrefix {
            groups: 5,
            questions: 4,
            system_tokens: 200,
            question_tokens: 30,
            output_tokens: 16,
            salted: false,
        }
    }

    fn mt() -> MultiTurn {
        MultiTurn {
            sessions: 6,
            turns: 4,
            system_tokens: 50,
            first_tokens: 300,
            followup_tokens: 20,
            output_tokens: 10,
            think_mean: 0.5,
        }
    }

    fn mx(n: usize) -> Mixed {
        Mixed {
            requests: n,
            long_fraction: 0.2,
            short_prompt: (50, 100),
            short_output: (8, 16),
            long_prompt: (2000, 3000),
            long_output: (100, 200),
        }
    }

    fn n_words(s: &str) -> usize {
        s.split_whitespace().count()
    }

    #[test]
    fn generators_are_deterministic_per_seed() {
        let a = Arrival::Poisson(10.0);
        assert_eq!(shared_prefix(1, &sp(), a), shared_prefix(1, &sp(), a));
        assert_ne!(shared_prefix(1, &sp(), a), shared_prefix(2, &sp(), a));
        assert_eq!(multi_turn(1, &mt(), a), multi_turn(1, &mt(), a));
        assert_ne!(multi_turn(1, &mt(), a), multi_turn(2, &mt(), a));
        assert_eq!(mixed(5, &mx(50), a), mixed(5, &mx(50), a));
        assert_ne!(mixed(5, &mx(50), a), mixed(6, &mx(50), a));
    }

    #[test]
    fn shared_prefix_shape() {
        let jobs = shared_prefix(9, &sp(), Arrival::Burst);
        assert_eq!(jobs.len(), 20);
        for g in 0..5 {
            let tag = g.to_string();
            let mine: Vec<&Job> = jobs.iter().filter(|j| j.tags[0].1 == tag).collect();
            assert_eq!(mine.len(), 4);
            assert!(mine.iter().all(|j| j.system == mine[0].system));
            let sys = mine[0].system.as_deref().unwrap_or("");
            assert!((n_words(sys) as i64 - 200).abs() <= 2, "{}", n_words(sys));
            for j in &mine {
                assert_eq!(j.turns.len(), 1);
                assert_eq!(j.turns[0].max_tokens, Some(16));
                assert!((n_words(&j.turns[0].user) as i64 - 30).abs() <= 2);
            }
        }
        // Groups differ from their first words on (no shared first block across groups).
        let firsts: std::collections::HashSet<String> = jobs
            .iter()
            .filter_map(|j| j.system.as_ref().map(|s| s.chars().take(64).collect()))
            .collect();
        assert_eq!(firsts.len(), 5);
        // Questions within a group are distinct.
        let qs: std::collections::HashSet<&str> =
            jobs.iter().map(|j| j.turns[0].user.as_str()).collect();
        assert_eq!(qs.len(), 20);
        assert!(jobs.iter().all(|j| j.headers.is_empty()));
    }

    #[test]
    fn salted_groups_are_tenants_of_one_system_prompt() {
        let jobs = shared_prefix(
            9,
            &SharedPrefix {
                salted: true,
                ..sp()
            },
            Arrival::Burst,
        );
        assert!(jobs.iter().all(|j| j.system == jobs[0].system));
        for j in &jobs {
            let tenant = format!("tenant-{}", j.tags[0].1);
            assert_eq!(j.headers, vec![(CACHE_SALT_HEADER.to_string(), tenant)]);
        }
        assert!(jobs.iter().all(|j| j.start == 0.0));
    }

    #[test]
    fn group_prompts_do_not_depend_on_the_number_of_questions() {
        let mut more = sp();
        more.questions = 9;
        let a = shared_prefix(3, &sp(), Arrival::Burst);
        let b = shared_prefix(3, &more, Arrival::Burst);
        let sys = |jobs: &[Job], g: &str| {
            jobs.iter()
                .find(|j| j.tags[0].1 == g)
                .and_then(|j| j.system.clone())
        };
        assert_eq!(sys(&a, "2"), sys(&b, "2"));
    }

    #[test]
    fn multi_turn_shape() {
        let jobs = multi_turn(4, &mt(), Arrival::Poisson(2.0));
        assert_eq!(jobs.len(), 6);
        let ids: std::collections::HashSet<&str> =
            jobs.iter().map(|j| j.headers[0].1.as_str()).collect();
        assert_eq!(ids.len(), 6);
        for j in &jobs {
            assert_eq!(j.headers[0].0, "x-session-id");
            assert_eq!(j.turns.len(), 4);
            assert_eq!(
                j.system, jobs[0].system,
                "one system prompt shared by all sessions"
            );
            assert!((n_words(&j.turns[0].user) as i64 - 300).abs() <= 2);
            assert!(j.turns[1..]
                .iter()
                .all(|t| (n_words(&t.user) as i64 - 20).abs() <= 2));
            assert!(j.turns[..3].iter().all(|t| t.think > 0.0));
            assert_eq!(j.turns[3].think, 0.0);
        }
        assert!(jobs.windows(2).all(|w| w[0].start <= w[1].start));
    }

    #[test]
    fn mixed_shape_and_class_mix() {
        let jobs = mixed(7, &mx(4000), Arrival::Poisson(100.0));
        let count = |k: &str, v: &str| {
            jobs.iter()
                .filter(|j| j.tags.iter().any(|(a, b)| a == k && b == v))
                .count() as f64
                / 4000.0
        };
        assert!((count("class", "critical") - 0.2).abs() < 0.03);
        assert!((count("class", "standard") - 0.5).abs() < 0.03);
        assert!((count("class", "batch") - 0.3).abs() < 0.03);
        assert!((count("tenant", "tenant-a") - 0.75).abs() < 0.03);
        assert!((count("cost", "long") - 0.2).abs() < 0.03);
        for j in &jobs {
            let long = j.tags.iter().any(|(a, b)| a == "cost" && b == "long");
            let n = n_words(&j.turns[0].user) as u64;
            let o = u64::from(j.turns[0].max_tokens.unwrap_or(0));
            if long {
                assert!((1999..=3001).contains(&n) && (100..=200).contains(&o));
            } else {
                assert!((49..=101).contains(&n) && (8..=16).contains(&o));
            }
            let hdr = |name: &str| {
                j.headers
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.as_str())
            };
            assert!(matches!(
                hdr("x-gateway-inference-objective"),
                Some("critical" | "standard" | "batch")
            ));
            assert!(matches!(
                hdr("x-gateway-inference-fairness-id"),
                Some("tenant-a" | "tenant-b")
            ));
        }
    }

    #[test]
    fn chat_shape() {
        let w = Chat {
            requests: 4000,
            prompt: (200, 3000),
            unbounded_fraction: 0.5,
            max_tokens: (128, 1024),
            apps: None,
        };
        let jobs = chat(3, &w, Arrival::Closed);
        assert_eq!(chat(3, &w, Arrival::Closed), jobs);
        assert_ne!(chat(4, &w, Arrival::Closed), jobs);
        let unbounded = jobs
            .iter()
            .filter(|j| j.turns[0].max_tokens.is_none())
            .count();
        assert!(
            (unbounded as f64 / 4000.0 - 0.5).abs() < 0.03,
            "{unbounded}"
        );
        let mut lens: Vec<f64> = Vec::new();
        for j in &jobs {
            let t = &j.turns[0];
            let n = n_words(&t.user);
            assert!((199..=3001).contains(&n), "{n}");
            lens.push(n as f64);
            let tag = if t.max_tokens.is_some() {
                "max_tokens"
            } else {
                "none"
            };
            assert_eq!(j.tags, vec![("bound".to_string(), tag.to_string())]);
            assert!(t.max_tokens.is_none_or(|m| (128..=1024).contains(&m)));
        }
        // Log-uniform: the median is the geometric mean of the bounds (≈ 775), the mean
        // (hi − lo) / ln(hi / lo) ≈ 1034.
        lens.sort_by(f64::total_cmp);
        let median = lens[lens.len() / 2];
        let mean = lens.iter().sum::<f64>() / lens.len() as f64;
        assert!((700.0..850.0).contains(&median), "median {median}");
        assert!((970.0..1100.0).contains(&mean), "mean {mean}");
        // Unique prompts: no two requests share their first words.
        let firsts: std::collections::HashSet<String> = jobs
            .iter()
            .map(|j| j.turns[0].user.chars().take(48).collect())
            .collect();
        assert_eq!(firsts.len(), jobs.len());
    }

    #[test]
    fn chat_of_several_applications_tells_each_answer_its_applications_length() {
        let apps = Apps {
            count: 4,
            mean: 256.0,
            between: 1.0,
            within: 0.5,
            opening: 0,
            words: 120,
            context: 0,
        };
        let w = Chat {
            requests: 8000,
            prompt: (200, 300),
            unbounded_fraction: 1.0,
            max_tokens: (128, 1024),
            apps: Some(apps),
        };
        let jobs = chat(5, &w, Arrival::Closed);
        let mut by_app: std::collections::HashMap<String, (String, Vec<f64>)> = Default::default();
        for j in &jobs {
            let app = j
                .tags
                .iter()
                .find(|(k, _)| k == "app")
                .map(|(_, v)| v.clone());
            let length = j.headers.iter().find(|(k, _)| k == "x-sim-output-tokens");
            let (Some(app), Some((_, length)), Some(system)) = (app, length, &j.system) else {
                panic!("{j:?}");
            };
            let e = by_app
                .entry(app)
                .or_insert_with(|| (system.clone(), vec![]));
            assert_eq!(&e.0, system, "one system prompt an application");
            e.1.push(length.parse::<f64>().unwrap().ln());
        }
        assert_eq!(by_app.len(), 4);
        let firsts: std::collections::HashSet<String> = by_app
            .values()
            .map(|(s, _)| s.chars().take(16).collect())
            .collect();
        assert_eq!(firsts.len(), 4, "each application's prompts start apart");
        for (_, logs) in by_app.values() {
            let mean = logs.iter().sum::<f64>() / logs.len() as f64;
            let sd =
                (logs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / logs.len() as f64).sqrt();
            assert!((sd - 0.5).abs() < 0.05, "within one application: {sd}");
        }
        // Over all of them the answers' mean is about the cell's.
        let all: Vec<f64> = by_app
            .values()
            .flat_map(|(_, l)| l.iter().map(|x| x.exp()))
            .collect();
        let mean = all.iter().sum::<f64>() / all.len() as f64;
        assert!((100.0..600.0).contains(&mean), "{mean}");
        // With a shared opening, every application's prompt starts with the same words, then
        // its own; a one-line prompt is its name and a few words.
        let w = Chat {
            apps: Some(Apps {
                opening: 40,
                words: 4,
                ..apps
            }),
            ..w
        };
        let prompts: std::collections::HashSet<String> = chat(5, &w, Arrival::Closed)
            .into_iter()
            .filter_map(|j| j.system)
            .collect();
        assert_eq!(prompts.len(), 4);
        let openings: std::collections::HashSet<&str> = prompts
            .iter()
            .filter_map(|p| p.split_once(". Application ").map(|(o, _)| o))
            .collect();
        assert_eq!(openings.len(), 1, "{prompts:?}");
        assert!(
            prompts.iter().all(|p| n_words(p) == 40 + 3 + 4),
            "{prompts:?}"
        );
        // With a context, each request's system prompt is its application's, then words of its
        // own: no two alike.
        let w = Chat {
            apps: Some(Apps {
                context: 20,
                ..apps
            }),
            ..w
        };
        let jobs = chat(5, &w, Arrival::Closed);
        let prompts: std::collections::HashSet<&str> =
            jobs.iter().filter_map(|j| j.system.as_deref()).collect();
        assert_eq!(prompts.len(), jobs.len());
        let heads: std::collections::HashSet<&str> = prompts
            .iter()
            .filter_map(|p| p.split_once(" Context for request ").map(|(h, _)| h))
            .collect();
        assert_eq!(
            heads.len(),
            4,
            "each application's own words, then the context"
        );
    }

    #[test]
    fn poisson_arrivals_have_the_right_statistics() {
        let rate = 50.0;
        let n = 20_000;
        let t = arrivals(&mut Rng::new(11), n, Arrival::Poisson(rate));
        assert!(t.windows(2).all(|w| w[0] <= w[1]));
        let gaps: Vec<f64> = std::iter::once(t[0])
            .chain(t.windows(2).map(|w| w[1] - w[0]))
            .collect();
        let mean = gaps.iter().sum::<f64>() / n as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / n as f64;
        assert!((mean * rate - 1.0).abs() < 0.03, "mean gap {mean}");
        // Exponential gaps: coefficient of variation 1.
        assert!((var.sqrt() / mean - 1.0).abs() < 0.05);
        // Counts in 1 s windows: Poisson, variance ≈ mean ≈ rate.
        let secs = t[n - 1].floor() as usize;
        let mut counts = vec![0f64; secs];
        for &x in &t {
            if (x as usize) < secs {
                counts[x as usize] += 1.0;
            }
        }
        let m = counts.iter().sum::<f64>() / secs as f64;
        let v = counts.iter().map(|c| (c - m).powi(2)).sum::<f64>() / secs as f64;
        assert!((m / rate - 1.0).abs() < 0.05, "mean count {m}");
        assert!((v / m - 1.0).abs() < 0.25, "dispersion {}", v / m);
        assert!(arrivals(&mut Rng::new(1), 5, Arrival::Burst)
            .iter()
            .all(|&x| x == 0.0));
    }

    #[test]
    fn fixed_body_has_the_requested_size() {
        let jobs = fixed(1, 3, 4096, 8);
        assert_eq!(jobs.len(), 3);
        let len = jobs[0].turns[0].user.len();
        assert!((3700..=4096).contains(&len), "{len}");
    }
}
