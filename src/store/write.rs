//! Writing a [`Plan`]: upserts of the dirty rows and the outbox row.

use entity::{cross_signing_key, remote_device, remote_user, stale_user};
use sea_orm::sea_query::OnConflict;
use sea_orm::{
    ActiveModelTrait, ActiveValue::NotSet, ActiveValue::Set, ConnectionTrait, DbBackend, DbErr,
    EntityTrait,
};

use super::bulk;
use super::outbox::{self, OutboxBatch, OutboxEvent};

use crate::decide::Plan;

/// Rows per multi-row INSERT (PostgreSQL allows 65 535 parameters).
pub(super) const CHUNK: usize = 1000;

/// Upserts `rows` in multi-row INSERTs of [`CHUNK`] rows, resolving
/// conflicts by `conflict`.
pub(super) async fn upsert<C, A>(db: &C, rows: &[A], conflict: OnConflict) -> Result<(), DbErr>
where
    C: ConnectionTrait,
    A: ActiveModelTrait + Clone,
{
    for chunk in rows.chunks(CHUNK) {
        <A::Entity as EntityTrait>::insert_many(chunk.to_vec())
            .on_conflict(conflict.clone())
            .exec_without_returning(db)
            .await?;
    }
    Ok(())
}

/// Writes every dirty row of `plan` and its events; returns the recorded
/// outbox batch (None when the plan has no events).
pub(super) async fn plan<C: ConnectionTrait>(
    db: &C,
    plan: &Plan,
    now_ms: i64,
) -> Result<Option<OutboxBatch>, DbErr> {
    if db.get_database_backend() == DbBackend::Postgres {
        bulk::write_users_and_devices(db, plan).await?;
    } else {
        portable_users_and_devices(db, plan).await?;
    }

    let stale: Vec<_> = plan
        .stale
        .iter()
        .map(|(user, mark)| stale_user::ActiveModel {
            user_id: Set(user.to_string()),
            server_name: Set(user.server_name().to_string()),
            marked_at_ms: Set(mark.marked_at_ms),
            trigger_stream_ids: Set(serde_json::to_string(&mark.trigger_ids).unwrap_or_default()),
            // A new mark starts with no failures (the columns' defaults);
            // re-marking a user keeps its own back-off (SPEC §5.2).
            last_error: NotSet,
            failures: NotSet,
            next_attempt_ms: NotSet,
        })
        .collect();
    upsert(
        db,
        &stale,
        OnConflict::column(stale_user::Column::UserId)
            .update_column(stale_user::Column::TriggerStreamIds)
            .to_owned(),
    )
    .await?;

    let keys: Vec<_> = plan
        .cross_signing
        .iter()
        .map(|((user, usage), json)| cross_signing_key::ActiveModel {
            user_id: Set(user.to_string()),
            key_usage: Set(usage.as_str().to_owned()),
            key_json: Set(json.clone()),
        })
        .collect();
    upsert(
        db,
        &keys,
        OnConflict::columns([
            cross_signing_key::Column::UserId,
            cross_signing_key::Column::KeyUsage,
        ])
        .update_column(cross_signing_key::Column::KeyJson)
        .to_owned(),
    )
    .await?;

    let events: Vec<OutboxEvent> = plan.events.iter().map(OutboxEvent::from_change).collect();
    let id = outbox::record(db, &events, now_ms).await?;
    Ok(id.map(|id| OutboxBatch {
        id,
        events,
        origin: None,
    }))
}

/// The user and device upserts as any backend runs them: multi-row INSERTs.
async fn portable_users_and_devices<C: ConnectionTrait>(db: &C, plan: &Plan) -> Result<(), DbErr> {
    let users: Vec<_> = plan
        .users
        .iter()
        .map(|(user, state)| remote_user::ActiveModel {
            user_id: Set(user.to_string()),
            server_name: Set(user.server_name().to_string()),
            known_stream_ids: Set(state.known.to_json()),
            max_stream_id: Set(state.max_stream_id),
            fetched_stream_id: Set(state.fetched_stream_id),
            // Written by the fetch writer alone (see `store/revalidate.rs`).
            fetched_at_ms: sea_orm::ActiveValue::NotSet,
        })
        .collect();
    upsert(
        db,
        &users,
        OnConflict::column(remote_user::Column::UserId)
            .update_columns([
                remote_user::Column::KnownStreamIds,
                remote_user::Column::MaxStreamId,
                remote_user::Column::FetchedStreamId,
            ])
            .to_owned(),
    )
    .await?;

    let devices: Vec<_> = plan
        .devices
        .iter()
        .map(|((user, device), row)| remote_device::ActiveModel {
            user_id: Set(user.to_string()),
            device_id: Set(device.to_string()),
            display_name: Set(row.display_name.clone()),
            keys_json: Set(row.keys.clone()),
            stream_id: Set(row.stream_id),
            deleted: Set(row.deleted),
        })
        .collect();
    upsert(
        db,
        &devices,
        OnConflict::columns([
            remote_device::Column::UserId,
            remote_device::Column::DeviceId,
        ])
        .update_columns([
            remote_device::Column::DisplayName,
            remote_device::Column::KeysJson,
            remote_device::Column::StreamId,
            remote_device::Column::Deleted,
        ])
        .to_owned(),
    )
    .await?;

    Ok(())
}
