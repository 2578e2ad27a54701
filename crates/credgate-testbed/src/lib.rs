//! Real parts for credgate's end-to-end tests and benchmarks, each owning its child process
//! and stopping exactly that PID when dropped:
//!
//! - [`Registry`]: Debian's `docker-registry` on 127.0.0.1 with htpasswd (or any other) auth;
//! - [`oci_image`] and [`push`]: a one-layer OCI image, pushed with skopeo;
//! - [`Containerd`]: Debian's containerd with its CRI plugin, the native snapshotter and a
//!   private root, state and socket in a temporary directory;
//! - [`cri`]: the CRI image-service messages a kubelet sends, and a unary call over a socket;
//! - [`secrets`]: the secrets a test handed out, checked for in every agent's log.

pub mod cri;
pub mod fake_runtime;
pub mod h2;
mod image;
mod process;
mod registry;
pub mod secrets;
pub mod stub_registry;

pub use image::{oci_image, oci_image_saying, push};
pub use process::{
    eventually, eventually_async, require, require_root, run, wait_for_exit, Containerd,
};
pub use registry::{docker_config, Registry};
