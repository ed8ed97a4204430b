//! A real three-node NATS cluster (routes on loopback, JetStream on each
//! node) under the worker, with `DLU_STREAM_REPLICAS=3`: during the burst of
//! the fault tests and with fetches pending, the node leading
//! `DEVICE_LIST_INPUT` is killed (SIGKILL) and started again, then the node
//! leading `KEY_CHANGE`. The worker is never restarted; every update is
//! reflected, every key change is in `KEY_CHANGE` exactly once, and the
//! streams it created have three replicas. The time from each kill until
//! the updates published just before it are all applied and their key
//! changes published is printed (run with `--no-capture`;
//! docs/reliability.md reports it).
//!
//! PostgreSQL, the database replicas share in a clustered deployment.

mod common;

use std::time::{Duration, Instant};

use async_nats::jetstream;
use common::burst::{
    ROUNDS, STALE_SERVERS, USERS, assert_all_reflected_once, assert_no_user_left_stale,
    publish_rounds, seed, stale_server, start_and_let_a_fifth_through,
};
use common::{Backend, OUR_SERVER, TestDb};
use device_list_updater::config::Config;
use device_list_updater::testkit::cluster::NatsCluster;
use device_list_updater::testkit::remote::{MockFederation, Reply, device_list};
use device_list_updater::testkit::wait_for;
use entity::{key_change_outbox, remote_device};
use sea_orm::{ColumnTrait as _, EntityTrait as _, PaginatorTrait as _, QueryFilter as _};
use serde_json::json;

/// Stale users marked at each kill, so fetches are pending when it hits.
const STALE_PER_KILL: usize = 20;

/// Marks `STALE_PER_KILL` new users of the mocked servers stale (each has
/// one list to give), so their fetches run while the next fault hits.
async fn mark_new_users_stale(
    js: &jetstream::Context,
    remote: &MockFederation,
    kill: usize,
) -> Vec<String> {
    let users: Vec<String> = (0..STALE_PER_KILL)
        .map(|u| format!("@k{kill}u{u}:{}", stale_server(u % STALE_SERVERS)))
        .collect();
    for user in &users {
        remote.script(
            user,
            vec![Reply::Json(device_list(user, 3, &[("D", "fetched")]))],
        );
        common::publish(
            js,
            "devicelist.in.resync",
            &json!({"user_id": user}).to_string(),
            None,
        )
        .await;
    }
    users
}

/// What a kill cost, in seconds from the kill, measured in the database
/// (NATS itself answers slowly while a stream has no leader).
struct Resumed {
    /// Until every update published just before the kill was applied.
    all_applied: f64,
    /// Until, besides, every key change was published (the outbox empty).
    all_published: f64,
}

/// Users whose update of round `round` (or a later one) is applied.
async fn applied_at(conn: &sea_orm::DatabaseConnection, round: usize) -> u64 {
    remote_device::Entity::find()
        .filter(remote_device::Column::StreamId.gte(round as i64))
        .count(conn)
        .await
        .unwrap_or(0)
}

/// Publishes `rounds`, kills the node leading `stream` while the worker is
/// busy with them, measures how long processing takes to resume, starts the
/// node again and waits until the streams have caught up on it.
async fn kill_leader_of(
    cluster: &mut NatsCluster,
    js: &jetstream::Context,
    conn: &sea_orm::DatabaseConnection,
    stream: &str,
    rounds: std::ops::RangeInclusive<usize>,
) -> Resumed {
    let last = *rounds.end();
    publish_rounds(js, rounds).await;
    let leader = cluster.leader_of(js, stream).await;
    let killed = Instant::now();
    cluster.nodes[leader].stop();
    let at_kill = applied_at(conn, last).await;
    assert!(
        at_kill < USERS as u64,
        "the kill of {stream}'s leader came before the worker was through"
    );
    wait_for(Duration::from_secs(60), "the part applied", || async {
        (applied_at(conn, last).await == USERS as u64).then_some(())
    })
    .await;
    let all_applied = killed.elapsed().as_secs_f64();
    wait_for(Duration::from_secs(60), "the outbox empty", || async {
        let rows = key_change_outbox::Entity::find().count(conn).await.ok()?;
        (rows == 0).then_some(())
    })
    .await;
    let all_published = killed.elapsed().as_secs_f64();
    eprintln!(
        "killed n{leader} (leading {stream}) with {at_kill} of {USERS} users at round {last}: \
         every update applied {all_applied:.2} s after the kill, every key change published \
         {all_published:.2} s after"
    );
    cluster.nodes[leader].restart().await;
    for name in ["DEVICE_LIST_INPUT", "KEY_CHANGE"] {
        cluster.wait_all_current(js, name).await;
    }
    Resumed {
        all_applied,
        all_published,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaders_killed_during_a_burst() {
    let mut cluster = NatsCluster::start(3).await;
    let db = TestDb::new(Backend::Postgres).await;
    let js = cluster.js().await;
    cluster.create_input_stream(&js).await;
    seed(&db.url).await;
    // Held back: each kill comes right after a part is published, so the
    // worker is busy with it when the node goes.
    let (first, second) = (ROUNDS / 2, ROUNDS * 3 / 4);
    publish_rounds(&js, 1..=first).await;
    let mut config = Config::for_tests(OUR_SERVER, &cluster.urls(), &db.url);
    config.settings.stream_replicas = 3;
    let (running, remote) = start_and_let_a_fifth_through(config, &js).await;
    let conn = running.store.connection();

    let mut stale = mark_new_users_stale(&js, &remote, 0).await;
    let input = kill_leader_of(
        &mut cluster,
        &js,
        conn,
        "DEVICE_LIST_INPUT",
        first + 1..=second,
    )
    .await;
    stale.extend(mark_new_users_stale(&js, &remote, 1).await);
    let output = kill_leader_of(&mut cluster, &js, conn, "KEY_CHANGE", second + 1..=ROUNDS).await;
    for (stream, resumed) in [("DEVICE_LIST_INPUT", &input), ("KEY_CHANGE", &output)] {
        assert!(
            resumed.all_applied < 30.0 && resumed.all_published < 30.0,
            "{stream}'s leader killed: applied after {:.1} s, published after {:.1} s",
            resumed.all_applied,
            resumed.all_published
        );
    }

    assert_all_reflected_once(&js, conn).await;
    assert_no_user_left_stale(&js, &running, &remote).await;
    wait_for(
        Duration::from_secs(30),
        "every newly stale user fetched",
        || async {
            stale
                .iter()
                .all(|user| remote.requests(user) > 0)
                .then_some(())
        },
    )
    .await;
    // The streams and the lease bucket the worker created run on three nodes.
    for name in [
        "KEY_CHANGE",
        "DEVICE_LIST_FETCH",
        "DEVICE_LIST_DEAD",
        "KV_device_list_updater_leases",
    ] {
        let mut stream = js.get_stream(name).await.expect(name);
        let info = stream.info().await.expect("stream info");
        assert_eq!(info.config.num_replicas, 3, "{name} has three replicas");
    }
    running.stop(Duration::from_secs(10)).await;
}

/// A node whose route port another process took meanwhile is reported at
/// once, with what nats-server printed, so the cluster can start again on
/// new ports (the cluster tests otherwise failed now and then, waiting for
/// a server that had exited).
#[tokio::test]
async fn a_taken_route_port_is_reported_not_waited_on() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let port = taken.local_addr().expect("its address").port();
    let conf = format!(
        "server_name: n0\ncluster {{ name: taken, listen: \"127.0.0.1:{port}\", routes: [nats-route://127.0.0.1:{port}] }}\n"
    );
    let Err(e) = device_list_updater::testkit::Nats::try_start_with_config(&conf).await else {
        panic!("a server started on a taken route port");
    };
    assert!(e.contains("address already in use"), "{e}");
}
