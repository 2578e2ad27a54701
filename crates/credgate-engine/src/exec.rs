//! Running plugin executables: one request on stdin, capped stdout and stderr, a timeout that
//! kills the plugin's whole process group, and a bounded drain when a child of the plugin keeps
//! its pipes open after the plugin exited. Processes that left the group are killed by the
//! [`sweep`] thread.

use std::ffi::CString;
use std::future::Future;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::pin::{pin, Pin};
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::spawn::{self, Peek, Program};
use crate::sweep::{self, Sweeper};
use crate::watchdog::{Watch, Watchdog};

/// A boxed future, for object-safe traits.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What to execute: a plugin binary, its arguments, and the environment it gets (the
/// process's own, read when the command is made, plus the provider's `env`, which wins on a
/// clash).
#[derive(Clone)]
pub struct PluginCommand {
    name: String,
    path: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    timeout: Duration,
    /// The same, as C strings for `posix_spawn`, made once. A NUL byte is an error that every
    /// run reports.
    program: Arc<io::Result<Program>>,
}

impl PluginCommand {
    pub fn new(
        name: String,
        path: PathBuf,
        args: Vec<String>,
        env: Vec<(String, String)>,
        timeout: Duration,
    ) -> PluginCommand {
        let program = Arc::new(Program::new(&path, &args, &env, sweep::MARKER_ENV));
        PluginCommand {
            name,
            path,
            args,
            env,
            timeout,
            program,
        }
    }

    /// The provider's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn args(&self) -> &[String] {
        &self.args
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

impl std::fmt::Debug for PluginCommand {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginCommand")
            .field("name", &self.name)
            .field("path", &self.path)
            .field("args", &self.args)
            .field("env", &self.env.iter().map(|(k, _)| k).collect::<Vec<_>>())
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// Size caps for a plugin's output.
#[derive(Debug, Clone, Copy)]
pub struct OutputLimits {
    /// Over this, stdout is an error (a response is a few kilobytes).
    pub stdout: usize,
    /// stderr beyond this is dropped; only its tail is kept for diagnostics.
    pub stderr: usize,
    /// How long to wait for pipes to close after the plugin exited.
    pub drain_grace: Duration,
}

impl Default for OutputLimits {
    fn default() -> Self {
        OutputLimits {
            stdout: 1 << 20,
            stderr: 4096,
            drain_grace: Duration::from_millis(500),
        }
    }
}

/// Why a run failed. Never carries stdout.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("plugin {plugin}: cannot start {path}")]
    Spawn {
        plugin: String,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("plugin {plugin}: timed out after {after:?}; its process group was killed")]
    Timeout { plugin: String, after: Duration },
    /// The stderr tail is kept for the debug log only: it is the plugin's free text and is
    /// never part of the message, which reaches API callers.
    #[error("plugin {plugin}: exited with {status}")]
    NonZeroExit {
        plugin: String,
        status: String,
        stderr: String,
    },
    #[error("plugin {plugin}: {stream} exceeded {cap} bytes; its process group was killed")]
    OutputTooLarge {
        plugin: String,
        stream: &'static str,
        cap: usize,
    },
    #[error("plugin {plugin}: i/o with the plugin failed")]
    Io {
        plugin: String,
        #[source]
        source: io::Error,
    },
}

/// What a runner hands its caller when the output may be whole before the plugin has exited.
pub type Early<'a> = &'a mut (dyn FnMut(&[u8]) + Send);

/// Runs a plugin with a request and returns its stdout. Engine tests inject fakes.
pub trait PluginRunner: Send + Sync + 'static {
    fn run<'a>(
        &'a self,
        command: &'a PluginCommand,
        stdin: Vec<u8>,
    ) -> BoxFuture<'a, Result<Vec<u8>, RunError>>;

    /// [`run`](Self::run), calling `early` with the output read so far when it may be the whole
    /// answer and the plugin has not exited yet, so that the caller can decode it meanwhile.
    /// What `early` computes holds only for the bytes it saw: the output `run_early` returns
    /// may be longer, and the exit status still decides. The default never calls `early`.
    fn run_early<'a>(
        &'a self,
        command: &'a PluginCommand,
        stdin: Vec<u8>,
        early: Early<'a>,
    ) -> BoxFuture<'a, Result<Vec<u8>, RunError>> {
        let _ = early;
        self.run(command, stdin)
    }
}

/// Runs real executables. Owns the two threads runs need (the watchdog, which enforces
/// deadlines, and the sweeper, which reaps and kills what plugins leave behind): they start
/// with the first run that needs them and stop when the last clone of the runner is dropped,
/// so an engine that goes leaves no thread behind.
#[derive(Clone, Default)]
pub struct ExecRunner {
    limits: OutputLimits,
    supervisor: Arc<Supervisor>,
}

/// The threads a runner owns.
#[derive(Default)]
struct Supervisor {
    watchdog: Watchdog,
    sweeper: Sweeper,
}

impl ExecRunner {
    pub fn new(limits: OutputLimits) -> ExecRunner {
        ExecRunner {
            limits,
            supervisor: Arc::default(),
        }
    }
}

impl std::fmt::Debug for ExecRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecRunner")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl PluginRunner for ExecRunner {
    fn run<'a>(
        &'a self,
        command: &'a PluginCommand,
        stdin: Vec<u8>,
    ) -> BoxFuture<'a, Result<Vec<u8>, RunError>> {
        Box::pin(exec(&self.supervisor, command, stdin, self.limits, None))
    }

    fn run_early<'a>(
        &'a self,
        command: &'a PluginCommand,
        stdin: Vec<u8>,
        early: Early<'a>,
    ) -> BoxFuture<'a, Result<Vec<u8>, RunError>> {
        Box::pin(exec(
            &self.supervisor,
            command,
            stdin,
            self.limits,
            Some(early),
        ))
    }
}

/// What an empty pipe takes in one write whatever its capacity (POSIX `PIPE_BUF` on Linux).
const PIPE_BUF: usize = 4096;

/// Output up to this size is offered to the caller early (see [`PluginRunner::run_early`]);
/// an answer is a few hundred bytes.
const EARLY_MAX: usize = 64 << 10;
/// At most this many early offers a run: a plugin that writes its JSON in pieces ending in
/// `}` costs a few decodes, never one per piece.
const EARLY_TIMES: u8 = 4;

/// Offers `out` to `early` if it may be a whole JSON object: it ends in `}`.
fn offer(early: &mut Option<Early<'_>>, offers: &mut u8, out: &[u8]) {
    let Some(early) = early else { return };
    let whole = out.len() <= EARLY_MAX && out.trim_ascii_end().ends_with(b"}");
    if whole && *offers < EARLY_TIMES {
        *offers += 1;
        early(out);
    }
}

/// How long a run whose pipes have closed spins for its plugin's exit, which follows within
/// microseconds unless the plugin closed its pipes and runs on; the watchdog tells then.
const EXIT_SPIN: Duration = Duration::from_micros(200);

/// A started plugin until it is reaped, or left to the sweeper to reap. Dropped before it
/// finished (timeout, oversized output, a cancelled run), it kills the plugin's process group
/// and leaves the reaping to the sweeper if the kill has not taken effect yet; either way the
/// run's marker goes to the sweeper for processes that left the group.
struct Run<'a> {
    sweeper: &'a Sweeper,
    pid: i32,
    /// The watchdog's registration, made when the run leaves the inline wait (a plugin that
    /// answers within it never needs one: the inline wait is bounded and ends before the
    /// deadline).
    watch: Option<Watch>,
    /// Reaped, or (a zombie whose exit status is known) handed to the sweeper to reap.
    settled: bool,
    /// The zombie the sweeper is to reap.
    zombie: Option<i32>,
    marker: Option<String>,
}

impl Run<'_> {
    /// From here on the watchdog leaves the plugin alone.
    fn unwatch(&self) {
        if let Some(w) = &self.watch {
            w.done();
        }
    }

    /// The plugin has exited and its pipes are closed (or drained): kill what it left running
    /// in its group while it is still a zombie, so that its group id cannot have been reused.
    /// Its exit status (`peeked` already, or peeked now) is read without reaping it, and the
    /// zombie goes to the sweeper to reap: the answer does not wait for the kernel tearing the
    /// process down. If the status cannot be read that way, the plugin is
    /// reaped here.
    fn finish(&mut self, peeked: Peek) -> io::Result<ExitStatus> {
        self.unwatch();
        spawn::kill_group(self.pid);
        let known = match peeked {
            Peek::Exited(Some(status)) => Some(status),
            _ => match spawn::peek(self.pid) {
                Peek::Exited(status) => status,
                Peek::Running => None,
            },
        };
        if let Some(status) = known {
            self.settled = true;
            self.zombie = Some(self.pid);
            return Ok(status);
        }
        let status = spawn::reap(self.pid)?.ok_or_else(|| {
            io::Error::other("the plugin's exit was reported but it could not be reaped")
        })?;
        self.settled = true;
        Ok(status)
    }
}

impl Drop for Run<'_> {
    fn drop(&mut self) {
        let mut unreaped = self.zombie.take();
        if !self.settled {
            self.unwatch();
            spawn::kill_group(self.pid);
            if matches!(spawn::reap(self.pid), Ok(None)) {
                unreaped = Some(self.pid);
            }
        }
        if let Some(marker) = self.marker.take() {
            self.sweeper.finished(marker, unreaped);
        }
    }
}

/// Whether (and how) the plugin exits within [`EXIT_SPIN`].
fn exits_soon(pid: i32) -> Peek {
    let started = std::time::Instant::now();
    loop {
        let peeked = spawn::peek(pid);
        if peeked.exited() {
            return peeked;
        }
        if started.elapsed() >= EXIT_SPIN {
            return Peek::Running;
        }
        std::thread::yield_now();
    }
}

/// Bytes a read asks for: a usual answer in one.
const READ_CHUNK: usize = 8192;

enum Capped {
    Done,
    Overflow,
}

/// One output stream of a run: our end of its pipe until EOF, and what was read.
struct Stream {
    fd: Option<OwnedFd>,
    buf: Vec<u8>,
    /// Past this many bytes the run fails, unless `keep_tail`: then only the last `cap`
    /// bytes are kept.
    cap: usize,
    keep_tail: bool,
}

impl Stream {
    fn new(fd: OwnedFd, cap: usize, keep_tail: bool) -> Stream {
        Stream {
            fd: Some(fd),
            buf: Vec::new(),
            cap,
            keep_tail,
        }
    }

    fn done(&self) -> bool {
        self.fd.is_none()
    }

    /// One read(2) from `fd` into `buf`. `Ok(None)`: more may follow. Errors as read(2)'s,
    /// `WouldBlock` and `Interrupted` included.
    fn read(
        fd: &OwnedFd,
        buf: &mut Vec<u8>,
        cap: usize,
        keep_tail: bool,
    ) -> io::Result<Option<Capped>> {
        if spawn::read_into(fd, buf, READ_CHUNK)? == 0 {
            return Ok(Some(Capped::Done));
        }
        if buf.len() > cap {
            if !keep_tail {
                return Ok(Some(Capped::Overflow));
            }
            let excess = buf.len() - cap;
            buf.drain(..excess);
        }
        Ok(None)
    }

    /// Reads until EOF through the runtime's reactor; stops at `Overflow`.
    async fn read_async(&mut self) -> io::Result<Capped> {
        let Some(fd) = self.fd.take() else {
            return Ok(Capped::Done);
        };
        // Blocking until now: the inline wait reads only after poll(2) says so.
        spawn::set_nonblocking(&fd)?;
        let fd = crate::sys::register(fd, Interest::READABLE)?;
        loop {
            let mut ready = fd.readable().await?;
            let (buf, cap, keep_tail) = (&mut self.buf, self.cap, self.keep_tail);
            match ready.try_io(|fd| Self::read(fd.get_ref(), buf, cap, keep_tail)) {
                Ok(Ok(Some(capped))) => return Ok(capped),
                Ok(Ok(None)) => {}
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => {}
            }
        }
    }
}

/// How long a run on a multi-threaded runtime holds its thread waiting for the plugin before
/// it waits through the reactor instead (see [`wait_inline`]).
const INLINE_WAIT: Duration = Duration::from_millis(5);

/// Whether this thread may block: only on a multi-threaded runtime, where
/// `block_in_place` hands the worker's other tasks to another thread first.
fn may_block() -> bool {
    tokio::runtime::Handle::try_current()
        .is_ok_and(|rt| rt.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
}

/// Reads both streams with a blocking `poll(2)` on this thread for at most `budget`. A
/// plugin that answers within it costs no reactor registration and no task wake-up, which
/// is most of what a run costs over a bare spawn; one that takes longer is left to the
/// reactor, where what was read so far is kept. `Overflow` as the reactor's readers. Output
/// that may be whole is offered to `early` while the plugin is still exiting.
fn wait_inline(
    streams: [&mut Stream; 2],
    budget: Duration,
    mut early: Option<Early<'_>>,
) -> io::Result<Capped> {
    let deadline = std::time::Instant::now() + budget;
    let mut offers = 0;
    let [out, err] = streams;
    while !(out.done() && err.done()) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            break;
        }
        let ready = spawn::poll_input([out.fd.as_ref(), err.fd.as_ref()], left)?;
        for (i, (stream, ready)) in [&mut *out, &mut *err].into_iter().zip(ready).enumerate() {
            let Some(fd) = stream.fd.as_ref().filter(|_| ready) else {
                continue;
            };
            match Stream::read(fd, &mut stream.buf, stream.cap, stream.keep_tail) {
                Ok(Some(Capped::Done)) => stream.fd = None,
                Ok(Some(Capped::Overflow)) => return Ok(Capped::Overflow),
                Ok(None) if i == 0 => offer(&mut early, &mut offers, &stream.buf),
                Ok(None) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(Capped::Done)
}

/// Writes what the first write left of the request as the plugin reads, then closes stdin.
/// A plugin may exit without reading its request: a broken pipe is its business.
async fn write_rest(stdin: Option<AsyncFd<OwnedFd>>, mut rest: &[u8]) {
    let Some(fd) = stdin else { return };
    while !rest.is_empty() {
        let Ok(mut ready) = fd.writable().await else {
            return;
        };
        match ready.try_io(|fd| spawn::write(fd.get_ref(), rest)) {
            Ok(Ok(n)) => rest = &rest[n..],
            Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
            Ok(Err(_)) => return,
            Err(_would_block) => {}
        }
    }
}

/// Where the plugin is, as its run knows it.
#[derive(Debug, Clone, Copy)]
enum Plugin {
    /// Its pipes are open, or it has not been looked at since they closed.
    Running,
    /// Its pipes closed and it did not exit within [`EXIT_SPIN`]: it runs on, and the watchdog
    /// tells when it exits.
    Lingering,
    /// It exited; how, when that could be read.
    Exited(Peek),
}

impl Plugin {
    /// What a look at a plugin whose pipes have closed finds.
    fn after_close(pid: i32) -> Plugin {
        match exits_soon(pid) {
            Peek::Running => Plugin::Lingering,
            exited => Plugin::Exited(exited),
        }
    }
}

fn io_error(cmd: &PluginCommand) -> impl Fn(io::Error) -> RunError + '_ {
    move |source| RunError::Io {
        plugin: cmd.name.clone(),
        source,
    }
}

fn overflow(cmd: &PluginCommand, limits: OutputLimits) -> RunError {
    RunError::OutputTooLarge {
        plugin: cmd.name.clone(),
        stream: "stdout",
        cap: limits.stdout,
    }
}

/// A run in five stages: [`start`], [`send_request`], [`wait_here`] (on a multi-threaded
/// runtime, for a plugin that answers at once), [`wait_on_reactor`] (for one that does not),
/// [`finish`].
async fn exec(
    supervisor: &Supervisor,
    cmd: &PluginCommand,
    input: Vec<u8>,
    limits: OutputLimits,
    early: Option<Early<'_>>,
) -> Result<Vec<u8>, RunError> {
    let deadline = std::time::Instant::now() + cmd.timeout;
    let (mut run, child) = start(supervisor, cmd)?;
    let (written, stdin) = send_request(cmd, child.stdin, &input)?;
    let mut out = Stream::new(child.stdout, limits.stdout, false);
    let mut err = Stream::new(child.stderr, limits.stderr, true);
    let mut plugin = Plugin::Running;
    if stdin.is_none() && may_block() {
        plugin = wait_here(cmd, run.pid, deadline, limits, [&mut out, &mut err], early)?;
    }
    if !(matches!(plugin, Plugin::Exited(_)) && out.done() && err.done()) {
        let rest = &input[written..];
        let pipes = Pipes {
            stdin,
            rest,
            out: &mut out,
            err: &mut err,
        };
        plugin =
            wait_on_reactor(supervisor, cmd, &mut run, deadline, limits, pipes, plugin).await?;
    }
    finish(cmd, &mut run, plugin, out, &err)
}

/// Stage 1: spawns the plugin with its run's sweep marker.
fn start<'s>(
    supervisor: &'s Supervisor,
    cmd: &PluginCommand,
) -> Result<(Run<'s>, spawn::Child), RunError> {
    let spawned = match &*cmd.program {
        Ok(program) => {
            let marker = sweep::marker();
            let var = CString::new(format!("{}={marker}", sweep::MARKER_ENV))
                .expect("a marker has no NUL byte");
            spawn::spawn(program, &var).map(|child| (child, marker))
        }
        Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
    };
    let (child, marker) = spawned.map_err(|source| RunError::Spawn {
        plugin: cmd.name.clone(),
        path: cmd.path.clone(),
        source,
    })?;
    let run = Run {
        sweeper: &supervisor.sweeper,
        pid: child.pid,
        watch: None,
        settled: false,
        zombie: None,
        marker: Some(marker),
    };
    Ok((run, child))
}

/// Stage 2: writes the request. An empty pipe takes a usual request in one write, blocking or
/// not (up to PIPE_BUF bytes fit in any pipe); a larger one is written without blocking, and
/// stdin comes back on the reactor for the rest, written as the plugin reads it. How much was
/// written.
fn send_request(
    cmd: &PluginCommand,
    stdin: OwnedFd,
    input: &[u8],
) -> Result<(usize, Option<AsyncFd<OwnedFd>>), RunError> {
    if input.len() > PIPE_BUF {
        spawn::set_nonblocking(&stdin).map_err(io_error(cmd))?;
    }
    let written = match spawn::write(&stdin, input) {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
        Err(_) => input.len(),
    };
    if written < input.len() {
        let stdin = crate::sys::register(stdin, Interest::WRITABLE).map_err(io_error(cmd))?;
        return Ok((written, Some(stdin)));
    }
    Ok((written, None))
}

/// Stage 3: reads both pipes on this thread (in `block_in_place`) for at most [`INLINE_WAIT`],
/// never past the deadline (the watchdog, which enforces it, is not watching yet); if both
/// closed, looks whether the plugin exited.
fn wait_here(
    cmd: &PluginCommand,
    pid: i32,
    deadline: std::time::Instant,
    limits: OutputLimits,
    streams: [&mut Stream; 2],
    early: Option<Early<'_>>,
) -> Result<Plugin, RunError> {
    let budget = INLINE_WAIT.min(deadline.saturating_duration_since(std::time::Instant::now()));
    let [out, err] = streams;
    let waited = tokio::task::block_in_place(|| {
        let capped = wait_inline([&mut *out, &mut *err], budget, early)?;
        let plugin = if out.done() && err.done() {
            Plugin::after_close(pid)
        } else {
            Plugin::Running
        };
        Ok::<_, io::Error>((capped, plugin))
    });
    match waited.map_err(io_error(cmd))? {
        (Capped::Overflow, _) => Err(overflow(cmd, limits)),
        (Capped::Done, plugin) => Ok(plugin),
    }
}

/// A run's pipes while it waits on the reactor: stdin with what is left of the request, and
/// the two output streams.
struct Pipes<'a> {
    stdin: Option<AsyncFd<OwnedFd>>,
    rest: &'a [u8],
    out: &'a mut Stream,
    err: &'a mut Stream,
}

/// Stage 4: under the watchdog's eye, writes the rest of the request and reads both pipes
/// through the reactor until they close and the plugin has exited, or its deadline passes, or
/// a drain grace after its exit (escapees hold the pipes: what came before is the answer).
async fn wait_on_reactor(
    supervisor: &Supervisor,
    cmd: &PluginCommand,
    run: &mut Run<'_>,
    deadline: std::time::Instant,
    limits: OutputLimits,
    pipes: Pipes<'_>,
    mut plugin: Plugin,
) -> Result<Plugin, RunError> {
    let pid = run.pid;
    let watch: &Watch = run.watch.insert(
        supervisor
            .watchdog
            .watch(pid, deadline, limits.drain_grace)
            .map_err(io_error(cmd))?,
    );
    let mut in_done = pipes.stdin.is_none();
    let (mut out_done, mut err_done) = (pipes.out.done(), pipes.err.done());
    let mut in_fut = pin!(write_rest(pipes.stdin, pipes.rest));
    let mut out_fut = pin!(pipes.out.read_async());
    let mut err_fut = pin!(pipes.err.read_async());
    loop {
        let seen = watch.seen();
        if seen.timed_out {
            return Err(RunError::Timeout {
                plugin: cmd.name.clone(),
                after: cmd.timeout,
            });
        }
        if seen.drained {
            return Ok(plugin);
        }
        if out_done && err_done {
            match plugin {
                Plugin::Exited(_) => return Ok(plugin),
                _ if seen.exited => return Ok(plugin),
                Plugin::Running => {
                    plugin = Plugin::after_close(pid);
                    if let Plugin::Exited(_) = plugin {
                        return Ok(plugin);
                    }
                }
                // It closed its pipes but runs on: the watchdog tells.
                Plugin::Lingering => {}
            }
        }
        tokio::select! {
            r = &mut out_fut, if !out_done => match r {
                Ok(Capped::Done) => out_done = true,
                Ok(Capped::Overflow) => return Err(overflow(cmd, limits)),
                Err(source) => return Err(io_error(cmd)(source)),
            },
            _ = &mut err_fut, if !err_done => err_done = true,
            () = &mut in_fut, if !in_done => in_done = true,
            () = watch.news() => {}
        }
    }
}

/// Stage 5: the exit status (read without reaping when it can be, the zombie left to the
/// sweeper), then the output, or the failure with the stderr tail for the debug log.
fn finish(
    cmd: &PluginCommand,
    run: &mut Run<'_>,
    plugin: Plugin,
    out: Stream,
    err: &Stream,
) -> Result<Vec<u8>, RunError> {
    let peeked = match plugin {
        Plugin::Exited(peeked) => peeked,
        Plugin::Running | Plugin::Lingering => Peek::Running,
    };
    let status = run.finish(peeked).map_err(io_error(cmd))?;
    if !status.success() {
        return Err(RunError::NonZeroExit {
            plugin: cmd.name.clone(),
            status: status.to_string(),
            stderr: printable_tail(&err.buf),
        });
    }
    Ok(out.buf)
}

/// The stderr tail as one printable line.
fn printable_tail(err: &[u8]) -> String {
    let text = String::from_utf8_lossy(err);
    let line: String = text
        .trim()
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    const MAX: usize = 512;
    match line.char_indices().rev().nth(MAX) {
        Some((i, _)) => format!("...{}", &line[i..]),
        None => line,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::time::Instant as StdInstant;

    fn plugin(dir: &Path, body: &str, timeout: Duration) -> PluginCommand {
        let path = dir.join("p");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        PluginCommand::new("p".into(), path, vec![], vec![], timeout)
    }

    async fn run(cmd: &PluginCommand, input: &[u8]) -> Result<Vec<u8>, RunError> {
        ExecRunner::default().run(cmd, input.to_vec()).await
    }

    /// Requests that fit an empty pipe (written blocking), and larger ones (written without
    /// blocking as the plugin reads), arrive whole.
    async fn requests_of_every_size_are_written_whole() {
        let dir = tempfile::tempdir().unwrap();
        let cmd = plugin(dir.path(), "sleep 0.01; wc -c", Duration::from_secs(30));
        for len in [0, 1, PIPE_BUF, PIPE_BUF + 1, 3 << 20] {
            let input = vec![b'x'; len];
            let out = run(&cmd, &input).await.unwrap();
            assert_eq!(String::from_utf8(out).unwrap().trim(), len.to_string());
        }
    }

    on_both_runtimes!(
        requests_of_every_size_are_written_whole,
        an_answer_split_across_the_inline_wait_is_read_whole,
        a_plugin_that_closes_its_pipes_and_runs_on_is_waited_for,
        a_hang_behind_an_escapee_holding_the_pipes_times_out,
    );

    async fn an_answer_split_across_the_inline_wait_is_read_whole() {
        let dir = tempfile::tempdir().unwrap();
        // Half the answer within the inline wait, the rest well after it.
        let cmd = plugin(
            dir.path(),
            "cat >/dev/null; printf first; echo err1 >&2; sleep 0.1; printf -- '-second'; echo err2 >&2",
            Duration::from_secs(30),
        );
        assert!(INLINE_WAIT < Duration::from_millis(100));
        assert_eq!(run(&cmd, b"{}").await.unwrap(), b"first-second");
        let failing = plugin(
            dir.path(),
            "cat >/dev/null; echo one >&2; sleep 0.1; echo two >&2; exit 4",
            Duration::from_secs(30),
        );
        match run(&failing, b"{}").await {
            Err(RunError::NonZeroExit { stderr, .. }) => assert_eq!(stderr, "one two"),
            other => panic!("{other:?}"),
        }
    }

    async fn a_plugin_that_closes_its_pipes_and_runs_on_is_waited_for() {
        let dir = tempfile::tempdir().unwrap();
        let ok = plugin(
            dir.path(),
            "cat >/dev/null; echo answer; exec >&- 2>&-; sleep 0.3",
            Duration::from_secs(30),
        );
        let started = StdInstant::now();
        assert_eq!(run(&ok, b"{}").await.unwrap(), b"answer\n");
        assert!(started.elapsed() >= Duration::from_millis(300));
        let failing = plugin(
            dir.path(),
            "cat >/dev/null; echo answer; exec >&- 2>&-; sleep 0.2; exit 3",
            Duration::from_secs(30),
        );
        match run(&failing, b"{}").await {
            Err(RunError::NonZeroExit { status, .. }) => assert!(status.contains('3'), "{status}"),
            other => panic!("{other:?}"),
        }
    }

    async fn a_hang_behind_an_escapee_holding_the_pipes_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("escapee.pid");
        let cmd = plugin(
            dir.path(),
            &format!(
                "setsid sh -c 'echo $$ > {}; exec sleep 30' & sleep 30",
                pid_file.display()
            ),
            Duration::from_millis(300),
        );
        let started = StdInstant::now();
        let result = run(&cmd, b"{}").await;
        assert!(
            matches!(result, Err(RunError::Timeout { .. })),
            "{result:?}"
        );
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(5),
            "{took:?}"
        );
        if let Ok(pid) = std::fs::read_to_string(&pid_file) {
            if let Some(pid) = rustix::process::Pid::from_raw(pid.trim().parse().unwrap()) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
    }

    #[tokio::test]
    async fn a_nul_byte_in_an_argument_is_a_spawn_error_every_run() {
        let cmd = PluginCommand::new(
            "p".into(),
            "/bin/true".into(),
            vec!["a\0b".into()],
            vec![],
            Duration::from_secs(5),
        );
        for _ in 0..2 {
            let e = run(&cmd, b"").await.unwrap_err();
            assert!(matches!(e, RunError::Spawn { .. }), "{e:?}");
        }
    }
}
