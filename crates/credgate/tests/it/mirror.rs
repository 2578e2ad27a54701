//! The node's registry mirror (issue 51, `serve --registry-mirror-addr`): reads forwarded to the
//! registry with the credential the agent holds now for the repository, never the consumer's;
//! a refused credential confirmed and the next source tried; callers the kernel does not name
//! as admitted get 403 and nothing upstream; redirects followed without credentials; Range reads
//! streamed; containerd reading through it by hosts.toml with no credential of its own.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};

use crate::support::{text, token::TokenServer, write_script, Agent};

/// `curl` of `url` with `headers`, as `as_uid` when given (setpriv); (status, headers, body).
fn curl(url: &str, headers: &[&str], method: &str, as_uid: Option<u32>) -> (u16, String, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let (head, body) = (dir.path().join("head"), dir.path().join("body"));
    let mut cmd = match as_uid {
        Some(uid) => {
            let mut c = Command::new("setpriv");
            c.arg(format!("--reuid={uid}"))
                .arg(format!("--regid={uid}"))
                .arg("--clear-groups")
                .arg("curl");
            c
        }
        None => Command::new("curl"),
    };
    cmd.args(["-s", "--path-as-is", "-X", method, "-D"])
        .arg(&head)
        .arg("-o")
        .arg(&body);
    if method == "HEAD" {
        cmd.arg("-I");
    }
    for h in headers {
        cmd.args(["-H", h]);
    }
    let out = cmd
        .args(["-w", "%{http_code}", url])
        .output()
        .expect("curl runs (scripts/test installs it)");
    let status = text(&out.stdout).trim().parse().unwrap_or(0);
    (
        status,
        std::fs::read_to_string(&head).unwrap_or_default(),
        std::fs::read(&body).unwrap_or_default(),
    )
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

const MANIFEST_ACCEPT: &str = "Accept: application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.index.v1+json";

/// A provider answering `user`:`password` for `pattern`, and its config.
fn provider(d: &Path, pattern: &str, user: &str, password: &str) -> std::path::PathBuf {
    std::fs::create_dir_all(d.join("plugins")).unwrap();
    write_script(
        &d.join("plugins/p"),
        &format!(
            r#"cat >/dev/null; printf '{{"kind":"CredentialProviderResponse","apiVersion":"credentialprovider.kubelet.k8s.io/v1","cacheKeyType":"Registry","cacheDuration":"10m","auth":{{"{pattern}":{{"username":"{user}","password":"{password}"}}}}}}'"#
        ),
    );
    let config = d.join("providers.yaml");
    std::fs::write(
        &config,
        format!("apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: p\n  matchImages: [\"{pattern}\"]\n  defaultCacheDuration: 10m\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n"),
    )
    .unwrap();
    config
}

/// A loopback registry whose one user alice may read its `team/app:v1`, and a provider
/// answering alice for it: the registry, its host and the provider's config.
fn private_registry(d: &Path) -> (crate::support::Registry, String, std::path::PathBuf) {
    let registry = crate::support::Registry::start(d, "alice", "alice-pw");
    crate::support::oci_image(d);
    crate::support::push(d, &registry, "team/app", "alice", "alice-pw");
    let host = registry.host();
    let config = provider(d, &host, "alice", "alice-pw");
    (registry, host, config)
}

/// The agent with the mirror on a free loopback port serving `registry`; its address.
fn mirror_agent(d: &Path, config: &Path, registry: &str, extra: &[&str]) -> (Agent, String) {
    mirror_agent_with_env(d, &[], config, registry, extra)
}

/// [`mirror_agent`] with `env` added to the agent's environment.
fn mirror_agent_with_env(
    d: &Path,
    env: &[(&str, &Path)],
    config: &Path,
    registry: &str,
    extra: &[&str],
) -> (Agent, String) {
    let addr = format!("127.0.0.1:{}", crate::support::free_port());
    let metrics = format!("127.0.0.1:{}", crate::support::free_port());
    let plugins = d.join("plugins");
    let mut args = vec![
        "--image-credential-provider-config",
        config.to_str().unwrap(),
        "--image-credential-provider-bin-dir",
        plugins.to_str().unwrap(),
        "--registry-mirror-addr",
        &addr,
        "--registry-mirror-upstream",
        registry,
        "--metrics-addr",
        &metrics,
    ];
    args.extend_from_slice(extra);
    let agent = Agent::start_with_env(d, env, &args);
    (agent, addr)
}

fn metrics_of(agent: &Agent) -> String {
    crate::cri::metrics_text(agent)
}

/// Debian's registry behind the test token server (admin, and alice who may read team-a/app):
/// the provider's credential (alice) reaches the registry for a read whose consumer sent a
/// stale credential of its own; a docker config entry the realm refuses, tried first, is
/// confirmed refused and the provider's is tried next; a Range read of a layer is served as a
/// range; a repository alice may not read answers 401 and drops nothing; reads of registries not
/// named, writes and other paths are refused before any credential; no secret reaches the log.
#[test]
fn reads_carry_the_agents_credential_of_now_and_never_the_consumers() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tokens = TokenServer::start(
        d,
        &[
            ("admin", "admin-pw", &["*"]),
            ("alice", "alice-pw", &["team-a/app"]),
        ],
    );
    let registry = crate::support::registry_with_tokens(d, &tokens);
    crate::support::oci_image(d);
    crate::support::push(d, &registry, "team-a/app", "admin", "admin-pw");
    crate::support::push(d, &registry, "team-b/app", "admin", "admin-pw");
    let host = registry.host();
    let config = provider(d, &host, "alice", "alice-pw");
    // A stale docker config entry for the registry, tried before the provider.
    let docker = d.join("docker.json");
    std::fs::write(
        &docker,
        format!(
            "{{\"auths\":{{\"{host}\":{{\"auth\":\"{}\"}}}}}}",
            base64::Engine::encode(&base64::engine::general_purpose::STANDARD, "stale:stale-pw")
        ),
    )
    .unwrap();
    std::fs::set_permissions(&docker, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let (agent, addr) = mirror_agent(
        d,
        &config,
        &host,
        &["--docker-config", docker.to_str().unwrap()],
    );
    let base = format!("http://{addr}");
    let (status, _, body) = curl(&format!("{base}/v2/"), &[], "GET", None);
    assert_eq!((status, body.as_slice()), (200, b"{}".as_slice()));

    let manifest = format!("{base}/v2/team-a/app/manifests/v1?ns={host}");
    let stale = "Authorization: Basic Y29uc3VtZXI6c3RhbGU="; // consumer:stale
    let (status, head, body) = curl(&manifest, &[MANIFEST_ACCEPT, stale], "GET", None);
    assert_eq!(status, 200, "{head}{}", text(&body));
    assert!(header(&head, "docker-content-digest").is_some(), "{head}");
    let (status, head, _) = curl(&manifest, &[MANIFEST_ACCEPT], "HEAD", None);
    assert_eq!(status, 200, "{head}");

    // A layer, read as a range.
    let parsed: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let layer = parsed["layers"][0]["digest"]
        .as_str()
        .expect("a layer")
        .to_owned();
    let (status, head, part) = curl(
        &format!("{base}/v2/team-a/app/blobs/{layer}?ns={host}"),
        &["Range: bytes=0-9"],
        "GET",
        None,
    );
    assert_eq!((status, part.len()), (206, 10), "{head}");

    // What alice may not read: the registry's 401, and alice's credential kept.
    let (status, _, _) = curl(
        &format!("{base}/v2/team-b/app/manifests/v1?ns={host}"),
        &[MANIFEST_ACCEPT],
        "GET",
        None,
    );
    assert_eq!(status, 401);
    let looked = agent.credgate(&["get", &format!("{host}/team-a/app")]);
    assert!(
        text(&looked.stdout).contains("alice"),
        "{}",
        text(&looked.stdout)
    );

    // Refused before any credential is looked at.
    for (url, method, want) in [
        (
            format!("{base}/v2/team-a/app/manifests/v1?ns=elsewhere.example"),
            "GET",
            404,
        ),
        (format!("{base}/v2/team-a/app/blobs/uploads/"), "POST", 405),
        (format!("{base}/v2/team-a/../app/manifests/v1"), "GET", 404),
    ] {
        assert_eq!(curl(&url, &[], method, None).0, want, "{method} {url}");
    }
    let m = metrics_of(&agent);
    let count = |prefix: &str| crate::node::metric_sum(&m, prefix);
    assert!(
        count("credgate_mirror_requests_total{result=\"forwarded\",auth=\"provider\"}") == 3.0,
        "{m}"
    );
    assert_eq!(
        count("credgate_credentials_refused_total{source=\"docker_config\"}"),
        1.0,
        "the stale docker config entry, confirmed refused: {m}"
    );
    assert_eq!(
        count("credgate_credentials_refused_total{source=\"provider\"}"),
        0.0
    );
    // Its connections are counted under the listener's name, as the API's and the proxy's.
    assert!(
        m.contains("credgate_connections{listener=\"registry-mirror\"}"),
        "{m}"
    );
    let log = agent.log_text();
    for secret in ["alice-pw", "stale-pw", "admin-pw", "Y29uc3VtZXI6c3RhbGU"] {
        assert!(!log.contains(secret), "{secret} in the agent's log");
    }
}

/// A registry whose blobs redirect to storage on another host: the mirror follows the redirect
/// without the credential (the storage never sees it) and streams the blob back.
#[test]
fn a_redirect_to_another_host_is_followed_without_the_credential() {
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let storage = TcpListener::bind("127.0.0.1:0").unwrap();
    let storage_port = storage.local_addr().unwrap().port();
    let registry = TcpListener::bind("127.0.0.1:0").unwrap();
    let registry_host = format!("127.0.0.1:{}", registry.local_addr().unwrap().port());
    let serve = |listener: TcpListener,
                 seen: Arc<Mutex<Vec<String>>>,
                 answer: Arc<dyn Fn(&str) -> String + Send + Sync>| {
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut head = String::new();
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                    head.push_str(&line);
                }
                seen.lock().unwrap().push(head.clone());
                let mut stream = stream;
                let _ = stream.write_all(answer(&head).as_bytes());
            }
        })
    };
    let location = format!("http://localhost:{storage_port}/blob");
    serve(
        registry,
        Arc::default(),
        Arc::new(move |head: &str| {
            if head.to_ascii_lowercase().contains("authorization: basic") {
                format!("HTTP/1.1 307 Temporary Redirect\r\nLocation: {location}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            } else {
                "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm=\"r\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_owned()
            }
        }),
    );
    serve(
        storage,
        seen.clone(),
        Arc::new(|_: &str| {
            "HTTP/1.1 200 OK\r\nContent-Length: 10\r\nConnection: close\r\n\r\nblob-bytes"
                .to_owned()
        }),
    );
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let config = provider(d, &registry_host, "u", "u-pw");
    let (agent, addr) = mirror_agent(d, &config, &registry_host, &[]);
    let (status, head, body) = curl(
        &format!("http://{addr}/v2/team/app/blobs/sha256:00aa"),
        &[],
        "GET",
        None,
    );
    assert_eq!(
        (status, body.as_slice()),
        (200, b"blob-bytes".as_slice()),
        "{head}"
    );
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert!(
        !seen[0].to_ascii_lowercase().contains("authorization"),
        "{seen:?}"
    );
    assert!(!agent.log_text().contains("u-pw"));
}

/// Callers the kernel names as neither root, the agent's own uid nor an admitted one get 403
/// and nothing goes upstream; `--allow-uids registry-mirror=UID` admits one.
#[test]
#[ignore = "needs root"]
fn a_caller_that_is_not_admitted_gets_403_and_no_credential() {
    credgate_testbed::require_root("reading as another uid");
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (mut registry, host, config) = private_registry(d);
    let nobody = 65534;
    for (admitted, extra) in [
        (false, None),
        (true, Some(format!("registry-mirror={nobody}"))),
    ] {
        let sub = d.join(format!("agent-{admitted}"));
        std::fs::create_dir_all(&sub).unwrap();
        let config = std::fs::read_to_string(&config).unwrap();
        let sub_config = sub.join("providers.yaml");
        std::fs::write(&sub_config, config).unwrap();
        std::fs::create_dir_all(sub.join("plugins")).unwrap();
        std::fs::copy(d.join("plugins/p"), sub.join("plugins/p")).unwrap();
        let allow: Vec<&str> = match &extra {
            Some(e) => vec!["--allow-uids", e.as_str()],
            None => vec![],
        };
        let (agent, addr) = mirror_agent(&sub, &sub_config, &host, &allow);
        let before = registry.log_lines().len();
        let (status, _, _) = curl(
            &format!("http://{addr}/v2/team/app/manifests/v1"),
            &[MANIFEST_ACCEPT],
            "GET",
            Some(nobody),
        );
        let m = metrics_of(&agent);
        if admitted {
            assert_eq!(status, 200);
        } else {
            assert_eq!(status, 403);
            assert_eq!(
                crate::node::metric_sum(
                    &m,
                    "credgate_mirror_requests_total{result=\"caller_refused\""
                ),
                1.0,
                "{m}"
            );
            assert!(
                !registry.saw_user("alice", before),
                "a credential went upstream"
            );
            // Root still reads.
            let (status, _, _) = curl(
                &format!("http://{addr}/v2/team/app/manifests/v1"),
                &[MANIFEST_ACCEPT],
                "GET",
                None,
            );
            assert_eq!(status, 200);
        }
    }
    registry.stop();
}

/// Connections opened one after another, as a consumer opens them, each get an answer: the
/// listener takes a connection only where it cannot drop it unanswered (it reset about one in
/// six when the owner's lookup was awaited after the accept).
#[test]
fn every_connection_of_a_run_is_answered() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let config = provider(d, "registry.invalid", "u", "p");
    let (agent, addr) = mirror_agent(d, &config, "registry.invalid", &[]);
    let mut unanswered = 0;
    for _ in 0..300 {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut head = [0u8; 12];
        let answered = s
            .write_all(b"GET /v2/ HTTP/1.1\r\nHost: m\r\nConnection: close\r\n\r\n")
            .and_then(|()| s.read_exact(&mut head))
            .is_ok();
        if !answered || &head != b"HTTP/1.1 200" {
            unanswered += 1;
        }
    }
    assert_eq!(unanswered, 0, "{}", agent.log_text());
}

/// A registry given an address of its own (`REGISTRY=ADDR`) is the default there: a read that
/// names no registry (nydusd's, whose host nydus-snapshotter replaced with the mirror's) reaches
/// it, with its credential; on the shared address the same read goes to the first registry
/// named.
#[test]
fn a_registry_with_an_address_of_its_own_is_the_default_there() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (_registry, host, config) = private_registry(d);
    let own = format!("127.0.0.1:{}", crate::support::free_port());
    let upstream = format!("{host}={own}");
    let (agent, shared) = mirror_agent(
        d,
        &config,
        "registry.invalid",
        &["--registry-mirror-upstream", &upstream],
    );
    let read = |addr: &str, query: &str| {
        curl(
            &format!("http://{addr}/v2/team/app/manifests/v1{query}"),
            &[MANIFEST_ACCEPT],
            "GET",
            None,
        )
    };
    let (status, _, body) = read(&own, "");
    assert_eq!(status, 200, "{}\n{}", text(&body), agent.log_text());
    assert_eq!(read(&shared, &format!("?ns={host}")).0, 200);
    let (status, _, _) = read(&shared, "");
    assert_ne!(
        status, 200,
        "the shared address's default is the first registry named"
    );
    assert!(!agent.log_text().contains("alice-pw"));
}

/// This machine's first IPv4 address that is not loopback (a loopback registry is always asked
/// over plain HTTP).
fn global_ipv4() -> String {
    let out = Command::new("ip")
        .args(["-4", "-o", "addr", "show", "scope", "global"])
        .output()
        .expect("ip runs");
    text(&out.stdout)
        .split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .and_then(|a| a.split('/').next())
        .map(str::to_owned)
        .expect("this test needs an IPv4 address that is not loopback (`ip -4 addr`)")
}

/// A private CA in `d` and a certificate it signs for `ip`: (the CA's, the server's, its key).
fn private_ca(d: &Path, ip: &str) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    crate::support::require("openssl");
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .current_dir(d)
            .args(args)
            .output()
            .expect("openssl runs");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            text(&out.stderr)
        );
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    openssl(
        &[
            &["req", "-x509"],
            &ec[..],
            &["-days", "2", "-subj", "/CN=credgate-test-ca"],
        ]
        .concat()
        .iter()
        .chain(&["-keyout", "ca.key", "-out", "ca.crt"])
        .copied()
        .collect::<Vec<_>>(),
    );
    openssl(
        &[
            &["req"],
            &ec[..],
            &["-subj", "/CN=registry", "-keyout", "tls.key"],
        ]
        .concat()
        .iter()
        .chain(&["-out", "tls.csr"])
        .copied()
        .collect::<Vec<_>>(),
    );
    std::fs::write(
        d.join("tls.ext"),
        format!("subjectAltName=IP:{ip}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"),
    )
    .unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        "tls.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "tls.ext",
        "-out",
        "tls.crt",
    ]);
    (d.join("ca.crt"), d.join("tls.crt"), d.join("tls.key"))
}

/// A registry served over HTTPS under a private CA, as many a company's is: the mirror reaches it
/// when the node trusts the CA (here `SSL_CERT_FILE`, as `update-ca-certificates` would add it
/// to the system's store) and reads with the provider's credential; an agent that is not told
/// of the CA refuses the registry's certificate and forwards nothing.
#[test]
fn a_registry_under_a_private_ca_is_reached_through_the_nodes_roots() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ip = global_ipv4();
    let (ca, cert, key) = private_ca(d, &ip);
    let registry = crate::support::Registry::start_tls(d, "alice", "alice-pw", &ip, (&cert, &key));
    crate::support::oci_image(d);
    crate::support::push(d, &registry, "team/app", "alice", "alice-pw");
    let host = registry.host();
    let config = provider(d, &host, "alice", "alice-pw");
    // One agent after the other in the same directory: each is stopped when `read` returns.
    let read = |trusting: Option<&Path>| {
        let env: Vec<(&str, &Path)> = trusting
            .map(|ca| ("SSL_CERT_FILE", ca))
            .into_iter()
            .collect();
        let (agent, addr) = mirror_agent_with_env(d, &env, &config, &host, &[]);
        let (status, _, body) = curl(
            &format!("http://{addr}/v2/team/app/manifests/v1"),
            &[MANIFEST_ACCEPT],
            "GET",
            None,
        );
        (status, text(&body), agent.log_text())
    };
    let (status, body, log) = read(None);
    assert_ne!(
        status, 200,
        "a certificate no root signs is refused: {body}"
    );
    assert!(log.contains("certificate not trusted"), "{log}");
    let (status, body, log) = read(Some(&ca));
    assert_eq!(status, 200, "{body}\n{log}");
    assert!(body.contains("layers"), "{body}");
    assert!(registry.saw_user("alice", 0));
}

/// containerd reads through the mirror by its hosts.toml (as README tells an operator), with no
/// credential of its own: the pull of a private image succeeds, with the provider's credential
/// added by the mirror.
#[test]
#[ignore = "needs root"]
fn containerd_pulls_a_private_image_through_the_mirror_with_no_credential_of_its_own() {
    crate::support::needs_containerd();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (_registry, host, config) = private_registry(d);
    let (agent, addr) = mirror_agent(d, &config, &host, &[]);
    let containerd = credgate_testbed::Containerd::start(d, &[]);
    let hosts = d.join("hosts.d");
    std::fs::create_dir_all(hosts.join(&host)).unwrap();
    std::fs::write(
        hosts.join(&host).join("hosts.toml"),
        format!("server = \"http://{host}\"\n\n[host.\"http://{addr}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"),
    )
    .unwrap();
    let pull = |with_mirror: bool| {
        let mut cmd = Command::new("ctr");
        cmd.arg("--address").arg(&containerd.socket).args([
            "-n",
            "mirror-test",
            "images",
            "pull",
            "--plain-http",
        ]);
        if with_mirror {
            cmd.arg("--hosts-dir").arg(&hosts);
        }
        cmd.arg(format!("{host}/team/app:v1")).output().unwrap()
    };
    // Without the mirror the image is private: containerd alone has no credential.
    let alone = pull(false);
    assert!(!alone.status.success(), "{}", text(&alone.stdout));
    let through = pull(true);
    assert!(
        through.status.success(),
        "{}{}\n{}",
        text(&through.stdout),
        text(&through.stderr),
        agent.log_text()
    );
    let m = metrics_of(&agent);
    assert!(
        crate::node::metric_sum(
            &m,
            "credgate_mirror_requests_total{result=\"forwarded\",auth=\"provider\"}"
        ) >= 2.0,
        "{m}"
    );
    let mut reader = Vec::new();
    let _ = std::fs::File::open(&agent.log).and_then(|mut f| f.read_to_end(&mut reader));
    assert!(!String::from_utf8_lossy(&reader).contains("alice-pw"));
}

/// Two namespaces pull one private repository through the CRI proxy, each with its own
/// credential; the newer one (team-b's) is then revoked at the registry. A read through the
/// mirror tries team-b's capture, has the refusal confirmed, drops that capture alone and is
/// served with team-a's (decision 0030): one tenant's revocation never stops another's lazy
/// reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn a_revoked_capture_leaves_another_namespaces_capture_of_the_repository() {
    use credgate_testbed::cri::{call, pull_request, PullImageResponse, PULL_IMAGE};
    crate::support::needs_containerd();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tokens = TokenServer::start(
        d,
        &[
            ("admin", "admin-pw", &["*"]),
            ("alice", "alice-pw", &["shared/app"]),
            ("bob", "bob-pw", &["shared/app"]),
        ],
    );
    let registry = crate::support::registry_with_tokens(d, &tokens);
    crate::support::oci_image(d);
    crate::support::push(d, &registry, "shared/app", "admin", "admin-pw");
    let host = registry.host();
    let containerd = credgate_testbed::Containerd::start(d, std::slice::from_ref(&host));
    let addr = format!("127.0.0.1:{}", crate::support::free_port());
    let metrics = format!("127.0.0.1:{}", crate::support::free_port());
    let (agent, proxy) = crate::support::proxy_agent_with(
        d,
        &containerd.socket,
        &[
            "--registry-mirror-addr",
            &addr,
            "--registry-mirror-upstream",
            &host,
            "--metrics-addr",
            &metrics,
        ],
    );
    let image = format!("{host}/shared/app:v1");
    for (namespace, user, password) in
        [("team-a", "alice", "alice-pw"), ("team-b", "bob", "bob-pw")]
    {
        let _: PullImageResponse = call(
            &proxy,
            PULL_IMAGE,
            pull_request(&image, Some((user, password)), namespace),
        )
        .await
        .unwrap_or_else(|e| panic!("{namespace}'s pull: {e}"));
        credgate_testbed::eventually(
            &format!("{namespace}'s credential is captured"),
            std::time::Duration::from_secs(20),
            || text(&agent.credgate(&["ctl", "captured"]).stdout).contains(namespace),
        );
    }
    let captured = text(&agent.credgate(&["ctl", "captured"]).stdout);
    assert!(
        captured.contains("team-a") && captured.contains("team-b"),
        "{captured}"
    );
    tokens.set_password("bob", "bob-revoked");
    let (status, _, body) = curl(
        &format!("http://{addr}/v2/shared/app/manifests/v1?ns={host}"),
        &[MANIFEST_ACCEPT],
        "GET",
        None,
    );
    assert_eq!(status, 200, "{}\n{}", text(&body), agent.log_text());
    let captured = text(&agent.credgate(&["ctl", "captured"]).stdout);
    assert!(
        captured.contains("team-a") && !captured.contains("team-b"),
        "team-b's revoked capture alone is dropped: {captured}"
    );
    let m = metrics_of(&agent);
    assert!(
        crate::node::metric_sum(
            &m,
            "credgate_mirror_requests_total{result=\"forwarded\",auth=\"captured\"}"
        ) >= 1.0,
        "{m}"
    );
    let log = agent.log_text();
    assert!(
        log.contains("the registry refused the captured pull credential"),
        "{log}"
    );
    for secret in ["alice-pw", "bob-pw", "bob-revoked", "admin-pw"] {
        assert!(!log.contains(secret), "{secret} in the log");
    }
}

/// The listeners' connection budgets fit the open-file limit together: under a limit of 1500,
/// the mirror's 512 connections on its one address (two descriptors each, its and the
/// registry's) and the metrics listener's 64 beside 256 reserved leave the API 156, and the
/// agent says so at start, instead of letting the mirror's consumers take the descriptors
/// the API's callers need.
#[test]
fn the_mirrors_connections_count_against_the_open_file_limit() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let addr = format!("127.0.0.1:{}", crate::support::free_port());
    let agent = Agent::start_with_nofile(
        d,
        1500,
        &[
            "--registry-mirror-addr",
            &addr,
            "--registry-mirror-upstream",
            "registry.example.com",
        ],
    );
    let log = agent.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("--max-connections lowered to fit the open-file limit"))
        .unwrap_or_else(|| panic!("no warning: {log}"));
    assert!(
        line.contains("allowed=156") && line.contains("open_file_limit=1500"),
        "{line}"
    );
}
