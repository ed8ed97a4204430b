//! Storing a fetched device list (SPEC §5.3) and finding who to fetch.

use std::collections::BTreeMap;

use entity::{cross_signing_key, remote_device, remote_user, stale_user};
use ruma::{OwnedDeviceId, OwnedUserId, ServerName, UserId};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DbErr, EntityTrait, QueryFilter, QueryOrder, QuerySelect,
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

    /// Stale users per server.
    pub async fn stale_counts(&self) -> Result<Vec<(String, i64)>, DbErr> {
        stale_user::Entity::find()
            .select_only()
            .column(stale_user::Column::ServerName)
            .column_as(stale_user::Column::UserId.count(), "n")
            .group_by(stale_user::Column::ServerName)
            .order_by_asc(stale_user::Column::ServerName)
            .into_tuple::<(String, i64)>()
            .all(&self.db)
            .await
    }

    /// How many users are stale.
    pub async fn stale_user_count(&self) -> Result<u64, DbErr> {
        use sea_orm::PaginatorTrait;
        stale_user::Entity::find().count(&self.db).await
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
        let item = FetchedUser {
            user: user.to_owned(),
            stale_at_start: stale_at_start.cloned(),
            list: list.clone(),
        };
        let (mut outcomes, outbox) = self
            .apply_fetches(std::slice::from_ref(&item), max_devices, now_ms)
            .await?;
        let outcome = outcomes
            .pop()
            .ok_or_else(|| DbErr::Custom("no outcome for the one list stored".into()))?;
        Ok(outcome.map(|plan| FetchStored { plan, outbox }))
    }

    /// Stores several fetched lists (of different users) in one transaction:
    /// the group commit of the fetcher. Returns one outcome per item, in
    /// order, and the outbox batch holding all their events.
    pub async fn apply_fetches(
        &self,
        items: &[FetchedUser],
        max_devices: usize,
        now_ms: i64,
    ) -> Result<(Vec<Result<FetchPlan, FetchRefusal>>, Option<OutboxBatch>), DbErr> {
        let txn = self.begin_write().await?;
        let mut users: Vec<&str> = items.iter().map(|i| i.user.as_str()).collect();
        users.sort_unstable();
        users.dedup();
        lock_users(&txn, &users).await?;
        let mut stored = load_users(&txn, &users).await?;
        let mut rows = Plan::default();
        let mut fresh = Vec::new();
        let mut outcomes = Vec::with_capacity(items.len());
        for item in items {
            let user = &item.user;
            let now = stored.remove(user).unwrap_or_default();
            let outcome = plan_fetch(
                user,
                &now,
                item.stale_at_start.as_ref(),
                &item.list,
                max_devices,
            );
            if let Ok(plan) = &outcome {
                rows.users.insert(user.clone(), plan.state.clone());
                for (device, row) in &plan.devices {
                    rows.devices
                        .insert((user.clone(), device.clone()), row.clone());
                }
                for (usage, json) in &plan.cross_signing {
                    rows.cross_signing
                        .insert((user.clone(), *usage), json.clone());
                }
                match &plan.still_stale {
                    Some(mark) => {
                        rows.stale.insert(user.clone(), mark.clone());
                    }
                    None => fresh.push(user.as_str().to_owned()),
                }
                rows.events.extend(plan.events.iter().cloned());
            }
            outcomes.push(outcome);
        }
        let outbox = write::plan(&txn, &rows, now_ms).await?;
        // A user kept stale by a trigger that came in meanwhile was answered:
        // its own back-off is over.
        let answered: Vec<String> = rows.stale.keys().map(|u| u.as_str().to_owned()).collect();
        for chunk in answered.chunks(500) {
            use sea_orm::sea_query::Expr;
            stale_user::Entity::update_many()
                .col_expr(stale_user::Column::Failures, Expr::value(0))
                .col_expr(stale_user::Column::NextAttemptMs, Expr::value(0_i64))
                .filter(stale_user::Column::UserId.is_in(chunk.iter().cloned()))
                .exec(&txn)
                .await?;
        }
        for chunk in fresh.chunks(500) {
            stale_user::Entity::delete_many()
                .filter(stale_user::Column::UserId.is_in(chunk.iter().cloned()))
                .exec(&txn)
                .await?;
        }
        txn.commit().await?;
        Ok((outcomes, outbox))
    }
}

/// One fetched list to store.
#[derive(Clone, Debug)]
pub struct FetchedUser {
    /// Whose list it is meant to be.
    pub user: OwnedUserId,
    /// The user's stale mark when the request was sent.
    pub stale_at_start: Option<StaleMark>,
    /// The answer.
    pub list: FetchedList,
}

pub(super) fn stale_mark(marked_at_ms: i64, triggers: &str) -> StaleMark {
    StaleMark {
        trigger_ids: serde_json::from_str(triggers).unwrap_or_default(),
        marked_at_ms,
    }
}

/// Everything stored for `users`, four queries per 500 users.
async fn load_users<C: ConnectionTrait>(
    db: &C,
    users: &[&str],
) -> Result<BTreeMap<OwnedUserId, StoredUser>, DbErr> {
    let mut stored: BTreeMap<OwnedUserId, StoredUser> = BTreeMap::new();
    for chunk in users.chunks(500) {
        let ids = || chunk.iter().copied();
        for row in remote_user::Entity::find()
            .filter(remote_user::Column::UserId.is_in(ids()))
            .all(db)
            .await?
        {
            let Ok(user) = OwnedUserId::try_from(row.user_id) else {
                continue;
            };
            stored.entry(user).or_default().state = UserState {
                known: KnownStreamIds::from_json(&row.known_stream_ids),
                max_stream_id: row.max_stream_id,
                fetched_stream_id: row.fetched_stream_id,
            };
        }
        for row in remote_device::Entity::find()
            .filter(remote_device::Column::UserId.is_in(ids()))
            .all(db)
            .await?
        {
            let Ok(user) = OwnedUserId::try_from(row.user_id) else {
                continue;
            };
            stored.entry(user).or_default().devices.insert(
                OwnedDeviceId::from(row.device_id),
                DeviceRow {
                    display_name: row.display_name,
                    keys: row.keys_json,
                    stream_id: row.stream_id,
                    deleted: row.deleted,
                },
            );
        }
        for row in cross_signing_key::Entity::find()
            .filter(cross_signing_key::Column::UserId.is_in(ids()))
            .all(db)
            .await?
        {
            let (Ok(user), Some(usage)) = (
                OwnedUserId::try_from(row.user_id),
                KeyUsage::from_str_opt(&row.key_usage),
            ) else {
                continue;
            };
            stored
                .entry(user)
                .or_default()
                .cross_signing
                .insert(usage, row.key_json);
        }
        for row in stale_user::Entity::find()
            .filter(stale_user::Column::UserId.is_in(ids()))
            .all(db)
            .await?
        {
            let Ok(user) = OwnedUserId::try_from(row.user_id) else {
                continue;
            };
            stored.entry(user).or_default().stale =
                Some(stale_mark(row.marked_at_ms, &row.trigger_stream_ids));
        }
    }
    Ok(stored)
}
