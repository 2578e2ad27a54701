//! The lazy-pull snapshotters on the real node (issues 40, 51): `scripts/lazy-compare` brings up
//! a node with nydus-snapshotter (and nydusd), soci-snapshotter or stargz-snapshotter as the
//! CRI's snapshotter, reading through credgate's registry mirror as README tells an operator, or
//! in a baseline way (its own CRI keychain; stargz: credgate's helper too; the other ways are
//! `scripts/lazy-compare`'s), starts pods from
//! images in the snapshotter's format and has their containers read data the snapshotter
//! fetches only then, across a snapshotter restart, a reboot of credgate, a pull secret's
//! rotation and a provider credential's expiry. One node at a time (the `node` test group);
//! needs root.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};

use crate::support::{bin_dir, text};

/// The outcome of each step of one way (`served`, or `failed: WHY`), and the scenario's facts.
fn compare(snapshotter: &str, way: &str) -> (BTreeMap<String, String>, serde_json::Value) {
    let out_dir = tempfile::tempdir().unwrap();
    let json = out_dir.path().join("results.json");
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/lazy-compare");
    let out = Command::new(script)
        .args(["--snapshotter", snapshotter, "--way", way, "--json"])
        .arg(&json)
        .env("CREDGATE_BIN_DIR", bin_dir())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "scripts/lazy-compare failed ({}):\n{}",
        out.status,
        text(&out.stderr)
    );
    let results: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let result = results[0].clone();
    let steps = result["steps"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
        .collect();
    (steps, result)
}

/// Every step `scripts/lazy-compare` reads at: what a row served throughout must serve.
const EVERY_STEP: &[&str] = &[
    "start",
    "restart",
    "new pod",
    "reboot",
    "rotation",
    "expiry-start",
    "expiry",
];

/// One way's row, checked: the steps that must be served, whether the pod secret's image, its new
/// pod after the restart (when given) and the provider's image are read lazily, and (with
/// credgate) that no secret reached its log.
fn row(
    snapshotter: &str,
    way: &str,
    served: &[&str],
    lazy: (bool, Option<bool>, bool),
) -> (BTreeMap<String, String>, serde_json::Value) {
    let (steps, result) = compare(snapshotter, way);
    for step in served {
        assert_eq!(steps[*step], "served", "{step}: {steps:?} {result}");
    }
    assert_eq!(result["lazy"]["team-a"], lazy.0, "{result}");
    if let Some(after) = lazy.1 {
        assert_eq!(result["lazy_after_restart"], after, "{result}");
    }
    assert_eq!(result["lazy"]["team-e"], lazy.2, "{result}");
    if way != "own" {
        assert_eq!(result["secret_in_credgate_log"], false, "{result}");
    }
    (steps, result)
}

/// nydus through credgate's mirror: every read served at every step, lazily: the pod secret's
/// image and the provider's, after the snapshotter's restart and credgate's, after the secret's
/// rotation and 3 minutes after the provider's first credential expired. nydusd 2.2.0 holds no
/// credential: it reads through the mirror, which adds the one of now.
#[test]
#[ignore = "needs root"]
fn nydus_through_credgates_mirror_reads_through_rotation_expiry_and_restarts() {
    let (_, result) = row("nydus", "mirror", EVERY_STEP, (true, Some(true), true));
    assert_eq!(result["late_restart"], "started", "{result}");
}

/// soci through credgate's mirror reads a pod secret's image lazily (no earlier way of
/// credgate's could: soci's docker keychain passes a host only) and the provider's image
/// lazily across its credential's expiry. A soci restart ends the filesystems it serves to
/// running containers whatever the credentials (its own CRI keychain's row too), so the reads
/// of the first container after it fail; soci comes back (allow_invalid_mounts_on_restart: it
/// fetches the SOCI index of a restored mount from the image's own registry, never a mirror,
/// with its keychains' credentials, which hold none for a pod secret's image after a restart;
/// docs/snapshotters.md).
#[test]
#[ignore = "needs root"]
fn soci_through_credgates_mirror_reads_a_pod_secrets_image_lazily() {
    let (steps, result) = row(
        "soci",
        "mirror",
        &["start", "expiry-start", "expiry"],
        (true, None, true),
    );
    assert!(
        steps["restart"].starts_with("failed: ") && !steps["restart"].contains("did not start"),
        "the first container's filesystem ends with the restart, soci comes back: {steps:?}"
    );
    assert_eq!(result["late_restart"], "started", "{result}");
}

/// stargz through credgate's mirror, with no credential of its own and its FUSE manager: every
/// read served at every step, lazily, as nydus's. A pod secret's image is read lazily (its layers
/// prepared during the pull with the pull's credential, lent to the mirror), by the first pod
/// across stargz's restarts (the FUSE manager keeps serving its filesystem) and the secret's
/// rotation, and by a new pod after the restart; the provider's image across its credential's
/// expiry.
#[test]
#[ignore = "needs root"]
fn stargz_through_credgates_mirror_reads_through_rotation_expiry_and_restarts() {
    let (_, result) = row("stargz", "mirror", EVERY_STEP, (true, Some(true), true));
    assert_eq!(result["rotation_pod"], "lazy-a", "{result}");
    assert_eq!(result["late_restart"], "started", "{result}");
}

/// A baseline for stargz: its docker config with credgate's helper, told the registry's host
/// only. The provider's image (a credential for the whole host) is read lazily across its
/// expiry; a pod's secret never reaches stargz, so the pod's image is pulled whole and read from
/// disk.
#[test]
#[ignore = "needs root"]
fn stargz_through_credgates_helper_never_reads_a_pod_secrets_image_lazily() {
    row(
        "stargz",
        "helper",
        &["start", "expiry-start", "expiry"],
        (false, None, true),
    );
}

#[test]
#[ignore = "needs root"]
fn nydus_on_its_own_cri_keychain_never_sees_a_rotated_or_renewed_credential() {
    // The baseline the comparison stands on: the same steps without credgate. Its lazy reads at
    // start must work (else nothing is compared); a rotated or renewed credential never
    // reaches the snapshotter (its CRI keychain is not renewable), and the reads fail.
    let (steps, result) = row(
        "nydus",
        "own",
        &["start", "expiry-start"],
        (true, None, true),
    );
    assert_eq!(result["rotation_delivered"], false, "{result}");
    assert_eq!(result["expiry_delivered"], false, "{result}");
    for step in ["rotation", "expiry"] {
        assert!(steps[step].starts_with("failed"), "{step}: {steps:?}");
    }
}

/// The baseline of soci on its own CRI keychain: it reads the pod's image lazily with the secret
/// its keychain saw, keeps that in memory only, and after a restart cannot restore the lazy
/// mount without it: it does not start again.
#[test]
#[ignore = "needs root"]
fn soci_on_its_own_cri_keychain_cannot_start_again_after_a_restart() {
    let (steps, result) = compare("soci", "own");
    assert_eq!(steps["start"], "served", "{steps:?}");
    assert_eq!(result["lazy"]["team-a"], true, "{result}");
    assert!(
        steps["restart"].contains("did not start again"),
        "{steps:?}"
    );
}

/// The baseline of stargz on its own CRI keychain, which lives in its FUSE manager (the kubelet's
/// image service): the mounts outlive the snapshotter's restarts, so the first pod reads on and a
/// new pod of the image is read lazily. But a mount reads through the keychain it was made with,
/// and each start of the snapshotter configures the FUSE manager with a new, empty one: the
/// rotated secret (the second pod's pull) reaches the new keychain, not the first pod's mount;
/// and a provider's credential is never renewed in a CRI keychain. Those reads fail.
#[test]
#[ignore = "needs root"]
fn stargz_on_its_own_cri_keychain_loses_its_reads_at_rotation_and_expiry() {
    let (steps, result) = row(
        "stargz",
        "own",
        &["start", "restart", "new pod", "reboot", "expiry-start"],
        (true, Some(true), true),
    );
    assert_eq!(result["rotation_pod"], "lazy-a", "{result}");
    for step in ["rotation", "expiry"] {
        assert!(steps[step].starts_with("failed"), "{step}: {steps:?}");
    }
}
