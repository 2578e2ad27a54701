//! Shared helpers: config builders, plugin scripts, a counting fake runner, log capture.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use credgate_core::config::ProviderConfig;
use credgate_engine::exec::{BoxFuture, PluginCommand, PluginRunner, RunError};
use credgate_engine::{Engine, EngineOptions};

pub const WIRE_V1: &str = "credentialprovider.kubelet.k8s.io/v1";

/// A config with one provider per `(name, matchImages, defaultCacheDuration, wire)`.
pub fn config(providers: &[(&str, &[&str], &str, &str)]) -> ProviderConfig {
    config_with(providers, "")
}

/// Like [`config`], with extra YAML lines appended to every provider.
pub fn config_with(providers: &[(&str, &[&str], &str, &str)], extra: &str) -> ProviderConfig {
    let mut yaml = String::from(
        "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n",
    );
    for (name, images, ttl, wire) in providers {
        let images: Vec<String> = images.iter().map(|i| format!("{i:?}")).collect();
        yaml.push_str(&format!(
            "- name: {name}\n  matchImages: [{}]\n  defaultCacheDuration: {ttl}\n  apiVersion: {wire}\n{extra}",
            images.join(", ")
        ));
    }
    ProviderConfig::from_slice("test.yaml", yaml.as_bytes()).expect("test config is valid")
}

/// A response body.
pub fn response(
    wire: &str,
    key_type: &str,
    duration: Option<&str>,
    auth: &[(&str, &str, &str)],
) -> String {
    let auth: Vec<String> = auth
        .iter()
        .map(|(k, u, p)| format!("{k:?}:{{\"username\":{u:?},\"password\":{p:?}}}"))
        .collect();
    let duration = duration
        .map(|d| format!(",\"cacheDuration\":{d:?}"))
        .unwrap_or_default();
    format!(
        "{{\"kind\":\"CredentialProviderResponse\",\"apiVersion\":{wire:?},\"cacheKeyType\":{key_type:?}{duration},\"auth\":{{{}}}}}",
        auth.join(",")
    )
}

/// Writes an executable shell script.
pub fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    let mut f = std::fs::File::create(&path).unwrap();
    writeln!(f, "#!/bin/sh\n{body}").unwrap();
    drop(f);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// A plugin script that counts its runs in `<dir>/<name>.runs`, saves its request in
/// `<dir>/<name>.request` and prints `body`.
pub fn counting_plugin(dir: &Path, name: &str, body: &str) -> PathBuf {
    let runs = dir.join(format!("{name}.runs"));
    let req = dir.join(format!("{name}.request"));
    script(
        dir,
        name,
        &format!(
            "cat > '{}'\necho run >> '{}'\ncat <<'EOF'\n{body}\nEOF",
            req.display(),
            runs.display()
        ),
    )
}

pub fn runs_of(dir: &Path, name: &str) -> usize {
    std::fs::read_to_string(dir.join(format!("{name}.runs")))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

pub fn engine(config: ProviderConfig, dir: &Path) -> Engine {
    engine_opts(config, dir, |_| {})
}

pub fn engine_opts(
    config: ProviderConfig,
    dir: &Path,
    tune: impl FnOnce(&mut EngineOptions),
) -> Engine {
    let mut options = EngineOptions {
        plugin_dir: dir.to_owned(),
        ..EngineOptions::default()
    };
    tune(&mut options);
    Engine::builder()
        .config(config)
        .options(options)
        .build()
        .expect("engine builds")
}

/// How a fake runner answers: from the request and the run's number, a body or a failure.
pub type Answer = Box<dyn Fn(&str, usize) -> Result<String, ()> + Send + Sync>;

/// A fake runner: counts runs, sleeps `delay` on tokio's clock, answers from `answer`.
pub struct FakeRunner {
    pub runs: AtomicUsize,
    pub delay: Duration,
    pub answer: Answer,
    pub requests: Mutex<Vec<String>>,
}

impl FakeRunner {
    pub fn new(
        delay: Duration,
        answer: impl Fn(&str, usize) -> Result<String, ()> + Send + Sync + 'static,
    ) -> Arc<Self> {
        Arc::new(FakeRunner {
            runs: AtomicUsize::new(0),
            delay,
            answer: Box::new(answer),
            requests: Mutex::new(Vec::new()),
        })
    }

    pub fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

impl PluginRunner for FakeRunner {
    fn run<'a>(
        &'a self,
        command: &'a PluginCommand,
        stdin: Vec<u8>,
    ) -> BoxFuture<'a, Result<Vec<u8>, RunError>> {
        Box::pin(async move {
            let n = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
            let request = String::from_utf8(stdin).unwrap();
            self.requests.lock().unwrap().push(request.clone());
            tokio::time::sleep(self.delay).await;
            match (self.answer)(&request, n) {
                Ok(body) => Ok(body.into_bytes()),
                Err(()) => Err(RunError::NonZeroExit {
                    plugin: command.name().to_owned(),
                    status: "exit status: 1".into(),
                    stderr: String::new(),
                }),
            }
        })
    }
}

/// Captures every log line (all levels) written while the guard lives, on this thread.
pub struct LogCapture {
    buf: Arc<Mutex<Vec<u8>>>,
    _guard: tracing::subscriber::DefaultGuard,
}

#[derive(Clone)]
struct BufWriter(Arc<Mutex<Vec<u8>>>);

impl Write for BufWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(data);
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl LogCapture {
    pub fn start() -> Self {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let writer = BufWriter(buf.clone());
        let sub = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_writer(move || writer.clone())
            .finish();
        LogCapture {
            buf,
            _guard: tracing::subscriber::set_default(sub),
        }
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.buf.lock().unwrap()).into_owned()
    }
}
