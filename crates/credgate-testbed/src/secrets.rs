//! The secrets a test hands out, remembered for the rest of the test, and the check that none of
//! them reached an agent's log.
//!
//! nextest runs every test in a process of its own, so the set is the test's. The fixtures that
//! make a secret (a registry's user, a token server's, a docker config, a pod's pull secret)
//! remember it; the fixtures that start an agent check its log when they are dropped, so every
//! test that starts one is checked without saying so.

use std::collections::BTreeSet;

use base64::Engine as _;
use parking_lot::Mutex;

static SECRETS: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// Shorter secrets are placeholders (`"x"`, `"pw"`) that any log holds by chance: not checked.
pub const MIN_LEN: usize = 6;

/// Remembers `secret` (and returns it, for a test's own constants).
pub fn secret(secret: &str) -> &str {
    if secret.len() >= MIN_LEN {
        SECRETS.lock().insert(secret.to_owned());
    }
    secret
}

/// Remembers a login: the password, and `user:password` in base64 as Basic auth and docker
/// configs carry it.
pub fn login(user: &str, password: &str) {
    if password.len() < MIN_LEN {
        return;
    }
    secret(password);
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    secret(&basic);
}

/// Words the tests' secrets carry by convention (`good-Pa55word`, `forged-token-not-for-logs`)
/// and nothing else does: found in a log even when the secret reached the agent some other way
/// than a fixture (a plugin's script, a CLI flag).
pub const MARKERS: [&str; 2] = ["Pa55word", "not-for-logs"];

/// The first remembered secret, or marker, that `text` contains.
pub fn found_in(text: &str) -> Option<String> {
    let remembered = SECRETS
        .lock()
        .iter()
        .find(|s| text.contains(s.as_str()))
        .cloned();
    remembered.or_else(|| {
        MARKERS
            .iter()
            .find(|m| text.contains(*m))
            .map(|m| (*m).to_owned())
    })
}

/// Panics if `text` (the log of `what`) contains a remembered secret, unless the thread is
/// already panicking (a failed test's first message is the one to read).
pub fn check(what: &str, text: &str) {
    if std::thread::panicking() {
        return;
    }
    if let Some(s) = found_in(text) {
        panic!("a secret of this test ({s:?}) is in {what}:\n{text}");
    }
}
