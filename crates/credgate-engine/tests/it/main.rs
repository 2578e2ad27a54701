//! Integration tests of the engine: real plugin executables written to a temp dir, and
//! coalescing and cache timing with an injected runner under tokio's paused clock.

#[macro_use]
#[path = "../../src/test_runtimes.rs"]
mod test_runtimes;

mod cache;
mod coalescing;
mod common;
mod explain;
mod hostile;
mod plugins;
mod saved;
mod service_accounts;
mod sources;
