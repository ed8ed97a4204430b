//! Loading the stored state a batch needs into a [`Snapshot`].

use std::collections::BTreeSet;

use entity::{cross_signing_key, remote_device, remote_user, stale_user};
use ruma::{OwnedDeviceId, OwnedUserId};
use sea_orm::{ColumnTrait, ConnectionTrait, DbBackend, DbErr, EntityTrait, QueryFilter};

use super::bulk;

use crate::decide::cross_signing::KeyUsage;
use crate::decide::device::DeviceRow;
use crate::decide::known_ids::KnownStreamIds;
use crate::decide::{Snapshot, StaleMark, UserState};
use crate::input::InputMessage;

/// Rows per `IN (…)` list, well below every backend's parameter limit.
const CHUNK: usize = 500;

/// Loads users, devices, stale marks and cross-signing keys of `users`.
pub(super) async fn snapshot<C: ConnectionTrait>(
    db: &C,
    messages: &[InputMessage],
    users: &[&str],
) -> Result<Snapshot, DbErr> {
    let mut snapshot = Snapshot::default();
    let wants_keys = messages
        .iter()
        .any(|m| matches!(m, InputMessage::SigningKey(_)));
    let (user_rows, stale_rows, device_rows) = if db.get_database_backend() == DbBackend::Postgres {
        let pairs: BTreeSet<(&str, &str)> = messages
            .iter()
            .filter_map(|m| match m {
                InputMessage::Update(u) => Some((u.user_id.as_str(), u.device_id.as_str())),
                _ => None,
            })
            .collect();
        let pairs: Vec<(&str, &str)> = pairs.into_iter().collect();
        (
            bulk::users(db, users).await?,
            bulk::stale(db, users).await?,
            bulk::devices(db, &pairs).await?,
        )
    } else {
        portable_rows(db, messages, users).await?
    };
    for row in user_rows {
        let Ok(user) = OwnedUserId::try_from(row.user_id) else {
            continue;
        };
        snapshot.users.insert(
            user,
            UserState {
                known: KnownStreamIds::from_json(&row.known_stream_ids),
                max_stream_id: row.max_stream_id,
                fetched_stream_id: row.fetched_stream_id,
            },
        );
    }
    for row in stale_rows {
        let Ok(user) = OwnedUserId::try_from(row.user_id) else {
            continue;
        };
        snapshot.stale.insert(
            user,
            StaleMark {
                trigger_ids: serde_json::from_str(&row.trigger_stream_ids).unwrap_or_default(),
                marked_at_ms: row.marked_at_ms,
            },
        );
    }
    for row in device_rows {
        let Ok(user) = OwnedUserId::try_from(row.user_id) else {
            continue;
        };
        snapshot.devices.insert(
            (user, OwnedDeviceId::from(row.device_id)),
            DeviceRow {
                display_name: row.display_name,
                keys: row.keys_json,
                stream_id: row.stream_id,
                deleted: row.deleted,
            },
        );
    }
    if wants_keys {
        for chunk in users.chunks(CHUNK) {
            for row in cross_signing_key::Entity::find()
                .filter(cross_signing_key::Column::UserId.is_in(chunk.iter().copied()))
                .all(db)
                .await?
            {
                let (Ok(user), Some(usage)) = (
                    OwnedUserId::try_from(row.user_id),
                    KeyUsage::from_str_opt(&row.key_usage),
                ) else {
                    continue;
                };
                snapshot.cross_signing.insert((user, usage), row.key_json);
            }
        }
    }
    Ok(snapshot)
}

/// Rows as any backend can select them: `IN (…)` lists in chunks.
async fn portable_rows<C: ConnectionTrait>(
    db: &C,
    messages: &[InputMessage],
    users: &[&str],
) -> Result<
    (
        Vec<remote_user::Model>,
        Vec<stale_user::Model>,
        Vec<remote_device::Model>,
    ),
    DbErr,
> {
    let devices: BTreeSet<&str> = messages
        .iter()
        .filter_map(|m| match m {
            InputMessage::Update(u) => Some(u.device_id.as_str()),
            _ => None,
        })
        .collect();
    let devices: Vec<&str> = devices.into_iter().collect();
    let (mut user_rows, mut stale_rows, mut device_rows) = (Vec::new(), Vec::new(), Vec::new());
    for chunk in users.chunks(CHUNK) {
        user_rows.extend(
            remote_user::Entity::find()
                .filter(remote_user::Column::UserId.is_in(chunk.iter().copied()))
                .all(db)
                .await?,
        );
        stale_rows.extend(
            stale_user::Entity::find()
                .filter(stale_user::Column::UserId.is_in(chunk.iter().copied()))
                .all(db)
                .await?,
        );
        // A superset (every listed device of every listed user) is cheaper than
        // a tuple IN and the same on both backends; extra rows are harmless.
        for device_chunk in devices.chunks(CHUNK) {
            device_rows.extend(
                remote_device::Entity::find()
                    .filter(remote_device::Column::UserId.is_in(chunk.iter().copied()))
                    .filter(remote_device::Column::DeviceId.is_in(device_chunk.iter().copied()))
                    .all(db)
                    .await?,
            );
        }
    }
    Ok((user_rows, stale_rows, device_rows))
}
