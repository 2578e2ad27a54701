//! credgate-core: everything credgate decides without doing IO.
//!
//! Image references ([`mod@reference`]), the kubelet's pattern grammar and matching ([`pattern`]),
//! Go durations ([`duration`]), the `CredentialProviderConfig` decoder and validator ([`config`]),
//! the plugin wire format ([`wire`]), node-wide docker config files ([`dockerconfig`]), the
//! keyring order ([`keyring`]), the docker credential helper's input ([`helper`]), the image access guard's rules ([`guard`]), renewal timing ([`renewal`]) and which consumers track which refs
//! ([`tracking`]). Nothing here touches the file system, processes, clocks or the
//! network; every function is testable from string literals.

pub mod config;
pub mod dockerconfig;
pub mod duration;
pub mod guard;
pub mod helper;
pub mod keyring;
pub mod pattern;
pub mod reference;
pub mod renewal;
pub mod text;
pub mod tracking;
pub mod wire;

pub use secrecy::{ExposeSecret, SecretString};
