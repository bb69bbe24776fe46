//! The OpenAI-compatible wire format, in both directions: what a request body says
//! (`request`; the shapes its prompt takes, read in one pass, in `shapes`, and rendered into
//! its canonical text as they are read, by `render`; its numbers and
//! flags read as the engines read them, in `lax`), what the model server's response reports as it streams past (`response`; each
//! streamed chunk's pieces of text counted by `sse_chunk`; a JSON answer too long to keep walked
//! for its usage by `long_body`), the answers kvgate gives itself
//! instead of forwarding (`reply`), and a request's headers as the host serializes them
//! (`header_map`).
//!
//! Source of truth: none of it is state. Each request's parsed fields live in its own `flow::Flow`
//! and die with it; nothing here touches shared data.

pub mod header_map;
mod lax;
mod long_body;
mod render;
pub mod reply;
pub mod request;
pub mod response;
mod shapes;
pub mod sse_chunk;
