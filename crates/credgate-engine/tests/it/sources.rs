//! Sources on disk: provider config files and directories, docker config files, and the
//! keyring order across static sources and several providers.

use credgate_engine::source::{load_docker_config, load_provider_config, LoadError};
use credgate_engine::{Engine, EngineOptions, LookupRequest, Source};

use crate::common::*;

const HEAD: &str = "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\n";

fn provider_yaml(name: &str, pattern: &str) -> String {
    format!("{HEAD}providers:\n- name: {name}\n  matchImages: [\"{pattern}\"]\n  defaultCacheDuration: 1m\n  apiVersion: {WIRE_V1}\n")
}

#[test]
fn config_directory_is_read_in_sorted_order() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("20-b.yaml"), provider_yaml("b", "b.io")).unwrap();
    std::fs::write(dir.path().join("10-a.json"), r#"{"apiVersion":"kubelet.config.k8s.io/v1beta1","kind":"CredentialProviderConfig","providers":[{"name":"a","matchImages":["a.io"],"defaultCacheDuration":"1m","apiVersion":"credentialprovider.kubelet.k8s.io/v1beta1"}]}"#).unwrap();
    std::fs::write(dir.path().join("30-c.yml"), provider_yaml("c", "c.io")).unwrap();
    std::fs::write(dir.path().join("README.md"), "not a config").unwrap();
    std::fs::create_dir(dir.path().join("sub.yaml")).unwrap();
    let cfg = load_provider_config(dir.path()).unwrap();
    let names: Vec<&str> = cfg.providers.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, vec!["a", "b", "c"]);
    std::fs::write(dir.path().join("40-dup.yaml"), provider_yaml("b", "d.io")).unwrap();
    let err = load_provider_config(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("40-dup.yaml") && err.contains("providers[0].name"),
        "{err}"
    );
}

#[test]
fn empty_directory_and_missing_file_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    assert!(matches!(
        load_provider_config(dir.path()),
        Err(LoadError::EmptyDirectory(_))
    ));
    assert!(matches!(
        load_provider_config(&dir.path().join("nope.yaml")),
        Err(LoadError::Read { .. })
    ));
}

/// A FIFO, a device or a file that grows without end is refused at once, never read whole
/// or waited on.
#[test]
fn config_files_are_regular_files_of_bounded_size() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.yaml");
    rustix::fs::mkfifoat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .unwrap();
    assert!(matches!(
        load_provider_config(&fifo),
        Err(LoadError::NotAFile(_))
    ));
    assert!(matches!(
        load_docker_config(&fifo),
        Err(LoadError::NotAFile(_))
    ));
    // A device everyone can write is refused before it is opened (the trust check), never read.
    assert!(matches!(
        load_docker_config(std::path::Path::new("/dev/zero")),
        Err(LoadError::NotAFile(_) | LoadError::Untrusted(_))
    ));
    let big = dir.path().join("big.json");
    let mut text = r#"{"auths":{"a.io":{"auth":""#.to_owned();
    text.push_str(&"A".repeat(credgate_engine::source::MAX_FILE as usize));
    text.push_str(r#""}}}"#);
    std::fs::write(&big, text).unwrap();
    let e = load_docker_config(&big).unwrap_err();
    assert!(matches!(e, LoadError::TooLarge { .. }), "{e}");
    assert!(e.to_string().contains("larger than"), "{e}");
}

#[tokio::test]
async fn docker_config_then_providers_in_keyring_order() {
    let dir = tempfile::tempdir().unwrap();
    let docker = dir.path().join("config.json");
    std::fs::write(
        &docker,
        r#"{"auths":{"*.example.com":{"auth":"ZG9ja2VyLXdpbGQ6cHc="},"https://registry.example.com/v2/":{"username":"docker","password":"pw"}}}"#,
    )
    .unwrap();
    counting_plugin(
        dir.path(),
        "first",
        &response(
            WIRE_V1,
            "Registry",
            None,
            &[("registry.example.com", "first", "p")],
        ),
    );
    counting_plugin(
        dir.path(),
        "second",
        &response(
            WIRE_V1,
            "Registry",
            None,
            &[
                ("registry.example.com/team", "second-team", "p"),
                ("registry.example.com", "second", "p"),
            ],
        ),
    );
    counting_plugin(
        dir.path(),
        "unrelated",
        &response(
            WIRE_V1,
            "Registry",
            None,
            &[("registry.example.com", "never", "p")],
        ),
    );
    let cfg = config(&[
        ("first", &["registry.example.com"], "10m", WIRE_V1),
        ("second", &["*.example.com"], "10m", WIRE_V1),
        ("unrelated", &["quay.io"], "10m", WIRE_V1),
    ]);
    let engine = Engine::builder()
        .config(cfg)
        .options(EngineOptions {
            plugin_dir: dir.path().to_owned(),
            ..Default::default()
        })
        .static_source(load_docker_config(&docker).unwrap())
        .build()
        .unwrap();
    let got = engine
        .lookup(&LookupRequest {
            image: "registry.example.com/team/app:v1",
            ..Default::default()
        })
        .await
        .unwrap();
    let order: Vec<(&str, &str)> = got
        .credentials
        .iter()
        .map(|c| (c.source.name(), c.username.as_str()))
        .collect();
    let docker_name = docker.display().to_string();
    assert_eq!(
        order,
        vec![
            ("second", "second-team"),
            (docker_name.as_str(), "docker"),
            ("first", "first"),
            ("second", "second"),
            (docker_name.as_str(), "docker-wild"),
        ]
    );
    assert!(matches!(got.credentials[1].source, Source::DockerConfig(_)));
    assert!(got.credentials[1].expires_at.is_none() && got.credentials[0].expires_at.is_some());
    assert_eq!(runs_of(dir.path(), "unrelated"), 0);
    assert!(!format!("{got:?}").contains("\"pw\""));
}

#[tokio::test]
async fn docker_hub_fallback_from_a_docker_config() {
    let dir = tempfile::tempdir().unwrap();
    let docker = dir.path().join("config.json");
    std::fs::write(
        &docker,
        r#"{"auths":{"https://index.docker.io/v1/":{"username":"hub","password":"pw"}}}"#,
    )
    .unwrap();
    let engine = Engine::builder()
        .static_source(load_docker_config(&docker).unwrap())
        .build()
        .unwrap();
    for (image, want) in [
        ("nginx:1.25", 1),
        ("team/app", 1),
        ("docker.io/x/y", 1),
        ("quay.io/x/y", 0),
    ] {
        let got = engine
            .lookup(&LookupRequest {
                image,
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(got.credentials.len(), want, "{image}");
    }
}

#[test]
fn bad_docker_config_names_the_file_not_the_secret() {
    let dir = tempfile::tempdir().unwrap();
    let docker = dir.path().join("config.json");
    std::fs::write(
        &docker,
        r#"{"auths":{"reg.io":{"auth":"c2VjcmV0LW5vLWNvbG9u"}}}"#,
    )
    .unwrap();
    let err = load_docker_config(&docker).unwrap_err().to_string();
    assert!(
        err.contains("config.json") && err.contains("reg.io"),
        "{err}"
    );
    assert!(!err.contains("secret-no-colon"));
}
