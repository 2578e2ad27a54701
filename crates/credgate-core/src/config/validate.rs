//! Validation of decoded providers: every rule of the kubelet, every problem collected into one
//! report, plus the lints for patterns that never match.

use std::collections::HashSet;

use super::raw::{Decoded, RawProvider, RawTokenAttributes};
use super::{
    ConfigError, ConfigIssue, ConfigLint, ProviderSpec, TokenAttributes, TokenCacheType,
    WireVersion,
};
use crate::duration::GoDuration;
use crate::pattern::Pattern;

/// Collects issues for one document.
struct Report<'a> {
    document: &'a str,
    issues: &'a mut Vec<ConfigIssue>,
}

impl Report<'_> {
    fn add(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.issues.push(ConfigIssue {
            document: self.document.to_owned(),
            field: field.into(),
            message: message.into(),
        });
    }
}

pub(super) fn validate(
    docs: &[(&str, Decoded)],
) -> Result<(Vec<ProviderSpec>, Vec<ConfigLint>), ConfigError> {
    let mut issues = Vec::new();
    let mut lints = Vec::new();
    let mut specs = Vec::new();
    let mut seen = HashSet::new();
    let total: usize = docs.iter().map(|(_, d)| d.providers.len()).sum();
    if total == 0 {
        let document = docs.last().map(|(n, _)| *n).unwrap_or_default();
        Report {
            document,
            issues: &mut issues,
        }
        .add("providers", "at least 1 item in providers is required");
    }
    for (document, decoded) in docs {
        let mut report = Report {
            document,
            issues: &mut issues,
        };
        for (i, raw) in decoded.providers.iter().enumerate() {
            let at = format!("providers[{i}]");
            if !seen.insert(raw.name.as_str()) {
                report.add(
                    format!("{at}.name"),
                    format!("duplicate provider name {:?}", raw.name),
                );
            }
            if let Some(spec) = provider(&mut report, &at, raw) {
                lints.extend(pattern_lints(document, &at, &spec));
                specs.push(spec);
            }
        }
    }
    if issues.is_empty() {
        Ok((specs, lints))
    } else {
        Err(ConfigError::Invalid(issues))
    }
}

fn provider(report: &mut Report<'_>, at: &str, raw: &RawProvider) -> Option<ProviderSpec> {
    let before = report.issues.len();
    check_name(report, at, &raw.name);
    let api_version = wire_version(report, at, &raw.api_version);
    let patterns = match_images(report, at, &raw.match_images);
    let duration = cache_duration(report, at, raw.default_cache_duration.as_deref());
    let token_attributes = raw
        .token_attributes
        .as_ref()
        .and_then(|t| token_attributes(report, &format!("{at}.tokenAttributes"), t, api_version));
    if report.issues.len() != before {
        return None;
    }
    Some(ProviderSpec {
        name: raw.name.clone(),
        match_images: patterns,
        default_cache_duration: duration?,
        api_version: api_version?,
        args: raw.args.clone(),
        env: raw
            .env
            .iter()
            .map(|e| (e.name.clone(), e.value.clone()))
            .collect(),
        token_attributes,
    })
}

fn check_name(report: &mut Report<'_>, at: &str, name: &str) {
    let field = format!("{at}.name");
    if name.is_empty() {
        report.add(&field, "required");
    }
    if name.contains('/') {
        report.add(&field, format!("provider name {name:?} cannot contain '/'"));
    }
    if name.contains(' ') {
        report.add(
            &field,
            format!("provider name {name:?} cannot contain spaces"),
        );
    }
    if name == "." || name == ".." {
        report.add(&field, format!("provider name cannot be {name:?}"));
    }
}

fn wire_version(report: &mut Report<'_>, at: &str, api_version: &str) -> Option<WireVersion> {
    if api_version.is_empty() {
        report.add(format!("{at}.apiVersion"), "required");
        return None;
    }
    let v = WireVersion::parse(api_version);
    if v.is_none() {
        let supported: Vec<&str> = WireVersion::ALL.iter().map(|v| v.as_str()).collect();
        report.add(
            format!("{at}.apiVersion"),
            format!(
                "unsupported value {api_version:?}, supported: {}",
                supported.join(", ")
            ),
        );
    }
    v
}

fn match_images(report: &mut Report<'_>, at: &str, images: &[String]) -> Vec<Pattern> {
    if images.is_empty() {
        report.add(
            format!("{at}.matchImages"),
            "at least 1 item in matchImages is required",
        );
    }
    let mut out = Vec::with_capacity(images.len());
    for (j, image) in images.iter().enumerate() {
        match Pattern::parse(image) {
            Ok(p) => out.push(p),
            Err(e) => report.add(
                format!("{at}.matchImages[{j}]"),
                format!("match image {image:?} is invalid: {e}"),
            ),
        }
    }
    out
}

fn cache_duration(
    report: &mut Report<'_>,
    at: &str,
    raw: Option<&str>,
) -> Option<std::time::Duration> {
    let field = format!("{at}.defaultCacheDuration");
    let Some(raw) = raw else {
        report.add(field, "required");
        return None;
    };
    match GoDuration::parse(raw) {
        Ok(d) if d.is_negative() => {
            report.add(field, format!("{raw:?} must be greater than or equal to 0"));
            None
        }
        Ok(d) => d.to_std(),
        Err(e) => {
            report.add(field, e.to_string());
            None
        }
    }
}

fn token_attributes(
    report: &mut Report<'_>,
    at: &str,
    raw: &RawTokenAttributes,
    api_version: Option<WireVersion>,
) -> Option<TokenAttributes> {
    if api_version.is_some_and(|v| v != WireVersion::V1) {
        report.add(
            at,
            format!(
                "tokenAttributes is only supported for {}",
                WireVersion::V1.as_str()
            ),
        );
    }
    if raw.service_account_token_audience.is_empty() {
        report.add(format!("{at}.serviceAccountTokenAudience"), "required");
    }
    let cache_type = match raw.cache_type.as_str() {
        "ServiceAccount" => Some(TokenCacheType::ServiceAccount),
        "Token" => Some(TokenCacheType::Token),
        "" => {
            report.add(format!("{at}.cacheType"), "required");
            None
        }
        other => {
            report.add(
                format!("{at}.cacheType"),
                format!("unsupported value {other:?}, supported: ServiceAccount, Token"),
            );
            None
        }
    };
    if raw.require_service_account.is_none() {
        report.add(format!("{at}.requireServiceAccount"), "required");
    }
    let required = &raw.required_service_account_annotation_keys;
    let optional = &raw.optional_service_account_annotation_keys;
    if raw.require_service_account == Some(false) && !required.is_empty() {
        report.add(
            format!("{at}.requiredServiceAccountAnnotationKeys"),
            "requireServiceAccount cannot be false when requiredServiceAccountAnnotationKeys is set",
        );
    }
    annotation_keys(
        report,
        &format!("{at}.requiredServiceAccountAnnotationKeys"),
        required,
    );
    annotation_keys(
        report,
        &format!("{at}.optionalServiceAccountAnnotationKeys"),
        optional,
    );
    let mut both: Vec<&String> = required.iter().filter(|k| optional.contains(k)).collect();
    both.sort();
    both.dedup();
    if !both.is_empty() {
        report.add(
            at,
            format!("annotation keys {both:?} cannot be both required and optional"),
        );
    }
    Some(TokenAttributes {
        service_account_token_audience: raw.service_account_token_audience.clone(),
        cache_type: cache_type?,
        require_service_account: raw.require_service_account?,
        required_annotation_keys: required.clone(),
        optional_annotation_keys: optional.clone(),
    })
}

fn annotation_keys(report: &mut Report<'_>, field: &str, keys: &[String]) {
    let mut seen = HashSet::new();
    for (i, key) in keys.iter().enumerate() {
        if let Err(why) = is_qualified_name(&key.to_lowercase()) {
            report.add(format!("{field}[{i}]"), format!("{key:?}: {why}"));
        }
        if !seen.insert(key) {
            report.add(format!("{field}[{i}]"), format!("duplicate value {key:?}"));
        }
    }
}

/// Kubernetes' qualified name: an optional DNS-1123 subdomain prefix and `/`, then a name of at
/// most 63 characters, alphanumeric at both ends, with `-`, `_` and `.` inside.
pub fn is_qualified_name(value: &str) -> Result<(), NameError> {
    let (prefix, name) = match value.split('/').collect::<Vec<_>>()[..] {
        [name] => (None, name),
        [prefix, name] => (Some(prefix), name),
        _ => return Err(NameError::Slashes),
    };
    if let Some(prefix) = prefix {
        if prefix.is_empty() || prefix.len() > 253 || !prefix.split('.').all(dns_label) {
            return Err(NameError::Prefix);
        }
    }
    let b = name.as_bytes();
    if b.is_empty() || b.len() > 63 {
        return Err(NameError::Length);
    }
    let inner_ok = b
        .iter()
        .all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(c));
    if !inner_ok || !b[0].is_ascii_alphanumeric() || !b[b.len() - 1].is_ascii_alphanumeric() {
        return Err(NameError::Characters);
    }
    Ok(())
}

/// Why a value is not a Kubernetes qualified name ([`is_qualified_name`]); the words are
/// Kubernetes' own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("a qualified name has at most one '/'")]
    Slashes,
    #[error("prefix part must be a lowercase RFC 1123 subdomain")]
    Prefix,
    #[error("name part must be non-empty and at most 63 characters")]
    Length,
    #[error("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character")]
    Characters,
}

fn dns_label(l: &str) -> bool {
    let b = l.as_bytes();
    let ok = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !b.is_empty() && ok(&b[0]) && ok(&b[b.len() - 1]) && b.iter().all(|c| ok(c) || *c == b'-')
}

fn pattern_lints<'a>(
    document: &'a str,
    at: &'a str,
    spec: &'a ProviderSpec,
) -> impl Iterator<Item = ConfigLint> + 'a {
    spec.match_images
        .iter()
        .enumerate()
        .flat_map(move |(j, p)| {
            p.lints().into_iter().map(move |lint| ConfigLint {
                document: document.to_owned(),
                field: format!("{at}.matchImages[{j}]"),
                pattern: p.as_str().to_owned(),
                lint,
            })
        })
}
