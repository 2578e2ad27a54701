//! credgate-agent: the node agent behind `credgate serve`.
//!
//! An [`Agent`] holds the credential engine (rebuilt whole on reload), the renewal service
//! ([`renewal`]) and the metric registry. [`server::serve`] exposes it as the `credgate.v1` gRPC
//! API on a unix socket bound by [`socket::bind`]; [`scrape::serve`] exposes `/metrics`.
//! [`node::Node`] composes them with the CRI proxy, signals and shutdown; binaries stay thin:
//! they parse flags into [`node::NodeOptions`] and run the node. Every task is owned by the
//! agent's [`tasks::Tasks`].

mod agent;
pub mod captured;
mod confirm;
mod conn;
pub mod cri;
pub mod explain;
pub mod guard;
mod listener;
pub mod metrics;
pub mod node;
pub mod node_images;
mod outcome;
mod pull_log;
mod refusal;
pub mod renewal;
mod rewrite;
pub mod saved_cache;
pub mod saver;
pub mod scrape;
pub mod server;
pub mod socket;
pub mod state;
mod status;
pub mod tasks;

pub use agent::{Agent, AgentOptions, CallerAllowlist, ReloadError, Reloaded, Service};
pub use credgate_engine::sources::{SourceError, Sources};

use credgate_core::text::error_chain;
