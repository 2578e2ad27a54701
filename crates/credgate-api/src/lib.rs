//! credgate's gRPC API: the `credgate.v1` messages and services generated from
//! `proto/credgate/v1/credgate.proto`, and how clients find and reach the agent's unix socket.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use credgate_api::v1::{credentials_client::CredentialsClient, LookupRequest};
//! let path = credgate_api::socket_path(None);
//! let channel = credgate_api::connect(&path).await?;
//! let answer = CredentialsClient::new(channel)
//!     .lookup(LookupRequest { image: "registry.example.com/team/app:v1".into(), ..Default::default() })
//!     .await?;
//! println!("{} credentials", answer.get_ref().credentials.len());
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};

/// The generated `credgate.v1` package.
pub mod v1 {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("credgate.v1");

    impl PullCredential {
        /// The pull secret at `secret` holding `username` and `password`.
        pub fn secret(
            secret: ObjectRef,
            username: impl Into<String>,
            password: impl Into<String>,
        ) -> PullCredential {
            PullCredential {
                kind: Some(pull_credential::Kind::Secret(SecretCredential {
                    secret: Some(secret),
                    username: username.into(),
                    password: password.into(),
                })),
            }
        }

        /// Anonymous or the node's own credentials.
        pub fn node_wide() -> PullCredential {
            PullCredential {
                kind: Some(pull_credential::Kind::NodeWide(NodeWide {})),
            }
        }
    }
}

/// The `credgate.v1` methods as gRPC paths, for clients that call them without generated
/// stubs (the blocking client of the helper and the bridge, raw HTTP/2 in tests and benchmarks).
pub mod methods {
    pub const LOOKUP: &str = "/credgate.v1.Credentials/Lookup";
    pub const WATCH: &str = "/credgate.v1.Credentials/Watch";
    pub const HEALTH: &str = "/credgate.v1.Admin/Health";
    pub const PING: &str = "/credgate.v1.Admin/Ping";
    pub const STATUS: &str = "/credgate.v1.Admin/Status";
    pub const VERIFY: &str = "/credgate.v1.ImageAccess/Verify";
    pub const REPORT_REFUSED: &str = "/credgate.v1.Credentials/ReportRefused";
    pub const FLUSH: &str = "/credgate.v1.Admin/Flush";
}

pub mod authority;
pub mod codec;
pub mod cri;
pub mod frame;
pub mod hpack;
pub mod names;
mod redact;
/// The rule for trusted paths (its own crate: the engine reads trusted files too).
pub use credgate_trust as trust;
pub mod unary;

/// The environment variable clients read the socket path from.
pub const SOCKET_ENV: &str = "CREDGATE_SOCKET";

/// The API package name.
pub const API: &str = "credgate.v1";

/// Whether this process runs as root.
pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// The default socket: `/run/credgate/credgate.sock` as root, `$XDG_RUNTIME_DIR/credgate.sock`
/// otherwise; without that variable `/run/user/$UID/credgate.sock` when that directory is the
/// user's, else `/tmp/credgate-$UID/credgate.sock` (which another user could create first:
/// agents and clients refuse it then, see [`trust`]).
pub fn default_socket_path() -> PathBuf {
    if is_root() {
        return PathBuf::from("/run/credgate/credgate.sock");
    }
    if let Some(dir) = std::env::var_os("XDG_RUNTIME_DIR").filter(|v| !v.is_empty()) {
        return PathBuf::from(dir).join("credgate.sock");
    }
    let uid = rustix::process::getuid().as_raw();
    let run_user = PathBuf::from(format!("/run/user/{uid}"));
    if trust::check_dir(&run_user, trust::Owner::Me).is_ok() {
        return run_user.join("credgate.sock");
    }
    PathBuf::from(format!("/tmp/credgate-{uid}/credgate.sock"))
}

/// The socket a client uses: the flag when given, else `CREDGATE_SOCKET`, else the default.
pub fn socket_path(flag: Option<&Path>) -> PathBuf {
    if let Some(p) = flag {
        return p.to_owned();
    }
    match std::env::var_os(SOCKET_ENV).filter(|v| !v.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => default_socket_path(),
    }
}

/// A channel to the agent on the unix socket at `path`. Connects eagerly, so an absent agent
/// is an error here rather than at the first call.
pub async fn connect(path: &Path) -> Result<Channel, tonic::transport::Error> {
    // The URI is required by the HTTP layer and never dialled; the connector is.
    connect_with(path, Endpoint::from_static("http://credgate.sock")).await
}

/// Like [`connect`], with the caller's endpoint settings (windows, timeouts). The socket and
/// its directory must be owned by this uid or root and writable by nobody else
/// ([`trust::check_socket`]): a client never sends secrets to, or takes credentials from, a
/// socket another user planted.
pub async fn connect_with(
    path: &Path,
    endpoint: Endpoint,
) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_owned();
    endpoint
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                trust::check_socket(&path)
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::PermissionDenied, e))?;
                UnixStream::connect(path).await.map(TokioIo::new)
            }
        }))
        .await
}
