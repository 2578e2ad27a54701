//! credgate-agent: the node agent behind `credgate serve`.
//!
//! An [`Agent`] holds the credential engine (rebuilt whole on reload), the renewal service
//! ([`renewal`]) and the metric registry. [`server::serve`] exposes it as the `credgate.v1` gRPC
//! API on a unix socket bound by [`socket::bind`]; [`scrape::serve`] exposes `/metrics`.
//! The CRI proxy (crate `credgate-cri`) is given handles on it, never the agent; the `credgate`
//! binary's `node.rs` composes them with signals and shutdown. Every task is owned by the
//! agent's [`tasks::Tasks`].

mod agent;
pub mod captured;
mod confirm;
pub mod control;
pub mod explain;
pub mod guard;
pub mod memory;
pub mod metrics;
pub mod refusal;
pub mod renewal;
pub mod saved_cache;
pub mod saver;
pub mod scrape;
pub mod server;
pub mod socket;
pub mod state;
pub mod status;
pub mod tasks;

pub use agent::{Agent, AgentOptions, AllowUidsError, CallerAllowlist, Service};
pub use control::{ReloadError, Reloaded};
pub use credgate_engine::sources::{SourceError, Sources};

use credgate_core::text::error_chain;
