//! Whether a registry refuses a credential itself, asked before the agent acts on a refusal
//! (decision 0019). A pull answered unauthorized, or a consumer's report, says only that the
//! registry did not let a credential read one image: a typo'd or missing repository, or one the
//! credential may not see, ends the same way on Docker Hub and most token registries. The
//! registry's auth endpoint tells the two apart ([`Verifier::check_credential`]).
//!
//! Confirmations are bounded: at most one in flight per registry and credential (others wait
//! for its answer), one per registry stripe and [`IN_FLIGHT`] in all, each within
//! [`TIMEOUT`]; answers are remembered for [`REMEMBER`] (an unanswered one for
//! [`REMEMBER_UNKNOWN`]), at most [`REMEMBERED`] of them. A registry that does not answer in
//! time changes nothing. Root's and the agent's own confirmations go first: they wait for no
//! stripe and have [`IN_FLIGHT`] of their own, so other local users' reports cannot hold them
//! back (a report joining one in flight still waits for that one, within [`TIMEOUT`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{OnceCell, Semaphore};

use crate::guard::registry::{CredentialCheck, Verifier};

/// A credential's keyed fingerprint (never the secret).
pub type Fingerprint = [u8; 32];

/// The longest a confirmation may take, waiting for its turn included.
pub const TIMEOUT: Duration = Duration::from_secs(5);
/// How long an answer is remembered: a pod in ImagePullBackOff on a typo'd image costs the
/// registry two requests per credential at most this often, and a credential rotated right
/// after it was found accepted waits at most this long to be refused.
pub const REMEMBER: Duration = Duration::from_secs(10);
/// How long "the registry did not answer" is remembered.
pub const REMEMBER_UNKNOWN: Duration = Duration::from_secs(5);
/// Confirmations remembered or in flight.
pub const REMEMBERED: usize = 1024;
/// Confirmations in flight at once for other uids' reports in all, and as many more for root's
/// and the agent's own.
pub const IN_FLIGHT: usize = 4;
/// Registries are spread over this many stripes of one confirmation in flight each.
const STRIPES: usize = 16;

/// What the registry said of a credential.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Confirmed {
    /// Its auth endpoint refused the credential itself.
    Refused,
    /// Its auth endpoint accepted the credential: what failed was the credential's access to
    /// the image (or the image itself).
    Accepted,
    /// It does not check credentials, or its answer says neither.
    Unchecked,
    /// It was not asked, or did not answer in time: why.
    Unknown(String),
}

impl Confirmed {
    /// As metrics and the API name it.
    pub fn as_str(&self) -> &'static str {
        match self {
            Confirmed::Refused => "refused",
            Confirmed::Accepted => "accepted",
            Confirmed::Unchecked => "unchecked",
            Confirmed::Unknown(_) => "unreachable",
        }
    }
}

type Key = (String, Fingerprint);

struct Slot {
    /// The answer and when it was given.
    answer: OnceCell<(Confirmed, Instant)>,
}

impl Slot {
    fn fresh(&self, now: Instant) -> bool {
        match self.answer.get() {
            None => true,
            Some((c, at)) => {
                let keep = match c {
                    Confirmed::Unknown(_) => REMEMBER_UNKNOWN,
                    _ => REMEMBER,
                };
                now < *at + keep
            }
        }
    }
}

/// The agent's confirmations.
pub struct Confirmations {
    verifier: Verifier,
    slots: Mutex<HashMap<Key, Arc<Slot>>>,
    stripes: Vec<Semaphore>,
    all: Semaphore,
    /// Root's and the agent's own.
    first: Semaphore,
}

impl Confirmations {
    pub fn new(verifier: Verifier) -> Confirmations {
        Confirmations {
            verifier,
            slots: Mutex::default(),
            stripes: (0..STRIPES).map(|_| Semaphore::new(1)).collect(),
            all: Semaphore::new(IN_FLIGHT),
            first: Semaphore::new(IN_FLIGHT),
        }
    }

    /// The slot of `key`: a remembered answer, the one in flight, or a new one; `None` when
    /// [`REMEMBERED`] are held and none can go.
    fn slot(&self, key: Key, now: Instant) -> Option<Arc<Slot>> {
        let mut slots = self.slots.lock();
        if let Some(s) = slots.get(&key).filter(|s| s.fresh(now)) {
            return Some(s.clone());
        }
        if slots.len() >= REMEMBERED {
            slots.retain(|_, s| s.fresh(now));
        }
        if slots.len() >= REMEMBERED {
            return None;
        }
        let slot = Arc::new(Slot {
            answer: OnceCell::new(),
        });
        slots.insert(key, slot.clone());
        Some(slot)
    }

    fn stripe(&self, registry: &str) -> &Semaphore {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        registry.hash(&mut h);
        &self.stripes[(h.finish() as usize) % STRIPES]
    }

    /// Asks `registry` (as image references name it) what it says of `username`:`password`
    /// (whose fingerprint is `fp`), for `repository`'s scope; or gives the answer remembered or
    /// in flight. `now`: the agent's clock; `first`: root's or the agent's own (goes first).
    #[allow(clippy::too_many_arguments)]
    pub async fn confirm(
        &self,
        registry: &str,
        repository: &str,
        fp: Fingerprint,
        username: &str,
        password: &str,
        now: Instant,
        first: bool,
    ) -> Confirmed {
        let Some(slot) = self.slot((registry.to_owned(), fp), now) else {
            return Confirmed::Unknown("too many confirmations at once".into());
        };
        let ask = async {
            let asked = tokio::time::timeout(TIMEOUT, async {
                let stopping = || Confirmed::Unknown("the agent is stopping".into());
                let _permits = if first {
                    let Ok(p) = self.first.acquire().await else {
                        return stopping();
                    };
                    (None, p)
                } else {
                    let Ok(one) = self.stripe(registry).acquire().await else {
                        return stopping();
                    };
                    let Ok(all) = self.all.acquire().await else {
                        return stopping();
                    };
                    (Some(one), all)
                };
                match self
                    .verifier
                    .check_credential(registry, repository, username, password)
                    .await
                {
                    Ok(CredentialCheck::Refused) => Confirmed::Refused,
                    Ok(CredentialCheck::Accepted) => Confirmed::Accepted,
                    Ok(CredentialCheck::Unchecked) => Confirmed::Unchecked,
                    Err(why) => Confirmed::Unknown(why.to_string()),
                }
            })
            .await
            .unwrap_or_else(|_| {
                Confirmed::Unknown(format!("no answer within {}s", TIMEOUT.as_secs()))
            });
            (asked, now)
        };
        slot.answer.get_or_init(|| ask).await.0.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guard::registry::RegistryOptions;
    use base64::Engine as _;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// A loopback registry with Basic auth whose one user's password is `password` (changed
    /// through the returned handle); it counts the requests that carry a credential.
    async fn basic_registry(
        user: &'static str,
        password: &str,
    ) -> (String, Arc<Mutex<String>>, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let host = listener.local_addr().unwrap().to_string();
        let password = Arc::new(Mutex::new(password.to_owned()));
        let asked = Arc::new(AtomicUsize::new(0));
        let (pw, n) = (password.clone(), asked.clone());
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let (pw, n) = (pw.clone(), n.clone());
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 8192];
                    let mut got = 0;
                    while !buf[..got].windows(4).any(|w| w == b"\r\n\r\n") {
                        match conn.read(&mut buf[got..]).await {
                            Ok(0) | Err(_) => return,
                            Ok(k) => got += k,
                        }
                    }
                    let head = String::from_utf8_lossy(&buf[..got]).to_ascii_lowercase();
                    let want = base64::engine::general_purpose::STANDARD
                        .encode(format!("{user}:{}", pw.lock()))
                        .to_ascii_lowercase();
                    let answer = match head.find("authorization: basic ") {
                        None => "401 Unauthorized",
                        Some(_) => {
                            n.fetch_add(1, Ordering::SeqCst);
                            match head.contains(&format!("authorization: basic {want}\r\n")) {
                                true => "200 OK",
                                false => "401 Unauthorized",
                            }
                        }
                    };
                    let reply = format!("HTTP/1.1 {answer}\r\nWWW-Authenticate: Basic realm=\"test\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                    let _ = conn.write_all(reply.as_bytes()).await;
                });
            }
        });
        (host, password, asked)
    }

    /// An answer is remembered for [`REMEMBER`] from the `now` it was given at, whatever the
    /// registry says meanwhile, and asked again after it: a credential rotated right after it
    /// was found accepted is refused at the first confirmation past that (no real time waited:
    /// `now` is the caller's clock).
    #[tokio::test]
    async fn answers_are_remembered_for_their_time_and_asked_again_after() {
        let (host, password, asked) = basic_registry("alice", "old-pw").await;
        let confirmations = Confirmations::new(Verifier::new(RegistryOptions {
            timeout: Duration::from_secs(5),
            insecure: Vec::new(),
        }));
        let fp = [7u8; 32];
        let t0 = Instant::now();
        let confirm = |at: Instant| {
            confirmations.confirm(&host, "team/app", fp, "alice", "old-pw", at, false)
        };
        assert_eq!(confirm(t0).await, Confirmed::Accepted);
        assert_eq!(asked.load(Ordering::SeqCst), 1);
        *password.lock() = "new-pw".into();
        // Within its time: the answer remembered, the registry not asked.
        assert_eq!(
            confirm(t0 + REMEMBER - Duration::from_secs(1)).await,
            Confirmed::Accepted
        );
        assert_eq!(asked.load(Ordering::SeqCst), 1);
        // Past it: asked again, and refused now.
        assert_eq!(
            confirm(t0 + REMEMBER + Duration::from_secs(1)).await,
            Confirmed::Refused
        );
        assert_eq!(asked.load(Ordering::SeqCst), 2);
    }

    /// A registry that takes connections and never answers: the confirmation gives up at
    /// [`TIMEOUT`] and says so, refusing nothing (on tokio's paused clock: no real time
    /// waited).
    #[tokio::test(start_paused = true)]
    async fn a_registry_that_never_answers_is_unknown_at_the_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let host = listener.local_addr().unwrap().to_string();
        let held = tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((conn, _)) = listener.accept().await {
                open.push(conn);
            }
        });
        let confirmations = Confirmations::new(Verifier::new(RegistryOptions {
            timeout: Duration::from_secs(60),
            insecure: Vec::new(),
        }));
        let asked = tokio::time::Instant::now();
        let answer = confirmations
            .confirm(
                &host,
                "team/app",
                [1u8; 32],
                "alice",
                "pw",
                Instant::now(),
                false,
            )
            .await;
        let waited = asked.elapsed();
        assert!(
            (TIMEOUT..TIMEOUT + Duration::from_secs(1)).contains(&waited),
            "{waited:?}"
        );
        assert_eq!(
            answer,
            Confirmed::Unknown(format!("no answer within {}s", TIMEOUT.as_secs()))
        );
        held.abort();
    }
}
