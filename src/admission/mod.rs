//! Who may be sent now, who waits and who is refused: the per-VM admission state and its wakes
//! (`admit`), a pod's token budget (`budget`), the KV forecast the budget is checked against
//! (`forecast`), the corrections the engine's own numbers make to the budget (`feedback`), the one
//! fair waiting line in front of all pods (`line`), and recent conversations whose next turn goes
//! first (`sessions`).
//!
//! Source of truth: the line is one shared record, `kvgate.queue` (`line`), recent sessions
//! another, `kvgate.sessions` (`sessions`), and the relief cap a preemption sets on every pod a
//! third, `kvgate.relief_lost` (`feedback`); all change only by compare-and-swap. What a pod holds
//! and its corrected budget live in the pod's shared record (`pods::record`). Per VM, `admit` keeps
//! only which of its own requests are parked and when it last woke another VM: derived, and rebuilt
//! from the line when lost.

pub mod admit;
pub mod budget;
pub mod feedback;
pub mod forecast;
pub mod line;
pub mod sessions;
