//! Input quoted in messages: errors name what they refused, but never echo a client's whole
//! input back (a megabyte reference must not come back as a megabyte status).

use std::fmt;

/// The most characters of an input a message quotes.
pub const QUOTE_MAX: usize = 64;

/// Writes `input` escaped (as `{:?}` would) and cut after [`QUOTE_MAX`] characters, saying
/// how long it was when it was cut: `"reg.io/aaaa…" (1048576 bytes)`.
#[derive(Clone, Copy)]
pub struct Quoted<'a>(pub &'a str);

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.char_indices().nth(QUOTE_MAX) {
            None => write!(f, "{:?}", self.0),
            Some((cut, _)) => {
                let shown = format!("{:?}", &self.0[..cut]);
                let open = &shown[..shown.len() - 1];
                write!(f, "{open}\u{2026}\" ({} bytes)", self.0.len())
            }
        }
    }
}

impl fmt::Debug for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// `outer: inner: root`, one line: an error and its causes as operators read them.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![e.to_string()];
    let mut cur = e.source();
    while let Some(s) = cur {
        parts.push(s.to_string());
        cur = s.source();
    }
    parts.join(": ")
}

/// The first error of `e`'s chain whose message already contains its `source()`'s, which a
/// chain (`outer: inner`) would then print twice; `None` when every cause is printed once.
/// Each error type's tests run it on every variant that has a source.
pub fn repeated_cause(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cur = e;
    while let Some(next) = cur.source() {
        let (outer, inner) = (cur.to_string(), next.to_string());
        if !inner.is_empty() && outer.contains(&inner) {
            return Some(format!("{outer:?} repeats its cause {inner:?}"));
        }
        cur = next;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_input_is_quoted_whole_and_long_input_is_cut() {
        assert_eq!(Quoted("nginx:1.25").to_string(), "\"nginx:1.25\"");
        assert_eq!(Quoted("a\nb").to_string(), "\"a\\nb\"");
        let long = "x".repeat(1 << 20);
        let q = Quoted(&long).to_string();
        assert!(q.len() < 100, "{q}");
        assert!(q.ends_with("\u{2026}\" (1048576 bytes)"), "{q}");
        let wide = "\u{e9}".repeat(100);
        assert!(Quoted(&wide).to_string().starts_with("\"\u{e9}"));
    }
}
