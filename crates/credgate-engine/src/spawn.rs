//! The system calls of a plugin run, in one place: `posix_spawn(3)` with pipes and a process
//! group (through [`crate::sys`], the one module with `unsafe`), exit peeking and reaping,
//! group kills, raw reads and writes, and the pidfds the sweeper signals through (through
//! rustix).
//!
//! Why not `std::process::Command`: it copies the whole environment of the process into a map
//! and back into C strings on every spawn that sets one variable, and every run sets its sweep
//! marker. That copy was most of `miss`'s cost over a bare spawn (docs/benchmark-notes.md).
//! A [`Program`] holds its arguments and environment as C strings made once, when
//! the engine is built; a spawn adds the marker and nothing else. The child gets what std would
//! give it: pipes on 0, 1 and 2 (every other descriptor of ours is close-on-exec), an empty
//! signal mask, default `SIGPIPE`, and a process group of its own.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::ExitStatus;
use std::time::Duration;

use rustix::process::{Pid, Signal};

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
    let pid = crate::sys::posix_spawn(
        &program.path,
        &program.argv,
        &program.env,
        extra,
        [&stdin_child, &stdout_child, &stderr_child],
    )?;
    lower_priority(pid);
    Ok(Child {
        pid,
        stdin,
        stdout,
        stderr,
    })
}

/// How much nicer than the agent its plugins run: what plugins cost in CPU (a tenant can make
/// them run often, through lookups of ever new keys or tracked refs) must not take the CPU
/// the agent needs to answer others. With CFS weights, ten plugins at +10 weigh about as much
/// as one thread of the agent.
pub const PLUGIN_NICENESS: i32 = 10;

/// Makes the plugin's process group (it leads its own, so every process it has forked yet
/// and every later one, which inherits it) [`PLUGIN_NICENESS`] nicer than the agent. Best
/// effort: a failure leaves the plugin at the agent's priority. `posix_spawn` has no attribute
/// for niceness, so this runs after the exec: what a plugin does before it reads its request
/// (written after this returns) may run at the agent's priority.
fn lower_priority(pid: i32) {
    let Some(group) = rustix::process::Pid::from_raw(pid) else {
        return;
    };
    let own = rustix::process::getpriority_process(None).unwrap_or(0);
    let _ = rustix::process::setpriority_pgrp(Some(group), (own + PLUGIN_NICENESS).min(19));
}

/// A pipe, (read end, write end), both close-on-exec.
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    Ok(rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?)
}

/// Makes `fd` non-blocking.
pub(crate) fn set_nonblocking(fd: &OwnedFd) -> io::Result<()> {
    // Pipes carry no other status flag we set.
    Ok(rustix::fs::fcntl_setfl(fd, rustix::fs::OFlags::NONBLOCK)?)
}

/// read(2) of up to `max` bytes appended to `buf`.
pub(crate) fn read_into(fd: &OwnedFd, buf: &mut Vec<u8>, max: usize) -> io::Result<usize> {
    buf.reserve(max);
    Ok(rustix::io::read(fd, rustix::buffer::spare_capacity(buf))?)
}

/// write(2) from `buf`.
pub(crate) fn write(fd: &OwnedFd, buf: &[u8]) -> io::Result<usize> {
    Ok(rustix::io::write(fd, buf)?)
}

/// poll(2) for input on up to two descriptors for at most `timeout`; which of them are
/// readable or hung up. An interrupted wait reports none.
pub(crate) fn poll_input(fds: [Option<&OwnedFd>; 2], timeout: Duration) -> io::Result<[bool; 2]> {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let mut set: Vec<PollFd<'_>> = fds
        .iter()
        .flatten()
        .map(|fd| PollFd::new(*fd, PollFlags::IN))
        .collect();
    let timeout = Timespec {
        tv_sec: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    match rustix::event::poll(&mut set, Some(&timeout)) {
        Ok(_) => {}
        Err(rustix::io::Errno::INTR) => return Ok([false; 2]),
        Err(e) => return Err(e.into()),
    }
    let mut ready = set.iter().map(|p| !p.revents().is_empty());
    Ok(fds.map(|fd| fd.is_some() && ready.next().unwrap_or(false)))
}

/// A pidfd for `pid`, to signal it without the risk of a recycled pid.
pub(crate) fn pidfd(pid: i32) -> io::Result<OwnedFd> {
    let pid = Pid::from_raw(pid).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    Ok(rustix::process::pidfd_open(
        pid,
        rustix::process::PidfdFlags::empty(),
    )?)
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
/// peek (the kernel tearing the process down).
pub(crate) fn peek(pid: i32) -> Peek {
    use rustix::process::{WaitId, WaitIdOptions};
    let Some(pid) = Pid::from_raw(pid) else {
        return Peek::Exited(None);
    };
    let options = WaitIdOptions::EXITED | WaitIdOptions::NOHANG | WaitIdOptions::NOWAIT;
    let status = match rustix::process::waitid(WaitId::Pid(pid), options) {
        Ok(Some(status)) => status,
        Ok(None) => return Peek::Running,
        Err(_) => return Peek::Exited(None),
    };
    // The wait status the kernel would have given waitpid(2).
    let raw = if let Some(code) = status.exit_status().filter(|_| status.exited()) {
        (code & 0xff) << 8
    } else if let Some(signal) = status.terminating_signal() {
        (signal & 0x7f) | if status.dumped() { 0x80 } else { 0 }
    } else {
        return Peek::Exited(None);
    };
    Peek::Exited(Some(ExitStatus::from_raw(raw)))
}

/// Reaps our child `pid` if it has exited. `Ok(None)`: still running.
pub(crate) fn reap(pid: i32) -> io::Result<Option<ExitStatus>> {
    let pid = Pid::from_raw(pid).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    let reaped = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::NOHANG)?;
    Ok(reaped.map(|(_, status)| ExitStatus::from_raw(status.as_raw())))
}

/// SIGKILL to every process of group `pgid`.
pub(crate) fn kill_group(pgid: i32) {
    if let Some(pgid) = Pid::from_raw(pgid) {
        let _ = rustix::process::kill_process_group(pgid, Signal::KILL);
    }
}

/// SIGKILL through a pidfd, so a recycled pid is never signalled; whether it was sent.
pub(crate) fn kill_pidfd(fd: &OwnedFd) -> bool {
    rustix::process::pidfd_send_signal(fd, Signal::KILL).is_ok()
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

    /// A plugin and what it forks after it has read its request run nicer than the agent.
    #[test]
    fn plugins_and_their_children_run_nicer_than_the_agent() {
        use std::io::{Read as _, Write as _};
        // Once it has read its request, the shell forks `cut`, which reads its own niceness
        // (field 19 of its stat). Without the read, the shell could fork and `cut` read its
        // stat before `spawn` renices the group (seen once in 300 runs).
        let program = Program::new(
            Path::new("/bin/sh"),
            &[
                "-c".into(),
                "read request; cut -d' ' -f19 /proc/self/stat; exit 0".into(),
            ],
            &[],
            "",
        )
        .unwrap();
        let child = spawn(&program, c"CREDGATE_TEST=1").unwrap();
        std::fs::File::from(child.stdin).write_all(b"{}\n").unwrap();
        let mut out = String::new();
        std::fs::File::from(child.stdout)
            .read_to_string(&mut out)
            .unwrap();
        while reap(child.pid).unwrap().is_none() {
            std::thread::sleep(Duration::from_millis(1));
        }
        let own = rustix::process::getpriority_process(None).unwrap();
        assert_eq!(
            out.trim().parse::<i32>().unwrap(),
            (own + PLUGIN_NICENESS).min(19),
            "{out}"
        );
    }
}
