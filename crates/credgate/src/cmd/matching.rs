//! `credgate match PATTERN IMAGE`: the kubelet's matching rule, for debugging patterns.

use anyhow::Result;
use credgate_core::pattern::{parse_schemeless, Pattern, Target};
use credgate_core::reference::ImageRef;

use crate::opts::MatchArgs;
use crate::Outcome;

pub fn run(args: MatchArgs) -> Result<Outcome> {
    let pattern = match Pattern::parse(&args.pattern) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: pattern {:?} is invalid: {e}", args.pattern);
            return Ok(Outcome::Usage);
        }
    };
    if looks_like_host(&args.image) {
        return report(&args, &pattern, host_target_matches(&pattern, &args.image));
    }
    let matched = match ImageRef::parse(&args.image) {
        Ok(image) => pattern.matches(&Target::from_image_name(image.name())),
        Err(ref_err) => match parse_schemeless(&args.image) {
            Ok(parts) => pattern.matches(&Target::from_parts(&parts)),
            Err(_) => {
                eprintln!(
                    "error: {:?} is neither an image nor a registry host: {ref_err}",
                    args.image
                );
                return Ok(Outcome::Usage);
            }
        },
    };
    report(&args, &pattern, matched)
}

/// A bare `host[:port]` with a dot or `localhost` before the colon is a registry host (what a
/// docker credential helper is asked about), not a Docker Hub image name.
fn looks_like_host(s: &str) -> bool {
    let host = s.split(':').next().unwrap_or_default();
    !s.contains('/') && (host.contains('.') || host == "localhost" || s.starts_with('['))
}

fn host_target_matches(pattern: &Pattern, host: &str) -> bool {
    parse_schemeless(host).is_ok_and(|parts| pattern.matches(&Target::from_parts(&parts)))
}

fn report(args: &MatchArgs, pattern: &Pattern, matched: bool) -> Result<Outcome> {
    println!("{matched}");
    if !matched {
        for lint in pattern.lints() {
            eprintln!("hint: pattern {:?} {lint}", args.pattern);
        }
        return Ok(Outcome::No);
    }
    Ok(Outcome::Yes)
}
