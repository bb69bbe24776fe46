//! What a request will cost in tokens, before a tokenizer or the engine has seen it: the static
//! character rule for prompts (`text`), the reservation charged to a pod from prompt and expected
//! output (`reservation`), the learned output-length distribution (`output_dist`), the
//! per-model corrections learned from responses' `usage` (`calibration`), the answers each VM
//! has started, running ones included (`cohort`), how each prompt template's answers run against
//! their model's (`templates`), the mean answer the model's engines report having finished
//! (`engine_lengths`), and where a model's shared records are (`slots`).
//!
//! Source of truth: a model's learned state is its shared-data slot `kvgate.cal.<n>` (its name
//! hash's, or one of the next few: `slots`) (`calibration`), which every worker updates by
//! compare-and-swap; each VM's `Calibration` holds a copy cached for a second (a tick until it has learned), derived and
//! allowed to lag, and its own cohorts and templates, which only it knows. The engines' mean is `kvgate.engine_len.<n>`, which the scraper alone writes. The rule
//! and the formula hold no state.

pub mod calibration;
pub mod cohort;
pub mod engine_lengths;
pub mod output_dist;
pub mod reservation;
pub mod slots;
pub mod templates;
pub mod text;
