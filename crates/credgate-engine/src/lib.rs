//! credgate-engine: the IO half of credgate's credential providers.
//!
//! An [`Engine`] holds the configured providers, each with a plugin command, a cache keyed as
//! the plugin answers (`Image`, `Registry`, `Global`, optionally scoped to a service account),
//! a list of pending runs that concurrent misses join, and a failure backoff; plus static
//! sources (node-wide docker config files). [`Engine::lookup`] returns every credential that
//! applies to an image, in the order a puller should try them.
//!
//! IO sits behind narrow seams so tests inject fakes: [`exec::PluginRunner`] runs plugins
//! ([`exec::ExecRunner`] spawns real executables) and [`clock::Clock`] tells time.
//!
//! Runtime: lookups need tokio (its reactor and a runtime handle). The request that misses
//! the cache drives the plugin run itself; on a multi-threaded runtime the run first waits for
//! its plugin for up to 5 ms on the caller's thread inside `block_in_place` (other tasks move
//! to another worker), which makes a fast plugin cheaper to run; on a current-thread runtime
//! it never blocks. A lookup dropped mid-run hands the run to a task, so it still completes.
//!
//! ```no_run
//! use credgate_engine::{Engine, EngineOptions, LookupRequest};
//! use credgate_engine::source::load_provider_config;
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let config = load_provider_config("examples/provider-config.yaml".as_ref())?;
//! let engine = Engine::builder()
//!     .config(config)
//!     .options(EngineOptions { plugin_dir: "examples/plugins".into(), ..Default::default() })
//!     .build()?;
//! let found = engine.lookup(&LookupRequest { image: "registry.example.com/app:v1", ..Default::default() }).await?;
//! for c in &found.credentials {
//!     println!("{} {} {}", c.source.name(), c.pattern, c.username);
//! }
//! # Ok(()) }
//! ```

#[cfg(test)]
#[macro_use]
mod test_runtimes;

mod cache;
pub mod clock;
pub mod engine;
pub mod error;
pub mod exec;
pub mod explain;
pub mod invalidate;
mod memo;
pub mod metrics;
mod owned_thread;
mod provider;
pub mod rate;
pub mod saved;
pub mod source;
pub mod sources;
mod spawn;
pub mod sweep;
pub mod sys;
mod watchdog;

pub use engine::{
    BuildError, Credential, CredentialRef, Engine, EngineBuilder, EngineOptions, EntryInfo, Lookup,
    LookupError, LookupRequest, Source, SourceKind, StaticSource,
};
pub use error::{FailureReason, ProviderError};
pub use invalidate::{Dropped, FlushError};
pub use provider::{
    BackoffPolicy, ProviderStatus, ServiceAccount, FOLLOW_FIRST, FOLLOW_MAX, FOLLOW_SHARED,
};
pub use sources::{SourceError, Sources};
