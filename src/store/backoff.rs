//! Fetch failure state (SPEC §5.2): per-user waits on `stale_user`, and per
//! server waits in `fetch_server`. Only a server's running job writes its
//! users' waits and its own row (one job per server at a time, across
//! replicas); a wake-up changes the row only by compare-and-set.

use entity::{fetch_server, revalidation, stale_user};
use std::collections::BTreeSet;

use ruma::{OwnedServerName, OwnedUserId, ServerName, UserId};
use sea_orm::sea_query::{
    Alias, Expr, ExprTrait as _, IntoColumnRef, OnConflict, Order, Query, SelectStatement,
};
use sea_orm::{
    ActiveValue::Set, ColumnTrait, DbBackend, DbErr, EntityTrait, FromQueryResult, PaginatorTrait,
    QueryFilter, QueryOrder, QuerySelect, QueryTrait as _,
};

use super::Store;
use super::one_of::unnest;
use super::rows;
use crate::decide::StaleMark;

/// A stale user whose own wait is over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DueUser {
    /// The user.
    pub user: OwnedUserId,
    /// Its stale mark now.
    pub mark: StaleMark,
    /// Its own failures in a row so far.
    pub failures: u32,
}

/// A server's fetch state as stored (None in the API: nothing to wait for).
pub type ServerWait = fetch_server::Model;

/// [`Store::has_fetch_work`]'s answer.
#[derive(FromQueryResult)]
struct WorkRow {
    work: bool,
}

/// The column of the servers in [`Store::servers_with_fetch_work`].
const LOOKED_AT: &str = "looked_at";

/// Whether `rows` has a row: a subquery for its first row in `order`
/// (see [`Store::servers_with_fetch_work`] for why not `EXISTS`).
fn has_first_row(mut rows: SelectStatement, order: impl IntoColumnRef) -> Expr {
    rows.order_by(order, Order::Asc).limit(1);
    Expr::from(rows).is_not_null()
}

/// [`Store::servers_with_fetch_work`]'s row.
#[derive(FromQueryResult)]
struct ServerRow {
    server_name: String,
}

/// [`Store::work_ahead`]'s row: the first wait end of each kind, and
/// whether a stale user may be fetched or a revalidation sent now.
#[derive(FromQueryResult)]
struct AheadRow {
    stale: Option<i64>,
    revalidation: Option<i64>,
    stale_due: bool,
    revalidation_due: bool,
}

/// What a job whose due stale users are done has ahead of it
/// ([`Store::work_ahead`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkAhead {
    /// A stale user may be fetched now (one the job already asked for,
    /// and that became stale again meanwhile, included).
    pub stale_due: bool,
    /// A queued revalidation may be sent now.
    pub revalidation_due: bool,
    /// The first end of a wait of a stale user or a queued revalidation
    /// still in its own back-off (Unix ms), if any.
    pub next_due_ms: Option<i64>,
}

impl WorkAhead {
    /// From the columns of [`Store::ahead_columns`] (and whether a stale
    /// user is due): the next work due is the first of the two waits.
    pub(super) fn new(
        stale_due: bool,
        revalidation_due: bool,
        stale: Option<i64>,
        revalidation: Option<i64>,
    ) -> WorkAhead {
        WorkAhead {
            stale_due,
            revalidation_due,
            next_due_ms: stale.into_iter().chain(revalidation).min(),
        }
    }
}

impl Store {
    /// The stale users a fetch may ask for: all of them, or with membership
    /// on only those who share a room with us now (SPEC §5.2, §5.5.9). The
    /// others keep their mark, which says their stored list is behind, and
    /// are fetched once they share a room; never before, so a fetch job can
    /// never loop on them.
    pub(super) fn fetchable_stale_users(&self) -> sea_orm::Select<stale_user::Entity> {
        let all = stale_user::Entity::find();
        match self.membership() {
            true => all.filter(super::sharing::stale_user_shares_now()),
            false => all,
        }
    }

    /// [`Store::fetchable_stale_users`] of `server`.
    fn server_stale_users(&self, server: &ServerName) -> sea_orm::Select<stale_user::Entity> {
        self.stale_users_of(&named(server))
    }

    /// [`Store::fetchable_stale_users`] of the server `server` names: a
    /// value, or in a statement over many servers the outer query's column.
    pub(super) fn stale_users_of(&self, server: &Expr) -> sea_orm::Select<stale_user::Entity> {
        self.fetchable_stale_users().filter(
            Expr::col((stale_user::Entity, stale_user::Column::ServerName)).eq(server.clone()),
        )
    }

    /// Stale users of `server` that may be fetched at `now_ms` (their own
    /// wait is over), oldest mark first, at most `limit`.
    pub async fn due_stale_users(
        &self,
        server: &ServerName,
        now_ms: i64,
        limit: u64,
    ) -> Result<Vec<DueUser>, DbErr> {
        let rows = self
            .server_stale_users(server)
            .filter(stale_user::Column::NextAttemptMs.lte(now_ms))
            .order_by_asc(stale_user::Column::MarkedAtMs)
            .order_by_asc(stale_user::Column::UserId)
            .limit(limit)
            .all(&self.db)
            .await?;
        Ok(rows.iter().filter_map(due_user).collect())
    }

    /// Whether `server` has a stale user that may be fetched at `now_ms`.
    pub async fn has_due_user(&self, server: &ServerName, now_ms: i64) -> Result<bool, DbErr> {
        Ok(!self.due_stale_users(server, now_ms, 1).await?.is_empty())
    }

    /// Selects a row for each stale user of `server` a job may fetch at
    /// `now_ms` (for `EXISTS`).
    fn stale_due_query(&self, server: &Expr, now_ms: i64) -> SelectStatement {
        self.stale_users_of(server)
            .select_only()
            .expr(Expr::val(1))
            .filter(stale_user::Column::NextAttemptMs.lte(now_ms))
            .into_query()
    }

    /// Selects a row for each queued revalidation of `server` a job may
    /// send at `now_ms` (for `EXISTS`).
    fn revalidation_due_query(&self, server: &Expr, now_ms: i64) -> SelectStatement {
        self.runnable_revalidations_of(server)
            .select_only()
            .expr(Expr::val(1))
            .filter(revalidation::Column::NextAttemptMs.lte(now_ms))
            .into_query()
    }

    /// Whether `server`'s job has work at `now_ms`: a stale user or a
    /// queued revalidation (SPEC §5.7) whose own wait is over. One
    /// statement: every job asks it when it ends or parks.
    pub async fn has_fetch_work(&self, server: &ServerName, now_ms: i64) -> Result<bool, DbErr> {
        let stale = self.stale_due_query(&named(server), now_ms);
        let revalidations = self.revalidation_due_query(&named(server), now_ms);
        let query = Query::select()
            .expr_as(
                Expr::exists(stale).or(Expr::exists(revalidations)),
                Alias::new("work"),
            )
            .to_owned();
        let row = WorkRow::find_by_statement(self.db.get_database_backend().build(&query))
            .one(&self.db)
            .await?;
        Ok(row.is_some_and(|row| row.work))
    }

    /// Those of `servers` whose job would have work at `now_ms`, as
    /// [`Store::has_fetch_work`] answers for each: the look that follows
    /// finished jobs. On PostgreSQL one statement for them all, asking of
    /// each server what [`Store::has_fetch_work`] asks; on SQLite, in
    /// process, each alone.
    ///
    /// Each server's probe is a subquery for its first due row in
    /// `next_attempt_ms` order, so that PostgreSQL reads it through the
    /// server's index: it may run an `EXISTS` over many servers as one
    /// hashed pass over every stale user and queued revalidation instead
    /// (seen at 1,000,000 users: 20 ms a look, 167 ms with membership on),
    /// and a bare `LIMIT 1` as a table scan per server that it expects to
    /// stop early (it does not, for a server with nothing left: the usual
    /// case after its job). A table scan cannot give the order without
    /// reading the whole table, the server's index can.
    pub async fn servers_with_fetch_work(
        &self,
        servers: &BTreeSet<OwnedServerName>,
        now_ms: i64,
    ) -> Result<BTreeSet<OwnedServerName>, DbErr> {
        let backend = self.db.get_database_backend();
        if backend != DbBackend::Postgres {
            let mut found = BTreeSet::new();
            for server in servers {
                if self.has_fetch_work(server, now_ms).await? {
                    found.insert(server.clone());
                }
            }
            return Ok(found);
        }
        if servers.is_empty() {
            return Ok(BTreeSet::new());
        }
        let server = Expr::col(Alias::new(LOOKED_AT));
        let query = Query::select()
            .expr_as(server.clone(), Alias::new("server_name"))
            .from_function(
                unnest(servers.iter().map(|s| s.as_str())),
                Alias::new(LOOKED_AT),
            )
            .and_where(
                has_first_row(
                    self.stale_due_query(&server, now_ms),
                    (stale_user::Entity, stale_user::Column::NextAttemptMs),
                )
                .or(has_first_row(
                    self.revalidation_due_query(&server, now_ms),
                    (revalidation::Entity, revalidation::Column::NextAttemptMs),
                )),
            )
            .to_owned();
        let rows = ServerRow::find_by_statement(backend.build(&query))
            .all(&self.db)
            .await?;
        Ok(rows
            .into_iter()
            .filter_map(|row| OwnedServerName::try_from(row.server_name).ok())
            .collect())
    }

    /// What `server`'s job has ahead of it at `now_ms`, once its due stale
    /// users are done: whether a stale user became due meanwhile, whether
    /// a queued revalidation may be sent now, and when the first stale user
    /// or revalidation still in its own wait is due. One statement: every
    /// job asks it before it ends, so a job with nothing left ends without
    /// a second look for stale users or revalidations.
    pub async fn work_ahead(&self, server: &ServerName, now_ms: i64) -> Result<WorkAhead, DbErr> {
        let stale_due = self.stale_due_query(&named(server), now_ms);
        let mut query = Query::select();
        for (column, alias) in self.ahead_columns(&named(server), now_ms) {
            query.expr_as(column, Alias::new(alias));
        }
        query.expr_as(Expr::exists(stale_due), Alias::new("stale_due"));
        let row = AheadRow::find_by_statement(self.db.get_database_backend().build(&query))
            .one(&self.db)
            .await?;
        Ok(row.map_or_else(WorkAhead::default, |row| {
            WorkAhead::new(
                row.stale_due,
                row.revalidation_due,
                row.stale,
                row.revalidation,
            )
        }))
    }

    /// The columns of what is ahead of `server`'s job at `now_ms`, beside
    /// its due stale users: the first wait end of a stale user and of a
    /// queued revalidation still in their own wait, and whether a queued
    /// revalidation may be sent now.
    pub(super) fn ahead_columns(&self, server: &Expr, now_ms: i64) -> [(Expr, &'static str); 3] {
        let stale = self
            .stale_users_of(server)
            .select_only()
            .column_as(stale_user::Column::NextAttemptMs.min(), "due")
            .filter(stale_user::Column::NextAttemptMs.gt(now_ms))
            .into_query();
        let revalidations = self
            .runnable_revalidations_of(server)
            .select_only()
            .column_as(revalidation::Column::NextAttemptMs.min(), "due")
            .filter(revalidation::Column::NextAttemptMs.gt(now_ms))
            .into_query();
        let revalidation_due = self.revalidation_due_query(server, now_ms);
        [
            (stale.into(), "stale"),
            (revalidations.into(), "revalidation"),
            (Expr::exists(revalidation_due), "revalidation_due"),
        ]
    }

    /// Records `user`'s own failure: `failures` in a row now, not to be
    /// asked again before `next_attempt_ms`.
    pub async fn note_user_failure(
        &self,
        user: &UserId,
        failures: u32,
        next_attempt_ms: i64,
        error: &str,
    ) -> Result<(), DbErr> {
        stale_user::Entity::update_many()
            .col_expr(
                stale_user::Column::Failures,
                Expr::value(i32::try_from(failures).unwrap_or(i32::MAX)),
            )
            .col_expr(
                stale_user::Column::NextAttemptMs,
                Expr::value(next_attempt_ms),
            )
            .col_expr(stale_user::Column::LastError, Expr::value(error.to_owned()))
            .filter(stale_user::Column::UserId.eq(user.as_str()))
            .exec(&self.db)
            .await?;
        Ok(())
    }

    /// `server`'s fetch state (None: it has nothing to wait for).
    pub async fn server_wait(&self, server: &ServerName) -> Result<Option<ServerWait>, DbErr> {
        fetch_server::Entity::find_by_id(server.as_str().to_owned())
            .one(&self.db)
            .await
    }

    /// The states of those of `servers` whose job waits past `now_ms`.
    pub async fn waiting_servers(
        &self,
        servers: &[&ServerName],
        now_ms: i64,
    ) -> Result<Vec<ServerWait>, DbErr> {
        let mut out = Vec::new();
        let backend = self.db.get_database_backend();
        let names = servers.iter().map(|s| s.as_str());
        for these in super::one_of::one_of(backend, fetch_server::Column::ServerName, names) {
            out.extend(
                fetch_server::Entity::find()
                    .filter(these)
                    .filter(fetch_server::Column::NextAttemptMs.gt(now_ms))
                    .all(&self.db)
                    .await?,
            );
        }
        Ok(out)
    }

    /// Records that `server`'s job waits until `next_attempt_ms`: after its
    /// `failures`-th failure in a row (with `error`), or with `failures` 0
    /// when only its users' own waits hold it (parked). Keeps `last_wake_ms`.
    pub async fn set_server_wait(
        &self,
        server: &ServerName,
        failures: u32,
        next_attempt_ms: i64,
        error: Option<&str>,
    ) -> Result<(), DbErr> {
        let failures = i32::try_from(failures).unwrap_or(i32::MAX);
        let failed_at = if failures > 0 { super::now_ms() } else { 0 };
        fetch_server::Entity::insert(fetch_server::ActiveModel {
            server_name: Set(server.as_str().to_owned()),
            failures: Set(failures),
            next_attempt_ms: Set(next_attempt_ms),
            failed_at_ms: Set(failed_at),
            last_wake_ms: Set(0),
            last_error: Set(error.map(str::to_owned)),
        })
        .on_conflict(
            OnConflict::column(fetch_server::Column::ServerName)
                .update_columns([
                    fetch_server::Column::Failures,
                    fetch_server::Column::NextAttemptMs,
                    fetch_server::Column::FailedAtMs,
                    fetch_server::Column::LastError,
                ])
                .to_owned(),
        )
        .exec_without_returning(&self.db)
        .await?;
        Ok(())
    }

    /// `server`'s job is running: not waiting (so no wake-up replaces it),
    /// its failure count kept until it answers.
    pub async fn server_running(&self, server: &ServerName) -> Result<(), DbErr> {
        fetch_server::Entity::update_many()
            .col_expr(fetch_server::Column::NextAttemptMs, Expr::value(0_i64))
            .filter(fetch_server::Column::ServerName.eq(server.as_str()))
            .exec(&self.db)
            .await?;
        Ok(())
    }

    /// `server` answered: its back-off is over. The row stays for
    /// `last_wake_ms`, which limits wake-ups of a flapping server.
    pub async fn server_answered(&self, server: &ServerName) -> Result<(), DbErr> {
        fetch_server::Entity::update_many()
            .col_expr(fetch_server::Column::Failures, Expr::value(0))
            .col_expr(fetch_server::Column::NextAttemptMs, Expr::value(0_i64))
            .col_expr(
                fetch_server::Column::LastError,
                Expr::value(Option::<String>::None),
            )
            .filter(fetch_server::Column::ServerName.eq(server.as_str()))
            .exec(&self.db)
            .await?;
        Ok(())
    }

    /// Ends the wait of `seen` (as read before) if nobody changed it since:
    /// the job may run now. `woken_at_ms` becomes its `last_wake_ms` when
    /// given. True when this call ended it (exactly one caller across
    /// replicas wins).
    pub async fn end_server_wait(
        &self,
        seen: &ServerWait,
        woken_at_ms: Option<i64>,
    ) -> Result<bool, DbErr> {
        let mut update = fetch_server::Entity::update_many()
            .col_expr(fetch_server::Column::NextAttemptMs, Expr::value(0_i64));
        if let Some(at) = woken_at_ms {
            update = update.col_expr(fetch_server::Column::LastWakeMs, Expr::value(at));
        }
        let result = update
            .filter(fetch_server::Column::ServerName.eq(seen.server_name.as_str()))
            .filter(fetch_server::Column::NextAttemptMs.eq(seen.next_attempt_ms))
            .filter(fetch_server::Column::LastWakeMs.eq(seen.last_wake_ms))
            .filter(fetch_server::Column::Failures.eq(seen.failures))
            .exec(&self.db)
            .await?;
        Ok(result.rows_affected == 1)
    }

    /// Stale users in their own back-off at `now_ms` (for `/metrics`).
    pub async fn users_backing_off(&self, now_ms: i64) -> Result<u64, DbErr> {
        stale_user::Entity::find()
            .filter(stale_user::Column::NextAttemptMs.gt(now_ms))
            .count(&self.db)
            .await
    }

    /// Servers in back-off after their own failures at `now_ms` (for `/metrics`).
    pub async fn servers_backing_off(&self, now_ms: i64) -> Result<u64, DbErr> {
        fetch_server::Entity::find()
            .filter(fetch_server::Column::Failures.gt(0))
            .filter(fetch_server::Column::NextAttemptMs.gt(now_ms))
            .count(&self.db)
            .await
    }
}

/// A stale row as a due user (None: not a user id, never stored).
pub(super) fn due_user(row: &stale_user::Model) -> Option<DueUser> {
    let (user, mark) = rows::stale(row)?;
    Some(DueUser {
        user,
        mark,
        failures: u32::try_from(row.failures).unwrap_or(0),
    })
}

/// `server`'s name as a value in a statement about it.
pub(super) fn named(server: &ServerName) -> Expr {
    Expr::val(server.as_str())
}
