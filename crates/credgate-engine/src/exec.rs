//! Running plugin executables: one request on stdin, capped stdout and stderr, a timeout that
//! kills the plugin's whole process group, and a bounded drain when a child of the plugin keeps
//! its pipes open after the plugin exited. Processes that left the group are killed by the
//! [`sweep`] thread.

use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::{pin, Pin};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;
use tokio::time::{sleep_until, Instant};

use crate::sweep;

/// A boxed future, for object-safe traits.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What to execute.
#[derive(Clone)]
pub struct PluginCommand {
    pub name: String,
    pub path: PathBuf,
    pub args: Vec<String>,
    /// Added to the agent's own environment; these win on a clash.
    pub env: Vec<(String, String)>,
    pub timeout: Duration,
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

/// Runs a plugin with a request and returns its stdout. Engine tests inject fakes.
pub trait PluginRunner: Send + Sync + 'static {
    fn run<'a>(
        &'a self,
        command: &'a PluginCommand,
        stdin: Vec<u8>,
    ) -> BoxFuture<'a, Result<Vec<u8>, RunError>>;
}

/// Runs real executables.
#[derive(Debug, Default, Clone, Copy)]
pub struct ExecRunner {
    pub limits: OutputLimits,
}

impl PluginRunner for ExecRunner {
    fn run<'a>(
        &'a self,
        command: &'a PluginCommand,
        stdin: Vec<u8>,
    ) -> BoxFuture<'a, Result<Vec<u8>, RunError>> {
        Box::pin(exec(command, stdin, self.limits))
    }
}

/// Kills a process group when dropped, so no exit path leaves the plugin's children behind,
/// and hands the run's marker to the sweeper for those that left the group.
struct GroupKill {
    pgid: Option<i32>,
    marker: Option<String>,
}

impl GroupKill {
    fn kill(&mut self) {
        if let Some(pgid) = self.pgid.take() {
            // SAFETY: kill(2) with a negative pid signals the process group we created for the
            // plugin (process_group(0) makes its pgid equal its pid); it touches no memory.
            unsafe {
                libc::kill(-pgid, libc::SIGKILL);
            }
        }
    }
}

impl Drop for GroupKill {
    fn drop(&mut self) {
        self.kill();
        if let Some(marker) = self.marker.take() {
            sweep::finished(marker);
        }
    }
}

enum Capped {
    Done,
    Overflow,
}

/// Reads into `buf` until EOF; stops with `Overflow` past `cap` bytes unless `keep_tail`, in
/// which case only the last `cap` bytes are kept.
async fn read_capped<R: AsyncRead + Unpin>(
    mut r: R,
    buf: &mut Vec<u8>,
    cap: usize,
    keep_tail: bool,
) -> io::Result<Capped> {
    let mut chunk = [0u8; 8192];
    loop {
        let n = r.read(&mut chunk).await?;
        if n == 0 {
            return Ok(Capped::Done);
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > cap {
            if !keep_tail {
                return Ok(Capped::Overflow);
            }
            let excess = buf.len() - cap;
            buf.drain(..excess);
        }
    }
}

async fn exec(
    cmd: &PluginCommand,
    input: Vec<u8>,
    limits: OutputLimits,
) -> Result<Vec<u8>, RunError> {
    let deadline = Instant::now() + cmd.timeout;
    let marker = sweep::marker();
    let mut child = Command::new(&cmd.path)
        .args(&cmd.args)
        .envs(cmd.env.iter().map(|(k, v)| (k, v)))
        .env(sweep::MARKER_ENV, &marker)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| RunError::Spawn {
            plugin: cmd.name.clone(),
            path: cmd.path.clone(),
            source,
        })?;
    let mut group = GroupKill {
        pgid: child.id().and_then(|id| i32::try_from(id).ok()),
        marker: Some(marker),
    };
    let (stdin, stdout, stderr) = (child.stdin.take(), child.stdout.take(), child.stderr.take());
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let status = {
        let mut out_fut = pin!(read_capped(
            stdout.expect("piped"),
            &mut out,
            limits.stdout,
            false
        ));
        let mut err_fut = pin!(read_capped(
            stderr.expect("piped"),
            &mut err,
            limits.stderr,
            true
        ));
        let mut wait_fut = pin!(async {
            if let Some(mut stdin) = stdin {
                // A plugin may exit without reading its request: a broken pipe is its business.
                let _ = stdin.write_all(&input).await;
            }
            child.wait().await
        });
        let mut timer = pin!(sleep_until(deadline));
        let (mut out_done, mut err_done) = (false, false);
        let mut status: Option<ExitStatus> = None;
        while !(out_done && err_done && status.is_some()) {
            tokio::select! {
                r = &mut out_fut, if !out_done => match r {
                    Ok(Capped::Done) => out_done = true,
                    Ok(Capped::Overflow) => {
                        return Err(RunError::OutputTooLarge { plugin: cmd.name.clone(), stream: "stdout", cap: limits.stdout });
                    }
                    Err(source) => return Err(RunError::Io { plugin: cmd.name.clone(), source }),
                },
                _ = &mut err_fut, if !err_done => err_done = true,
                s = &mut wait_fut, if status.is_none() => {
                    let s = s.map_err(|source| RunError::Io { plugin: cmd.name.clone(), source })?;
                    status = Some(s);
                    // The plugin is done: whatever it left running in its group goes too, which
                    // closes pipes they held. Escapees (setsid) get a bounded drain.
                    group.kill();
                    let grace = Instant::now() + limits.drain_grace;
                    timer.as_mut().reset(grace.min(deadline));
                },
                _ = &mut timer => {
                    if status.is_none() {
                        return Err(RunError::Timeout { plugin: cmd.name.clone(), after: cmd.timeout });
                    }
                    break;
                }
            }
        }
        status.expect("loop ends with a status")
    };
    if !status.success() {
        return Err(RunError::NonZeroExit {
            plugin: cmd.name.clone(),
            status: status.to_string(),
            stderr: printable_tail(&err),
        });
    }
    Ok(out)
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
