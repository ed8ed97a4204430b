//! Field parsers shared by the input messages: each turns loosely typed JSON
//! into a checked value or a [`Rejection`].

use ruma::{OwnedDeviceId, OwnedRoomId, OwnedUserId, RoomId, UserId};
use serde_json::Value;

use super::dead_letter::{DeadReason, Rejection};

/// Longest accepted device id, in bytes.
pub const MAX_DEVICE_ID_BYTES: usize = 255;
/// Longest accepted display name, in bytes.
pub const MAX_DISPLAY_NAME_BYTES: usize = 1024;
/// Most entries accepted in `prev_id`.
pub const MAX_PREV_IDS: usize = 1000;

/// A required Matrix user id.
pub fn user_id(value: Option<&Value>) -> Result<OwnedUserId, Rejection> {
    let Some(Value::String(raw)) = value else {
        return Err(Rejection::new(
            DeadReason::InvalidUserId,
            "user_id is missing or not a string",
        ));
    };
    if raw.contains('\0') {
        return Err(Rejection::new(
            DeadReason::InvalidUserId,
            "user_id contains NUL",
        ));
    }
    UserId::parse(raw.as_str())
        .map_err(|e| Rejection::new(DeadReason::InvalidUserId, format!("user_id {raw:?}: {e}")))
}

/// A required, non-empty device id.
pub fn device_id(value: Option<&Value>) -> Result<OwnedDeviceId, Rejection> {
    match value {
        Some(Value::String(raw))
            if !raw.is_empty() && raw.len() <= MAX_DEVICE_ID_BYTES && !raw.contains('\0') =>
        {
            Ok(OwnedDeviceId::from(raw.as_str()))
        }
        _ => Err(Rejection::new(
            DeadReason::InvalidDeviceId,
            format!(
                "device_id must be a non-empty string of at most {MAX_DEVICE_ID_BYTES} bytes without NUL"
            ),
        )),
    }
}

/// A non-negative integer given as a JSON number or a numeric string (SPEC §4.1).
fn stream_number(value: &Value) -> Option<i64> {
    match value {
        Value::Number(n) => n.as_i64().filter(|n| *n >= 0),
        Value::String(s) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => {
            s.parse::<i64>().ok()
        }
        _ => None,
    }
}

/// A required `stream_id`.
pub fn stream_id(value: Option<&Value>) -> Result<i64, Rejection> {
    value.and_then(stream_number).ok_or_else(|| {
        Rejection::new(
            DeadReason::InvalidStreamId,
            "stream_id must be a non-negative integer or numeric string",
        )
    })
}

/// A required `stream_ordering` (membership and member-key messages).
pub fn stream_ordering(value: Option<&Value>) -> Result<i64, Rejection> {
    value.and_then(stream_number).ok_or_else(|| {
        Rejection::new(
            DeadReason::InvalidStreamOrdering,
            "stream_ordering must be a non-negative integer or numeric string",
        )
    })
}

/// A required room id.
pub fn room_id(value: Option<&Value>) -> Result<OwnedRoomId, Rejection> {
    let Some(Value::String(raw)) = value else {
        return Err(Rejection::new(
            DeadReason::InvalidRoomId,
            "room_id is missing or not a string",
        ));
    };
    RoomId::parse(raw.as_str())
        .map_err(|e| Rejection::new(DeadReason::InvalidRoomId, format!("room_id {raw:?}: {e}")))
}

/// An optional `prev_id` list (absent or null means empty).
pub fn prev_ids(value: Option<&Value>) -> Result<Vec<i64>, Rejection> {
    let items = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => {
            return Err(Rejection::new(
                DeadReason::InvalidPrevId,
                "prev_id must be a list",
            ));
        }
    };
    if items.len() > MAX_PREV_IDS {
        return Err(Rejection::new(
            DeadReason::InvalidPrevId,
            format!(
                "prev_id has {} entries, more than {MAX_PREV_IDS}",
                items.len()
            ),
        ));
    }
    items
        .iter()
        .map(|item| {
            stream_number(item).ok_or_else(|| {
                Rejection::new(
                    DeadReason::InvalidPrevId,
                    "prev_id entries must be non-negative integers or numeric strings",
                )
            })
        })
        .collect()
}

/// An optional display name.
pub fn display_name(value: Option<&Value>) -> Result<Option<String>, Rejection> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.len() <= MAX_DISPLAY_NAME_BYTES && !s.contains('\0') => {
            Ok(Some(s.clone()))
        }
        Some(_) => Err(Rejection::new(
            DeadReason::InvalidField,
            format!(
                "device_display_name must be a string of at most {MAX_DISPLAY_NAME_BYTES} bytes without NUL"
            ),
        )),
    }
}

/// An optional boolean flag (absent or null means false).
pub fn flag(name: &str, value: Option<&Value>) -> Result<bool, Rejection> {
    match value {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(Rejection::new(
            DeadReason::InvalidField,
            format!("{name} must be a boolean"),
        )),
    }
}
