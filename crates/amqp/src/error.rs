//! AMQP reply codes and the error value that closes a channel or a connection.

use std::fmt;

/// An AMQP 0-9-1 reply code (the spec's constants, as RabbitMQ uses them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReplyCode {
    /// 200: normal close.
    Success,
    /// 311: content too large (soft).
    ContentTooLarge,
    /// 312: unroutable mandatory message (basic.return).
    NoRoute,
    /// 313: no consumers for an immediate message (basic.return).
    NoConsumers,
    /// 320: the server closed the connection (operator action, shutdown).
    ConnectionForced,
    /// 402: invalid path (hard).
    InvalidPath,
    /// 403: access refused (soft on channels; also used for refused logins).
    AccessRefused,
    /// 404: entity not found (soft).
    NotFound,
    /// 405: resource locked, e.g. an exclusive queue of another connection (soft).
    ResourceLocked,
    /// 406: precondition failed, e.g. redeclare with other arguments (soft).
    PreconditionFailed,
    /// 501: malformed or oversized frame (hard).
    FrameError,
    /// 502: a method field has an illegal value or cannot be decoded (hard).
    SyntaxError,
    /// 503: an invalid command or sequence of commands (hard).
    CommandInvalid,
    /// 504: a channel that is not open was used, or opened twice (hard).
    ChannelError,
    /// 505: a frame arrived where another kind was expected (hard).
    UnexpectedFrame,
    /// 506: the server ran out of a resource (hard).
    ResourceError,
    /// 530: not allowed, e.g. vhost refused or channel_max exceeded (hard).
    NotAllowed,
    /// 540: functionality not implemented by the server (hard).
    NotImplemented,
    /// 541: internal error (hard).
    InternalError,
}

impl ReplyCode {
    /// The numeric reply code carried in close methods.
    #[must_use]
    pub fn code(self) -> u16 {
        match self {
            Self::Success => 200,
            Self::ContentTooLarge => 311,
            Self::NoRoute => 312,
            Self::NoConsumers => 313,
            Self::ConnectionForced => 320,
            Self::InvalidPath => 402,
            Self::AccessRefused => 403,
            Self::NotFound => 404,
            Self::ResourceLocked => 405,
            Self::PreconditionFailed => 406,
            Self::FrameError => 501,
            Self::SyntaxError => 502,
            Self::CommandInvalid => 503,
            Self::ChannelError => 504,
            Self::UnexpectedFrame => 505,
            Self::ResourceError => 506,
            Self::NotAllowed => 530,
            Self::NotImplemented => 540,
            Self::InternalError => 541,
        }
    }

    /// The reply code for a numeric code, if it is one the spec defines.
    #[must_use]
    pub fn from_code(code: u16) -> Option<Self> {
        ALL.iter().copied().find(|c| c.code() == code)
    }

    /// The upper-case name RabbitMQ puts in front of reply texts (`NOT_FOUND`).
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Success => "OK",
            Self::ContentTooLarge => "CONTENT_TOO_LARGE",
            Self::NoRoute => "NO_ROUTE",
            Self::NoConsumers => "NO_CONSUMERS",
            Self::ConnectionForced => "CONNECTION_FORCED",
            Self::InvalidPath => "INVALID_PATH",
            Self::AccessRefused => "ACCESS_REFUSED",
            Self::NotFound => "NOT_FOUND",
            Self::ResourceLocked => "RESOURCE_LOCKED",
            Self::PreconditionFailed => "PRECONDITION_FAILED",
            Self::FrameError => "FRAME_ERROR",
            Self::SyntaxError => "SYNTAX_ERROR",
            Self::CommandInvalid => "COMMAND_INVALID",
            Self::ChannelError => "CHANNEL_ERROR",
            Self::UnexpectedFrame => "UNEXPECTED_FRAME",
            Self::ResourceError => "RESOURCE_ERROR",
            Self::NotAllowed => "NOT_ALLOWED",
            Self::NotImplemented => "NOT_IMPLEMENTED",
            Self::InternalError => "INTERNAL_ERROR",
        }
    }

    /// Whether the spec makes this a connection ("hard") error.
    #[must_use]
    pub fn is_hard(self) -> bool {
        matches!(
            self,
            Self::ConnectionForced
                | Self::InvalidPath
                | Self::FrameError
                | Self::SyntaxError
                | Self::CommandInvalid
                | Self::ChannelError
                | Self::UnexpectedFrame
                | Self::ResourceError
                | Self::NotAllowed
                | Self::NotImplemented
                | Self::InternalError
        )
    }
}

const ALL: [ReplyCode; 19] = [
    ReplyCode::Success,
    ReplyCode::ContentTooLarge,
    ReplyCode::NoRoute,
    ReplyCode::NoConsumers,
    ReplyCode::ConnectionForced,
    ReplyCode::InvalidPath,
    ReplyCode::AccessRefused,
    ReplyCode::NotFound,
    ReplyCode::ResourceLocked,
    ReplyCode::PreconditionFailed,
    ReplyCode::FrameError,
    ReplyCode::SyntaxError,
    ReplyCode::CommandInvalid,
    ReplyCode::ChannelError,
    ReplyCode::UnexpectedFrame,
    ReplyCode::ResourceError,
    ReplyCode::NotAllowed,
    ReplyCode::NotImplemented,
    ReplyCode::InternalError,
];

impl fmt::Display for ReplyCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.code(), self.name())
    }
}

/// An AMQP exception: the code, the text and the method that caused it.
///
/// It becomes a `channel.close` (soft codes) or a `connection.close` (hard
/// codes). The reply text sent is RabbitMQ's form, `NAME - text`
/// (see [`AmqpError::reply_text`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{} - {text}", code.name())]
pub struct AmqpError {
    /// The reply code.
    pub code: ReplyCode,
    /// The human text, without the `NAME - ` prefix.
    pub text: String,
    /// Class id of the method that caused the error (0 if none).
    pub class_id: u16,
    /// Method id of the method that caused the error (0 if none).
    pub method_id: u16,
}

impl AmqpError {
    /// An error with no causing method.
    pub fn new(code: ReplyCode, text: impl Into<String>) -> Self {
        Self {
            code,
            text: text.into(),
            class_id: 0,
            method_id: 0,
        }
    }

    /// Sets the causing method's class and method ids.
    #[must_use]
    pub fn with_method(mut self, class_id: u16, method_id: u16) -> Self {
        self.class_id = class_id;
        self.method_id = method_id;
        self
    }

    /// The reply text as RabbitMQ sends it: `NOT_FOUND - no queue 'q' in vhost '/'`;
    /// one longer than the 255 bytes a short string holds is cut to 252
    /// and ends in `...`, as RabbitMQ cuts it; the code's name alone for an
    /// empty text (as RabbitMQ's `INTERNAL_ERROR` when a channel crashes).
    #[must_use]
    pub fn reply_text(&self) -> String {
        if self.text.is_empty() {
            return self.code.name().to_owned();
        }
        let mut s = format!("{} - {}", self.code.name(), self.text);
        if s.len() > 255 {
            let mut end = 252;
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            s.truncate(end);
            s.push_str("...");
        }
        s
    }

    /// RabbitMQ's 530 for a virtual host that does not exist.
    pub fn vhost_not_found(vhost: &str) -> Self {
        Self::new(ReplyCode::NotAllowed, format!("vhost {vhost} not found")).with_method(10, 40)
    }

    /// RabbitMQ's 530 for a user without access to a virtual host.
    pub fn vhost_access_refused(vhost: &str, user: &str) -> Self {
        Self::new(
            ReplyCode::NotAllowed,
            format!("access to vhost '{vhost}' refused for user '{user}'"),
        )
        .with_method(10, 40)
    }

    /// RabbitMQ's 404 for a missing queue.
    pub fn queue_not_found(queue: &str, vhost: &str) -> Self {
        Self::new(
            ReplyCode::NotFound,
            format!("no queue '{queue}' in vhost '{vhost}'"),
        )
    }

    /// RabbitMQ's 404 for a missing exchange.
    pub fn exchange_not_found(exchange: &str, vhost: &str) -> Self {
        Self::new(
            ReplyCode::NotFound,
            format!("no exchange '{exchange}' in vhost '{vhost}'"),
        )
    }
}

/// Cuts a string to at most 255 bytes on a char boundary.
pub(crate) fn truncate_short(s: &mut String) {
    if s.len() > 255 {
        let mut end = 255;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
}
