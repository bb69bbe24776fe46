//! How a host carries out kvgate's decisions, in the parts that are decisions themselves: what a
//! step means for the stream (continue, resume, pause, answer), and, when the line moves, which
//! of this VM's parked requests to retry, in what order, and what to do when a parked request's
//! stream is already gone. The shell (and the flow fuzz target) supply the host side through
//! [`Waiting`]; the logic lives here so it is tested natively and shared by both.

use crate::admission::admit::{Reach, Stay};
use crate::admission::line::ANYWHERE;
use crate::flow::{Flow, Gate, Step};
use crate::openai::reply::LocalReply;
use crate::stats;
use crate::store::interface::Store;

/// Wake-ups admit at most this many requests from the head of the line in one pass; each pass
/// admits or drops one ticket and the line is bounded, so this only guards against a loop.
const MAX_ADMITS: usize = 1_000;

/// Backfills tried in one pass over the line at most, however many passes the head has left:
/// each is a routing attempt on the request path of whatever woke the VM.
const MAX_BACKFILL_TRIES: usize = 8;

/// What the host does with a stream once a decision's header edits are made.
#[derive(Debug, PartialEq, Eq)]
pub enum Next<'a> {
    /// Let the current callback continue.
    Continue,
    /// The request was parked earlier (its callback returned long ago): resume it explicitly.
    Resume,
    /// Hold the stream: more body to come, or parked in the line.
    Pause,
    /// Send this local answer; the stream stays paused and goes no further upstream.
    Reply(&'a LocalReply),
}

/// The host's part of `step`; `parked_earlier` for a request taken out of the line.
pub fn next(step: &Step, parked_earlier: bool) -> Next<'_> {
    match step {
        Step::Forward if parked_earlier => Next::Resume,
        Step::Forward => Next::Continue,
        Step::WaitForBody | Step::Park(_) | Step::Hold => Next::Pause,
        Step::Reply(reply) => Next::Reply(reply),
    }
}

/// The host side of this VM's parked requests: where they are kept (by ticket), and how their
/// streams are reached.
pub trait Waiting {
    /// How the host refers to one parked request.
    type Stream;
    /// The request parked under `ticket`, when this VM holds it.
    fn find(&self, ticket: u64) -> Option<Self::Stream>;
    /// The request has left the line: forget its ticket.
    fn unpark(&mut self, ticket: u64);
    /// Makes the request's stream the one later host calls act on; false when the stream is
    /// gone (reset) and its `on_done` has not been delivered yet.
    fn enter(&mut self, stream: &Self::Stream) -> bool;
    /// Runs `f` on the request's flow.
    fn with_flow<R>(&mut self, stream: &Self::Stream, f: impl FnOnce(&mut Flow) -> R) -> R;
    /// Carries out the decision that took the request out of the line (on its entered stream).
    fn resume(&mut self, stream: &Self::Stream, decision: crate::flow::Decision);
}

/// Retries one parked request on the pods `reach` allows among those its bits name
/// (`line::ANYWHERE`: all); `Ok` when it left the line (admitted, answered or released).
pub fn retry(
    gate: &mut Gate,
    store: &dyn Store,
    waiting: &mut impl Waiting,
    ticket: u64,
    reach: (Reach, u64),
) -> Result<(), Stay> {
    let Some(stream) = waiting.find(ticket) else {
        // A ticket this VM parked with no stream to resume: nobody would ever take it out of
        // the line, which waits behind it. (Every path that lets a stream go leaves the line
        // too; this keeps one that did not from stopping the line.)
        if gate.admission.withdraw(store, ticket) {
            gate.stats.count(stats::ADMISSION_LOST, 1);
        }
        return Err(Stay::NoRoom);
    };
    if !waiting.enter(&stream) {
        // The stream is gone without its on_done yet: release it now, exactly once (a later
        // on_done finds the flow finished), so its ticket does not hold up the line.
        waiting.unpark(ticket);
        waiting.with_flow(&stream, |flow| flow.on_done(gate, store));
        return Ok(());
    }
    let decision = waiting.with_flow(&stream, |flow| flow.retry(gate, store, reach))?;
    waiting.unpark(ticket);
    waiting.resume(&stream, decision);
    Ok(())
}

/// The line moved (a wake-up or the tick): answers the parked requests whose wait ran out, then
/// admits from each ticket heading the line on some pods (`line::QueueRecord::leaders`: the head
/// of each set of pods its requests share, and a ticket behind heads on the pods none of them
/// may take, there only) while that ticket is this VM's and fits, then tries this VM's
/// backfills (requests behind a head that does not fit, into the room it leaves).
///
/// In a cache-friendly order: a request goes where its prompt's prefix is cached, when some pod
/// caches it. When the room is only on pods that would compute the head's prefix again, the
/// backfills that find their own prefix there go before it (`admission.cacheFirstPasses` more
/// passes a head), and the head then goes wherever there is room; a plain backfill (behind a head
/// with no room at all) never copies a prefix another pod caches. Measured on the burst
/// benchmark (1,000 requests of 10 prompt groups at once): in line order each wave after the
/// first sent the line's head to whichever pod had freed room, and 36–37 requests a run computed
/// a 2k-token system prompt on a pod that never had it (21–27 behind sglang-router), each such
/// copy holding the KV of about seven requests, so a third wave was needed; in this order, 2–15.
pub fn run_line(gate: &mut Gate, store: &dyn Store, waiting: &mut impl Waiting) {
    // Those whose wait ran out first (503), then those a request of higher precedence took the
    // place of in the full line (429).
    for ticket in gate.expired(store) {
        let _ = retry(gate, store, waiting, ticket, (Reach::Any, ANYWHERE));
    }
    for ticket in gate.displaced(store) {
        let _ = retry(gate, store, waiting, ticket, (Reach::Any, ANYWHERE));
    }
    gate.admission.begin_pass();
    // Heads of this VM that stay in the line in this pass: the next head is tried.
    let mut tried = Vec::new();
    for _ in 0..MAX_ADMITS {
        let Some((ticket, within)) = gate.next_parked(store, &tried) else {
            break;
        };
        let roomy = match retry(gate, store, waiting, ticket, (Reach::Cached, within)) {
            Ok(()) => continue,
            Err(Stay::NoRoom) => {
                tried.push(ticket);
                continue;
            }
            Err(Stay::Uncached(pods)) => pods,
        };
        // Those behind it whose prompt belongs on a pod with room (its prefix cached there by
        // this VM's index, or its group's home): a cheap look through the line first, then a
        // pick for each, which decides.
        let now = store.now_ms();
        let cached: Vec<u64> = gate
            .backfill(store, true, Some(ticket))
            .into_iter()
            .filter(|&t| {
                waiting.find(t).is_some_and(|stream| {
                    waiting.with_flow(&stream, |f| f.parked_prompt_belongs_on(gate, &roomy, now))
                })
            })
            .take(MAX_BACKFILL_TRIES)
            .collect();
        let admitted = backfill(gate, store, waiting, cached, true);
        gate.stats
            .count(stats::ADMISSION_CACHE_FIRST, admitted as u64);
        // For `Config::cache_wait_ms` from the first time it heads the line with room only
        // elsewhere, a head whose prefix few requests share waits for room where it is cached
        // (`Router::route_patient`) rather than take room elsewhere. Not from its arrival: in a
        // saturated pool every request waits longer than that for room anywhere, and each head
        // would then copy its prefix to whichever pod freed room first.
        let cache_wait_ms = gate.config.cache_wait_ms();
        let reach = if gate
            .admission
            .patient(ticket, store.now_ms(), cache_wait_ms)
        {
            Reach::Patient
        } else {
            Reach::Any
        };
        match retry(gate, store, waiting, ticket, (reach, within)) {
            Ok(()) => gate.stats.count(stats::ADMISSION_UNCACHED, 1),
            Err(stay) => {
                if matches!(stay, Stay::Uncached(_)) {
                    gate.admission.set_head_waits_for_cache();
                }
                tried.push(ticket);
            }
        }
    }
    // Behind a head with no room (or another VM's), a backfill goes only where its prefix is,
    // when some pod holds it: a pass spent on a copy of a prefix another pod holds would cost
    // the room of several requests.
    let tickets = gate.backfill(store, false, None);
    backfill(gate, store, waiting, tickets, false);
}

/// Retries `tickets` in line order, each where its prefix is when some pod caches it, while the
/// head may still be passed (`cache_first`: by `cacheFirstPasses` more), up to
/// `MAX_BACKFILL_TRIES`; how many left the line. The passes a head has left do not limit the
/// tries: behind a long prompt the first few parked requests are often long too, and a shorter
/// one further back fits the room.
fn backfill(
    gate: &mut Gate,
    store: &dyn Store,
    waiting: &mut impl Waiting,
    tickets: Vec<u64>,
    cache_first: bool,
) -> usize {
    let mut admitted = 0;
    for (i, ticket) in tickets.into_iter().take(MAX_BACKFILL_TRIES).enumerate() {
        // The listing (`Gate::backfill`) has just read the passes for the first.
        if i > 0 && !gate.may_pass(store, cache_first, ticket) {
            break;
        }
        if retry(gate, store, waiting, ticket, (Reach::Cached, ANYWHERE)).is_ok() {
            admitted += 1;
        }
    }
    admitted
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::config::Config;
    use crate::flow::{Decision, RequestHead, DESTINATION_HEADER};
    use crate::pods::scrape::Target;
    use crate::store::fake_host::{FakeHost, FakeVm};
    use hashbrown::{HashMap, HashSet};

    const POD: &str = "10.0.0.1:8000";

    /// Backfills admitted past the first ticket of the line while it headed it.
    fn first_passes(vm: &FakeVm) -> u32 {
        let q = crate::admission::line::read(vm).unwrap();
        q.tickets.first().map_or(0, |h| q.passes(h.id))
    }

    /// A host holding flows by context id, some of whose streams may be gone.
    #[derive(Default)]
    struct Host {
        flows: HashMap<u32, Flow>,
        parked: HashMap<u64, u32>,
        gone: HashSet<u32>,
        resumed: Vec<(u32, Decision)>,
    }

    impl Waiting for Host {
        type Stream = u32;
        fn find(&self, ticket: u64) -> Option<u32> {
            self.parked.get(&ticket).copied()
        }
        fn unpark(&mut self, ticket: u64) {
            self.parked.remove(&ticket);
        }
        fn enter(&mut self, context: &u32) -> bool {
            !self.gone.contains(context)
        }
        fn with_flow<R>(&mut self, context: &u32, f: impl FnOnce(&mut Flow) -> R) -> R {
            f(self.flows.entry(*context).or_default())
        }
        fn resume(&mut self, context: &u32, decision: Decision) {
            self.resumed.push((*context, decision));
        }
    }

    /// One pod whose budget holds one request: the second and later requests park.
    fn gate() -> (FakeHost, FakeVm, Gate) {
        gate_with(r#""budgetTokens":100"#)
    }

    /// One pod, waits of 5 s, and `admission` (JSON members) added to the admission config.
    fn gate_with(admission: &str) -> (FakeHost, FakeVm, Gate) {
        let host = FakeHost::new();
        host.set_now_ms(1_000_000);
        let vm = host.vm();
        let config = Config::parse(
            format!(r#"{{"pods":["{POD}"],"admission":{{"maxWaitMs":5000,{admission}}}}}"#)
                .as_bytes(),
        )
        .unwrap();
        let gate = Gate::new(config, &vm).unwrap();
        (host, vm, gate)
    }

    /// Sends a request on `context`; returns its decision, parking it in `host` as the shell does.
    fn send(gate: &mut Gate, vm: &dyn Store, host: &mut Host, context: u32) -> Decision {
        send_sized(gate, vm, host, context, 40, 50)
    }

    /// `send` with a prompt of about `words` tokens and `max_tokens`.
    fn send_sized(
        gate: &mut Gate,
        vm: &dyn Store,
        host: &mut Host,
        context: u32,
        words: usize,
        max_tokens: u32,
    ) -> Decision {
        send_to(gate, vm, host, context, "m", (words, max_tokens))
    }

    /// `send_sized` for `model`.
    fn send_to(
        gate: &mut Gate,
        vm: &dyn Store,
        host: &mut Host,
        context: u32,
        model: &str,
        size: (usize, u32),
    ) -> Decision {
        send_from(gate, vm, host, (context, None), model, size)
    }

    /// `send_to` from `tenant`, when given.
    fn send_from(
        gate: &mut Gate,
        vm: &dyn Store,
        host: &mut Host,
        (context, tenant): (u32, Option<&str>),
        model: &str,
        (words, max_tokens): (usize, u32),
    ) -> Decision {
        let body = format!(
            // Streamed: an answer that does not stream keeps its VM's tick quick, which these tests
            // of the line's own tick would see.
            r#"{{"model":"{model}","prompt":"request {context} {}","max_tokens":{max_tokens},"stream":true}}"#,
            "x ".repeat(words)
        );
        let mut flow = Flow::default();
        let head = RequestHead {
            content_length: Some(body.len() as u64),
            tenant,
            ..RequestHead::json_post("/v1/completions")
        };
        assert_eq!(
            flow.on_request_headers(gate, vm, &head).step,
            Step::WaitForBody
        );
        let d = flow.on_body(gate, vm, body.as_bytes());
        if let Step::Park(ticket) = d.step {
            host.parked.insert(ticket, context);
        }
        host.flows.insert(context, flow);
        d
    }

    fn reserved(vm: &FakeVm) -> u64 {
        crate::pods::record::read(vm, POD).unwrap().held_tokens()
    }

    #[test]
    fn a_model_on_pods_of_its_own_is_not_held_behind_another_models_line() {
        // Model m on POD, model n on b (`two_models`): before the line had a head per set of
        // pods, n's requests waited behind m's head however idle n's pod was. The second b's name
        // hashes to POD's bit: before each pod of the pool had a bit of its own, those two pods'
        // requests waited for each other.
        for b in ["10.0.0.2:8000", "10.0.0.12:8000"] {
            own_line(b);
        }
    }

    /// Model m on POD and model n on `b`, each pod's budget one request, and a strict line (no
    /// backfills).
    fn two_models(b: &str) -> (FakeHost, FakeVm, Gate) {
        serving(&[(POD, &[("m", None)]), (b, &[("n", None)])])
    }

    /// A model a pod's list names, with its base model for an adapter.
    type Listed<'a> = (&'a str, Option<&'a str>);

    /// Pods whose model lists name these models, each pod's budget one request, and a strict
    /// line (no backfills).
    fn serving(lists: &[(&str, &[Listed])]) -> (FakeHost, FakeVm, Gate) {
        let host = FakeHost::new();
        host.set_now_ms(1_000_000);
        let vm = host.vm();
        for (pod, models) in lists {
            let list: Vec<_> = models
                .iter()
                .map(|(id, parent)| crate::models::served::ServedModel {
                    id: (*id).into(),
                    parent: parent.map(Into::into),
                })
                .collect();
            crate::models::served::write_list(&vm, pod, &list, 1).unwrap();
        }
        let pods: Vec<String> = lists.iter().map(|(p, _)| format!("\"{p}\"")).collect();
        let config = Config::parse(
            format!(
                r#"{{"pods":[{}],"admission":{{"maxWaitMs":5000,"budgetTokens":100,"backfillPasses":0}}}}"#,
                pods.join(",")
            )
            .as_bytes(),
        )
        .unwrap();
        let gate = Gate::new(config, &vm).unwrap();
        (host, vm, gate)
    }

    /// The pod a decision sends its request to.
    fn on(d: &Decision) -> Option<String> {
        d.set
            .iter()
            .find(|(n, _)| n == DESTINATION_HEADER)
            .map(|(_, v)| v.clone())
    }

    fn own_line(b: &str) {
        let (_host, vm, mut gate) = two_models(b);
        let mut host = Host::default();
        let size = (40, 50);
        let m1 = send_to(&mut gate, &vm, &mut host, 1, "m", size);
        assert_eq!(on(&m1).as_deref(), Some(POD));
        let m2 = send_to(&mut gate, &vm, &mut host, 2, "m", size);
        assert!(matches!(m2.step, Step::Park(_)), "m's pod is full");
        let n1 = send_to(&mut gate, &vm, &mut host, 3, "n", size);
        assert_eq!(on(&n1).as_deref(), Some(b), "nobody waits for b: at once");
        let n2 = send_to(&mut gate, &vm, &mut host, 4, "n", size);
        assert!(matches!(n2.step, Step::Park(_)), "b is full now");
        // b frees: n's head goes, m's stays.
        host.flows.get_mut(&3).unwrap().on_done(&mut gate, &vm);
        run_line(&mut gate, &vm, &mut host);
        assert_eq!(host.resumed.len(), 1, "{:?}", host.resumed);
        assert_eq!(host.resumed[0].0, 4);
        assert_eq!(on(&host.resumed[0].1).as_deref(), Some(b));
        assert_eq!(
            first_passes(&vm),
            0,
            "a head of a line of its own passes nobody"
        );
        // And m's pod frees: its head goes.
        host.flows.get_mut(&1).unwrap().on_done(&mut gate, &vm);
        run_line(&mut gate, &vm, &mut host);
        assert_eq!(host.resumed.len(), 2, "{:?}", host.resumed);
        assert_eq!(host.resumed[1].0, 2);
        assert!(host.parked.is_empty());
    }

    #[test]
    fn a_request_goes_to_pods_no_ticket_ahead_of_it_may_take_past_a_head_waiting_for_others() {
        // Base model m on POD and b; its adapter x on POD only. Each pod's budget holds one
        // request, and the line is strict (no backfills). Before a ticket headed the line on the
        // pods no ticket ahead of it may take, m's requests waited behind x's head for room on
        // POD however idle b was.
        let b = "10.0.0.2:8000";
        let (_host, vm, mut gate) =
            serving(&[(POD, &[("m", None), ("x", Some("m"))]), (b, &[("m", None)])]);
        let mut host = Host::default();
        let size = (40, 50);
        let x1 = send_to(&mut gate, &vm, &mut host, 1, "x", size);
        assert_eq!(on(&x1).as_deref(), Some(POD));
        let x2 = send_to(&mut gate, &vm, &mut host, 2, "x", size);
        assert!(matches!(x2.step, Step::Park(_)), "x's pod is full");
        let m1 = send_to(&mut gate, &vm, &mut host, 3, "m", size);
        assert_eq!(on(&m1).as_deref(), Some(b), "nobody waits for b: at once");
        for c in [4, 5] {
            let d = send_to(&mut gate, &vm, &mut host, c, "m", size);
            assert!(matches!(d.step, Step::Park(_)), "b is full now");
        }
        // b frees: the first m behind x's head goes there, and passes nobody.
        host.flows.get_mut(&3).unwrap().on_done(&mut gate, &vm);
        run_line(&mut gate, &vm, &mut host);
        let resumed: Vec<(u32, Option<String>)> =
            host.resumed.iter().map(|(c, d)| (*c, on(d))).collect();
        assert_eq!(resumed, vec![(4, Some(b.to_string()))]);
        assert_eq!(first_passes(&vm), 0, "4 took no room x's head waits for");
        // POD frees: x's head takes it, not the m behind it.
        host.flows.get_mut(&1).unwrap().on_done(&mut gate, &vm);
        run_line(&mut gate, &vm, &mut host);
        assert_eq!(host.resumed.len(), 2, "{:?}", host.resumed);
        assert_eq!(
            (host.resumed[1].0, on(&host.resumed[1].1).as_deref()),
            (2, Some(POD))
        );
        assert_eq!(host.parked.values().copied().collect::<Vec<_>>(), vec![5]);
    }

    #[test]
    fn a_tenants_use_of_one_models_pods_does_not_put_it_behind_on_anothers() {
        // Tenant x fills m's line; then x and y wait on n's, x first. Before fairness was kept
        // per set of pods, x's tokens on m put its request on n behind y's.
        let (_host, vm, mut gate) = two_models("10.0.0.2:8000");
        let mut host = Host::default();
        let size = (40, 50);
        let z = send_from(&mut gate, &vm, &mut host, (1, Some("z")), "n", size);
        assert_eq!(z.step, Step::Forward, "B taken");
        for c in 2..6 {
            send_from(&mut gate, &vm, &mut host, (c, Some("x")), "m", size);
        }
        for (c, tenant) in [(10, "x"), (11, "y")] {
            let d = send_from(&mut gate, &vm, &mut host, (c, Some(tenant)), "n", size);
            assert!(
                matches!(d.step, Step::Park(_)),
                "{tenant} waits on n's line"
            );
        }
        host.flows.get_mut(&1).unwrap().on_done(&mut gate, &vm);
        run_line(&mut gate, &vm, &mut host);
        let resumed: Vec<u32> = host.resumed.iter().map(|(c, _)| *c).collect();
        assert_eq!(resumed, [10], "x came first on n, and is not behind there");
    }

    #[test]
    fn steps_map_to_continue_resume_pause_or_reply() {
        let reply = LocalReply::error(429, "queue_full", "full", None);
        assert_eq!(next(&Step::Forward, false), Next::Continue);
        assert_eq!(next(&Step::Forward, true), Next::Resume);
        assert_eq!(next(&Step::WaitForBody, false), Next::Pause);
        assert_eq!(next(&Step::Park(7), false), Next::Pause);
        let step = Step::Reply(reply.clone());
        assert_eq!(next(&step, true), Next::Reply(&reply));
    }

    #[test]
    fn released_budget_admits_the_head_of_the_line_and_resumes_its_stream() {
        let (_h, vm, mut gate) = gate();
        let mut host = Host::default();
        assert_eq!(send(&mut gate, &vm, &mut host, 1).step, Step::Forward);
        assert!(matches!(
            send(&mut gate, &vm, &mut host, 2).step,
            Step::Park(_)
        ));
        assert!(matches!(
            send(&mut gate, &vm, &mut host, 3).step,
            Step::Park(_)
        ));
        run_line(&mut gate, &vm, &mut host);
        assert!(
            host.resumed.is_empty(),
            "nothing fits while the first holds the budget"
        );
        assert_eq!(host.parked.len(), 2);

        host.flows.get_mut(&1).unwrap().on_done(&mut gate, &vm);
        run_line(&mut gate, &vm, &mut host);
        assert_eq!(host.resumed.len(), 1, "one fits: {:?}", host.resumed);
        let (context, d) = &host.resumed[0];
        assert_eq!(*context, 2, "the head of the line goes first");
        assert_eq!(d.step, Step::Forward);
        assert!(d
            .set
            .iter()
            .any(|(n, v)| n == DESTINATION_HEADER && v == POD));
        assert_eq!(host.parked.values().copied().collect::<Vec<_>>(), [3]);
    }

    #[test]
    fn a_request_sent_before_the_first_discovery_waits_for_the_pool_and_goes_to_a_pick() {
        let vm = FakeHost::new().vm();
        let config =
            r#"{"discovery":{"adminCluster":"kvgate_admin"},"admission":{"budgetTokens":1000}}"#;
        let mut gate = Gate::new(Config::parse(config.as_bytes()).unwrap(), &vm).unwrap();
        assert_eq!(gate.tick_ms(&vm), 20, "discovery is asked for at once");
        let mut host = Host::default();
        assert!(matches!(
            send(&mut gate, &vm, &mut host, 1).step,
            Step::Park(_)
        ));
        let calls = gate.on_tick(&vm);
        assert!(calls.iter().any(|c| c.target == Target::Discovery));
        let clusters = crate::test_support::clusters_json(&[POD]);
        gate.on_call_response(&vm, &Target::Discovery, Some(200), &clusters);
        assert!(
            vm.dequeue(gate.wake_queue()).unwrap().is_some(),
            "the head's VM is woken by the discovery, not a tick later"
        );
        run_line(&mut gate, &vm, &mut host);
        assert_eq!(host.resumed.len(), 1);
        assert!(host.resumed[0]
            .1
            .set
            .iter()
            .any(|(n, v)| n == DESTINATION_HEADER && v == POD));
        assert_eq!(gate.tick_ms(&vm), crate::gate::TICK_MS);
        assert_eq!(gate.stats.take_count(stats::ROUTED), 1);
    }

    #[test]
    fn a_request_behind_a_head_that_does_not_fit_backfills_the_room_a_bounded_number_of_times() {
        for passes in [0, 1] {
            let (_h, vm, mut gate) =
                gate_with(&format!(r#""budgetTokens":300,"backfillPasses":{passes}"#));
            let mut host = Host::default();
            // About 145 tokens run; a head of about 255 does not fit beside them, two of about
            // 75 and 30 would.
            assert_eq!(
                send_sized(&mut gate, &vm, &mut host, 1, 40, 100).step,
                Step::Forward
            );
            for (context, words, max) in [(2, 150, 100), (3, 20, 50), (4, 5, 20)] {
                assert!(matches!(
                    send_sized(&mut gate, &vm, &mut host, context, words, max).step,
                    Step::Park(_)
                ));
            }
            run_line(&mut gate, &vm, &mut host);
            let resumed: Vec<u32> = host.resumed.iter().map(|(c, _)| *c).collect();
            if passes == 0 {
                assert!(resumed.is_empty(), "a strict line: {resumed:?}");
            } else {
                assert_eq!(resumed, [3], "one pass: the first that fits, then no more");
            }
            let line = crate::admission::line::read(&vm).unwrap();
            assert_eq!(
                line.tickets.first().map(|t| t.vm),
                Some(gate.vm()),
                "the head still waits, first"
            );
            assert_eq!(host.parked.len(), 3 - passes as usize);
            assert!(reserved(&vm) <= 300);
            // The head goes once what runs leaves it room (with a backfill, that is one more to
            // finish: the price of the pass); the next head starts with no passes.
            let running = if passes == 0 { vec![1] } else { vec![1, 3] };
            for context in running {
                host.flows
                    .get_mut(&context)
                    .unwrap()
                    .on_done(&mut gate, &vm);
                run_line(&mut gate, &vm, &mut host);
            }
            assert!(
                host.resumed.iter().any(|(c, _)| *c == 2),
                "{:?}",
                host.resumed
            );
            assert_eq!(first_passes(&vm), 0);
        }
    }

    #[test]
    fn a_head_with_passes_left_has_parked_requests_tried_past_one_that_does_not_fit() {
        let (_h, vm, mut gate) = gate_with(r#""budgetTokens":300,"backfillPasses":1"#);
        let mut host = Host::default();
        assert_eq!(
            send_sized(&mut gate, &vm, &mut host, 1, 40, 100).step,
            Step::Forward
        );
        // Behind a head of about 255 tokens, one of about 200 that does not fit either, then
        // one of about 30 that does: the one pass left is not one try.
        for (context, words, max) in [(2, 150, 100), (3, 100, 100), (4, 5, 20)] {
            assert!(matches!(
                send_sized(&mut gate, &vm, &mut host, context, words, max).step,
                Step::Park(_)
            ));
        }
        run_line(&mut gate, &vm, &mut host);
        let resumed: Vec<u32> = host.resumed.iter().map(|(c, _)| *c).collect();
        assert_eq!(resumed, [4]);
        assert!(reserved(&vm) <= 300);
    }

    const PODS: [&str; 2] = ["10.0.0.1:8000", "10.0.0.2:8000"];

    /// Two pods, waits of 5 s, and `admission` (JSON members) added to the admission config.
    fn two_pods(admission: &str) -> (FakeVm, Gate) {
        let host = FakeHost::new();
        host.set_now_ms(1_000_000);
        let vm = host.vm();
        let config = format!(
            r#"{{"pods":["{}","{}"],"admission":{{"maxWaitMs":5000,{admission}}}}}"#,
            PODS[0], PODS[1]
        );
        let gate = Gate::new(Config::parse(config.as_bytes()).unwrap(), &vm).unwrap();
        (vm, gate)
    }

    /// Sends a prompt of `system` (a group's shared prefix, about 250 tokens when not empty)
    /// and a question of `words` words, parking it in `host` as the shell does; returns the pod
    /// it was sent to, if it was.
    fn send_prompt(
        (gate, vm, host): (&mut Gate, &FakeVm, &mut Host),
        context: u32,
        system: &str,
        words: usize,
        max_tokens: u32,
    ) -> Option<String> {
        let system = if system.is_empty() {
            String::new()
        } else {
            format!("You are assistant {system}. ").repeat(60)
        };
        let question = format!("question {context} ").repeat(words);
        let body = format!(
            r#"{{"model":"m","prompt":"{system}{question}","max_tokens":{max_tokens},"stream":true}}"#
        );
        let mut flow = Flow::default();
        let head = RequestHead {
            content_length: Some(body.len() as u64),
            ..RequestHead::json_post("/v1/completions")
        };
        flow.on_request_headers(gate, vm, &head);
        let d = flow.on_body(gate, vm, body.as_bytes());
        if let Step::Park(ticket) = d.step {
            host.parked.insert(ticket, context);
        }
        host.flows.insert(context, flow);
        destination(&d)
    }

    /// Two pods with `cacheWaitMs` 100 and room for one request each (not for a second of its
    /// group beside it), x's and y's first requests on them: the VM, the gate, the host, x's pod
    /// and y's pod.
    fn x_and_y_on_their_pods() -> (FakeVm, Gate, Host, String, String) {
        let (vm, mut gate) = two_pods(r#""budgetTokens":700,"cacheWaitMs":100"#);
        let mut host = Host::default();
        let x1 = send_prompt((&mut gate, &vm, &mut host), 1, "X", 60, 16).expect("routed");
        let y1 = send_prompt((&mut gate, &vm, &mut host), 2, "Y", 60, 16).expect("routed");
        assert_ne!(x1, y1);
        (vm, gate, host, x1, y1)
    }

    /// The pod a decision sends its request to (the override host's first, before fallbacks).
    fn destination(d: &Decision) -> Option<String> {
        d.set
            .iter()
            .find(|(n, _)| n == DESTINATION_HEADER)
            .and_then(|(_, v)| v.split(',').next())
            .map(str::to_string)
    }

    fn held(vm: &FakeVm, pod: &str) -> u64 {
        crate::pods::record::read(vm, pod).unwrap().held_tokens()
    }

    #[test]
    fn room_goes_first_to_a_request_whose_prefix_is_cached_there_within_the_backfill_bound() {
        for passes in [0, 1] {
            // Room for one request a pod, not for a second of its group beside it.
            let (vm, mut gate) = two_pods(&format!(
                r#""budgetTokens":700,"backfillPasses":0,"cacheFirstPasses":{passes},"cacheWaitMs":0"#
            ));
            let mut host = Host::default();
            let mut send = |gate: &mut Gate, context: u32, group: &str| {
                send_prompt((gate, &vm, &mut host), context, group, 60, 16)
            };
            let x1 = send(&mut gate, 1, "X").expect("routed");
            let y1 = send(&mut gate, 2, "Y").expect("routed");
            assert_ne!(x1, y1);
            assert_eq!(send(&mut gate, 3, "X"), None, "x's pod is full: the head");
            // More than a pass's picks of requests no pod caches, then y's next: found all the
            // same, by the index, without a pick for each.
            for context in 10..20 {
                assert_eq!(send(&mut gate, context, &format!("Z{context}")), None);
            }
            assert_eq!(send(&mut gate, 4, "Y"), None, "behind them");
            // y's pod frees: the head would compute x's prefix there, y's next finds its own.
            host.flows.get_mut(&2).unwrap().on_done(&mut gate, &vm);
            run_line(&mut gate, &vm, &mut host);
            let (context, d) = &host.resumed[0];
            assert_eq!(host.resumed.len(), 1);
            assert_eq!(destination(d), Some(y1.clone()));
            if passes == 0 {
                assert_eq!(*context, 3, "a strict line: the head goes, and copies");
            } else {
                assert_eq!(*context, 4, "the room goes where its prefix is");
                assert_eq!(first_passes(&vm), 1);
            }
            for pod in PODS {
                assert!(held(&vm, pod) <= 700, "{pod}: {}", held(&vm, pod));
            }
        }
    }

    #[test]
    fn a_request_waits_for_room_where_its_prefix_is_for_cache_wait_ms_and_then_takes_room_elsewhere(
    ) {
        for frees in ["its own pod", "nothing"] {
            let (vm, mut gate, mut host, x1, y1) = x_and_y_on_their_pods();
            let send = |gate: &mut Gate, host: &mut Host, context: u32, group: &str| {
                send_prompt((gate, &vm, host), context, group, 60, 16)
            };
            assert_eq!(gate.retick(&vm), Some(crate::gate::TICK_MS));
            // y's pod frees before x's next arrives: there is room, but only as a copy of x's
            // prefix, which one request in flight shares. It waits.
            host.flows.get_mut(&2).unwrap().on_done(&mut gate, &vm);
            assert_eq!(send(&mut gate, &mut host, 3, "X"), None, "x's pod is full");
            assert_eq!(gate.stats.take_count(stats::ADMISSION_CACHE_WAITS), 1);
            // Nothing may wake the line as the wait ends: the tick is quick from its arrival.
            assert_eq!(gate.retick(&vm), Some(crate::gate::QUICK_TICK_MS));
            run_line(&mut gate, &vm, &mut host);
            assert!(host.resumed.is_empty(), "{:?}", host.resumed);
            assert_eq!(gate.retick(&vm), None, "still quick");
            if frees == "its own pod" {
                host.flows.get_mut(&1).unwrap().on_done(&mut gate, &vm);
                run_line(&mut gate, &vm, &mut host);
                assert_eq!(destination(&host.resumed[0].1), Some(x1.clone()), "{frees}");
            } else {
                vm.host().advance_ms(99);
                run_line(&mut gate, &vm, &mut host);
                assert!(host.resumed.is_empty(), "{:?}", host.resumed);
                vm.host().advance_ms(1);
                run_line(&mut gate, &vm, &mut host);
                assert_eq!(destination(&host.resumed[0].1), Some(y1.clone()), "{frees}");
                assert_eq!(gate.stats.take_count(stats::ADMISSION_UNCACHED), 1);
            }
            assert_eq!(host.resumed.len(), 1);
            assert_eq!(gate.retick(&vm), Some(crate::gate::TICK_MS));
        }
    }

    #[test]
    fn a_request_that_waited_for_room_anywhere_still_waits_cache_wait_ms_for_its_prefixs_pod() {
        let (vm, mut gate, mut host, _, y1) = x_and_y_on_their_pods();
        let send = |gate: &mut Gate, host: &mut Host, context: u32, group: &str| {
            send_prompt((gate, &vm, host), context, group, 60, 16)
        };
        // The pool is full: x's next waits for room anywhere, far longer than `cacheWaitMs`.
        assert_eq!(send(&mut gate, &mut host, 3, "X"), None);
        assert_eq!(gate.stats.take_count(stats::ADMISSION_CACHE_WAITS), 0);
        vm.host().advance_ms(500);
        run_line(&mut gate, &vm, &mut host);
        assert!(host.resumed.is_empty(), "{:?}", host.resumed);
        // y's pod frees: room, but only as a copy of x's prefix. Its wait for x's pod starts
        // now, not at its arrival.
        host.flows.get_mut(&2).unwrap().on_done(&mut gate, &vm);
        run_line(&mut gate, &vm, &mut host);
        assert!(host.resumed.is_empty(), "{:?}", host.resumed);
        assert_eq!(gate.retick(&vm), Some(crate::gate::QUICK_TICK_MS));
        vm.host().advance_ms(99);
        run_line(&mut gate, &vm, &mut host);
        assert!(host.resumed.is_empty(), "{:?}", host.resumed);
        vm.host().advance_ms(1);
        run_line(&mut gate, &vm, &mut host);
        assert_eq!(destination(&host.resumed[0].1), Some(y1));
        assert_eq!(gate.stats.take_count(stats::ADMISSION_UNCACHED), 1);
    }

    #[test]
    fn a_backfill_waits_for_its_prefix_rather_than_copy_it_where_a_head_has_no_room() {
        let (vm, mut gate) = two_pods(r#""budgetTokens":700"#);
        let mut host = Host::default();
        let send = |gate: &mut Gate, host: &mut Host, context, system, words, max| {
            send_prompt((gate, &vm, host), context, system, words, max)
        };
        // X (about 540 tokens) on one pod, a small request on the other.
        let x1 = send(&mut gate, &mut host, 1, "X", 60, 16).expect("routed");
        let small = send(&mut gate, &mut host, 2, "", 5, 16).expect("routed");
        assert_ne!(x1, small);
        // A head larger than any budget: it waits for an empty pod.
        assert_eq!(send(&mut gate, &mut host, 3, "", 60, 600), None);
        // Behind it, x's next would fit beside the small one, as a copy of x's prefix.
        assert_eq!(send(&mut gate, &mut host, 4, "X", 60, 16), None);
        run_line(&mut gate, &vm, &mut host);
        assert!(host.resumed.is_empty(), "{:?}", host.resumed);
        // One that no pod caches does backfill there.
        assert_eq!(
            send(&mut gate, &mut host, 5, "", 5, 16),
            None,
            "behind the head"
        );
        run_line(&mut gate, &vm, &mut host);
        let resumed: Vec<(u32, Option<String>)> = host
            .resumed
            .iter()
            .map(|(c, d)| (*c, destination(d)))
            .collect();
        assert_eq!(resumed, [(5, Some(small))]);
        assert_eq!(host.parked.len(), 2);
    }

    #[test]
    fn a_parked_stream_that_is_gone_is_released_and_the_next_one_admitted() {
        let (_h, vm, mut gate) = gate();
        let mut host = Host::default();
        for context in 1..=3 {
            send(&mut gate, &vm, &mut host, context);
        }
        host.gone.insert(2);
        host.flows.get_mut(&1).unwrap().on_done(&mut gate, &vm);
        run_line(&mut gate, &vm, &mut host);
        // The gone stream left the line without being resumed; the next one took the budget.
        assert_eq!(
            host.resumed.iter().map(|(c, _)| *c).collect::<Vec<_>>(),
            [3]
        );
        assert!(host.parked.is_empty());
        assert!(crate::admission::line::read(&vm)
            .unwrap()
            .tickets
            .is_empty());
        assert!(reserved(&vm) > 0);
        // Its on_done, delivered later, changes nothing.
        host.flows.get_mut(&2).unwrap().on_done(&mut gate, &vm);
        host.flows.get_mut(&3).unwrap().on_done(&mut gate, &vm);
        assert_eq!(reserved(&vm), 0);
    }

    /// The access log's line of a request that waited: a client that left while it waited is
    /// logged as `client_left` with how long it had waited; one answered 503 past its wait with
    /// the reason and its wait.
    #[test]
    fn a_request_that_left_the_line_or_timed_out_in_it_is_logged_with_its_wait() {
        let (h, vm, mut gate) = gate();
        let mut host = Host::default();
        for context in 1..=3 {
            send(&mut gate, &vm, &mut host, context);
        }
        h.advance_ms(300);
        let flow = host.flows.get_mut(&2).unwrap();
        let line = flow.take_access_log(|| vm.now_ms()).unwrap();
        assert!(
            line.starts_with("reason=client_left model=m prompt_tokens="),
            "{line}"
        );
        assert!(line.ends_with(" queue_ms=300"), "{line}");
        host.flows.get_mut(&2).unwrap().on_done(&mut gate, &vm);
        h.advance_ms(5_000);
        run_line(&mut gate, &vm, &mut host);
        let [(3, d)] = host.resumed.as_slice() else {
            panic!("{:?}", host.resumed);
        };
        let flow = host.flows.get_mut(&3).unwrap();
        flow.shaped(d.clone());
        let line = flow.take_access_log(|| vm.now_ms()).unwrap();
        assert!(
            line.starts_with("reason=service_unavailable model=m "),
            "{line}"
        );
        assert!(line.ends_with(" queue_ms=5300"), "{line}");
    }

    #[test]
    fn a_request_past_its_wait_is_answered_even_while_nothing_frees() {
        let (h, vm, mut gate) = gate();
        let mut host = Host::default();
        send(&mut gate, &vm, &mut host, 1);
        send(&mut gate, &vm, &mut host, 2);
        h.advance_ms(5_001);
        run_line(&mut gate, &vm, &mut host);
        let [(2, d)] = host.resumed.as_slice() else {
            panic!("{:?}", host.resumed);
        };
        assert!(
            matches!(&d.step, Step::Reply(r) if r.status == 503),
            "{d:?}"
        );
        assert!(host.parked.is_empty());
    }

    /// Shared data fails while the head of the line is retried: it goes on undecided, and its
    /// ticket leaves the line with it, so the request behind it is admitted in the same pass.
    #[test]
    fn a_head_whose_retry_fails_on_shared_data_goes_on_and_the_next_is_admitted() {
        let (_h, vm, mut gate) = gate();
        let mut host = Host::default();
        send(&mut gate, &vm, &mut host, 1);
        send(&mut gate, &vm, &mut host, 2);
        send(&mut gate, &vm, &mut host, 3);
        host.flows.get_mut(&1).unwrap().on_done(&mut gate, &vm);
        // The head's write of the pod's record fails; the next one's goes through.
        let failing = crate::test_support::Watched::failing_once(&vm, "kvgate.pod.");
        run_line(&mut gate, &failing, &mut host);
        let [(2, undecided), (3, admitted)] = host.resumed.as_slice() else {
            panic!("{:?}", host.resumed);
        };
        assert_eq!(undecided.step, Step::Forward);
        assert_eq!(destination(undecided), None);
        assert_eq!(destination(admitted).as_deref(), Some(POD));
        assert!(crate::admission::line::read(&vm)
            .unwrap()
            .tickets
            .is_empty());
    }

    /// Other workers win every race of the head's pick (each of its compare-and-swaps of the
    /// pod's record): nothing is charged, it keeps its place rather than go on past the budget,
    /// the VM asks for the quick tick (no release may come to wake the line), and the next pass
    /// admits it.
    #[test]
    fn a_head_whose_pick_loses_every_race_keeps_its_place_and_the_next_pass_admits_it() {
        let (_h, vm, mut gate) = gate();
        let mut host = Host::default();
        send(&mut gate, &vm, &mut host, 1);
        send(&mut gate, &vm, &mut host, 2);
        host.flows.get_mut(&1).unwrap().on_done(&mut gate, &vm);
        gate.retick(&vm);
        let losing = crate::test_support::Watched::losing_races(&vm, "kvgate.pod.");
        run_line(&mut gate, &losing, &mut host);
        assert!(host.resumed.is_empty(), "{:?}", host.resumed);
        assert_eq!(host.parked.len(), 1);
        assert_eq!(reserved(&vm), 0);
        assert_eq!(gate.stats.take_count(stats::ADMISSION_CONTENDED), 1);
        assert_eq!(gate.stats.take_count(stats::ROUTE_ERRORS), 0);
        assert_eq!(gate.retick(&vm), Some(crate::gate::QUICK_TICK_MS));
        run_line(&mut gate, &vm, &mut host);
        let [(2, d)] = host.resumed.as_slice() else {
            panic!("{:?}", host.resumed);
        };
        assert_eq!(destination(d).as_deref(), Some(POD));
        assert!(reserved(&vm) > 0);
        assert_eq!(gate.retick(&vm), Some(crate::gate::TICK_MS));
    }

    /// A request arriving while other workers win every race of its pick waits in the line
    /// instead of going on undecided, and the next pass admits it.
    #[test]
    fn an_arrival_whose_pick_loses_every_race_waits_and_the_next_pass_admits_it() {
        let (_h, vm, mut gate) = gate();
        let mut host = Host::default();
        let losing = crate::test_support::Watched::losing_races(&vm, "kvgate.pod.");
        let d = send(&mut gate, &losing, &mut host, 1);
        assert!(matches!(d.step, Step::Park(_)), "{d:?}");
        assert_eq!(gate.stats.take_count(stats::ADMISSION_CONTENDED), 1);
        assert_eq!(gate.retick(&vm), Some(crate::gate::QUICK_TICK_MS));
        run_line(&mut gate, &vm, &mut host);
        let [(1, d)] = host.resumed.as_slice() else {
            panic!("{:?}", host.resumed);
        };
        assert_eq!(destination(d).as_deref(), Some(POD));
    }

    /// A parked request whose stream this VM no longer holds (every path that lets a stream go
    /// takes its ticket out of the line; this is the backstop) is taken out of the line when met
    /// at its head, and the line moves on.
    #[test]
    fn a_head_with_no_stream_to_resume_leaves_the_line_and_the_next_is_admitted() {
        let (_h, vm, mut gate) = gate();
        let mut host = Host::default();
        send(&mut gate, &vm, &mut host, 1);
        send(&mut gate, &vm, &mut host, 2);
        send(&mut gate, &vm, &mut host, 3);
        assert_eq!(host.parked.len(), 2);
        let (&lost, _) = host.parked.iter().find(|(_, &c)| c == 2).unwrap();
        host.parked.remove(&lost);
        host.flows.get_mut(&1).unwrap().on_done(&mut gate, &vm);
        run_line(&mut gate, &vm, &mut host);
        assert!(
            crate::admission::line::read(&vm)
                .unwrap()
                .tickets
                .is_empty(),
            "both out of the line"
        );
        let [(3, d)] = host.resumed.as_slice() else {
            panic!("{:?}", host.resumed);
        };
        assert_eq!(destination(d).as_deref(), Some(POD));
        assert_eq!(gate.stats.take_count(stats::ADMISSION_LOST), 1);
        assert_eq!(gate.stats.take_count(stats::ADMISSION_ABANDONED), 0);
    }

    #[test]
    fn a_ticket_this_vm_does_not_hold_is_not_retried() {
        let (_h, vm, mut gate) = gate();
        let mut host = Host::default();
        assert!(retry(&mut gate, &vm, &mut host, 42, (Reach::Any, ANYWHERE)).is_err());
        assert!(host.resumed.is_empty());
    }
}
