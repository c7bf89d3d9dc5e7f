//! Names of vhosts, queues, exchanges, users and policies, held to what
//! AMQP can carry: UTF-8 (a Rust `str` already is), at most 255 bytes (a
//! short string), and no control characters. A NUL once let two (vhost,
//! queue) pairs share one data directory; a newline forged log lines; a
//! 300-byte dead-letter exchange was cut short when a message was routed.

use std::fmt;

/// The longest name, in bytes: an AMQP short string.
pub const MAX_NAME_BYTES: usize = 255;

/// Why a name is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadName {
    /// Longer than [`MAX_NAME_BYTES`].
    TooLong(usize),
    /// Holds a control character (NUL, newline, …).
    Control,
}

impl fmt::Display for BadName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooLong(n) => write!(f, "{n} bytes long, more than {MAX_NAME_BYTES}"),
            Self::Control => f.write_str("contains a control character"),
        }
    }
}

/// Checks one name.
pub fn check_name(name: &str) -> Result<(), BadName> {
    if name.len() > MAX_NAME_BYTES {
        return Err(BadName::TooLong(name.len()));
    }
    if name.chars().any(char::is_control) {
        return Err(BadName::Control);
    }
    Ok(())
}

/// A name as it may be shown in a message: control characters escaped.
pub(crate) fn shown(name: &str) -> String {
    name.escape_debug().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_held_to_a_short_string_without_controls() {
        assert_eq!(check_name(""), Ok(()));
        assert_eq!(check_name("orders.eu-west/ünïcode ✓"), Ok(()));
        assert_eq!(check_name(&"x".repeat(255)), Ok(()));
        assert_eq!(check_name(&"x".repeat(256)), Err(BadName::TooLong(256)));
        // 128 two-byte characters: 256 bytes.
        assert_eq!(check_name(&"é".repeat(128)), Err(BadName::TooLong(256)));
        for bad in [
            "a\0b",
            "line\nINFO forged",
            "tab\t",
            "del\u{7f}",
            "c1\u{85}",
        ] {
            assert_eq!(check_name(bad), Err(BadName::Control), "{bad:?}");
        }
        assert_eq!(shown("a\nb\0"), "a\\nb\\0");
    }
}
