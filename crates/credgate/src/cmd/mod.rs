pub mod check;
pub mod ctl;
pub mod ctl_guard;
pub mod explain;
pub mod get;
pub mod kubelet_config;
pub mod matching;
pub mod serve;
