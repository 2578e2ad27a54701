//! containerd's hosts directories (`config_path`), read at the proxy's start and again when
//! they change, never on a pull: the policy ([`crate::policy`]) decides from the last
//! [`HostsView`], in memory.
//!
//! What is read: every entry of each root (at most [`MAX_ENTRIES`]), whether it is a
//! directory (as `os.Stat` sees it: a link is followed), and its `hosts.toml` (at most
//! [`MAX_HOSTS_FILE`] bytes). What tells of a change: inotify watches on each root (or, while
//! a root is missing, on the nearest directory above it that exists) and on each directory in
//! it; the view is read again after any event, and every [`RECHECK`] whatever the events say
//! (a watch can be missed: the kernel's queue overflows, a link's target changes elsewhere).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio_util::sync::CancellationToken;

/// Largest `hosts.toml` read.
pub const MAX_HOSTS_FILE: u64 = 256 << 10;
/// Entries of one root read; a root with more is not certain (every lookup under it is).
pub const MAX_ENTRIES: usize = 4096;
/// The view is read again this often even when no event came.
pub const RECHECK: Duration = Duration::from_secs(30);

/// One entry of a root, as containerd's `os.Stat` would find it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    /// A directory, and its `hosts.toml`'s text (`None`: it has none).
    Dir(Result<Option<String>, HostsError>),
    /// Something else: containerd fails a pull that reaches it.
    NotDir,
    /// Its metadata could not be read.
    Unreadable(HostsError),
}

/// One root: its entries by name, or why it could not be read (a missing root has none).
type Root = Result<BTreeMap<OsString, Entry>, HostsError>;

/// Why containerd's hosts for a registry are not known with certainty: the proxy then keeps
/// the credential with the registry.
#[derive(Debug, Clone, thiserror::Error)]
pub enum HostsError {
    #[error("{}", path.display())]
    Io {
        path: PathBuf,
        /// Shared: a reading is cloned into every view that holds it.
        #[source]
        source: std::sync::Arc<std::io::Error>,
    },
    #[error("{} has more than {MAX_ENTRIES} entries", path.display())]
    TooMany { path: PathBuf },
    #[error("{} is not a regular file", path.display())]
    NotFile { path: PathBuf },
    #[error("{} is over {MAX_HOSTS_FILE} bytes", path.display())]
    TooLarge { path: PathBuf },
    #[error("{} is not a directory (containerd fails such pulls)", path.display())]
    NotDir { path: PathBuf },
    #[error("{}", path.display())]
    Toml {
        path: PathBuf,
        #[source]
        source: std::sync::Arc<crate::policy::HostsTomlError>,
    },
}

impl HostsError {
    fn io(path: &Path, e: std::io::Error) -> HostsError {
        HostsError::Io {
            path: path.to_owned(),
            source: std::sync::Arc::new(e),
        }
    }
}

/// Two readings are the same when they fail the same way on the same path (what the watcher
/// compares).
impl PartialEq for HostsError {
    fn eq(&self, other: &Self) -> bool {
        use HostsError::*;
        match (self, other) {
            (Io { path: a, source: x }, Io { path: b, source: y }) => {
                a == b && x.kind() == y.kind()
            }
            (TooMany { path: a }, TooMany { path: b })
            | (NotFile { path: a }, NotFile { path: b })
            | (TooLarge { path: a }, TooLarge { path: b })
            | (NotDir { path: a }, NotDir { path: b }) => a == b,
            (Toml { path: a, source: x }, Toml { path: b, source: y }) => {
                a == b && x.to_string() == y.to_string()
            }
            _ => false,
        }
    }
}

impl Eq for HostsError {}

/// What the hosts directories held at one reading.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostsView {
    roots: Vec<(PathBuf, Root)>,
}

impl HostsView {
    /// Reads `roots` (containerd's `config_path`, split as `filepath.SplitList` splits it).
    pub fn read(roots: &[PathBuf]) -> HostsView {
        HostsView {
            roots: roots.iter().map(|r| (r.clone(), read_root(r))).collect(),
        }
    }

    /// The hosts other than `registry`'s own that containerd tries for it: in the first root
    /// where any of [`host_dirs`] exists, the first that exists decides, and its `hosts.toml`
    /// names them; a directory without one, or with an empty one, names none, and so does no
    /// directory at all. `Err` where containerd would fail or credgate cannot be sure (a
    /// candidate that is not a directory, an unreadable or malformed `hosts.toml`, a root that
    /// could not be read): the caller then keeps the credential with the registry.
    pub fn configured_mirrors(&self, registry: &str) -> Result<Vec<String>, HostsError> {
        for (root, entries) in &self.roots {
            let entries = entries.as_ref().map_err(Clone::clone)?;
            for dir in host_dirs(root, registry) {
                let Some(entry) = dir.file_name().and_then(|name| entries.get(name)) else {
                    continue;
                };
                let file = dir.join("hosts.toml");
                return match entry {
                    Entry::Dir(Ok(None)) => Ok(Vec::new()),
                    Entry::Dir(Ok(Some(text))) => crate::policy::mirrors_in(text, registry)
                        .map_err(|e| HostsError::Toml {
                            path: file,
                            source: std::sync::Arc::new(e),
                        }),
                    Entry::Dir(Err(e)) | Entry::Unreadable(e) => Err(e.clone()),
                    Entry::NotDir => Err(HostsError::NotDir { path: dir }),
                };
            }
        }
        Ok(Vec::new())
    }
}

/// The host containerd looks up in its `config_path` for an image of `registry`: the host of
/// the reference as its CRI normalizes it (distribution's `ParseDockerRef`), which folds only
/// `index.docker.io` into `docker.io`; `registry-1.docker.io` stays itself and so reads
/// `registry-1.docker.io/` and then `_default/`, never `docker.io/`.
pub fn containerd_host(registry: &str) -> &str {
    match registry {
        "index.docker.io" => "docker.io",
        r => r,
    }
}

/// The directories containerd (1.6 through 2.4: `hostPaths`) tries for `registry` under one
/// root of its `config_path`, in its order: `HOST_PORT_` when the name has a port,
/// `HOST[:PORT]`, then the catch-all `_default`.
pub fn host_dirs(root: &Path, registry: &str) -> Vec<PathBuf> {
    let host = containerd_host(registry);
    let mut out = Vec::new();
    if let Some(i) = host.rfind(':').filter(|&i| i > 0) {
        out.push(root.join(format!("{}_{}_", &host[..i], &host[i + 1..])));
    }
    out.push(root.join(host));
    out.push(root.join("_default"));
    out
}

fn read_root(root: &Path) -> Root {
    let listing = match std::fs::read_dir(root) {
        Ok(listing) => listing,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(HostsError::io(root, e)),
    };
    let mut entries = BTreeMap::new();
    for entry in listing {
        let entry = entry.map_err(|e| HostsError::io(root, e))?;
        if entries.len() == MAX_ENTRIES {
            return Err(HostsError::TooMany {
                path: root.to_owned(),
            });
        }
        let path = entry.path();
        let read = match std::fs::metadata(&path) {
            Ok(meta) if meta.is_dir() => Entry::Dir(read_hosts_toml(&path.join("hosts.toml"))),
            Ok(_) => Entry::NotDir,
            // A link to nothing: containerd's os.Stat says it does not exist.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => Entry::Unreadable(HostsError::io(&path, e)),
        };
        entries.insert(entry.file_name(), read);
    }
    Ok(entries)
}

fn read_hosts_toml(path: &Path) -> Result<Option<String>, HostsError> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(HostsError::io(path, e)),
    };
    if !file.metadata().is_ok_and(|m| m.is_file()) {
        return Err(HostsError::NotFile {
            path: path.to_owned(),
        });
    }
    let mut text = String::new();
    file.take(MAX_HOSTS_FILE + 1)
        .read_to_string(&mut text)
        .map_err(|e| HostsError::io(path, e))?;
    if text.len() as u64 > MAX_HOSTS_FILE {
        return Err(HostsError::TooLarge {
            path: path.to_owned(),
        });
    }
    Ok(Some(text))
}

/// The hosts directories and their last reading, shared by the policy (which loads it) and the
/// watcher (which replaces it).
#[derive(Debug)]
pub struct Hosts {
    roots: Vec<PathBuf>,
    view: ArcSwap<HostsView>,
    /// Bumped at each reading that changed the view (what a test waits for).
    changed: tokio::sync::watch::Sender<u64>,
}

impl Hosts {
    /// The roots, read now (at the proxy's start).
    pub fn new(roots: Vec<PathBuf>) -> Hosts {
        let view = HostsView::read(&roots);
        Hosts {
            roots,
            view: ArcSwap::from_pointee(view),
            changed: tokio::sync::watch::Sender::new(0),
        }
    }

    /// The last reading.
    pub fn view(&self) -> arc_swap::Guard<Arc<HostsView>> {
        self.view.load()
    }

    /// Reads the roots again; whether the view changed.
    pub fn reread(&self) -> bool {
        let view = HostsView::read(&self.roots);
        if **self.view.load() == view {
            return false;
        }
        self.view.store(Arc::new(view));
        self.changed.send_modify(|n| *n += 1);
        true
    }

    /// A receiver told of every change of the view.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Keeps the view current until `shutdown`: reads again after each inotify event on the
    /// roots and their directories (once the watches are armed again), and every [`RECHECK`]. Without inotify (no descriptor left,
    /// the watch limit reached) it reads every second instead, and says so once.
    pub async fn watch(self: Arc<Self>, shutdown: CancellationToken) {
        let mut notify = match Watches::new() {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(error = %e, "the hosts directories cannot be watched: they are read every second instead");
                None
            }
        };
        loop {
            if let Some(w) = notify.as_mut() {
                if let Err(e) = w.arm(&self.roots) {
                    tracing::warn!(error = %e, "the hosts directories cannot be watched: they are read every second instead");
                    notify = None;
                }
            }
            // What changed before the watches were armed has no event of its own.
            if self.reread() {
                tracing::info!("containerd's hosts directories changed: read again");
            }
            let every = match notify {
                Some(_) => RECHECK,
                None => Duration::from_secs(1),
            };
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(every) => {}
                () = async {
                    match notify.as_mut() {
                        Some(w) => w.next().await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
        }
    }
}

/// One inotify instance and its watches (a fresh set at each [`Watches::arm`]).
struct Watches {
    fd: tokio::io::unix::AsyncFd<OwnedFd>,
    armed: Vec<i32>,
}

impl Watches {
    fn new() -> std::io::Result<Watches> {
        use rustix::fs::inotify;
        let fd = inotify::init(inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK)?;
        Ok(Watches {
            fd: credgate_engine::sys::register(fd, tokio::io::Interest::READABLE)?,
            armed: Vec::new(),
        })
    }

    /// Watches each root (or the nearest directory above a missing one) and each directory
    /// in it, from now on.
    fn arm(&mut self, roots: &[PathBuf]) -> std::io::Result<()> {
        use rustix::fs::inotify::{self, WatchFlags};
        for wd in self.armed.drain(..) {
            let _ = inotify::remove_watch(self.fd.get_ref(), wd);
        }
        let flags = WatchFlags::CREATE
            | WatchFlags::DELETE
            | WatchFlags::MOVED_FROM
            | WatchFlags::MOVED_TO
            | WatchFlags::CLOSE_WRITE
            | WatchFlags::MODIFY
            | WatchFlags::ATTRIB
            | WatchFlags::DELETE_SELF
            | WatchFlags::MOVE_SELF;
        let mut paths = Vec::new();
        for root in roots {
            match std::fs::read_dir(root) {
                Ok(listing) => {
                    paths.push(root.clone());
                    paths.extend(
                        listing
                            .flatten()
                            .take(MAX_ENTRIES)
                            .map(|e| e.path())
                            .filter(|p| p.is_dir()),
                    );
                }
                Err(_) => paths.extend(
                    root.ancestors()
                        .skip(1)
                        .find(|a| a.is_dir())
                        .map(Path::to_owned),
                ),
            }
        }
        for path in paths {
            match inotify::add_watch(self.fd.get_ref(), &path, flags) {
                Ok(wd) => self.armed.push(wd),
                // Gone between the listing and the watch: the next event or recheck reads it.
                Err(rustix::io::Errno::NOENT | rustix::io::Errno::NOTDIR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Waits for events, then takes every one queued (what they say does not matter: the
    /// whole view is read again).
    async fn next(&mut self) {
        let mut buf = [0u8; 4096];
        loop {
            let Ok(mut ready) = self.fd.readable().await else {
                return std::future::pending().await;
            };
            let mut got = false;
            loop {
                match rustix::io::read(self.fd.get_ref(), &mut buf) {
                    Ok(0) => break,
                    Ok(_) => got = true,
                    Err(rustix::io::Errno::AGAIN) => {
                        ready.clear_ready();
                        break;
                    }
                    Err(_) => break,
                }
            }
            if got {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Until `registry`'s mirrors read `want`, waiting for the watcher's changes (20 s each
    /// at most: less than [`RECHECK`], so that only an event can make it).
    async fn until(hosts: &Hosts, registry: &str, want: &[&str]) {
        let want: Vec<String> = want.iter().map(|s| (*s).to_owned()).collect();
        loop {
            let mut changed = hosts.subscribe();
            if hosts.view().configured_mirrors(registry).as_ref() == Ok(&want) {
                return;
            }
            tokio::time::timeout(Duration::from_secs(20), changed.changed())
                .await
                .unwrap_or_else(|_| panic!("the watcher never read {want:?}"))
                .unwrap();
        }
    }

    /// A root created after the start, a hosts.toml written, rewritten in place and its
    /// directory removed: each is read by the watcher without a pull asking.
    #[tokio::test]
    async fn changes_are_read_when_they_happen() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("certs.d");
        let hosts = Arc::new(Hosts::new(vec![root.clone()]));
        assert_eq!(hosts.view().configured_mirrors("r.example"), Ok(Vec::new()));
        let stop = CancellationToken::new();
        let task = tokio::spawn(hosts.clone().watch(stop.clone()));
        tokio::task::yield_now().await;
        std::fs::create_dir_all(root.join("r.example")).unwrap();
        std::fs::write(
            root.join("r.example/hosts.toml"),
            "[host.\"https://m.example\"]\n",
        )
        .unwrap();
        until(&hosts, "r.example", &["m.example"]).await;
        std::fs::write(
            root.join("r.example/hosts.toml"),
            "[host.\"https://n.example\"]\n",
        )
        .unwrap();
        until(&hosts, "r.example", &["n.example"]).await;
        std::fs::remove_dir_all(root.join("r.example")).unwrap();
        until(&hosts, "r.example", &[]).await;
        stop.cancel();
        task.await.unwrap();
    }
}
