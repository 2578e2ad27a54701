use super::*;

const NAME: &str = "registry.example.com/team-a/app";
const NOW: i64 = 1_000_000_000;

fn coords(ns: &str, name: &str) -> Coords {
    Coords {
        namespace: ns.into(),
        name: name.into(),
        uid: format!("uid-{ns}-{name}"),
    }
}

fn hash(b: u8) -> CredentialHash {
    CredentialHash::new(7, [b; 32])
}

fn secret(ns: &str, name: &str, h: u8) -> Presented {
    Presented::Secret {
        coords: coords(ns, name),
        hash: hash(h),
    }
}

fn record_with(name: &str, entry: NameEntry) -> Record {
    let mut names = NameMap::default();
    names.insert(name.to_owned(), entry);
    Record {
        image_ref: "sha256:abc".into(),
        names,
        changed_ms: NOW,
    }
}

fn secrets_entry(list: &[(&str, &str, u8, i64)]) -> NameEntry {
    NameEntry {
        secrets: list
            .iter()
            .map(|(ns, n, h, at)| SecretRecord {
                coords: coords(ns, n),
                hash: hash(*h),
                recorded_ms: *at,
            })
            .collect(),
        changed_ms: NOW,
        ..Default::default()
    }
}

fn check(policy: Policy, allowlist: &Allowlist) -> Check<'_> {
    Check {
        name: NAME,
        present: true,
        policy,
        allowlist,
        max_age_ms: None,
        now_ms: NOW,
    }
}

fn never_called() -> Vec<Presented> {
    panic!("credentials must not be looked up at this step")
}

const ALL: [Policy; 4] = [
    Policy::NeverVerify,
    Policy::NeverVerifyPreloadedImages,
    Policy::NeverVerifyAllowlistedImages,
    Policy::AlwaysVerify,
];

#[test]
fn step1_absent_image_is_pulled_under_every_policy() {
    let list = Allowlist::default();
    for p in ALL {
        let c = Check {
            present: false,
            ..check(p, &list)
        };
        let d = decide(&c, StoreView::Unreadable, never_called);
        assert_eq!(d.verdict, Verdict::Pull, "{p}");
    }
}

#[test]
fn step2_unreadable_store_fails_safe_under_every_policy() {
    let list = Allowlist::parse([NAME]).unwrap();
    for p in ALL {
        let d = decide(&check(p, &list), StoreView::Unreadable, never_called);
        assert_eq!(
            d.verdict,
            Verdict::Authenticate(AuthReason::StoreUnreadable),
            "{p}"
        );
    }
}

#[test]
fn steps_3_and_4_policy_exemptions() {
    let empty = Allowlist::default();
    let listed = Allowlist::parse(["registry.example.com/team-a/*"]).unwrap();
    let pulled = record_with(NAME, secrets_entry(&[("a", "pull", 1, NOW)]));
    let none = StoreView::Readable {
        record: None,
        intent: false,
    };
    let with_record = StoreView::Readable {
        record: Some(&pulled),
        intent: false,
    };
    let with_intent = StoreView::Readable {
        record: None,
        intent: true,
    };
    let v = |p, l, s| decide(&check(p, l), s, Vec::new).verdict;
    use AllowReason::*;
    use AuthReason::*;
    use Verdict::*;
    // NeverVerify: everything present is allowed.
    assert_eq!(
        v(Policy::NeverVerify, &empty, with_record),
        Allow(PolicyNeverVerify)
    );
    // Preloaded (no record, no intent) is trusted; pulled by the node is not.
    assert_eq!(
        v(Policy::NeverVerifyPreloadedImages, &empty, none),
        Allow(Preloaded)
    );
    assert_eq!(
        v(Policy::NeverVerifyPreloadedImages, &empty, with_intent),
        Authenticate(NoRecord)
    );
    assert_eq!(
        v(Policy::NeverVerifyPreloadedImages, &empty, with_record),
        Authenticate(NoMatchingCredential)
    );
    // Allowlisted names are trusted, others are not.
    assert_eq!(
        v(Policy::NeverVerifyAllowlistedImages, &listed, with_record),
        Allow(Allowlisted)
    );
    assert_eq!(
        v(Policy::NeverVerifyAllowlistedImages, &empty, none),
        Authenticate(NoRecord)
    );
    // AlwaysVerify: no exemption.
    assert_eq!(
        v(Policy::AlwaysVerify, &listed, none),
        Authenticate(NoRecord)
    );
}

#[test]
fn steps_5_to_8_records_without_a_usable_entry() {
    let list = Allowlist::default();
    let p = Policy::AlwaysVerify;
    let other_name = record_with("registry.example.com/other", NameEntry::default());
    let d = decide(
        &check(p, &list),
        StoreView::Readable {
            record: Some(&other_name),
            intent: false,
        },
        never_called,
    );
    assert_eq!(d.verdict, Verdict::Authenticate(AuthReason::NoEntryForName));

    let open = record_with(
        NAME,
        NameEntry {
            node_accessible: true,
            ..Default::default()
        },
    );
    let d = decide(
        &check(p, &list),
        StoreView::Readable {
            record: Some(&open),
            intent: false,
        },
        never_called,
    );
    assert_eq!(d.verdict, Verdict::Allow(AllowReason::NodeAccessible));

    let recovered = recovered(None, "sha256:abc", NAME, NOW);
    let d = decide(
        &check(p, &list),
        StoreView::Readable {
            record: Some(&recovered),
            intent: false,
        },
        never_called,
    );
    assert_eq!(
        d.verdict,
        Verdict::Authenticate(AuthReason::NoCredentialsRecorded)
    );
}

fn decide_with(entry: NameEntry, creds: Vec<Presented>, max_age: Option<i64>) -> Decision {
    let list = Allowlist::default();
    let record = record_with(NAME, entry);
    let c = Check {
        max_age_ms: max_age,
        ..check(Policy::AlwaysVerify, &list)
    };
    decide(
        &c,
        StoreView::Readable {
            record: Some(&record),
            intent: false,
        },
        || creds,
    )
}

#[test]
fn step9_secret_matches_by_hash_and_learns_new_coordinates() {
    let entry = secrets_entry(&[("a", "pull", 1, NOW - 10)]);
    // Same content under another name (tenant B copied A's secret): allowed by hash, and the
    // new coordinates are remembered.
    let d = decide_with(entry.clone(), vec![secret("b", "copy", 1)], None);
    assert_eq!(d.verdict, Verdict::Allow(AllowReason::SecretMatch));
    let learned = d.update.unwrap();
    let record = record_with(NAME, secrets_entry(&[("a", "pull", 1, NOW - 10)]));
    let updated = learn(&record, NAME, &learned, NOW).unwrap();
    let e = &updated.names[NAME];
    assert_eq!(e.secrets.len(), 2);
    assert_eq!(e.secrets[1].coords, coords("b", "copy"));
    assert_eq!(
        e.secrets[1].recorded_ms,
        NOW - 10,
        "as old as the content it matched"
    );
    assert!(
        learn(&updated, NAME, &learned, NOW).is_none(),
        "learned once"
    );
    // The same secret again: allowed, nothing to write.
    let d = decide_with(entry, vec![secret("a", "pull", 1)], None);
    assert_eq!(d.verdict, Verdict::Allow(AllowReason::SecretMatch));
    assert!(d.update.is_none());
}

#[test]
fn step9_rotated_secret_allows_and_updates_the_hash() {
    let entry = secrets_entry(&[("a", "pull", 1, NOW - 10)]);
    let d = decide_with(entry, vec![secret("a", "pull", 2)], None);
    assert_eq!(d.verdict, Verdict::Allow(AllowReason::SecretRotated));
    let record = record_with(NAME, secrets_entry(&[("a", "pull", 1, NOW - 10)]));
    let updated = learn(&record, NAME, &d.update.unwrap(), NOW).unwrap();
    assert_eq!(updated.names[NAME].secrets[0].hash, hash(2));
}

#[test]
fn step9_rotation_is_accepted_only_below_the_secrets_limit() {
    let names: Vec<String> = (0..MAX_SECRETS_PER_NAME).map(|i| format!("s{i}")).collect();
    let full: Vec<(&str, &str, u8, i64)> = names
        .iter()
        .enumerate()
        .map(|(i, n)| ("a", n.as_str(), (i % 200) as u8, NOW - 10))
        .collect();
    let d = decide_with(secrets_entry(&full), vec![secret("a", "s0", 250)], None);
    assert_eq!(
        d.verdict,
        Verdict::Authenticate(AuthReason::NoMatchingCredential),
        "at {MAX_SECRETS_PER_NAME} secrets a rotated one is not accepted"
    );
    let d = decide_with(
        secrets_entry(&full[..MAX_SECRETS_PER_NAME - 1]),
        vec![secret("a", "s0", 250)],
        None,
    );
    assert_eq!(d.verdict, Verdict::Allow(AllowReason::SecretRotated));
}

#[test]
fn step9_service_account_must_match_all_coordinates() {
    let entry = NameEntry {
        service_accounts: vec![coords("a", "builder")],
        changed_ms: NOW,
        ..Default::default()
    };
    let mut other_uid = coords("a", "builder");
    other_uid.uid = "recreated".into();
    let d = decide_with(
        entry.clone(),
        vec![Presented::ServiceAccount(other_uid)],
        None,
    );
    assert_eq!(
        d.verdict,
        Verdict::Authenticate(AuthReason::NoMatchingCredential)
    );
    let d = decide_with(
        entry,
        vec![
            Presented::NodeWide,
            Presented::ServiceAccount(coords("a", "builder")),
        ],
        None,
    );
    assert_eq!(d.verdict, Verdict::Allow(AllowReason::ServiceAccountMatch));
}

#[test]
fn step10_no_match_means_authenticate() {
    let entry = secrets_entry(&[("a", "pull", 1, NOW)]);
    for creds in [
        vec![],
        vec![Presented::NodeWide],
        vec![secret("b", "own", 9)],
    ] {
        let d = decide_with(entry.clone(), creds, None);
        assert_eq!(
            d.verdict,
            Verdict::Authenticate(AuthReason::NoMatchingCredential)
        );
    }
}

#[test]
fn maximum_age_makes_an_old_secret_match_reauthenticate() {
    let day = 86_400_000;
    let entry = secrets_entry(&[("a", "pull", 1, NOW - 40 * day)]);
    let d = decide_with(entry.clone(), vec![secret("a", "pull", 1)], Some(30 * day));
    assert_eq!(d.verdict, Verdict::Authenticate(AuthReason::SecretTooOld));
    let d = decide_with(entry.clone(), vec![secret("a", "pull", 2)], Some(30 * day));
    assert_eq!(
        d.verdict,
        Verdict::Authenticate(AuthReason::SecretTooOld),
        "rotation too"
    );
    let d = decide_with(entry, vec![secret("a", "pull", 1)], Some(50 * day));
    assert_eq!(d.verdict, Verdict::Allow(AllowReason::SecretMatch));
}

#[test]
fn known_flaw_preloaded_is_judged_per_name() {
    // The same content was preloaded as `pause` and later pulled as another name with a
    // secret. Upstream decides "pulled by the node" per image ID and starts refusing the
    // preloaded name; credgate keeps it working.
    let list = Allowlist::default();
    let record = record_with(
        "registry.example.com/mirror/pause",
        secrets_entry(&[("a", "s", 1, NOW)]),
    );
    let c = Check {
        name: "registry.k8s.io/pause",
        ..check(Policy::NeverVerifyPreloadedImages, &list)
    };
    let d = decide(
        &c,
        StoreView::Readable {
            record: Some(&record),
            intent: false,
        },
        never_called,
    );
    assert_eq!(d.verdict, Verdict::Allow(AllowReason::Preloaded));
}

#[test]
fn known_flaw_allowlist_is_normalized_on_both_sides() {
    let list = Allowlist::parse([
        "registry.k8s.io/pause",
        "nginx",
        "quay.io/team/*",
        "library/*",
    ])
    .unwrap();
    let name = |s: &str| ImageRef::parse(s).unwrap().name().to_owned();
    // Upstream 1.35 compared the raw pod string: a tag defeated the entry.
    assert!(list.allows(&name("registry.k8s.io/pause:3.10")));
    assert!(list.allows(&name("registry.k8s.io/pause@sha256:0000000000000000000000000000000000000000000000000000000000000000")));
    // Familiar names are accepted and normalized.
    assert!(list.allows(&name("nginx:1.25")));
    assert!(list.allows(&name("docker.io/library/nginx")));
    assert!(list.allows(&name("quay.io/team/app:v1")));
    assert!(list.allows(&name("busybox")));
    assert!(!list.allows(&name("quay.io/teams/app")));
    assert!(!list.allows(&name("registry.k8s.io/pause-not")));
}

#[test]
fn empty_or_padded_allowlist_entries_are_errors() {
    let errors = Allowlist::parse(["", " nginx", "ok.io/app", "quay.io/x/* "]).unwrap_err();
    let entries: Vec<&str> = errors.iter().map(|e| e.entry.as_str()).collect();
    assert_eq!(entries, ["", " nginx", "quay.io/x/* "]);
    assert!(errors[0].to_string().contains("empty"), "{}", errors[0]);
    assert!(
        errors[1].to_string().contains("white space"),
        "{}",
        errors[1]
    );
}

#[test]
fn invalid_allowlist_entries_are_all_reported() {
    let errors = Allowlist::parse([
        "nginx:1.25",
        "Bad/Name",
        "*.io/x",
        "ok.io/app",
        "a.io/x@sha256:00/*",
    ])
    .unwrap_err();
    let entries: Vec<&str> = errors.iter().map(|e| e.entry.as_str()).collect();
    assert_eq!(
        entries,
        ["nginx:1.25", "Bad/Name", "*.io/x", "a.io/x@sha256:00/*"]
    );
    assert!(
        errors[0].to_string().contains("without tag or digest"),
        "{}",
        errors[0]
    );
}

#[test]
fn policies_parse_by_their_kubelet_names() {
    for n in Policy::NAMES {
        assert_eq!(n.parse::<Policy>().unwrap().as_str(), n);
    }
    assert!("neververify".parse::<Policy>().is_err());
    assert_eq!(Policy::default(), Policy::NeverVerifyPreloadedImages);
}

#[test]
fn merge_node_wide_dominates_and_secrets_union_by_coordinates() {
    let r = merge(None, "sha256:abc", NAME, &secret("a", "pull", 1), NOW);
    let r = merge(
        Some(&r),
        "sha256:abc",
        NAME,
        &secret("a", "pull", 2),
        NOW + 1,
    );
    let e = &r.names[NAME];
    assert_eq!(e.secrets.len(), 1, "union by coordinates");
    assert_eq!(e.secrets[0].hash, hash(2), "the new hash wins");
    let r = merge(
        Some(&r),
        "sha256:abc",
        NAME,
        &Presented::ServiceAccount(coords("a", "sa")),
        NOW + 2,
    );
    assert_eq!(r.names[NAME].service_accounts.len(), 1);
    let r = merge(Some(&r), "sha256:abc", NAME, &Presented::NodeWide, NOW + 3);
    let e = &r.names[NAME];
    assert!(e.node_accessible && e.secrets.is_empty() && e.service_accounts.is_empty());
    let r = merge(Some(&r), "sha256:abc", NAME, &secret("b", "x", 5), NOW + 4);
    assert!(
        r.names[NAME].secrets.is_empty(),
        "node accessible dominates"
    );
}

#[test]
fn the_hundred_secret_limit() {
    let mut r = None;
    for i in 0..MAX_SECRETS_PER_NAME {
        let s = secret("ns", &format!("s{i}"), 1 + (i % 200) as u8);
        r = Some(merge(r.as_ref(), "sha256:abc", NAME, &s, NOW + i as i64));
    }
    let full = r.unwrap();
    assert_eq!(full.names[NAME].secrets.len(), MAX_SECRETS_PER_NAME);
    // A decision-time match under new coordinates does not grow the list past the limit.
    let d = decide_with(
        full.names[NAME].clone(),
        vec![secret("other", "copy", 1)],
        None,
    );
    assert_eq!(d.verdict, Verdict::Allow(AllowReason::SecretMatch));
    assert!(d.update.is_none());
    // A successful pull with a new secret makes room by dropping the oldest.
    let r = merge(
        Some(&full),
        "sha256:abc",
        NAME,
        &secret("new", "s", 250),
        NOW + 1000,
    );
    let e = &r.names[NAME];
    assert_eq!(e.secrets.len(), MAX_SECRETS_PER_NAME);
    assert!(e.secrets.iter().all(|s| s.coords != coords("ns", "s0")));
    assert!(e.secrets.iter().any(|s| s.coords == coords("new", "s")));
}

#[test]
fn records_round_trip_through_json_with_hex_hashes() {
    let r = merge(None, "sha256:abc", NAME, &secret("a", "pull", 0xab), NOW);
    let json = super::stored::encode(&r);
    assert!(json.contains(&format!("k00000007:{}", "ab".repeat(32))));
    let back: Record = super::stored::decode(json.as_bytes()).unwrap();
    assert_eq!(back, r);
    assert!(!format!("{:?}", hash(0xab)).contains(&"ab".repeat(8)));
}

#[test]
fn two_things_learned_at_once_both_stick() {
    // Decided on the same snapshot, written one after the other: the second must not undo the
    // first (each is applied to the record as it is when written).
    let record = record_with(NAME, secrets_entry(&[("a", "pull", 1, NOW - 10)]));
    let copy = decide_with(
        record.names[NAME].clone(),
        vec![secret("b", "copy", 1)],
        None,
    );
    let rotation = decide_with(
        record.names[NAME].clone(),
        vec![secret("a", "pull", 2)],
        None,
    );
    let r = learn(&record, NAME, &copy.update.unwrap(), NOW).unwrap();
    let r = learn(&r, NAME, &rotation.update.unwrap(), NOW + 1).unwrap();
    let e = &r.names[NAME];
    assert_eq!(e.secrets.len(), 2);
    assert_eq!(e.secrets[0].hash, hash(2));
    assert_eq!(e.secrets[1].coords, coords("b", "copy"));
}

#[test]
fn hashes_under_another_node_key_neither_match_nor_rotate() {
    // The node key was lost and recreated: the records' hashes were made under key 7.
    let entry = secrets_entry(&[("a", "pull", 1, NOW - 10)]);
    let other_key = |b| Presented::Secret {
        coords: coords("a", "pull"),
        hash: CredentialHash::new(8, [b; 32]),
    };
    for b in [1, 2] {
        let d = decide_with(entry.clone(), vec![other_key(b)], None);
        assert_eq!(
            d.verdict,
            Verdict::Authenticate(AuthReason::NoMatchingCredential)
        );
        assert!(d.update.is_none());
    }
}

/// One content pulled under ever more names keeps at most `MAX_NAMES_PER_RECORD` of them: the
/// name changed longest ago goes, never the one just pulled.
#[test]
fn a_record_keeps_a_bounded_number_of_names() {
    let mut r = merge(
        None,
        "sha256:abc",
        "reg.io/a/name-0",
        &Presented::NodeWide,
        0,
    );
    for i in 1..(MAX_NAMES_PER_RECORD as i64 + 50) {
        r = merge(
            Some(&r),
            "sha256:abc",
            &format!("reg.io/a/name-{i}"),
            &Presented::NodeWide,
            i,
        );
    }
    assert_eq!(r.names.len(), MAX_NAMES_PER_RECORD);
    assert!(!r.names.contains_key("reg.io/a/name-0"));
    assert!(r.names.contains_key(&format!(
        "reg.io/a/name-{}",
        MAX_NAMES_PER_RECORD as i64 + 49
    )));
    // An old name pulled again is kept and others make room.
    let again = merge(
        Some(&r),
        "sha256:abc",
        "reg.io/a/name-60",
        &Presented::NodeWide,
        1000,
    );
    assert_eq!(again.names.len(), MAX_NAMES_PER_RECORD);
    let fresh = merge(
        Some(&again),
        "sha256:abc",
        "reg.io/a/new",
        &Presented::NodeWide,
        1001,
    );
    assert!(fresh.names.contains_key("reg.io/a/name-60"));
    assert!(fresh.names.contains_key("reg.io/a/new"));
}
