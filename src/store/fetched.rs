//! Storing a fetched device list (SPEC §5.3) and finding who to fetch.

use std::collections::{BTreeMap, BTreeSet};

use entity::{cross_signing_key, remote_device, remote_user, stale_user};
use ruma::{OwnedUserId, UserId};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DbErr, EntityTrait, QueryFilter, QueryOrder, QuerySelect,
};

use super::one_of::one_of;
use super::outbox::OutboxBatch;
use super::revalidate::Answered;
use super::rows;
use super::{Store, lock_users, write};
use crate::decide::fetched::{FetchPlan, FetchRefusal, FetchedList, StoredUser, plan_fetch};
use crate::decide::{Plan, StaleMark};

impl Store {
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

    /// Every server with stale users that may be fetched (for the start-up
    /// rescan).
    pub async fn servers_with_stale_users(&self) -> Result<Vec<String>, DbErr> {
        self.fetchable_stale_users()
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
            .map(|row| (rows::stale_mark(&row), row.last_error)))
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
        // With membership on, only users sharing a room now are stored
        // (SPEC §5.5.4).
        let shared: Option<BTreeSet<OwnedUserId>> = match self.membership() {
            true => Some(
                super::sharing::rooms_shared_now(&txn, &users)
                    .await?
                    .into_iter()
                    .filter(|(_, n)| *n > 0)
                    .map(|(user, _)| user)
                    .collect(),
            ),
            false => None,
        };
        let mut stored = load_users(&txn, &users).await?;
        let mut rows = Plan::default();
        let mut fresh = Vec::new();
        let mut outcomes = Vec::with_capacity(items.len());
        let mut answered = Vec::with_capacity(items.len());
        for item in items {
            let user = &item.user;
            let now = stored.remove(user).unwrap_or_default();
            if shared.as_ref().is_some_and(|shared| !shared.contains(user)) {
                outcomes.push(Err(FetchRefusal::Untracked));
                continue;
            }
            let outcome = plan_fetch(
                user,
                &now,
                item.stale_at_start.as_ref(),
                &item.list,
                max_devices,
            );
            if let Ok(plan) = &outcome {
                answered.push(Answered {
                    user,
                    revalidation: item.revalidation,
                    changed: !plan.events.is_empty(),
                });
                if add_rows(&mut rows, user, plan) {
                    fresh.push(user.as_str().to_owned());
                }
            }
            outcomes.push(outcome);
        }
        let outbox = write::plan(&txn, &rows, now_ms).await?;
        // After the users' rows exist: their fetch time is set on them.
        super::revalidate::record_fetches(&txn, &answered, now_ms).await?;
        // A user kept stale by a trigger that came in meanwhile was answered:
        // its own back-off is over.
        let backend = txn.get_database_backend();
        let answered = rows.stale.keys().map(|u| u.as_str());
        for users in one_of(backend, stale_user::Column::UserId, answered) {
            use sea_orm::sea_query::Expr;
            stale_user::Entity::update_many()
                .col_expr(stale_user::Column::Failures, Expr::value(0))
                .col_expr(stale_user::Column::NextAttemptMs, Expr::value(0_i64))
                .filter(users)
                .exec(&txn)
                .await?;
        }
        for users in one_of(backend, stale_user::Column::UserId, fresh) {
            stale_user::Entity::delete_many()
                .filter(users)
                .exec(&txn)
                .await?;
        }
        txn.commit().await?;
        Ok((outcomes, outbox))
    }
}

/// Adds one user's fetched rows to the group's rows; true if the user is
/// fresh now (its stale row goes).
fn add_rows(rows: &mut Plan, user: &OwnedUserId, plan: &FetchPlan) -> bool {
    rows.users.insert(user.clone(), plan.state.clone());
    for (device, row) in &plan.devices {
        rows.devices
            .insert((user.clone(), device.clone()), row.clone());
    }
    for (usage, json) in &plan.cross_signing {
        rows.cross_signing
            .insert((user.clone(), *usage), json.clone());
    }
    rows.events.extend(plan.events.iter().cloned());
    match &plan.still_stale {
        Some(mark) => {
            rows.stale.insert(user.clone(), mark.clone());
            false
        }
        None => true,
    }
}

/// One fetched list to store.
#[derive(Clone, Debug)]
pub struct FetchedUser {
    /// Whose list it is meant to be.
    pub user: OwnedUserId,
    /// The user's stale mark when the request was sent.
    pub stale_at_start: Option<StaleMark>,
    /// A revalidation (SPEC §5.7): a change it finds is a divergence.
    pub revalidation: bool,
    /// The answer.
    pub list: FetchedList,
}

/// Everything stored for `users`: four queries (more on SQLite for
/// groups over its `IN` list's size).
async fn load_users<C: ConnectionTrait>(
    db: &C,
    users: &[&str],
) -> Result<BTreeMap<OwnedUserId, StoredUser>, DbErr> {
    let backend = db.get_database_backend();
    let ids = || users.iter().copied();
    let mut stored: BTreeMap<OwnedUserId, StoredUser> = BTreeMap::new();
    for these in one_of(backend, remote_user::Column::UserId, ids()) {
        let found = remote_user::Entity::find().filter(these).all(db).await?;
        for (user, state) in found.into_iter().filter_map(rows::user_state) {
            stored.entry(user).or_default().state = state;
        }
    }
    for these in one_of(backend, remote_device::Column::UserId, ids()) {
        let found = remote_device::Entity::find().filter(these).all(db).await?;
        for (user, id, device) in found.into_iter().filter_map(rows::device) {
            stored.entry(user).or_default().devices.insert(id, device);
        }
    }
    for these in one_of(backend, cross_signing_key::Column::UserId, ids()) {
        let found = cross_signing_key::Entity::find()
            .filter(these)
            .all(db)
            .await?;
        for (user, usage, key) in found.into_iter().filter_map(rows::cross_signing_key) {
            stored
                .entry(user)
                .or_default()
                .cross_signing
                .insert(usage, key);
        }
    }
    for these in one_of(backend, stale_user::Column::UserId, ids()) {
        let found = stale_user::Entity::find().filter(these).all(db).await?;
        for (user, mark) in found.iter().filter_map(rows::stale) {
            stored.entry(user).or_default().stale = Some(mark);
        }
    }
    Ok(stored)
}
