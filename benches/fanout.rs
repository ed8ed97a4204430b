//! Fan-out benchmark (`cargo bench --bench fanout`): how fast stale users on
//! many remote servers become fresh.
//!
//! 10,000 users on 2,000 servers (5 each) are marked stale through
//! `devicelist.in.resync`; an in-process mock fleet answers every signed
//! request after 100 ms. The clock runs from the first resync published to
//! the moment no user is stale. Target: at most 5 s (SPEC §5.2 fan-out).
//!
//! Settings: `BENCH_SERVERS` (2000), `BENCH_USERS_PER_SERVER` (5),
//! `BENCH_LATENCY_MS` (100), `BENCH_CONCURRENCY` (the config default),
//! `DLU_BENCH_PG_URL`, `NATS_SERVER_BIN`.

use std::time::{Duration, Instant};

#[path = "support/fleet.rs"]
mod fleet;

use device_list_updater::config::Config;
use device_list_updater::server_key::ServerKey;
use device_list_updater::testkit::remote::overrides_for;
use device_list_updater::testkit::{
    Nats, create_postgres_database, drop_postgres_database, wait_for,
};
use device_list_updater::worker;
use sea_orm::{EntityTrait, PaginatorTrait};

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Outcome {
    elapsed: Duration,
    requests: usize,
    max_in_flight: usize,
}

async fn fanout(
    database_url: &str,
    servers: usize,
    per_server: usize,
    latency: Duration,
) -> Outcome {
    let nats = Nats::start().await;
    let key = ServerKey::generate().expect("key");
    let fleet::Fleet {
        mock: fleet,
        servers: names,
        users,
    } = fleet::two_device_fleet(&key, servers, per_server, latency).await;
    let mut config = Config::for_tests("our.example", &nats.url, database_url);
    config.server_key = key;
    config.settings.federation_overrides = overrides_for(&fleet, names.iter().map(String::as_str));
    // Production settings: the benchmark measures the defaults.
    let defaults = device_list_updater::config::Settings::default();
    config.settings.federation_timeout = defaults.federation_timeout;
    config.settings.retry_min = defaults.retry_min;
    config.settings.retry_max = defaults.retry_max;
    config.settings.lease_ttl = defaults.lease_ttl;
    config.settings.ack_wait = defaults.ack_wait;
    config.settings.fetch_concurrency = match std::env::var("BENCH_CONCURRENCY") {
        Ok(v) => v.parse().expect("BENCH_CONCURRENCY"),
        Err(_) => defaults.fetch_concurrency,
    };
    let running = worker::start(config).await.expect("worker");
    let js = nats.js().await;
    let started = Instant::now();
    // async-nats allows a limited number of unanswered publish acks: await
    // them in chunks.
    for chunk in users.chunks(1000) {
        let mut acks = Vec::with_capacity(chunk.len());
        for user in chunk {
            let body = serde_json::json!({"user_id": user}).to_string();
            acks.push(
                js.publish("devicelist.in.resync", body.into())
                    .await
                    .expect("publish"),
            );
        }
        for ack in acks {
            ack.await.expect("publish ack");
        }
    }
    let db = running.store.connection().clone();
    wait_for(Duration::from_secs(600), "every user fresh", || async {
        let stale = entity::stale_user::Entity::find().count(&db).await.ok()?;
        (fleet.total_requests() >= users.len() && stale == 0).then_some(())
    })
    .await;
    let elapsed = started.elapsed();
    let outcome = Outcome {
        elapsed,
        requests: fleet.total_requests(),
        max_in_flight: fleet.max_in_flight_any(),
    };
    assert_eq!(fleet.bad_signatures(), 0);
    running.stop(Duration::from_secs(10)).await;
    outcome
}

fn main() {
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let servers = env_usize("BENCH_SERVERS", 2000);
    let per_server = env_usize("BENCH_USERS_PER_SERVER", 5);
    let latency = Duration::from_millis(env_usize("BENCH_LATENCY_MS", 100) as u64);
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let admin = std::env::var("DLU_BENCH_PG_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let (pg_url, pg_name) = create_postgres_database(&admin, "dlu_bench").await;
        let pg = fanout(&pg_url, servers, per_server, latency).await;
        drop_postgres_database(&admin, &pg_name).await;
        let dir = tempfile::tempdir().expect("dir");
        let sqlite_url = format!("sqlite://{}?mode=rwc", dir.path().join("bench.sqlite").display());
        let sqlite = fanout(&sqlite_url, servers, per_server, latency).await;
        let users = servers * per_server;
        println!("| fan-out ({users} stale users, {servers} servers, {} ms each) | requests | most in flight per server | time |", latency.as_millis());
        println!("|---|---|---|---|");
        for (name, o) in [("PostgreSQL", pg), ("SQLite", sqlite)] {
            println!("| {name} | {} | {} | {:.2}s |", o.requests, o.max_in_flight, o.elapsed.as_secs_f64());
        }
    });
}
