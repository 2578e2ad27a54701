//! Service-account mode (KEP-4412): scoped cache keys, required annotations, token echo.

use std::collections::BTreeMap;
use std::time::Duration;

use credgate_engine::{Engine, LookupRequest, ProviderError, ServiceAccount};
use secrecy::SecretString;

use crate::common::*;

const IMG: &str = "registry.example.com/team/app:v1";

fn sa_engine(
    cache_type: &str,
    require: bool,
    echo_token: bool,
) -> (Engine, std::sync::Arc<FakeRunner>) {
    let runner = FakeRunner::new(Duration::ZERO, move |req, _| {
        let v: serde_json::Value = serde_json::from_str(req).unwrap();
        let password = if echo_token {
            v["serviceAccountToken"].as_str().unwrap_or("p").to_owned()
        } else {
            "p".to_owned()
        };
        Ok(response(
            WIRE_V1,
            "Registry",
            None,
            &[("registry.example.com", "u", &password)],
        ))
    });
    let extra = format!(
        "  tokenAttributes:\n    serviceAccountTokenAudience: registry\n    cacheType: {cache_type}\n    requireServiceAccount: {require}\n{}    optionalServiceAccountAnnotationKeys: [example.com/opt]\n",
        if require { "    requiredServiceAccountAnnotationKeys: [example.com/role]\n" } else { "" }
    );
    let engine = Engine::builder()
        .config(config_with(
            &[("p", &["registry.example.com"], "10m", WIRE_V1)],
            &extra,
        ))
        .runner(runner.clone())
        .build()
        .unwrap();
    (engine, runner)
}

fn sa(name: &str, token: &str, role: Option<&str>) -> ServiceAccount {
    let mut annotations = BTreeMap::from([("unrelated".to_owned(), "x".to_owned())]);
    if let Some(role) = role {
        annotations.insert("example.com/role".to_owned(), role.to_owned());
    }
    ServiceAccount {
        namespace: "ns".into(),
        name: name.into(),
        uid: format!("uid-{name}"),
        token: SecretString::from(token),
        annotations,
    }
}

async fn ask(engine: &Engine, account: Option<&ServiceAccount>) -> credgate_engine::Lookup {
    engine
        .lookup(&LookupRequest {
            image: IMG,
            service_account: account,
            ..Default::default()
        })
        .await
        .unwrap()
}

#[tokio::test]
async fn required_account_missing_means_no_run() {
    let (engine, runner) = sa_engine("ServiceAccount", true, false);
    let got = ask(&engine, None).await;
    assert!(got.credentials.is_empty() && got.errors.is_empty());
    assert_eq!(runner.runs(), 0);
}

#[tokio::test]
async fn missing_required_annotation_means_no_run() {
    let (engine, runner) = sa_engine("ServiceAccount", true, false);
    let got = ask(&engine, Some(&sa("a", "t1", None))).await;
    assert!(
        matches!(&got.errors[0], ProviderError::MissingAnnotation { key, .. } if key == "example.com/role")
    );
    assert_eq!(runner.runs(), 0);
}

#[tokio::test]
async fn request_carries_token_and_selected_annotations_only() {
    let (engine, runner) = sa_engine("ServiceAccount", true, false);
    let got = ask(&engine, Some(&sa("a", "t1", Some("admin")))).await;
    assert_eq!(got.credentials.len(), 1, "{:?}", got.errors);
    let req: serde_json::Value = serde_json::from_str(&runner.requests.lock().unwrap()[0]).unwrap();
    assert_eq!(req["serviceAccountToken"], "t1");
    assert_eq!(
        req["serviceAccountAnnotations"],
        serde_json::json!({"example.com/role": "admin"})
    );
}

#[tokio::test]
async fn cache_is_scoped_per_account() {
    let (engine, runner) = sa_engine("ServiceAccount", true, false);
    ask(&engine, Some(&sa("a", "t1", Some("r")))).await;
    ask(&engine, Some(&sa("a", "t2", Some("r")))).await;
    assert_eq!(
        runner.runs(),
        1,
        "ServiceAccount cacheType ignores the token"
    );
    ask(&engine, Some(&sa("b", "t1", Some("r")))).await;
    assert_eq!(runner.runs(), 2);
    ask(&engine, Some(&sa("a", "t1", Some("other-role")))).await;
    assert_eq!(runner.runs(), 3, "selected annotations are part of the key");
}

#[tokio::test]
async fn token_cache_type_keys_on_the_token() {
    let (engine, runner) = sa_engine("Token", true, true);
    ask(&engine, Some(&sa("a", "t1", Some("r")))).await;
    ask(&engine, Some(&sa("a", "t1", Some("r")))).await;
    ask(&engine, Some(&sa("a", "t2", Some("r")))).await;
    assert_eq!(runner.runs(), 2);
}

#[tokio::test]
async fn echoed_token_is_rejected_unless_token_keyed() {
    let (engine, _) = sa_engine("ServiceAccount", true, true);
    let got = ask(&engine, Some(&sa("a", "tok-secret", Some("r")))).await;
    assert!(matches!(got.errors[0], ProviderError::TokenEchoed { .. }));
    assert!(!format!("{:?} {}", got, got.errors[0]).contains("tok-secret"));
}

#[tokio::test]
async fn optional_account_runs_without_one() {
    let (engine, runner) = sa_engine("ServiceAccount", false, false);
    let got = ask(&engine, None).await;
    assert_eq!(got.credentials.len(), 1);
    let req: serde_json::Value = serde_json::from_str(&runner.requests.lock().unwrap()[0]).unwrap();
    assert!(req.get("serviceAccountToken").is_none());
    assert!(!format!("{:?}", sa("a", "tok-secret", None)).contains("tok-secret"));
}
