//! `credgate`: the command-line face of credgate. Each subcommand is a short function over the
//! library; `main` maps outcomes to exit codes in one place (0 success, 1 negative answer or
//! failure, 2 usage error).

mod activation;
// The bridge reads its fields; here only its page is written from it.
#[allow(dead_code)]
mod bridge_cli;
mod cmd;
mod helper_help;
mod node;
mod opts;
mod runtime_config;

use std::process::ExitCode;

use clap::Parser;

use crate::opts::{Cli, Command, LogFormat};

/// What a subcommand concluded.
pub enum Outcome {
    /// Exit 0.
    Yes,
    /// Exit 1: the operation's negative answer (no credentials, no match, invalid config).
    No,
    /// Exit 2: the input was unusable (a malformed pattern).
    Usage,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if matches!(cli.command, Command::Serve(_)) {
        credgate_engine::sys::limit_malloc_arenas();
    }
    if !matches!(cli.command, Command::Serve(_)) {
        // A CLI piped into `head` ends quietly when the pipe closes, like other Unix tools.
        credgate_engine::sys::default_sigpipe();
    }
    let (default_level, json) = match &cli.command {
        Command::Serve(a) => ("info", a.log_format == LogFormat::Json),
        _ => ("error", false),
    };
    init_logs(cli.verbose, default_level, json);
    // The sockets a service manager hands over, taken before any thread starts (their
    // variables are removed).
    let handed = if matches!(cli.command, Command::Serve(_)) {
        match activation::Handed::from_env() {
            Ok(handed) => handed,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(1);
            }
        }
    } else {
        activation::Handed::default()
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime starts");
    let result = runtime.block_on(async {
        match cli.command {
            Command::Serve(args) => cmd::serve::run(*args, handed).await,
            Command::Ctl(args) => cmd::ctl::run(args).await,
            Command::Get(args) => cmd::get::run(args).await,
            Command::Explain(args) => cmd::explain::run(args).await,
            Command::CheckConfig(args) => cmd::check::run(args),
            Command::KubeletConfig(args) => cmd::kubelet_config::run(args),
            Command::Match(args) => cmd::matching::run(args),
            Command::Import(opts::ImportCommand::Containerd(args)) => cmd::import::containerd(args),
            Command::Man(args) => man(&args.dir),
        }
    });
    // What is still running (a task past the agent's shutdown deadline, a blocking thread of
    // a plugin's run) is not waited for past this: the process exits.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(Outcome::Yes) => ExitCode::SUCCESS,
        Ok(Outcome::No) => ExitCode::from(1),
        Ok(Outcome::Usage) => ExitCode::from(2),
        Err(e) => {
            eprintln!("error: {}", chain(&e));
            if e.chain().any(|c| c.is::<UsageError>()) {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}

/// Writes credgate(1) and a page a subcommand (credgate-serve(1), ...) into `dir`, and the
/// pages of the kubelet bridge and the credential helper, from their own definitions.
fn man(dir: &std::path::Path) -> anyhow::Result<Outcome> {
    use clap::CommandFactory as _;
    std::fs::create_dir_all(dir)?;
    clap_mangen::generate_to(opts::Cli::command(), dir)?;
    clap_mangen::generate_to(bridge_cli::Args::command(), dir)?;
    let description = helper_help::HELP
        .split_once("\n\n")
        .map_or("", |(_usage, rest)| rest);
    let verb = |name: &'static str, about: &'static str| clap::Command::new(name).about(about);
    let helper = clap::Command::new("docker-credential-credgate")
        .version(env!("CARGO_PKG_VERSION"))
        .about("A docker credential helper backed by the credgate agent")
        .long_about(description.to_owned())
        .subcommands([
            verb("get", "The registry on stdin; its credential on stdout, else \"credentials not found in native keychain\" and exit 1"),
            verb("store", "Refused: the store is read-only"),
            verb("erase", "Refused, or nothing with CREDGATE_HELPER_ERASE=ignore"),
            verb("list", "{}: plugins cannot be enumerated"),
            verb("version", "The helper's version"),
        ]);
    clap_mangen::generate_to(helper, dir)?;
    Ok(Outcome::Yes)
}

/// An error in what the user typed that clap cannot see (the inside of a flag's value): exits
/// 2, like clap's own usage errors.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// A usage error (exit 2) saying `what`.
pub fn usage(what: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(UsageError(what.into()))
}

/// `outer: inner: root`, one line; a cause its outer message already ends with is not
/// repeated (transport errors carry their io error's text and the io error itself).
fn chain(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for part in e.chain().map(ToString::to_string) {
        if !parts.last().is_some_and(|outer| outer.ends_with(&part)) {
            parts.push(part);
        }
    }
    parts.join(": ")
}

fn init_logs(verbose: u8, default_level: &str, json: bool) {
    let level = match verbose {
        0 => default_level,
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("CREDGATE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let logs = tracing_subscriber::fmt().with_env_filter(filter);
    if json {
        logs.with_writer(std::io::stderr).json().init();
    } else {
        // Text: each line escaped as a whole, so that no field from outside (a registry's
        // error body, an image reference, a pod name, a plugin's stderr) can end the line and
        // forge another; without colours, whose escapes would be escaped too.
        logs.with_ansi(false).with_writer(EscapedLines).init();
    }
}

/// Standard error, one log line at a time with its control characters escaped (JSON logs
/// escape them as JSON does).
struct EscapedLines;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for EscapedLines {
    type Writer = LineBuffer;

    fn make_writer(&'a self) -> LineBuffer {
        LineBuffer(Vec::new())
    }
}

/// One event's formatted line, written escaped when it is dropped (the formatter writes an
/// event whole, then drops its writer).
struct LineBuffer(Vec<u8>);

impl std::io::Write for LineBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LineBuffer {
    fn drop(&mut self) {
        use std::io::Write as _;
        let line = String::from_utf8_lossy(&self.0);
        let escaped = credgate_core::text::escape_controls(&line);
        let _ = std::io::stderr().lock().write_all(escaped.as_bytes());
    }
}
