//! Node names: how nodes know each other.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The name of a Warren node, such as `warren@127.0.0.2` (RabbitMQ's `rabbit@host` style).
///
/// Names are 1–255 bytes of printable characters without whitespace.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct NodeName(String);

/// Why a string is not a valid [`NodeName`].
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[error("invalid node name {name:?}: {reason}")]
pub struct NodeNameError {
    name: String,
    reason: &'static str,
}

impl NodeName {
    /// The longest node name, in bytes.
    pub const MAX_LEN: usize = 255;

    /// Checks and wraps a node name.
    pub fn new(name: impl Into<String>) -> Result<Self, NodeNameError> {
        let name = name.into();
        let reason = if name.is_empty() {
            Some("it is empty")
        } else if name.len() > Self::MAX_LEN {
            Some("it is longer than 255 bytes")
        } else if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
            Some("it contains whitespace or control characters")
        } else {
            None
        };
        match reason {
            Some(reason) => Err(NodeNameError { name, reason }),
            None => Ok(Self(name)),
        }
    }

    /// The name as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for NodeName {
    type Error = NodeNameError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::new(value)
    }
}

impl From<NodeName> for String {
    fn from(value: NodeName) -> Self {
        value.0
    }
}

impl std::str::FromStr for NodeName {
    type Err = NodeNameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl fmt::Display for NodeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for NodeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_rabbit_style_names() {
        assert_eq!(
            NodeName::new("warren@127.0.0.2").unwrap().as_str(),
            "warren@127.0.0.2"
        );
    }

    #[test]
    fn refuses_bad_names() {
        for bad in ["", " a", "a\nb", &"x".repeat(256)] {
            assert!(NodeName::new(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn deserialising_checks_the_name() {
        let bytes = postcard::to_stdvec(&"bad name".to_string()).unwrap();
        assert!(postcard::from_bytes::<NodeName>(&bytes).is_err());
    }
}
