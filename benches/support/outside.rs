//! The `outside` phase: the worker as a homeserver runs it, the release
//! binary in its own process with default settings, timed through the
//! public contract only (JetStream, `devicelist.rpc.query`). Because the
//! worker is alone in its process, its peak RSS (`VmHWM`) and CPU time
//! (`/proc/<pid>/stat`) are its own, not the benchmark's.
//!
//! - Ingest: `users` users (known, as after a fetch) × 2 devices, `n`
//!   chained updates with realistic keys published round by round while
//!   the worker is stopped; worker start → all `n` key changes in
//!   `KEY_CHANGE`.
//! - Fan-out: `servers` servers × `per_server` users, each named by one
//!   update whose `prev_id` the worker does not know (so the user is stale,
//!   SPEC §5.1.6), published while the worker is stopped; a mock fleet in
//!   this process answers each `/user/devices` after `latency`, checking
//!   X-Matrix; worker start → every user `stale: false` with its two
//!   devices by `devicelist.rpc.query`.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use device_list_updater::server_key::ServerKey;
use device_list_updater::testkit::{Nats, create_input_stream, stream_len, wait_for};

use super::{fresh_streams, publish_all, realistic_update, seed_users};

/// What one outside run measured.
pub struct Run {
    /// Worker start → done.
    pub elapsed: Duration,
    /// The worker process's peak resident set (`VmHWM`), in KiB.
    pub peak_rss_kib: u64,
    /// The worker process's CPU time (user + system) over the run.
    pub cpu: Duration,
    /// The share of the machine's CPU time that was busy over the run
    /// (every process: the worker, PostgreSQL, nats-server, this bench).
    pub machine_busy: f64,
}

/// The machine's CPU time so far, from `/proc/stat`: (busy, total) ticks.
pub(super) fn machine_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").expect("/proc/stat");
    let line = stat.lines().next().unwrap_or_default();
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        // user … steal; guest time is already counted in user.
        .take(8)
        .filter_map(|f| f.parse().ok())
        .collect();
    let total: u64 = fields.iter().sum();
    // idle and iowait are the 4th and 5th fields.
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// Busy share between two [`machine_ticks`] readings.
pub(super) fn busy_since(before: (u64, u64)) -> f64 {
    let after = machine_ticks();
    let total = after.1.saturating_sub(before.1).max(1);
    after.0.saturating_sub(before.0) as f64 / total as f64
}

/// The worker binary, started with the settings a homeserver would give
/// (defaults for everything else); killed if dropped.
pub(super) struct Worker {
    child: tokio::process::Child,
    pid: u32,
}

impl Worker {
    fn start(nats: &Nats, database_url: &str, key_path: &Path, overrides: &str) -> Worker {
        Worker::start_with(nats, database_url, key_path, overrides, &[])
    }

    /// [`Worker::start`] with more environment variables (`extra` wins).
    pub(super) fn start_with(
        nats: &Nats,
        database_url: &str,
        key_path: &Path,
        overrides: &str,
        extra: &[(&str, String)],
    ) -> Worker {
        let binary = env!("CARGO_BIN_EXE_device-list-updater");
        // `BENCH_WORKER_WRAPPER` (e.g. `heaptrack -o /tmp/worker`) runs the
        // worker under a profiler; its RSS and CPU figures are then the
        // wrapper's, not the worker's.
        let mut command = match std::env::var("BENCH_WORKER_WRAPPER") {
            Ok(wrapper) if !wrapper.trim().is_empty() => {
                let mut words = wrapper.split_whitespace();
                let mut command = tokio::process::Command::new(words.next().unwrap_or_default());
                command.args(words).arg(binary);
                command
            }
            _ => tokio::process::Command::new(binary),
        };
        command
            .arg("run")
            .env("DLU_SERVER_NAME", "our.example")
            .env("DLU_SIGNING_KEY_PATH", key_path)
            .env("DLU_DATABASE_URL", database_url)
            .env("DLU_NATS_URL", &nats.url)
            .env("DLU_HTTP_ADDR", "127.0.0.1:0")
            .env("DLU_FEDERATION_OVERRIDES", overrides)
            .env("RUST_LOG", "warn")
            .envs(extra.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            // Its own process group: a stop reaches a wrapped worker too.
            .process_group(0)
            .kill_on_drop(true);
        let child = command.spawn().expect("worker binary");
        let pid = child.id().expect("pid");
        Worker { child, pid }
    }

    /// The resident set now (`VmRSS`), in KiB.
    pub(super) fn rss_kib(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.pid))
            .ok()
            .and_then(|status| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            })
            .unwrap_or(0)
    }

    /// Peak RSS and CPU time so far, from `/proc`.
    pub(super) fn usage(&self) -> (u64, Duration) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).expect("status");
        let peak = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmHWM");
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).expect("stat");
        // Fields after the command name (which may hold spaces): utime and
        // stime are the 12th and 13th, in clock ticks.
        let after = stat.rsplit_once(')').expect("stat").1;
        let fields: Vec<u64> = after
            .split_whitespace()
            .skip(11)
            .take(2)
            .map(|f| f.parse().expect("ticks"))
            .collect();
        let ticks = fields.iter().sum::<u64>();
        (peak, Duration::from_secs_f64(ticks as f64 / clock_ticks()))
    }

    /// The run's figures, the worker having been started at `started` with
    /// the machine at `ticks`; then stops it.
    async fn finish(self, started: Instant, ticks: (u64, u64)) -> Run {
        let elapsed = started.elapsed();
        let machine_busy = busy_since(ticks);
        let (peak_rss_kib, cpu) = self.usage();
        self.stop().await;
        Run {
            elapsed,
            peak_rss_kib,
            cpu,
            machine_busy,
        }
    }

    pub(super) async fn stop(mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", "--", &format!("-{}", self.pid)])
            .status();
        let _ = tokio::time::timeout(Duration::from_secs(20), self.child.wait()).await;
    }
}

/// Clock ticks per second (`getconf CLK_TCK`; 100 on Linux).
fn clock_ticks() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// A new signing key file in `dir`.
pub(super) fn key_file(dir: &Path) -> (ServerKey, std::path::PathBuf) {
    let key = ServerKey::generate().expect("key");
    let path = dir.join("signing.key");
    key.write_new(&path).expect("key file");
    (key, path)
}

fn user_name(u: usize) -> String {
    format!("@user{u}:server{}.example", u % 500)
}

/// The ingest workloads' starting state: the worker's streams gone, `users`
/// users known up to stream id 0, an empty input stream.
pub(super) async fn fresh_ingest(
    nats: &Nats,
    database_url: &str,
    users: usize,
) -> async_nats::jetstream::Context {
    let js = nats.js().await;
    fresh_streams(&js).await;
    let store = device_list_updater::worker::open_store(database_url, Duration::from_secs(10))
        .await
        .expect("db");
    seed_users(store.connection(), users, user_name).await;
    create_input_stream(&js).await;
    js
}

/// Publishes `n` chained realistic updates over `users` users, round by
/// round.
pub(super) async fn publish_updates(js: &async_nats::jetstream::Context, n: usize, users: usize) {
    publish_all(
        js,
        "devicelist.in.update",
        (0..n).map(|i| realistic_update(&user_name(i % users), 1 + i / users)),
    )
    .await;
}

/// The outside ingest workload (see the module docs).
pub async fn ingest(nats: &Nats, database_url: &str, n: usize, users: usize) -> Run {
    let js = fresh_ingest(nats, database_url, users).await;
    publish_updates(&js, n, users).await;
    let dir = tempfile::tempdir().expect("dir");
    let (_, key_path) = key_file(dir.path());
    let ticks = machine_ticks();
    let started = Instant::now();
    let worker = Worker::start(nats, database_url, &key_path, "");
    wait_for(Duration::from_secs(600), "all key changes", || async {
        (stream_len(&js, "KEY_CHANGE").await >= n as u64).then_some(())
    })
    .await;
    worker.finish(started, ticks).await
}

/// The outside fan-out workload (see the module docs).
pub async fn fanout(
    nats: &Nats,
    database_url: &str,
    servers: usize,
    per_server: usize,
    latency: Duration,
) -> Run {
    let js = nats.js().await;
    fresh_streams(&js).await;
    let dir = tempfile::tempdir().expect("dir");
    let (key, key_path) = key_file(dir.path());
    let super::fleet::Fleet {
        mock: fleet,
        servers: names,
        users,
    } = super::fleet::two_device_fleet(&key, servers, per_server, latency).await;
    let overrides = names
        .iter()
        .map(|s| format!("{s}={}", fleet.base_url()))
        .collect::<Vec<_>>()
        .join(",");
    create_input_stream(&js).await;
    // An update after one the worker never saw: the user is stale.
    publish_all(
        &js,
        "devicelist.in.update",
        users.iter().map(|u| realistic_update(u, 2)),
    )
    .await;
    let client = async_nats::connect(&nats.url).await.expect("nats");
    let ticks = machine_ticks();
    let started = Instant::now();
    let worker = Worker::start(nats, database_url, &key_path, &overrides);
    wait_for(Duration::from_secs(600), "every user asked for", || async {
        (fleet.total_requests() >= users.len()).then_some(())
    })
    .await;
    let mut waiting: Vec<&str> = users.iter().map(String::as_str).collect();
    while !waiting.is_empty() {
        let mut still = Vec::new();
        for chunk in waiting.chunks(1000) {
            still.extend(not_fresh(&client, chunk).await);
        }
        waiting = still;
        if !waiting.is_empty() {
            assert!(started.elapsed() < Duration::from_secs(600), "never fresh");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let run = worker.finish(started, ticks).await;
    assert_eq!(fleet.bad_signatures(), 0);
    run
}

/// Those of `users` that `devicelist.rpc.query` does not report fresh with
/// their two devices.
async fn not_fresh<'a>(client: &async_nats::Client, users: &[&'a str]) -> Vec<&'a str> {
    let request = serde_json::json!({ "user_ids": users }).to_string();
    let Ok(reply) = client.request("devicelist.rpc.query", request.into()).await else {
        return users.to_vec();
    };
    let reply: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap_or_default();
    users
        .iter()
        .copied()
        .filter(|u| {
            let user = &reply["users"][*u];
            user["stale"] != false
                || user["devices"].as_object().map_or(0, serde_json::Map::len) != 2
        })
        .collect()
}
