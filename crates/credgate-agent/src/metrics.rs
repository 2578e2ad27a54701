//! The agent's metric families (served at `/metrics` by [`crate::scrape`]).
//! Labels never carry credentials or image names: refs are unbounded and their per-ref state
//! is served by `ListTracked` instead.

use std::collections::HashMap;
use std::sync::Arc;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;

use crate::refusal::SourceLabel;
use crate::saved_cache::DropReason;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Whether a renewal or a reload succeeded (`result`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttemptResult {
    Success,
    Failure,
}

impl AttemptResult {
    pub fn of(success: bool) -> AttemptResult {
        if success {
            AttemptResult::Success
        } else {
            AttemptResult::Failure
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            AttemptResult::Success => "success",
            AttemptResult::Failure => "failure",
        }
    }
}

/// A gRPC code as a label: its canonical name ([`code_name`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Code(pub tonic::Code);

impl Code {
    pub fn as_str(self) -> &'static str {
        code_name(self.0)
    }
}

credgate_engine::label_values!(AttemptResult, Code, DropReason);

/// `version` of the running agent.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: &'static str,
}

/// `result` and `auth` of a read through the registry mirror.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct MirrorLabels {
    pub result: &'static str,
    pub auth: &'static str,
}

/// `result` of a renewal or a reload.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct AttemptLabels {
    pub result: AttemptResult,
}

/// `result` of a guard decision or a verification (the guard's own enums' names).
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

/// `caller` of a lookup ([`CALLERS`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct CallerLabels {
    pub caller: &'static str,
}

/// `source` of a refused credential.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct SourceLabels {
    pub source: SourceLabel,
}

/// `outcome` of a consumer's report of a refused credential.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

/// What a registry `said` when asked to confirm a refusal.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct SaidLabels {
    pub said: &'static str,
}

/// `reason` a saved provider answer was not restored.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct DropLabels {
    pub reason: DropReason,
}

/// An API call's `method` and `code`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct RpcLabels {
    pub method: &'static str,
    pub code: Code,
}

/// An API call's `method`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct MethodLabels {
    pub method: &'static str,
}

/// Every method of the API, so that their handles exist before the first call.
pub const METHODS: &[&str] = &[
    "Lookup",
    "Track",
    "Untrack",
    "SetTracked",
    "ListTracked",
    "Watch",
    "Health",
    "Version",
    "Status",
    "Reload",
    "ListCaptured",
    "ForgetCaptured",
    "Explain",
    "ListPulls",
    "Flush",
    "ReportRefused",
    "CheckAccess",
    "RecordPullIntent",
    "RecordPullResult",
    "Verify",
    "Prune",
    "ListRecords",
    "GetRecord",
    "DeleteRecord",
];

/// Handles of one method's successful calls, taken once so the hot path neither allocates
/// labels nor locks the family.
#[derive(Clone)]
struct MethodHandles {
    ok: Counter,
    seconds: Histogram,
}

/// The agent's own families (the engine's are registered beside them).
#[derive(Clone)]
pub struct AgentMetrics {
    pub renewals: Family<AttemptLabels, Counter>,
    pub tracked_refs: Gauge,
    /// Tracked refs within their renewal lead of expiry (renewal late), at the last scrape.
    pub tracked_refs_due: Gauge,
    /// 1 when the guard's store is readable (or the guard is off), 0 when it is not.
    pub guard_store_available: Gauge,
    pub watchers: Gauge,
    /// Watch streams ended because their client did not read.
    pub watchers_dropped: Counter,
    pub rpcs: Family<RpcLabels, Counter>,
    pub rpc_seconds: Family<MethodLabels, Histogram, fn() -> Histogram>,
    pub reloads: Family<AttemptLabels, Counter>,
    /// Reads through the node's registry mirror, by result and the source of the credential.
    pub mirror_requests: Family<MirrorLabels, Counter>,
    /// 1 while the agent serves without the provider config it was given, which it refused
    /// at start (with the CRI proxy it serves on rather than exit); 0 once a reload takes it.
    pub config_refused: Gauge,
    pub guard_decisions: Family<ResultLabels, Counter>,
    pub guard_records: Gauge,
    /// Image names dropped from a record that held its most, the oldest first.
    pub guard_names_dropped: Counter,
    pub guard_intents: Gauge,
    pub verifications: Family<ResultLabels, Counter>,
    /// Lookups by caller kind (kubelet, docker-helper, api).
    pub lookups: Family<CallerLabels, Counter>,
    callers: Arc<[Counter; 3]>,
    /// Credentials a registry refused, by the source that gave them (provider, captured,
    /// docker_config): what the agent dropped, forgot or reported.
    pub credentials_refused: Family<SourceLabels, Counter>,
    /// Consumers' reports of a refused credential, by outcome.
    pub refusal_reports: Family<OutcomeLabels, Counter>,
    /// Registry confirmations of a refusal (a pull's or a report's), by what the registry said.
    pub refusal_confirmations: Family<SaidLabels, Counter>,
    /// Provider answers dropped by `ctl flush`.
    pub cache_flushed: Counter,
    /// 1, labelled with the agent's version: what runs where (`credgate_build_info`).
    pub build_info: Family<BuildLabels, Gauge>,
    /// Provider answers restored from the sealed cache at start.
    pub cache_restored: Counter,
    /// Saved provider answers not restored, by reason.
    pub cache_dropped_total: Family<DropLabels, Counter>,
    /// Provider answers written to the sealed cache (each save counts what it wrote).
    pub cache_persisted: Counter,
    /// Open and closed connections, by listener.
    pub connections: credgate_listener::ConnectionMetrics,
    methods: Arc<HashMap<&'static str, MethodHandles>>,
    decisions: Arc<HashMap<&'static str, Counter>>,
}

/// Every caller kind lookups are counted by.
pub const CALLERS: [&str; 3] = ["kubelet", "docker-helper", "api"];

/// Every result of a guard decision.
pub const DECISIONS: &[&str] = &["allow", "must_authenticate", "refuse", "pull"];

fn rpc_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_05, 2.0, 18))
}

impl Default for AgentMetrics {
    fn default() -> Self {
        let rpcs: Family<RpcLabels, Counter> = Family::default();
        let rpc_seconds: Family<MethodLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(rpc_histogram as fn() -> Histogram);
        let methods = METHODS
            .iter()
            .map(|m| {
                let handles = MethodHandles {
                    ok: rpcs
                        .get_or_create(&RpcLabels {
                            method: m,
                            code: Code(tonic::Code::Ok),
                        })
                        .clone(),
                    seconds: rpc_seconds
                        .get_or_create(&MethodLabels { method: m })
                        .clone(),
                };
                (*m, handles)
            })
            .collect();
        let guard_decisions: Family<ResultLabels, Counter> = Family::default();
        let lookups: Family<CallerLabels, Counter> = Family::default();
        let decisions = DECISIONS
            .iter()
            .map(|d| {
                let counter = guard_decisions.get_or_create(&ResultLabels { result: d });
                (*d, counter.clone())
            })
            .collect();
        // Both results exist from the start at 0: an alert that compares failures with
        // successes, or takes the increase of the first failure, needs both series before
        // either happens.
        let renewals: Family<AttemptLabels, Counter> = Family::default();
        let reloads: Family<AttemptLabels, Counter> = Family::default();
        for success in [true, false] {
            let labels = AttemptLabels {
                result: AttemptResult::of(success),
            };
            let _ = renewals.get_or_create(&labels);
            let _ = reloads.get_or_create(&labels);
        }
        AgentMetrics {
            renewals,
            tracked_refs: Gauge::default(),
            tracked_refs_due: Gauge::default(),
            guard_store_available: Gauge::default(),
            watchers: Gauge::default(),
            watchers_dropped: Counter::default(),
            rpcs,
            rpc_seconds,
            reloads,
            config_refused: Gauge::default(),
            mirror_requests: Family::default(),
            guard_decisions,
            guard_records: Gauge::default(),
            guard_names_dropped: Counter::default(),
            guard_intents: Gauge::default(),
            verifications: Family::default(),
            callers: Arc::new(
                CALLERS.map(|c| lookups.get_or_create(&CallerLabels { caller: c }).clone()),
            ),
            lookups,
            credentials_refused: {
                let f = Family::default();
                for source in SourceLabel::ALL {
                    let _ = f.get_or_create(&SourceLabels { source });
                }
                f
            },
            refusal_reports: Family::default(),
            refusal_confirmations: Family::default(),
            cache_flushed: Counter::default(),
            build_info: {
                let f: Family<BuildLabels, Gauge> = Family::default();
                f.get_or_create(&BuildLabels {
                    version: env!("CARGO_PKG_VERSION"),
                })
                .set(1);
                f
            },
            cache_restored: Counter::default(),
            cache_dropped_total: Family::default(),
            cache_persisted: Counter::default(),
            connections: Default::default(),
            methods: Arc::new(methods),
            decisions: Arc::new(decisions),
        }
    }
}

impl AgentMetrics {
    /// Registers every family under the `credgate_` prefix.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("credgate");
        self.register_pull_credentials(r);
        self.register_build(r);
        self.register_cache(r);
        self.register_renewal(r);
        self.register_guard(r);
        self.register_api(r);
    }

    /// Refused credentials: what became of them, and what registries said.
    fn register_pull_credentials(&self, r: &mut Registry) {
        r.register(
            "credentials_refused",
            "Credentials a registry refused, by the source that gave them: a provider's answer dropped (its plugin runs again), a captured credential forgotten, a docker config entry reported",
            self.credentials_refused.clone(),
        );
        r.register(
            "refusal_reports",
            "Consumers' reports of a refused credential (ReportRefused) by outcome (refused, accepted, unchecked, not_given, already_refused, unreachable)",
            self.refusal_reports.clone(),
        );
        r.register(
            "refusal_confirmations",
            "What registries said, asked whether they refuse a credential itself before a refusal acts (refused, accepted, unchecked, unreachable)",
            self.refusal_confirmations.clone(),
        );
    }

    /// What runs.
    fn register_build(&self, r: &mut Registry) {
        r.register(
            "build_info",
            "The running agent's version (value 1)",
            self.build_info.clone(),
        );
    }

    /// The provider cache: flushes, and the sealed copy saved and restored.
    fn register_cache(&self, r: &mut Registry) {
        r.register(
            "cache_flushed",
            "Provider answers dropped by an operator (ctl flush)",
            self.cache_flushed.clone(),
        );
        r.register(
            "cache_restored",
            "Provider answers restored from the sealed cache at start (served with no plugin run)",
            self.cache_restored.clone(),
        );
        r.register(
            "cache_dropped",
            "Saved provider answers not restored, by reason (provider_gone, config_changed, expired, invalid, node_key, refused, consumer_invalid)",
            self.cache_dropped_total.clone(),
        );
        r.register(
            "cache_persisted",
            "Provider answers written to the sealed cache, summed over saves",
            self.cache_persisted.clone(),
        );
    }

    /// Renewal of tracked refs and the Watch streams that carry it.
    fn register_renewal(&self, r: &mut Registry) {
        r.register(
            "renewals",
            "Renewals of tracked refs by result (success, failure)",
            self.renewals.clone(),
        );
        r.register(
            "tracked_refs",
            "Refs tracked for renewal, including those in their grace period",
            self.tracked_refs.clone(),
        );
        r.register(
            "tracked_refs_due",
            "Tracked refs whose credentials are within their renewal lead of expiry (renewal is late)",
            self.tracked_refs_due.clone(),
        );
        r.register("watch_streams", "Open Watch streams", self.watchers.clone());
        r.register(
            "watch_streams_dropped",
            "Watch streams ended because their client did not read them",
            self.watchers_dropped.clone(),
        );
    }

    /// The image access guard.
    fn register_guard(&self, r: &mut Registry) {
        r.register(
            "guard_store_available",
            "1 when the image access guard's store is readable (or the guard is off), else 0",
            self.guard_store_available.clone(),
        );
        r.register(
            "guard_decisions",
            "Image access decisions by result (allow, must_authenticate, refuse, pull)",
            self.guard_decisions.clone(),
        );
        r.register(
            "guard_records",
            "Pull records stored",
            self.guard_records.clone(),
        );
        r.register(
            "guard_names_dropped",
            "Image names dropped from a pull record that held its most (64), the one changed longest ago first",
            self.guard_names_dropped.clone(),
        );
        r.register(
            "guard_intents",
            "Pull intents stored",
            self.guard_intents.clone(),
        );
        r.register(
            "guard_verifications",
            "Verifications against registries by result",
            self.verifications.clone(),
        );
    }

    /// Calls, connections and reloads.
    fn register_api(&self, r: &mut Registry) {
        r.register(
            "rpc_requests",
            "API calls by method and gRPC status code",
            self.rpcs.clone(),
        );
        r.register(
            "rpc_duration_seconds",
            "API call handling time by method",
            self.rpc_seconds.clone(),
        );
        r.register(
            "lookups",
            "Lookups by caller kind: kubelet (the credential provider bridge), docker-helper, api",
            self.lookups.clone(),
        );
        self.connections.register(r);
        r.register(
            "config_reloads",
            "Provider config reloads by result (success, failure)",
            self.reloads.clone(),
        );
        r.register(
            "mirror_requests",
            "Reads through the registry mirror by result (forwarded, unauthorized, caller_refused, not_served, not_a_read, upstream_unreachable) and auth (captured, provider, docker_config, anonymous, none)",
            self.mirror_requests.clone(),
        );
        r.register(
            "config_refused",
            "1 while the agent serves without the provider config it refused at start",
            self.config_refused.clone(),
        );
    }

    /// Counts a credential a registry refused, by its source.
    pub fn refused(&self, source: SourceLabel) {
        self.credentials_refused
            .get_or_create(&SourceLabels { source })
            .inc();
    }

    /// Counts a consumer's report of a refused credential.
    pub fn refusal_report(&self, outcome: &'static str) {
        self.refusal_reports
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    /// Counts a registry's answer to a confirmation of a refusal.
    pub fn refusal_confirmation(&self, said: &'static str) {
        self.refusal_confirmations
            .get_or_create(&SaidLabels { said })
            .inc();
    }

    /// Counts a renewal.
    pub fn renewal(&self, success: bool) {
        self.renewals
            .get_or_create(&AttemptLabels {
                result: AttemptResult::of(success),
            })
            .inc();
    }

    /// Counts a guard decision.
    pub fn guard_decision(&self, result: &'static str) {
        match self.decisions.get(result) {
            Some(c) => {
                c.inc();
            }
            None => {
                self.guard_decisions
                    .get_or_create(&ResultLabels { result })
                    .inc();
            }
        }
    }

    /// Counts saved provider answers not restored.
    pub fn cache_dropped(&self, reason: DropReason, n: u64) {
        self.cache_dropped_total
            .get_or_create(&DropLabels { reason })
            .inc_by(n);
    }

    /// Counts a verification.
    pub fn verification(&self, result: &'static str) {
        self.verifications
            .get_or_create(&ResultLabels { result })
            .inc();
    }

    /// Counts a read through the registry mirror.
    pub fn mirror_request(&self, result: &'static str, auth: &'static str) {
        self.mirror_requests
            .get_or_create(&MirrorLabels { result, auth })
            .inc();
    }

    /// Counts a lookup by who asked: `kubelet`, `docker-helper`, anything else is `api`.
    pub fn lookup_by(&self, caller: &str) {
        let i = CALLERS.iter().position(|c| *c == caller).unwrap_or(2);
        self.callers[i].inc();
    }

    /// Counts a reload.
    pub fn reload(&self, success: bool) {
        self.reloads
            .get_or_create(&AttemptLabels {
                result: AttemptResult::of(success),
            })
            .inc();
    }

    /// Counts a finished call.
    pub fn rpc(&self, method: &'static str, code: tonic::Code, seconds: f64) {
        match self.methods.get(method) {
            Some(h) => {
                if code == tonic::Code::Ok {
                    h.ok.inc();
                } else {
                    self.rpcs
                        .get_or_create(&RpcLabels {
                            method,
                            code: Code(code),
                        })
                        .inc();
                }
                h.seconds.observe(seconds);
            }
            None => {
                self.rpcs
                    .get_or_create(&RpcLabels {
                        method,
                        code: Code(code),
                    })
                    .inc();
                self.rpc_seconds
                    .get_or_create(&MethodLabels { method })
                    .observe(seconds);
            }
        }
    }
}

/// The canonical upper-case name of a gRPC code, as grpc-go's metrics label it.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Renders a registry in the text exposition format.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    encode(&mut out, registry).expect("writing to a String cannot fail");
    out
}
