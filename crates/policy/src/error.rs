//! Errors: every message names the key (or field) at fault and the rule it broke.
//!
//! The texts follow RabbitMQ's (`rabbit_mirror_queue_misc`, `rabbit_policies`,
//! `rabbit_policy`), with the offending value shown as JSON instead of an
//! Erlang term, and, where RabbitMQ's text does not say what is allowed, the
//! rule appended after a semicolon or colon.

use crate::definition::keys;

/// Why a policy definition (the JSON object of keys) is invalid.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DefinitionError {
    /// The definition text is not JSON.
    #[error("Could not parse JSON document: {0}")]
    Json(String),
    /// The definition is JSON but not an object.
    #[error("definition must be a dictionary: {0}")]
    NotAnObject(String),
    /// The definition is an empty object.
    #[error("no policy provided")]
    Empty,
    /// The same key appears more than once in the definition text.
    #[error("{} duplicate keys not allowed", render_keys(.0))]
    DuplicateKeys(Vec<String>),
    /// Keys that no policy recognises (sorted).
    #[error("{} are not recognised policy settings", render_keys(.0))]
    Unrecognised(Vec<String>),
    /// Keys that regular policies accept but operator policies do not (sorted).
    #[error(
        "{} are not recognised operator policy settings; operator policies accept only {}",
        render_keys(.0),
        keys::OPERATOR.join(", ")
    )]
    NotOperatorKeys(Vec<String>),
    /// An ha-* key is present without `ha-mode`.
    #[error(
        "ha-mode must be specified to specify ha-params, ha-sync-mode or ha-promote-on-shutdown: \
         {0} is set but ha-mode is not"
    )]
    HaModeRequired(&'static str),
    /// `ha-mode` is not one of the modes.
    #[error("{0} is not a valid ha-mode value; ha-mode must be \"all\", \"exactly\" or \"nodes\"")]
    InvalidHaMode(String),
    /// `ha-params` given with `ha-mode` `all`.
    #[error("ha-mode=\"all\" does not take parameters: remove ha-params")]
    AllTakesNoParams,
    /// `ha-params` for `exactly` is not a positive integer.
    #[error(
        "ha-mode=\"exactly\" takes an integer, {0} given: \
         ha-params must be a positive integer when ha-mode is exactly"
    )]
    ExactlyTakesInteger(String),
    /// `ha-mode` `exactly` without `ha-params`.
    #[error(
        "ha-mode=\"exactly\" takes an integer, none given: \
         ha-mode exactly needs ha-params: a positive count of replicas, the master included"
    )]
    ExactlyNeedsParams,
    /// `ha-params` for `nodes` is not a list.
    #[error(
        "ha-mode=\"nodes\" takes a list, {0} given: \
         ha-params must be a non-empty list of node names when ha-mode is nodes"
    )]
    NodesTakesList(String),
    /// `ha-params` for `nodes` is an empty list.
    #[error("ha-mode=\"nodes\" list must be non-empty: ha-params must name at least one node")]
    NodesListEmpty,
    /// `ha-params` for `nodes` holds something other than strings.
    #[error(
        "ha-mode=\"nodes\" takes a list of strings, {0} was not a string: \
         ha-params must be a list of node names"
    )]
    NodesNotStrings(String),
    /// `ha-mode` `nodes` without `ha-params`.
    #[error(
        "ha-mode=\"nodes\" takes a list, none given: \
         ha-mode nodes needs ha-params: a non-empty list of node names"
    )]
    NodesNeedsParams,
    /// `ha-sync-mode` is not `manual` or `automatic`.
    #[error("ha-sync-mode must be \"manual\" or \"automatic\", got {0}")]
    InvalidSyncMode(String),
    /// `ha-sync-batch-size` is not a positive integer.
    #[error("ha-sync-batch-size takes an integer greater than 0, {0} given")]
    InvalidSyncBatchSize(String),
    /// `ha-promote-on-shutdown` is not `always` or `when-synced`.
    #[error("ha-promote-on-shutdown must be \"always\" or \"when-synced\", got {0}")]
    InvalidPromoteOnShutdown(String),
    /// `ha-promote-on-failure` is not `always` or `when-synced`.
    #[error("ha-promote-on-failure must be \"always\" or \"when-synced\", got {0}")]
    InvalidPromoteOnFailure(String),
    /// `ha-min-sync-replicas` is not a positive integer.
    #[error("ha-min-sync-replicas takes an integer greater than 0, {0} given")]
    InvalidMinSyncReplicas(String),
    /// `ha-min-sync-replicas` asks for more synchronised replicas than the mode can ever place.
    #[error(
        "ha-min-sync-replicas ({min}) is greater than the {max} replicas that ha-mode={mode} \
         allows: confirms would be held forever"
    )]
    MinSyncReplicasUnreachable {
        /// The `ha-min-sync-replicas` value.
        min: u32,
        /// The most replicas (master included) the mode places.
        max: u32,
        /// The `ha-mode` value.
        mode: &'static str,
    },
    /// `queue-master-locator` is not one of the locators.
    #[error(
        "{0} invalid queue-master-locator value; queue-master-locator must be \
         \"client-local\", \"min-masters\" or \"random\""
    )]
    InvalidMasterLocator(String),
    /// `queue-mode` is neither `default` nor `lazy`.
    #[error("{0} is not a valid queue-mode value")]
    InvalidQueueMode(String),
    /// `message-ttl` is not a non-negative integer.
    #[error(
        "{0} is not a valid message TTL: message-ttl must be a non-negative integer (milliseconds)"
    )]
    InvalidMessageTtl(String),
    /// `expires` is not a positive integer.
    #[error("{0} is not a valid queue expiry: expires must be a positive integer (milliseconds)")]
    InvalidExpires(String),
    /// `max-length` is not a non-negative integer.
    #[error("{0} is not a valid maximum length: max-length must be a non-negative integer")]
    InvalidMaxLength(String),
    /// `max-length-bytes` is not a non-negative integer.
    #[error(
        "{0} is not a valid maximum length in bytes: max-length-bytes must be a non-negative integer"
    )]
    InvalidMaxLengthBytes(String),
    /// `overflow` is not one of the overflow behaviours.
    #[error(
        "{0} is not a valid overflow value: overflow must be \"drop-head\", \"reject-publish\" \
         or \"reject-publish-dlx\""
    )]
    InvalidOverflow(String),
    /// `dead-letter-exchange` is not a string.
    #[error("{0} is not a valid dead letter exchange name: dead-letter-exchange must be a string")]
    InvalidDeadLetterExchange(String),
    /// `dead-letter-routing-key` is not a string.
    #[error("{0} is not a valid dead letter routing key: dead-letter-routing-key must be a string")]
    InvalidDeadLetterRoutingKey(String),
    /// `alternate-exchange` is not a string.
    #[error("{0} is not a valid alternate exchange name: alternate-exchange must be a string")]
    InvalidAlternateExchange(String),
}

impl DefinitionError {
    /// The definition key the error is about, when there is exactly one.
    pub fn key(&self) -> Option<&'static str> {
        use DefinitionError as E;
        Some(match self {
            E::Json(_)
            | E::NotAnObject(_)
            | E::Empty
            | E::DuplicateKeys(_)
            | E::Unrecognised(_)
            | E::NotOperatorKeys(_) => return None,
            E::HaModeRequired(_) | E::InvalidHaMode(_) => keys::HA_MODE,
            E::AllTakesNoParams
            | E::ExactlyTakesInteger(_)
            | E::ExactlyNeedsParams
            | E::NodesTakesList(_)
            | E::NodesListEmpty
            | E::NodesNotStrings(_)
            | E::NodesNeedsParams => keys::HA_PARAMS,
            E::InvalidSyncMode(_) => keys::HA_SYNC_MODE,
            E::InvalidSyncBatchSize(_) => keys::HA_SYNC_BATCH_SIZE,
            E::InvalidPromoteOnShutdown(_) => keys::HA_PROMOTE_ON_SHUTDOWN,
            E::InvalidPromoteOnFailure(_) => keys::HA_PROMOTE_ON_FAILURE,
            E::InvalidMinSyncReplicas(_) | E::MinSyncReplicasUnreachable { .. } => {
                keys::HA_MIN_SYNC_REPLICAS
            }
            E::InvalidMasterLocator(_) => keys::QUEUE_MASTER_LOCATOR,
            E::InvalidQueueMode(_) => keys::QUEUE_MODE,
            E::InvalidMessageTtl(_) => keys::MESSAGE_TTL,
            E::InvalidExpires(_) => keys::EXPIRES,
            E::InvalidMaxLength(_) => keys::MAX_LENGTH,
            E::InvalidMaxLengthBytes(_) => keys::MAX_LENGTH_BYTES,
            E::InvalidOverflow(_) => keys::OVERFLOW,
            E::InvalidDeadLetterExchange(_) => keys::DEAD_LETTER_EXCHANGE,
            E::InvalidDeadLetterRoutingKey(_) => keys::DEAD_LETTER_ROUTING_KEY,
            E::InvalidAlternateExchange(_) => keys::ALTERNATE_EXCHANGE,
        })
    }
}

/// Why a policy (its name, pattern, apply-to, priority or definition) is invalid.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PolicyError {
    /// The policy name is empty.
    #[error("policy name must not be empty")]
    EmptyName,
    /// The pattern does not compile.
    #[error("pattern {pattern:?} is not a valid regular expression: {reason}")]
    InvalidPattern {
        /// The pattern as given.
        pattern: String,
        /// What the regex compiler said.
        reason: String,
    },
    /// `apply-to` is not one of the accepted values.
    #[error(
        "apply-to '{0}' unrecognised; should be one of: 'queues', 'classic_queues', \
         'exchanges', or 'all'"
    )]
    InvalidApplyTo(String),
    /// The priority is not an integer.
    #[error("{0:?} priority must be a number")]
    InvalidPriority(String),
    /// The definition is invalid.
    #[error(transparent)]
    Definition(#[from] DefinitionError),
}

fn render_keys(keys: &[String]) -> String {
    serde_json::Value::from(keys.to_vec()).to_string()
}
