//! The `revalidation` phase (SPEC §5.7): what revalidation costs a running
//! worker. `servers` × `per_server` tracked users (100,000 on 1,000 servers
//! by default), each stored with the two devices the mock fleet answers
//! with (so a revalidation finds nothing new, the usual case), all due; the
//! worker binary runs once with revalidation off and once with
//! `DLU_REVALIDATE_AFTER` set to users / `rate` seconds (200 per second by
//! default). In each run, after a warm-up, ordinary updates of 1,000 other
//! users flow at `update_rate` a second for `seconds`: measured are the
//! worker's CPU and resident memory over that window, the revalidations the
//! fleet answered, and the updates' publish → key change latency.

use std::time::{Duration, Instant};

use device_list_updater::testkit::remote::device_keys;
use device_list_updater::testkit::{Nats, create_input_stream, wait_for};
use sea_orm::{ActiveValue::Set, ConnectionTrait, EntityTrait};

use super::outside::{Worker, busy_since, key_file, machine_ticks};
use super::{Latencies, fresh_streams, key_changes_seen, latencies_once_seen, realistic_update};

/// The settings of the phase.
pub struct Settings {
    /// Remote servers revalidated.
    pub servers: usize,
    /// Tracked users per server.
    pub per_server: usize,
    /// Revalidations per second asked for.
    pub rate: usize,
    /// The mock fleet's answer time.
    pub latency: Duration,
    /// Ordinary updates per second during the window.
    pub update_rate: usize,
    /// The measured window.
    pub seconds: usize,
}

/// What one run measured.
pub struct Run {
    /// Revalidation on.
    pub on: bool,
    /// Requests the fleet answered per second over the window.
    pub revalidations_per_second: f64,
    /// The worker's CPU over the window, in cores.
    pub cpu_cores: f64,
    /// The worker's largest resident set seen in the window, in KiB.
    pub rss_kib: u64,
    /// The worker's peak resident set since its start (`VmHWM`), in KiB.
    pub peak_rss_kib: u64,
    /// The machine's busy share over the window.
    pub machine_busy: f64,
    /// Ordinary updates: publish → key change.
    pub latency: Latencies,
}

/// Users whose updates are measured (not revalidated in the window: their
/// lists were just fetched).
const UPDATED: usize = 1_000;

fn updated_user(u: usize) -> String {
    format!("@member{u}:other{}.example", u % 100)
}

/// Both runs, revalidation off then on, on one database.
pub async fn phase(nats: &Nats, database_url: &str, settings: &Settings) -> Vec<Run> {
    let js = nats.js().await;
    fresh_streams(&js).await;
    let dir = tempfile::tempdir().expect("dir");
    let (key, key_path) = key_file(dir.path());
    let fleet = super::fleet::two_device_fleet(
        &key,
        settings.servers,
        settings.per_server,
        settings.latency,
    )
    .await;
    let overrides = fleet
        .servers
        .iter()
        .map(|s| format!("{s}={}", fleet.mock.base_url()))
        .collect::<Vec<_>>()
        .join(",");
    let store = device_list_updater::worker::open_store(database_url, Duration::from_secs(10))
        .await
        .expect("db");
    seed(store.connection(), &fleet.users).await;
    create_input_stream(&js).await;
    let users = fleet.users.len();
    let period = format!("{}s", users / settings.rate.max(1));
    let mut runs = Vec::new();
    // Each updated user's last stream id: updates chain on it, run after run.
    let mut rounds = vec![0; UPDATED];
    for on in [false, true] {
        let after = if on { period.clone() } else { "0s".into() };
        let worker = Worker::start_with(
            nats,
            database_url,
            &key_path,
            &overrides,
            &[("DLU_REVALIDATE_AFTER", after)],
        );
        let received = key_changes_seen(nats).await;
        // Warm-up: the worker consumes, and revalidation has started.
        rounds[0] += 1;
        let first = (updated_user(0), rounds[0] as i64);
        js.publish(
            "devicelist.in.update",
            realistic_update(&first.0, rounds[0]).into(),
        )
        .await
        .expect("publish")
        .await
        .expect("ack");
        wait_for(Duration::from_secs(60), "the worker consuming", || {
            let received = received.clone();
            let first = first.clone();
            async move { received.lock().ok()?.contains_key(&first).then_some(()) }
        })
        .await;
        if on {
            let asked = fleet.mock.total_requests();
            wait_for(Duration::from_secs(60), "revalidations running", || async {
                (fleet.mock.total_requests() >= asked + 5 * settings.rate).then_some(())
            })
            .await;
        }
        let requests = fleet.mock.total_requests();
        let (_, cpu_before) = worker.usage();
        let ticks = machine_ticks();
        let started = Instant::now();
        let (sent, rss_kib) = steady(
            &js,
            &worker,
            settings.update_rate,
            settings.seconds,
            &mut rounds,
        )
        .await;
        let window = started.elapsed();
        let machine_busy = busy_since(ticks);
        let (peak_rss_kib, cpu_after) = worker.usage();
        let answered = fleet.mock.total_requests() - requests;
        let latency =
            Latencies::of(latencies_once_seen(&received, &sent, Duration::from_secs(120)).await);
        worker.stop().await;
        runs.push(Run {
            on,
            revalidations_per_second: answered as f64 / window.as_secs_f64(),
            cpu_cores: (cpu_after - cpu_before).as_secs_f64() / window.as_secs_f64(),
            rss_kib,
            peak_rss_kib,
            machine_busy,
            latency,
        });
    }
    assert_eq!(fleet.mock.bad_signatures(), 0);
    runs
}

/// Publishes `rate` updates a second for `seconds`, round-robin over the
/// updated users, each chained on the user's last (`rounds`), sampling the
/// worker's resident set every second; returns what was sent and the
/// largest resident set seen.
async fn steady(
    js: &async_nats::jetstream::Context,
    worker: &Worker,
    rate: usize,
    seconds: usize,
    rounds: &mut [usize],
) -> (Vec<((String, i64), Instant)>, u64) {
    let every = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let total = rate * seconds;
    let mut sent = Vec::with_capacity(total);
    let mut rss = 0;
    let mut sampled = Instant::now();
    for k in 0..total {
        tick.tick().await;
        let u = k % rounds.len();
        rounds[u] += 1;
        let (user, update_round) = (updated_user(u), rounds[u]);
        let at = Instant::now();
        js.publish(
            "devicelist.in.update",
            realistic_update(&user, update_round).into(),
        )
        .await
        .expect("publish")
        .await
        .expect("publish ack");
        sent.push(((user, update_round as i64), at));
        if sampled.elapsed() >= Duration::from_secs(1) {
            rss = rss.max(worker.rss_kib());
            sampled = Instant::now();
        }
    }
    (sent, rss.max(worker.rss_kib()))
}

/// Stores every revalidated user with the two devices the fleet answers
/// with, never fetched (all due), and the updated users known up to stream
/// id 0 and just fetched (not due in the measured window).
async fn seed(db: &sea_orm::DatabaseConnection, users: &[String]) {
    let user_row = |user: &str, fetched_at_ms: i64| entity::remote_user::ActiveModel {
        user_id: Set(user.to_owned()),
        server_name: Set(user
            .split_once(':')
            .map(|(_, s)| s)
            .unwrap_or_default()
            .into()),
        known_stream_ids: Set("[1]".into()),
        max_stream_id: Set(1),
        fetched_stream_id: Set(1),
        fetched_at_ms: Set(fetched_at_ms),
    };
    for chunk in users.chunks(1_000) {
        entity::remote_user::Entity::insert_many(chunk.iter().map(|u| user_row(u, 0)))
            .exec_without_returning(db)
            .await
            .expect("seed users");
        let devices = chunk.iter().flat_map(|user| {
            [("D1", "Phone"), ("D2", "Laptop")].map(|(device, name)| {
                entity::remote_device::ActiveModel {
                    user_id: Set(user.clone()),
                    device_id: Set(device.into()),
                    display_name: Set(Some(name.into())),
                    keys_json: Set(Some(device_keys(user, device).to_string())),
                    stream_id: Set(1),
                    deleted: Set(false),
                }
            })
        });
        entity::remote_device::Entity::insert_many(devices)
            .exec_without_returning(db)
            .await
            .expect("seed devices");
    }
    let now = device_list_updater::store::now_ms();
    let updated: Vec<String> = (0..UPDATED).map(updated_user).collect();
    entity::remote_user::Entity::insert_many(updated.iter().map(|u| {
        let mut row = user_row(u, now);
        row.known_stream_ids = Set("[0]".into());
        row.max_stream_id = Set(0);
        row.fetched_stream_id = Set(0);
        row
    }))
    .exec_without_returning(db)
    .await
    .expect("seed updated users");
    db.execute_unprepared("ANALYZE").await.expect("analyze");
}
