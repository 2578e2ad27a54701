//! Property tests: the pattern matcher agrees with a plain reference implementation of the
//! kubelet's rule, written here from the rule's statement (equal port, equal label count,
//! per-label `path.Match` glob, path prefix) with a naive recursive glob.

use credgate_core::pattern::{Pattern, Target};
use credgate_core::reference::ImageRef;
use proptest::prelude::*;

/// Go's `path.Match` for one label, by recursion on the pattern: obviously right, slow.
fn ref_glob(p: &[char], t: &[char]) -> bool {
    match p.split_first() {
        None => t.is_empty(),
        Some(('*', rest)) => (0..=t.len()).any(|i| ref_glob(rest, &t[i..])),
        Some(('?', rest)) => !t.is_empty() && ref_glob(rest, &t[1..]),
        Some(('\\', rest)) => match (rest.split_first(), t.split_first()) {
            (Some((e, rest)), Some((c, t))) => e == c && ref_glob(rest, t),
            _ => false,
        },
        Some(('[', rest)) => {
            let Some((&c, t)) = t.split_first() else {
                return false;
            };
            let (negated, mut body) = match rest.split_first() {
                Some(('^', b)) => (true, b),
                _ => (false, rest),
            };
            let mut hit = false;
            let mut first = true;
            loop {
                match body.split_first() {
                    Some((']', after)) if !first => {
                        body = after;
                        break;
                    }
                    Some((&lo, after)) => {
                        first = false;
                        if let ['-', hi, tail @ ..] = after {
                            hit |= lo <= c && c <= *hi;
                            body = tail;
                        } else {
                            hit |= lo == c;
                            body = after;
                        }
                    }
                    None => return false,
                }
            }
            hit != negated && ref_glob(body, t)
        }
        Some((c, rest)) => t.first() == Some(c) && ref_glob(rest, &t[1..]),
    }
}

/// `host[:port][/path]` split the obvious way (no brackets, escapes or queries are generated).
fn split(s: &str) -> (&str, &str, &str) {
    let (authority, path) = s.find('/').map_or((s, ""), |i| (&s[..i], &s[i..]));
    let (host, port) = authority
        .rsplit_once(':')
        .map_or((authority, ""), |(h, p)| (h, p));
    (host, port, path)
}

fn ref_matches(pattern: &str, image_name: &str) -> bool {
    // A pattern is read as a URL: `?` starts its query, which takes no part in matching.
    let pattern = pattern
        .split_once('?')
        .map_or(pattern, |(before, _)| before);
    let (ph, pport, ppath) = split(pattern);
    let (ih, iport, ipath) = split(image_name);
    let pl: Vec<&str> = ph.split('.').collect();
    let il: Vec<&str> = ih.split('.').collect();
    pport == iport
        && ipath.starts_with(ppath)
        && pl.len() == il.len()
        && pl.iter().zip(&il).all(|(p, t)| {
            let p: Vec<char> = p.chars().collect();
            let t: Vec<char> = t.chars().collect();
            ref_glob(&p, &t)
        })
}

/// Host labels from a tiny alphabet, so that patterns and images collide often.
fn host_label() -> impl Strategy<Value = String> {
    "[ab1]([ab1-]?[ab1])?"
}

fn glob_item() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[ab1-]".prop_map(|s| s.to_string()),
        2 => Just("*".to_string()),
        2 => Just("?".to_string()),
        1 => Just("[a-b]".to_string()),
        1 => Just("[^a]".to_string()),
        1 => Just("[b1]".to_string()),
        1 => Just("\\a".to_string()),
    ]
}

fn glob_label() -> impl Strategy<Value = String> {
    prop::collection::vec(glob_item(), 1..4).prop_map(|v| v.concat())
}

fn port() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just(":5000".into()),
        Just(":443".into())
    ]
}

fn path() -> impl Strategy<Value = String> {
    prop::collection::vec("[ab]{1,2}", 0..3)
        .prop_map(|segs| segs.iter().map(|s| format!("/{s}")).collect::<String>())
}

fn image() -> impl Strategy<Value = String> {
    (prop::collection::vec(host_label(), 2..4), port(), path()).prop_map(|(labels, port, path)| {
        let path = if path.is_empty() { "/x".into() } else { path };
        format!("{}{port}{path}:tag", labels.join("."))
    })
}

/// A glob host label: no `^` or `\\`, which Go's URL parser refuses in a host, and no `[`
/// first, which would start an IPv6 literal.
fn host_glob_label() -> impl Strategy<Value = String> {
    glob_label().prop_map(|l| {
        let l = l.replace("[^a]", "[a1]").replace("\\a", "a");
        if l.starts_with('[') {
            format!("a{l}")
        } else {
            l
        }
    })
}

fn pattern() -> impl Strategy<Value = String> {
    let label = prop_oneof![3 => host_label(), 2 => host_glob_label()];
    (prop::collection::vec(label, 1..4), port(), path())
        .prop_map(|(labels, port, path)| format!("{}{port}{path}", labels.join(".")))
}

/// A pattern made from an image: most of these match, some labels are globbed.
fn pattern_from(image: &str, glob_at: usize, cut: usize) -> String {
    let name = image.rsplit_once(':').map_or(image, |(n, _)| n);
    let (host, port, path) = split(name);
    let labels: Vec<String> = host
        .split('.')
        .enumerate()
        .map(|(i, l)| if i == glob_at { "*".into() } else { l.into() })
        .collect();
    let port = if port.is_empty() {
        String::new()
    } else {
        format!(":{port}")
    };
    let path = &path[..path.len().min(cut)];
    format!("{}{port}{path}", labels.join("."))
}

fn check(pattern: &str, image: &str) -> Result<(), TestCaseError> {
    let parsed = ImageRef::parse(image).map_err(|e| TestCaseError::fail(format!("{e}")))?;
    let name = parsed.name();
    let p = Pattern::parse(pattern).map_err(|e| TestCaseError::fail(format!("{e}")))?;
    let got = p.matches(&Target::from_image_name(name));
    let want = ref_matches(pattern, name);
    prop_assert_eq!(got, want, "pattern {:?} image name {:?}", pattern, name);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    #[test]
    fn matching_agrees_with_the_reference(p in pattern(), i in image()) {
        check(&p, &i)?;
    }

    #[test]
    fn patterns_made_from_images_agree(i in image(), glob_at in 0usize..5, cut in 0usize..8) {
        let p = pattern_from(&i, glob_at, cut);
        check(&p, &i)?;
    }

    #[test]
    fn globs_agree_on_single_labels(p in glob_label(), t in "[ab1-]{0,5}") {
        let pc: Vec<char> = p.chars().collect();
        let tc: Vec<char> = t.chars().collect();
        prop_assert!(credgate_core::pattern::glob_valid(&p));
        prop_assert_eq!(credgate_core::pattern::glob_match(&p, &t), ref_glob(&pc, &tc), "{:?} ~ {:?}", p, t);
    }
}

#[test]
fn the_reference_itself_knows_the_rule() {
    // Guards against a reference that agrees by being wrong the same way.
    assert!(ref_matches("*.a", "b.a/x"));
    assert!(!ref_matches("*.a", "a/x"), "label counts differ");
    assert!(!ref_matches("b.a", "b.a:5000/x"), "ports differ");
    assert!(ref_matches("b.a/x", "b.a/xy"), "path is a plain prefix");
    assert!(!ref_matches("b.a/y", "b.a/x"));
    assert!(ref_matches("[^a]1.b", "b1.b/p"));
    assert!(!ref_matches("[a-b]", "1"));
    assert!(
        ref_matches("b.*?:5000", "b.a/x"),
        "'?' ends the host: no port, '*' label"
    );
}
