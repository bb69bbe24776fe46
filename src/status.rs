//! The status page (`statusPath`): the pool as kvgate sees it at this moment, read from shared
//! data by whichever worker took the request — each pod's budget, reservations, active blocks,
//! requests in flight, scraped queue, the age of its last scrape and its health, the line in
//! front of the pool, and per base model the output prior in force. JSON for tools, a small HTML
//! table for a person (`Accept: text/html`). Stats say how these numbers move over time; this
//! page says what they are now, per pod, without a Prometheus in between.

use crate::admission::forecast::Lag;
use crate::config::Config;
use crate::estimate::calibration::output_prior;
use crate::gate::Gate;
use crate::openai::reply::LocalReply;
use crate::pods::record::{self, At, PodRecord};
use crate::replicas::share::{self, Share};
use crate::store::interface::{Store, StoreError};
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// Whether `path` (its query string ignored) is the configured status path.
pub fn is_status_path(cfg: &Config, path: &str) -> bool {
    let bare = path.split_once('?').map_or(path, |(p, _)| p);
    !cfg.status_path.is_empty() && bare == cfg.status_path
}

/// The answer to a request on the status path: the page for GET and HEAD, 405 otherwise.
pub fn reply(gate: &mut Gate, store: &dyn Store, method: &str, accept: Option<&str>) -> LocalReply {
    if !(method.eq_ignore_ascii_case("GET") || method.eq_ignore_ascii_case("HEAD")) {
        return LocalReply::error(
            405,
            "method_not_allowed",
            "kvgate's status page answers GET only",
            None,
        )
        .with_header("allow", "GET, HEAD".into());
    }
    let page = pool(gate, store);
    let html = accept.is_some_and(|a| a.to_ascii_lowercase().contains("text/html"));
    let (content_type, body) = if html {
        ("text/html; charset=utf-8", render_html(&page).into_bytes())
    } else {
        ("application/json", page.to_string().into_bytes())
    };
    LocalReply {
        status: 200,
        headers: vec![
            ("content-type".into(), content_type.into()),
            // A snapshot of a moment: a cached copy would show a pool that no longer exists.
            ("cache-control".into(), "no-store".into()),
        ],
        body,
    }
}

/// One pod's line of the page.
fn pod(
    cfg: &Config,
    block_tokens: u64,
    pod: &str,
    (rec, share): (&PodRecord, Option<Share>),
    now: u64,
) -> Value {
    let snapshot = rec.snapshot.as_ref();
    let age = snapshot.map(|s| now.saturating_sub(s.at_ms));
    // The same judgements the pool gauges make (gate.rs), from the pod record.
    let stale = rec.is_stale(now, &cfg.metrics);
    let budget = crate::admission::budget::budget_tokens(cfg, snapshot);
    let reserved = rec.forecast(
        None,
        cfg.admission.headroom(),
        block_tokens,
        At::of(cfg, now),
    );
    json!({
        "pod": pod,
        "healthy": !rec.is_down(),
        "stale": stale,
        "lastScrapeAgeMs": age,
        // null: no budget limits this pod.
        "budgetTokens": budget,
        // What admission holds within the budget: the pod's KV forecast (the reserved_tokens
        // gauge), and what its requests hold now.
        "reservedTokens": reserved,
        "heldTokens": rec.held_tokens(),
        // With etcd on (null off): what this replica may reserve on the pod now (the
        // grant_tokens gauge: its grant, scaled down when the budget fell, or its fallback cut
        // off from etcd), and the grant etcd holds for it as far as it knows, which its
        // reservations (read with it) never pass while the grants in etcd sum to at most the
        // budget.
        "grantTokens": share.and(share::cap_of(share, cfg, budget, now)),
        "syncedGrantTokens": share.map(|s| s.published),
        // Lapsed replicas' reclaimed grants held out of the pod's split until a scrape has read
        // the engine since (the ghost_tokens gauge).
        "ghostTokens": share.map(|s| s.ghost_tokens),
        // What the other replicas' requests hold on the pod as last synced: explained, not
        // subtracted, in `unexplainedTokens` (the remote_tokens gauge).
        "remoteTokens": share.map(|s| s.remote_tokens),
        "backoff": snapshot.map(|s| s.backoff),
        "relief": snapshot.map(|s| s.relief),
        "unexplainedTokens": snapshot.map(|s| s.unexplained_tokens),
        // The most output tokens one chunk brought an answer of a stream in flight there: how far
        // behind the engine the forecast counts every answer (null: none seen yet).
        "streamLagTokens": match rec.lag() {
            Lag::Seen(l) => Some(l),
            Lag::Unseen => None,
        },
        "activeBlocks": rec.active_blocks(block_tokens),
        "inFlight": rec.entries.len(),
        // Of those, the requests forecast on the output prior's guess, whose shared error the
        // forecast counts once over them (docs/design.md, *A guess's error is shared*): a fresh
        // pool's first wave, until the lengths learned say the guess was not short.
        "onGuess": rec.entries.iter().filter(|e| e.output_guessed).count(),
        "waiting": snapshot.map(|s| s.waiting),
        "running": snapshot.map(|s| s.running),
        // How many requests the engine runs at once, as configured (`admission.engineSeats`) or
        // learned from its queue (null: neither, and not scraped; 0: not learned): admission
        // holds the pod to that and one more (docs/design.md, *An engine's seats*).
        "engineSeats": match crate::pods::seats::in_force(cfg, snapshot) {
            0 => snapshot.map(|_| 0),
            seats => Some(seats),
        },
        "kvUsage": snapshot.map(|s| s.kv_usage),
        "capacityTokens": snapshot.map(|s| s.capacity_tokens),
    })
}

/// The pod's record, and with etcd on its share (a pod not synced yet: an empty one), read as of
/// one moment: the share again after the record, until it did not change in between (a sync
/// changes it a few times a second, so a second read is rare and a fourth unheard of). Read so,
/// its reservations never pass the grant etcd holds for this replica (`Share::published`); read
/// one after the other, a sync that gave credit back between the reads could show them passing
/// it.
fn with_share(
    store: &dyn Store,
    cfg: &Config,
    pod: &str,
) -> Result<(PodRecord, Option<Share>), StoreError> {
    if !cfg.etcd.enabled() {
        return Ok((record::read(store, pod)?, None));
    }
    let (_, mut at) = share::read_versioned(store, pod)?;
    let mut tries = 0;
    loop {
        let rec = record::read(store, pod)?;
        let (share, now_at) = share::read_versioned(store, pod)?;
        tries += 1;
        if now_at == at || tries == 4 {
            return Ok((rec, Some(share.unwrap_or_default())));
        }
        at = now_at;
    }
}

/// The whole page as data; a pod or the line that cannot be read says so in its place.
fn pool(gate: &mut Gate, store: &dyn Store) -> Value {
    let cfg = &gate.config;
    let now = store.now_ms();
    let block = u64::from(gate.router.block_tokens(&cfg.routing));
    let pods: Vec<Value> = gate
        .router
        .pods()
        .iter()
        .map(|p| match with_share(store, cfg, p) {
            Ok((rec, share)) => pod(cfg, block, p, (&rec, share), now),
            Err(e) => json!({"pod": p, "error": format!("{e:?}")}),
        })
        .collect();
    let line = match crate::admission::line::read(store) {
        Ok(q) => {
            let mut bands: BTreeMap<String, usize> = BTreeMap::new();
            for t in &q.tickets {
                *bands.entry(t.priority.to_string()).or_default() += 1;
            }
            let oldest = q.tickets.iter().map(|t| t.enqueued_ms).min();
            // What `refuseLate` and `Retry-After` read for each set of pods the line measures.
            let paces: Vec<Value> = q
                .drains
                .iter()
                .map(|d| {
                    json!({
                        "pods": d.reach.count_ones(),
                        "admissions": d.drained,
                        "gapMs": d.gap_ms(now),
                        "waitMsPer1kTokens": d.sizes.slope().map(|s| s * 1_000.0),
                    })
                })
                .collect();
            json!({
                "length": q.tickets.len(),
                // Heads of lines of their own: models on pods of their own wait apart.
                "heads": q.leaders().len(),
                "byPriority": bands,
                "oldestWaitMs": oldest.map(|t| now.saturating_sub(t)),
                "paces": paces,
            })
        }
        Err(e) => json!({"error": format!("{e:?}")}),
    };
    json!({
        "vm": gate.vm(),
        "nowMs": now,
        "admission": cfg.admission.enabled,
        "scraping": !cfg.metrics.cluster.is_empty(),
        "blockTokens": gate.router.block_tokens(&cfg.routing),
        "queue": line,
        "pods": pods,
        "models": models(gate, store),
    })
}

/// Each base model the pods list, with the mean answer its output prior assumes until kvgate has
/// learned its lengths (`calibration::output_prior`: the configured one, or its engines'
/// where longer). A pod whose list cannot be read adds none.
fn models(gate: &mut Gate, store: &dyn Store) -> Vec<Value> {
    gate.router
        .base_models(store, &gate.config)
        .iter()
        .map(|m| {
            json!({
                "model": m,
                "outputPriorTokens": output_prior(store, m, &gate.config.estimator).tokens,
            })
        })
        .collect()
}

/// Text made safe inside HTML: pod names come from discovery, errors from the host.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A cell: `null` (not known, or no limit) as a dash, strings unquoted.
fn cell(v: &Value) -> String {
    match v {
        Value::Null => "–".into(),
        Value::String(s) => escape(s),
        Value::Number(n) => n
            .as_f64()
            .filter(|f| f.fract() != 0.0)
            .map_or_else(|| n.to_string(), |f| format!("{f:.2}")),
        other => escape(&other.to_string()),
    }
}

const COLUMNS: [(&str, &str); 12] = [
    ("pod", "pod"),
    ("healthy", "healthy"),
    ("stale", "stale"),
    ("lastScrapeAgeMs", "last scrape (ms ago)"),
    ("budgetTokens", "budget (tokens)"),
    ("reservedTokens", "reserved (tokens)"),
    ("grantTokens", "grant (tokens)"),
    ("activeBlocks", "active blocks"),
    ("inFlight", "in flight"),
    ("waiting", "waiting (scraped)"),
    ("running", "running (scraped)"),
    ("kvUsage", "KV usage (scraped)"),
];

fn render_html(page: &Value) -> String {
    let mut html = String::from(
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>kvgate pool</title>\
         <style>td,th{padding:2px 8px;text-align:right}td:first-child{text-align:left}</style>\
         </head><body>\n<h1>kvgate pool</h1>\n",
    );
    let q = &page["queue"];
    html.push_str(&format!(
        "<p>line: {} waiting behind {} heads (by priority: {}), oldest {} ms; admission {}; seen by VM {}</p>\n",
        cell(&q["length"]),
        cell(&q["heads"]),
        escape(&q["byPriority"].to_string()),
        cell(&q["oldestWaitMs"]),
        if page["admission"] == Value::Bool(true) {
            "on"
        } else {
            "off"
        },
        cell(&page["vm"]),
    ));
    html.push_str("<table>\n<tr>");
    for (_, title) in COLUMNS {
        html.push_str(&format!("<th>{title}</th>"));
    }
    html.push_str("</tr>\n");
    for p in page["pods"].as_array().into_iter().flatten() {
        html.push_str("<tr>");
        for (key, _) in COLUMNS {
            let v = match (&p[key], &p["error"]) {
                (Value::Null, Value::String(e)) if key != "pod" => Value::String(e.clone()),
                (v, _) => v.clone(),
            };
            html.push_str(&format!("<td>{}</td>", cell(&v)));
        }
        html.push_str("</tr>\n");
    }
    html.push_str("</table>\n");
    for m in page["models"].as_array().into_iter().flatten() {
        html.push_str(&format!(
            "<p>{}: answers without max_tokens taken to run {} tokens until learned</p>\n",
            cell(&m["model"]),
            cell(&m["outputPriorTokens"]),
        ));
    }
    html.push_str("</body></html>\n");
    html
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::flow::{Flow, RequestHead, Step};
    use crate::pods::record::Snapshot;
    use crate::store::fake_host::{FakeHost, FakeVm};

    const PODS: [&str; 2] = ["10.0.0.1:80", "10.0.0.2:80"];

    /// A gate with two pods and the status page on, one request in flight on the first pod (its
    /// reservation held), the first pod scraped 1.5 s ago and the second never.
    fn pool_with_one_request() -> (FakeHost, FakeVm, Gate) {
        let host = FakeHost::new();
        let vm = host.vm();
        let mut cfg = Config {
            status_path: "/kvgate/status".into(),
            pods: PODS.iter().map(|p| p.to_string()).collect(),
            ..Config::default()
        };
        cfg.admission.budget_tokens = 10_000;
        cfg.metrics.cluster = "kvgate_metrics".into();
        let mut gate = Gate::new(cfg, &vm).unwrap();
        host.set_now_ms(10_000);
        let snapshot = Snapshot {
            at_ms: 10_000,
            healthy: true,
            running: 1.0,
            waiting: 2.0,
            kv_usage: 0.25,
            capacity_tokens: 50_000,
            block_size: 16,
            ..Snapshot::default()
        };
        record::write_snapshot(&vm, PODS[0], snapshot, 0, &Config::default()).unwrap();
        crate::test_support::lists_failed(&vm, &PODS);
        host.set_now_ms(11_500);
        let mut flow = Flow::default();
        let head = RequestHead::json_post("/v1/completions");
        assert_eq!(
            flow.on_request_headers(&mut gate, &vm, &head).step,
            Step::WaitForBody
        );
        let body = br#"{"model":"m","prompt":"a prompt of a few words","max_tokens":100}"#;
        assert_eq!(flow.on_body(&mut gate, &vm, body).step, Step::Forward);
        (host, vm, gate)
    }

    fn get(gate: &mut Gate, vm: &FakeVm, path: &str, accept: Option<&str>) -> Step {
        let head = RequestHead {
            method: "GET",
            path,
            accept,
            ..RequestHead::default()
        };
        Flow::default().on_request_headers(gate, vm, &head).step
    }

    /// A request without `max_tokens` of a model nothing has measured is on the prior's guess,
    /// and its pod shows it.
    #[test]
    fn the_page_counts_the_requests_on_the_priors_guess() {
        let (_host, vm, mut gate) = pool_with_one_request();
        let mut flow = Flow::default();
        let head = RequestHead::json_post("/v1/completions");
        flow.on_request_headers(&mut gate, &vm, &head);
        let body = br#"{"model":"m","prompt":"a prompt of a few words","max_tokens":null}"#;
        assert_eq!(flow.on_body(&mut gate, &vm, body).step, Step::Forward);
        let Step::Reply(r) = get(&mut gate, &vm, "/kvgate/status", None) else {
            panic!("the status path is answered locally");
        };
        let page: Value = serde_json::from_slice(&r.body).unwrap();
        let pods = page["pods"].as_array().unwrap();
        let count = |key: &str| pods.iter().map(|p| p[key].as_u64().unwrap()).sum::<u64>();
        assert_eq!((count("inFlight"), count("onGuess")), (2, 1), "{pods:?}");
    }

    /// The pods list one base model (and an adapter of it), whose engines report answers of 700
    /// tokens on average: the page shows the prior kvgate assumes for it, theirs.
    #[test]
    fn the_page_shows_each_listed_models_output_prior() {
        use crate::estimate::engine_lengths::EngineLengths;
        use crate::models::served::ServedModel;
        use crate::pods::metrics::AnswerTotals;
        let (host, vm, mut gate) = pool_with_one_request();
        let listed = [
            ServedModel {
                id: "m".into(),
                parent: None,
            },
            ServedModel {
                id: "m-lora".into(),
                parent: Some("m".into()),
            },
        ];
        for pod in PODS {
            crate::models::served::write_list(&vm, pod, &listed, host.now_ms()).unwrap();
        }
        // The page shows the lists as the VM last read them, at most half a second ago.
        host.advance_ms(1_000);
        let page = |gate: &mut Gate| {
            let Step::Reply(r) = get(gate, &vm, "/kvgate/status", None) else {
                panic!("the status path is answered locally");
            };
            serde_json::from_slice::<Value>(&r.body).unwrap()["models"].clone()
        };
        assert_eq!(
            page(&mut gate),
            json!([{"model": "m", "outputPriorTokens": 256}])
        );
        let answers = AnswerTotals {
            model: crate::hash::fnv1a(b"m"),
            tokens: 70_000.0,
            count: 100.0,
        };
        EngineLengths::default()
            .note(&vm, PODS[0], answers, host.now_ms())
            .unwrap();
        assert_eq!(
            page(&mut gate),
            json!([{"model": "m", "outputPriorTokens": 700}])
        );
        let Step::Reply(r) = get(&mut gate, &vm, "/kvgate/status", Some("text/html")) else {
            panic!("answered locally");
        };
        let html = String::from_utf8(r.body).unwrap();
        assert!(html.contains("m: answers without max_tokens taken to run 700 tokens"));
    }

    #[test]
    fn the_page_shows_each_pod_as_shared_data_holds_it() {
        let (host, vm, mut gate) = pool_with_one_request();
        let Step::Reply(r) = get(&mut gate, &vm, "/kvgate/status?x=1", None) else {
            panic!("the status path is answered locally");
        };
        assert_eq!(r.status, 200);
        assert!(r
            .headers
            .contains(&("content-type".into(), "application/json".into())));
        let page: Value = serde_json::from_slice(&r.body).unwrap();
        let pods = page["pods"].as_array().unwrap();
        let busy = pods
            .iter()
            .find(|p| p["inFlight"] == 1)
            .expect("the request is in flight on one pod");
        let reserved = busy["reservedTokens"].as_u64().unwrap();
        assert!(reserved >= 64, "at least the minimum reservation: {busy}");
        assert_eq!(
            busy["onGuess"], 0,
            "a request with max_tokens runs to it: {busy}"
        );
        assert!(busy["activeBlocks"].as_u64().unwrap() > 0, "{busy}");
        assert_eq!(busy["budgetTokens"], 10_000);
        let scraped = pods.iter().find(|p| p["pod"] == PODS[0]).unwrap();
        assert_eq!(
            (
                &scraped["lastScrapeAgeMs"],
                &scraped["waiting"],
                &scraped["stale"]
            ),
            (&json!(1_500), &json!(2.0), &json!(false))
        );
        let never = pods.iter().find(|p| p["pod"] == PODS[1]).unwrap();
        assert_eq!(
            (
                &never["lastScrapeAgeMs"],
                &never["stale"],
                &never["healthy"]
            ),
            (&Value::Null, &json!(true), &json!(true)),
            "never scraped: stale, but not held against"
        );
        assert_eq!(page["queue"]["length"], 0);
        assert_eq!(page["queue"]["heads"], 0);
        let ticket = |id, enqueued_ms, cost, reach| crate::admission::line::Ticket {
            id,
            vm: 1,
            priority: 0,
            boosted: false,
            start_tag: 0.0,
            enqueued_ms,
            deadline_ms: u64::MAX / 2,
            cost,
            wants: 0,
            reach,
            need: 0,
        };
        // Two tickets for pods of their own, then one for both, which waits behind them.
        for (id, reach) in [(1, 1), (2, 2), (3, 3)] {
            let t = ticket(id, id, 10, reach);
            crate::admission::line::enqueue(&vm, t, id, 0.0, 10)
                .unwrap()
                .unwrap();
            let Step::Reply(r) = get(&mut gate, &vm, "/kvgate/status", None) else {
                panic!("no page");
            };
            let page: Value = serde_json::from_slice(&r.body).unwrap();
            assert_eq!(page["queue"]["heads"], json!(id.min(2)), "{id}");
        }
        // The line's pace on the pods of 1, once 32 of tickets of 500 and 1,500 tokens have
        // left it every 100 ms, the larger waiting 100 ms longer: 0.1 ms a token.
        for n in 0..40u64 {
            let t = ticket(100 + n, host.now_ms(), 500 + 1_000 * (n % 2), 1);
            crate::admission::line::enqueue(&vm, t, 1, 0.0, 100)
                .unwrap()
                .unwrap();
            host.advance_ms(100 + 100 * (n % 2));
            let left = crate::admission::line::Leave::Admitted(1);
            assert!(crate::admission::line::remove(&vm, 100 + n, left).unwrap());
        }
        let Step::Reply(r) = get(&mut gate, &vm, "/kvgate/status", None) else {
            panic!("no page");
        };
        let page: Value = serde_json::from_slice(&r.body).unwrap();
        let pace = &page["queue"]["paces"][0];
        assert_eq!(
            (&pace["pods"], &pace["admissions"]),
            (&json!(1), &json!(39))
        );
        let gap = pace["gapMs"].as_f64().unwrap();
        assert!((150.0..=160.0).contains(&gap), "{gap}");
        let slope = pace["waitMsPer1kTokens"].as_f64().unwrap();
        assert!((slope - 100.0).abs() < 1e-6, "{slope}");
    }

    #[test]
    fn a_person_asking_for_html_gets_a_table_with_names_escaped() {
        let (_host, vm, mut gate) = pool_with_one_request();
        let Step::Reply(r) = get(
            &mut gate,
            &vm,
            "/kvgate/status",
            Some("text/html,application/xhtml+xml"),
        ) else {
            panic!("answered locally");
        };
        let html = String::from_utf8(r.body).unwrap();
        assert!(r.headers[0].1.starts_with("text/html"));
        assert_eq!(html.matches("<tr><td>").count(), 2, "one row per pod");
        assert!(html.contains("<td>10.0.0.1:80</td><td>true</td><td>false</td><td>1500</td>"));
        assert!(html.contains("<td>0.25</td>"), "fractions shown as such");
        assert_eq!(escape("<b x='1'>&\""), "&lt;b x=&#39;1&#39;&gt;&amp;&quot;");
        gate.config.status_path = "/s".into();
        let json = get(&mut gate, &vm, "/s", Some("application/json"));
        assert!(matches!(json, Step::Reply(r) if r.headers[0].1 == "application/json"));
    }

    fn page(gate: &mut Gate, vm: &FakeVm) -> Value {
        let Step::Reply(r) = get(gate, vm, "/kvgate/status", None) else {
            panic!("the status path is answered locally");
        };
        serde_json::from_slice(&r.body).unwrap()
    }

    #[test]
    fn with_etcd_on_each_pod_shows_this_replicas_grant() {
        let (host, vm, mut gate) = pool_with_one_request();
        let grants = |gate: &mut Gate| {
            page(gate, &vm)["pods"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| (p["grantTokens"].clone(), p["syncedGrantTokens"].clone()))
                .collect::<Vec<_>>()
        };
        let none = (Value::Null, Value::Null);
        assert_eq!(grants(&mut gate), [none.clone(), none], "etcd off");
        gate.config.etcd.cluster = "etcd".into();
        gate.config.etcd.max_replicas = 10;
        let now = host.now_ms();
        // The never-scraped pod, whose budget is the configured one.
        // A sync has lowered the grant admission reads, and not yet written it to etcd.
        share::modify(&vm, PODS[1], |s| {
            (s.grant, s.published, s.granted, s.contact_ms) = (1_234, 1_500, 5_000, now);
            s.remote_tokens = 77;
        })
        .unwrap();
        assert_eq!(
            grants(&mut gate),
            [(json!(0), json!(0)), (json!(1_234), json!(1_500))],
            "in contact, within the budget: the grant; a pod with no share: nothing"
        );
        let remote = |p: &Value| p["remoteTokens"].clone();
        let pods = page(&mut gate, &vm)["pods"].as_array().unwrap().clone();
        assert_eq!(
            pods.iter().map(remote).collect::<Vec<_>>(),
            [json!(0), json!(77)]
        );
        host.set_now_ms(now + 60_000);
        assert_eq!(
            grants(&mut gate)[1],
            (json!(10_000 / 10), json!(1_500)),
            "cut off from etcd: the fallback"
        );
    }

    #[test]
    fn the_page_is_off_by_default_and_answers_only_reads() {
        let (_host, vm, mut gate) = pool_with_one_request();
        let post = RequestHead::json_post("/kvgate/status");
        let d = Flow::default().on_request_headers(&mut gate, &vm, &post);
        assert!(matches!(&d.step, Step::Reply(r) if r.status == 405));
        assert!(d.remove.contains(&crate::flow::DESTINATION_HEADER));
        assert_eq!(
            get(&mut gate, &vm, "/kvgate/status/other", None),
            Step::Forward,
            "only the exact path"
        );
        gate.config.status_path = String::new();
        assert_eq!(get(&mut gate, &vm, "/kvgate/status", None), Step::Forward);
        assert_eq!(get(&mut gate, &vm, "", None), Step::Forward);
    }
}
