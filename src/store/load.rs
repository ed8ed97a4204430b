//! Loading the stored state a batch needs into a [`Snapshot`].

use std::collections::BTreeSet;

use entity::{cross_signing_key, remote_device, remote_user, stale_user};
use ruma::{DeviceId, UserId};
use sea_orm::{ColumnTrait, ConnectionTrait, DbBackend, DbErr, EntityTrait, QueryFilter};

use super::bulk;
use super::one_of::one_of;
use super::rows::{self, CHUNK};

use crate::decide::Snapshot;
use crate::input::InputMessage;

/// The stored device a message needs to see, if any. Every kind is named
/// (no catch-all), so a new kind must say what it needs.
fn device_of(message: &InputMessage) -> Option<(&UserId, &DeviceId)> {
    match message {
        InputMessage::Update(u) => Some((&u.user_id, &u.device_id)),
        InputMessage::SigningKey(_)
        | InputMessage::Resync(_)
        | InputMessage::Membership(_)
        | InputMessage::MemberKey(_) => None,
    }
}

/// Whether a message needs the user's stored cross-signing keys.
fn needs_keys(message: &InputMessage) -> bool {
    match message {
        InputMessage::SigningKey(_) => true,
        InputMessage::Update(_)
        | InputMessage::Resync(_)
        | InputMessage::Membership(_)
        | InputMessage::MemberKey(_) => false,
    }
}

/// Loads users, devices, stale marks and cross-signing keys of `users`.
pub(super) async fn snapshot<C: ConnectionTrait>(
    db: &C,
    messages: &[InputMessage],
    users: &[&str],
) -> Result<Snapshot, DbErr> {
    let mut snapshot = Snapshot::default();
    let wants_keys = messages.iter().any(needs_keys);
    let (user_rows, stale_rows, device_rows) = if db.get_database_backend() == DbBackend::Postgres {
        let pairs: BTreeSet<(&str, &str)> = messages
            .iter()
            .filter_map(|m| device_of(m).map(|(user, device)| (user.as_str(), device.as_str())))
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
    snapshot
        .users
        .extend(user_rows.into_iter().filter_map(rows::user_state));
    snapshot
        .stale
        .extend(stale_rows.iter().filter_map(rows::stale));
    snapshot.devices.extend(
        device_rows
            .into_iter()
            .filter_map(rows::device)
            .map(|(user, id, device)| ((user, id), device)),
    );
    if wants_keys {
        let backend = db.get_database_backend();
        let ids = users.iter().copied();
        for these in one_of(backend, cross_signing_key::Column::UserId, ids) {
            let keys = cross_signing_key::Entity::find()
                .filter(these)
                .all(db)
                .await?;
            snapshot.cross_signing.extend(
                keys.into_iter()
                    .filter_map(rows::cross_signing_key)
                    .map(|(user, usage, key)| ((user, usage), key)),
            );
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
        .filter_map(|m| device_of(m).map(|(_, device)| device.as_str()))
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
