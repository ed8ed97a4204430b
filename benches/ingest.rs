//! Ingest benchmark (`cargo bench --bench ingest`).
//!
//! Measures, in one run on one nats-server:
//! 1. a bare JetStream loop: pull a message, publish it to another stream, ack;
//! 2. the worker's ingest: N device-list updates pre-published to
//!    `devicelist.in.update` until all N key changes are in `KEY_CHANGE`
//!    (check, plan, one transaction per batch, outbox, publish, ack), on
//!    PostgreSQL and on SQLite.
//!
//! Settings: `BENCH_UPDATES` (default 200000), `BENCH_USERS` (default 10000),
//! `DLU_BENCH_PG_URL` (default `postgres://postgres@127.0.0.1:5432/test`),
//! `NATS_SERVER_BIN`, `BENCH_ONLY` (a comma list of `bare`, `postgres`, `sqlite`:
//! run only those phases, for profiling; `membership` is only run when
//! named). Results go to stdout as a Markdown table.
//! 3. `membership`: a membership snapshot (`BENCH_ROOMS` rooms, default
//!    1000, × `BENCH_MEMBERS` remote members, default 100, drawn from
//!    `BENCH_ROOM_USERS` users, default 20000), half in member-key rooms,
//!    applied with membership on, on PostgreSQL, while a mock fleet of the
//!    1,000 servers (`BENCH_LATENCY_MS`, default 100) answers the fetches
//!    of the users it starts tracking (`BENCH_FLEET=off`: no fleet;
//!    `BENCH_CONCURRENCY`: `DLU_FETCH_CONCURRENCY`, default its default);
//! 4. `room_leave`: our server leaving a room of `BENCH_ROOM_MEMBERS`
//!    remote members (default 50000), on PostgreSQL, while updates of
//!    1,000 other users flow at 500/s (their latency is reported).
//! 5. `latency`: updates at a steady `BENCH_RATE` a second (default 5000)
//!    for `BENCH_SECONDS` (default 10) over `BENCH_LATENCY_USERS` users
//!    (default 5000) with two devices each, published to a running worker
//!    on PostgreSQL; p50, p99 and max of publish → key change seen by a
//!    core-NATS subscriber. Only run when named.
//! 6. `outside`: the same workloads as a homeserver sees them, with the
//!    release worker binary in its own process (`support/outside.rs`):
//!    ingest of `BENCH_OUTSIDE_UPDATES` (100000) realistic updates over
//!    `BENCH_LATENCY_USERS` users, and the fan-out of `BENCH_SERVERS`
//!    (2000) × `BENCH_USERS_PER_SERVER` (5) stale users; with the worker's
//!    peak RSS and CPU time. Only run when named.
//! 7. `partitions`: ingest of `BENCH_OUTSIDE_UPDATES` realistic updates by
//!    the worker binary in 1, 2 and 3 processes (`BENCH_REPLICAS`, a comma
//!    list) at `DLU_INPUT_PARTITIONS=BENCH_PARTITIONS` (default 8), beside
//!    one process at one partition, `BENCH_ROUNDS` rounds (default 3)
//!    alternating; per replica its CPU, updates routed and ingested; and
//!    the routing hop alone (`support/partitions.rs`). Only run when named.
//! 8. `revalidation`: the worker binary with revalidation off, then on at
//!    `BENCH_REVALIDATIONS` a second (default 200) over `BENCH_SERVERS`
//!    (1000) × `BENCH_USERS_PER_SERVER` (100) tracked users whose lists are
//!    unchanged, the fleet answering in `BENCH_LATENCY_MS` (default 50),
//!    while ordinary updates flow at `BENCH_RATE` (default 200) a second for
//!    `BENCH_SECONDS` (default 30): the worker's CPU and RSS and the
//!    updates' latency (`support/revalidation.rs`). Only run when named.
//! 9. `scale`: the cost as tracked users grow to a million: ingest, steady
//!    latency, the query RPC, admin commands, start-up and peak RSS at each
//!    size of `BENCH_SCALE_SIZES` (`support/scale.rs`). Only run when named.

use std::time::{Duration, Instant};

#[path = "support/fleet.rs"]
mod fleet;
#[path = "support/outside.rs"]
mod outside;
#[path = "support/partitions.rs"]
mod partitions;
#[path = "support/revalidation.rs"]
mod revalidation;
#[path = "support/scale.rs"]
mod scale;

use async_nats::jetstream::{self, stream};
use device_list_updater::config::Config;
use device_list_updater::testkit::remote::{MockFederation, Reply, device_list};
use device_list_updater::testkit::{
    Nats, create_input_stream, create_postgres_database, drop_postgres_database, stream_len,
    wait_for, wait_input_drained_within,
};
use device_list_updater::worker;
use futures::StreamExt as _;
use sea_orm::{ActiveValue::Set, EntityTrait};

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn update(user: usize, round: usize) -> String {
    update_of(&format!("@user{user}:server{}.example", user % 500), round)
}

/// `user`'s update number `round`, chained on the one before.
fn update_of(user: &str, round: usize) -> String {
    let device = format!("DEV{}", round % 4);
    serde_json::json!({
        "user_id": user, "device_id": device, "device_display_name": format!("Phone {round}"),
        "stream_id": round, "prev_id": [round - 1],
        "keys": {"user_id": user, "device_id": device,
                 "algorithms": ["m.olm.v1.curve25519-aes-sha2", "m.megolm.v1.aes-sha2"],
                 "keys": {format!("curve25519:{device}"): "3C5BFWi2Y8MaVvjM8M22DBmh24PmgR0nPvJOIArzgyI",
                          format!("ed25519:{device}"): format!("lEuiRJBit0IG6nUf5pUzWTUEsRVVe/HJkoKu{round:08}")},
                 "signatures": {}}
    })
    .to_string()
}

async fn publish_all(js: &jetstream::Context, subject: &str, bodies: impl Iterator<Item = String>) {
    let mut acks = Vec::with_capacity(4096);
    for body in bodies {
        acks.push(
            js.publish(subject.to_owned(), body.into())
                .await
                .expect("publish"),
        );
        if acks.len() == 4096 {
            for ack in acks.drain(..) {
                ack.await.expect("ack");
            }
        }
    }
    for ack in acks {
        ack.await.expect("ack");
    }
}

/// Pull, publish to another stream, ack: the ceiling for any JetStream worker.
async fn bare_loop(nats: &Nats, n: usize, users: usize) -> f64 {
    let js = nats.js().await;
    for (name, subject) in [("BENCH_IN", "bench.in"), ("BENCH_OUT", "bench.out")] {
        js.get_or_create_stream(stream::Config {
            name: name.into(),
            subjects: vec![subject.into()],
            ..Default::default()
        })
        .await
        .expect("stream");
    }
    publish_all(
        &js,
        "bench.in",
        (0..n).map(|i| update(i % users, 1 + i / users)),
    )
    .await;
    let consumer: jetstream::consumer::PullConsumer = js
        .get_stream("BENCH_IN")
        .await
        .expect("stream")
        .get_or_create_consumer(
            "bench",
            jetstream::consumer::pull::Config {
                durable_name: Some("bench".into()),
                max_ack_pending: 10_000,
                ..Default::default()
            },
        )
        .await
        .expect("consumer");
    let started = Instant::now();
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(1000)
        .messages()
        .await
        .expect("pull");
    let mut acks = Vec::with_capacity(1000);
    let mut done = 0;
    while done < n {
        let message = messages.next().await.expect("message").expect("message");
        acks.push(
            js.publish("bench.out", message.payload.clone())
                .await
                .expect("publish"),
        );
        message.ack().await.expect("ack");
        done += 1;
        if acks.len() == 1000 || done == n {
            for ack in acks.drain(..) {
                ack.await.expect("ack");
            }
        }
    }
    n as f64 / started.elapsed().as_secs_f64()
}

/// The worker's ingest from pre-published updates to published key changes.
async fn ingest(nats: &Nats, database_url: &str, n: usize, users: usize) -> (f64, Duration) {
    let js = nats.js().await;
    fresh_streams(&js).await;
    let store = worker::open_store(database_url, Duration::from_secs(10))
        .await
        .expect("db");
    seed_users(store.connection(), users, |u| {
        format!("@user{u}:server{}.example", u % 500)
    })
    .await;
    create_input_stream(&js).await;
    // round by round: every batch holds many users, each with its next update
    publish_all(
        &js,
        "devicelist.in.update",
        (0..n).map(|i| update(i % users, 1 + i / users)),
    )
    .await;
    let mut config = Config::for_tests("our.example", &nats.url, database_url);
    // Production timings where they matter to a long run.
    config.settings.federation_timeout = Duration::from_secs(30);
    config.settings.retry_min = Duration::from_secs(60);
    config.settings.retry_max = Duration::from_secs(3600);
    config.settings.lease_ttl = Duration::from_secs(10);
    config.settings.ack_wait = Duration::from_secs(60);
    config.settings.batch_size = env_usize("BENCH_BATCH", 1000);
    let started = Instant::now();
    let running = worker::start(config).await.expect("worker");
    wait_for(Duration::from_secs(600), "all key changes", || async {
        (stream_len(&js, "KEY_CHANGE").await >= n as u64).then_some(())
    })
    .await;
    let elapsed = started.elapsed();
    running.stop(Duration::from_secs(10)).await;
    (n as f64 / elapsed.as_secs_f64(), elapsed)
}

/// `user`'s update number `round` as a client's device list carries it:
/// two devices in turn, curve25519 and ed25519 keys, and the device's
/// signature over them (the shape a homeserver publishes).
fn realistic_update(user: &str, round: usize) -> String {
    let device = format!("DEVICE{}", round % 2);
    serde_json::json!({
        "user_id": user, "device_id": device, "device_display_name": format!("Element on phone {round}"),
        "stream_id": round, "prev_id": [round - 1],
        "keys": {"user_id": user, "device_id": device,
                 "algorithms": ["m.olm.v1.curve25519-aes-sha2", "m.megolm.v1.aes-sha2"],
                 "keys": {format!("curve25519:{device}"): format!("3C5BFWi2Y8MaVvjM8M22DBmh24PmgR0nPvJO{round:08}"),
                          format!("ed25519:{device}"): format!("lEuiRJBit0IG6nUf5pUzWTUEsRVVe/HJkoKu{round:08}")},
                 "signatures": {user: {format!("ed25519:{device}"):
                     format!("FLWxXqGbwrb8SM3Y795eB6OA8bwBcoMZFXBqnTn58AYWZSqiD45tlBVcDa2L7RwdKXebW/VzDlnfVJ+9jok1Bw{round:08}")}}}
    })
    .to_string()
}

/// Deletes what an earlier phase left: the worker's streams and its lease
/// bucket.
async fn fresh_streams(js: &jetstream::Context) {
    for name in [
        "DEVICE_LIST_INPUT",
        "KEY_CHANGE",
        "DEVICE_LIST_DEAD",
        "DEVICE_LIST_FETCH",
        "DEVICE_LIST_INPUT_PARTS",
    ] {
        let _ = js.delete_stream(name).await;
    }
    let _ = js.delete_key_value(worker_lease_bucket()).await;
    let _ = js
        .delete_key_value(device_list_updater::bus::parts::COUNTS_BUCKET)
        .await;
}

/// Every user `name(u)` of `0..users` known up to stream id 0, as after a
/// fetch.
async fn seed_users(
    db: &sea_orm::DatabaseConnection,
    users: usize,
    name: impl Fn(usize) -> String,
) {
    let rows: Vec<_> = (0..users)
        .map(|u| {
            let user_id = name(u);
            let server = user_id
                .split_once(':')
                .map(|(_, s)| s.to_owned())
                .unwrap_or_default();
            entity::remote_user::ActiveModel {
                user_id: Set(user_id),
                server_name: Set(server),
                known_stream_ids: Set("[0]".into()),
                max_stream_id: Set(0),
                fetched_stream_id: Set(0),
                fetched_at_ms: Set(0),
            }
        })
        .collect();
    for chunk in rows.chunks(1000) {
        entity::remote_user::Entity::insert_many(chunk.to_vec())
            .exec_without_returning(db)
            .await
            .expect("seed");
    }
}

/// Latency at a steady rate (the shape a homeserver's traffic has between
/// bursts): `users` users with two devices each, updates published at
/// `rate` a second for `seconds`, round-robin over the users, to a running
/// worker. Each update's time from its publish to its key change reaching a
/// core-NATS subscriber on `key_change.>`.
async fn steady_latency(
    nats: &Nats,
    database_url: &str,
    users: usize,
    rate: usize,
    seconds: usize,
) -> (Latencies, HistogramView) {
    let js = nats.js().await;
    fresh_streams(&js).await;
    let store = worker::open_store(database_url, Duration::from_secs(10))
        .await
        .expect("db");
    let name = |u: usize| format!("@user{u}:server{}.example", u % 500);
    seed_users(store.connection(), users, name).await;
    create_input_stream(&js).await;
    let mut config = Config::for_tests("our.example", &nats.url, database_url);
    config.settings.retry_min = Duration::from_secs(60);
    config.settings.retry_max = Duration::from_secs(3600);
    config.settings.lease_ttl = Duration::from_secs(10);
    config.settings.ack_wait = Duration::from_secs(60);
    let running = worker::start(config).await.expect("worker");
    let received = key_changes_seen(nats).await;
    // The first update waits for the worker to hold the input lease.
    js.publish("devicelist.in.update", realistic_update(&name(0), 1).into())
        .await
        .expect("publish")
        .await
        .expect("ack");
    wait_for(Duration::from_secs(30), "the worker consuming", || {
        let received = received.clone();
        async move { (received.lock().ok()?.len() == 1).then_some(()) }
    })
    .await;
    let acks = AcksAside::new();
    let total = rate * seconds;
    let per_tick = rate.div_ceil(1000).max(1);
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut sent = Vec::with_capacity(total);
    // Update 0 (user 0, round 1) was the warm-up.
    let mut k = 1;
    while sent.len() < total {
        tick.tick().await;
        for _ in 0..per_tick.min(total - sent.len()) {
            let (user, round) = (k % users, 1 + k / users);
            k += 1;
            let user = name(user);
            let at = acks.publish(&js, realistic_update(&user, round)).await;
            sent.push(((user, round as i64), at));
        }
    }
    acks.finish().await;
    let latencies = latencies_once_seen(&received, &sent, Duration::from_secs(120)).await;
    let metrics = http_get(running.http_addr, "/metrics").await;
    running.stop(Duration::from_secs(10)).await;
    (
        Latencies::of(latencies),
        HistogramView::of(&metrics, "dlu_update_to_key_change_seconds", "update"),
    )
}

/// `GET path` over plain HTTP/1.1; the body.
async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    try_http_get(addr, path).await.expect("an HTTP answer")
}

/// The body of `GET path` from `addr`; None if nothing answers there.
async fn try_http_get(addr: std::net::SocketAddr, path: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
}

/// What the worker's own latency histogram says: its count and the bucket
/// bounds its p50 and p99 fall in (Prometheus's view of the same run).
struct HistogramView {
    count: u64,
    p50_le: f64,
    p99_le: f64,
}

impl HistogramView {
    fn of(text: &str, name: &str, source: &str) -> HistogramView {
        let prefix = format!("{name}_bucket{{source=\"{source}\",le=\"");
        let buckets: Vec<(f64, u64)> = text
            .lines()
            .filter_map(|line| {
                let rest = line.strip_prefix(&prefix)?;
                let (le, count) = rest.split_once("\"} ")?;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                Some((le, count.trim().parse().ok()?))
            })
            .collect();
        let count = buckets.last().map_or(0, |b| b.1);
        let at = |q: f64| {
            buckets
                .iter()
                .find(|(_, n)| *n as f64 >= q * count as f64)
                .map_or(f64::NAN, |b| b.0)
        };
        HistogramView {
            count,
            p50_le: at(0.50),
            p99_le: at(0.99),
        }
    }
}

/// A member key (`@` + unpadded URL-safe base64 of 32 bytes) for `n`.
fn member_key(n: usize) -> String {
    use base64::Engine as _;
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&(n as u64).to_le_bytes());
    format!(
        "@{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    )
}

/// A membership snapshot applied with `DLU_MEMBERSHIP=on` (and MSC4430):
/// `rooms` rooms, each with our user and `members` remote members drawn
/// from `users` distinct remote users on 1,000 servers; every second room
/// a member-key room (each remote member a key with a verified link, sent
/// before its join); a mock fleet plays the 1,000 servers. Measured:
/// worker start → input consumer drained, and → every user it started
/// tracking fetched.
async fn membership_snapshot(
    nats: &Nats,
    database_url: &str,
    rooms: usize,
    members: usize,
    users: usize,
) -> Snapshot {
    use sea_orm::PaginatorTrait;
    let js = nats.js().await;
    fresh_streams(&js).await;
    let store = worker::open_store(database_url, Duration::from_secs(10))
        .await
        .expect("db");
    create_input_stream(&js).await;
    let mut memberships = Vec::new();
    let mut links = Vec::new();
    let mut ordering = 0_u64;
    for room in 0..rooms {
        let room_id = format!("!room{room}:our.example");
        let keyed = room % 2 == 1;
        ordering += 1;
        memberships.push(
            serde_json::json!({"room_id": room_id, "state_key": "@me:our.example",
            "membership": "join", "stream_ordering": ordering})
            .to_string(),
        );
        for m in 0..members {
            let user = (room * members + m) % users;
            let user_id = format!("@user{user}:server{}.example", user % 1000);
            ordering += 1;
            let state_key = if keyed {
                let key = member_key(room * members + m);
                links.push(
                    serde_json::json!({"room_id": room_id, "member_key": key,
                    "user_id": user_id, "verified": true, "stream_ordering": ordering})
                    .to_string(),
                );
                ordering += 1;
                key
            } else {
                user_id
            };
            memberships.push(
                serde_json::json!({"room_id": room_id, "state_key": state_key,
                "membership": "join", "stream_ordering": ordering})
                .to_string(),
            );
        }
    }
    let messages = memberships.len() + links.len();
    publish_all(&js, "devicelist.in.member_key", links.into_iter()).await;
    publish_all(&js, "devicelist.in.membership", memberships.into_iter()).await;
    let mut config = Config::for_tests("our.example", &nats.url, database_url);
    config.settings.membership = device_list_updater::config::Switch::On;
    config.settings.msc4430 = device_list_updater::config::Switch::On;
    // Production settings for fetching: the fan-out of the users the
    // snapshot starts tracking runs beside it, as it would.
    let defaults = device_list_updater::config::Settings::default();
    config.settings.federation_timeout = defaults.federation_timeout;
    config.settings.retry_min = defaults.retry_min;
    config.settings.retry_max = defaults.retry_max;
    config.settings.fetch_concurrency = env_usize("BENCH_CONCURRENCY", defaults.fetch_concurrency);
    config.settings.ack_wait = Duration::from_secs(60);
    config.settings.batch_size = env_usize("BENCH_BATCH", 1000);
    let latency = Duration::from_millis(env_usize("BENCH_LATENCY_MS", 100) as u64);
    let fleet = MockFederation::trusting(&config, latency).await;
    let servers: Vec<String> = (0..1000).map(|s| format!("server{s}.example")).collect();
    // `BENCH_FLEET=off`: no remote servers (their names do not resolve), so
    // the snapshot is measured without the fan-out beside it.
    let with_fleet = std::env::var("BENCH_FLEET").as_deref() != Ok("off");
    if with_fleet {
        fleet.serve(&mut config, servers.iter().map(String::as_str));
    }
    for user in 0..users {
        let user_id = format!("@user{user}:server{}.example", user % 1000);
        let list = device_list(&user_id, 1, &[("D1", "Phone"), ("D2", "Laptop")]);
        fleet.script(&user_id, vec![Reply::Json(list)]);
    }
    let started = Instant::now();
    let running = worker::start(config).await.expect("worker");
    wait_input_drained_within(&js, Duration::from_secs(600)).await;
    let applied = started.elapsed();
    let db = store.connection();
    if with_fleet {
        wait_for(
            Duration::from_secs(600),
            "every shared user fetched",
            || async {
                let stale = entity::stale_user::Entity::find().count(db).await.ok()?;
                (stale == 0 && fleet.total_requests() >= users).then_some(())
            },
        )
        .await;
    }
    let fetched = started.elapsed();
    let shared = entity::shared_user::Entity::find()
        .count(db)
        .await
        .expect("count");
    assert_eq!(fleet.bad_signatures(), 0);
    let requests = fleet.total_requests();
    running.stop(Duration::from_secs(10)).await;
    Snapshot {
        messages,
        applied,
        shared,
        fetched,
        requests,
    }
}

/// What [`membership_snapshot`] measured.
struct Snapshot {
    /// Membership and link messages applied.
    messages: usize,
    /// Worker start → input drained.
    applied: Duration,
    /// Users sharing a room with us at the end.
    shared: u64,
    /// Worker start → every shared user fetched and fresh.
    fetched: Duration,
    /// Requests the remote fleet answered.
    requests: usize,
}

/// Our server leaving a room of `members` remote members: the room is set
/// up (our user joined first, so members start sharing one by one), then
/// our user leaves. Measured: the leave published → every member untracked
/// and the sweep done. Meanwhile 500 updates a second flow for 1,000 other
/// users (tracked through another room); their publish → key change
/// latency is the second figure. Returns (elapsed, users still sharing,
/// latencies).
async fn room_leave(nats: &Nats, database_url: &str, members: usize) -> (Duration, u64, Latencies) {
    use sea_orm::PaginatorTrait;
    let js = nats.js().await;
    fresh_streams(&js).await;
    let store = worker::open_store(database_url, Duration::from_secs(10))
        .await
        .expect("db");
    create_input_stream(&js).await;
    seed_others(store.connection()).await;
    let join = |who: String, membership: &str, at: usize| {
        serde_json::json!({"room_id": "!big:our.example", "state_key": who,
            "membership": membership, "stream_ordering": at})
        .to_string()
    };
    let mut config = Config::for_tests("our.example", &nats.url, database_url);
    config.settings.membership = device_list_updater::config::Switch::On;
    config.settings.retry_min = Duration::from_secs(60);
    config.settings.retry_max = Duration::from_secs(3600);
    config.settings.ack_wait = Duration::from_secs(60);
    let running = worker::start(config).await.expect("worker");
    publish_all(
        &js,
        "devicelist.in.membership",
        std::iter::once(join("@me:our.example".into(), "join", 0)).chain((0..members).map(|m| {
            join(
                format!("@user{m}:server{}.example", m % 1000),
                "join",
                m + 1,
            )
        })),
    )
    .await;
    let db = store.connection();
    wait_for(Duration::from_secs(600), "all members shared", || async {
        let shared = entity::shared_user::Entity::find().count(db).await.ok()?;
        (shared == (members + OTHERS) as u64).then_some(())
    })
    .await;
    let received = key_changes_seen(nats).await;
    let started = Instant::now();
    publish_all(
        &js,
        "devicelist.in.membership",
        std::iter::once(join("@me:our.example".into(), "leave", members + 1)),
    )
    .await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let steady = tokio::spawn(steady_updates(js.clone(), stop.clone()));
    wait_for(
        Duration::from_secs(600),
        "all members untracked",
        || async {
            let shared = entity::shared_user::Entity::find().count(db).await.ok()?;
            let room = entity::room::Entity::find_by_id("!big:our.example".to_owned())
                .one(db)
                .await
                .ok()??;
            (shared == OTHERS as u64 && !room.sweep).then_some(shared)
        },
    )
    .await;
    let elapsed = started.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = steady.await.expect("steady updates");
    let latencies = latencies_once_seen(&received, &sent, Duration::from_secs(60)).await;
    let left = entity::shared_user::Entity::find()
        .count(db)
        .await
        .expect("count")
        - OTHERS as u64;
    running.stop(Duration::from_secs(10)).await;
    (elapsed, left, Latencies::of(latencies))
}

/// Users of the steady updates during a sweep.
const OTHERS: usize = 1000;

fn other(i: usize) -> String {
    format!("@other{i}:busy{}.example", i % 50)
}

/// The other users, known up to stream id 0 and sharing one room with us,
/// `!others:our.example`, which is ours (as after a fetch of members of
/// another room). Sharing is decided when it is used: a stored count alone
/// would not make them tracked, their updates would be dropped.
async fn seed_others(db: &sea_orm::DatabaseConnection) {
    const ROOM: &str = "!others:our.example";
    entity::room::Entity::insert(entity::room::ActiveModel {
        room_id: Set(ROOM.into()),
        local_joined: Set(1),
        sweep: Set(false),
    })
    .exec_without_returning(db)
    .await
    .expect("seed room");
    let pairs: Vec<_> = (0..OTHERS)
        .map(|i| entity::room_user::ActiveModel {
            room_id: Set(ROOM.into()),
            user_id: Set(other(i)),
            remote: Set(true),
            joined: Set(1),
            shares: Set(true),
        })
        .collect();
    entity::room_user::Entity::insert_many(pairs)
        .exec_without_returning(db)
        .await
        .expect("seed pairs");
    let users: Vec<_> = (0..OTHERS)
        .map(|i| entity::remote_user::ActiveModel {
            user_id: Set(other(i)),
            server_name: Set(format!("busy{}.example", i % 50)),
            known_stream_ids: Set("[0]".into()),
            max_stream_id: Set(0),
            fetched_stream_id: Set(0),
            fetched_at_ms: Set(0),
        })
        .collect();
    let shared: Vec<_> = (0..OTHERS)
        .map(|i| entity::shared_user::ActiveModel {
            user_id: Set(other(i)),
            server_name: Set(format!("busy{}.example", i % 50)),
            shared_rooms: Set(1),
        })
        .collect();
    entity::remote_user::Entity::insert_many(users)
        .exec_without_returning(db)
        .await
        .expect("seed users");
    entity::shared_user::Entity::insert_many(shared)
        .exec_without_returning(db)
        .await
        .expect("seed shared");
}

/// Publishes to the input at a rate with the publish acks awaited aside,
/// so a slow ack never delays the next publish.
struct AcksAside {
    acks: tokio::sync::mpsc::UnboundedSender<jetstream::context::PublishAckFuture>,
    awaiting: tokio::task::JoinHandle<()>,
}

impl AcksAside {
    fn new() -> AcksAside {
        let (acks, mut pending) =
            tokio::sync::mpsc::unbounded_channel::<jetstream::context::PublishAckFuture>();
        let awaiting = tokio::spawn(async move {
            while let Some(ack) = pending.recv().await {
                ack.await.expect("publish ack");
            }
        });
        AcksAside { acks, awaiting }
    }

    /// Publishes `body` to `devicelist.in.update`; when it was sent.
    async fn publish(&self, js: &jetstream::Context, body: String) -> Instant {
        let at = Instant::now();
        let ack = js
            .publish("devicelist.in.update", body.into())
            .await
            .expect("publish");
        let _ = self.acks.send(ack);
        at
    }

    /// Waits for every ack.
    async fn finish(self) {
        drop(self.acks);
        self.awaiting.await.expect("acks");
    }
}

/// (user, stream id) → when its key change arrived, from a core-NATS
/// subscriber on `key_change.>`.
type Seen = std::sync::Arc<std::sync::Mutex<std::collections::HashMap<(String, i64), Instant>>>;

async fn key_changes_seen(nats: &Nats) -> Seen {
    let client = nats.client().await;
    let mut changes = client.subscribe("key_change.>").await.expect("subscribe");
    let seen = Seen::default();
    let out = seen.clone();
    tokio::spawn(async move {
        while let Some(message) = changes.next().await {
            // Nobody looks any more: stop (and unsubscribe), so a phase
            // that measures again and again does not keep every earlier
            // subscriber busy with every later key change.
            if std::sync::Arc::strong_count(&out) == 1 {
                break;
            }
            let at = Instant::now();
            let event: serde_json::Value =
                serde_json::from_slice(&message.payload).unwrap_or_default();
            if let (Some(user), Some(stream)) =
                (event["user_id"].as_str(), event["stream_id"].as_i64())
                && let Ok(mut seen) = out.lock()
            {
                seen.insert((user.to_owned(), stream), at);
            }
        }
    });
    // The subscription is registered with the server before any publish.
    client.flush().await.expect("flush");
    seen
}

/// Waits until every update of `sent` has its key change in `received`;
/// returns each one's publish → key change time.
async fn latencies_once_seen(
    received: &Seen,
    sent: &[((String, i64), Instant)],
    within: Duration,
) -> Vec<Duration> {
    wait_for(within, "every key change", || {
        let received = received.clone();
        async move {
            let received = received.lock().ok()?;
            sent.iter()
                .map(|(key, at)| Some(received.get(key)?.duration_since(*at)))
                .collect::<Option<Vec<Duration>>>()
        }
    })
    .await
}

/// Publishes an update every 2 ms, round-robin over the other users, until
/// `stop`; returns when each was sent.
async fn steady_updates(
    js: jetstream::Context,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Vec<((String, i64), Instant)> {
    let mut tick = tokio::time::interval(Duration::from_millis(2));
    let mut sent = Vec::new();
    for k in 0.. {
        tick.tick().await;
        if stop.load(std::sync::atomic::Ordering::Relaxed) {
            break;
        }
        let (user, round) = (other(k % OTHERS), 1 + k / OTHERS);
        let at = Instant::now();
        js.publish("devicelist.in.update", update_of(&user, round).into())
            .await
            .expect("publish")
            .await
            .expect("publish ack");
        sent.push(((user, round as i64), at));
    }
    sent
}

/// Latency figures of a set of measurements.
struct Latencies {
    count: usize,
    p50: Duration,
    p99: Duration,
    max: Duration,
}

impl Latencies {
    fn of(mut all: Vec<Duration>) -> Latencies {
        all.sort_unstable();
        let at = |q: f64| {
            let i = ((all.len() as f64 * q).ceil() as usize).clamp(1, all.len().max(1)) - 1;
            all.get(i).copied().unwrap_or_default()
        };
        Latencies {
            count: all.len(),
            p50: at(0.50),
            p99: at(0.99),
            max: all.last().copied().unwrap_or_default(),
        }
    }
}

/// The `revalidation` phase (see the module docs): a table of its own.
async fn revalidation_phase(nats: &Nats) {
    let admin = std::env::var("DLU_BENCH_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let settings = revalidation::Settings {
        servers: env_usize("BENCH_SERVERS", 1000),
        per_server: env_usize("BENCH_USERS_PER_SERVER", 100),
        rate: env_usize("BENCH_REVALIDATIONS", 200),
        latency: Duration::from_millis(env_usize("BENCH_LATENCY_MS", 50) as u64),
        update_rate: env_usize("BENCH_RATE", 200),
        seconds: env_usize("BENCH_SECONDS", 30),
    };
    let (pg_url, pg_name) = create_postgres_database(&admin, "dlu_bench_revalidation").await;
    let runs = revalidation::phase(nats, &pg_url, &settings).await;
    drop_postgres_database(&admin, &pg_name).await;
    let users = settings.servers * settings.per_server;
    println!();
    println!(
        "| revalidation, PostgreSQL, the worker binary: {users} tracked users on {} servers; updates at {}/s for {} s | revalidations/s | worker CPU (cores) | worker RSS max in window / peak (MiB) | machine busy | update → key change p50 / p99 / max (ms) |",
        settings.servers, settings.update_rate, settings.seconds
    );
    println!("|---|---|---|---|---|---|");
    for run in runs {
        println!(
            "| {} | {:.0} | {:.3} | {:.1} / {:.1} | {:.0} % | {:.1} / {:.1} / {:.1} ({} updates) |",
            if run.on {
                format!("on, DLU_REVALIDATE_AFTER={}s", users / settings.rate.max(1))
            } else {
                "off (idle but for the updates)".into()
            },
            run.revalidations_per_second,
            run.cpu_cores,
            run.rss_kib as f64 / 1024.0,
            run.peak_rss_kib as f64 / 1024.0,
            run.machine_busy * 100.0,
            run.latency.p50.as_secs_f64() * 1000.0,
            run.latency.p99.as_secs_f64() * 1000.0,
            run.latency.max.as_secs_f64() * 1000.0,
            run.latency.count
        );
    }
}

/// The `partitions` phase (see the module docs): a table of its own.
async fn partitions_phase() {
    let admin = std::env::var("DLU_BENCH_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let n = env_usize("BENCH_OUTSIDE_UPDATES", 100_000);
    let users = env_usize("BENCH_LATENCY_USERS", 5000);
    let p = env_usize("BENCH_PARTITIONS", 8) as u16;
    let rounds = env_usize("BENCH_ROUNDS", 3);
    let counts: Vec<usize> = std::env::var("BENCH_REPLICAS")
        .unwrap_or_else(|_| "1,2,3".into())
        .split(',')
        .filter_map(|c| c.trim().parse().ok())
        .collect();
    let mut shapes = vec![(1u16, 1usize, false), (p, 1, true)];
    shapes.extend(counts.iter().map(|&r| (p, r, false)));
    println!();
    println!(
        "| round | P | replicas | resume → all {n} key changes | updates/s | CPU of all replicas per update | machine busy | per replica: partitions held, routed, ingested, CPU per update ingested, peak RSS |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    // Rounds alternate the shapes, so a drift of the machine spreads over
    // all of them; each run has a nats-server of its own.
    for round in 1..=rounds {
        for &(p, replicas, split) in &shapes {
            let nats = Nats::start().await;
            let (pg_url, pg_name) = create_postgres_database(&admin, "dlu_bench_parts").await;
            let run = partitions::ingest(&nats, &pg_url, n, users, p, replicas, split).await;
            drop_postgres_database(&admin, &pg_name).await;
            let per_replica: Vec<String> = run
                .replicas
                .iter()
                .map(|r| {
                    format!(
                        "{} / {} / {} / {:.1} µs / {:.0} MiB",
                        r.held,
                        r.routed,
                        r.ingested,
                        r.cpu.as_secs_f64() * 1e6 / (r.ingested.max(1)) as f64,
                        r.peak_rss_kib as f64 / 1024.0
                    )
                })
                .collect();
            let label = match run.routing {
                Some((routing, cpu)) => format!(
                    "routed in {:.2} s ({:.0}/s, {:.1} µs CPU per update), then ingested from partitions in {:.2} s",
                    routing.as_secs_f64(),
                    n as f64 / routing.as_secs_f64(),
                    cpu.as_secs_f64() * 1e6 / n as f64,
                    (run.elapsed - routing).as_secs_f64()
                ),
                None => format!("{:.2} s", run.elapsed.as_secs_f64()),
            };
            let rate = match run.routing {
                Some((routing, _)) => n as f64 / (run.elapsed - routing).as_secs_f64(),
                None => n as f64 / run.elapsed.as_secs_f64(),
            };
            println!(
                "| {round} | {p} | {replicas}{} | {label} | {rate:.0} | {:.1} µs | {:.0} % | {} |",
                if split { " (routing alone first)" } else { "" },
                run.total_cpu().as_secs_f64() * 1e6 / n as f64,
                run.machine_busy * 100.0,
                per_replica.join("; ")
            );
        }
    }
}

fn worker_lease_bucket() -> &'static str {
    device_list_updater::bus::lease::BUCKET
}

fn main() {
    // `cargo bench` passes `--bench`; there are no options to read.
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let n = env_usize("BENCH_UPDATES", 200_000);
    let users = env_usize("BENCH_USERS", 10_000);
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let nats = Nats::start().await;
        let only = std::env::var("BENCH_ONLY").ok();
        let runs = |phase: &str| {
            only.as_deref()
                .is_none_or(|o| o.split(',').any(|p| p == phase))
        };
        println!("| measurement | messages | time | per second |");
        println!("|---|---|---|---|");
        if runs("bare") {
            let bare = bare_loop(&nats, n, users).await;
            println!(
                "| bare JetStream pull → publish → ack | {n} | {:.2}s | {bare:.0} |",
                n as f64 / bare
            );
        }
        if runs("postgres") {
            let admin = std::env::var("DLU_BENCH_PG_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
            let (pg_url, pg_name) = create_postgres_database(&admin, "dlu_bench").await;
            let (pg, pg_time) = ingest(&nats, &pg_url, n, users).await;
            drop_postgres_database(&admin, &pg_name).await;
            println!(
                "| ingest, PostgreSQL (update → key change published) | {n} | {:.2}s | {pg:.0} |",
                pg_time.as_secs_f64()
            );
        }
        let named = |phase: &str| {
            only.as_deref()
                .is_some_and(|o| o.split(',').any(|p| p == phase))
        };
        if named("membership") {
            let admin = std::env::var("DLU_BENCH_PG_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
            let (pg_url, pg_name) = create_postgres_database(&admin, "dlu_bench_rooms").await;
            let rooms = env_usize("BENCH_ROOMS", 1000);
            let members = env_usize("BENCH_MEMBERS", 100);
            let distinct = env_usize("BENCH_ROOM_USERS", 20_000);
            let run = membership_snapshot(&nats, &pg_url, rooms, members, distinct).await;
            drop_postgres_database(&admin, &pg_name).await;
            println!(
                "| membership snapshot, PostgreSQL ({rooms} rooms × {members} remote members, half member-key rooms; {} users now shared) | {} | {:.2}s | {:.0} |",
                run.shared,
                run.messages,
                run.applied.as_secs_f64(),
                run.messages as f64 / run.applied.as_secs_f64()
            );
            if run.requests > 0 {
                println!(
                    "| … and its fan-out: worker start → all {} users fetched ({} requests) | {} | {:.2}s | {:.0} |",
                    run.shared,
                    run.requests,
                    run.shared,
                    run.fetched.as_secs_f64(),
                    run.shared as f64 / run.fetched.as_secs_f64()
                );
            }
        }
        if named("room_leave") {
            let admin = std::env::var("DLU_BENCH_PG_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
            let (pg_url, pg_name) = create_postgres_database(&admin, "dlu_bench_leave").await;
            let members = env_usize("BENCH_ROOM_MEMBERS", 50_000);
            let (time, left, others) = room_leave(&nats, &pg_url, members).await;
            drop_postgres_database(&admin, &pg_name).await;
            println!(
                "| our server leaving a room of {members} remote members, PostgreSQL (leave published → all untracked; {left} left) | 1 | {:.2}s | - |",
                time.as_secs_f64()
            );
            println!(
                "| … meanwhile, updates of other users at 500/s: publish → key change p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms | {} | - | - |",
                others.p50.as_secs_f64() * 1000.0,
                others.p99.as_secs_f64() * 1000.0,
                others.max.as_secs_f64() * 1000.0,
                others.count
            );
        }
        if named("latency") {
            let admin = std::env::var("DLU_BENCH_PG_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
            let (pg_url, pg_name) = create_postgres_database(&admin, "dlu_bench_latency").await;
            let users = env_usize("BENCH_LATENCY_USERS", 5000);
            let rate = env_usize("BENCH_RATE", 5000);
            let seconds = env_usize("BENCH_SECONDS", 10);
            let (run, histogram) = steady_latency(&nats, &pg_url, users, rate, seconds).await;
            drop_postgres_database(&admin, &pg_name).await;
            println!(
                "| latency, PostgreSQL: {rate} updates/s for {seconds} s over {users} users × 2 devices, publish → key change p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms | {} | - | - |",
                run.p50.as_secs_f64() * 1000.0,
                run.p99.as_secs_f64() * 1000.0,
                run.max.as_secs_f64() * 1000.0,
                run.count
            );
            println!(
                "| … the worker's dlu_update_to_key_change_seconds{{source=\"update\"}}: p50 ≤ {} s, p99 ≤ {} s (bucket bounds) | {} | - | - |",
                histogram.p50_le, histogram.p99_le, histogram.count
            );
        }
        if named("outside") {
            let admin = std::env::var("DLU_BENCH_PG_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
            let n = env_usize("BENCH_OUTSIDE_UPDATES", 100_000);
            let users = env_usize("BENCH_LATENCY_USERS", 5000);
            let (pg_url, pg_name) = create_postgres_database(&admin, "dlu_bench_outside").await;
            let run = outside::ingest(&nats, &pg_url, n, users).await;
            drop_postgres_database(&admin, &pg_name).await;
            println!(
                "| outside ingest, PostgreSQL, the worker binary: {n} chained updates ({users} users × 2 devices, realistic keys) → key changes; worker peak RSS {:.1} MiB, worker CPU {:.2} s ({:.1} µs per update), machine CPU {:.0} % busy | {n} | {:.2}s | {:.0} |",
                run.peak_rss_kib as f64 / 1024.0,
                run.cpu.as_secs_f64(),
                run.cpu.as_secs_f64() * 1e6 / n as f64,
                run.machine_busy * 100.0,
                run.elapsed.as_secs_f64(),
                n as f64 / run.elapsed.as_secs_f64()
            );
            let servers = env_usize("BENCH_SERVERS", 2000);
            let per_server = env_usize("BENCH_USERS_PER_SERVER", 5);
            let latency = Duration::from_millis(env_usize("BENCH_LATENCY_MS", 100) as u64);
            let (pg_url, pg_name) = create_postgres_database(&admin, "dlu_bench_outside").await;
            let run = outside::fanout(&nats, &pg_url, servers, per_server, latency).await;
            drop_postgres_database(&admin, &pg_name).await;
            let fetched = servers * per_server;
            println!(
                "| outside fan-out, PostgreSQL, the worker binary: {fetched} stale users on {servers} servers answering in {} ms → all fresh by devicelist.rpc.query; worker peak RSS {:.1} MiB, worker CPU {:.0} µs per user, machine CPU {:.0} % busy | {fetched} | {:.2}s | {:.0} |",
                latency.as_millis(),
                run.peak_rss_kib as f64 / 1024.0,
                run.cpu.as_secs_f64() * 1e6 / fetched as f64,
                run.machine_busy * 100.0,
                run.elapsed.as_secs_f64(),
                fetched as f64 / run.elapsed.as_secs_f64()
            );
        }
        if named("partitions") {
            partitions_phase().await;
        }
        if named("revalidation") {
            revalidation_phase(&nats).await;
        }
        if named("scale") {
            scale::phase(&nats).await;
        }
        if runs("sqlite") {
            let dir = tempfile::tempdir().expect("dir");
            let sqlite_url = format!(
                "sqlite://{}?mode=rwc",
                dir.path().join("bench.sqlite").display()
            );
            let (sqlite, sqlite_time) = ingest(&nats, &sqlite_url, n, users).await;
            println!(
                "| ingest, SQLite (update → key change published) | {n} | {:.2}s | {sqlite:.0} |",
                sqlite_time.as_secs_f64()
            );
        }
    });
}
