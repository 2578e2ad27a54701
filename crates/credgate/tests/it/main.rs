//! The `credgate` binaries end to end, in one test binary (one link instead of one per file):
//! the CLI, the agent as a process, the kubelet bridge, the docker helper with skopeo, podman
//! and docker, the CRI proxy against containerd, the image access guard, the deployment files,
//! and gRPC clients credgate did not write.

mod support;

mod agent;
mod bridge;
mod cli;
mod clients;
mod cri;
mod deploy;
mod docs;
mod e2e;
mod guard_agent;
mod guard_e2e;
mod hpack;
mod lazy;
mod mirror;
mod node;
mod node_images;
mod package;
mod policy;
mod refusal;
mod rotation;
mod tenants;
