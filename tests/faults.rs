//! Fault injection with real processes, during a burst of updates:
//! - a replica killed with SIGKILL and started again;
//! - nats-server stopped and started again (file store kept);
//! - PostgreSQL refusing the worker's database for a while;
//! - a private PostgreSQL server stopped with `pg_ctl stop -m immediate`
//!   and started again;
//! - the connection to NATS going silent while a pull has an update on its
//!   way, then breaking.
//!
//! After each, every update is reflected in the database and every key
//! change is in `KEY_CHANGE` exactly once (distinct `Nats-Msg-Id`s, one
//! event per update: each update of the burst is a visible change). In the
//! in-process cases a few users of mocked remote servers are stale when the
//! fault hits; none stays stale once the back-off (2 s at most here) allows
//! a retry.

mod common;

use std::time::Duration;

use common::burst::{
    TOTAL, assert_all_reflected_once, assert_no_user_left_stale, seed_and_publish,
    start_and_let_a_fifth_through,
};
use common::{Backend, Nats, TestDb};
use device_list_updater::server_key::ServerKey;
use device_list_updater::testkit::{input_consumer_info, stream_len, wait_for};
use device_list_updater::worker;
use sea_orm::ConnectionTrait;

async fn sigkill_during_a_burst(backend: Backend) {
    let nats = Nats::start().await;
    let db = TestDb::new(backend).await;
    let js = nats.js().await;
    seed_and_publish(&db.url, &js).await;
    let key_dir = tempfile::tempdir().expect("dir");
    let key_path = key_dir.path().join("signing.key");
    ServerKey::generate()
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

async fn nats_restart_during_a_burst(backend: Backend) {
    let mut nats = Nats::start().await;
    let db = TestDb::new(backend).await;
    let js = nats.js().await;
    seed_and_publish(&db.url, &js).await;
    let (running, remote) = start_and_let_a_fifth_through(common::config(&nats, &db), &js).await;
    nats.restart().await;
    let js = nats.js().await;
    assert_all_reflected_once(&js, running.store.connection()).await;
    assert_no_user_left_stale(&js, &running, &remote).await;
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
    let (running, remote) = start_and_let_a_fifth_through(common::config(&nats, &db), &js).await;
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
    assert_no_user_left_stale(&js, &running, &remote).await;
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
    let (running, remote) = start_and_let_a_fifth_through(
        device_list_updater::config::Config::for_tests(common::OUR_SERVER, &nats.url, &pg.url),
        &js,
    )
    .await;
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
    assert_no_user_left_stale(&js, &running, &remote).await;
    assert_eq!(common::http_status(addr, "/readyz").await, 200);
    running.stop(Duration::from_secs(10)).await;
}

/// The connection to NATS goes silent while a pull has an update on its way
/// (the socket of a node that is dying), then breaks (its death). The update
/// that vanished with the pull is redelivered only after the ack wait; the
/// same user's next update, published as soon as the worker has
/// reconnected, must not overtake it (per-user order): both apply, in
/// order, and the user is never stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_pull_keeps_per_user_order() {
    let nats = Nats::start().await;
    let proxy = common::proxy::Proxy::start(&nats.url).await;
    let db = TestDb::new(Backend::Sqlite).await;
    let js = nats.js().await;
    device_list_updater::testkit::create_input_stream(&js).await;
    let mut config =
        device_list_updater::config::Config::for_tests(common::OUR_SERVER, &proxy.url(), &db.url);
    // Longer than a lost pull takes to notice (its expiry and grace, 5 s), so
    // a new pull would come before the redelivery.
    config.settings.ack_wait = Duration::from_secs(10);
    // No renewal during the test: one lost to the silence would end the lease
    // and take the takeover path instead of the lost-pull one.
    config.settings.lease_ttl = Duration::from_secs(600);
    let running = worker::start(config).await.expect("worker");
    let user = "@lost:remote.example";
    common::known_user(running.store.connection(), user).await;
    let update = |id: i64, name: &str| {
        common::fetch_env::update(user, "DEVICE", id, &[id - 1], name).to_string()
    };
    // One update through first: the ingest is past its start-up and pulls
    // as it does in steady state.
    common::publish(&js, "devicelist.in.update", &update(1, "first"), None).await;
    common::wait_stream(&js, "KEY_CHANGE", 1).await;
    let mut next = 2;
    // The update must leave on a pull before that pull expires; if it did
    // not (the pull ended just as the silence began), it is delivered after
    // the cut, in order, and the next one is tried.
    loop {
        device_list_updater::testkit::wait_input_drained(&js).await;
        pull_waiting(&js).await;
        proxy.swallow_what_the_server_sends();
        common::publish(&js, "devicelist.in.update", &update(next, "lost"), None).await;
        let sent = delivered_unacked(&js, Duration::from_secs(2)).await;
        let subscribed = proxy.subscribed_connections();
        proxy.cut();
        // The next update comes once the worker is back: the server may
        // still hold the lost pull (its expiry has not come) and deliver
        // the update on it, ahead of the one the pull lost.
        proxy.wait_subscribed_after(subscribed).await;
        next += 1;
        if sent {
            break;
        }
    }
    common::publish(&js, "devicelist.in.update", &update(next, "after"), None).await;
    device_list_updater::testkit::wait_input_drained_within(&js, Duration::from_secs(60)).await;
    // The outbox is published after the acks: wait for it (or 20 s), then
    // say what arrived.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let ids = loop {
        let ids: Vec<i64> = common::read_stream(&js, "KEY_CHANGE")
            .await
            .iter()
            .filter(|k| k.json["user_id"] == user)
            .filter_map(|k| k.json["stream_id"].as_i64())
            .collect();
        if ids.len() >= next as usize || tokio::time::Instant::now() > deadline {
            break ids;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(ids, (1..=next).collect::<Vec<_>>(), "key changes in order");
    use sea_orm::EntityTrait as _;
    let stale = entity::stale_user::Entity::find()
        .one(running.store.connection())
        .await
        .expect("query");
    assert!(stale.is_none(), "the user went stale after a gap");
    running.stop(Duration::from_secs(10)).await;
}

/// Waits until the worker has a pull request waiting on the input consumer.
async fn pull_waiting(js: &async_nats::jetstream::Context) {
    wait_for(Duration::from_secs(20), "a waiting pull", || async {
        let info = input_consumer_info(js).await?;
        (info.num_waiting > 0).then_some(())
    })
    .await;
}

/// Whether the input consumer has, within `timeout`, delivered its one
/// pending message without its being acked.
async fn delivered_unacked(js: &async_nats::jetstream::Context, timeout: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        let info = input_consumer_info(js).await.expect("consumer info");
        if info.num_pending == 0 && info.num_ack_pending == 1 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}
