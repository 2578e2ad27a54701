//! The credential helper's usage, in a file of its own so that `credgate man` writes its page
//! from the same text (`docker-credential-credgate(1)`).

pub const HELP: &str = "usage: docker-credential-credgate get|store|erase|list|version

A docker credential helper backed by the credgate agent (CREDGATE_SOCKET, else the default
socket). Clients run it themselves: docker, podman, buildah and skopeo when their config names
it for a registry (\"credHelpers\": {\"registry.example.com\": \"credgate\"}, or
\"credsStore\": \"credgate\" for all), with the verb as its argument and the registry on stdin.

Example:
  printf registry.example.com | docker-credential-credgate get

Environment: CREDGATE_SOCKET (the agent's socket), CREDGATE_HELPER_EXPLAIN=1 (write every
source tried on an anonymous answer, not only those that matched), CREDGATE_HELPER_ERASE=ignore
(erase succeeds and does nothing, for clients that erase at logout).";
