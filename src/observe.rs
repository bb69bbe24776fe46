//! The safe rollout: `routing.mode` and `admission.mode` `observe` (the first phase of kthena PR
//! 928's three-phase rollout, observe → soft → strict). kvgate then makes and accounts every
//! decision as it would, but acts on none of them — Envoy's own load balancer picks the host,
//! and nothing waits or is refused for capacity — and reports what it would have done: stats
//! (`kvgate.observe.*`), the `x-kvgate-observed` debug header, and a debug log line per decision.
//! An operator switches it on in production first, compares, then enforces.
//!
//! Admission's part is `admission::admit` (`Admission::place`: a request no pod has room for is
//! placed past the budget, `Router::route_past_budget`, instead of waiting); routing's part is
//! here: the flow sets no override host, and when the response says which host Envoy used, the
//! request's accounting moves there (`Router::rehome`), so budgets, active blocks and the prefix
//! index describe where requests really run.

use crate::admission::admit::Class;
use crate::config::{Config, Mode};
use crate::gate::Gate;
use crate::routing::router::{Moved, Routed};
use crate::stats;
use crate::store::interface::Store;

/// Whether the pick is sent to Envoy as the override host.
pub fn enforces_routing(cfg: &Config) -> bool {
    cfg.routing.mode == Mode::Enforce
}

/// The value of the `x-kvgate-observed` debug header: what enforcement would have done that
/// did not happen (`would-wait`, `would-shed`, `pick=<pod>` when Envoy chose another host).
/// `None` when nothing was only observed.
pub fn header(cfg: &Config, routed: &Routed, class: Class, picked: &str) -> Option<String> {
    let mut parts = Vec::new();
    if routed.over_budget {
        parts.push(admission_outcome(class).0.to_string());
    }
    if !enforces_routing(cfg) && picked != routed.pod {
        parts.push(format!("pick={picked}"));
    }
    (!parts.is_empty()).then(|| parts.join(", "))
}

/// What admission would have done with a request placed past the budget: the header's word
/// and the stat that counts it.
fn admission_outcome(class: Class) -> (&'static str, stats::Fixed) {
    if class.priority < 0 {
        ("would-shed", stats::OBSERVE_WOULD_SHED)
    } else {
        ("would-wait", stats::OBSERVE_WOULD_WAIT)
    }
}

/// Counts and logs a request admission placed past every budget because it only observes.
pub fn placed_past_budget(gate: &mut Gate, routed: &Routed, class: Class) {
    let (outcome, stat) = admission_outcome(class);
    gate.stats.count(stat, 1);
    log::debug!(
        "kvgate observe: request {} {outcome} (no pod has room); sent to {}",
        routed.request,
        routed.pod
    );
}

/// The response started on `served_by`. Under enforcement a different host means Envoy could
/// not use the pick (its retry went elsewhere); while routing observes it is Envoy's own choice,
/// counted against kvgate's pick. Either way the request's accounting moves to the host that
/// serves it.
pub fn served(gate: &mut Gate, store: &dyn Store, routed: &mut Routed, served_by: &str) {
    let why = if enforces_routing(&gate.config) {
        if served_by == routed.pod {
            return;
        }
        gate.stats.count(stats::ROUTE_REROUTED, 1);
        // The pick may have left Envoy's cluster: every pick of it goes elsewhere, past that
        // pod's budget, until discovery drops it, so it is asked now, not an interval later.
        if !gate.config.discovery.admin_cluster.is_empty() {
            if let Err(e) = crate::pods::pool::ask_discovery(store, store.now_ms()) {
                log::debug!("asking for discovery failed: {e:?}");
            }
        }
        Moved::PickFailed
    } else {
        let same = served_by == routed.pod;
        gate.stats.count(
            if same {
                stats::OBSERVE_ROUTING_SAME
            } else {
                stats::OBSERVE_ROUTING_OTHER
            },
            1,
        );
        log::debug!(
            "kvgate observe: request {} picked {}, Envoy chose {served_by}",
            routed.request,
            routed.pod
        );
        if same {
            return;
        }
        Moved::EnvoyChose
    };
    if let Err(e) = gate
        .router
        .rehome(store, &gate.config, routed, served_by, why)
    {
        log::debug!("rehome failed: {e:?}");
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::flow::{Flow, RequestHead, Step, DESTINATION_HEADER};
    use crate::pods::record;
    use crate::store::fake_host::{FakeHost, FakeVm};

    const A: &str = "10.0.0.1:80";
    const B: &str = "10.0.0.2:80";

    fn observing(budget: u64) -> (FakeHost, FakeVm, Gate) {
        let mut cfg = crate::test_support::with_pods(&[A, B]);
        cfg.debug_headers = true;
        cfg.routing.mode = Mode::Observe;
        cfg.admission.mode = Mode::Observe;
        cfg.admission.budget_tokens = budget;
        let host = FakeHost::new();
        let vm = host.vm();
        let gate = Gate::new(cfg, &vm).unwrap();
        (host, vm, gate)
    }

    /// Sends a chat request of `words` words through a new flow.
    fn send(gate: &mut Gate, vm: &FakeVm, words: usize) -> (Flow, crate::flow::Decision) {
        let mut f = Flow::default();
        let head = RequestHead::json_post("/v1/chat/completions");
        f.on_request_headers(gate, vm, &head);
        let text = "word ".repeat(words);
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"{text}"}}],"max_tokens":16}}"#
        );
        let d = f.on_body(gate, vm, body.as_bytes());
        (f, d)
    }

    fn entries(vm: &FakeVm, pod: &str) -> usize {
        record::read(vm, pod).unwrap().entries.len()
    }

    fn header<'a>(headers: &'a [(&str, String)], name: &str) -> Option<&'a str> {
        headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn observing_sets_no_host_and_moves_the_accounting_where_envoy_sent_it() {
        let (_host, vm, mut gate) = observing(0);
        let (mut f, d) = send(&mut gate, &vm, 40);
        assert_eq!(d.step, Step::Forward);
        assert!(
            d.set.iter().all(|(k, _)| k != DESTINATION_HEADER),
            "Envoy's balancer chooses: {:?}",
            d.set
        );
        let picked = if entries(&vm, A) == 1 { A } else { B };
        let other = if picked == A { B } else { A };
        let headers = f.on_response_headers(&mut gate, &vm, None, Some(other));
        assert_eq!(entries(&vm, picked), 0, "moved off the pick");
        assert_eq!(entries(&vm, other), 1, "accounted where it runs");
        assert_eq!(header(&headers, "x-kvgate-pod"), Some(other));
        let expected = format!("pick={picked}");
        assert_eq!(
            header(&headers, "x-kvgate-observed"),
            Some(expected.as_str())
        );
        let rec = record::read(&vm, picked).unwrap();
        assert!(
            rec.snapshot.is_none_or(|s| s.healthy),
            "Envoy's choice says nothing against the pick"
        );
        assert_eq!(gate.stats.take_count(stats::OBSERVE_ROUTING_OTHER), 1);
        f.on_done(&mut gate, &vm);
        assert_eq!(entries(&vm, A) + entries(&vm, B), 0, "released once");

        // Envoy chose the pick: counted as the same, nothing moves, no header.
        let (mut f, _) = send(&mut gate, &vm, 40);
        let picked = if entries(&vm, A) == 1 { A } else { B };
        let headers = f.on_response_headers(&mut gate, &vm, None, Some(picked));
        assert_eq!(entries(&vm, picked), 1);
        assert_eq!(header(&headers, "x-kvgate-observed"), None);
        assert_eq!(gate.stats.take_count(stats::OBSERVE_ROUTING_SAME), 1);
        f.on_done(&mut gate, &vm);
    }

    #[test]
    fn a_pick_envoy_could_not_use_is_marked_down_and_discovery_asked_for() {
        let (host, vm, mut gate) = observing(0);
        gate.config.routing.mode = Mode::Enforce;
        gate.config.admission.mode = Mode::Enforce;
        gate.config.discovery.admin_cluster = "kvgate_admin".into();
        host.set_now_ms(70);
        let (mut f, d) = send(&mut gate, &vm, 40);
        let picked = d
            .set
            .iter()
            .find(|(k, _)| k == DESTINATION_HEADER)
            .and_then(|(_, h)| h.split(',').next())
            .unwrap()
            .to_string();
        let other = if picked == A { B } else { A };
        assert_eq!(crate::pods::pool::discovery_asked(&vm), None);
        f.on_response_headers(&mut gate, &vm, None, Some(other));
        assert_eq!(gate.stats.take_count(stats::ROUTE_REROUTED), 1);
        assert!(record::read(&vm, &picked).unwrap().is_down());
        assert_eq!(
            crate::pods::pool::discovery_asked(&vm),
            Some(70),
            "the pick may have left Envoy's cluster"
        );
        assert_eq!((entries(&vm, &picked), entries(&vm, other)), (0, 1));
        f.on_done(&mut gate, &vm);
        assert_eq!(entries(&vm, A) + entries(&vm, B), 0, "released once");
    }

    #[test]
    fn a_request_no_pod_has_room_for_is_sent_and_reported() {
        // A budget below any request: each pod takes one alone (rather than none ever), and the
        // third request finds no room.
        let (_host, vm, mut gate) = observing(1);
        let mut flows = Vec::new();
        for _ in 0..3 {
            let (f, d) = send(&mut gate, &vm, 40);
            assert_eq!(d.step, Step::Forward, "nothing waits");
            flows.push(f);
        }
        assert_eq!(entries(&vm, A) + entries(&vm, B), 3);
        assert_eq!(gate.stats.take_count(stats::OBSERVE_WOULD_WAIT), 1);
        let last = flows.last_mut().unwrap();
        let pod = if entries(&vm, A) == 2 { A } else { B };
        let headers = last.on_response_headers(&mut gate, &vm, None, Some(pod));
        assert_eq!(header(&headers, "x-kvgate-observed"), Some("would-wait"));
        for f in &mut flows {
            f.on_done(&mut gate, &vm);
        }
        assert_eq!(entries(&vm, A) + entries(&vm, B), 0);
    }

    #[test]
    fn routing_cannot_observe_behind_an_original_dst_cluster() {
        let json = br#"{"routing": {"mode": "observe", "setOriginalDstHeader": true}}"#;
        let e = Config::parse(json).unwrap_err().to_string();
        assert!(e.contains("routing.mode"), "{e}");
        let both = br#"{"routing": {"mode": "observe"}, "admission": {"mode": "observe"}}"#;
        let cfg = Config::parse(both).unwrap();
        assert_eq!(
            (cfg.routing.mode, cfg.admission.mode),
            (Mode::Observe, Mode::Observe)
        );
        assert!(Config::parse(br#"{"admission": {"mode": "watch"}}"#).is_err());
    }
}
