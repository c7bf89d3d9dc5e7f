//! Users, RabbitMQ-compatible salted SHA-256 password hashes, and vhost
//! permissions (configure, write, read regexes).

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use rand::RngCore as _;
use regex::Regex;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// Hashes `password` as RabbitMQ's `rabbit_password_hashing_sha256` does:
/// base64 of a 4-byte random salt followed by SHA-256(salt ++ password).
#[must_use]
pub fn hash_password(password: &str) -> String {
    let mut salt = [0u8; 4];
    rand::rng().fill_bytes(&mut salt);
    hash_with_salt(salt, password)
}

fn hash_with_salt(salt: [u8; 4], password: &str) -> String {
    let mut h = Sha256::new();
    h.update(salt);
    h.update(password.as_bytes());
    let mut out = salt.to_vec();
    out.extend_from_slice(&h.finalize());
    STANDARD.encode(out)
}

/// Checks `password` against a hash made by [`hash_password`] (or by
/// RabbitMQ with `rabbit_password_hashing_sha256`).
#[must_use]
pub fn check_password(hash: &str, password: &str) -> bool {
    let Ok(raw) = STANDARD.decode(hash.trim()) else {
        return false;
    };
    if raw.len() != 4 + 32 {
        return false;
    }
    let salt = [raw[0], raw[1], raw[2], raw[3]];
    let mut h = Sha256::new();
    h.update(salt);
    h.update(password.as_bytes());
    let digest = h.finalize();
    // Constant-time comparison.
    digest
        .iter()
        .zip(&raw[4..])
        .fold(0u8, |acc, (a, b)| acc | (a ^ b))
        == 0
}

/// A user as stored in the metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserDef {
    /// The user name.
    pub name: String,
    /// The password hash ([`hash_password`] format).
    pub password_hash: String,
    /// Tags (`administrator`, `monitoring`, …), as RabbitMQ has them.
    #[serde(default)]
    pub tags: Vec<String>,
    /// Only allowed to log in from a loopback address (the default `guest`).
    #[serde(default)]
    pub loopback_only: bool,
}

/// A user's permissions in one vhost, as stored in the metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PermissionDef {
    /// The user.
    pub user: String,
    /// The vhost.
    pub vhost: String,
    /// Regex of the resources the user may create and delete.
    pub configure: String,
    /// Regex of the resources the user may publish to (or bind to as destination).
    pub write: String,
    /// Regex of the resources the user may consume from (or bind from as source).
    pub read: String,
}

/// Which permission an operation needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Create or delete.
    Configure,
    /// Publish or bind into.
    Write,
    /// Consume, get, purge or bind from.
    Read,
}

impl Access {
    /// The word RabbitMQ uses in its error text.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Configure => "configure",
            Self::Write => "write",
            Self::Read => "read",
        }
    }
}

/// Compiled permissions of one user in one vhost.
#[derive(Debug, Clone)]
pub(crate) struct Permission {
    configure: Option<Regex>,
    write: Option<Regex>,
    read: Option<Regex>,
}

/// As in RabbitMQ, a permission regex matches anywhere in the name unless it
/// is anchored (`^app\\.`), and the empty regex matches nothing.
fn compile(re: &str) -> Option<Regex> {
    if re.is_empty() {
        return None;
    }
    Regex::new(re).ok()
}

impl Permission {
    pub(crate) fn new(def: &PermissionDef) -> Self {
        Self {
            configure: compile(&def.configure),
            write: compile(&def.write),
            read: compile(&def.read),
        }
    }

    pub(crate) fn allows(&self, access: Access, name: &str) -> bool {
        let re = match access {
            Access::Configure => &self.configure,
            Access::Write => &self.write,
            Access::Read => &self.read,
        };
        re.as_ref().is_some_and(|r| r.is_match(name))
    }
}

/// Checks that a permission regex compiles.
#[must_use]
pub fn valid_regex(re: &str) -> bool {
    re.is_empty() || Regex::new(re).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rabbitmq_hash_format_roundtrip() {
        let h = hash_password("guest");
        assert!(check_password(&h, "guest"));
        assert!(!check_password(&h, "guesT"));
        assert!(!check_password("not base64!", "guest"));
    }

    #[test]
    fn known_rabbitmq_hash() {
        // salt 0x908DC60A, as in RabbitMQ's docs on computing hashes.
        let h = hash_with_salt([0x90, 0x8d, 0xc6, 0x0a], "test12");
        assert_eq!(h, "kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR");
        assert!(check_password(&h, "test12"));
    }

    #[test]
    fn permissions_match_like_rabbitmq() {
        let p = Permission::new(&PermissionDef {
            user: "u".into(),
            vhost: "/".into(),
            configure: "^app-".into(),
            write: "".into(),
            read: ".*".into(),
        });
        assert!(p.allows(Access::Configure, "app-1"));
        assert!(!p.allows(Access::Configure, "xapp-1"));
        assert!(!p.allows(Access::Write, "app-1"));
        assert!(p.allows(Access::Read, "anything"));
    }
}
