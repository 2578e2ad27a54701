//! Go duration strings (`"10m"`, `"1h30m"`, `"500ms"`, `"0s"`), as the kubelet's
//! `metav1.Duration` reads and writes them.

use std::fmt;
use std::time::Duration;

/// A signed duration in nanoseconds, as Go's `time.Duration`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct GoDuration(pub i64);

/// Why a duration string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("invalid duration {0:?}")]
    Invalid(String),
    #[error("missing unit in duration {0:?}")]
    MissingUnit(String),
    #[error("unknown unit {unit:?} in duration {input:?}")]
    UnknownUnit { unit: String, input: String },
    #[error("duration {0:?} out of range")]
    Overflow(String),
}

const UNITS: &[(&str, u64)] = &[
    ("ns", 1),
    ("us", 1_000),
    ("\u{b5}s", 1_000),
    ("\u{3bc}s", 1_000),
    ("ms", 1_000_000),
    ("s", 1_000_000_000),
    ("m", 60_000_000_000),
    ("h", 3_600_000_000_000),
];

impl GoDuration {
    /// Parses a Go duration string exactly as `time.ParseDuration` does.
    pub fn parse(input: &str) -> Result<Self, DurationError> {
        let invalid = || DurationError::Invalid(input.to_owned());
        let (neg, mut s) = match input.as_bytes().first() {
            Some(b'-') => (true, &input[1..]),
            Some(b'+') => (false, &input[1..]),
            _ => (false, input),
        };
        if s == "0" {
            return Ok(GoDuration(0));
        }
        if s.is_empty() {
            return Err(invalid());
        }
        let mut total: u128 = 0;
        while !s.is_empty() {
            let (value, rest) = parse_number(s).ok_or_else(invalid)?;
            let unit_len = rest
                .find(|c: char| c == '.' || c.is_ascii_digit())
                .unwrap_or(rest.len());
            if unit_len == 0 {
                return Err(DurationError::MissingUnit(input.to_owned()));
            }
            let unit = &rest[..unit_len];
            let scale = UNITS
                .iter()
                .find(|(name, _)| *name == unit)
                .map(|(_, scale)| *scale)
                .ok_or_else(|| DurationError::UnknownUnit {
                    unit: unit.to_owned(),
                    input: input.to_owned(),
                })?;
            total += value
                .scaled(scale)
                .ok_or_else(|| DurationError::Overflow(input.into()))?;
            if total > i64::MAX as u128 + u128::from(neg) {
                return Err(DurationError::Overflow(input.to_owned()));
            }
            s = &rest[unit_len..];
        }
        let nanos = if neg {
            (total as i128).wrapping_neg() as i64
        } else {
            total as i64
        };
        Ok(GoDuration(nanos))
    }

    /// The duration when it is not negative.
    pub fn to_std(self) -> Option<Duration> {
        u64::try_from(self.0).ok().map(Duration::from_nanos)
    }

    /// Whether the duration is below zero.
    pub fn is_negative(self) -> bool {
        self.0 < 0
    }
}

/// Integer and fractional digits of one component.
struct Number<'a> {
    whole: u128,
    fraction: &'a str,
}

impl Number<'_> {
    fn scaled(&self, scale: u64) -> Option<u128> {
        let mut v = self.whole.checked_mul(u128::from(scale))?;
        let mut unit = u128::from(scale);
        for d in self.fraction.bytes() {
            unit /= 10;
            if unit == 0 {
                break;
            }
            v += u128::from(d - b'0') * unit;
        }
        Some(v)
    }
}

fn parse_number(s: &str) -> Option<(Number<'_>, &str)> {
    let int_len = s.bytes().take_while(u8::is_ascii_digit).count();
    let mut whole: u128 = 0;
    for d in s[..int_len].bytes() {
        whole = whole.checked_mul(10)?.checked_add(u128::from(d - b'0'))?;
        if whole > u128::from(u64::MAX) {
            return None;
        }
    }
    let mut rest = &s[int_len..];
    let mut fraction = "";
    if let Some(after_dot) = rest.strip_prefix('.') {
        let frac_len = after_dot.bytes().take_while(u8::is_ascii_digit).count();
        fraction = &after_dot[..frac_len];
        rest = &after_dot[frac_len..];
    }
    if int_len == 0 && fraction.is_empty() {
        return None;
    }
    Some((Number { whole, fraction }, rest))
}

impl fmt::Display for GoDuration {
    /// Formats like Go's `Duration.String` for whole seconds and above (`1h0m0s`, `10m0s`),
    /// and as milliseconds or smaller units below a second.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.0 < 0 { "-" } else { "" };
        let n = self.0.unsigned_abs();
        if n == 0 {
            return f.write_str("0s");
        }
        if n < 1_000_000_000 {
            return match n {
                n if n % 1_000_000 == 0 => write!(f, "{sign}{}ms", n / 1_000_000),
                n if n % 1_000 == 0 => write!(f, "{sign}{}\u{b5}s", n / 1_000),
                n => write!(f, "{sign}{n}ns"),
            };
        }
        let secs = n / 1_000_000_000;
        let sub = n % 1_000_000_000;
        let (h, m, s) = (secs / 3600, (secs / 60) % 60, secs % 60);
        f.write_str(sign)?;
        if h > 0 {
            write!(f, "{h}h{m}m")?;
        } else if m > 0 {
            write!(f, "{m}m")?;
        }
        if sub == 0 {
            write!(f, "{s}s")
        } else {
            let frac = format!("{sub:09}");
            write!(f, "{s}.{}s", frac.trim_end_matches('0'))
        }
    }
}

/// A duration for people: rounded to the second from a minute up, to the millisecond from a
/// millisecond up, else to the microsecond; then written as Go writes durations (`400ms`,
/// `1.5s`, `2m30s`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rounded(pub Duration);

impl fmt::Display for Rounded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ns = self.0.as_nanos();
        let unit: u128 = match ns {
            n if n >= 60_000_000_000 => 1_000_000_000,
            n if n >= 1_000_000 => 1_000_000,
            _ => 1_000,
        };
        let rounded = (ns + unit / 2) / unit * unit;
        GoDuration(i64::try_from(rounded).unwrap_or(i64::MAX)).fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounded_durations_read_as_people_write_them() {
        let cases = [
            (Duration::from_nanos(399_999_997), "400ms"),
            (Duration::from_millis(1500), "1.5s"),
            (Duration::from_secs(150), "2m30s"),
            (Duration::from_nanos(3_599_999_999_997), "1h0m0s"),
            (Duration::from_millis(150_400), "2m30s"),
            (Duration::from_nanos(1_234_567_890), "1.235s"),
            (Duration::from_nanos(12_345), "12\u{b5}s"),
            (Duration::ZERO, "0s"),
        ];
        for (d, want) in cases {
            assert_eq!(Rounded(d).to_string(), want, "{d:?}");
        }
    }

    #[test]
    fn parses_what_go_parses() {
        let cases: &[(&str, i64)] = &[
            ("0", 0),
            ("0s", 0),
            ("-0s", 0),
            ("5s", 5_000_000_000),
            ("+5s", 5_000_000_000),
            ("10m", 600_000_000_000),
            ("12h", 43_200_000_000_000),
            ("1h30m", 5_400_000_000_000),
            ("500ms", 500_000_000),
            ("1.5s", 1_500_000_000),
            (".5s", 500_000_000),
            ("5.s", 5_000_000_000),
            ("100us", 100_000),
            ("100\u{b5}s", 100_000),
            ("100\u{3bc}s", 100_000),
            ("3ns", 3),
            ("-1m", -60_000_000_000),
            ("1h1m1s1ms1us1ns", 3_661_001_001_001),
            ("0.000000001s", 1),
            ("0.0000000019s", 1),
        ];
        for (input, want) in cases {
            assert_eq!(GoDuration::parse(input), Ok(GoDuration(*want)), "{input}");
        }
    }

    #[test]
    fn refuses_what_go_refuses() {
        for input in [
            "", "-", "s", "1", "10", ".s", "1x", "1hh", "1 h", " 1h", "1h ", "3000000h",
        ] {
            assert!(GoDuration::parse(input).is_err(), "{input:?} should fail");
        }
        assert!(matches!(
            GoDuration::parse("10"),
            Err(DurationError::MissingUnit(_))
        ));
        assert!(matches!(
            GoDuration::parse("1d"),
            Err(DurationError::UnknownUnit { .. })
        ));
        assert!(matches!(
            GoDuration::parse("9999999999h"),
            Err(DurationError::Overflow(_))
        ));
    }

    #[test]
    fn formats_like_go() {
        let cases: &[(i64, &str)] = &[
            (0, "0s"),
            (3_600_000_000_000, "1h0m0s"),
            (600_000_000_000, "10m0s"),
            (1_500_000_000, "1.5s"),
            (500_000_000, "500ms"),
            (-60_000_000_000, "-1m0s"),
        ];
        for (nanos, want) in cases {
            assert_eq!(GoDuration(*nanos).to_string(), *want);
        }
    }

    #[test]
    fn negative_has_no_std_form() {
        assert_eq!(GoDuration(-1).to_std(), None);
        assert_eq!(GoDuration(7).to_std(), Some(Duration::from_nanos(7)));
    }
}
