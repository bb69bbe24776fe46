//! Which models each pod serves and which LoRA adapters it is running: the pod's `/v1/models` list
//! (base models, and adapters with their `parent`, as vLLM lists them) and its
//! `vllm:lora_requests_info` (adapter slots, running and waiting adapters), kept in one shared
//! record per pod, `kvgate.models.<ip:port>`, written by the lease holder's scraper alone.
//!
//! Each VM reads the records into a `ServedView`, cached for `VIEW_CACHE_MS`: model lists change
//! at human speed and the adapter state is scraped once a second, so reading them per request
//! would only add host calls. A pod never listed serves everything (as before model scraping); a
//! list that fails to fetch or parse leaves the last one in place.
//!
//! A pod's first list is awaited, not guessed at: from the moment a VM first sees a pod until its
//! list is answered (or fails, or `scrape::first_list_ms` passes), a request for a model no list
//! names waits (`ServedView::awaits_list`), and the view is read again at the quick pace, not
//! `VIEW_CACHE_MS` later. Taken to serve everything in that window, a gateway started under load
//! with two models' pods sent one model's requests to the other's engines, which answered 404
//! (an e2e run of 2026-12-02: 180 of 192 requests in the half second a view read before the lists
//! landed was kept).

use crate::hash::fnv1a;
use crate::store::codec::{Reader, Writer};
use crate::store::interface::{update_record, Store, StoreError};
use hashbrown::HashMap;
use serde::Deserialize;

const VERSION: u8 = 1;
const VIEW_CACHE_MS: u64 = 500;
/// How long a view is kept while a pod's first list is still unanswered: waiting requests go once
/// it lands, within the quick tick that retries them (`gate::QUICK_TICK_MS`).
const AWAITING_CACHE_MS: u64 = crate::gate::QUICK_TICK_MS;
/// Entries of one pod's model list kept at most: a pod serving more is misconfigured or hostile,
/// and the record must stay small enough to read on every refresh.
pub const MAX_MODELS: usize = 1024;
/// Adapters named in one scraped running or waiting list kept at most.
const MAX_LISTED_ADAPTERS: usize = 256;
const MAX_NAME_CHARS: usize = 256;

pub fn key(pod: &str) -> String {
    format!("kvgate.models.{pod}")
}

/// One entry of a pod's model list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedModel {
    pub id: String,
    /// The base model of a LoRA adapter; `None` for a base model.
    pub parent: Option<String>,
}

/// What `vllm:lora_requests_info` said at the last scrape.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LoraState {
    pub at_ms: u64,
    /// Adapter slots of the engine (`max_lora`): most distinct adapters in one batch.
    pub max_lora: u32,
    /// Adapter ids (`adapter_id`) running, and waiting for a slot.
    pub running: Vec<u64>,
    pub waiting: Vec<u64>,
}

/// A pod's record.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Served {
    /// When the list was last fetched; `None` before the first success.
    pub listed_ms: Option<u64>,
    /// When fetching the list last failed; `None` if it never did. A pod never listed whose list
    /// failed is not waited for (`ServedView::awaits_list`).
    pub failed_ms: Option<u64>,
    pub models: Vec<ServedModel>,
    pub lora: Option<LoraState>,
}

/// A model name as an adapter identity: what the pick log and the affinity replica carry (0
/// stands for no adapter).
pub fn adapter_id(name: &str) -> u64 {
    fnv1a(name.as_bytes()) | 1
}

impl Served {
    /// Whether its list has neither arrived nor failed yet: it may still come.
    fn unanswered(&self) -> bool {
        self.listed_ms.is_none() && self.failed_ms.is_none()
    }

    pub fn serves(&self, model: &str) -> bool {
        self.models.iter().any(|m| m.id == model)
    }

    /// Whether `model` is one of the pod's LoRA adapters.
    pub fn is_adapter(&self, model: &str) -> bool {
        self.base_of(model).is_some()
    }

    /// The base model of `model` when it is one of the pod's LoRA adapters.
    pub fn base_of(&self, model: &str) -> Option<&str> {
        self.models
            .iter()
            .filter(|m| m.id == model)
            .find_map(|m| m.parent.as_deref().filter(|p| *p != model))
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.u8(VERSION).u64(self.listed_ms.map_or(0, |t| t.max(1)));
        w.u32(self.models.len() as u32);
        for m in &self.models {
            w.bytes(m.id.as_bytes());
            match &m.parent {
                Some(p) => w.u8(1).bytes(p.as_bytes()),
                None => w.u8(0),
            };
        }
        match &self.lora {
            Some(l) => {
                w.u8(1).u64(l.at_ms).u32(l.max_lora);
                for list in [&l.running, &l.waiting] {
                    w.u32(list.len() as u32);
                    list.iter().for_each(|id| {
                        w.u64(*id);
                    });
                }
            }
            None => {
                w.u8(0);
            }
        }
        w.u64(self.failed_ms.map_or(0, |t| t.max(1)));
        w.0
    }

    /// A corrupt or foreign record reads as a pod never listed; one written before `failed_ms`
    /// was kept (a module loaded over an older one, in the same shared data) as never failed.
    pub fn decode(bytes: &[u8]) -> Option<Served> {
        let mut r = Reader(bytes);
        if r.u8()? != VERSION {
            return None;
        }
        let listed = r.u64()?;
        let text = |r: &mut Reader| String::from_utf8(r.bytes()?.to_vec()).ok();
        let models = r.list(5, |r| {
            let id = text(r)?;
            let parent = match r.u8()? {
                0 => None,
                _ => Some(text(r)?),
            };
            Some(ServedModel { id, parent })
        })?;
        let lora = match r.u8()? {
            0 => None,
            _ => {
                let (at_ms, max_lora) = (r.u64()?, r.u32()?);
                let (running, waiting) = (r.list(8, Reader::u64)?, r.list(8, Reader::u64)?);
                Some(LoraState {
                    at_ms,
                    max_lora,
                    running,
                    waiting,
                })
            }
        };
        let failed = r.u64().unwrap_or(0);
        Some(Served {
            listed_ms: (listed > 0).then_some(listed),
            failed_ms: (failed > 0).then_some(failed),
            models,
            lora,
        })
    }
}

pub fn read(store: &dyn Store, pod: &str) -> Result<Served, StoreError> {
    Ok(store
        .get(&key(pod))?
        .value
        .and_then(|b| Served::decode(&b))
        .unwrap_or_default())
}

fn modify(
    store: &dyn Store,
    pod: &str,
    mut change: impl FnMut(&mut Served),
) -> Result<(), StoreError> {
    update_record(
        store,
        &key(pod),
        Served::decode,
        Served::encode,
        &mut change,
    )
}

/// Records a freshly fetched model list; returns whether it is the pod's first (requests may be
/// waiting for it).
pub fn write_list(
    store: &dyn Store,
    pod: &str,
    models: &[ServedModel],
    now: u64,
) -> Result<bool, StoreError> {
    let mut first = false;
    modify(store, pod, |s| {
        first = s.listed_ms.is_none();
        s.listed_ms = Some(now);
        s.models = models.to_vec();
    })?;
    Ok(first)
}

/// Records that fetching the pod's list failed (an error status, no answer, a body that is no
/// list): a pod never listed is then taken to serve everything instead of being waited for.
pub fn write_failure(store: &dyn Store, pod: &str, now: u64) -> Result<(), StoreError> {
    modify(store, pod, |s| s.failed_ms = Some(now))
}

/// Records the adapter state of a metrics scrape.
pub fn write_lora(store: &dyn Store, pod: &str, lora: LoraState) -> Result<(), StoreError> {
    modify(store, pod, |s| s.lora = Some(lora.clone()))
}

/// Why a model list was not taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListError(pub String);

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ListedModel>,
}

#[derive(Deserialize)]
struct ListedModel {
    id: String,
    #[serde(default)]
    parent: Option<String>,
}

/// A name kvgate keeps: what request parsing accepts, without control characters (it may become
/// a header value or a stat name). Anything else a pod lists is left out, not guessed at.
fn keepable(name: &str) -> bool {
    !name.is_empty()
        && name.chars().count() <= MAX_NAME_CHARS
        && !name.chars().any(char::is_control)
}

/// Reads an OpenAI `/v1/models` body (`{"object":"list","data":[{"id", "parent"}, ...]}`).
/// Entries with names kvgate cannot carry are skipped; a body that is not such a list, or lists
/// nothing usable, is an error, so the pod keeps its last known models.
pub fn parse_list(body: &[u8]) -> Result<Vec<ServedModel>, ListError> {
    let list: ModelList = serde_json::from_slice(body)
        .map_err(|e| ListError(format!("model list is not an OpenAI list: {e}")))?;
    if list.data.len() > MAX_MODELS {
        return Err(ListError(format!(
            "model list has {} entries, more than {MAX_MODELS}",
            list.data.len()
        )));
    }
    let models: Vec<ServedModel> = list
        .data
        .into_iter()
        .filter(|m| keepable(&m.id))
        .map(|m| ServedModel {
            parent: m.parent.filter(|p| keepable(p)),
            id: m.id,
        })
        .collect();
    if models.is_empty() {
        return Err(ListError("model list names no usable model".into()));
    }
    Ok(models)
}

/// Adapter names in a `running_lora_adapters` / `waiting_lora_adapters` label value (vLLM joins
/// them with commas), as adapter ids.
pub fn adapter_ids(label: &str) -> Vec<u64> {
    label
        .split(',')
        .filter(|n| !n.is_empty())
        .take(MAX_LISTED_ADAPTERS)
        .map(adapter_id)
        .collect()
}

/// A VM's cached copy of every pod's record, for one pool: each answer is about its pods, in
/// its order.
#[derive(Default)]
pub struct ServedView {
    /// The pool's pods, as the router orders them (`pool_changed`).
    pool: Vec<String>,
    pods: HashMap<String, Served>,
    /// When this view first had each pod: its first list is awaited for `wait_ms` from then.
    since: HashMap<String, u64>,
    /// How long a pod's first list is awaited (`scrape::first_list_ms`; 0 while lists are not
    /// fetched).
    wait_ms: u64,
    /// Whether, at the last read, a pod's list had neither arrived nor failed (`wait_ms` > 0):
    /// once every list is answered, nothing is awaited and no pod need be asked.
    any_unanswered: bool,
    read_ms: Option<u64>,
    /// Each model's standing on every pod of the pool, until the records are read again or the
    /// pool changes. Each pick asks it of every pod several times (may the model run there, is
    /// it an adapter there): by pod name and a scan of each list, about a tenth of a request's
    /// instructions at 64 pods, while the lists change at human speed. Kept per model, so that a
    /// pool serving many models (a LoRA adapter each) works each one out once, not at every
    /// change of model. (Held for one pool rather than checked against the list each pick
    /// passed: comparing 64 names five times a pick was 6 % of its time in V8.)
    memo: HashMap<String, Standing>,
}

/// The most models the memo keeps between reads: names come from clients, so a stream of
/// unknown ones must not grow it.
const MEMO_MODELS: usize = 256;

/// One model on each pod of the pool: the pod's list names it; the list has been read;
/// it is one of the pod's adapters. And the base model the first list naming it as an adapter
/// gives as its `parent`.
struct Standing {
    lists: Vec<bool>,
    listed: Vec<bool>,
    adapter: Vec<bool>,
    base: Option<String>,
}

impl ServedView {
    /// A view of the pool `pods`, nothing read yet.
    pub fn of(pods: &[String]) -> ServedView {
        let mut view = ServedView::default();
        view.pool_changed(pods);
        view
    }

    /// Sets how long a pod's first list is awaited (`scrape::first_list_ms`).
    pub fn set_wait(&mut self, wait_ms: u64) {
        self.wait_ms = wait_ms;
    }

    /// The pool is now `pods`: the next `refresh` reads every record. A pod the copy has not had
    /// is neither listed nor awaited, so until the next read it was taken to serve every model
    /// (a copy read before discovery answered sent requests to the other model's pods).
    pub fn pool_changed(&mut self, pods: &[String]) {
        self.pool = pods.to_vec();
        self.memo.clear();
        self.read_ms = None;
    }

    /// Re-reads the pool's records when the copy is older than `VIEW_CACHE_MS`, or than
    /// `AWAITING_CACHE_MS` while a pod's first list may still come. A record that cannot be
    /// read keeps its cached copy.
    pub fn refresh(&mut self, store: &dyn Store, now: u64) {
        let keep = if self.any_unanswered {
            AWAITING_CACHE_MS
        } else {
            VIEW_CACHE_MS
        };
        if self.read_ms.is_some_and(|t| now.saturating_sub(t) < keep) {
            return;
        }
        self.read_ms = Some(now);
        self.memo.clear();
        let pods = &self.pool;
        self.pods.retain(|p, _| pods.contains(p));
        self.since.retain(|p, _| pods.contains(p));
        for pod in pods {
            self.since.entry_ref(pod.as_str()).or_insert(now);
            if let Ok(s) = read(store, pod) {
                self.pods.insert(pod.clone(), s);
            }
        }
        self.any_unanswered = self.wait_ms > 0 && pods.iter().any(|p| self.unanswered(p));
    }

    /// Whether `pod`'s list has neither arrived nor failed, as last read (a record never read
    /// counts as such).
    fn unanswered(&self, pod: &str) -> bool {
        self.pods.get(pod).is_none_or(Served::unanswered)
    }

    /// Whether a pod's first list is awaited: unanswered, and within `wait_ms` of this view
    /// first having the pod (never, with `wait_ms` 0).
    fn awaited(&self, pod: &str, now: u64) -> bool {
        self.unanswered(pod)
            && self
                .since
                .get(pod)
                .is_some_and(|&t| now < t.saturating_add(self.wait_ms))
    }

    /// Whether any of the pool's first lists is awaited (the gate ticks at the quick pace, so
    /// that requests waiting for it go as it lands).
    pub fn awaits_any(&self, now: u64) -> bool {
        self.any_unanswered && self.pool.iter().any(|p| self.awaited(p, now))
    }

    /// Whether a request for `model` must wait for a list: none names it, and one that might
    /// (an `up` pod's first list) is awaited. Sent now, it would go to any pod without a list,
    /// perhaps one serving another model. A request naming no model (`model` empty) does not
    /// wait: any engine serves it its own model, and once lists name several it is refused.
    pub fn awaits_list(&mut self, model: &str, now: u64, up: impl Fn(usize) -> bool) -> bool {
        self.any_unanswered
            && !model.is_empty()
            && !self.lists(model)
            && self
                .pool
                .iter()
                .enumerate()
                .any(|(i, p)| self.awaited(p, now) && up(i))
    }

    pub fn get(&self, pod: &str) -> Option<&Served> {
        self.pods.get(pod)
    }

    /// `model` on each of the pool's pods, worked out once per model between reads.
    fn memo(&mut self, model: &str) -> &Standing {
        let memo = &mut self.memo;
        if memo.len() >= MEMO_MODELS && !memo.contains_key(model) {
            memo.clear();
        }
        let (view, pods) = (&self.pods, &self.pool);
        memo.entry_ref(model).or_insert_with(|| {
            let each = |f: &dyn Fn(&Served) -> bool| -> Vec<bool> {
                pods.iter().map(|p| view.get(p).is_some_and(f)).collect()
            };
            Standing {
                lists: each(&|s| s.serves(model)),
                listed: each(&|s| s.listed_ms.is_some()),
                adapter: each(&|s| s.is_adapter(model)),
                base: pods
                    .iter()
                    .find_map(|p| view.get(p).and_then(|s| s.base_of(model)))
                    .map(str::to_string),
            }
        })
    }

    /// Which of the pool's pods may serve `model`: those listing it; if none does, those not listed yet
    /// (a pod is taken to serve everything until its list is known) that are `up` (a pod that
    /// refuses connections never answers its list: it must not become the one pod every unknown
    /// model is sent to); else none.
    pub fn serving(&mut self, model: &str, up: impl Fn(usize) -> bool) -> Vec<bool> {
        let m = self.memo(model);
        if m.lists.contains(&true) {
            return m.lists.clone();
        }
        m.listed
            .iter()
            .enumerate()
            .map(|(i, &listed)| !listed && up(i))
            .collect()
    }

    /// Whether `serving` names any pod, asking `up` only until one is found: `up` reads a pod's
    /// record, which every request would otherwise pay for every pod while no list is known.
    pub fn serving_any(&mut self, model: &str, mut up: impl FnMut(usize) -> bool) -> bool {
        let m = self.memo(model);
        m.lists.contains(&true)
            || m.listed
                .iter()
                .enumerate()
                .any(|(i, &listed)| !listed && up(i))
    }

    /// The base models (not their adapters) the pool's lists, as last read, name, sorted.
    pub fn base_models(&self) -> Vec<&str> {
        let mut out: Vec<&str> = self
            .pool
            .iter()
            .filter_map(|p| self.pods.get(p))
            .flat_map(|s| s.models.iter())
            .filter(|m| m.parent.as_deref().is_none_or(|p| p == m.id))
            .map(|m| m.id.as_str())
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Whether two of the pool's lists, as last read, name different models (a pod not listed
    /// yet is taken to serve every model, and differs from none).
    pub fn differ(&self) -> bool {
        let mut lists = self
            .pool
            .iter()
            .filter_map(|p| self.pods.get(p))
            .filter(|s| s.listed_ms.is_some())
            .map(|s| {
                let mut ids: Vec<&str> = s.models.iter().map(|m| m.id.as_str()).collect();
                ids.sort_unstable();
                ids.dedup();
                ids
            });
        let Some(first) = lists.next() else {
            return false;
        };
        lists.any(|ids| ids != first)
    }

    /// Whether any of the pool's lists, as last read, names `model`.
    pub fn lists(&mut self, model: &str) -> bool {
        self.memo(model).lists.contains(&true)
    }

    /// The base model of `model` when some pod lists it as a LoRA adapter.
    pub fn base_of(&mut self, model: &str) -> Option<&str> {
        self.memo(model).base.as_deref()
    }

    /// Of each of the pool's pods, its record where `model` is one of its adapters.
    pub fn adapter_on(&mut self, model: &str) -> Vec<Option<&Served>> {
        let adapter = self.memo(model).adapter.clone();
        self.pool
            .iter()
            .zip(adapter)
            .map(|(p, is)| if is { self.pods.get(p) } else { None })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::store::fake_host::FakeHost;

    fn base(id: &str) -> ServedModel {
        ServedModel {
            id: id.into(),
            parent: None,
        }
    }

    #[test]
    fn a_vllm_model_list_with_adapters_is_read_and_round_trips() {
        let body = br#"{"object":"list","data":[
            {"id":"llama","object":"model","root":"/m","parent":null},
            {"id":"sql-lora","object":"model","root":"/l/sql","parent":"llama"},
            {"id":"","parent":null},{"id":"bad\u0000name"}]}"#;
        let models = parse_list(body).unwrap();
        assert_eq!(models.len(), 2, "unusable names are skipped");
        let s = Served {
            listed_ms: Some(5),
            failed_ms: Some(6),
            models,
            lora: Some(LoraState {
                at_ms: 7,
                max_lora: 2,
                running: adapter_ids("sql-lora,x"),
                waiting: vec![],
            }),
        };
        assert!(s.serves("sql-lora") && s.is_adapter("sql-lora") && !s.is_adapter("llama"));
        assert_eq!(s.base_of("sql-lora"), Some("llama"));
        assert_eq!(Served::decode(&s.encode()), Some(s.clone()));
        // A record an older module wrote, before the failure's time was kept: never failed.
        let older = s.encode();
        let older = Served::decode(&older[..older.len() - 8]);
        assert_eq!(older.map(|o| o.failed_ms), Some(None));
    }

    #[test]
    fn bad_lists_are_errors_not_empty_pods() {
        for body in [
            &b"not json"[..],
            b"{}",
            br#"{"data":[]}"#,
            br#"{"data":[{"id":""}]}"#,
        ] {
            assert!(
                parse_list(body).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        let many = format!(
            r#"{{"data":[{}]}}"#,
            vec![r#"{"id":"m"}"#; MAX_MODELS + 1].join(",")
        );
        assert!(parse_list(many.as_bytes()).is_err());
    }

    #[test]
    fn a_models_standing_is_kept_per_model_until_the_next_read_or_pool() {
        let host = FakeHost::new();
        let vm = host.vm();
        let pods: Vec<String> = ["a:1", "b:1", "c:1"].map(String::from).to_vec();
        write_list(&vm, "a:1", &[base("m")], 1).unwrap();
        let lora = ServedModel {
            id: "m-lora".into(),
            parent: Some("m".into()),
        };
        write_list(&vm, "b:1", &[base("m"), lora], 1).unwrap();
        write_list(&vm, "c:1", &[base("n")], 1).unwrap();
        let mut view = ServedView::of(&pods);
        view.refresh(&vm, 0);
        let up = |_| true;
        assert_eq!(view.serving("m", up), [true, true, false]);
        // Another model: its own answer, not the last one's.
        assert_eq!(view.serving("n", up), [false, false, true]);
        assert!(view.lists("m") && !view.lists("x"));
        let on: Vec<bool> = view
            .adapter_on("m-lora")
            .iter()
            .map(Option::is_some)
            .collect();
        assert_eq!(on, [false, true, false]);
        assert!(view.adapter_on("m").iter().all(Option::is_none));
        assert_eq!(view.base_of("m-lora"), Some("m"));
        assert_eq!(view.base_of("m"), None);
        // The base models the lists name (a request naming no model is for the pool's one).
        assert_eq!(view.base_models(), ["m", "n"]);
        // A list written since is seen at the next read, not before.
        write_list(&vm, "c:1", &[base("m")], 2).unwrap();
        view.refresh(&vm, 100);
        assert_eq!(view.serving("m", up), [true, true, false]);
        view.refresh(&vm, 1_000);
        assert_eq!(view.serving("m", up), [true, true, true]);
        // Another pool: each answer is about its pods, in its order, at once.
        let two = vec![pods[2].clone(), pods[0].clone()];
        view.pool_changed(&two);
        assert_eq!(view.serving("m", up), [true, true]);
        write_list(&vm, "c:1", &[base("n")], 3).unwrap();
        view.refresh(&vm, 1_001);
        assert_eq!(view.serving("n", up), [true, false]);
        view.pool_changed(&pods[..1]);
        assert_eq!(view.base_of("m-lora"), None, "a has no such adapter");
        view.pool_changed(&pods[..2]);
        assert_eq!(view.base_models(), ["m"], "adapters are not base models");
    }

    #[test]
    fn a_pod_new_to_the_view_is_read_at_once_and_its_first_list_awaited() {
        let host = FakeHost::new();
        let vm = host.vm();
        let mut view = ServedView::default();
        view.set_wait(1_500);
        // Read while the pool was not yet discovered; then both pods are known, one listed.
        view.refresh(&vm, 0);
        let pods: Vec<String> = ["a:1", "b:1"].map(String::from).to_vec();
        write_list(&vm, "b:1", &[base("n")], 1).unwrap();
        view.pool_changed(&pods);
        view.refresh(&vm, 5);
        let up = |_| true;
        assert_eq!(view.serving("n", up), [false, true], "read at once");
        assert!(view.awaits_list("m", 5, up), "a:1's list may name it");
        assert!(!view.awaits_list("n", 5, up), "b:1 lists it");
        assert!(!view.awaits_list("", 5, up), "no model: any engine's own");
        assert!(!view.awaits_list("m", 5, |i| i != 0), "a:1 is down");
        write_list(&vm, "a:1", &[base("m")], 10).unwrap();
        view.refresh(&vm, 10);
        assert!(
            view.awaits_list("m", 10, up),
            "the copy is kept a quick tick"
        );
        view.refresh(&vm, 25);
        assert!(!view.awaits_list("m", 25, up) && !view.awaits_any(25));
        assert_eq!(view.serving("m", up), [true, false]);
        // The wait is bounded from when the view first had the pod.
        let three: Vec<String> = ["a:1", "b:1", "c:1"].map(String::from).to_vec();
        view.pool_changed(&three);
        view.refresh(&vm, 100);
        assert!(view.awaits_list("x", 1_599, up));
        assert!(!view.awaits_list("x", 1_600, up));
        assert_eq!(view.serving("x", up), [false, false, true]);
    }

    #[test]
    fn listing_pods_are_eligible_then_unlisted_ones_then_none() {
        let host = FakeHost::new();
        let vm = host.vm();
        let pods: Vec<String> = ["a:1", "b:1", "c:1"].map(String::from).to_vec();
        let mut view = ServedView::of(&pods);
        let up = |_| true;
        view.refresh(&vm, 0);
        assert_eq!(view.serving("m", up), [true; 3], "nothing listed");
        assert_eq!(view.serving("m", |i| i != 1), [true, false, true], "b down");
        write_list(&vm, "a:1", &[base("m")], 1).unwrap();
        write_list(&vm, "b:1", &[base("n")], 1).unwrap();
        view.refresh(&vm, 100);
        assert_eq!(view.serving("m", up), [true, true, true], "cached");
        view.refresh(&vm, 1_000);
        assert_eq!(view.serving("m", up), [true, false, false]);
        assert_eq!(view.serving("x", up), [false, false, true], "c not listed");
        assert_eq!(view.serving("x", |i| i != 2), [false; 3], "c is down");
        write_list(&vm, "c:1", &[base("n")], 1).unwrap();
        view.refresh(&vm, 2_000);
        assert_eq!(view.serving("x", up), [false, false, false]);
        write_lora(&vm, "a:1", LoraState::default()).unwrap();
        assert!(
            read(&vm, "a:1").unwrap().serves("m"),
            "adapter state keeps the list"
        );
    }
}
