//! How `credgate` prints what the agent answers: a message as JSON for programs (the API's
//! enums by name) or as text for people, aligned tables whose cells cannot break a terminal,
//! instants to whole seconds, a status as the sentence it carries.

use std::time::{Duration, SystemTime};

use anyhow::Result;
use credgate_api::v1::{self as pb};
use serde::Serialize;

use crate::opts::Output;

/// Prints a response: the message as JSON with `-o json`, else `text` of it.
pub fn show<T: Serialize>(out: Output, value: &T, text: impl FnOnce(&T) -> String) -> Result<()> {
    if out == Output::Json {
        json(value)
    } else {
        println!("{}", text(value));
        Ok(())
    }
}

pub fn json(value: &impl Serialize) -> Result<()> {
    // The API's enums are serialized by their words (credgate_api::names).
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// The agent's status as a sentence: its message, which says what failed; the code's name
/// only when there is no message.
pub fn status_error(s: tonic::Status) -> anyhow::Error {
    if s.message().is_empty() {
        return anyhow::anyhow!(
            "the agent answered {}",
            credgate_agent::metrics::code_name(s.code()).to_lowercase()
        );
    }
    anyhow::anyhow!("{}", s.message())
}

/// The answer of a call, or its status as an error.
pub async fn answer<T>(
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T> {
    call.await
        .map(tonic::Response::into_inner)
        .map_err(status_error)
}

/// A decision's name, as the API's enum spells it.
pub fn decision_name(d: i32) -> &'static str {
    pb::Decision::try_from(d).map_or("UNSPECIFIED", pb::Decision::word)
}

pub fn rfc3339(t: SystemTime) -> String {
    time::OffsetDateTime::from(t)
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// A Unix-ms instant of the API, to whole seconds (`-` when unset).
pub fn time_ms(ms: i64) -> String {
    if ms <= 0 {
        return "-".into();
    }
    whole_seconds(&rfc3339(
        SystemTime::UNIX_EPOCH + Duration::from_millis(ms.unsigned_abs()),
    ))
}

/// `2026-11-22T10:00:00.123Z` → `2026-11-22T10:00:00Z`.
pub(super) fn whole_seconds(t: &str) -> String {
    match (t.find('.'), t.rfind(['Z', '+'])) {
        (Some(dot), Some(zone)) if dot < zone => format!("{}{}", &t[..dot], &t[zone..]),
        _ => t.to_owned(),
    }
}

/// The widest a table cell is shown; longer values (a plugin's username, a consumer name) are
/// cut, and `-o json` shows them whole.
const CELL_MAX: usize = 80;

/// Outside text (what the agent relays from a runtime, a registry, a plugin, a pod) as one
/// field of a printed line: every control character escaped, a line feed too.
pub use credgate_core::text::escape_field as plain;

/// A value as a table shows it: control characters escaped, cut after [`CELL_MAX`] characters.
fn cell(value: &str) -> String {
    let escaped = plain(value);
    match escaped.char_indices().nth(CELL_MAX) {
        None => escaped.into_owned(),
        Some((cut, _)) => format!("{}\u{2026}", &escaped[..cut]),
    }
}

/// Aligned columns, one line per row; empty when there are no rows.
pub fn render_table(header: &[&str], rows: &[Vec<String>]) -> String {
    if rows.is_empty() {
        return String::new();
    }
    let shown: Vec<Vec<String>> = std::iter::once(header.iter().map(|h| cell(h)).collect())
        .chain(rows.iter().map(|r| r.iter().map(|c| cell(c)).collect()))
        .collect();
    let mut widths = vec![0usize; header.len()];
    for row in &shown {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for row in &shown {
        let mut line = String::new();
        for (c, w) in row.iter().zip(&widths) {
            line.push_str(c);
            line.extend(std::iter::repeat_n(' ', w - c.chars().count() + 2));
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Prints aligned columns; nothing when there are no rows.
pub fn print_table(header: &[&str], rows: &[Vec<String>]) {
    print!("{}", render_table(header, rows));
}

#[cfg(test)]
mod table_tests {
    use super::*;

    #[test]
    fn long_and_odd_cells_are_cut_and_escaped_not_a_panic() {
        let rows = vec![
            vec!["a".repeat(70_000), "x\ny".into()],
            vec!["short".into(), "z".into()],
        ];
        let text = render_table(&["USER", "NOTE"], &rows);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(
            lines.iter().all(|l| l.chars().count() < 2 * CELL_MAX),
            "{text}"
        );
        assert!(lines[1].contains('\u{2026}'));
        assert!(lines[1].ends_with("x\\ny"), "{}", lines[1]);
        assert!(lines[2].starts_with("short "));
        assert_eq!(render_table(&["A"], &[]), "");
    }
}
