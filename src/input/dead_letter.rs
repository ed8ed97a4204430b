//! Why an input message can never be processed: the `<reason>` of
//! `devicelist.dead.<reason>` (SPEC §4.3).

use std::fmt;

/// The kind of bad input. Each kind has its own dead-letter subject.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeadReason {
    /// The body is not JSON at all.
    NotJson,
    /// JSON, but not an object of the expected shape.
    InvalidShape,
    /// `user_id` missing or not a valid Matrix user id.
    InvalidUserId,
    /// `device_id` missing, empty, too long or not a string.
    InvalidDeviceId,
    /// `stream_id` missing, negative or not an integer (or numeric string).
    InvalidStreamId,
    /// `prev_id` not a list of integers (or numeric strings), or too long.
    InvalidPrevId,
    /// `device_display_name` or `deleted` of the wrong type or size.
    InvalidField,
    /// `keys` present but not a JSON object.
    InvalidKeys,
    /// A signing-key update without a single well-formed key.
    InvalidSigningKey,
    /// The `origin` header names another server than the user's.
    OriginMismatch,
    /// The body is larger than the input limit.
    Oversized,
    /// The message arrived on a subject this worker does not consume.
    UnknownSubject,
    /// Delivered the maximum number of times without being processed.
    MaxDeliver,
    /// Well formed, but the database refuses to store it.
    Unprocessable,
    /// `room_id` missing or not a valid room id.
    InvalidRoomId,
    /// A `state_key` or `member_key` that is no identity (SPEC §5.5.7).
    InvalidIdentity,
    /// `membership` not one of `join`, `leave`, `invite`, `knock`, `ban`.
    InvalidMembership,
    /// `stream_ordering` missing, negative or not an integer (or numeric string).
    InvalidStreamOrdering,
    /// A member key's link naming another user than its first (SPEC §5.6.2).
    LinkConflict,
}

impl DeadReason {
    /// The subject token, e.g. `origin_mismatch`.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadReason::NotJson => "not_json",
            DeadReason::InvalidShape => "invalid_shape",
            DeadReason::InvalidUserId => "invalid_user_id",
            DeadReason::InvalidDeviceId => "invalid_device_id",
            DeadReason::InvalidStreamId => "invalid_stream_id",
            DeadReason::InvalidPrevId => "invalid_prev_id",
            DeadReason::InvalidField => "invalid_field",
            DeadReason::InvalidKeys => "invalid_keys",
            DeadReason::InvalidSigningKey => "invalid_signing_key",
            DeadReason::OriginMismatch => "origin_mismatch",
            DeadReason::Oversized => "oversized",
            DeadReason::UnknownSubject => "unknown_subject",
            DeadReason::MaxDeliver => "max_deliver",
            DeadReason::Unprocessable => "unprocessable",
            DeadReason::InvalidRoomId => "invalid_room_id",
            DeadReason::InvalidIdentity => "invalid_identity",
            DeadReason::InvalidMembership => "invalid_membership",
            DeadReason::InvalidStreamOrdering => "invalid_stream_ordering",
            DeadReason::LinkConflict => "link_conflict",
        }
    }
}

impl fmt::Display for DeadReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A refused message: the reason (subject token) and a human sentence (the `error` header).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    /// The kind of bad input.
    pub reason: DeadReason,
    /// What exactly is wrong, for people reading the dead-letter stream.
    pub error: String,
}

impl Rejection {
    /// Builds a rejection.
    pub fn new(reason: DeadReason, error: impl Into<String>) -> Self {
        Rejection {
            reason,
            error: error.into(),
        }
    }
}
