//! A load test on loopback, bounded in count and time: many concurrent clients over the real
//! socket doing a fixed number of lookups; no call may fail and memory must not keep growing.

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use credgate_agent::socket::{self, SocketAccess};
use credgate_agent::{server, Agent, AgentOptions, Sources};
use credgate_api::v1::credentials_client::CredentialsClient;
use credgate_api::v1::LookupRequest;

const CLIENTS: usize = 64;
const CONNECTIONS: usize = 8;
const ROUNDS: usize = 2;
const LOOKUPS_PER_CLIENT_PER_ROUND: usize = 150;

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_clients_no_errors_memory_stable() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = dir.path().join("reg");
    std::fs::write(&plugin, "#!/bin/sh\ncat >/dev/null\necho '{\"kind\":\"CredentialProviderResponse\",\"apiVersion\":\"credentialprovider.kubelet.k8s.io/v1\",\"cacheKeyType\":\"Registry\",\"cacheDuration\":\"1h\",\"auth\":{\"reg.example.com\":{\"username\":\"u\",\"password\":\"p\"}}}'\n").unwrap();
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let config = dir.path().join("c.yaml");
    std::fs::write(&config, "apiVersion: kubelet.config.k8s.io/v1\nkind: CredentialProviderConfig\nproviders:\n- name: reg\n  matchImages: [reg.example.com]\n  defaultCacheDuration: 1h\n  apiVersion: credentialprovider.kubelet.k8s.io/v1\n").unwrap();
    let agent = Agent::new(AgentOptions {
        sources: Sources {
            provider_config: Some(config),
            bin_dir: Some(dir.path().to_owned()),
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
    let path = dir.path().join("s.sock");
    let listener = socket::bind(&path, &SocketAccess::default()).await.unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let served = tokio::spawn(server::serve(agent.clone(), listener, stop.clone()));

    let mut channels = Vec::new();
    for _ in 0..CONNECTIONS {
        channels.push(credgate_api::connect(&path).await.unwrap());
    }
    let started = Instant::now();
    let mut rss = Vec::new();
    for round in 0..ROUNDS {
        let mut tasks = Vec::new();
        for c in 0..CLIENTS {
            let mut client = CredentialsClient::new(channels[c % CONNECTIONS].clone());
            tasks.push(tokio::spawn(async move {
                for i in 0..LOOKUPS_PER_CLIENT_PER_ROUND {
                    // 500 distinct images, all behind one Registry-keyed entry.
                    let image = format!("reg.example.com/team/app-{}:v1", (c * 31 + i) % 500);
                    let r = client
                        .lookup(LookupRequest {
                            image,
                            ..Default::default()
                        })
                        .await
                        .expect("no call fails under load")
                        .into_inner();
                    assert_eq!(r.credentials.len(), 1);
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        rss.push(rss_kib());
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "round {round} took too long"
        );
    }
    // The warm-up round allocates the memo and connection buffers; the second one reuses them.
    let growth = rss[1].saturating_sub(rss[0]);
    assert!(growth < 16 * 1024, "RSS grew by {growth} KiB: {rss:?}");
    assert_eq!(
        agent.engine().total_runs(),
        1,
        "one plugin run for the whole load"
    );

    stop.cancel();
    drop(channels);
    served.await.unwrap();
}
