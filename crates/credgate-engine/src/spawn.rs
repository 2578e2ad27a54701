//! The system calls of a plugin run, in one place: `posix_spawn(3)` with pipes and a process
//! group, exit peeking and reaping, group kills, raw reads and writes, and the pidfds the
//! sweeper signals through.
//!
//! Why not `std::process::Command`: it copies the whole environment of the process into a map
//! and back into C strings on every spawn that sets one variable, and every run sets its sweep
//! marker. That copy is 10 to 13 µs a run on the reference VM, most of `miss`'s budget over a
//! bare spawn. A [`Program`] holds its arguments and environment as C strings made once, when
//! the engine is built; a spawn adds the marker and nothing else. The child gets what std would
//! give it: pipes on 0, 1 and 2 (every other descriptor of ours is close-on-exec), an empty
//! signal mask, default `SIGPIPE`, and a process group of its own.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::ExitStatus;
use std::time::Duration;

/// An executable with its arguments and environment, ready to spawn.
pub(crate) struct Program {
    path: CString,
    argv: Vec<CString>,
    env: Vec<CString>,
}

impl Program {
    /// The process's environment now, minus `omit`, with `env` added (it wins on a clash).
    /// Fails on a NUL byte in the path, an argument or a variable.
    pub(crate) fn new(
        path: &Path,
        args: &[String],
        env: &[(String, String)],
        omit: &str,
    ) -> io::Result<Program> {
        let path = c_string(path.as_os_str().as_bytes())?;
        let mut argv = Vec::with_capacity(args.len() + 1);
        argv.push(path.clone());
        for arg in args {
            argv.push(c_string(arg.as_bytes())?);
        }
        let own =
            |key: &[u8]| key == omit.as_bytes() || env.iter().any(|(k, _)| k.as_bytes() == key);
        let mut vars = Vec::new();
        for (key, value) in std::env::vars_os() {
            if !own(key.as_bytes()) {
                vars.push(c_string(
                    &[key.as_bytes(), b"=", value.as_bytes()].concat(),
                )?);
            }
        }
        for (key, value) in env {
            vars.push(c_string(format!("{key}={value}").as_bytes())?);
        }
        Ok(Program {
            path,
            argv,
            env: vars,
        })
    }
}

fn c_string(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "a path, argument or environment variable holds a NUL byte",
        )
    })
}

/// A started plugin: its pid (also its process group) and our ends of its pipes, all
/// close-on-exec and blocking until [`set_nonblocking`]: a run that writes a small request
/// into the empty stdin pipe, or reads stdout and stderr after `poll(2)`, needs no system
/// call for it.
/// The caller reaps it.
pub(crate) struct Child {
    pub pid: i32,
    pub stdin: OwnedFd,
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
}

/// Starts `program` with `extra` (`KEY=value`) added to its environment.
pub(crate) fn spawn(program: &Program, extra: &CStr) -> io::Result<Child> {
    let (stdin_child, stdin) = pipe()?;
    let (stdout, stdout_child) = pipe()?;
    let (stderr, stderr_child) = pipe()?;
    let mut argv: Vec<*mut libc::c_char> =
        program.argv.iter().map(|a| a.as_ptr().cast_mut()).collect();
    argv.push(std::ptr::null_mut());
    let mut envp: Vec<*mut libc::c_char> = Vec::with_capacity(program.env.len() + 2);
    envp.extend(program.env.iter().map(|v| v.as_ptr().cast_mut()));
    envp.push(extra.as_ptr().cast_mut());
    envp.push(std::ptr::null_mut());
    let mut actions = FileActions::new()?;
    // Our pipe descriptors are above 2 (the process's 0, 1 and 2 are open), so no dup2 below
    // overwrites one that a later dup2 reads.
    actions.dup2(&stdin_child, 0)?;
    actions.dup2(&stdout_child, 1)?;
    actions.dup2(&stderr_child, 2)?;
    let attrs = Attrs::new()?;
    let mut pid: libc::pid_t = 0;
    // SAFETY: every pointer is valid for the call: the path and the NUL-terminated argv and
    // envp arrays point at C strings owned by `program` and `extra`, which outlive it, and the
    // file actions and attributes were initialised above and are destroyed after.
    let rc = unsafe {
        libc::posix_spawn(
            &mut pid,
            program.path.as_ptr(),
            &actions.0,
            &attrs.0,
            argv.as_ptr(),
            envp.as_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(Child {
        pid,
        stdin,
        stdout,
        stderr,
    })
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

    fn dup2(&mut self, fd: &OwnedFd, to: RawFd) -> io::Result<()> {
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

/// A pipe, (read end, write end), both close-on-exec.
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2(2) writes two descriptors into the array we pass.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors are new and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Makes `fd` non-blocking.
pub(crate) fn set_nonblocking(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: fcntl(2) on a descriptor we own; pipes carry no other status flag we set.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// read(2) of up to `max` bytes appended to `buf`.
pub(crate) fn read_into(fd: &OwnedFd, buf: &mut Vec<u8>, max: usize) -> io::Result<usize> {
    buf.reserve(max);
    let spare = buf.spare_capacity_mut();
    // SAFETY: the spare capacity is valid for writes of its length, which read(2) does not
    // exceed.
    let n = unsafe {
        libc::read(
            fd.as_raw_fd(),
            spare.as_mut_ptr().cast(),
            spare.len().min(max),
        )
    };
    let n = usize::try_from(n).map_err(|_| io::Error::last_os_error())?;
    // SAFETY: read(2) initialised the first n bytes of the spare capacity.
    unsafe { buf.set_len(buf.len() + n) };
    Ok(n)
}

/// write(2) from `buf`.
pub(crate) fn write(fd: &OwnedFd, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: the buffer is valid for reads of its length.
    let n = unsafe { libc::write(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// poll(2) for input on up to two descriptors for at most `timeout` (rounded up to a
/// millisecond); which of them are readable or hung up. An interrupted wait reports none.
pub(crate) fn poll_input(fds: [Option<&OwnedFd>; 2], timeout: Duration) -> io::Result<[bool; 2]> {
    // A negative descriptor is ignored by poll(2).
    let mut set = fds.map(|fd| libc::pollfd {
        fd: fd.map_or(-1, AsRawFd::as_raw_fd),
        events: libc::POLLIN,
        revents: 0,
    });
    let ms = libc::c_int::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(libc::c_int::MAX);
    // SAFETY: poll(2) reads and writes the array of pollfd we pass, of the length we pass.
    if unsafe { libc::poll(set.as_mut_ptr(), set.len() as libc::nfds_t, ms) } < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted {
            Ok([false; 2])
        } else {
            Err(e)
        };
    }
    Ok(set.map(|p| p.revents != 0))
}

/// A pidfd for `pid`, to signal it without the risk of a recycled pid.
pub(crate) fn pidfd(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the descriptor is new and owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// What `waitid(2)` says of a child without reaping it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Peek {
    Running,
    /// Exited, with its status; `None` if it is gone already (reaped by someone else).
    Exited(Option<ExitStatus>),
}

impl Peek {
    pub(crate) fn exited(self) -> bool {
        matches!(self, Peek::Exited(_))
    }
}

/// Whether our child `pid` has exited, and how, without reaping it: while it is a zombie its
/// pid, and so its process group id, cannot be reused, so the group can still be signalled
/// safely. Reaping can then be left to the sweeper, off the run's path: it costs more than the
/// peek (several µs of the kernel tearing the process down).
pub(crate) fn peek(pid: i32) -> Peek {
    // SAFETY: an all-zero siginfo is a valid value of the plain C struct.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid(2) fills the siginfo we pass; WNOWAIT leaves the child as it is.
    let rc = unsafe {
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    if rc < 0 {
        return Peek::Exited(None);
    }
    // SAFETY: si_pid and si_status are set by waitid when it reports a child (si_pid is zero
    // otherwise).
    let (reported, status) = unsafe { (info.si_pid(), info.si_status()) };
    if reported == 0 {
        return Peek::Running;
    }
    // The wait status the kernel would have given waitpid(2).
    let raw = match info.si_code {
        libc::CLD_EXITED => (status & 0xff) << 8,
        libc::CLD_KILLED => status & 0x7f,
        libc::CLD_DUMPED => (status & 0x7f) | 0x80,
        _ => return Peek::Exited(None),
    };
    Peek::Exited(Some(ExitStatus::from_raw(raw)))
}

/// Reaps our child `pid` if it has exited. `Ok(None)`: still running.
pub(crate) fn reap(pid: i32) -> io::Result<Option<ExitStatus>> {
    let mut status = 0;
    // SAFETY: waitpid(2) writes the status into the integer we pass.
    match unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } {
        0 => Ok(None),
        n if n > 0 => Ok(Some(ExitStatus::from_raw(status))),
        _ => Err(io::Error::last_os_error()),
    }
}

/// SIGKILL to every process of group `pgid`.
pub(crate) fn kill_group(pgid: i32) {
    // SAFETY: kill(2) with a negative pid signals a process group; it touches no memory.
    unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    }
}

/// SIGKILL through a pidfd, so a recycled pid is never signalled; whether it was sent.
pub(crate) fn kill_pidfd(fd: &OwnedFd) -> bool {
    // SAFETY: pidfd_send_signal(2) on a descriptor we own, with no siginfo.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    rc == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The status read without reaping is the one reaping gives, for exits and signals.
    #[test]
    fn exit_status_without_reaping_is_the_reaped_status() {
        for (script, shown) in [
            ("exit 0", "exit status: 0"),
            ("exit 3", "exit status: 3"),
            ("kill -TERM $$", "signal: 15 (SIGTERM)"),
            ("kill -KILL $$", "signal: 9 (SIGKILL)"),
        ] {
            let program =
                Program::new(Path::new("/bin/sh"), &["-c".into(), script.into()], &[], "").unwrap();
            let child = spawn(&program, c"CREDGATE_TEST=1").unwrap();
            let peeked = loop {
                if let Peek::Exited(Some(s)) = peek(child.pid) {
                    break s;
                }
                std::thread::sleep(Duration::from_millis(1));
            };
            assert_eq!(peeked.to_string(), shown, "{script}");
            // Still a zombie: peeking again gives the same, and reaping agrees.
            assert_eq!(peek(child.pid), Peek::Exited(Some(peeked)));
            assert_eq!(reap(child.pid).unwrap(), Some(peeked), "{script}");
            assert_eq!(peek(child.pid), Peek::Exited(None), "reaped: gone");
        }
    }
}
