//! Tables for pattern parsing and matching; cases learned from the kubelet's keyring tests and
//! from the rule's corners (ports, label counts, path prefixes, globs).

use super::*;

fn m(pattern: &str, image: &str) -> bool {
    Pattern::parse(pattern)
        .unwrap_or_else(|e| panic!("{pattern}: {e}"))
        .matches(&Target::from_image_name(image))
}

#[test]
fn matching_table() {
    let cases: &[(&str, &str, bool, &str)] = &[
        // globs per label
        (
            "*.kubernetes.io",
            "prefix.kubernetes.io/app",
            true,
            "star label",
        ),
        (
            "prefix.*.io",
            "prefix.kubernetes.io/app",
            true,
            "star middle",
        ),
        (
            "prefix.kubernetes.*",
            "prefix.kubernetes.io/app",
            true,
            "star tld",
        ),
        (
            "*-good.kubernetes.io",
            "prefix-good.kubernetes.io/app",
            true,
            "star in label",
        ),
        (
            "*.kubernetes.io",
            "kubernetes.io/app",
            false,
            "fewer labels",
        ),
        (
            "*.kubernetes.io",
            "a.b.kubernetes.io/app",
            false,
            "more labels",
        ),
        (
            "*.*.kubernetes.io",
            "prefix.kubernetes.io/app",
            false,
            "two stars three labels",
        ),
        ("k*.io", "quay.io/app", false, "glob first letter"),
        (
            "q?ay.io",
            "quay.io/app",
            false,
            "? starts a URL query, never a glob",
        ),
        ("q?ay.io", "q/app", true, "? cuts the host"),
        ("q[tu]ay.io", "quay.io/app", true, "class"),
        ("q[s-t]ay.io", "quay.io/app", false, "range excludes"),
        ("q[a-z]ay.io", "quay.io/app", true, "range"),
        ("x.[a-.io", "x.a.io/app", false, "bad glob never matches"),
        ("*", "localhost/app", true, "single label star"),
        (
            "*",
            "docker.io/library/nginx",
            false,
            "single label star vs two labels",
        ),
        (
            "*.*",
            "docker.io/library/nginx",
            true,
            "two stars two labels",
        ),
        (
            "*.*.*",
            "docker.io/library/nginx",
            false,
            "three stars two labels",
        ),
        ("Quay.io", "quay.io/app", false, "case sensitive"),
        // ports
        (
            "prefix.*.io:1111",
            "prefix.kubernetes.io:1111/app",
            true,
            "same port",
        ),
        (
            "prefix.*.io:1111",
            "prefix.kubernetes.io:2222/app",
            false,
            "other port",
        ),
        (
            "prefix.*.io",
            "prefix.kubernetes.io:1111/app",
            false,
            "port only on image",
        ),
        (
            "prefix.*.io:1111",
            "prefix.kubernetes.io/app",
            false,
            "port only on pattern",
        ),
        (
            "registry.io:443",
            "registry.io/app",
            false,
            "443 is not implied",
        ),
        (
            "127.0.0.1:5000",
            "127.0.0.1:5000/team-a/app",
            true,
            "ip and port",
        ),
        (
            "127.0.0.1",
            "127.0.0.1:5000/team-a/app",
            false,
            "ip without port",
        ),
        ("[::1]:5000", "[::1]:5000/app", true, "ipv6 with port"),
        // paths
        (
            "prefix.*.io:1111/foo",
            "prefix.kubernetes.io:1111/foo/bar",
            true,
            "path prefix",
        ),
        (
            "prefix.kubernetes.io/foo/bar",
            "prefix.kubernetes.io/foo",
            false,
            "longer path",
        ),
        (
            "reg.io/team",
            "reg.io/teams/x",
            true,
            "prefix is not segment aware",
        ),
        ("reg.io/team/", "reg.io/teams/x", false, "trailing slash"),
        ("reg.io/*", "reg.io/app", false, "star in path is literal"),
        ("reg.io/", "reg.io/app", true, "slash path"),
        ("reg.io/te%61m", "reg.io/team/app", true, "escaped path"),
        ("reg.io?x=1", "reg.io/app", true, "query ignored"),
        ("user@reg.io", "reg.io/app", true, "user info ignored"),
        // schemes never match
        ("https://reg.io", "reg.io/app", false, "scheme"),
    ];
    for (pattern, image, want, why) in cases {
        assert_eq!(m(pattern, image), *want, "{why}: {pattern} vs {image}");
    }
}

#[test]
fn spec_examples() {
    assert!(m("*.kubernetes.io", "prefix.kubernetes.io"));
    assert!(!m("k*.io", "quay.io"));
    assert!(m(
        "prefix.*.io:1111/foo",
        "prefix.kubernetes.io:1111/foo/bar"
    ));
}

#[test]
fn invalid_patterns() {
    let cases: &[(&str, PatternError)] = &[
        ("reg.io:abc", PatternError::InvalidPort(":abc".into())),
        ("reg.io:*", PatternError::InvalidPort(":*".into())),
        ("reg io", PatternError::InvalidHostCharacter(' ')),
        ("reg{x}.io", PatternError::InvalidHostCharacter('{')),
        ("q[^tu]ay.io", PatternError::InvalidHostCharacter('^')),
        ("reg\\x.io", PatternError::InvalidHostCharacter('\\')),
        ("[::1", PatternError::UnclosedBracket),
        ("[::1]x", PatternError::InvalidPort("x".into())),
        ("[qr]uay.io", PatternError::InvalidPort("uay.io".into())),
        ("reg.io/a%zz", PatternError::InvalidEscape("%zz".into())),
        ("reg.io\t", PatternError::ControlCharacter),
        ("reg%41.io", PatternError::InvalidEscape("reg%41.io".into())),
    ];
    for (pattern, want) in cases {
        assert_eq!(
            Pattern::parse(pattern).as_ref().err(),
            Some(want),
            "{pattern}"
        );
    }
    for ok in [
        "*",
        "reg.io:",
        "reg.io:5000",
        "*.dkr.ecr.*.amazonaws.com",
        "x.[a-.io",
        "reg.io/*",
    ] {
        assert!(Pattern::parse(ok).is_ok(), "{ok}");
    }
}

#[test]
fn lints() {
    let lint = |p: &str| Pattern::parse(p).unwrap().lints();
    assert_eq!(lint("https://reg.io"), vec![PatternLint::Scheme]);
    assert_eq!(lint("reg.io/*"), vec![PatternLint::GlobInPath]);
    assert_eq!(lint("x.[a-.io"), vec![PatternLint::BadGlob("[a-".into())]);
    assert_eq!(lint("q?ay.io"), vec![PatternLint::Query]);
    assert_eq!(lint("x.[]y.io"), vec![PatternLint::BadGlob("[]y".into())]);
    assert!(lint("*.reg.io/team").is_empty());
    assert!(lint("reg.io").is_empty());
}

#[test]
fn glob_table() {
    let cases: &[(&str, &str, bool)] = &[
        ("abc", "abc", true),
        ("*", "abc", true),
        ("*c", "abc", true),
        ("a*", "a", true),
        ("a*b*c*d*e*", "axbxcxdxe", true),
        ("a*b*c*d*e*", "axbxcxdxexxx", true),
        ("a*b?c*x", "abxbbxdbxebxczzx", true),
        ("a*b?c*x", "abxbbxdbxebxczzy", false),
        ("ab[c]", "abc", true),
        ("ab[b-d]", "abc", true),
        ("ab[e-g]", "abc", false),
        ("ab[^c]", "abc", false),
        ("ab[^b-d]", "abc", false),
        ("ab[^e-g]", "abc", true),
        ("a\\*b", "a*b", true),
        ("a\\*b", "ab", false),
        ("a?b", "a\u{263a}b", true),
        ("a[^a]b", "a\u{263a}b", true),
        ("[\\]a]", "]", true),
        ("[\\-]", "-", true),
        ("[x\\-]", "z", false),
        ("*x", "xxx", true),
    ];
    for (p, t, want) in cases {
        assert!(glob_valid(p), "{p} should be valid");
        assert_eq!(glob_match(p, t), *want, "{p} vs {t}");
    }
    for bad in [
        "[", "[^", "[^bc", "a[", "[]a]", "[-]", "[x-]", "[-x]", "\\", "[a-b-c]", "a[\\",
    ] {
        assert!(!glob_valid(bad), "{bad} should be invalid");
    }
}

#[test]
fn host_port_split() {
    for (input, host, port) in [
        ("reg.io", "reg.io", ""),
        ("reg.io:5000", "reg.io", "5000"),
        ("reg.io:", "reg.io", ""),
        ("[::1]:5000", "::1", "5000"),
        ("[::1]", "[::1]", ""),
        ("a:b:c", "a:b:c", ""),
    ] {
        assert_eq!(split_host_port(input), (host, port), "{input}");
    }
}

#[test]
fn registry_host_targets() {
    let parts = parse_schemeless("127.0.0.1:5000").unwrap();
    let target = Target::from_parts(&parts);
    assert!(Pattern::parse("127.0.0.1:5000").unwrap().matches(&target));
    assert!(!Pattern::parse("127.0.0.1:5000/team")
        .unwrap()
        .matches(&target));
}
