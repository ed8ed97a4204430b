//! Fault injection with real processes, during a burst of updates:
//! - a replica killed with SIGKILL and started again;
//! - nats-server stopped and started again (file store kept);
//! - PostgreSQL refusing the worker's database for a while;
//! - a private PostgreSQL server stopped with `pg_ctl stop -m immediate`
//!   and started again.
//!
//! After each, every update is reflected in the database and every key
//! change is in `KEY_CHANGE` exactly once (distinct `Nats-Msg-Id`s, one
//! event per update: each update of the burst is a visible change). In the
//! in-process cases a few users of mocked remote servers are stale when the
//! fault hits; none stays stale once the back-off (2 s at most here) allows
//! a retry.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use async_nats::jetstream;
use common::{Backend, Nats, TestDb};
use device_list_updater::signing_key::SigningKey;
use device_list_updater::testkit::remote::{MockFederation, Reply, device_list};
use device_list_updater::testkit::{stream_len, wait_for};
use device_list_updater::worker;
use futures::StreamExt as _;
use sea_orm::{ActiveValue::Set, ConnectionTrait, EntityTrait, PaginatorTrait};
use serde_json::json;

const USERS: usize = 200;
const ROUNDS: usize = 50;
const TOTAL: usize = USERS * ROUNDS;
/// Users of other servers, marked stale by a resync request.
const STALE_USERS: usize = 20;
const STALE_SERVERS: usize = 4;

fn stale_server(s: usize) -> String {
    format!("stale{s}.example")
}

fn stale_user(u: usize) -> String {
    format!("@s{u}:{}", stale_server(u % STALE_SERVERS))
}

fn user(u: usize) -> String {
    format!("@burst{u}:remote.example")
}

async fn seed_and_publish(db_url: &str, js: &jetstream::Context) {
    let store = worker::open_store(db_url, Duration::from_secs(10))
        .await
        .expect("store");
    let rows: Vec<_> = (0..USERS)
        .map(|u| entity::remote_user::ActiveModel {
            user_id: Set(user(u)),
            server_name: Set("remote.example".into()),
            known_stream_ids: Set("[0]".into()),
            max_stream_id: Set(0),
            fetched_stream_id: Set(0),
        })
        .collect();
    entity::remote_user::Entity::insert_many(rows)
        .exec_without_returning(store.connection())
        .await
        .expect("seed");
    common::create_input_stream(js).await;
    let mut acks = Vec::new();
    for round in 1..=ROUNDS {
        for u in 0..USERS {
            let body = json!({"user_id": user(u), "device_id": "D", "stream_id": round,
                "prev_id": [round - 1], "device_display_name": format!("name {round}"),
                "keys": {"user_id": user(u), "device_id": "D", "round": round}});
            acks.push(
                js.publish("devicelist.in.update", body.to_string().into())
                    .await
                    .expect("publish"),
            );
        }
        for ack in acks.drain(..) {
            ack.await.expect("publish ack");
        }
    }
}

/// Every update applied, and `KEY_CHANGE` holds exactly one event per update.
async fn assert_all_reflected_once(js: &jetstream::Context, db: &sea_orm::DatabaseConnection) {
    wait_for(Duration::from_secs(120), "every key change", || async {
        (stream_len(js, "KEY_CHANGE").await >= TOTAL as u64).then_some(())
    })
    .await;
    wait_for(
        Duration::from_secs(60),
        "every user at its last update",
        || async {
            let done = entity::remote_device::Entity::find()
                .all(db)
                .await
                .ok()?
                .iter()
                .filter(|d| d.stream_id == ROUNDS as i64)
                .count();
            (done == USERS).then_some(())
        },
    )
    .await;
    // published rows are deleted just after their acks arrive
    wait_for(Duration::from_secs(30), "outbox drained", || async {
        let rows = entity::key_change_outbox::Entity::find()
            .count(db)
            .await
            .ok()?;
        (rows == 0).then_some(())
    })
    .await;
    // distinct (user, stream id) pairs: exactly once each
    let stream = js.get_stream("KEY_CHANGE").await.expect("stream");
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig::default())
        .await
        .expect("consumer");
    let mut messages = consumer.messages().await.expect("messages");
    let mut seen = HashSet::new();
    let mut ids = HashSet::new();
    let mut fetched = 0;
    let total = stream_len(js, "KEY_CHANGE").await;
    for _ in 0..total {
        let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .expect("read in time")
            .expect("a message")
            .expect("readable");
        let body: serde_json::Value = serde_json::from_slice(&message.payload).expect("json");
        let key = (
            body["user_id"].as_str().unwrap_or_default().to_owned(),
            body["stream_id"].as_i64().unwrap_or_default(),
        );
        assert!(seen.insert(key.clone()), "duplicate key change {key:?}");
        if !key.0.starts_with("@burst") {
            fetched += 1;
        }
        let id = message
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .map(|v| v.to_string())
            .expect("Nats-Msg-Id");
        assert!(ids.insert(id), "duplicate Nats-Msg-Id");
    }
    assert_eq!(seen.len() - fetched, TOTAL, "one key change per update");
}

async fn sigkill_during_a_burst(backend: Backend) {
    let nats = Nats::start().await;
    let db = TestDb::new(backend).await;
    let js = nats.js().await;
    seed_and_publish(&db.url, &js).await;
    let key_dir = tempfile::tempdir().expect("dir");
    let key_path = key_dir.path().join("signing.key");
    SigningKey::generate()
        .expect("key")
        .write_new(&key_path)
        .expect("write key");
    // Two kills, each once part of the burst is through.
    for (i, threshold) in [TOTAL / 5, TOTAL / 2].into_iter().enumerate() {
        let mut child = common::worker_command(&nats, &db, &key_path)
            .env("DLU_BATCH_SIZE", "100")
            .env("DLU_LEASE_TTL", "2s")
            .env("DLU_ACK_WAIT", "2s")
            .spawn()
            .expect("spawn");
        wait_for(Duration::from_secs(120), "part of the burst", || async {
            (stream_len(&js, "KEY_CHANGE").await >= threshold as u64).then_some(())
        })
        .await;
        child.start_kill().expect("SIGKILL");
        child.wait().await.expect("reaped");
        assert!(
            stream_len(&js, "KEY_CHANGE").await < TOTAL as u64,
            "kill {i} came before the end of the burst"
        );
    }
    let mut child = common::worker_command(&nats, &db, &key_path)
        .env("DLU_LEASE_TTL", "2s")
        .env("DLU_ACK_WAIT", "2s")
        .spawn()
        .expect("spawn");
    let store = worker::open_store(&db.url, Duration::from_secs(10))
        .await
        .expect("store");
    assert_all_reflected_once(&js, store.connection()).await;
    child.start_kill().expect("kill");
}
both_backends!(sigkill_replica, sigkill_during_a_burst);

/// Starts an in-process worker (small batches, so the burst takes many) and
/// returns once a fifth of the burst's key changes are out.
async fn start_and_let_a_fifth_through(
    nats: &Nats,
    db_url: &str,
    js: &jetstream::Context,
) -> (worker::Running, MockFederation) {
    let mut config =
        device_list_updater::config::Config::for_tests(common::OUR_SERVER, &nats.url, db_url);
    config.settings.batch_size = 100;
    // A few users to fetch too, so the fault also meets pending fetches.
    let remote = MockFederation::trusting(&config, Duration::from_millis(50)).await;
    let servers: Vec<String> = (0..STALE_SERVERS).map(stale_server).collect();
    remote.serve(&mut config, servers.iter().map(String::as_str));
    for u in 0..STALE_USERS {
        let user = stale_user(u);
        remote.script(
            &user,
            vec![Reply::Json(device_list(&user, 3, &[("D", "fetched")]))],
        );
        common::publish(
            js,
            "devicelist.in.resync",
            &json!({"user_id": user}).to_string(),
            None,
        )
        .await;
    }
    let running = worker::start(config).await.expect("worker");
    wait_for(Duration::from_secs(120), "part of the burst", || async {
        (stream_len(js, "KEY_CHANGE").await >= (TOTAL / 5) as u64).then_some(())
    })
    .await;
    (running, remote)
}

/// Every user marked stale is fetched again within the back-off's reach
/// (`common::config` caps it at 2 s; the bound here leaves room for a slow
/// machine).
async fn assert_no_user_left_stale(running: &worker::Running, remote: &MockFederation) {
    wait_for(
        Duration::from_secs(30),
        "every stale user fetched",
        || async {
            let asked = (0..STALE_USERS).all(|u| remote.requests(&stale_user(u)) > 0);
            (asked && running.store.stale_user_count().await.ok()? == 0).then_some(())
        },
    )
    .await;
}

async fn nats_restart_during_a_burst(backend: Backend) {
    let mut nats = Nats::start().await;
    let db = TestDb::new(backend).await;
    let js = nats.js().await;
    seed_and_publish(&db.url, &js).await;
    let (running, remote) = start_and_let_a_fifth_through(&nats, &db.url, &js).await;
    nats.restart().await;
    let js = nats.js().await;
    assert_all_reflected_once(&js, running.store.connection()).await;
    assert_no_user_left_stale(&running, &remote).await;
    running.stop(Duration::from_secs(10)).await;
}
both_backends!(nats_restart, nats_restart_during_a_burst);

/// PostgreSQL refuses the worker's database for a few seconds (connections
/// terminated, new ones refused), then takes it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_unavailable_during_a_burst() {
    let nats = Nats::start().await;
    let db = TestDb::new(Backend::Postgres).await;
    let js = nats.js().await;
    seed_and_publish(&db.url, &js).await;
    let name = db.url.rsplit('/').next().expect("database name").to_owned();
    let admin = sea_orm::Database::connect(common::pg_admin_url())
        .await
        .expect("admin");
    let (running, remote) = start_and_let_a_fifth_through(&nats, &db.url, &js).await;
    admin
        .execute_unprepared(&format!(
            "ALTER DATABASE \"{name}\" ALLOW_CONNECTIONS false; \
             SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"
        ))
        .await
        .expect("take the database away");
    // The worker notices: readiness goes down while the database is gone.
    let addr = running.http_addr;
    wait_for(Duration::from_secs(30), "readyz 503", || async {
        (common::http_status(addr, "/readyz").await == 503).then_some(())
    })
    .await;
    let during = stream_len(&js, "KEY_CHANGE").await;
    assert!(during < TOTAL as u64, "the outage came before the end");
    admin
        .execute_unprepared(&format!("ALTER DATABASE \"{name}\" ALLOW_CONNECTIONS true"))
        .await
        .expect("give it back");
    assert_all_reflected_once(&js, running.store.connection()).await;
    assert_no_user_left_stale(&running, &remote).await;
    running.stop(Duration::from_secs(10)).await;
}

/// A private PostgreSQL server is stopped the way a crash stops it
/// (`pg_ctl stop -m immediate`) during the burst and started again: the
/// worker, never restarted, reports not ready while it is down and then
/// finishes the burst, nothing lost and nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_stopped_during_a_burst() {
    let nats = Nats::start().await;
    let pg = device_list_updater::testkit::postgres::PrivatePostgres::start();
    let js = nats.js().await;
    seed_and_publish(&pg.url, &js).await;
    let (running, remote) = start_and_let_a_fifth_through(&nats, &pg.url, &js).await;
    let stopped = std::time::Instant::now();
    pg.stop_immediate();
    let addr = running.http_addr;
    // Promptly: a probe does not wait for the pool's 30 s acquire timeout.
    wait_for(Duration::from_secs(10), "readyz 503 within 5 s", || async {
        let probe = common::http_status(addr, "/readyz");
        let status = tokio::time::timeout(Duration::from_secs(5), probe)
            .await
            .ok()?;
        (status == 503).then_some(())
    })
    .await;
    let during = stream_len(&js, "KEY_CHANGE").await;
    assert!(during < TOTAL as u64, "the stop came before the end");
    pg.start_again();
    let restarted = std::time::Instant::now();
    wait_for(Duration::from_secs(60), "key changes again", || async {
        (stream_len(&js, "KEY_CHANGE").await > during).then_some(())
    })
    .await;
    // The figure docs/reliability.md reports (run with --nocapture).
    eprintln!(
        "PostgreSQL down {:.1} s; key changes again {:.1} s after it was back",
        (restarted - stopped).as_secs_f64(),
        restarted.elapsed().as_secs_f64()
    );
    assert_all_reflected_once(&js, running.store.connection()).await;
    assert_no_user_left_stale(&running, &remote).await;
    assert_eq!(common::http_status(addr, "/readyz").await, 200);
    running.stop(Duration::from_secs(10)).await;
}
