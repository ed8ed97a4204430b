//! Revalidation state (SPEC §5.7): when each list was last fetched
//! (`remote_user.fetched_at_ms`), the users picked for a revalidation and
//! waiting for their server's fetch job (`revalidation`), and per server what
//! its answers came to (`remote_server`).
//!
//! Picking and queueing are one statement (`INSERT … SELECT … RETURNING`),
//! so a user is never queued twice and a user untracked meanwhile is never
//! queued at all. Every fetch that stores a list, stale or not, sets its
//! time and ends a queued revalidation of the user (`record_fetches`).

use std::collections::BTreeMap;

use entity::{fetch_server, remote_server, remote_user, revalidation, stale_user};
use ruma::{OwnedServerName, OwnedUserId, ServerName, UserId};
use sea_orm::sea_query::{
    Alias, Expr, ExprTrait as _, IntoColumnRef, IntoTableRef, OnConflict, Query, SelectStatement,
};
use sea_orm::{
    ActiveValue::Set, ColumnTrait, ConnectionTrait, DbBackend, DbErr, EntityTrait, FromQueryResult,
    PaginatorTrait, QueryFilter, QueryOrder, QuerySelect,
};

use super::Store;
use super::one_of::one_of;
use super::rows::CHUNK;

/// A server with this many revalidations queued gets no more until its job
/// has worked some off.
pub const QUEUED_PER_SERVER: i64 = 32;

/// A queued revalidation whose own wait is over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DueRevalidation {
    /// The user.
    pub user: OwnedUserId,
    /// Its unusable answers in a row so far.
    pub failures: u32,
}

/// One stored answer, as the fetch writer tallies it for its server.
#[derive(Clone, Debug)]
pub(super) struct Answered<'a> {
    /// The user.
    pub user: &'a UserId,
    /// It was a revalidation (not a stale user's fetch).
    pub revalidation: bool,
    /// The answer changed what was stored.
    pub changed: bool,
}

/// One remote server's figures (`admin servers`).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ServerFigures {
    /// The server.
    pub server_name: String,
    /// Users of it stored (tracked).
    pub tracked_users: i64,
    /// Of those, stale.
    pub stale_users: i64,
    /// Queued for a revalidation.
    pub queued_revalidations: i64,
    /// Its own failures in a row (0: not backing off).
    pub failures: i32,
    /// When its job runs again after its failures (Unix ms; None: not
    /// backing off).
    pub retry_at_ms: Option<i64>,
    /// Why its last request failed, while it backs off.
    pub last_error: Option<String>,
    /// When a fetch from it last succeeded (Unix ms; None: never).
    pub last_success_at_ms: Option<i64>,
    /// Revalidations answered.
    pub revalidations: i64,
    /// Revalidations that found a difference.
    pub divergences: i64,
    /// When the last divergence was found (Unix ms; None: never).
    pub last_divergence_at_ms: Option<i64>,
}

impl Store {
    /// The users revalidation is spread over: every stored user, or with
    /// membership on those that share a room with us.
    pub async fn revalidation_population(&self) -> Result<u64, DbErr> {
        match self.membership() {
            true => self.tracked_user_count().await,
            false => remote_user::Entity::find().count(&self.db).await,
        }
    }

    /// Queues for revalidation at most `limit` users whose list was last
    /// fetched at or before `fetched_before_ms`, oldest first: not stale
    /// (their fetch is coming anyway), not queued already, whose server is
    /// not backing off at `now_ms` (SPEC §5.2: what it fails is not asked
    /// again before its wait is over, and nothing piles up meanwhile) and
    /// has fewer than [`QUEUED_PER_SERVER`] queued (a server slower than its
    /// share does not grow a backlog), and with membership on sharing a room
    /// with us now. Returns the servers of the users queued.
    pub async fn queue_revalidations(
        &self,
        fetched_before_ms: i64,
        now_ms: i64,
        limit: u64,
    ) -> Result<Vec<OwnedServerName>, DbErr> {
        let due = self.due_for_revalidation(fetched_before_ms, now_ms, limit);
        let mut insert = Query::insert();
        insert
            .into_table(revalidation::Entity)
            .columns([
                revalidation::Column::UserId,
                revalidation::Column::ServerName,
                revalidation::Column::QueuedAtMs,
            ])
            .select_from(due)
            .map_err(|e| DbErr::Custom(e.to_string()))?
            .on_conflict(
                OnConflict::column(revalidation::Column::UserId)
                    .do_nothing()
                    .to_owned(),
            )
            .returning_col(revalidation::Column::ServerName);
        #[derive(FromQueryResult)]
        struct Row {
            server_name: String,
        }
        let statement = self.db.get_database_backend().build(&insert);
        let mut servers: Vec<OwnedServerName> = Row::find_by_statement(statement)
            .all(&self.db)
            .await?
            .into_iter()
            .filter_map(|row| OwnedServerName::try_from(row.server_name).ok())
            .collect();
        servers.sort_unstable();
        servers.dedup();
        Ok(servers)
    }

    /// The select of [`Store::queue_revalidations`]: user, server and
    /// `now_ms` of the users it queues.
    fn due_for_revalidation(
        &self,
        fetched_before_ms: i64,
        now_ms: i64,
        limit: u64,
    ) -> SelectStatement {
        let user = (remote_user::Entity, remote_user::Column::UserId);
        let server = (remote_user::Entity, remote_user::Column::ServerName);
        let mut due = Query::select();
        due.column(user)
            .column(server)
            .expr(Expr::val(now_ms))
            .from(remote_user::Entity)
            .and_where(
                Expr::col((remote_user::Entity, remote_user::Column::FetchedAtMs))
                    .lte(fetched_before_ms),
            )
            .and_where(none_of(rows_where(
                stale_user::Entity,
                (stale_user::Entity, stale_user::Column::UserId),
                user,
            )))
            .and_where(none_of(rows_where(
                revalidation::Entity,
                (revalidation::Entity, revalidation::Column::UserId),
                user,
            )))
            .and_where(none_of(
                rows_where(
                    fetch_server::Entity,
                    (fetch_server::Entity, fetch_server::Column::ServerName),
                    server,
                )
                .and_where(Expr::col((fetch_server::Entity, fetch_server::Column::Failures)).gt(0))
                .and_where(
                    Expr::col((fetch_server::Entity, fetch_server::Column::NextAttemptMs))
                        .gt(now_ms),
                )
                .to_owned(),
            ))
            .order_by(
                (remote_user::Entity, remote_user::Column::FetchedAtMs),
                sea_orm::Order::Asc,
            )
            .limit(limit);
        if self.membership() {
            due.and_where(super::sharing::shares_now(user));
        }
        // The server's queue is counted per candidate, through the queue's
        // index by server (at most the cap's worth of rows each), not by
        // grouping the whole queue on every pick: the queue grows with the
        // servers, and the pick runs up to ten times a second.
        let queued = Query::select()
            .expr(Expr::col((revalidation::Entity, revalidation::Column::UserId)).count())
            .from(revalidation::Entity)
            .and_where(
                Expr::col((revalidation::Entity, revalidation::Column::ServerName)).equals(server),
            )
            .to_owned();
        due.and_where(Expr::from(queued).lt(QUEUED_PER_SERVER));
        due
    }

    /// Queued revalidations of `server` that a job may send once their own
    /// wait is over: not of a stale user (its own fetch comes first and ends
    /// the revalidation), and with membership on only of users sharing a
    /// room with us now.
    pub(super) fn runnable_revalidations(
        &self,
        server: &ServerName,
    ) -> sea_orm::Select<revalidation::Entity> {
        self.runnable_revalidations_of(&super::backoff::named(server))
    }

    /// [`Store::runnable_revalidations`] of the server `server` names: a
    /// value, or in a statement over many servers the outer query's column.
    pub(super) fn runnable_revalidations_of(
        &self,
        server: &Expr,
    ) -> sea_orm::Select<revalidation::Entity> {
        self.runnable_revalidations_where(
            Expr::col((revalidation::Entity, revalidation::Column::ServerName)).eq(server.clone()),
        )
    }

    /// [`Store::runnable_revalidations`] of the servers `servers` selects
    /// (a condition on `revalidation.server_name`).
    pub(super) fn runnable_revalidations_where(
        &self,
        servers: impl sea_orm::sea_query::IntoCondition,
    ) -> sea_orm::Select<revalidation::Entity> {
        let user = (revalidation::Entity, revalidation::Column::UserId);
        let query = revalidation::Entity::find()
            .filter(servers)
            .filter(none_of(rows_where(
                stale_user::Entity,
                (stale_user::Entity, stale_user::Column::UserId),
                user,
            )));
        match self.membership() {
            true => query.filter(super::sharing::shares_now(user)),
            false => query,
        }
    }

    /// Queued revalidations of `server` that may run at `now_ms` (their own
    /// wait is over; not of a stale user, whose own fetch comes first; with
    /// membership on, of users sharing a room with us now), oldest first,
    /// at most `limit`.
    pub async fn due_revalidations(
        &self,
        server: &ServerName,
        now_ms: i64,
        limit: u64,
    ) -> Result<Vec<DueRevalidation>, DbErr> {
        let rows = self
            .runnable_revalidations(server)
            .filter(revalidation::Column::NextAttemptMs.lte(now_ms))
            .order_by_asc(revalidation::Column::QueuedAtMs)
            .order_by_asc(revalidation::Column::UserId)
            .limit(limit)
            .all(&self.db)
            .await?;
        Ok(rows
            .into_iter()
            .filter_map(|row| {
                Some(DueRevalidation {
                    user: OwnedUserId::try_from(row.user_id).ok()?,
                    failures: u32::try_from(row.failures).unwrap_or(0),
                })
            })
            .collect())
    }

    /// Records an unusable answer to `user`'s revalidation: `failures` in a
    /// row now, not to be asked again before `next_attempt_ms`. The stored
    /// list and the user's freshness stay as they are (SPEC §5.7.3).
    pub async fn note_revalidation_failure(
        &self,
        user: &UserId,
        failures: u32,
        next_attempt_ms: i64,
        error: &str,
    ) -> Result<(), DbErr> {
        revalidation::Entity::update_many()
            .col_expr(
                revalidation::Column::Failures,
                Expr::value(i32::try_from(failures).unwrap_or(i32::MAX)),
            )
            .col_expr(
                revalidation::Column::NextAttemptMs,
                Expr::value(next_attempt_ms),
            )
            .col_expr(
                revalidation::Column::LastError,
                Expr::value(error.to_owned()),
            )
            .filter(revalidation::Column::UserId.eq(user.as_str()))
            .exec(&self.db)
            .await?;
        Ok(())
    }

    /// Ends `user`'s queued revalidation without an answer (it is no longer
    /// tracked).
    pub async fn drop_revalidation(&self, user: &UserId) -> Result<(), DbErr> {
        revalidation::Entity::delete_many()
            .filter(revalidation::Column::UserId.eq(user.as_str()))
            .exec(&self.db)
            .await?;
        Ok(())
    }

    /// Every server with queued revalidations (for the start-up rescan).
    pub async fn servers_with_revalidations(&self) -> Result<Vec<String>, DbErr> {
        revalidation::Entity::find()
            .select_only()
            .column(revalidation::Column::ServerName)
            .distinct()
            .into_tuple::<String>()
            .all(&self.db)
            .await
    }

    /// `server` failed: its queued revalidations that hold no back-off of
    /// their own are dropped, to be picked again, at the pacer's rate, once
    /// its back-off is over. Kept, they would all be asked for at once when
    /// it answers again (a burst after an outage, SPEC §5.7.1).
    pub async fn drop_server_revalidations(&self, server: &ServerName) -> Result<u64, DbErr> {
        let result = revalidation::Entity::delete_many()
            .filter(revalidation::Column::ServerName.eq(server.as_str()))
            .filter(revalidation::Column::Failures.eq(0))
            .exec(&self.db)
            .await?;
        Ok(result.rows_affected)
    }

    /// Revalidations queued now (for `/metrics`).
    pub async fn queued_revalidation_count(&self) -> Result<u64, DbErr> {
        revalidation::Entity::find().count(&self.db).await
    }

    /// Every remote server we know of (a tracked user, a stale user, a
    /// back-off or a successful fetch), worst first: most divergences, then
    /// most stale users, then backing off longest, then by name.
    pub async fn server_figures(&self) -> Result<Vec<ServerFigures>, DbErr> {
        let mut servers: BTreeMap<String, ServerFigures> = BTreeMap::new();
        fn entry(
            servers: &mut BTreeMap<String, ServerFigures>,
            name: String,
        ) -> &mut ServerFigures {
            servers
                .entry(name.clone())
                .or_insert_with(|| ServerFigures {
                    server_name: name,
                    ..ServerFigures::default()
                })
        }
        for (name, n) in count_by_server::<remote_user::Entity>(
            &self.db,
            remote_user::Column::ServerName,
            remote_user::Column::UserId,
        )
        .await?
        {
            entry(&mut servers, name).tracked_users = n;
        }
        for (name, n) in self.stale_counts().await? {
            entry(&mut servers, name).stale_users = n;
        }
        for (name, n) in count_by_server::<revalidation::Entity>(
            &self.db,
            revalidation::Column::ServerName,
            revalidation::Column::UserId,
        )
        .await?
        {
            entry(&mut servers, name).queued_revalidations = n;
        }
        for wait in fetch_server::Entity::find().all(&self.db).await? {
            let figures = entry(&mut servers, wait.server_name);
            figures.failures = wait.failures;
            if wait.failures > 0 {
                figures.retry_at_ms = Some(wait.next_attempt_ms).filter(|&ms| ms > 0);
                figures.last_error = wait.last_error;
            }
        }
        for row in remote_server::Entity::find().all(&self.db).await? {
            let figures = entry(&mut servers, row.server_name);
            figures.last_success_at_ms = Some(row.last_success_ms).filter(|&ms| ms > 0);
            figures.revalidations = row.revalidations;
            figures.divergences = row.divergences;
            figures.last_divergence_at_ms = Some(row.last_divergence_ms).filter(|&ms| ms > 0);
        }
        let mut servers: Vec<ServerFigures> = servers.into_values().collect();
        servers.sort_by(|a, b| {
            b.divergences
                .cmp(&a.divergences)
                .then(b.stale_users.cmp(&a.stale_users))
                .then(b.failures.cmp(&a.failures))
                .then(a.server_name.cmp(&b.server_name))
        });
        Ok(servers)
    }
}

/// `SELECT 1 FROM table WHERE column = equals`.
fn rows_where(
    table: impl IntoTableRef,
    column: impl IntoColumnRef,
    equals: impl IntoColumnRef,
) -> SelectStatement {
    Query::select()
        .expr(Expr::val(1))
        .from(table)
        .and_where(Expr::col(column).equals(equals))
        .to_owned()
}

/// No row of `rows` exists.
fn none_of(rows: SelectStatement) -> Expr {
    Expr::exists(rows).not()
}

/// Rows of `E` per server.
async fn count_by_server<E: EntityTrait>(
    db: &impl ConnectionTrait,
    server: E::Column,
    user: E::Column,
) -> Result<Vec<(String, i64)>, DbErr> {
    E::find()
        .select_only()
        .column(server)
        .column_as(user.count(), "n")
        .group_by(server)
        .into_tuple::<(String, i64)>()
        .all(db)
        .await
}

/// In the fetch writer's transaction: the answered users' lists were
/// fetched at `now_ms` and their queued revalidations are over; each
/// server's last success, revalidations and divergences (a revalidation
/// that changed what was stored) are counted (SPEC §5.7.3).
pub(super) async fn record_fetches<C: ConnectionTrait>(
    db: &C,
    answered: &[Answered<'_>],
    now_ms: i64,
) -> Result<(), DbErr> {
    let backend = db.get_database_backend();
    let users = || answered.iter().map(|a| a.user.as_str());
    for these in one_of(backend, remote_user::Column::UserId, users()) {
        remote_user::Entity::update_many()
            .col_expr(remote_user::Column::FetchedAtMs, Expr::value(now_ms))
            .filter(these)
            .exec(db)
            .await?;
    }
    for these in one_of(backend, revalidation::Column::UserId, users()) {
        revalidation::Entity::delete_many()
            .filter(these)
            .exec(db)
            .await?;
    }
    let mut tallies: BTreeMap<&ServerName, (i64, i64)> = BTreeMap::new();
    for a in answered {
        let tally = tallies.entry(a.user.server_name()).or_default();
        if a.revalidation {
            tally.0 += 1;
            tally.1 += i64::from(a.changed);
        }
    }
    if backend == DbBackend::Postgres {
        return super::bulk::record_servers(db, &tallies, now_ms).await;
    }
    let rows: Vec<remote_server::ActiveModel> = tallies
        .into_iter()
        .map(
            |(server, (revalidations, divergences))| remote_server::ActiveModel {
                server_name: Set(server.as_str().to_owned()),
                last_success_ms: Set(now_ms),
                revalidations: Set(revalidations),
                divergences: Set(divergences),
                last_divergence_ms: Set(if divergences > 0 { now_ms } else { 0 }),
            },
        )
        .collect();
    // `excluded` is the row that was to be inserted, in both dialects.
    let excluded = |column: remote_server::Column| Expr::col((Alias::new("excluded"), column));
    let stored = |column: remote_server::Column| Expr::col((remote_server::Entity, column));
    let added = |column| stored(column).add(excluded(column));
    for chunk in rows.chunks(CHUNK) {
        let mut conflict = OnConflict::column(remote_server::Column::ServerName);
        conflict
            .value(remote_server::Column::LastSuccessMs, Expr::value(now_ms))
            .value(
                remote_server::Column::Revalidations,
                added(remote_server::Column::Revalidations),
            )
            .value(
                remote_server::Column::Divergences,
                added(remote_server::Column::Divergences),
            )
            .value(
                remote_server::Column::LastDivergenceMs,
                Expr::case(
                    excluded(remote_server::Column::Divergences).gt(0),
                    excluded(remote_server::Column::LastDivergenceMs),
                )
                .finally(stored(remote_server::Column::LastDivergenceMs)),
            );
        remote_server::Entity::insert_many(chunk.to_vec())
            .on_conflict(conflict.to_owned())
            .exec_without_returning(db)
            .await?;
    }
    Ok(())
}
