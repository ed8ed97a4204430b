//! Storing a fetched device list (SPEC §5.3) and finding who to fetch.

use std::collections::BTreeMap;

use entity::{cross_signing_key, remote_device, remote_user, stale_user};
use ruma::{OwnedDeviceId, OwnedUserId, ServerName, UserId};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DbErr, EntityTrait, QueryFilter, QueryOrder, QuerySelect,
    SqliteTransactionMode, TransactionOptions, TransactionTrait,
};

use super::outbox::OutboxBatch;
use super::{Store, lock_users, write};
use crate::decide::cross_signing::KeyUsage;
use crate::decide::device::DeviceRow;
use crate::decide::fetched::{FetchPlan, FetchRefusal, FetchedList, StoredUser, plan_fetch};
use crate::decide::known_ids::KnownStreamIds;
use crate::decide::{Plan, StaleMark, UserState};

/// A fetched list that was stored.
#[derive(Debug)]
pub struct FetchStored {
    /// What was written.
    pub plan: FetchPlan,
    /// Its events as recorded in the outbox (None: nothing changed).
    pub outbox: Option<OutboxBatch>,
}

impl Store {
    /// Users of `server` marked stale, oldest mark first, at most `limit`.
    pub async fn stale_users(
        &self,
        server: &ServerName,
        limit: u64,
    ) -> Result<Vec<(OwnedUserId, StaleMark)>, DbErr> {
        let rows = stale_user::Entity::find()
            .filter(stale_user::Column::ServerName.eq(server.as_str()))
            .order_by_asc(stale_user::Column::MarkedAtMs)
            .order_by_asc(stale_user::Column::UserId)
            .limit(limit)
            .all(&self.db)
            .await?;
        Ok(rows
            .into_iter()
            .filter_map(|row| {
                let user = OwnedUserId::try_from(row.user_id).ok()?;
                Some((user, stale_mark(row.marked_at_ms, &row.trigger_stream_ids)))
            })
            .collect())
    }

    /// Every server with stale users (for the start-up rescan).
    pub async fn servers_with_stale_users(&self) -> Result<Vec<String>, DbErr> {
        stale_user::Entity::find()
            .select_only()
            .column(stale_user::Column::ServerName)
            .distinct()
            .into_tuple::<String>()
            .all(&self.db)
            .await
    }

    /// Records why fetching `user` failed (shown by the resync RPC).
    pub async fn note_fetch_error(&self, user: &UserId, error: &str) -> Result<(), DbErr> {
        use sea_orm::sea_query::Expr;
        stale_user::Entity::update_many()
            .col_expr(stale_user::Column::LastError, Expr::value(error.to_owned()))
            .filter(stale_user::Column::UserId.eq(user.as_str()))
            .exec(&self.db)
            .await?;
        Ok(())
    }

    /// The user's stale row now: its mark and the last fetch error.
    pub async fn stale_state(
        &self,
        user: &UserId,
    ) -> Result<Option<(StaleMark, Option<String>)>, DbErr> {
        Ok(stale_user::Entity::find_by_id(user.as_str().to_owned())
            .one(&self.db)
            .await?
            .map(|row| {
                (
                    stale_mark(row.marked_at_ms, &row.trigger_stream_ids),
                    row.last_error,
                )
            }))
    }

    /// The user's stale mark now, if any.
    pub async fn stale_mark(&self, user: &UserId) -> Result<Option<StaleMark>, DbErr> {
        Ok(stale_user::Entity::find_by_id(user.as_str().to_owned())
            .one(&self.db)
            .await?
            .map(|row| stale_mark(row.marked_at_ms, &row.trigger_stream_ids)))
    }

    /// Stores `list`, fetched for `user` while `stale_at_start` was its mark,
    /// in one transaction under the same per-user lock as ingest: devices
    /// replaced (unlisted ones deleted), keys, stream state, the stale mark
    /// cleared (or kept for triggers that arrived meanwhile), and the events.
    /// The inner error: the answer must not be stored.
    pub async fn apply_fetch(
        &self,
        user: &UserId,
        stale_at_start: Option<&StaleMark>,
        list: &FetchedList,
        max_devices: usize,
        now_ms: i64,
    ) -> Result<Result<FetchStored, FetchRefusal>, DbErr> {
        let txn = self
            .db
            .begin_with_options(TransactionOptions {
                sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
                ..Default::default()
            })
            .await?;
        lock_users(&txn, &[user.as_str()]).await?;
        let stored = load_user(&txn, user).await?;
        let plan = match plan_fetch(user, &stored, stale_at_start, list, max_devices) {
            Ok(plan) => plan,
            Err(refusal) => {
                txn.rollback().await?;
                return Ok(Err(refusal));
            }
        };
        let mut rows = Plan::default();
        rows.users.insert(user.to_owned(), plan.state.clone());
        for (device, row) in &plan.devices {
            rows.devices
                .insert((user.to_owned(), device.clone()), row.clone());
        }
        for (usage, json) in &plan.cross_signing {
            rows.cross_signing
                .insert((user.to_owned(), *usage), json.clone());
        }
        if let Some(mark) = &plan.still_stale {
            rows.stale.insert(user.to_owned(), mark.clone());
        }
        rows.events = plan.events.clone();
        let outbox = write::plan(&txn, &rows, now_ms).await?;
        if plan.still_stale.is_none() {
            stale_user::Entity::delete_by_id(user.as_str().to_owned())
                .exec(&txn)
                .await?;
        }
        txn.commit().await?;
        Ok(Ok(FetchStored { plan, outbox }))
    }
}

fn stale_mark(marked_at_ms: i64, triggers: &str) -> StaleMark {
    StaleMark {
        trigger_ids: serde_json::from_str(triggers).unwrap_or_default(),
        marked_at_ms,
    }
}

/// Everything stored for one user.
async fn load_user<C: ConnectionTrait>(db: &C, user: &UserId) -> Result<StoredUser, DbErr> {
    let id = user.as_str().to_owned();
    let state = remote_user::Entity::find_by_id(id.clone())
        .one(db)
        .await?
        .map(|row| UserState {
            known: KnownStreamIds::from_json(&row.known_stream_ids),
            max_stream_id: row.max_stream_id,
        })
        .unwrap_or_default();
    let devices: BTreeMap<OwnedDeviceId, DeviceRow> = remote_device::Entity::find()
        .filter(remote_device::Column::UserId.eq(id.clone()))
        .all(db)
        .await?
        .into_iter()
        .map(|row| {
            (
                OwnedDeviceId::from(row.device_id),
                DeviceRow {
                    display_name: row.display_name,
                    keys: row.keys_json,
                    stream_id: row.stream_id,
                    deleted: row.deleted,
                },
            )
        })
        .collect();
    let cross_signing = cross_signing_key::Entity::find()
        .filter(cross_signing_key::Column::UserId.eq(id.clone()))
        .all(db)
        .await?
        .into_iter()
        .filter_map(|row| Some((KeyUsage::from_str_opt(&row.key_usage)?, row.key_json)))
        .collect();
    let stale = stale_user::Entity::find_by_id(id)
        .one(db)
        .await?
        .map(|row| stale_mark(row.marked_at_ms, &row.trigger_stream_ids));
    Ok(StoredUser {
        devices,
        state,
        cross_signing,
        stale,
    })
}
