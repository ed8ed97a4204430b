//! Admin commands (`device-list-updater admin …`): read and nudge the same
//! database and NATS the workers use. Each returns JSON; the command line
//! prints it as is (`--json`) or as text for people.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::jetstream;
use ruma::OwnedUserId;
use serde_json::{Value, json};

use crate::bus::BusError;
use crate::bus::fetch_jobs::FETCH_CONSUMER;
use crate::bus::publisher::{OutboxError, Publisher};
use crate::bus::streams::{
    DEAD_STREAM, FETCH_STREAM, INPUT_CONSUMER, INPUT_STREAM, KEY_CHANGE_STREAM,
};
use crate::faults::Faults;
use crate::fetch::queue::FetchQueue;
use crate::fetch::resync::{self, Requested, ResyncError};
use crate::rpc::QueryReply;
use crate::store::Store;
use crate::store::backoff::DueUser;

/// Why an admin command failed.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// An argument is not what the command takes.
    #[error("{0}")]
    Argument(String),
    /// The database.
    #[error("database: {0}")]
    Database(#[from] sea_orm::DbErr),
    /// NATS.
    #[error(transparent)]
    Bus(#[from] BusError),
    /// The resync could not be requested.
    #[error(transparent)]
    Resync(#[from] ResyncError),
    /// The outbox could not be published.
    #[error("outbox: {0}")]
    Outbox(#[from] OutboxError),
}

impl AdminError {
    /// The exit code: 2 for an argument the command does not take (as for a
    /// configuration error), 1 for a failure on the way.
    pub fn exit_code(&self) -> u8 {
        match self {
            AdminError::Argument(_) => 2,
            AdminError::Database(_)
            | AdminError::Bus(_)
            | AdminError::Resync(_)
            | AdminError::Outbox(_) => 1,
        }
    }
}

/// A user id given on the command line; anything else is refused, as the
/// RPCs refuse it (SPEC §5.6.5).
pub fn user_id(text: &str) -> Result<OwnedUserId, AdminError> {
    OwnedUserId::try_from(text)
        .map_err(|_| AdminError::Argument(format!("{text:?} is not a user id")))
}

/// User ids given on the command line, each checked as [`user_id`] does.
pub fn user_ids(texts: &[String]) -> Result<Vec<OwnedUserId>, AdminError> {
    texts.iter().map(|text| user_id(text)).collect()
}

/// What is stored for `users` (the same shape as the query RPC's reply).
pub async fn user(store: &Store, users: &[OwnedUserId]) -> Result<Value, AdminError> {
    let users: Vec<String> = users.iter().map(ToString::to_string).collect();
    let views = store.query_users(&users).await?;
    Ok(serde_json::to_value(QueryReply::new(&views)).unwrap_or_default())
}

/// Stale users: counts per server, and the users of `server` if given.
pub async fn stale(store: &Store, server: Option<&str>) -> Result<Value, AdminError> {
    let counts: BTreeMap<String, i64> = store.stale_counts().await?.into_iter().collect();
    let mut out = json!({"total": counts.values().sum::<i64>(), "servers": counts});
    if let Some(server) = server {
        let parsed = ruma::OwnedServerName::try_from(server)
            .map_err(|e| AdminError::Argument(format!("server name {server:?}: {e}")))?;
        // Every stale user, due or still in its own back-off.
        let users = store.due_stale_users(&parsed, i64::MAX, 10_000).await?;
        let mut listed = Vec::new();
        for DueUser { user, mark, .. } in users {
            let error = store
                .stale_state(&user)
                .await
                .ok()
                .flatten()
                .and_then(|(_, e)| e);
            listed.push(json!({"user_id": user, "marked_at_ms": mark.marked_at_ms,
                               "trigger_stream_ids": mark.trigger_ids, "last_error": error}));
        }
        out["users"] = Value::from(listed);
    }
    Ok(out)
}

/// Every remote server we know of, worst first (SPEC §5.7.4): tracked and
/// stale users, back-off, last success, revalidations and divergences.
pub async fn servers(store: &Store) -> Result<Value, AdminError> {
    let servers = store.server_figures().await?;
    let total = |f: fn(&crate::store::revalidate::ServerFigures) -> i64| -> i64 {
        servers.iter().map(f).sum()
    };
    Ok(json!({
        "servers_known": servers.len(),
        "tracked_users": total(|s| s.tracked_users),
        "stale_users": total(|s| s.stale_users),
        "servers_backing_off": servers.iter().filter(|s| s.retry_at_ms.is_some()).count(),
        "revalidations": total(|s| s.revalidations),
        "divergences": total(|s| s.divergences),
        "servers": servers,
    }))
}

/// Marks `user` stale and enqueues its server's fetch job (a parked job is
/// started; `retry_min`: `DLU_RETRY_MIN`, as the worker's wake-ups use it); a
/// running worker fetches it. With membership on, a user that shares no
/// room is not marked (SPEC §5.5.6), and the answer says so.
pub async fn resync(
    store: &Store,
    js: &jetstream::Context,
    retry_min: std::time::Duration,
    user: &OwnedUserId,
) -> Result<Value, AdminError> {
    let queue = FetchQueue::inline(js.clone(), store.clone(), retry_min);
    Ok(match resync::request(store, &queue, user).await? {
        Requested::MarkedStale => {
            json!({"user_id": user, "marked_stale": true, "job_enqueued": true})
        }
        Requested::Untracked => json!({"user_id": user, "marked_stale": false,
            "job_enqueued": false, "reason": "the user shares no room with us, so it is not tracked"}),
    })
}

/// Users stored that share no room with us (SPEC §5.5.9): listed (a dry
/// run), or untracked with `apply`. Needs membership on: with it off every
/// remote user is tracked on purpose.
pub async fn untrack_unshared(store: &Store, apply: bool) -> Result<Value, AdminError> {
    if !store.membership() {
        return Err(AdminError::Argument(
            "needs DLU_MEMBERSHIP=on and DLU_SERVER_NAME: with membership off every remote user is tracked, none is unshared"
                .into(),
        ));
    }
    const PAGE: u64 = 1000;
    const LISTED: usize = 1000;
    let (mut after, mut found, mut untracked) = (String::new(), 0_usize, 0_usize);
    let mut listed = Vec::new();
    loop {
        let page = store.unshared_users(&after, PAGE).await?;
        let Some(last) = page.last() else { break };
        after = last.to_string();
        found += page.len();
        let users = if apply {
            let gone = store.untrack_unshared(&page).await?;
            untracked += gone.len();
            gone
        } else {
            page
        };
        listed.extend(users.into_iter().take(LISTED.saturating_sub(listed.len())));
    }
    Ok(
        json!({"unshared": found, "applied": apply, "untracked": untracked,
              "users": listed, "listed": listed.len()}),
    )
}

/// The rooms `user` is in, whether each counts as shared, and through
/// which identities (its user id, or member keys linked to it).
pub async fn rooms(store: &Store, user: &OwnedUserId) -> Result<Value, AdminError> {
    let rooms = store.rooms_of(user).await?;
    let shared = rooms.iter().filter(|r| r.shares).count();
    Ok(json!({"user_id": user, "shared_rooms": shared, "rooms": rooms}))
}

/// Streams and consumers as JetStream reports them.
pub async fn streams(js: &jetstream::Context) -> Result<Value, AdminError> {
    let mut out = serde_json::Map::new();
    for name in [INPUT_STREAM, KEY_CHANGE_STREAM, DEAD_STREAM, FETCH_STREAM] {
        let mut entry = json!({"exists": false});
        if let Ok(mut stream) = js.get_stream(name).await
            && let Ok(info) = stream.info().await
        {
            entry = json!({"exists": true, "messages": info.state.messages, "bytes": info.state.bytes,
                           "first_sequence": info.state.first_sequence, "last_sequence": info.state.last_sequence,
                           "subjects": info.config.subjects});
            let consumer = match name {
                INPUT_STREAM => Some(INPUT_CONSUMER),
                FETCH_STREAM => Some(FETCH_CONSUMER),
                _ => None,
            };
            if let Some(consumer_name) = consumer
                && let Ok(mut consumer) = stream
                    .get_consumer::<async_nats::jetstream::consumer::pull::Config>(consumer_name)
                    .await
                && let Ok(info) = consumer.info().await
            {
                entry["consumer"] = json!({"name": consumer_name, "pending": info.num_pending,
                    "ack_pending": info.num_ack_pending, "redelivered": info.num_redelivered,
                    "waiting": info.num_waiting});
            }
        }
        out.insert(name.to_owned(), entry);
    }
    out.insert("leases".to_owned(), holders(js).await);
    Ok(Value::Object(out))
}

/// Who holds what (SPEC §4.5): the replica consuming each input stream,
/// the holder of each input partition with the count the stream is routed
/// with and what waits in its partitions stream, the live replicas, and the
/// replica pacing revalidations (SPEC §5.7).
async fn holders(js: &jetstream::Context) -> Value {
    use futures::TryStreamExt as _;
    let Ok(leases) = js.get_key_value(crate::bus::lease::BUCKET).await else {
        return json!({"exists": false});
    };
    let keys: Vec<String> = match leases.keys().await {
        Ok(keys) => keys.try_collect().await.unwrap_or_default(),
        Err(_) => Vec::new(),
    };
    let mut inputs = serde_json::Map::new();
    let mut partitions: BTreeMap<String, BTreeMap<u16, String>> = BTreeMap::new();
    let mut replicas = Vec::new();
    let mut pacer = None;
    for key in keys {
        let Ok(Some(holder)) = leases.get(&key).await else {
            continue;
        };
        let holder = String::from_utf8_lossy(&holder).into_owned();
        if let Some(stream) = key.strip_prefix("input.") {
            inputs.insert(stream.to_owned(), json!(holder));
        } else if let Some(rest) = key.strip_prefix("part.")
            && let Some((stream, partition)) = rest.rsplit_once('.')
            && let Ok(partition) = partition.parse::<u16>()
        {
            partitions
                .entry(stream.to_owned())
                .or_default()
                .insert(partition, holder);
        } else if key.starts_with(crate::bus::parts::REPLICA_KEY_PREFIX) {
            replicas.push(holder);
        } else if key == crate::fetch::revalidate::LEASE_KEY {
            pacer = Some(holder);
        }
    }
    let counts = crate::bus::parts::counts_bucket(js, 1, false)
        .await
        .ok()
        .flatten();
    let mut partitioned = serde_json::Map::new();
    for stream in inputs
        .keys()
        .chain(partitions.keys())
        .cloned()
        .collect::<std::collections::BTreeSet<_>>()
    {
        let routed_with = match &counts {
            Some(counts) => crate::bus::parts::routed_count(counts, &stream)
                .await
                .ok()
                .flatten(),
            None => None,
        };
        let held = partitions.remove(&stream).unwrap_or_default();
        if routed_with.is_none() && held.is_empty() {
            continue;
        }
        let waiting = crate::bus::parts::waiting(js, &stream).await.ok();
        let held: Vec<Value> = held
            .into_iter()
            .map(|(partition, replica)| json!({"partition": partition, "replica": replica}))
            .collect();
        partitioned.insert(
            stream,
            json!({"routed_with": routed_with.unwrap_or(1), "waiting": waiting, "holders": held}),
        );
    }
    replicas.sort();
    json!({"input_streams": inputs, "input_partitions": partitioned, "replicas": replicas,
           "revalidation_pacer": pacer})
}

/// Renders a result for people: nested keys as indented lines, and times
/// (`…_at_ms` keys) as a UTC time and an age (`--json` keeps the number).
pub fn to_text(value: &Value) -> String {
    let mut out = String::new();
    walk(value, 0, SystemTime::now(), &mut out);
    out
}

/// Appends `value` at `indent` to `out`.
fn walk(value: &Value, indent: usize, now: SystemTime, out: &mut String) {
    let pad = "  ".repeat(indent);
    match value {
        Value::Object(map) => {
            for (key, value) in map {
                out.push_str(&pad);
                if let (Some(name), Some(ms)) = (key.strip_suffix("_at_ms"), value.as_i64()) {
                    out.push_str(&format!("{name}_at: {}\n", when(ms, now)));
                } else if value.is_object() || value.as_array().is_some_and(|a| !a.is_empty()) {
                    out.push_str(&format!("{key}:\n"));
                    walk(value, indent + 1, now, out);
                } else {
                    out.push_str(&format!("{key}: {}\n", scalar(value)));
                }
            }
        }
        Value::Array(items) => {
            for item in items {
                out.push_str(&format!("{pad}-\n"));
                walk(item, indent + 1, now, out);
            }
        }
        other => out.push_str(&format!("{pad}{}\n", scalar(other))),
    }
}

/// A scalar as people read it.
fn scalar(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        Value::Array(a) if a.is_empty() => "[]".into(),
        other => other.to_string(),
    }
}

/// A time in milliseconds since the epoch, for people: the UTC time to the
/// second and how long ago it was.
fn when(ms: i64, now: SystemTime) -> String {
    let at = UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    let time = humantime::format_rfc3339_seconds(at);
    match now.duration_since(at) {
        Ok(age) => {
            let age = Duration::from_secs(age.as_secs());
            format!("{time} ({} ago)", humantime::format_duration(age))
        }
        Err(_) => format!("{time} (in the future)"),
    }
}

/// Publishes whatever the outbox holds now (normally the workers do this
/// themselves; for after an outage, or to check that NATS takes them).
pub async fn replay_outbox(store: &Store, js: &jetstream::Context) -> Result<Value, AdminError> {
    let instance_id = store.instance_id().await?;
    let (publisher, _handle) = Publisher::new(
        store.clone(),
        js.clone(),
        instance_id,
        Faults::default(),
        crate::metrics::Metrics::new(),
    );
    let sent = publisher.reread_table().await?;
    Ok(json!({"published": sent}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_read_as_utc_and_age_in_text() {
        let now = UNIX_EPOCH + Duration::from_secs(1_796_314_928);
        let value = json!({"users": [{"marked_at_ms": 1_796_314_628_544_i64, "user_id": "@a:b"}]});
        let mut text = String::new();
        walk(&value, 0, now, &mut text);
        assert_eq!(
            text,
            "users:\n  -\n    marked_at: 2026-12-03T16:17:08Z (4m 59s ago)\n    user_id: @a:b\n"
        );
    }

    #[test]
    fn a_value_that_is_not_a_user_id_is_an_argument_error() {
        let err = user_id("not-a-user").unwrap_err();
        assert_eq!(err.to_string(), r#""not-a-user" is not a user id"#);
        assert_eq!(err.exit_code(), 2);
        assert!(user_id("@a:remote.example").is_ok());
    }
}
