//! Tables for decoding and validation: every rule of the kubelet, one case each.

use super::*;

const V1: &str = "kubelet.config.k8s.io/v1";
const WIRE_V1: &str = "credentialprovider.kubelet.k8s.io/v1";

fn yaml_provider(extra: &str) -> String {
    format!(
        "apiVersion: {V1}\nkind: CredentialProviderConfig\nproviders:\n- name: p\n  matchImages: [\"*.example.com\"]\n  defaultCacheDuration: 10m\n  apiVersion: {WIRE_V1}\n{extra}"
    )
}

fn issues(doc: &str) -> Vec<(String, String)> {
    match ProviderConfig::from_slice("c.yaml", doc.as_bytes()) {
        Err(ConfigError::Invalid(issues)) => {
            issues.into_iter().map(|i| (i.field, i.message)).collect()
        }
        other => panic!("expected validation issues, got {other:?}"),
    }
}

fn decode_err(doc: &str) -> ConfigError {
    ProviderConfig::from_slice("c.yaml", doc.as_bytes()).expect_err("must fail")
}

#[test]
fn decodes_all_versions_in_yaml_and_json() {
    for version in ["v1alpha1", "v1beta1", "v1"] {
        for wire in WireVersion::ALL {
            let yaml = format!(
                "apiVersion: kubelet.config.k8s.io/{version}\nkind: CredentialProviderConfig\nproviders:\n  - name: ecr\n    matchImages: [\"*.dkr.ecr.*.amazonaws.com\", \"registry.example.com:5000/team\"]\n    defaultCacheDuration: 12h\n    apiVersion: {}\n    args: [get-credentials]\n    env:\n      - name: AWS_PROFILE\n        value: temp\n",
                wire.as_str()
            );
            let json = format!(
                r#"{{"apiVersion":"kubelet.config.k8s.io/{version}","kind":"CredentialProviderConfig","providers":[{{"name":"ecr","matchImages":["*.dkr.ecr.*.amazonaws.com","registry.example.com:5000/team"],"defaultCacheDuration":"12h","apiVersion":"{}","args":["get-credentials"],"env":[{{"name":"AWS_PROFILE","value":"temp"}}]}}]}}"#,
                wire.as_str()
            );
            let a = ProviderConfig::from_slice("a.yaml", yaml.as_bytes()).unwrap();
            let b = ProviderConfig::from_slice("a.json", json.as_bytes()).unwrap();
            assert_eq!(a.providers, b.providers);
            let p = &a.providers[0];
            assert_eq!(p.name, "ecr");
            assert_eq!(p.api_version, wire);
            assert_eq!(
                p.default_cache_duration,
                std::time::Duration::from_secs(12 * 3600)
            );
            assert_eq!(p.args, vec!["get-credentials"]);
            assert_eq!(p.env, vec![("AWS_PROFILE".to_owned(), "temp".to_owned())]);
            assert_eq!(p.match_images.len(), 2);
            assert!(a.identity.starts_with("sha256:"));
        }
    }
}

#[test]
fn token_attributes_decode_under_v1() {
    let doc = yaml_provider(
        "  tokenAttributes:\n    serviceAccountTokenAudience: aud\n    cacheType: Token\n    requireServiceAccount: true\n    requiredServiceAccountAnnotationKeys: [example.com/role]\n    optionalServiceAccountAnnotationKeys: [example.com/extra]\n",
    );
    let cfg = ProviderConfig::from_slice("c.yaml", doc.as_bytes()).unwrap();
    let ta = cfg.providers[0].token_attributes.as_ref().unwrap();
    assert_eq!(ta.service_account_token_audience, "aud");
    assert_eq!(ta.cache_type, TokenCacheType::Token);
    assert!(ta.require_service_account);
    assert_eq!(ta.required_annotation_keys, vec!["example.com/role"]);
}

#[test]
fn token_attributes_unknown_in_older_config_versions() {
    let doc = yaml_provider(
        "  tokenAttributes:\n    serviceAccountTokenAudience: aud\n    cacheType: Token\n    requireServiceAccount: true\n",
    )
    .replace(V1, "kubelet.config.k8s.io/v1beta1");
    match decode_err(&doc) {
        ConfigError::Decode { field, message, .. } => {
            assert_eq!(field, "providers[0].tokenAttributes");
            assert!(message.contains("unknown field"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn strict_decoding_names_the_field() {
    let cases: &[(&str, &str, &str)] = &[
        (
            "  unknownField: 1\n",
            "providers[0].unknownField",
            "unknown field",
        ),
        ("  name: again\n", "providers[0].name", "duplicate field"),
        (
            "  env:\n  - name: A\n    value: b\n    extra: c\n",
            "providers[0].env[0].extra",
            "unknown field",
        ),
        ("  args: notalist\n", "providers[0].args", "invalid type"),
    ];
    for (extra, want_field, want_msg) in cases {
        match decode_err(&yaml_provider(extra)) {
            ConfigError::Decode { field, message, .. } => {
                assert_eq!(field, *want_field, "{extra}");
                assert!(message.contains(want_msg), "{extra}: {message}");
            }
            other => panic!("{extra}: {other:?}"),
        }
    }
    let json = format!(
        r#"{{"apiVersion":"{V1}","kind":"CredentialProviderConfig","providers":[],"bogus":true}}"#
    );
    match ProviderConfig::from_slice("c.json", json.as_bytes()).unwrap_err() {
        ConfigError::Decode { field, message, .. } => {
            assert_eq!(field, "bogus");
            assert!(message.starts_with("unknown field at line 1"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn decode_errors_do_not_echo_values() {
    let doc = yaml_provider("  env:\n  - name: TOKEN\n    value: [hunter2]\n");
    let err = decode_err(&doc).to_string();
    assert!(!err.contains("hunter2"), "{err}");
    let doc = yaml_provider("  tokenAttributes:\n    requireServiceAccount: hunter2\n");
    let err = decode_err(&doc).to_string();
    assert!(!err.contains("hunter2"), "{err}");
    assert!(err.contains("requireServiceAccount"), "{err}");
}

#[test]
fn wrong_kind_and_group() {
    let doc = yaml_provider("").replace(
        "kind: CredentialProviderConfig",
        "kind: KubeletConfiguration",
    );
    assert!(
        matches!(decode_err(&doc), ConfigError::WrongKind { kind, .. } if kind == "KubeletConfiguration")
    );
    let doc = yaml_provider("").replace(V1, "kubelet.k8s.io/v1");
    assert!(matches!(
        decode_err(&doc),
        ConfigError::WrongApiVersion { .. }
    ));
    let doc = yaml_provider("").replace(V1, "kubelet.config.k8s.io/v2");
    assert!(matches!(
        decode_err(&doc),
        ConfigError::WrongApiVersion { .. }
    ));
    assert!(matches!(
        decode_err("providers: []\n"),
        ConfigError::WrongApiVersion { .. }
    ));
    assert!(matches!(
        decode_err("{not json"),
        ConfigError::Decode { .. }
    ));
    assert!(matches!(decode_err("a: [\n"), ConfigError::Decode { .. }));
}

#[test]
fn every_validation_rule() {
    let head = format!("apiVersion: {V1}\nkind: CredentialProviderConfig\n");
    let p = |body: &str| format!("{head}providers:\n- {body}\n");
    let ok = format!("matchImages: [a.io]\n  defaultCacheDuration: 1m\n  apiVersion: {WIRE_V1}");
    let cases: Vec<(String, &str, &str)> = vec![
        (format!("{head}providers: []\n"), "providers", "at least 1"),
        (p(&format!("name: a/b\n  {ok}")), "providers[0].name", "cannot contain '/'"),
        (p(&format!("name: a b\n  {ok}")), "providers[0].name", "cannot contain spaces"),
        (p(&format!("name: .\n  {ok}")), "providers[0].name", "cannot be"),
        (p(&format!("name: ..\n  {ok}")), "providers[0].name", "cannot be"),
        (p(&ok), "providers[0].name", "required"),
        (
            format!("{head}providers:\n- name: a\n  {ok}\n- name: a\n  {ok}\n"),
            "providers[1].name",
            "duplicate",
        ),
        (p("name: a\n  matchImages: [a.io]\n  defaultCacheDuration: 1m"), "providers[0].apiVersion", "required"),
        (
            p("name: a\n  matchImages: [a.io]\n  defaultCacheDuration: 1m\n  apiVersion: credentialprovider.kubelet.k8s.io/v2"),
            "providers[0].apiVersion",
            "unsupported",
        ),
        (
            p(&format!("name: a\n  defaultCacheDuration: 1m\n  apiVersion: {WIRE_V1}")),
            "providers[0].matchImages",
            "at least 1",
        ),
        (
            p(&format!("name: a\n  matchImages: [\"a.io:abc\"]\n  defaultCacheDuration: 1m\n  apiVersion: {WIRE_V1}")),
            "providers[0].matchImages[0]",
            "invalid port",
        ),
        (
            p(&format!("name: a\n  matchImages: [a.io]\n  apiVersion: {WIRE_V1}")),
            "providers[0].defaultCacheDuration",
            "required",
        ),
        (
            p(&format!("name: a\n  matchImages: [a.io]\n  defaultCacheDuration: -1m\n  apiVersion: {WIRE_V1}")),
            "providers[0].defaultCacheDuration",
            "greater than or equal to 0",
        ),
        (
            p(&format!("name: a\n  matchImages: [a.io]\n  defaultCacheDuration: 10\n  apiVersion: {WIRE_V1}")),
            "providers[0].defaultCacheDuration",
            "missing unit",
        ),
    ];
    for (doc, field, msg) in cases {
        let got = issues(&doc);
        assert!(
            got.iter().any(|(f, m)| f == field && m.contains(msg)),
            "want {field}: {msg} in {got:?} for\n{doc}"
        );
    }
}

#[test]
fn token_attribute_rules() {
    let wire_beta = "credentialprovider.kubelet.k8s.io/v1beta1";
    let base = |wire: &str, ta: &str| {
        format!(
            "apiVersion: {V1}\nkind: CredentialProviderConfig\nproviders:\n- name: p\n  matchImages: [a.io]\n  defaultCacheDuration: 1m\n  apiVersion: {wire}\n  tokenAttributes:\n{ta}"
        )
    };
    let full = "    serviceAccountTokenAudience: aud\n    cacheType: ServiceAccount\n    requireServiceAccount: true\n";
    let at = "providers[0].tokenAttributes";
    let cases: Vec<(String, String, &str)> = vec![
        (base(wire_beta, full), at.into(), "only supported for"),
        (
            base(WIRE_V1, "    cacheType: Token\n    requireServiceAccount: true\n"),
            format!("{at}.serviceAccountTokenAudience"),
            "required",
        ),
        (
            base(WIRE_V1, "    serviceAccountTokenAudience: a\n    requireServiceAccount: true\n"),
            format!("{at}.cacheType"),
            "required",
        ),
        (
            base(WIRE_V1, "    serviceAccountTokenAudience: a\n    cacheType: token\n    requireServiceAccount: true\n"),
            format!("{at}.cacheType"),
            "unsupported",
        ),
        (
            base(WIRE_V1, "    serviceAccountTokenAudience: a\n    cacheType: Token\n"),
            format!("{at}.requireServiceAccount"),
            "required",
        ),
        (
            base(WIRE_V1, "    serviceAccountTokenAudience: a\n    cacheType: Token\n    requireServiceAccount: false\n    requiredServiceAccountAnnotationKeys: [a.io/x]\n"),
            format!("{at}.requiredServiceAccountAnnotationKeys"),
            "cannot be false",
        ),
        (
            base(WIRE_V1, &format!("{full}    requiredServiceAccountAnnotationKeys: [\"bad key\"]\n")),
            format!("{at}.requiredServiceAccountAnnotationKeys[0]"),
            "name part",
        ),
        (
            base(WIRE_V1, &format!("{full}    optionalServiceAccountAnnotationKeys: [\"Bad_Prefix/x\"]\n")),
            format!("{at}.optionalServiceAccountAnnotationKeys[0]"),
            "prefix part",
        ),
        (
            base(WIRE_V1, &format!("{full}    optionalServiceAccountAnnotationKeys: [a/b/c]\n")),
            format!("{at}.optionalServiceAccountAnnotationKeys[0]"),
            "at most one",
        ),
        (
            base(WIRE_V1, &format!("{full}    requiredServiceAccountAnnotationKeys: [a.io/x, a.io/x]\n")),
            format!("{at}.requiredServiceAccountAnnotationKeys[1]"),
            "duplicate",
        ),
        (
            base(WIRE_V1, &format!("{full}    requiredServiceAccountAnnotationKeys: [a.io/x]\n    optionalServiceAccountAnnotationKeys: [a.io/x]\n")),
            at.into(),
            "both required and optional",
        ),
    ];
    for (doc, field, msg) in cases {
        let got = issues(&doc);
        assert!(
            got.iter().any(|(f, m)| *f == field && m.contains(msg)),
            "want {field}: {msg} in {got:?} for\n{doc}"
        );
    }
}

#[test]
fn all_problems_reported_at_once() {
    let doc = format!(
        "apiVersion: {V1}\nkind: CredentialProviderConfig\nproviders:\n- name: a/b\n  matchImages: []\n  apiVersion: nope\n- name: ok\n  matchImages: [\"x:y\"]\n  defaultCacheDuration: -5s\n  apiVersion: {WIRE_V1}\n"
    );
    let got = issues(&doc);
    let fields: Vec<&str> = got.iter().map(|(f, _)| f.as_str()).collect();
    assert_eq!(
        fields,
        vec![
            "providers[0].name",
            "providers[0].apiVersion",
            "providers[0].matchImages",
            "providers[0].defaultCacheDuration",
            "providers[1].matchImages[0]",
            "providers[1].defaultCacheDuration",
        ]
    );
    let err = ProviderConfig::from_slice("c.yaml", doc.as_bytes()).unwrap_err();
    assert_eq!(err.lines().len(), 6);
    assert!(err.lines()[0].starts_with("c.yaml: providers[0].name: "));
}

#[test]
fn documents_concatenate_and_names_stay_unique() {
    let a = yaml_provider("");
    let b = yaml_provider("").replace("name: p", "name: q");
    let docs = [
        Document {
            name: "10-a.yaml",
            bytes: a.as_bytes(),
        },
        Document {
            name: "20-b.yaml",
            bytes: b.as_bytes(),
        },
    ];
    let cfg = ProviderConfig::from_documents(&docs).unwrap();
    let names: Vec<&str> = cfg.providers.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, vec!["p", "q"]);
    let docs = [
        Document {
            name: "10-a.yaml",
            bytes: a.as_bytes(),
        },
        Document {
            name: "20-b.yaml",
            bytes: a.as_bytes(),
        },
    ];
    match ProviderConfig::from_documents(&docs).unwrap_err() {
        ConfigError::Invalid(issues) => {
            assert_eq!(issues.len(), 1);
            assert_eq!(issues[0].document, "20-b.yaml");
            assert_eq!(issues[0].field, "providers[0].name");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        ProviderConfig::from_documents(&[]),
        Err(ConfigError::NoDocuments)
    );
}

#[test]
fn lints_for_patterns_that_never_match() {
    let doc = format!(
        "apiVersion: {V1}\nkind: CredentialProviderConfig\nproviders:\n- name: p\n  matchImages: [\"https://a.io\", \"a.io/*\", \"x.[a-.io\", \"ok.io\"]\n  defaultCacheDuration: 1m\n  apiVersion: {WIRE_V1}\n"
    );
    let cfg = ProviderConfig::from_slice("c.yaml", doc.as_bytes()).unwrap();
    let fields: Vec<&str> = cfg.lints.iter().map(|l| l.field.as_str()).collect();
    assert_eq!(
        fields,
        vec![
            "providers[0].matchImages[0]",
            "providers[0].matchImages[1]",
            "providers[0].matchImages[2]"
        ]
    );
}

#[test]
fn env_values_redacted_in_debug() {
    let doc = yaml_provider("  env:\n  - name: TOKEN\n    value: hunter2\n");
    let cfg = ProviderConfig::from_slice("c.yaml", doc.as_bytes()).unwrap();
    let dbg = format!("{cfg:?}");
    assert!(dbg.contains("TOKEN"));
    assert!(!dbg.contains("hunter2"), "{dbg}");
}

#[test]
fn qualified_names() {
    for ok in ["a", "a.b-c_d", "example.com/role", "a1/B2"] {
        assert!(is_qualified_name(ok).is_ok(), "{ok}");
    }
    for bad in [
        "",
        "-a",
        "a-",
        "/a",
        "a/",
        "UP.com/x",
        &"x".repeat(64),
        "a b",
    ] {
        assert!(is_qualified_name(bad).is_err(), "{bad}");
    }
}
