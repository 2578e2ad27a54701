//! Debian's `docker-registry` (distribution 2.8) on 127.0.0.1.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::process::{require, run, signal, wait_for_exit};

/// A registry on 127.0.0.1 (or the address given), storing in `dir/data`.
pub struct Registry {
    child: Child,
    config: PathBuf,
    dir: PathBuf,
    ip: String,
    pub port: u16,
    /// Its log's lines (the last [`LOG_LINES`]), across restarts.
    log: Arc<Mutex<VecDeque<String>>>,
}

/// How many of a registry's log lines are kept.
pub const LOG_LINES: usize = 20_000;

impl Registry {
    /// Starts a registry in `dir` whose only user is `user`:`password` (htpasswd in
    /// `dir/htpasswd`).
    pub fn start(dir: &Path, user: &str, password: &str) -> Registry {
        Self::with_auth(dir, &Self::htpasswd(dir, user, password))
    }

    /// As [`Registry::start`], serving HTTPS with `cert` and `key` on `ip`, an address of this
    /// machine (a loopback registry is always asked over plain HTTP).
    pub fn start_tls(
        dir: &Path,
        user: &str,
        password: &str,
        ip: &str,
        (cert, key): (&Path, &Path),
    ) -> Registry {
        let auth = Self::htpasswd(dir, user, password);
        let tls = format!(
            "  tls:\n    certificate: {}\n    key: {}\n",
            cert.display(),
            key.display()
        );
        Self::configured(dir, &auth, ip, &tls)
    }

    /// The `auth:` section of one htpasswd user.
    fn htpasswd(dir: &Path, user: &str, password: &str) -> String {
        require("htpasswd");
        crate::secrets::login(user, password);
        run(Command::new("htpasswd")
            .args(["-cbB", "-C", "4"])
            .arg(dir.join("htpasswd"))
            .args([user, password]));
        format!(
            "  htpasswd:\n    realm: credgate-test\n    path: {}\n",
            dir.join("htpasswd").display()
        )
    }

    /// Starts a registry in `dir` with `auth` as its config's `auth:` section (indented by
    /// two spaces).
    pub fn with_auth(dir: &Path, auth: &str) -> Registry {
        Self::configured(dir, auth, "127.0.0.1", "")
    }

    fn configured(dir: &Path, auth: &str, ip: &str, http: &str) -> Registry {
        require("docker-registry");
        let config = dir.join("registry.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {ip}:0\n{http}auth:\n{auth}",
                dir.join("data").display(),
            ),
        )
        .unwrap();
        Self::spawn(&config, dir, ip, Arc::default())
    }

    fn spawn(config: &Path, dir: &Path, ip: &str, log: Arc<Mutex<VecDeque<String>>>) -> Registry {
        let mut child = Command::new("docker-registry")
            .arg("serve")
            .arg(config)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("docker-registry starts");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        // Reads the registry's log until it ends (with the registry), so that it never blocks
        // on a full pipe.
        let kept = log.clone();
        let listening = format!("listening on {ip}:");
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                {
                    let mut kept = kept.lock().unwrap();
                    if kept.len() == LOG_LINES {
                        kept.pop_front();
                    }
                    kept.push_back(line.clone());
                }
                if let Some(i) = line.find(&listening) {
                    let rest = &line[i + listening.len()..];
                    let port: String = rest.chars().take_while(char::is_ascii_digit).collect();
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(port.parse::<u16>().unwrap());
                    }
                }
            }
        });
        let port = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("registry reports its port");
        Registry {
            child,
            config: config.to_path_buf(),
            dir: dir.to_path_buf(),
            ip: ip.to_owned(),
            port,
            log,
        }
    }

    /// The registry's log lines so far (distribution logs `authorized request` for a request a
    /// credential authorized, `error authenticating user "USER"` for one it refused).
    pub fn log_lines(&self) -> Vec<String> {
        self.log.lock().unwrap().iter().cloned().collect()
    }

    /// Whether any request since line `from` of its log carried a credential: one it
    /// authorized (with htpasswd every path but `/v2/` needs one, so an `authorized request`
    /// line means a right credential) or one of `user` it refused.
    pub fn saw_user(&self, user: &str, from: usize) -> bool {
        let refused = format!("authenticating user \\\"{user}\\\"");
        self.settled_log()
            .iter()
            .skip(from)
            .any(|l| l.contains("msg=\"authorized request\"") || l.contains(&refused))
    }

    /// The log once the registry has written what its answers so far leave (a request's line
    /// is written after its answer): no new line for 300 ms, or 5 s at most.
    pub fn settled_log(&self) -> Vec<String> {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut seen = self.log.lock().unwrap().len();
        loop {
            std::thread::sleep(Duration::from_millis(300));
            let now = self.log.lock().unwrap().len();
            if now == seen || std::time::Instant::now() > deadline {
                return self.log_lines();
            }
            seen = now;
        }
    }

    /// `IP:PORT` (`127.0.0.1:PORT` unless started on another address).
    pub fn host(&self) -> String {
        format!("{}:{}", self.ip, self.port)
    }

    /// Adds `user`:`password` to the htpasswd file and restarts the registry to read it.
    pub fn add_user(&mut self, user: &str, password: &str) {
        crate::secrets::login(user, password);
        run(Command::new("htpasswd")
            .args(["-bB", "-C", "4"])
            .arg(self.dir.join("htpasswd"))
            .args([user, password]));
        self.stop();
        self.restart();
    }

    /// Sets `user`'s password in the htpasswd file (adding the user if new), as an operator
    /// rotating it would. The running registry reads the file again at its next request that
    /// needs it (distribution 2.7 and later reload it when its modification time changes).
    pub fn set_password(&mut self, user: &str, password: &str) {
        crate::secrets::login(user, password);
        let path = self.dir.join("htpasswd");
        let before = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
        run(Command::new("htpasswd")
            .args(["-bB", "-C", "4"])
            .arg(&path)
            .args([user, password]));
        // A coarse clock could leave the time unchanged, and the registry would not notice.
        if std::fs::metadata(&path).and_then(|m| m.modified()).ok() == before {
            let later = before.unwrap() + Duration::from_secs(1);
            std::fs::File::options()
                .write(true)
                .open(&path)
                .and_then(|f| f.set_modified(later))
                .unwrap();
        }
    }

    /// Stops the registry now (SIGTERM, waited for).
    pub fn stop(&mut self) {
        signal(&self.child, rustix::process::Signal::TERM);
        let _ = wait_for_exit(&mut self.child, Duration::from_secs(5));
    }

    /// Kills the registry outright (SIGKILL, waited for): connections die mid-request.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the registry again on the same port with the same storage and auth.
    pub fn restart(&mut self) {
        let config = std::fs::read_to_string(&self.config).unwrap().replace(
            &format!("addr: {}:0\n", self.ip),
            &format!("addr: {}\n", self.host()),
        );
        std::fs::write(&self.config, config).unwrap();
        let again = Self::spawn(&self.config, &self.dir, &self.ip, self.log.clone());
        assert_eq!(again.port, self.port);
        *self = again;
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        signal(&self.child, rustix::process::Signal::TERM);
        if wait_for_exit(&mut self.child, Duration::from_secs(5)).is_none() {
            let _ = self.child.kill();
        }
    }
}

/// A docker `config.json` in `dir` with one entry, `host` → `user`:`password` (remembered as
/// secrets a log must not hold); its path.
pub fn docker_config(dir: &Path, host: &str, user: &str, password: &str) -> PathBuf {
    use base64::Engine as _;
    crate::secrets::login(user, password);
    let path = dir.join("config.json");
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    std::fs::write(
        &path,
        format!(r#"{{"auths":{{"{host}":{{"auth":"{auth}"}}}}}}"#),
    )
    .unwrap();
    path
}
