//! PostgreSQL statements that take whole columns as array parameters.
//!
//! A batch of 1000 updates written as a multi-row `INSERT … VALUES` binds
//! 6000 parameters, and each distinct row count is a new statement to parse
//! and plan. Here every statement has fixed text and one array per column
//! (`UNNEST($1::text[], …)`), so it is prepared once per connection and the
//! worker builds a handful of values instead of thousands. The ingest
//! benchmark in `BENCHMARKS.md` measures the difference. SQLite has no
//! arrays and keeps the portable statements in `write.rs` and `load.rs`.

use entity::{remote_device, remote_user, stale_user};
use std::collections::BTreeMap;

use ruma::ServerName;
use sea_orm::{ConnectionTrait, DbBackend, DbErr, EntityTrait, Statement, Value};

use crate::decide::Plan;

/// Takes a transaction-scoped advisory lock per user, in hash order so two
/// batches never wait on each other in a cycle.
const LOCK_USERS: &str = "SELECT count(pg_advisory_xact_lock(h)) AS n FROM \
     (SELECT DISTINCT hashtext(u) AS h FROM UNNEST($1::text[]) AS v(u) ORDER BY 1) AS s";

const SELECT_USERS: &str = "SELECT user_id, server_name, known_stream_ids, max_stream_id, \
     fetched_stream_id, fetched_at_ms \
     FROM remote_user WHERE user_id = ANY($1::text[])";

const SELECT_STALE: &str = "SELECT user_id, server_name, marked_at_ms, trigger_stream_ids, \
     last_error, failures, next_attempt_ms FROM stale_user WHERE user_id = ANY($1::text[])";

/// Exactly the (user, device) pairs asked for.
const SELECT_DEVICES: &str = "SELECT d.user_id, d.device_id, d.display_name, d.keys_json, \
     d.stream_id, d.deleted FROM remote_device AS d \
     JOIN UNNEST($1::text[], $2::text[]) AS k(u, v) ON d.user_id = k.u AND d.device_id = k.v";

const UPSERT_USERS: &str = "INSERT INTO remote_user \
     (user_id, server_name, known_stream_ids, max_stream_id, fetched_stream_id) \
     SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::int8[], $5::int8[]) \
     ON CONFLICT (user_id) DO UPDATE SET \
     known_stream_ids = EXCLUDED.known_stream_ids, max_stream_id = EXCLUDED.max_stream_id, \
     fetched_stream_id = EXCLUDED.fetched_stream_id";

/// Arrays of this driver cannot hold NULL, so the nullable columns travel
/// as a text array plus a "present" flag array.
const UPSERT_DEVICES: &str = "INSERT INTO remote_device \
     (user_id, device_id, display_name, keys_json, stream_id, deleted) \
     SELECT u, d, CASE WHEN has_name THEN name END, CASE WHEN has_keys THEN keys END, s, del \
     FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bool[], $5::text[], $6::bool[], \
                 $7::int8[], $8::bool[]) \
          AS t(u, d, name, has_name, keys, has_keys, s, del) \
     ON CONFLICT (user_id, device_id) DO UPDATE SET \
     display_name = EXCLUDED.display_name, keys_json = EXCLUDED.keys_json, \
     stream_id = EXCLUDED.stream_id, deleted = EXCLUDED.deleted";

/// A fetch from each server succeeded at `$2`; `$3` revalidations were
/// answered and `$4` of them diverged (see `record_fetches`).
const UPSERT_SERVERS: &str = "INSERT INTO remote_server \
     (server_name, last_success_ms, revalidations, divergences, last_divergence_ms) \
     SELECT s, $2::int8, r, d, CASE WHEN d > 0 THEN $2::int8 ELSE 0 END \
     FROM UNNEST($1::text[], $3::int8[], $4::int8[]) AS t(s, r, d) \
     ON CONFLICT (server_name) DO UPDATE SET \
     last_success_ms = EXCLUDED.last_success_ms, \
     revalidations = remote_server.revalidations + EXCLUDED.revalidations, \
     divergences = remote_server.divergences + EXCLUDED.divergences, \
     last_divergence_ms = CASE WHEN EXCLUDED.divergences > 0 \
         THEN EXCLUDED.last_divergence_ms ELSE remote_server.last_divergence_ms END";

fn statement(sql: &str, values: Vec<Value>) -> Statement {
    Statement::from_sql_and_values(DbBackend::Postgres, sql, values)
}

/// An optional text column as (values, present flags).
fn nullable(column: Vec<Option<&String>>) -> (Value, Value) {
    let present: Vec<bool> = column.iter().map(Option::is_some).collect();
    let text: Vec<String> = column
        .into_iter()
        .map(|v| v.cloned().unwrap_or_default())
        .collect();
    (Value::from(text), Value::from(present))
}

fn owned(users: &[&str]) -> Value {
    Value::from(
        users
            .iter()
            .map(|u| (*u).to_owned())
            .collect::<Vec<String>>(),
    )
}

/// See [`LOCK_USERS`].
pub(super) async fn lock_users<C: ConnectionTrait>(db: &C, users: &[&str]) -> Result<(), DbErr> {
    db.query_one_raw(statement(LOCK_USERS, vec![owned(users)]))
        .await?;
    Ok(())
}

/// The stored rows of `users`.
pub(super) async fn users<C: ConnectionTrait>(
    db: &C,
    users: &[&str],
) -> Result<Vec<remote_user::Model>, DbErr> {
    remote_user::Entity::find()
        .from_raw_sql(statement(SELECT_USERS, vec![owned(users)]))
        .all(db)
        .await
}

/// The stale marks of `users`.
pub(super) async fn stale<C: ConnectionTrait>(
    db: &C,
    users: &[&str],
) -> Result<Vec<stale_user::Model>, DbErr> {
    stale_user::Entity::find()
        .from_raw_sql(statement(SELECT_STALE, vec![owned(users)]))
        .all(db)
        .await
}

/// The stored rows of exactly these (user, device) pairs.
pub(super) async fn devices<C: ConnectionTrait>(
    db: &C,
    pairs: &[(&str, &str)],
) -> Result<Vec<remote_device::Model>, DbErr> {
    let users: Vec<String> = pairs.iter().map(|(u, _)| (*u).to_owned()).collect();
    let devices: Vec<String> = pairs.iter().map(|(_, d)| (*d).to_owned()).collect();
    remote_device::Entity::find()
        .from_raw_sql(statement(
            SELECT_DEVICES,
            vec![Value::from(users), Value::from(devices)],
        ))
        .all(db)
        .await
}

/// Upserts the user and device rows of `plan`.
pub(super) async fn write_users_and_devices<C: ConnectionTrait>(
    db: &C,
    plan: &Plan,
) -> Result<(), DbErr> {
    if !plan.users.is_empty() {
        let n = plan.users.len();
        let (mut ids, mut servers, mut known, mut max, mut fetched) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for (user, state) in &plan.users {
            ids.push(user.to_string());
            servers.push(user.server_name().to_string());
            known.push(state.known.to_json());
            max.push(state.max_stream_id);
            fetched.push(state.fetched_stream_id);
        }
        let values = vec![
            ids.into(),
            servers.into(),
            known.into(),
            max.into(),
            fetched.into(),
        ];
        db.execute_raw(statement(UPSERT_USERS, values)).await?;
    }
    if !plan.devices.is_empty() {
        let n = plan.devices.len();
        let (mut users, mut devices, mut stream_ids, mut deleted) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for ((user, device), row) in &plan.devices {
            users.push(user.to_string());
            devices.push(device.to_string());
            stream_ids.push(row.stream_id);
            deleted.push(row.deleted);
        }
        let (names, has_names) = nullable(
            plan.devices
                .values()
                .map(|r| r.display_name.as_ref())
                .collect(),
        );
        let (keys, has_keys) = nullable(plan.devices.values().map(|r| r.keys.as_ref()).collect());
        let values = vec![
            users.into(),
            devices.into(),
            names,
            has_names,
            keys,
            has_keys,
            stream_ids.into(),
            deleted.into(),
        ];
        db.execute_raw(statement(UPSERT_DEVICES, values)).await?;
    }
    Ok(())
}

/// Records, per server, a successful fetch at `now_ms` and its answered
/// revalidations and divergences, `(revalidations, divergences)`.
pub(super) async fn record_servers<C: ConnectionTrait>(
    db: &C,
    tallies: &BTreeMap<&ServerName, (i64, i64)>,
    now_ms: i64,
) -> Result<(), DbErr> {
    if tallies.is_empty() {
        return Ok(());
    }
    let servers: Vec<String> = tallies.keys().map(|s| s.as_str().to_owned()).collect();
    let revalidations: Vec<i64> = tallies.values().map(|t| t.0).collect();
    let divergences: Vec<i64> = tallies.values().map(|t| t.1).collect();
    let values = vec![
        servers.into(),
        now_ms.into(),
        revalidations.into(),
        divergences.into(),
    ];
    db.execute_raw(statement(UPSERT_SERVERS, values)).await?;
    Ok(())
}
