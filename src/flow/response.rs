//! The response side of a request's way through kvgate: the debug headers and the access log's
//! line (one report, `accessLog`), where the response really came from (`observe`), metering
//! what streams (the entry grows with it), and the end — the release, exactly once, and what the
//! engine's `usage` says of the estimate (stats and calibration). The request side is `flow`'s
//! `mod.rs`.

use super::decode::Decoder;
use super::{Admitted, Flow, Gate, Sought};
use crate::estimate::calibration::{Length, Sample};
use crate::estimate::reservation::Ended;
use crate::observe;
use crate::openai::reply::{LocalReply, REASON_HEADER};
use crate::openai::response::ResponseMeter;
use crate::routing::stored;
use crate::stats;
use crate::store::interface::Store;

/// Client text made fit for a response header: visible ASCII only, at most 128 characters, so a
/// crafted value cannot split the response or bloat it.
pub(super) fn header_safe(value: &str) -> String {
    value
        .chars()
        .map(|c| if (' '..='~').contains(&c) { c } else { '?' })
        .take(128)
        .collect()
}

/// The decision headers as one line for an access log: `key=value` pairs (logfmt), each key its
/// header's name without `x-kvgate-`, `-` as `_`; a value with a space, `"` or `=` in quotes, and
/// an empty one (the ranking, built only for the headers) left out.
fn access_log_line(headers: &[(&str, String)]) -> String {
    let len: usize = headers.iter().map(|(k, v)| k.len() + v.len() + 4).sum();
    let mut line = String::with_capacity(len);
    for (name, value) in headers.iter().filter(|(_, v)| !v.is_empty()) {
        if !line.is_empty() {
            line.push(' ');
        }
        let key = name.strip_prefix("x-kvgate-").unwrap_or(name);
        for (i, part) in key.split('-').enumerate() {
            if i > 0 {
                line.push('_');
            }
            line.push_str(part);
        }
        line.push('=');
        if !value.bytes().any(|b| matches!(b, b' ' | b'"' | b'=')) {
            line.push_str(value);
            continue;
        }
        line.push('"');
        let mut rest = value.as_str();
        while let Some(at) = rest.find(['"', '\\']) {
            // `at` is where a one-byte character starts: both splits fall on boundaries.
            let (before, after) = rest.split_at(at);
            let (found, after) = after.split_at(1);
            line.push_str(before);
            line.push('\\');
            line.push_str(found);
            rest = after;
        }
        line.push_str(rest);
        line.push('"');
    }
    line
}

/// How far an estimate was from what the engine counted, in whole percent of the count (any
/// estimate of something the engine counted none of is 100 % off).
fn error_percent(estimated: u64, counted: u64) -> u64 {
    if counted == 0 {
        return if estimated == 0 { 0 } else { 100 };
    }
    (100.0 * estimated.abs_diff(counted) as f64 / counted as f64).round() as u64
}

impl Admitted {
    /// What the debug headers and the access log say of any request kvgate estimated: the
    /// model it was asked for, the estimate, the wait, the model it was sent as.
    fn report(&self) -> Vec<(&'static str, String)> {
        // Room for every header at once.
        let mut headers = Vec::with_capacity(10);
        headers.extend([
            (
                "x-kvgate-model",
                header_safe(self.requested.as_ref().unwrap_or(&self.model)),
            ),
            (
                "x-kvgate-prompt-tokens",
                self.estimate.prompt_tokens.to_string(),
            ),
            (
                "x-kvgate-output-tokens",
                self.estimate.output_tokens.to_string(),
            ),
            ("x-kvgate-cost", self.estimate.cost.to_string()),
        ]);
        if let Some(ms) = self.waited_ms {
            headers.push(("x-kvgate-queue-ms", ms.to_string()));
        }
        if self.requested.is_some() {
            headers.push(("x-kvgate-target-model", header_safe(&self.model)));
        }
        headers
    }
}

impl Flow {
    /// Whether the response headers are worth reading (only for requests kvgate decided on):
    /// otherwise `on_response_headers` does nothing.
    pub fn reads_response_headers(&self) -> bool {
        self.admitted.is_some()
    }

    /// The response has started (returns the debug headers to add, when enabled); `served_by` is the upstream host Envoy used (after retries).
    pub fn on_response_headers(
        &mut self,
        gate: &mut Gate,
        store: &dyn Store,
        content_type: Option<&str>,
        served_by: Option<&str>,
    ) -> Vec<(&'static str, String)> {
        let Some(a) = &mut self.admitted else {
            return Vec::new();
        };
        let (debug, logged) = (gate.config.debug_headers, gate.config.access_log);
        let mut observed = None;
        if let Some(routed) = &mut a.routed {
            let picked = (debug || logged).then(|| routed.pod.clone());
            if let Some(host) = served_by {
                observe::served(gate, store, routed, host);
            }
            observed = picked.and_then(|p| observe::header(&gate.config, routed, self.class, &p));
        }
        let meter = ResponseMeter::new(content_type).answering(a.estimate.choices);
        self.meter = Some(if a.stored {
            a.answered_by = served_by
                .map(str::to_string)
                .or_else(|| a.routed.as_ref().map(|r| r.pod.clone()));
            meter.keeping_id()
        } else {
            meter
        });
        let a = &*a;
        if !debug && !logged {
            return Vec::new();
        }
        let mut headers = a.report();
        if let Some(r) = &a.routed {
            headers.push(("x-kvgate-pod", r.pod.clone()));
            headers.push((
                "x-kvgate-prefix-blocks",
                format!("{}/{}", r.cached_blocks, r.prompt_blocks),
            ));
            headers.push(("x-kvgate-ranking", r.ranking.clone()));
        }
        if let Some(observed) = observed {
            headers.push(("x-kvgate-observed", observed));
        }
        // kvgate's own reply passes here too (Envoy sends a local reply through the filter that
        // sent it): its line says why (`refused`), and stays.
        if logged && self.access_log.is_none() {
            self.access_log = Some(access_log_line(&headers));
        }
        if !debug {
            headers.clear();
        }
        headers
    }

    /// The request's line for Envoy's access log (`accessLog`), when Envoy logs the request
    /// (proxy-wasm's `on_log`, which Envoy 1.40 calls before the access loggers it is
    /// configured with, and before `on_done`), at `now_ms`; taken once. The report made when
    /// its response started, with what the engine's `usage` counted beside the estimate (each
    /// request's error, where the stats sum them); a refusal's (`refused`); or, for a client
    /// that left while its request waited in the line, `reason=client_left` with what was
    /// known of it and how long it had waited (`now_ms`, read only then); one that left while
    /// its request was held for the stored response it names, alike with its model and how long
    /// it was held (`held_ms`).
    pub fn take_access_log(&mut self, now_ms: impl FnOnce() -> u64) -> Option<String> {
        if !self.logs {
            return None;
        }
        // A client that left while held: what was known of its request, and how long it was
        // held, for the stored response it names or in the line.
        let left = if let Some(seeking) = &self.seeking {
            let known = match &seeking.what {
                Sought::FollowUp(parsed) => vec![("x-kvgate-model", parsed.0.model.clone())],
                Sought::Retrieval(_) => Vec::new(),
            };
            Some((known, "x-kvgate-held-ms", seeking.since_ms))
        } else {
            self.admitted
                .as_ref()
                .and_then(|a| Some((a, a.waiting.as_ref()?)))
                .map(|(a, (ticket, _))| (a.report(), "x-kvgate-queue-ms", ticket.enqueued_ms))
        };
        if let Some((known, held, since)) = left {
            let mut fields = vec![("x-kvgate-reason", "client_left".to_string())];
            fields.extend(known);
            fields.push((held, now_ms().saturating_sub(since).to_string()));
            return Some(access_log_line(&fields));
        }
        let mut line = self.access_log.take()?;
        // The body is over when Envoy logs: its usage is what `on_done` reads (`finish` again
        // gives the same).
        if let Some(usage) = self.meter.as_mut().and_then(ResponseMeter::finish) {
            let used = [
                ("used-prompt-tokens", usage.prompt_tokens.to_string()),
                ("used-output-tokens", usage.completion_tokens.to_string()),
            ];
            line.push(' ');
            line.push_str(&access_log_line(&used));
        }
        Some(line)
    }

    /// kvgate answers the request itself (`Flow::shaped`): its access log line says why (the
    /// reply's `x-kvgate-reason`), and what kvgate knew of the request by then, its model and
    /// estimate and how long it waited in the line, so an operator reading a 429 or 503 sees
    /// which model's line was full and what the request would have cost. A reply that is no
    /// refusal (the status page, the model list) is not kvgate's report.
    pub(super) fn refused(&mut self, reply: &LocalReply) {
        let Some((_, reason)) = reply.headers.iter().find(|(k, _)| k == REASON_HEADER) else {
            return;
        };
        let mut fields = vec![("x-kvgate-reason", reason.clone())];
        if let Some(a) = &self.admitted {
            fields.extend(a.report());
        }
        self.access_log = Some(access_log_line(&fields));
    }

    /// The response's body comes encoded (its `content-encoding` names a coding other than
    /// `identity`): a compressor filter placed after kvgate in the chain (clients such as
    /// OpenAI's SDKs ask for gzip), or an upstream that compresses. gzip and brotli are decoded
    /// as they stream (`decode`) and the answer metered as a plain one
    /// (`kvgate.response.decoded`), while this VM has room for their decoders
    /// (`decode::Room`). Any other is `unmetered`. Returns whether the request must now be grown
    /// on the tick (`answers_unseen`), when it was not already.
    pub fn on_response_encoded(&mut self, gate: &mut Gate, coding: &str) -> bool {
        if !super::encoded(coding) || self.meter.is_none() {
            return false;
        }
        if let Some(d) = Decoder::open(coding, &mut gate.decoders) {
            self.decoder = Some(d);
            return false;
        }
        self.unmetered(gate, coding)
    }

    /// An answer whose body kvgate cannot read (a coding it does not decode, too many decoded
    /// at once, a gzip body that is not): neither its tokens nor its usage can be read, so it is
    /// not metered: its entry grows at its pod's pace on the tick to the end, as an answer that
    /// does not stream does until its body comes (the reservation keeps following the engine's
    /// KV), and it teaches calibration nothing. Counted (`kvgate.response.encoded`) and told once
    /// per VM, with the fix. Returns whether the request must now be grown on the tick.
    fn unmetered(&mut self, gate: &mut Gate, coding: &str) -> bool {
        let coding = coding.trim();
        self.meter = None;
        gate.stats.count(stats::RESPONSE_ENCODED, 1);
        if !std::mem::replace(&mut gate.told_encoded, true) {
            log::warn!(
                "an answer reached kvgate encoded (content-encoding: {}) that it cannot decode: \
                 its tokens and usage cannot be read, so its reservation grows at the pod's pace \
                 and calibration learns nothing from it; put the compressor filter before kvgate \
                 in http_filters (kvgate.response.encoded counts such answers)",
                header_safe(coding)
            );
        }
        let Some(a) = self.admitted.as_mut().filter(|a| a.streams) else {
            return false;
        };
        a.streams = false;
        gate.unseen_answers += 1;
        true
    }

    /// Whether the response body is worth reading (only for requests kvgate decided on).
    pub fn reads_response(&self) -> bool {
        self.meter.is_some()
    }

    /// The next piece of the response body, decoded first when it comes compressed. Returns
    /// whether the request must now be grown on the tick: its coding turned out broken, or its
    /// brotli window found no room in the VM.
    pub fn on_response_body(&mut self, gate: &mut Gate, store: &dyn Store, bytes: &[u8]) -> bool {
        let Some(mut d) = self.decoder.take() else {
            self.meter_body(gate, store, bytes);
            return false;
        };
        let mut room = std::mem::take(&mut gate.decoders);
        let fed = d.feed(&mut room, bytes, &mut |text| {
            self.meter_body(gate, store, text)
        });
        gate.decoders = room;
        if fed.is_ok() {
            self.decoder = Some(d);
            return false;
        }
        let coding = d.coding();
        d.close(&mut gate.decoders);
        self.unmetered(gate, coding)
    }

    /// Frees this answer's decoder at its end, if it has one: an answer decoded to its end
    /// (`kvgate.response.decoded`).
    fn close_decoder(&mut self, gate: &mut Gate) {
        if let Some(d) = self.decoder.take() {
            d.close(&mut gate.decoders);
            gate.stats.count(stats::RESPONSE_DECODED, 1);
        }
    }

    fn meter_body(&mut self, gate: &mut Gate, store: &dyn Store, bytes: &[u8]) {
        let (Some(m), Some(a)) = (&mut self.meter, &mut self.admitted) else {
            return;
        };
        let pieces = m.feed(bytes);
        // A request for several answers: an answer's end frees its tokens, in a chunk of no text.
        let ended = m.ended();
        let ends = a
            .routed
            .as_ref()
            .is_some_and(|r| ended.answers > r.ended.answers);
        if pieces == 0 && !ends {
            return;
        }
        let made = a.made(m.pieces);
        let ended = Ended {
            answers: ended.answers,
            tokens: a.made(ended.pieces),
        };
        let (model, family) = (&a.model, a.family.as_deref());
        // The cohort follows answers: one of its choices has run about their mean.
        let answer = made / a.estimate.choices.max(1);
        let moved = match &mut a.started {
            Some(at) => gate.calibration.streamed(model, family, at, answer, None),
            // An answer the engine holds on past where the model may stop teaches no length
            // (`Length::Untold`).
            None if a.estimate.output.held_on() => false,
            None => {
                a.started = gate
                    .calibration
                    .started(model, family, &gate.config.estimator);
                false
            }
        };
        if moved {
            // Its outlook from here on is read from the lengths learned now, not those it was
            // admitted with: answers admitted in a pool's first seconds, when little had ended,
            // would otherwise be forecast from the prior's tail for as long as they run.
            let cfg = &gate.config.estimator;
            if let Some(l) = gate.calibration.learned(store, model, family, cfg) {
                let est = &mut a.estimate;
                est.output = est.output.relearned(l.output);
                // Admitted on the prior's guess: its pod's forecast counts the guess's error for
                // it (`admission::forecast`) for as long as what is learned says the answers run
                // longer than the guess. The first lengths learned are the short ones (those
                // that ended first), so a guess they already pass was short by at least that
                // much; one they do not pass erred long, or not at all, and is dropped.
                if est.output_guessed {
                    let choices = est.choices.max(1);
                    est.output_guessed = est.output.expected(0, est.max_output_tokens / choices)
                        > est.output_tokens / choices;
                }
            }
        }
        let brought = a.made(pieces);
        if let Some(routed) = &mut a.routed {
            // A chunk that only ends an answer carries no token: no step of the engine to time.
            if gate.config.routing.step_phase && pieces > 0 {
                gate.router.streamed(store, routed, pieces);
            }
            if a.streams && pieces > 0 {
                // What the chunk brought each answer running when it came: the engine had made
                // (and allocated KV for) that many before the filter saw the first of them.
                let running = a
                    .estimate
                    .choices
                    .saturating_sub(routed.ended.answers)
                    .max(1);
                let each = brought.div_ceil(running);
                routed.lag = routed.lag.max(u16::try_from(each).unwrap_or(u16::MAX));
            }
            if let Err(e) = gate
                .router
                .grow(store, &gate.config, routed, &a.estimate, made, ended)
            {
                log::debug!("grow failed: {e:?}");
            }
        }
    }

    /// Whether the answer will not be metered as it streams, so that the VM's tick grows its
    /// entry (`on_tick`): known once the body is read (or, for an answer that comes encoded,
    /// once its response begins), for as long as the request is open.
    pub fn answers_unseen(&self) -> bool {
        self.admitted.as_ref().is_some_and(|a| !a.streams)
    }

    /// The VM's tick, for an answer that does not stream and has not begun, or that comes
    /// encoded: its entry grows at the pod's pace (`Router::grow_unseen`). Once a readable
    /// response begins its body follows at once, metered as it comes.
    pub fn on_tick(&mut self, gate: &mut Gate, store: &dyn Store) {
        if self.finished || self.meter.is_some() {
            return;
        }
        let Some(a) = self.admitted.as_mut().filter(|a| !a.streams) else {
            return;
        };
        if let Some(routed) = &mut a.routed {
            if let Err(e) = gate
                .router
                .grow_unseen(store, &gate.config, routed, &a.estimate)
            {
                log::debug!("growing an unseen answer failed: {e:?}");
            }
        }
    }

    /// The stream is over, however it ended. Runs its effects once even if called again.
    pub fn on_done(&mut self, gate: &mut Gate, store: &dyn Store) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        self.close_decoder(gate);
        if self.answers_unseen() {
            gate.unseen_answers = gate.unseen_answers.saturating_sub(1);
        }
        // The client left while the request was held.
        self.end_seeking(gate);
        if let Some((ticket, _)) = self.admitted.as_ref().and_then(|a| a.waiting.as_ref()) {
            // The client left while parked.
            gate.admission.abandon(store, &mut gate.stats, ticket.id);
        }
        if let Some(routed) = self.admitted.as_ref().and_then(|a| a.routed.as_ref()) {
            match gate.router.finish(store, routed) {
                Ok(_) => {
                    if let Err(e) = gate.admission.wake_head(store) {
                        log::debug!("waking the queue failed: {e:?}");
                    }
                }
                // The entry expires by itself (routing.requestTtlMs).
                Err(e) => log::warn!(
                    "release of {} on {} failed: {e:?}",
                    routed.request,
                    routed.pod
                ),
            }
            if let Some(session) = self
                .class
                .session
                .filter(|_| gate.config.admission.session_boost_ms > 0)
            {
                if let Err(e) = crate::admission::sessions::finished_turn(store, session) {
                    log::debug!("session record failed: {e:?}");
                }
            }
        }
        let (Some(a), Some(meter)) = (&mut self.admitted, &mut self.meter) else {
            return;
        };
        let usage = meter.finish();
        let length = usage.map(|u| {
            if a.estimate.output.held_on() {
                Length::Untold
            } else if a
                .max_output_tokens
                .is_some_and(|m| u.completion_tokens >= m)
            {
                Length::Cut
            } else {
                Length::Ended
            }
        });
        // Without usage the stream was lost: the answer is known to have run this far.
        let tokens = usage.map_or(a.made(meter.pieces), |u| u.completion_tokens);
        let ended = length == Some(Length::Ended);
        let answer = tokens / a.estimate.choices.max(1);
        if let Some(routed) = a.routed.as_ref().filter(|_| !a.streams && usage.is_some()) {
            // An answer grown at its pod's pace (`on_tick`) ended: how long before its tokens
            // began is learned for the next ones.
            gate.router.unseen_ended(store, routed, answer);
        }
        if let Some(at) = &mut a.started {
            gate.calibration
                .streamed(&a.model, a.family.as_deref(), at, answer, Some(ended));
        }
        if let (Some(id), Some(pod)) = (&meter.response_id, &a.answered_by) {
            // Its conversation so far as the engine counted it; a response answered in the
            // background (`background: true`, polled by `GET`) has no usage yet: as estimated.
            let conversation = usage
                .map_or(a.estimate.prompt_tokens + a.estimate.output_tokens, |u| {
                    u.prompt_tokens.saturating_add(u.completion_tokens)
                });
            gate.note_stored(store, stored::id_hash(id), pod, conversation);
        }
        let (Some(usage), Some(length)) = (usage, length) else {
            return;
        };
        // The estimate beside what the engine reported, summed: ratios of their rates are the
        // estimator's error over any window (the dashboard's accuracy panel, the drift alerts).
        let stats = &mut gate.stats;
        stats.count(stats::ESTIMATE_PROMPT_TOKENS, a.estimate.prompt_tokens);
        stats.count(stats::USAGE_PROMPT_TOKENS, usage.prompt_tokens);
        stats.count(stats::ESTIMATE_OUTPUT_TOKENS, a.estimate.output_tokens);
        stats.count(stats::USAGE_COMPLETION_TOKENS, usage.completion_tokens);
        stats.count(stats::ESTIMATE_COST_TOKENS, a.estimate.cost);
        stats.count(
            stats::USAGE_TOTAL_TOKENS,
            usage.prompt_tokens + usage.completion_tokens,
        );
        stats.count(
            stats::model_stat(&a.stat_model, stats::MODEL_PROMPT_TOKENS),
            usage.prompt_tokens,
        );
        stats.count(
            stats::model_stat(&a.stat_model, stats::MODEL_COMPLETION_TOKENS),
            usage.completion_tokens,
        );
        for (stat, estimated, counted) in [
            (
                stats::MODEL_PROMPT_ERROR_PCT,
                a.estimate.prompt_tokens,
                usage.prompt_tokens,
            ),
            (
                stats::MODEL_OUTPUT_ERROR_PCT,
                a.estimate.output_tokens,
                usage.completion_tokens,
            ),
        ] {
            stats.histogram(
                stats::model_stat(&a.stat_model, stat),
                error_percent(estimated, counted),
            );
        }
        let sample = Sample {
            static_text_tokens: a.static_text_tokens,
            templated: a.templated,
            known_tokens: a.known_tokens,
            parts: a.parts,
            prompts: a.estimate.prompts,
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: usage.completion_tokens,
            choices: a.estimate.choices,
            length,
            bounded: a.max_output_tokens.is_some(),
            pieces: meter.pieces,
            template: a.template,
        };
        gate.calibration.observe(
            &a.model,
            a.family.as_deref(),
            sample,
            &gate.config.estimator,
        );
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::flow::{Decision, RequestHead, Step};
    use crate::stats::Stat;
    use crate::store::fake_host::FakeHost;

    /// Without debug headers the client sees none, and the access log still gets the report,
    /// but the ranking (built for the headers only); with `accessLog` off, nothing.
    #[test]
    fn the_access_log_gets_the_report_the_headers_would_carry() {
        let pod = "10.0.0.1:80";
        for logged in [true, false] {
            let host = FakeHost::new();
            let vm = host.vm();
            let mut cfg = crate::test_support::with_pods(&[pod]);
            cfg.access_log = logged;
            let mut gate = Gate::new(cfg, &vm).unwrap();
            let mut f = Flow::default();
            f.on_request_headers(&mut gate, &vm, &RequestHead::json_post("/v1/completions"));
            let body = br#"{"model":"a \"quoted\" name","prompt":"hello there","max_tokens":20}"#;
            f.on_body(&mut gate, &vm, body);
            let json = Some("application/json");
            let headers = f.on_response_headers(&mut gate, &vm, json, Some(pod));
            assert!(headers.is_empty());
            let answer = br#"{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":7}}"#;
            f.on_response_body(&mut gate, &vm, answer);
            let line = f.take_access_log(|| 0);
            if !logged {
                assert_eq!(line, None);
                continue;
            }
            let line = line.unwrap();
            assert!(
                line.starts_with(r#"model="a \"quoted\" name" prompt_tokens="#),
                "{line}"
            );
            // What the engine counted, beside the estimate.
            assert!(
                line.ends_with(
                    " pod=10.0.0.1:80 prefix_blocks=0/1 used_prompt_tokens=4 used_output_tokens=7"
                ),
                "{line}"
            );
        }
        let line = access_log_line(&[
            ("x-kvgate-queue-ms", "12".into()),
            ("x-kvgate-ranking", String::new()),
            ("x-kvgate-observed", "pick=b, would-wait".into()),
            ("x-kvgate-model", r"a\b=c".into()),
        ]);
        assert_eq!(
            line,
            r#"queue_ms=12 observed="pick=b, would-wait" model="a\\b=c""#
        );
    }

    /// A request kvgate answers itself leaves a line too: why, and what kvgate knew of it by
    /// then (none of it for a body it could not read); a reply that is no refusal, none.
    #[test]
    fn a_refusal_logs_its_reason_and_what_was_known_of_the_request() {
        let pod = "10.0.0.1:80";
        let host = FakeHost::new();
        let vm = host.vm();
        let mut gate = Gate::new(crate::test_support::with_pods(&[pod]), &vm).unwrap();
        let head = RequestHead::json_post("/v1/completions");
        let mut f = Flow::default();
        f.on_request_headers(&mut gate, &vm, &head);
        let d = f.on_body(&mut gate, &vm, b"{oops");
        let d = f.shaped(d);
        assert!(matches!(d.step, Step::Reply(ref r) if r.status == 400));
        assert_eq!(
            f.take_access_log(|| 0).as_deref(),
            Some("reason=invalid_request_error")
        );
        let mut f = Flow::default();
        f.on_request_headers(&mut gate, &vm, &head);
        f.on_body(
            &mut gate,
            &vm,
            br#"{"model":"m","prompt":"hello","max_tokens":9}"#,
        );
        let late = LocalReply::error(503, "service_unavailable", "no room", None);
        f.shaped(Decision::step(Step::Reply(late)));
        let line = f.take_access_log(|| 0).unwrap();
        assert!(
            line.starts_with("reason=service_unavailable model=m prompt_tokens="),
            "{line}"
        );
        assert!(line.contains(" output_tokens=9 cost="), "{line}");
        let status = LocalReply {
            status: 200,
            headers: Vec::new(),
            body: Vec::new(),
        };
        f.shaped(Decision::step(Step::Reply(status)));
        assert_eq!(f.take_access_log(|| 0), None);
    }

    #[test]
    fn errors_are_whole_percent_of_what_the_engine_counted() {
        assert_eq!(error_percent(110, 100), 10);
        assert_eq!(error_percent(50, 200), 75);
        assert_eq!(error_percent(0, 0), 0);
        assert_eq!(error_percent(7, 0), 100);
    }

    /// `pod` scraped now, healthy and roomy, decoding a token every `itl_s` seconds.
    fn paced(vm: &crate::store::fake_host::FakeVm, pod: &str, itl_s: f64) {
        use crate::pods::record::{self, Snapshot};
        let now = vm.now_ms();
        record::modify(vm, pod, |rec| {
            rec.snapshot = Some(Snapshot {
                at_ms: now,
                healthy: true,
                capacity_tokens: 1 << 20,
                block_size: 16,
                itl_s,
                itl_at_ms: now,
                ..Snapshot::default()
            });
            Some(())
        })
        .unwrap();
    }

    /// A completion of up to 100 tokens sent through `gate`, its answer streamed or not.
    fn sent(gate: &mut Gate, vm: &crate::store::fake_host::FakeVm, stream: bool) -> Flow {
        let mut f = Flow::default();
        f.on_request_headers(gate, vm, &RequestHead::json_post("/v1/completions"));
        let body = format!(r#"{{"model":"m","prompt":"hi","max_tokens":100,"stream":{stream}}}"#);
        f.on_body(gate, vm, body.as_bytes());
        f
    }

    /// (held tokens, steps left) of each entry on `pod`, oldest first.
    fn entries(vm: &crate::store::fake_host::FakeVm, pod: &str) -> Vec<(u64, u32)> {
        let mut e = crate::pods::record::read(vm, pod).unwrap().entries;
        e.sort_by_key(|e| e.id);
        e.iter().map(|e| (e.held_tokens, e.left)).collect()
    }

    /// An answer that does not stream: its entry grows on the tick at the pod's pace, up to its
    /// limit, until its response begins; a streamed one, and any on a pod of unknown pace, only
    /// as its tokens come; one whose body comes encoded, at the pace to its end.
    #[test]
    fn an_answer_that_does_not_stream_grows_at_its_pods_pace() {
        let pod = "10.0.0.1:80";
        let cfg = crate::test_support::with_pods(&[pod]);
        let host = FakeHost::new();
        let vm = host.vm();
        let mut gate = Gate::new(cfg, &vm).unwrap();
        let paced = |itl_s: f64| paced(&vm, pod, itl_s);
        let send = |gate: &mut Gate, stream: bool| sent(gate, &vm, stream);
        let entries = || entries(&vm, pod);
        paced(0.0);
        let mut unknown = send(&mut gate, false);
        host.advance_ms(500);
        unknown.on_tick(&mut gate, &vm);
        let prompt = entries()[0].0;
        assert_eq!(
            entries(),
            vec![(prompt, 100)],
            "no pace: nothing to grow by"
        );
        unknown.on_done(&mut gate, &vm);

        paced(0.010);
        let (mut unseen, mut streamed) = (send(&mut gate, false), send(&mut gate, true));
        assert!(unseen.answers_unseen() && !streamed.answers_unseen());
        host.advance_ms(405);
        unseen.on_tick(&mut gate, &vm);
        streamed.on_tick(&mut gate, &vm);
        assert_eq!(
            entries(),
            vec![(prompt + 40, 60), (prompt, 100)],
            "40 steps of 10 ms"
        );
        host.advance_ms(100);
        unseen.on_tick(&mut gate, &vm);
        assert_eq!(entries()[0], (prompt + 50, 50), "a block boundary crossed");
        host.advance_ms(2_000);
        unseen.on_tick(&mut gate, &vm);
        assert_eq!(entries()[0], (prompt + 100, 0), "up to its max_tokens");
        // Its response begins: what comes is metered, not guessed.
        let mut begun = send(&mut gate, false);
        begun.on_response_headers(&mut gate, &vm, Some("application/json"), Some(pod));
        host.advance_ms(500);
        begun.on_tick(&mut gate, &vm);
        assert_eq!(entries()[2], (prompt, 100));
        // A streamed answer that comes encoded in a coding kvgate does not decode (a zstd
        // compressor after kvgate) cannot be read: from its response headers on it grows at the
        // pace to its end, as an unseen one, counted.
        let mut encoded = send(&mut gate, true);
        encoded.on_response_headers(&mut gate, &vm, Some("text/event-stream"), Some(pod));
        assert!(!encoded.on_response_encoded(&mut gate, " Identity "));
        assert!(encoded.reads_response() && !encoded.answers_unseen());
        assert!(encoded.on_response_encoded(&mut gate, "zstd"));
        assert!(!encoded.reads_response() && encoded.answers_unseen());
        assert_eq!(gate.stats.take_count(stats::RESPONSE_ENCODED), 1);
        host.advance_ms(305);
        encoded.on_tick(&mut gate, &vm);
        assert_eq!(entries()[3], (prompt + 30, 70), "30 steps of 10 ms");
        host.advance_ms(2_000);
        encoded.on_tick(&mut gate, &vm);
        assert_eq!(entries()[3], (prompt + 100, 0), "up to its max_tokens");
        // The VM ticks quickly while any of them is in flight, so their entries keep up.
        use crate::gate::{QUICK_TICK_MS, TICK_MS};
        assert_eq!(gate.tick_ms(&vm), QUICK_TICK_MS);
        for mut f in [unseen, begun, streamed, encoded] {
            f.on_done(&mut gate, &vm);
            f.on_done(&mut gate, &vm);
        }
        assert_eq!(gate.tick_ms(&vm), TICK_MS);
    }

    /// An unseen answer that ended teaches its worker how long such answers take on the pod
    /// before their tokens begin (`routing::unseen_lead`): the next one grows from its age less
    /// that lead, so that its entry does not reach its limit while the engine still decodes it.
    #[test]
    fn an_unseen_answer_grows_from_when_its_tokens_began() {
        let pod = "10.0.0.1:80";
        let host = FakeHost::new();
        let vm = host.vm();
        let mut gate = Gate::new(crate::test_support::with_pods(&[pod]), &vm).unwrap();
        paced(&vm, pod, 0.010);
        let send = |gate: &mut Gate| sent(gate, &vm, false);
        let held = || entries(&vm, pod).first().copied();
        // 90 tokens at 10 ms in a second: its tokens began 100 ms after it was sent.
        let mut first = send(&mut gate);
        host.advance_ms(1_000);
        // Grown at the pace on its worker's tick: the pace its lead is measured against.
        first.on_tick(&mut gate, &vm);
        first.on_response_headers(&mut gate, &vm, Some("application/json"), Some(pod));
        first.on_response_body(
            &mut gate,
            &vm,
            br#"{"id":"c1","object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":90,"total_tokens":91}}"#,
        );
        first.on_done(&mut gate, &vm);
        let mut next = send(&mut gate);
        let prompt = held().unwrap().0;
        host.advance_ms(405);
        next.on_tick(&mut gate, &vm);
        assert_eq!(
            held(),
            Some((prompt + 30, 70)),
            "30 steps of 10 ms after its first 100 ms"
        );
        next.on_done(&mut gate, &vm);
    }

    /// A Responses API answer is remembered on the pod that answered it (the upstream Envoy
    /// used), by its id; a follow-up naming it goes to that pod alone, counted with the
    /// conversation the engine prepends, and a `GET` of it goes there too. An id never seen
    /// stored is routed by cost.
    #[test]
    fn a_stored_response_s_follow_ups_go_back_to_its_pod() {
        use crate::flow::{Step, DESTINATION_HEADER};
        let pods = ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"];
        let host = FakeHost::new();
        let vm = host.vm();
        let mut gate = Gate::new(crate::test_support::with_pods(&pods), &vm).unwrap();
        let mut first = Flow::default();
        first.on_request_headers(&mut gate, &vm, &RequestHead::json_post("/v1/responses"));
        first.on_body(
            &mut gate,
            &vm,
            br#"{"model":"m","input":"hello","stream":true}"#,
        );
        first.on_response_headers(&mut gate, &vm, Some("text/event-stream"), Some(pods[1]));
        for event in [
            &br#"event: response.created
data: {"type":"response.created","sequence_number":0,"response":{"id":"resp_1","status":"in_progress","usage":null}}

"#[..],
            br#"event: response.output_text.delta
data: {"type":"response.output_text.delta","sequence_number":1,"delta":"Hi","item_id":"m1"}

"#,
            br#"event: response.completed
data: {"type":"response.completed","sequence_number":2,"response":{"id":"resp_1","status":"completed","usage":{"input_tokens":700,"output_tokens":300}}}

"#,
        ] {
            first.on_response_body(&mut gate, &vm, event);
        }
        first.on_done(&mut gate, &vm);
        let on = stored::find(&vm, "resp_1").unwrap().unwrap();
        assert_eq!((on.pod.as_str(), on.tokens), (pods[1], 1_000));
        let destination = |d: &crate::flow::Decision| {
            d.set
                .iter()
                .find(|(name, _)| name == DESTINATION_HEADER)
                .map(|(_, v)| v.clone())
        };
        let follow = |gate: &mut Gate, previous: &str| {
            let mut f = Flow::default();
            f.on_request_headers(gate, &vm, &RequestHead::json_post("/v1/responses"));
            let body =
                format!(r#"{{"model":"m","input":"more","previous_response_id":"{previous}"}}"#);
            let d = f.on_body(gate, &vm, body.as_bytes());
            let prompt = f.admitted.as_ref().map(|a| a.estimate.prompt_tokens);
            let to = destination(&d);
            let pod = to.as_deref().and_then(|t| t.split(',').next());
            f.on_response_headers(gate, &vm, Some("application/json"), pod);
            f.on_response_body(gate, &vm, br#"{"id":"resp_next","usage":null}"#);
            f.on_done(gate, &vm);
            (to, prompt)
        };
        for _ in 0..3 {
            let (to, prompt) = follow(&mut gate, "resp_1");
            assert_eq!(to.as_deref(), Some(pods[1]), "that pod alone");
            assert!(prompt.is_some_and(|p| p > 1_000), "{prompt:?}");
        }
        assert_eq!(gate.stats.take_count(stats::STORED_FOLLOWED), 3);
        let (to, prompt) = follow(&mut gate, "resp_unknown");
        assert!(to.is_some(), "routed by cost");
        assert!(prompt.is_some_and(|p| p < 100));
        assert_eq!(gate.stats.take_count(stats::STORED_UNKNOWN), 1);
        let get = RequestHead {
            method: "GET",
            path: "/v1/responses/resp_1",
            ..RequestHead::default()
        };
        let d = Flow::default().on_request_headers(&mut gate, &vm, &get);
        assert!(matches!(d.step, Step::Forward) && destination(&d).as_deref() == Some(pods[1]));
        // Stored on a pod gone from the pool: Envoy's balancer chooses.
        stored::remember(&vm, stored::id_hash("resp_old"), "10.0.0.9:80", 5).unwrap();
        let old = RequestHead {
            path: "/v1/responses/resp_old",
            ..get
        };
        let d = Flow::default().on_request_headers(&mut gate, &vm, &old);
        assert!(matches!(d.step, Step::Forward) && destination(&d).is_none());
        // A JSON answer's id is its body's; `store: false` keeps nothing; one answered in the
        // background has no usage yet, and is found all the same (its `GET`s poll it).
        let usage = r#"{"input_tokens":5,"output_tokens":2}"#;
        for (body, id, usage) in [
            (&br#"{"model":"m","input":"x"}"#[..], "resp_2", usage),
            (
                br#"{"model":"m","input":"x","store":false}"#,
                "resp_3",
                usage,
            ),
            (
                br#"{"model":"m","input":"x","background":true}"#,
                "resp_4",
                "null",
            ),
        ] {
            let mut f = Flow::default();
            f.on_request_headers(&mut gate, &vm, &RequestHead::json_post("/v1/responses"));
            let d = f.on_body(&mut gate, &vm, body);
            let to = destination(&d);
            let pod = to.as_deref().and_then(|t| t.split(',').next());
            f.on_response_headers(&mut gate, &vm, Some("application/json"), pod);
            let answer = format!(r#"{{"id":"{id}","object":"response","usage":{usage}}}"#);
            f.on_response_body(&mut gate, &vm, answer.as_bytes());
            f.on_done(&mut gate, &vm);
        }
        let tokens = |id| stored::find(&vm, id).unwrap().map(|s| s.tokens);
        assert_eq!((tokens("resp_2"), tokens("resp_3")), (Some(7), None));
        assert!(tokens("resp_4").is_some_and(|t| t > 0));
    }

    /// With gateway replicas, a stored response is logged for the others (`Event::Stored`,
    /// carried by `replicas::placements`); alone, it is not.
    #[test]
    fn a_stored_response_is_logged_for_the_other_replicas_when_there_are_any() {
        use crate::routing::pick_log::{Event, PickLog};
        for replicas in [false, true] {
            let host = FakeHost::new();
            let vm = host.vm();
            let mut cfg = crate::test_support::with_pods(&["10.0.0.1:80"]);
            if replicas {
                cfg.etcd.cluster = "etcd".into();
                cfg.etcd.replica_id = "r0".into();
            }
            let mut gate = Gate::new(cfg, &vm).unwrap();
            let mut log = PickLog::start(&vm).unwrap();
            let mut f = Flow::default();
            f.on_request_headers(&mut gate, &vm, &RequestHead::json_post("/v1/responses"));
            f.on_body(&mut gate, &vm, br#"{"model":"m","input":"x"}"#);
            f.on_response_headers(
                &mut gate,
                &vm,
                Some("application/json"),
                Some("10.0.0.1:80"),
            );
            let answer = br#"{"id":"resp_9","usage":{"input_tokens":5,"output_tokens":2}}"#;
            f.on_response_body(&mut gate, &vm, answer);
            f.on_done(&mut gate, &vm);
            let mut logged = Vec::new();
            log.poll_every(&vm, |e| {
                if let Event::Stored { pod, id, tokens } = e {
                    logged.push((pod, id, tokens));
                }
            })
            .unwrap();
            let expected = vec![("10.0.0.1:80".to_string(), stored::id_hash("resp_9"), 7)];
            assert_eq!(logged, if replicas { expected } else { vec![] });
        }
    }

    /// A response found by asking the pods (`routing::stored_ask`) is logged for the other
    /// replicas too: each would otherwise ask for it again.
    #[test]
    fn a_stored_response_found_by_asking_is_logged_for_the_other_replicas() {
        use crate::routing::pick_log::{Event, PickLog};
        let pods = ["10.0.0.1:80", "10.0.0.2:80"];
        let host = FakeHost::new();
        let vm = host.vm();
        let mut cfg = crate::test_support::with_pods(&pods);
        cfg.metrics.cluster = "kvgate_metrics".into();
        cfg.etcd.cluster = "etcd".into();
        cfg.etcd.replica_id = "r0".into();
        let mut gate = Gate::new(cfg, &vm).unwrap();
        let mut log = PickLog::start(&vm).unwrap();
        let (mut f, d) = streamed_follow_up(&mut gate, &vm, "resp_lost");
        assert_eq!(d.step, crate::flow::Step::Hold);
        assert_eq!(f.take_asks(None).len(), 2, "both pods asked");
        let answer = br#"{"id":"resp_lost","object":"response","status":"completed","usage":{"input_tokens":700,"output_tokens":100}}"#;
        let d = f.answered(&mut gate, &vm, pods[1], Some(200), answer);
        assert!(d.is_some(), "settled");
        let mut logged = Vec::new();
        log.poll_every(&vm, |e| {
            if let Event::Stored { pod, id, tokens } = e {
                logged.push((pod, id, tokens));
            }
        })
        .unwrap();
        let expected = vec![(pods[1].to_string(), stored::id_hash("resp_lost"), 800)];
        assert_eq!(logged, expected);
        f.on_done(&mut gate, &vm);
    }

    /// A streamed Responses API follow-up naming `previous`, through its body: its flow and the
    /// decision.
    fn streamed_follow_up(
        gate: &mut Gate,
        vm: &crate::store::fake_host::FakeVm,
        previous: &str,
    ) -> (Flow, crate::flow::Decision) {
        let mut f = Flow::default();
        f.on_request_headers(gate, vm, &RequestHead::json_post("/v1/responses"));
        let body = format!(
            r#"{{"model":"m","input":"more","previous_response_id":"{previous}","stream":true}}"#
        );
        let d = f.on_body(gate, vm, body.as_bytes());
        (f, d)
    }

    /// The pod a decision sends its request to (the first of the destination's list).
    fn destination(d: &crate::flow::Decision) -> Option<String> {
        d.set
            .iter()
            .find(|(name, _)| name == crate::flow::DESTINATION_HEADER)
            .map(|(_, v)| v.split(',').next().unwrap_or_default().to_string())
    }

    /// With replicas, a follow-up or a retrieval naming a response this replica has not heard
    /// of is held for another replica's note of it: sent to the pod storing it as soon as the
    /// note is here, by cost once `followUpWaitMs` is over.
    #[test]
    fn a_request_naming_a_response_another_replica_saw_stored_waits_for_its_note() {
        use crate::flow::Step;
        use crate::gate::{QUICK_TICK_MS, TICK_MS};
        let pods = ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"];
        let host = FakeHost::new();
        let vm = host.vm();
        let mut cfg = crate::test_support::with_pods(&pods);
        cfg.etcd.cluster = "etcd".into();
        cfg.etcd.replica_id = "r0".into();
        cfg.etcd.busy_sync_interval_ms = 0;
        let mut gate = Gate::new(cfg, &vm).unwrap();
        let follow_up = |gate: &mut Gate, previous: &str| streamed_follow_up(gate, &vm, previous);
        let (mut f, d) = follow_up(&mut gate, "resp_far");
        assert_eq!(d.step, Step::Hold);
        assert!(stored::sought(&vm).unwrap(), "the sync is told to hurry");
        assert_eq!(gate.tick_ms(&vm), QUICK_TICK_MS);
        host.advance_ms(100);
        assert!(f.sought(&mut gate, &vm).is_none(), "still waiting");
        // The sync brings the other replica's note.
        stored::remember(&vm, stored::id_hash("resp_far"), pods[2], 800).unwrap();
        let d = f.sought(&mut gate, &vm).unwrap();
        assert_eq!(d.step, Step::Forward);
        assert_eq!(destination(&d).as_deref(), Some(pods[2]));
        let prompt = f.admitted.as_ref().map(|a| a.estimate.prompt_tokens);
        assert!(prompt.is_some_and(|p| p > 800), "{prompt:?}");
        assert!(f.sought(&mut gate, &vm).is_none(), "decided once");
        assert_eq!(gate.stats.take_count(stats::STORED_FOLLOWED), 1);
        // One no replica noted: routed by cost once the wait is over.
        let (mut g, d) = follow_up(&mut gate, "resp_gone");
        assert_eq!(d.step, Step::Hold);
        host.advance_ms(299);
        assert!(g.sought(&mut gate, &vm).is_none());
        host.advance_ms(1);
        let d = g.sought(&mut gate, &vm).unwrap();
        assert!(d.step == Step::Forward && destination(&d).is_some());
        assert_eq!(gate.stats.take_count(stats::STORED_UNKNOWN), 1);
        // A retrieval, held at its headers.
        let get = RequestHead {
            method: "GET",
            path: "/v1/responses/resp_polled",
            ..RequestHead::default()
        };
        let mut r = Flow::default();
        assert_eq!(r.on_request_headers(&mut gate, &vm, &get).step, Step::Hold);
        stored::remember(&vm, stored::id_hash("resp_polled"), pods[0], 50).unwrap();
        let d = r.sought(&mut gate, &vm).unwrap();
        assert_eq!(destination(&d).as_deref(), Some(pods[0]));
        assert_eq!(gate.stats.take_count(stats::STORED_WAITED), 1);
        host.advance_ms(400);
        assert_eq!(gate.tick_ms(&vm), TICK_MS, "the quick tick was for them");
        assert!(!stored::sought(&vm).unwrap());
        // Held until a read of etcd since then finds no other replica alive: nobody else can
        // have stored it, or send its note.
        stored::note_peers(&vm, false).unwrap();
        host.advance_ms(1);
        let (mut a, d) = follow_up(&mut gate, "resp_alone");
        assert_eq!(d.step, Step::Hold, "that read came before it");
        host.advance_ms(20);
        assert!(a.sought(&mut gate, &vm).is_none());
        stored::note_peers(&vm, true).unwrap();
        assert!(
            a.sought(&mut gate, &vm).is_none(),
            "another replica is alive"
        );
        host.advance_ms(20);
        stored::note_peers(&vm, false).unwrap();
        let d = a.sought(&mut gate, &vm).unwrap();
        assert!(d.step == Step::Forward && destination(&d).is_some());
        assert_eq!(gate.stats.take_count(stats::STORED_UNKNOWN), 1);
        stored::note_peers(&vm, true).unwrap();
        host.advance_ms(400);
        // Not held when Envoy's balancer chooses, nor when the wait is off.
        gate.config.routing.mode = crate::config::Mode::Observe;
        let (_, d) = follow_up(&mut gate, "resp_other");
        assert_eq!(d.step, Step::Forward);
        gate.config.routing.mode = crate::config::Mode::Enforce;
        gate.config.etcd.follow_up_wait_ms = 0;
        let (_, d) = follow_up(&mut gate, "resp_other");
        assert_eq!(d.step, Step::Forward);
        assert_eq!(gate.stats.take_count(stats::STORED_UNKNOWN), 2);
    }

    /// A client that leaves while its request is held for the stored response it names is
    /// logged as one that left the line is: `client_left`, its model, and how long it was held.
    #[test]
    fn a_client_that_leaves_while_held_for_a_stored_response_is_logged() {
        let pods = ["10.0.0.1:80", "10.0.0.2:80"];
        let host = FakeHost::new();
        let vm = host.vm();
        let mut cfg = crate::test_support::with_pods(&pods);
        cfg.metrics.cluster = "kvgate_metrics".into();
        crate::test_support::lists_failed(&vm, &pods);
        let mut gate = Gate::new(cfg, &vm).unwrap();
        let (mut f, d) = streamed_follow_up(&mut gate, &vm, "resp_lost");
        assert_eq!(d.step, crate::flow::Step::Hold);
        host.advance_ms(40);
        assert_eq!(
            f.take_access_log(|| vm.now_ms()).as_deref(),
            Some("reason=client_left model=m held_ms=40")
        );
        f.on_done(&mut gate, &vm);
    }

    /// A request naming a response no note names (made before this Envoy started, forgotten,
    /// or seen by a replica sharing no etcd) is held while each pod is asked for it, with the
    /// client's key: it goes to the first that has it, counted with the conversation its answer
    /// reports, and its next turns need no asking; by cost once every pod has said no, a call
    /// could not be sent, or the time is up.
    #[test]
    fn a_request_naming_a_response_no_note_names_asks_the_pods_and_goes_where_it_is_stored() {
        use crate::flow::Step;
        use crate::gate::QUICK_TICK_MS;
        use crate::pods::scrape::Target;
        use crate::stats::{Name, Stat};
        let pods = ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"];
        let host = FakeHost::new();
        let vm = host.vm();
        let mut cfg = crate::test_support::with_pods(&pods);
        cfg.metrics.cluster = "kvgate_metrics".into();
        crate::test_support::lists_failed(&vm, &pods);
        let mut gate = Gate::new(cfg, &vm).unwrap();
        let follow_up = |gate: &mut Gate, previous: &str| streamed_follow_up(gate, &vm, previous);
        let asked = |f: &mut Flow| -> Vec<String> {
            f.take_asks(Some("Bearer k"))
                .into_iter()
                .map(|c| {
                    assert_eq!(c.cluster, "kvgate_metrics");
                    assert!(c
                        .headers
                        .contains(&("authorization".into(), "Bearer k".into())));
                    match c.target {
                        Target::Stored(pod) => pod,
                        other => panic!("{other:?}"),
                    }
                })
                .collect()
        };
        let (mut f, d) = follow_up(&mut gate, "resp_lost");
        assert_eq!(d.step, Step::Hold);
        assert_eq!(asked(&mut f), pods.to_vec(), "every pod serving the model");
        assert!(f.take_asks(None).is_empty(), "sent once");
        assert_eq!(gate.tick_ms(&vm), QUICK_TICK_MS, "its wait ends on time");
        assert!(!stored::sought(&vm).unwrap(), "no replica to hurry");
        let not_found = br#"{"error":{"message":"Response with id 'resp_lost' not found."}}"#;
        assert!(f
            .answered(&mut gate, &vm, pods[0], Some(404), not_found)
            .is_none());
        assert!(
            f.sought(&mut gate, &vm).is_none(),
            "one pod is still to answer"
        );
        let answer = br#"{"id":"resp_lost","object":"response","status":"completed","usage":{"input_tokens":700,"output_tokens":100}}"#;
        let d = f
            .answered(&mut gate, &vm, pods[2], Some(200), answer)
            .unwrap();
        assert_eq!(d.step, Step::Forward);
        assert_eq!(destination(&d).as_deref(), Some(pods[2]));
        let prompt = f.admitted.as_ref().map(|a| a.estimate.prompt_tokens);
        assert!(prompt.is_some_and(|p| p > 800), "{prompt:?}");
        assert!(
            f.answered(&mut gate, &vm, pods[1], Some(404), not_found)
                .is_none(),
            "decided once"
        );
        let noted = stored::find(&vm, "resp_lost").unwrap().unwrap();
        assert_eq!((noted.pod.as_str(), noted.tokens), (pods[2], 800));
        // (Taking a count drains every stat.)
        let counts = |gate: &mut Gate| {
            let all: Vec<Stat> = gate.stats.drain().collect();
            [
                stats::STORED_ASKED,
                stats::STORED_FOUND,
                stats::STORED_FOLLOWED,
                stats::STORED_UNKNOWN,
            ]
            .map(|name| {
                all.iter()
                    .map(|s| match s {
                        Stat::Counter(n, by) if *n == Name::from(name).to_string() => *by,
                        _ => 0,
                    })
                    .sum::<u64>()
            })
        };
        assert_eq!(counts(&mut gate), [1, 1, 1, 0]);
        // The next turn naming it is not asked again.
        f.on_done(&mut gate, &vm);
        let (mut n, d) = follow_up(&mut gate, "resp_lost");
        assert_eq!(destination(&d).as_deref(), Some(pods[2]));
        n.on_done(&mut gate, &vm);
        assert_eq!(counts(&mut gate), [0, 0, 1, 0]);
        // Stored nowhere: by cost as soon as every pod has said so.
        let (mut f, _) = follow_up(&mut gate, "resp_nowhere");
        for pod in asked(&mut f) {
            let d = f.answered(&mut gate, &vm, &pod, Some(404), not_found);
            assert_eq!(d.is_some(), pod == pods[2], "{pod}");
            if let Some(d) = d {
                assert!(d.step == Step::Forward && destination(&d).is_some());
            }
        }
        f.on_done(&mut gate, &vm);
        assert_eq!(counts(&mut gate), [1, 0, 0, 1]);
        // A pod that does not answer: by cost when the time is up (`routing.storedLookupMs`).
        let (mut f, _) = follow_up(&mut gate, "resp_slow");
        asked(&mut f);
        assert!(f.answered(&mut gate, &vm, pods[0], None, b"").is_none());
        host.advance_ms(499);
        assert!(f.sought(&mut gate, &vm).is_none());
        host.advance_ms(1);
        assert_eq!(
            f.sought(&mut gate, &vm).map(|d| d.step),
            Some(Step::Forward)
        );
        f.on_done(&mut gate, &vm);
        // Calls that could not be sent leave nothing to wait for: the tick decides.
        let (mut f, _) = follow_up(&mut gate, "resp_unsent");
        for pod in asked(&mut f) {
            f.unasked(&pod);
        }
        assert_eq!(
            f.sought(&mut gate, &vm).map(|d| d.step),
            Some(Step::Forward)
        );
        f.on_done(&mut gate, &vm);
        assert_eq!(counts(&mut gate), [2, 0, 0, 2]);
        // A retrieval asks every pod, and goes to the one storing it.
        let get = RequestHead {
            method: "GET",
            path: "/v1/responses/resp_got",
            ..RequestHead::default()
        };
        let mut r = Flow::default();
        assert_eq!(r.on_request_headers(&mut gate, &vm, &get).step, Step::Hold);
        assert_eq!(asked(&mut r).len(), 3);
        let answer = br#"{"id":"resp_got","object":"response","usage":null}"#;
        let d = r
            .answered(&mut gate, &vm, pods[1], Some(200), answer)
            .unwrap();
        assert_eq!(destination(&d).as_deref(), Some(pods[1]));
        r.on_done(&mut gate, &vm);
        // With replicas, another replica's note may tell first; every pod saying no ends the
        // wait for one (an engine stores a response before a client can name it).
        gate.config.etcd.cluster = "etcd".into();
        gate.config.etcd.replica_id = "r0".into();
        let (mut f, d) = follow_up(&mut gate, "resp_noted");
        assert_eq!(d.step, Step::Hold);
        assert!(stored::sought(&vm).unwrap() && asked(&mut f).len() == 3);
        stored::remember(&vm, stored::id_hash("resp_noted"), pods[0], 50).unwrap();
        // (Parked: this replica has no grant of the pods' budgets before its first sync.)
        assert!(f.sought(&mut gate, &vm).is_some());
        let only_on = f.admitted.as_ref().and_then(|a| a.estimate.only_on);
        assert_eq!(only_on, Some(crate::hash::fnv1a(pods[0].as_bytes())));
        assert!(f
            .answered(&mut gate, &vm, pods[0], Some(404), not_found)
            .is_none());
        f.on_done(&mut gate, &vm);
        let (mut f, _) = follow_up(&mut gate, "resp_none");
        let asked_pods = asked(&mut f);
        let mut decided = asked_pods
            .iter()
            .filter_map(|pod| f.answered(&mut gate, &vm, pod, Some(404), not_found));
        assert!(decided.next().is_some() && decided.next().is_none());
        f.on_done(&mut gate, &vm);
        assert_eq!(counts(&mut gate), [3, 1, 1, 1], "the retrieval found");
        // Not asked when Envoy's balancer chooses, nor when asking is off.
        gate.config.etcd.cluster.clear();
        gate.config.routing.mode = crate::config::Mode::Observe;
        let (_, d) = follow_up(&mut gate, "resp_other");
        assert_eq!(d.step, Step::Forward);
        gate.config.routing.mode = crate::config::Mode::Enforce;
        gate.config.routing.stored_lookup_ms = 0;
        let (_, d) = follow_up(&mut gate, "resp_other");
        assert_eq!(d.step, Step::Forward);
        assert_eq!(counts(&mut gate), [0, 0, 0, 2]);
    }

    /// At most `MAX_ASKING` requests of a VM are held asking at once: past them a request naming
    /// an unknown response is routed by cost, and a request decided, or whose client left, frees
    /// its place.
    #[test]
    fn a_vms_requests_asking_the_pods_are_bounded() {
        use crate::flow::Step;
        use crate::routing::stored_ask::MAX_ASKING;
        let host = FakeHost::new();
        let vm = host.vm();
        let mut cfg = crate::test_support::with_pods(&["10.0.0.1:80", "10.0.0.2:80"]);
        cfg.metrics.cluster = "kvgate_metrics".into();
        let mut gate = Gate::new(cfg, &vm).unwrap();
        let mut held: Vec<Flow> = (0..MAX_ASKING)
            .map(|i| {
                let (f, d) = streamed_follow_up(&mut gate, &vm, &format!("resp_{i}"));
                assert_eq!(d.step, Step::Hold, "{i}");
                f
            })
            .collect();
        let (mut past, d) = streamed_follow_up(&mut gate, &vm, "resp_past");
        assert_ne!(d.step, Step::Hold, "routed by cost");
        past.on_done(&mut gate, &vm);
        // One client leaves, another request is decided: two places free.
        held[0].on_done(&mut gate, &vm);
        for pod in held[1]
            .take_asks(None)
            .iter()
            .filter_map(|c| match &c.target {
                crate::pods::scrape::Target::Stored(pod) => Some(pod.clone()),
                _ => None,
            })
        {
            held[1].answered(&mut gate, &vm, &pod, Some(404), b"{}");
        }
        for name in ["resp_again", "resp_more"] {
            let (_, d) = streamed_follow_up(&mut gate, &vm, name);
            assert_eq!(d.step, Step::Hold, "{name}");
        }
        let (_, d) = streamed_follow_up(&mut gate, &vm, "resp_full");
        assert_ne!(d.step, Step::Hold);
    }

    /// One streamed output token, as the engine sends it.
    const PIECE: &[u8] = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n";

    /// Teaches model `m`'s shared record `n` answers of `tokens` tokens each (prompts of one),
    /// streamed as `pieces` pieces each (0: not counted).
    fn learn(
        vm: &crate::store::fake_host::FakeVm,
        cfg: &crate::config::Config,
        n: usize,
        tokens: u64,
        pieces: u64,
    ) {
        use crate::estimate::calibration::{Calibration, Sample};
        let s = Sample {
            static_text_tokens: 1.0,
            templated: true,
            known_tokens: 0,
            parts: 0,
            prompts: 1,
            prompt_tokens: 1,
            completion_tokens: tokens,
            choices: 1,
            length: Length::Ended,
            bounded: false,
            pieces,
            template: crate::estimate::templates::Keys::default(),
        };
        for _ in 0..n {
            Calibration::record(vm, "m", &[s], &cfg.estimator).unwrap();
        }
    }

    /// The one pod's configuration (lengths learned after five answers), and a host whose model
    /// `m` has learned `n` answers of `tokens` tokens each, streamed as `pieces` pieces each.
    fn learned_pod(
        n: usize,
        tokens: u64,
        pieces: u64,
    ) -> (
        crate::config::Config,
        FakeHost,
        crate::store::fake_host::FakeVm,
    ) {
        let mut cfg = crate::test_support::with_pods(&["10.0.0.1:80"]);
        cfg.estimator.min_samples = 5;
        let host = FakeHost::new();
        let vm = host.vm();
        learn(&vm, &cfg, n, tokens, pieces);
        (cfg, host, vm)
    }

    /// A streaming request for model `m` with no limit on its answer, sent to the one pod and
    /// answering.
    fn streaming(gate: &mut Gate, vm: &crate::store::fake_host::FakeVm) -> Flow {
        let mut f = Flow::default();
        f.on_request_headers(gate, vm, &RequestHead::json_post("/v1/completions"));
        f.on_body(
            gate,
            vm,
            br#"{"model":"m","prompt":"hi","stream":true,"max_tokens":null}"#,
        );
        f.on_response_headers(gate, vm, Some("text/event-stream"), Some("10.0.0.1:80"));
        f
    }

    /// An answer gzipped after kvgate (Envoy's compressor listed after it) is decoded as it
    /// streams: its entry grows with its tokens and its usage is read, as a plain answer's. A
    /// body that is not the gzip it says grows at the pace from there; more answers at once
    /// than a VM decodes too. The decoders are freed as the answers end.
    #[test]
    fn an_answer_gzipped_after_kvgate_is_metered_as_it_streams() {
        use crate::gate::QUICK_TICK_MS;
        use crate::pods::record;
        use crate::stats::{Name, Stat};
        let pod = "10.0.0.1:80";
        let host = FakeHost::new();
        let vm = host.vm();
        let mut gate = Gate::new(crate::test_support::with_pods(&[pod]), &vm).unwrap();
        let mut f = streaming(&mut gate, &vm);
        let held = |vm: &crate::store::fake_host::FakeVm| {
            record::read(vm, pod).unwrap().entries[0].held_tokens
        };
        let prompt = held(&vm);
        assert!(!f.on_response_encoded(&mut gate, "gzip"));
        assert!(f.reads_response() && !f.answers_unseen());
        assert_eq!(gate.decoders.open(), 1);
        let (header, mut deflate) = crate::flow::decode::gzip::tests::flushing();
        assert!(!f.on_response_body(&mut gate, &vm, &header));
        let piece = b"data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n";
        for _ in 0..40 {
            assert!(!f.on_response_body(&mut gate, &vm, &deflate(piece)));
        }
        assert_eq!(held(&vm), prompt + 33, "written as it crossed its blocks");
        let usage = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":40,\"total_tokens\":43}}\n\ndata: [DONE]\n\n";
        f.on_response_body(&mut gate, &vm, &deflate(usage));
        f.on_done(&mut gate, &vm);
        let counted: Vec<Stat> = gate.stats.drain().collect();
        assert!(counted.contains(&Stat::Counter(
            Name::from(stats::USAGE_COMPLETION_TOKENS).to_string(),
            40
        )));
        assert!(counted.contains(&Stat::Counter(
            Name::from(stats::RESPONSE_DECODED).to_string(),
            1
        )));
        assert_eq!(gate.decoders.open(), 0, "freed at its end");
        assert_eq!(gate.stats.take_count(stats::RESPONSE_ENCODED), 0);

        // Not gzip after all: from there at the pod's pace, counted as unread.
        let mut broken = streaming(&mut gate, &vm);
        broken.on_response_encoded(&mut gate, "x-gzip");
        assert!(broken.on_response_body(&mut gate, &vm, b"data: {}\n\n"));
        assert!(!broken.reads_response() && broken.answers_unseen());
        assert_eq!(gate.decoders.open(), 0);
        assert_eq!(gate.stats.take_count(stats::RESPONSE_ENCODED), 1);
        assert_eq!(gate.tick_ms(&vm), QUICK_TICK_MS);
        broken.on_done(&mut gate, &vm);

        // A VM decodes at most `MAX_OPEN` answers at once.
        let mut open: Vec<Flow> = (0..=crate::flow::decode::Room::MAX_GZIPS)
            .map(|_| streaming(&mut gate, &vm))
            .collect();
        let unseen: Vec<bool> = open
            .iter_mut()
            .map(|f| f.on_response_encoded(&mut gate, "gzip"))
            .collect();
        assert_eq!(unseen.iter().filter(|u| **u).count(), 1, "the last one");
        assert_eq!(gate.decoders.open(), crate::flow::decode::Room::MAX_GZIPS);
        for mut f in open {
            f.on_done(&mut gate, &vm);
        }
        assert_eq!(gate.decoders.open(), 0);

        // A Responses API answer that comes gzipped is noted on its pod by its id, as a plain
        // one is: its follow-ups go back there.
        let mut answer = Flow::default();
        answer.on_request_headers(&mut gate, &vm, &RequestHead::json_post("/v1/responses"));
        answer.on_body(&mut gate, &vm, br#"{"model":"m","input":"hello"}"#);
        answer.on_response_headers(&mut gate, &vm, Some("application/json"), Some(pod));
        answer.on_response_encoded(&mut gate, "gzip");
        let (header, mut deflate) = crate::flow::decode::gzip::tests::flushing();
        answer.on_response_body(&mut gate, &vm, &header);
        let body = br#"{"id":"resp_gz","usage":{"input_tokens":7,"output_tokens":3}}"#;
        answer.on_response_body(&mut gate, &vm, &deflate(body));
        answer.on_done(&mut gate, &vm);
        let on = stored::find(&vm, "resp_gz").unwrap().unwrap();
        assert_eq!((on.pod.as_str(), on.tokens), (pod, 10));
        assert!(record::read(&vm, pod).unwrap().entries.is_empty());
    }

    /// An answer brotli-coded after kvgate is metered as it streams, as a gzipped one is; its
    /// window is charged to the VM while it runs, and a stream whose window the VM has no room
    /// left for grows at its pod's pace instead.
    #[test]
    fn an_answer_in_brotli_after_kvgate_is_metered_within_the_vms_room_for_windows() {
        use crate::pods::record;
        use crate::stats::{Name, Stat};
        let pod = "10.0.0.1:80";
        let host = FakeHost::new();
        let vm = host.vm();
        let mut gate = Gate::new(crate::test_support::with_pods(&[pod]), &vm).unwrap();
        let held = |vm: &crate::store::fake_host::FakeVm| {
            record::read(vm, pod).unwrap().entries[0].held_tokens
        };
        // As many streams at Envoy's default window (256 KB) as the room holds, and one more.
        let streams = crate::flow::decode::Room::MAX_WINDOWS / (256 << 10);
        let mut open: Vec<_> = (0..=streams)
            .map(|_| {
                let mut f = streaming(&mut gate, &vm);
                assert!(!f.on_response_encoded(&mut gate, "br"));
                (f, crate::flow::decode::brotli::tests::flushing())
            })
            .collect();
        let piece = b"data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n";
        let prompt = held(&vm);
        let unseen: Vec<bool> = open
            .iter_mut()
            .map(|(f, compress)| f.on_response_body(&mut gate, &vm, &compress(piece)))
            .collect();
        assert_eq!(
            unseen,
            [vec![false; streams], vec![true]].concat(),
            "the last has no room"
        );
        assert_eq!(gate.stats.take_count(stats::RESPONSE_ENCODED), 1);
        let (mut first, mut compress) = open.remove(0);
        for _ in 1..40 {
            assert!(!first.on_response_body(&mut gate, &vm, &compress(piece)));
        }
        let entries = record::read(&vm, pod).unwrap().entries;
        assert_eq!(
            entries.iter().map(|e| e.held_tokens).max(),
            Some(prompt + 33),
            "the first grew with its 40 tokens"
        );
        let usage = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":40,\"total_tokens\":43}}\n\ndata: [DONE]\n\n";
        first.on_response_body(&mut gate, &vm, &compress(usage));
        first.on_done(&mut gate, &vm);
        let counted: Vec<Stat> = gate.stats.drain().collect();
        assert!(counted.contains(&Stat::Counter(
            Name::from(stats::USAGE_COMPLETION_TOKENS).to_string(),
            40
        )));
        assert!(
            counted.contains(&Stat::Counter(
                Name::from(stats::RESPONSE_DECODED).to_string(),
                1
            )),
            "decoded to its end"
        );
        assert_eq!(gate.decoders.open(), streams - 1);
        for (mut f, _) in open {
            f.on_done(&mut gate, &vm);
        }
        assert_eq!(gate.decoders.open(), 0);
        // Its room given back: a new stream is decoded again.
        let mut again = streaming(&mut gate, &vm);
        again.on_response_encoded(&mut gate, "br");
        let mut compress = crate::flow::decode::brotli::tests::flushing();
        assert!(!again.on_response_body(&mut gate, &vm, &compress(piece)));
        again.on_done(&mut gate, &vm);
        assert!(record::read(&vm, pod).unwrap().entries.is_empty());
    }

    /// A request for two answers streams both, interleaved; the first ends (vLLM's last chunk
    /// of an answer: no text, its `finish_reason`) while the second runs on: the pod's entry
    /// then holds the prompt and the second's tokens, growing a token a step.
    #[test]
    fn an_answer_that_ends_frees_its_tokens_in_the_pods_entry() {
        use crate::pods::record;
        let pod = "10.0.0.1:80";
        let cfg = crate::test_support::with_pods(&[pod]);
        let host = FakeHost::new();
        let vm = host.vm();
        let mut gate = Gate::new(cfg, &vm).unwrap();
        let mut f = Flow::default();
        f.on_request_headers(&mut gate, &vm, &RequestHead::json_post("/v1/completions"));
        f.on_body(
            &mut gate,
            &vm,
            br#"{"model":"m","prompt":"hi","stream":true,"n":2,"max_tokens":100}"#,
        );
        f.on_response_headers(&mut gate, &vm, Some("text/event-stream"), Some(pod));
        let entry = || record::read(&vm, pod).unwrap().entries[0];
        let prompt = entry().held_tokens;
        assert_eq!(entry().choices, 2);
        let piece = |i: u8| format!("data: {{\"choices\":[{{\"index\":{i},\"text\":\"a\"}}]}}\n\n");
        for _ in 0..20 {
            f.on_response_body(&mut gate, &vm, piece(0).as_bytes());
            f.on_response_body(&mut gate, &vm, piece(1).as_bytes());
        }
        // Written as the stream crosses its blocks: at its 33rd token.
        assert_eq!(entry().held_tokens, prompt + 33);
        f.on_response_body(
            &mut gate,
            &vm,
            b"data: {\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":\"stop\"}]}\n\n",
        );
        let e = entry();
        assert_eq!((e.held_tokens, e.choices), (prompt + 20, 1), "{e:?}");
        assert_eq!(e.left, 100 - 20, "the one left, 20 tokens into its 100");
        f.on_done(&mut gate, &vm);
        assert!(record::read(&vm, pod).unwrap().entries.is_empty());
    }

    #[test]
    fn a_streamed_answer_counts_as_running_until_it_ends_and_a_lost_one_as_censored() {
        use crate::estimate::output_dist::bucket;
        let cfg = crate::test_support::with_pods(&["10.0.0.1:80"]);
        let host = FakeHost::new();
        let vm = host.vm();
        let mut gate = Gate::new(cfg, &vm).unwrap();
        let stream = |gate: &mut Gate, pieces: u64, usage: bool| {
            let mut f = streaming(gate, &vm);
            for _ in 0..pieces {
                f.on_response_body(gate, &vm, PIECE);
            }
            if usage {
                let end = format!(
                    "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":2,\"completion_tokens\":{pieces}}}}}\n\n"
                );
                f.on_response_body(gate, &vm, end.as_bytes());
            }
            f
        };
        let mut running = stream(&mut gate, 40, false);
        let censored_at = |gate: &Gate, b| gate.calibration.cohort_counts("m").map(|c| c.1[b]);
        assert_eq!(censored_at(&gate, bucket(40)), Some(1.0), "running at 40");
        running.on_response_body(
            &mut gate,
            &vm,
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":41}}\n\n",
        );
        running.on_done(&mut gate, &vm);
        let counts = gate.calibration.cohort_counts("m").unwrap();
        assert_eq!(
            (counts.0[bucket(41)], counts.1.iter().sum::<f64>()),
            (1.0, 0.0),
            "ended"
        );
        // A stream lost at 70 tokens: the model would have gone on.
        stream(&mut gate, 70, false).on_done(&mut gate, &vm);
        assert_eq!(censored_at(&gate, bucket(70)), Some(1.0));
        // One that ends by itself is a length.
        stream(&mut gate, 20, true).on_done(&mut gate, &vm);
        assert_eq!(
            gate.calibration.cohort_counts("m").unwrap().0[bucket(20)],
            1.0
        );
    }

    /// One model behind two applications, a classifier and a summarizer, each its own prompt
    /// template: once each has answered, a new request of each is expected at its own length,
    /// not at the mixture's (`estimate::templates`); with `templateLengths` off, at the model's.
    #[test]
    fn each_templates_answers_are_expected_apart_from_the_models_mixture() {
        let pod = "10.0.0.1:80";
        let (cfg, host, vm) = learned_pod(50, 200, 0);
        // Each application's request, as its kind of client sends it: a completions prompt
        // opening with the application's words; a chat whose system prompt is one line (shorter
        // than a block: every first block holds the user's words too); a chat whose system prompt
        // opens with house rules all the applications share (their first blocks alike); and one
        // whose system prompt then ends with the user's profile, every request's its own.
        let body = |kind: &str, app: &str, i: u64| {
            let user = format!("question {i}: {}", "the user's own words ".repeat(4));
            match kind {
                "completions" => {
                    serde_json::json!({"model": "m", "stream": true, "max_tokens": null,
                    "prompt": format!("{app} {} {user}", "the application's own words ".repeat(4))})
                }
                "one line" => serde_json::json!({"model": "m", "stream": true, "messages": [
                    {"role": "system", "content": app}, {"role": "user", "content": user}]}),
                "house rules" => serde_json::json!({"model": "m", "stream": true, "messages": [
                    {"role": "system", "content": format!("{} {app}", "Our house rules. ".repeat(8))},
                    {"role": "user", "content": user}]}),
                _ => serde_json::json!({"model": "m", "stream": true, "messages": [
                    {"role": "system", "content": format!("{} {app} {} The user: {i}, of plan {}.",
                        "Our house rules. ".repeat(8), "the application's own words ".repeat(6),
                        i * 7 % 5)},
                    {"role": "user", "content": user}]}),
            }
        };
        let expected = |kind: &str, on: bool| {
            let mut cfg = cfg.clone();
            cfg.estimator.template_lengths = on;
            let mut gate = Gate::new(cfg, &vm).unwrap();
            let ask = |gate: &mut Gate, app: &str, i: u64, answer: Option<u64>| {
                let path = if kind == "completions" {
                    "/v1/completions"
                } else {
                    "/v1/chat/completions"
                };
                let mut f = Flow::default();
                f.on_request_headers(gate, &vm, &RequestHead::json_post(path));
                f.on_body(gate, &vm, body(kind, app, i).to_string().as_bytes());
                let expected = f.admitted.as_ref().map(|a| a.estimate.output_tokens);
                if let Some(n) = answer {
                    f.on_response_headers(gate, &vm, Some("text/event-stream"), Some(pod));
                    for _ in 0..n {
                        f.on_response_body(gate, &vm, PIECE);
                    }
                    let end = format!(
                        "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":9,\"completion_tokens\":{n}}}}}\n\n"
                    );
                    f.on_response_body(gate, &vm, end.as_bytes());
                }
                f.on_done(gate, &vm);
                expected
            };
            for i in 0..30 {
                ask(&mut gate, "Classify.", i, Some(4 + i % 3));
                ask(&mut gate, "Summarize.", i, Some(380 + i % 40));
            }
            // Into the model's record at the tick's flush, read again a second later.
            gate.calibration.flush(&vm, &gate.config.estimator).unwrap();
            host.advance_ms(1_000);
            (
                ask(&mut gate, "Classify.", 99, None),
                ask(&mut gate, "Summarize.", 99, None),
            )
        };
        for kind in ["completions", "one line", "house rules", "with a profile"] {
            let (short, long) = expected(kind, true);
            let (short, long) = (short.unwrap(), long.unwrap());
            assert!(
                short < 30 && (300..=500).contains(&long),
                "{kind}: {short} {long}"
            );
            let (short, long) = expected(kind, false);
            assert_eq!(short, long, "{kind}, off: both the model's");
        }
    }

    /// Lengths learned after a request was admitted reach its outlook as it streams.
    #[test]
    fn an_answers_outlook_follows_the_lengths_learned_while_it_streams() {
        let (cfg, host, vm) = learned_pod(50, 10, 0);
        let mut gate = Gate::new(cfg.clone(), &vm).unwrap();
        let mut f = streaming(&mut gate, &vm);
        let far = |f: &Flow| {
            f.admitted
                .as_ref()
                .unwrap()
                .estimate
                .output
                .survival(1_000.0)
        };
        assert!(far(&f) < 0.05, "admitted when every answer was short");
        // Every answer since has run to 3,000 tokens.
        learn(&vm, &cfg, 1_000, 3_000, 0);
        host.advance_ms(2_000);
        for _ in 0..40 {
            f.on_response_body(&mut gate, &vm, PIECE);
        }
        assert!(far(&f) > 0.5, "{}", far(&f));
    }

    /// A request admitted before anything measured its model's lengths is on the prior's guess,
    /// and its entry says so (its pod's forecast counts the guess's error, `admission::forecast`)
    /// while the lengths learned as it streams run longer than the guess; one admitted after
    /// never is.
    #[test]
    fn an_entry_is_on_the_priors_guess_until_the_lengths_are_learned() {
        use crate::pods::record;
        let pod = "10.0.0.1:80";
        let mut cfg = crate::test_support::with_pods(&[pod]);
        cfg.estimator.min_samples = 5;
        let host = FakeHost::new();
        let vm = host.vm();
        let mut gate = Gate::new(cfg.clone(), &vm).unwrap();
        let mut f = streaming(&mut gate, &vm);
        let guessed = || record::read(&vm, pod).unwrap().entries[0].output_guessed;
        assert!(guessed());
        // Learned lengths longer than the guess (256): it was short, and its error still counts.
        learn(&vm, &cfg, 10, 600, 0);
        host.advance_ms(2_000);
        for _ in 0..40 {
            f.on_response_body(&mut gate, &vm, PIECE);
        }
        assert!(guessed(), "a guess the lengths learned pass");
        // Learned no longer than the guess: it erred long, or not at all.
        learn(&vm, &cfg, 200, 100, 0);
        host.advance_ms(2_000);
        for _ in 0..200 {
            f.on_response_body(&mut gate, &vm, PIECE);
        }
        assert!(!guessed(), "a guess the lengths learned do not pass");
        f.on_done(&mut gate, &vm);
        let mut g = streaming(&mut gate, &vm);
        assert!(!guessed());
        g.on_done(&mut gate, &vm);
    }

    /// A stream that reaches the filter several tokens at once was that far behind its engine:
    /// its entry keeps the most one chunk brought it, by which the pod's forecast counts every
    /// answer there behind its engine (`forecast::Lag`).
    #[test]
    fn a_chunk_of_several_tokens_shows_how_far_behind_its_engine_the_stream_came() {
        use crate::admission::forecast::Lag;
        use crate::pods::record;
        let pod = "10.0.0.1:80";
        let cfg = crate::test_support::with_pods(&[pod]);
        let host = FakeHost::new();
        let vm = host.vm();
        let mut gate = Gate::new(cfg, &vm).unwrap();
        let mut f = streaming(&mut gate, &vm);
        let lag = || record::read(&vm, pod).unwrap().entries[0].lag;
        assert_eq!(lag(), 0, "none seen before its stream");
        f.on_response_body(&mut gate, &vm, PIECE);
        assert_eq!(lag(), 1, "its first token, alone in its chunk");
        // Three at once, to its 19th token: written as it enters its second block.
        for _ in 0..6 {
            f.on_response_body(&mut gate, &vm, &PIECE.repeat(3));
        }
        assert_eq!(lag(), 3);
        assert_eq!(record::read(&vm, pod).unwrap().lag(), Lag::Seen(3));
        for _ in 0..20 {
            f.on_response_body(&mut gate, &vm, PIECE);
        }
        assert_eq!(lag(), 3, "the most it saw");
    }

    /// A model whose engine streams four tokens a chunk: each piece of its answer counts four
    /// in its entry, and a stream lost without usage is known to have run that far too.
    #[test]
    fn a_streamed_piece_counts_the_tokens_the_model_sends_a_chunk() {
        use crate::pods::record;
        let pod = "10.0.0.1:80";
        let (cfg, _host, vm) = learned_pod(10, 200, 50);
        let mut gate = Gate::new(cfg, &vm).unwrap();
        let mut f = streaming(&mut gate, &vm);
        let held = || record::read(&vm, pod).unwrap().entries[0].held_tokens;
        let prompt = held();
        // The entry is written as the count enters a new block: at 4, 20, 36 and 52 tokens.
        for _ in 0..13 {
            f.on_response_body(&mut gate, &vm, PIECE);
        }
        assert_eq!(held(), prompt + 52);
        f.on_done(&mut gate, &vm);
        let counts = gate.calibration.cohort_counts("m").unwrap();
        assert_eq!(
            counts.1[crate::estimate::output_dist::bucket(52)],
            1.0,
            "lost at 52 tokens"
        );
    }

    /// vLLM's chat embeddings (`messages` in place of `input`) are reserved and routed as their
    /// prompt, and a batch's answer, past the megabyte the meter keeps, is still read for its
    /// usage (before: refused as missing `input`; a long answer's usage lost).
    #[test]
    fn a_chat_embedding_is_reserved_and_its_long_answers_usage_read() {
        use crate::pods::record;
        let pod = "10.0.0.1:80";
        let host = FakeHost::new();
        let vm = host.vm();
        let mut gate = Gate::new(crate::test_support::with_pods(&[pod]), &vm).unwrap();
        let mut f = Flow::default();
        f.on_request_headers(&mut gate, &vm, &RequestHead::json_post("/v1/embeddings"));
        let body = br#"{"model":"m","messages":[{"role":"user","content":"embed this please"}]}"#;
        f.on_body(&mut gate, &vm, body);
        let entry = record::read(&vm, pod).unwrap().entries[0];
        assert!(entry.held_tokens > 0, "its prompt, held");
        f.on_response_headers(&mut gate, &vm, Some("application/json"), Some(pod));
        // vLLM's answer for 24 prompts of 4,096 dimensions: about 2 MB, usage last.
        let vector = vec!["0.015625"; 4096].join(",");
        let item = format!(r#"{{"index":0,"object":"embedding","embedding":[{vector}]}}"#);
        let answer = format!(
            r#"{{"id":"embd-1","object":"list","created":1,"model":"m","data":[{}],"usage":{{"prompt_tokens":240,"total_tokens":240,"completion_tokens":0,"prompt_tokens_details":null}}}}"#,
            vec![item; 24].join(",")
        );
        for piece in answer.as_bytes().chunks(16 * 1024) {
            f.on_response_body(&mut gate, &vm, piece);
        }
        f.on_done(&mut gate, &vm);
        assert_eq!(gate.stats.take_count(stats::USAGE_PROMPT_TOKENS), 240);
        assert_eq!(gate.stats.take_count(stats::USAGE_COMPLETION_TOKENS), 0);
        assert!(record::read(&vm, pod).unwrap().entries.is_empty());
    }

    #[test]
    fn each_answer_reports_the_estimates_error_and_the_pods_prefix_blocks() {
        let cfg = crate::test_support::with_pods(&["10.0.0.1:80"]);
        let host = FakeHost::new();
        let vm = host.vm();
        let mut gate = Gate::new(cfg, &vm).unwrap();
        let mut f = Flow::default();
        let head = RequestHead::json_post("/v1/completions");
        f.on_request_headers(&mut gate, &vm, &head);
        f.on_body(
            &mut gate,
            &vm,
            br#"{"model":"m","prompt":"hello there","max_tokens":20}"#,
        );
        f.on_response_headers(
            &mut gate,
            &vm,
            Some("application/json"),
            Some("10.0.0.1:80"),
        );
        let est = f.admitted.as_ref().map(|a| a.estimate).unwrap();
        let usage = br#"{"usage":{"prompt_tokens":4,"completion_tokens":10}}"#;
        f.on_response_body(&mut gate, &vm, usage);
        f.on_done(&mut gate, &vm);
        let sent: Vec<Stat> = gate.stats.drain().collect();
        // A model neither configured nor listed by a pod counts under `other`.
        for expected in [
            Stat::Histogram(
                "kvgate.model.other.prompt_error_pct".into(),
                error_percent(est.prompt_tokens, 4),
            ),
            Stat::Histogram(
                "kvgate.model.other.output_error_pct".into(),
                error_percent(est.output_tokens, 10),
            ),
            Stat::Counter("kvgate.pod.10_0_0_1_80.prefix_blocks_total".into(), 1),
        ] {
            assert!(sent.contains(&expected), "{expected:?} in {sent:?}");
        }
    }
}
