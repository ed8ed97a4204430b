//! Stored rows as the rules see them: the one mapping from each entity's
//! row to its domain value, for every reader (batch snapshots, fetched
//! lists, back-off). A row whose user id no longer parses is skipped by
//! every reader alike.

use entity::{cross_signing_key, remote_device, remote_user, stale_user};
use ruma::{OwnedDeviceId, OwnedUserId};

use crate::decide::device::DeviceRow;
use crate::decide::known_ids::KnownStreamIds;
use crate::decide::{StaleMark, UserState};
use crate::input::cross_signing::KeyUsage;

/// Rows per `IN (…)` list, well below every backend's parameter limit.
pub(super) const CHUNK: usize = 500;

/// A count as stored (an `integer` column).
pub(super) fn to_i32(n: u32) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// A user's stream state.
pub(super) fn user_state(row: remote_user::Model) -> Option<(OwnedUserId, UserState)> {
    let user = OwnedUserId::try_from(row.user_id).ok()?;
    let state = UserState {
        known: KnownStreamIds::from_json(&row.known_stream_ids),
        max_stream_id: row.max_stream_id,
        fetched_stream_id: row.fetched_stream_id,
    };
    Some((user, state))
}

/// A stored device (tombstones included).
pub(super) fn device(row: remote_device::Model) -> Option<(OwnedUserId, OwnedDeviceId, DeviceRow)> {
    let user = OwnedUserId::try_from(row.user_id).ok()?;
    let device = DeviceRow {
        display_name: row.display_name,
        keys: row.keys_json,
        stream_id: row.stream_id,
        deleted: row.deleted,
    };
    Some((user, OwnedDeviceId::from(row.device_id), device))
}

/// A stored cross-signing key (its JSON as received).
pub(super) fn cross_signing_key(
    row: cross_signing_key::Model,
) -> Option<(OwnedUserId, KeyUsage, String)> {
    let user = OwnedUserId::try_from(row.user_id).ok()?;
    let usage = KeyUsage::from_str_opt(&row.key_usage)?;
    Some((user, usage, row.key_json))
}

/// A stale mark.
pub(super) fn stale(row: &stale_user::Model) -> Option<(OwnedUserId, StaleMark)> {
    let user = OwnedUserId::try_from(row.user_id.as_str()).ok()?;
    Some((user, stale_mark(row)))
}

/// The mark of a stale row.
pub(super) fn stale_mark(row: &stale_user::Model) -> StaleMark {
    StaleMark {
        trigger_ids: serde_json::from_str(&row.trigger_stream_ids).unwrap_or_default(),
        marked_at_ms: row.marked_at_ms,
    }
}
