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
//!    applied with membership on, on PostgreSQL;
//! 4. `room_leave`: our server leaving a room of `BENCH_ROOM_MEMBERS`
//!    remote members (default 50000), on PostgreSQL.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use device_list_updater::config::Config;
use device_list_updater::testkit::{
    Nats, create_input_stream, create_postgres_database, drop_postgres_database, stream_len,
    wait_for,
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
    let user = format!("@user{user}:server{}.example", user % 500);
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
    for name in [
        "DEVICE_LIST_INPUT",
        "KEY_CHANGE",
        "DEVICE_LIST_DEAD",
        "DEVICE_LIST_FETCH",
    ] {
        let _ = js.delete_stream(name).await;
    }
    let _ = js.delete_key_value(worker_lease_bucket()).await;
    let store = worker::open_store(database_url, Duration::from_secs(10))
        .await
        .expect("db");
    // every user known up to stream id 0, as after a fetch
    let rows: Vec<_> = (0..users)
        .map(|u| entity::remote_user::ActiveModel {
            user_id: Set(format!("@user{u}:server{}.example", u % 500)),
            server_name: Set(format!("server{}.example", u % 500)),
            known_stream_ids: Set("[0]".into()),
            max_stream_id: Set(0),
            fetched_stream_id: Set(0),
        })
        .collect();
    for chunk in rows.chunks(1000) {
        entity::remote_user::Entity::insert_many(chunk.to_vec())
            .exec_without_returning(store.connection())
            .await
            .expect("seed");
    }
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
/// before its join). Measured: worker start → input consumer drained.
/// Returns (messages, messages/s, elapsed, users now sharing a room).
async fn membership_snapshot(
    nats: &Nats,
    database_url: &str,
    rooms: usize,
    members: usize,
    users: usize,
) -> (usize, f64, Duration, u64) {
    use sea_orm::PaginatorTrait;
    let js = nats.js().await;
    for name in [
        "DEVICE_LIST_INPUT",
        "KEY_CHANGE",
        "DEVICE_LIST_DEAD",
        "DEVICE_LIST_FETCH",
    ] {
        let _ = js.delete_stream(name).await;
    }
    let _ = js.delete_key_value(worker_lease_bucket()).await;
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
    config.settings.retry_min = Duration::from_secs(60);
    config.settings.retry_max = Duration::from_secs(3600);
    config.settings.ack_wait = Duration::from_secs(60);
    config.settings.batch_size = env_usize("BENCH_BATCH", 1000);
    let started = Instant::now();
    let running = worker::start(config).await.expect("worker");
    wait_for(Duration::from_secs(600), "input drained", || async {
        let stream = js.get_stream("DEVICE_LIST_INPUT").await.ok()?;
        let mut consumer: jetstream::consumer::PullConsumer = stream
            .get_consumer("device-list-updater-input")
            .await
            .ok()?;
        let info = consumer.info().await.ok()?;
        (info.num_pending == 0 && info.num_ack_pending == 0).then_some(())
    })
    .await;
    let elapsed = started.elapsed();
    let shared = entity::shared_user::Entity::find()
        .count(store.connection())
        .await
        .expect("count");
    running.stop(Duration::from_secs(10)).await;
    (
        messages,
        messages as f64 / elapsed.as_secs_f64(),
        elapsed,
        shared,
    )
}

/// Our server leaving a room of `members` remote members: the room is set
/// up (our user joined first, so members start sharing one by one), then
/// our user leaves. Measured: the leave published → every member untracked
/// and the sweep done. Returns (elapsed, users still sharing).
async fn room_leave(nats: &Nats, database_url: &str, members: usize) -> (Duration, u64) {
    use sea_orm::PaginatorTrait;
    let js = nats.js().await;
    for name in [
        "DEVICE_LIST_INPUT",
        "KEY_CHANGE",
        "DEVICE_LIST_DEAD",
        "DEVICE_LIST_FETCH",
    ] {
        let _ = js.delete_stream(name).await;
    }
    let _ = js.delete_key_value(worker_lease_bucket()).await;
    let store = worker::open_store(database_url, Duration::from_secs(10))
        .await
        .expect("db");
    create_input_stream(&js).await;
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
        (shared == members as u64).then_some(())
    })
    .await;
    let started = Instant::now();
    publish_all(
        &js,
        "devicelist.in.membership",
        std::iter::once(join("@me:our.example".into(), "leave", members + 1)),
    )
    .await;
    wait_for(
        Duration::from_secs(600),
        "all members untracked",
        || async {
            let shared = entity::shared_user::Entity::find().count(db).await.ok()?;
            let room = entity::room::Entity::find_by_id("!big:our.example".to_owned())
                .one(db)
                .await
                .ok()??;
            (shared == 0 && !room.sweep).then_some(shared)
        },
    )
    .await;
    let elapsed = started.elapsed();
    let left = entity::shared_user::Entity::find()
        .count(db)
        .await
        .expect("count");
    running.stop(Duration::from_secs(10)).await;
    (elapsed, left)
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
            let (messages, rate, time, shared) =
                membership_snapshot(&nats, &pg_url, rooms, members, distinct).await;
            drop_postgres_database(&admin, &pg_name).await;
            println!(
                "| membership snapshot, PostgreSQL ({rooms} rooms × {members} remote members, half member-key rooms; {shared} users now shared) | {messages} | {:.2}s | {rate:.0} |",
                time.as_secs_f64()
            );
        }
        if named("room_leave") {
            let admin = std::env::var("DLU_BENCH_PG_URL")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
            let (pg_url, pg_name) = create_postgres_database(&admin, "dlu_bench_leave").await;
            let members = env_usize("BENCH_ROOM_MEMBERS", 50_000);
            let (time, left) = room_leave(&nats, &pg_url, members).await;
            drop_postgres_database(&admin, &pg_name).await;
            println!(
                "| our server leaving a room of {members} remote members, PostgreSQL (leave published → all untracked; {left} left) | 1 | {:.2}s | - |",
                time.as_secs_f64()
            );
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
