//! credgate-agent: the node agent behind `credgate serve`.
//!
//! An [`Agent`] holds the credential engine (rebuilt whole on reload), the renewal service
//! ([`renewal`]) and the metric registry. [`server::serve`] exposes it as the `credgate.v1` gRPC
//! API on a unix socket bound by [`socket::bind`]; [`metrics::serve`] exposes `/metrics`.
//! [`node::Node`] composes them with the CRI proxy, signals and shutdown; binaries stay thin:
//! they parse flags into [`node::NodeOptions`] and run the node. Every task is owned by the
//! agent's [`tasks::Tasks`].

pub mod agent;
pub mod captured;
pub mod conn;
pub mod cri;
pub mod explain;
pub mod guard;
pub mod listener;
pub mod metrics;
pub mod node;
pub mod pulls;
pub mod refusal;
pub mod renewal;
mod rewrite;
pub mod saved_cache;
pub mod server;
pub mod socket;
pub mod state;
pub mod status;
pub mod tasks;

pub use agent::{Agent, AgentOptions, CallerAllowlist, ReloadError, Reloaded, Service};
pub use credgate_engine::sources::{SourceError, Sources};

pub use credgate_core::text::error_chain;
