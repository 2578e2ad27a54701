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

/// `line` with every control character but a final line feed written as an escape (`\n`,
/// `\r`, `\t`, `\u{1b}`; Unicode's line and paragraph separators too): a log line whose
/// fields came from outside (a registry's error body in the runtime's message, an image
/// reference, a pod name, a plugin's stderr) stays one line and cannot forge another.
pub fn escape_controls(line: &str) -> std::borrow::Cow<'_, str> {
    let (body, end) = match line.strip_suffix('\n') {
        Some(body) => (body, "\n"),
        None => (line, ""),
    };
    let forged = |c: char| c.is_control() || c == '\u{2028}' || c == '\u{2029}';
    if !body.contains(forged) {
        return std::borrow::Cow::Borrowed(line);
    }
    let mut out = String::with_capacity(line.len() + 16);
    for c in body.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if forged(c) => {
                use std::fmt::Write as _;
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push_str(end);
    std::borrow::Cow::Owned(out)
}

/// `value` with every control character escaped, a final line feed too: outside text (a
/// runtime's message quoting a registry's body, a plugin's error, a pod's name) printed as one
/// field of a line cannot end that line, forge another, or reach the terminal as an escape
/// sequence.
pub fn escape_field(value: &str) -> std::borrow::Cow<'_, str> {
    match escape_controls(value) {
        std::borrow::Cow::Borrowed(v) if !v.ends_with('\n') => std::borrow::Cow::Borrowed(v),
        escaped => {
            let mut s = escaped.into_owned();
            if s.ends_with('\n') {
                s.pop();
                s.push_str("\\n");
            }
            std::borrow::Cow::Owned(s)
        }
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
    #[test]
    fn a_field_keeps_no_control_character_not_even_a_final_line_feed() {
        use super::escape_field;
        assert_eq!(escape_field("plain"), "plain");
        assert_eq!(escape_field("a\n"), "a\\n");
        assert_eq!(
            escape_field("401\n\u{1b}]0;title\u{7}\u{1b}[2J\u{2028}x"),
            "401\\n\\u{1b}]0;title\\u{7}\\u{1b}[2J\\u{2028}x"
        );
    }

    #[test]
    fn control_characters_are_escaped_but_the_line_end() {
        use super::escape_controls;
        assert_eq!(escape_controls("plain line\n"), "plain line\n");
        assert!(matches!(
            escape_controls("plain\n"),
            std::borrow::Cow::Borrowed(_)
        ));
        assert_eq!(
            escape_controls("a 401\n2026-01-01T00:00:00Z  INFO forged\r\t\u{1b}[31m\u{2028}x\n"),
            "a 401\\n2026-01-01T00:00:00Z  INFO forged\\r\\t\\u{1b}[31m\\u{2028}x\n"
        );
        assert_eq!(escape_controls("no end\u{7f}"), "no end\\u{7f}");
        assert_eq!(escape_controls("ünïcode ok\n"), "ünïcode ok\n");
    }

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
