//! Input partitions (SPEC §4.5): three worker processes with
//! `DLU_INPUT_PARTITIONS=8` on a three-node NATS cluster (R3 streams) and
//! PostgreSQL share the partitions out (two or three each). During a burst
//! of 20,000 chained updates for 2,000 users, one replica is killed
//! (SIGKILL), or stopped (SIGTERM), or the node leading the partitions
//! stream is killed; a new replica starts where one went. Every update is
//! applied once and in order per user (each `prev_id` names the update
//! before, so one applied out of order would leave its user stale), no key
//! change is published twice, and the partitions of a replica that went are
//! held by the others within the lease time.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::process::Stdio;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use common::burst::{publish_round_of, read_key_changes, seed_users};
use common::{Backend, TestDb};
use device_list_updater::server_key::ServerKey;
use device_list_updater::testkit::cluster::NatsCluster;
use device_list_updater::testkit::{stream_len, wait_for};
use device_list_updater::worker;
use futures::TryStreamExt as _;
use sea_orm::{ColumnTrait as _, EntityTrait, PaginatorTrait, QueryFilter as _};
use tokio::process::Child;

const PARTITIONS: usize = 8;
const USERS: usize = 2_000;
const ROUNDS: usize = 10;
const TOTAL: usize = USERS * ROUNDS;
/// `DLU_LEASE_TTL` of the replicas.
const LEASE_TTL: Duration = Duration::from_secs(3);
/// How soon a replica that starts holds its share: its start-up (a process,
/// its connections, the bus set-up) and a hand-over, each within seconds.
const NEWCOMER_DEALT_WITHIN: Duration = Duration::from_secs(15);

fn user(u: usize) -> String {
    format!("@p{u}:remote{}.example", u % 20)
}

/// How the burst is disturbed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// One replica is killed with SIGKILL.
    KillReplica,
    /// One replica is stopped with SIGTERM.
    StopReplica,
    /// The NATS node leading the partitions stream is killed.
    KillNatsNode,
}

struct Deployment {
    cluster: NatsCluster,
    db: TestDb,
    key_dir: tempfile::TempDir,
    replicas: Vec<(String, Child)>,
    started: usize,
}

impl Deployment {
    /// Starts replica `replica-<n>` (its host name, so its lease holder id
    /// starts with it).
    fn spawn(&mut self) {
        let name = format!("replica-{}", self.started);
        self.started += 1;
        let mut command = tokio::process::Command::new(common::binary());
        command
            .arg("run")
            .env("HOSTNAME", &name)
            .env("DLU_SERVER_NAME", common::OUR_SERVER)
            .env(
                "DLU_SIGNING_KEY_PATH",
                self.key_dir.path().join("signing.key"),
            )
            .env("DLU_DATABASE_URL", &self.db.url)
            .env("DLU_NATS_URL", self.cluster.urls())
            .env("DLU_HTTP_ADDR", "127.0.0.1:0")
            .env("DLU_INPUT_PARTITIONS", PARTITIONS.to_string())
            .env("DLU_STREAM_REPLICAS", "3")
            .env("DLU_LEASE_TTL", format!("{}s", LEASE_TTL.as_secs()))
            .env("DLU_ACK_WAIT", "3s")
            .env("DLU_BATCH_SIZE", "200")
            .env("RUST_LOG", "warn")
            .env_remove("DLU_FAULT")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        let child = command.spawn().expect("spawn a replica");
        self.replicas.push((name, child));
    }
}

/// The holder of each partition (`part.DEVICE_LIST_INPUT.<p>` leases), by
/// replica name (`replica-<n>`).
async fn holders(js: &jetstream::Context) -> BTreeMap<u16, String> {
    let Ok(leases) = js.get_key_value("device_list_updater_leases").await else {
        return BTreeMap::new();
    };
    let Ok(keys) = leases.keys().await else {
        return BTreeMap::new();
    };
    let keys: Vec<String> = keys.try_collect().await.unwrap_or_default();
    let mut held = BTreeMap::new();
    for key in keys {
        let Some(partition) = key
            .strip_prefix("part.DEVICE_LIST_INPUT.")
            .and_then(|p| p.parse::<u16>().ok())
        else {
            continue;
        };
        if let Ok(Some(holder)) = leases.get(&key).await {
            let holder = String::from_utf8_lossy(&holder).into_owned();
            let name = holder.rsplit_once('-').map_or(holder.as_str(), |(n, _)| n);
            held.insert(partition, name.to_owned());
        }
    }
    held
}

/// Waits until every partition is held by a live replica, each of them
/// holding two or three; returns the deal.
async fn wait_dealt(
    js: &jetstream::Context,
    deployment: &mut Deployment,
    within: Duration,
) -> BTreeMap<u16, String> {
    let live: Vec<String> = deployment.replicas.iter().map(|(n, _)| n.clone()).collect();
    let deadline = Instant::now() + within;
    loop {
        let held = holders(js).await;
        let mut per: BTreeMap<&str, usize> = live.iter().map(|n| (n.as_str(), 0)).collect();
        let mut by_live = 0;
        for name in held.values() {
            if let Some(n) = per.get_mut(name.as_str()) {
                *n += 1;
                by_live += 1;
            }
        }
        if by_live == PARTITIONS && per.values().all(|&n| (2..=3).contains(&n)) {
            return held;
        }
        if Instant::now() >= deadline {
            let ended: Vec<_> = deployment
                .replicas
                .iter_mut()
                .map(|(n, c)| (n.clone(), c.try_wait().ok().flatten()))
                .collect();
            panic!(
                "the partitions not dealt out among {live:?} within {within:?}: {held:?}; ended: {ended:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn users_at(conn: &sea_orm::DatabaseConnection, round: usize) -> u64 {
    entity::remote_device::Entity::find()
        .filter(entity::remote_device::Column::StreamId.gte(round as i64))
        .count(conn)
        .await
        .unwrap_or(0)
}

async fn burst_with(fault: Fault) {
    let cluster = NatsCluster::start(3).await;
    let db = TestDb::new(Backend::Postgres).await;
    let js = cluster.js().await;
    cluster.create_input_stream(&js).await;
    let users: Vec<String> = (0..USERS).map(user).collect();
    seed_users(&db.url, users.iter().cloned()).await;
    let key_dir = tempfile::tempdir().expect("dir");
    ServerKey::generate()
        .expect("key")
        .write_new(&key_dir.path().join("signing.key"))
        .expect("key file");
    let store = worker::open_store(&db.url, Duration::from_secs(10))
        .await
        .expect("store");
    let conn = store.connection();
    let mut deployment = Deployment {
        cluster,
        db,
        key_dir,
        replicas: Vec::new(),
        started: 0,
    };
    // All at once, as a deployment starts them: three replicas creating
    // the R3 streams of a fresh cluster together (which once took longer
    // than a JetStream request's timeout, ending a start with exit 2).
    for _ in 0..3 {
        deployment.spawn();
    }
    let names = |d: &Deployment| {
        d.replicas
            .iter()
            .map(|(n, _)| n.clone())
            .collect::<Vec<_>>()
    };
    wait_dealt(&js, &mut deployment, Duration::from_secs(60)).await;

    let half = ROUNDS / 2;
    for round in 1..=half {
        publish_round_of(&js, &users, round).await;
    }
    // The fault hits while the replicas are busy with the first half.
    wait_for(
        Duration::from_secs(120),
        "part of the burst applied",
        || async { (users_at(conn, 2).await >= (USERS / 2) as u64).then_some(()) },
    )
    .await;
    assert!(
        users_at(conn, half).await < USERS as u64,
        "the fault came after the first half was through"
    );
    let hit = Instant::now();
    match fault {
        Fault::KillReplica | Fault::StopReplica => {
            let (name, mut child) = deployment.replicas.remove(0);
            if fault == Fault::KillReplica {
                child.start_kill().expect("SIGKILL");
            } else {
                let pid = child.id().expect("pid");
                std::process::Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status()
                    .expect("kill -TERM");
            }
            let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
                .await
                .expect("the replica ends")
                .expect("exit status");
            if fault == Fault::StopReplica {
                assert!(status.success(), "a graceful stop exits 0: {status}");
            }
            // The others hold its partitions within the lease time (a stop
            // hands them over at once); they are three-then-four each.
            let survivors = names(&deployment);
            wait_for(
                LEASE_TTL + Duration::from_secs(3),
                "the partitions of the replica that went held elsewhere",
                || async {
                    let held = holders(&js).await;
                    (held.len() == PARTITIONS && held.values().all(|n| n != &name)).then_some(())
                },
            )
            .await;
            eprintln!(
                "{fault:?}: {name}'s partitions held by {survivors:?} {:.2} s after",
                hit.elapsed().as_secs_f64()
            );
            // One that starts takes its share within seconds, while the
            // first half is still being ingested.
            let started = Instant::now();
            deployment.spawn();
            wait_dealt(&js, &mut deployment, NEWCOMER_DEALT_WITHIN).await;
            eprintln!(
                "{fault:?}: the new replica holds its share {:.2} s after its start",
                started.elapsed().as_secs_f64()
            );
        }
        Fault::KillNatsNode => {
            let leader = deployment
                .cluster
                .leader_of(&js, "DEVICE_LIST_INPUT_PARTS")
                .await;
            deployment.cluster.nodes[leader].stop();
            wait_for(Duration::from_secs(60), "ingest going on", || async {
                (users_at(conn, half).await >= (USERS / 4) as u64).then_some(())
            })
            .await;
            deployment.cluster.nodes[leader].restart().await;
        }
    }
    for round in half + 1..=ROUNDS {
        publish_round_of(&js, &users, round).await;
    }
    wait_for(
        Duration::from_secs(180),
        "every user at its last update",
        || async { (users_at(conn, ROUNDS).await == USERS as u64).then_some(()) },
    )
    .await;
    // In order per user: an update applied before its predecessor would
    // have left its user stale.
    assert_eq!(
        store.stale_user_count().await.expect("count"),
        0,
        "no user went stale"
    );
    wait_for(
        Duration::from_secs(60),
        "every key change published",
        || async { (stream_len(&js, "KEY_CHANGE").await >= TOTAL as u64).then_some(()) },
    )
    .await;
    let mut seen = HashSet::new();
    let mut ids = HashSet::new();
    for (body, id) in read_key_changes(&js).await {
        let key = (
            body["user_id"].as_str().unwrap_or_default().to_owned(),
            body["stream_id"].as_i64().unwrap_or_default(),
        );
        assert!(seen.insert(key.clone()), "key change {key:?} twice");
        assert!(ids.insert(id.expect("Nats-Msg-Id")), "a Nats-Msg-Id twice");
    }
    assert_eq!(seen.len(), TOTAL, "one key change per update");
    // The replica started last has its share too.
    wait_dealt(&js, &mut deployment, Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_during_a_burst() {
    burst_with(Fault::KillReplica).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_stopped_during_a_burst() {
    burst_with(Fault::StopReplica).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_node_killed_during_a_burst() {
    burst_with(Fault::KillNatsNode).await;
}
