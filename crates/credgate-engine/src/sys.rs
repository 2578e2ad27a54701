//! The workspace's only `unsafe` code: the C library calls that have no safe form in rustix or
//! std. Every other crate and module denies `unsafe_code` (`[workspace.lints]`).
//!
//! - `posix_spawn`: a plugin run's spawn (see `spawn` for why not `std::process::Command`);
//! - `register`: a descriptor on tokio's reactor;
//! - [`group_id`]: a group's id by name, through NSS (`getgrnam_r`);
//! - [`default_sigpipe`] and [`limit_malloc_arenas`]: process settings made in `main`.
#![allow(unsafe_code)]

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// Starts `path` with `argv` and `env` plus `extra` (`KEY=value`), `stdio` on its descriptors
/// 0, 1 and 2, an empty signal mask, default `SIGPIPE` and a process group of its own; its pid.
pub(crate) fn posix_spawn(
    path: &CStr,
    argv: &[CString],
    env: &[CString],
    extra: &CStr,
    stdio: [&OwnedFd; 3],
) -> io::Result<i32> {
    let mut argv: Vec<*mut libc::c_char> = argv.iter().map(|a| a.as_ptr().cast_mut()).collect();
    argv.push(std::ptr::null_mut());
    let mut envp: Vec<*mut libc::c_char> = Vec::with_capacity(env.len() + 2);
    envp.extend(env.iter().map(|v| v.as_ptr().cast_mut()));
    envp.push(extra.as_ptr().cast_mut());
    envp.push(std::ptr::null_mut());
    let mut actions = FileActions::new()?;
    // The pipe descriptors are above 2 (the process's 0, 1 and 2 are open), so no dup2 below
    // overwrites one that a later dup2 reads.
    for (to, fd) in stdio.into_iter().enumerate() {
        actions.dup2(fd, to as libc::c_int)?;
    }
    let attrs = Attrs::new()?;
    let mut pid: libc::pid_t = 0;
    // SAFETY: every pointer is valid for the call: the path and the NUL-terminated argv and
    // envp arrays point at C strings the caller owns, which outlive it, and the file actions
    // and attributes were initialised above and are destroyed after.
    let rc = unsafe {
        libc::posix_spawn(
            &mut pid,
            path.as_ptr(),
            &actions.0,
            &attrs.0,
            argv.as_ptr(),
            envp.as_ptr(),
        )
    };
    check(rc)?;
    Ok(pid)
}

struct FileActions(libc::posix_spawn_file_actions_t);

impl FileActions {
    fn new() -> io::Result<FileActions> {
        // SAFETY: an all-zero value is a valid place for posix_spawn_file_actions_init to fill.
        let mut actions = FileActions(unsafe { std::mem::zeroed() });
        // SAFETY: initialising the value we own; it is destroyed once, in Drop.
        check(unsafe { libc::posix_spawn_file_actions_init(&mut actions.0) })?;
        Ok(actions)
    }

    fn dup2(&mut self, fd: &OwnedFd, to: libc::c_int) -> io::Result<()> {
        // SAFETY: the actions were initialised; glibc records the two numbers in memory it
        // allocated and points to from the value, which holds no pointer into itself, so the
        // value may move between init and destroy.
        check(unsafe { libc::posix_spawn_file_actions_adddup2(&mut self.0, fd.as_raw_fd(), to) })
    }
}

impl Drop for FileActions {
    fn drop(&mut self) {
        // SAFETY: destroying the actions initialised in new(), once.
        unsafe {
            libc::posix_spawn_file_actions_destroy(&mut self.0);
        }
    }
}

struct Attrs(libc::posix_spawnattr_t);

impl Attrs {
    /// Empty signal mask, default SIGPIPE (Rust ignores it), a new process group.
    fn new() -> io::Result<Attrs> {
        // SAFETY: an all-zero value is a valid place for posix_spawnattr_init to fill; the
        // sigset calls fill a local set; every call gets pointers to values we own.
        unsafe {
            let mut attrs = Attrs(std::mem::zeroed());
            check(libc::posix_spawnattr_init(&mut attrs.0))?;
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            check(libc::posix_spawnattr_setsigmask(&mut attrs.0, &set))?;
            libc::sigaddset(&mut set, libc::SIGPIPE);
            check(libc::posix_spawnattr_setsigdefault(&mut attrs.0, &set))?;
            check(libc::posix_spawnattr_setpgroup(&mut attrs.0, 0))?;
            let flags = libc::POSIX_SPAWN_SETSIGMASK
                | libc::POSIX_SPAWN_SETSIGDEF
                | libc::POSIX_SPAWN_SETPGROUP;
            check(libc::posix_spawnattr_setflags(
                &mut attrs.0,
                flags as libc::c_short,
            ))?;
            Ok(attrs)
        }
    }
}

impl Drop for Attrs {
    fn drop(&mut self) {
        // SAFETY: destroying the attributes initialised in new(), once.
        unsafe {
            libc::posix_spawnattr_destroy(&mut self.0);
        }
    }
}

/// posix_spawn's functions return an error number instead of setting errno.
fn check(rc: libc::c_int) -> io::Result<()> {
    match rc {
        0 => Ok(()),
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

/// `fd` (non-blocking) registered with the runtime's reactor.
pub fn register(fd: OwnedFd, interest: Interest) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an OwnedFd is an open descriptor that stays the same until it is dropped, and
    // only the AsyncFd that now owns it can drop it.
    Ok(unsafe { AsyncFd::register_with_interest(fd, interest) }?)
}

/// The id of the group `name`, through the system's group database (NSS, so LDAP groups
/// too); `None` when there is no such group.
pub fn group_id(name: &str) -> Option<u32> {
    let c_name = CString::new(name.as_bytes()).ok()?;
    // SAFETY: an all-zero `group` is a valid value of the plain C struct for getgrnam_r to fill.
    let mut group: libc::group = unsafe { std::mem::zeroed() };
    let mut buf = vec![0u8; 16 * 1024];
    let mut result: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call: a NUL-terminated name, a group struct, a
    // buffer with its true length and the out pointer; getgrnam_r is the thread-safe variant.
    let rc = unsafe {
        libc::getgrnam_r(
            c_name.as_ptr(),
            &mut group,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut result,
        )
    };
    (rc == 0 && !result.is_null()).then_some(group.gr_gid)
}

/// Restores the default disposition of `SIGPIPE` (Rust's runtime ignores it), so a CLI piped
/// into `head` ends quietly when the pipe closes, like other Unix tools. For `main`, before
/// any thread starts.
pub fn default_sigpipe() {
    // SAFETY: signal(2) with SIG_DFL installs no handler; called before other threads exist.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// glibc gives each new thread its own malloc arena (up to eight per core), and memory freed in
/// one arena is not reused by threads of another. Under connection churn beside plugin runs
/// (which start and retire threads) the soak's adversarial phase measured RSS climbing without
/// a plateau with the default, and the live set alone with one arena; two keep allocation from
/// contending while bounding the spread.
///
/// Large blocks (a message read whole, up to a few MiB) are also kept out of the arenas: glibc
/// raises its mmap threshold each time an mmapped block is freed, after which blocks of that
/// size come from an arena and stay in the resident set once freed (the CRI proxy measured
/// 14 MB left behind by callers that had gone). A fixed threshold of 128 KiB keeps every
/// larger block mmapped, so that freeing it returns it to the system. For `main`, before any
/// thread starts.
pub fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: called before any other thread exists; mallopt only changes allocator
        // parameters, and these values are valid for M_ARENA_MAX and M_MMAP_THRESHOLD.
        unsafe {
            let _ = libc::mallopt(libc::M_ARENA_MAX, 2);
            let _ = libc::mallopt(libc::M_MMAP_THRESHOLD, 128 << 10);
        }
    }
}
