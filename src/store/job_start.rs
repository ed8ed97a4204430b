//! What a fetch job reads as it starts (SPEC §5.2): its server's stored
//! wait, its first round of due stale users, and what else is ahead of it,
//! for one server or, on PostgreSQL, for every server whose job starts at
//! once in one statement.

use std::collections::{BTreeMap, BTreeSet};

use entity::{fetch_server, stale_user};
use ruma::{OwnedServerName, ServerName};
use sea_orm::sea_query::{Alias, Asterisk, Expr, ExprTrait as _, JoinType, Query};
use sea_orm::{
    ColumnTrait, ConnectionTrait as _, DbBackend, DbErr, EntityTrait, FromQueryResult, QueryFilter,
    QueryOrder, QuerySelect, QueryTrait as _, Select,
};

use super::Store;
use super::backoff::{DueUser, WorkAhead, due_user, named};

/// A server's stored wait, as its fetch job starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JobWait {
    /// The server's failures in a row so far.
    pub failures: i32,
    /// When its job may run (Unix ms; 0: not waiting).
    pub next_attempt_ms: i64,
}

/// What a fetch job reads as it starts ([`Store::job_start`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobStart {
    /// The server's stored wait (None: nothing to wait for).
    pub wait: Option<JobWait>,
    /// Its first round of due stale users, as
    /// [`Store::due_stale_users`] reads them.
    pub due: Vec<DueUser>,
    /// What else is ahead of the job, as [`Store::work_ahead`] answers it,
    /// read with the users; None when no stale user is due.
    pub ahead: Option<WorkAhead>,
}

/// [`Store::job_start`]'s row: a due stale user, and its server's wait.
#[derive(FromQueryResult)]
struct StartRow {
    #[sea_orm(nested)]
    user: stale_user::Model,
    server_failures: Option<i32>,
    server_next_attempt_ms: Option<i64>,
    stale: Option<i64>,
    revalidation: Option<i64>,
    revalidation_due: bool,
}

/// The column of the servers in the statement over many servers.
const JOB_SERVER: &str = "job_server";
/// The alias of each server's rows in it.
const DUE: &str = "due";

impl Store {
    /// What `server`'s fetch job reads as it starts at `now_ms`: the
    /// server's stored wait, its first `limit` due stale users (as
    /// [`Store::due_stale_users`]) and what else is ahead of it. One
    /// statement when a stale user is due, the common case (every job of a
    /// fan-out starts with one); a second reads the wait alone when none
    /// is.
    pub async fn job_start(
        &self,
        server: &ServerName,
        now_ms: i64,
        limit: u64,
    ) -> Result<JobStart, DbErr> {
        let rows = self
            .start_select(&named(server), now_ms, limit)
            .into_model::<StartRow>()
            .all(&self.db)
            .await?;
        if rows.is_empty() {
            let wait = self.server_wait(server).await?;
            return Ok(without_due_users(wait));
        }
        Ok(job_start_of(&rows))
    }

    /// [`Store::job_start`] of each of `servers`. On PostgreSQL one
    /// statement reads every server's first round (each server's rows
    /// through its own index range, as alone) and a second the waits of
    /// those with no user due; elsewhere each server is read alone.
    pub async fn job_starts(
        &self,
        servers: &BTreeSet<OwnedServerName>,
        now_ms: i64,
        limit: u64,
    ) -> Result<BTreeMap<OwnedServerName, JobStart>, DbErr> {
        let mut starts = BTreeMap::new();
        let backend = self.db.get_database_backend();
        if backend != DbBackend::Postgres || servers.len() < 2 {
            for server in servers {
                starts.insert(server.clone(), self.job_start(server, now_ms, limit).await?);
            }
            return Ok(starts);
        }
        let each = self
            .start_select(&Expr::col(Alias::new(JOB_SERVER)), now_ms, limit)
            .into_query();
        let query = Query::select()
            .expr_as(Expr::col(Alias::new(JOB_SERVER)), Alias::new(JOB_SERVER))
            .column((Alias::new(DUE), Asterisk))
            .from_function(
                super::one_of::unnest(servers.iter().map(|s| s.as_str())),
                Alias::new(JOB_SERVER),
            )
            .join_lateral(
                JoinType::InnerJoin,
                each,
                Alias::new(DUE),
                Expr::cust("TRUE"),
            )
            .order_by(Alias::new(JOB_SERVER), sea_orm::Order::Asc)
            .order_by(
                (Alias::new(DUE), stale_user::Column::MarkedAtMs),
                sea_orm::Order::Asc,
            )
            .order_by(
                (Alias::new(DUE), stale_user::Column::UserId),
                sea_orm::Order::Asc,
            )
            .to_owned();
        let mut rows: BTreeMap<String, Vec<StartRow>> = BTreeMap::new();
        for row in self.db.query_all_raw(backend.build(&query)).await? {
            let server: String = row.try_get("", JOB_SERVER)?;
            rows.entry(server)
                .or_default()
                .push(StartRow::from_query_result(&row, "")?);
        }
        for (server, rows) in &rows {
            if let Ok(server) = OwnedServerName::try_from(server.as_str()) {
                starts.insert(server, job_start_of(rows));
            }
        }
        let idle: Vec<&str> = servers
            .iter()
            .filter(|s| !starts.contains_key(*s))
            .map(|s| s.as_str())
            .collect();
        let mut waits = BTreeMap::new();
        for these in super::one_of::one_of(
            backend,
            fetch_server::Column::ServerName,
            idle.iter().copied(),
        ) {
            for wait in fetch_server::Entity::find()
                .filter(these)
                .all(&self.db)
                .await?
            {
                waits.insert(wait.server_name.clone(), wait);
            }
        }
        for server in servers {
            if !starts.contains_key(server) {
                let wait = waits.remove(server.as_str());
                starts.insert(server.clone(), without_due_users(wait));
            }
        }
        Ok(starts)
    }

    /// The due stale users of the server `server` names, at most `limit`,
    /// oldest mark first, each with its server's wait and what else is
    /// ahead ([`StartRow`]).
    fn start_select(&self, server: &Expr, now_ms: i64, limit: u64) -> Select<stale_user::Entity> {
        let wait_column = |column: fetch_server::Column| {
            Query::select()
                .column(column)
                .from(fetch_server::Entity)
                .and_where(
                    Expr::col((fetch_server::Entity, fetch_server::Column::ServerName))
                        .eq(server.clone()),
                )
                .to_owned()
        };
        let mut select = self
            .stale_users_of(server)
            .filter(stale_user::Column::NextAttemptMs.lte(now_ms))
            .expr_as(
                wait_column(fetch_server::Column::Failures),
                "server_failures",
            )
            .expr_as(
                wait_column(fetch_server::Column::NextAttemptMs),
                "server_next_attempt_ms",
            );
        for (column, alias) in self.ahead_columns(server, now_ms) {
            select = select.expr_as(column, alias);
        }
        select
            .order_by_asc(stale_user::Column::MarkedAtMs)
            .order_by_asc(stale_user::Column::UserId)
            .limit(limit)
    }
}

/// A job start with no user due: the stored wait alone.
fn without_due_users(wait: Option<fetch_server::Model>) -> JobStart {
    JobStart {
        wait: wait.map(|wait| JobWait {
            failures: wait.failures,
            next_attempt_ms: wait.next_attempt_ms,
        }),
        due: Vec::new(),
        ahead: None,
    }
}

/// A job start from its rows (at least one): the wait and what is ahead
/// are the same in each.
fn job_start_of(rows: &[StartRow]) -> JobStart {
    let first = rows.first();
    let wait = first
        .and_then(|row| row.server_failures.zip(row.server_next_attempt_ms))
        .map(|(failures, next_attempt_ms)| JobWait {
            failures,
            next_attempt_ms,
        });
    let ahead =
        first.map(|row| WorkAhead::new(true, row.revalidation_due, row.stale, row.revalidation));
    JobStart {
        wait,
        ahead,
        due: rows
            .iter()
            .map(|row| &row.user)
            .filter_map(due_user)
            .collect(),
    }
}
