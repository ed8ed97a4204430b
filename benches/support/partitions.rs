//! The `partitions` phase: ingest with input partitions (SPEC §4.5), the
//! worker binary in `replicas` processes of their own on this machine,
//! against one nats-server and one PostgreSQL database.
//!
//! Each run: the replicas start with `DLU_INPUT_PARTITIONS=partitions` and
//! an empty input; once the input lease is held and (with partitions) the
//! partitions are dealt out (every one held, each replica holding
//! ⌊P/N⌋ or ⌈P/N⌉), the input consumer is paused (JetStream's consumer
//! pause), `n` chained realistic updates are published, and the consumer
//! is resumed: the clock runs from the resume until all `n` key changes
//! are in `KEY_CHANGE`. Starting, dealing and publishing are thus outside
//! the figure, and every configuration starts from the same state.
//!
//! With `routing_split`, the partition consumers are paused too, so the
//! routing replica only routes: its time and CPU until every update is in
//! the partitions stream are the routing hop's own; then the partition
//! consumers are resumed and the rest is timed as ingest from partitions.
//!
//! Per replica: CPU time over the run (`/proc/<pid>/stat`), peak RSS,
//! updates routed (`dlu_input_routed_total`), updates ingested
//! (`dlu_updates_total`) and partitions held (`dlu_input_partitions_held`).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use device_list_updater::testkit::{Nats, stream_len, wait_for};

use super::outside::{Worker, busy_since, fresh_ingest, key_file, machine_ticks, publish_updates};
use super::try_http_get;

/// The input stream and its consumer, as the worker names them.
const INPUT: &str = "DEVICE_LIST_INPUT";
const INPUT_CONSUMER: &str = "device-list-updater-input";
/// The partitions stream of the input (`bus::parts::stream_name`).
const PARTS: &str = "DEVICE_LIST_INPUT_PARTS";

/// What one replica did over a run.
pub struct ReplicaRun {
    /// CPU time (user + system) over the timed part.
    pub cpu: Duration,
    /// Peak resident set, in KiB.
    pub peak_rss_kib: u64,
    /// Input messages it routed to their partitions.
    pub routed: u64,
    /// Updates it ingested.
    pub ingested: u64,
    /// Partitions it held at the start.
    pub held: u64,
}

/// What one run measured.
pub struct Run {
    /// Resume → all key changes out.
    pub elapsed: Duration,
    /// With the routing split: (resume → all routed, the CPU of every
    /// replica over it).
    pub routing: Option<(Duration, Duration)>,
    /// The machine's busy share over the timed part.
    pub machine_busy: f64,
    /// One entry per replica.
    pub replicas: Vec<ReplicaRun>,
}

impl Run {
    /// CPU time of every replica over the timed part.
    pub fn total_cpu(&self) -> Duration {
        self.replicas.iter().map(|r| r.cpu).sum()
    }
}

/// One replica: its process and its metrics address.
struct Replica {
    worker: Worker,
    http: SocketAddr,
}

impl Replica {
    /// The sum of every series of metric `name`, if the replica answers.
    async fn metric(&self, name: &str) -> Option<u64> {
        let text = try_http_get(self.http, "/metrics").await?;
        let mut sum = 0.0;
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            if series.split('{').next() == Some(name) {
                sum += value.parse::<f64>().ok()?;
            }
        }
        Some(sum as u64)
    }
}

/// A port nothing listens on now (the replica binds it a moment later).
fn free_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("address")
}

/// Pauses (`true`) or resumes JetStream consumer `consumer` of `stream`.
async fn pause(js: &jetstream::Context, stream: &str, consumer: &str, paused: bool) {
    let body = if paused {
        serde_json::json!({ "pause_until": "2099-01-01T00:00:00Z" })
    } else {
        serde_json::json!({})
    };
    let reply: serde_json::Value = js
        .request(format!("CONSUMER.PAUSE.{stream}.{consumer}"), &body)
        .await
        .expect("consumer pause");
    assert_eq!(reply["paused"], paused, "{stream}/{consumer}: {reply}");
}

/// Whether the lease bucket holds `key` (a replica holds that lease).
async fn lease_held(js: &jetstream::Context, key: &str) -> bool {
    let Ok(leases) = js
        .get_key_value(device_list_updater::bus::lease::BUCKET)
        .await
    else {
        return false;
    };
    matches!(leases.get(key).await, Ok(Some(holder)) if !holder.is_empty())
}

/// Waits until the input lease is held and, with partitions, every
/// partition is held with each replica holding ⌊P/N⌋ or ⌈P/N⌉.
async fn wait_dealt(js: &jetstream::Context, replicas: &[Replica], partitions: u64) {
    let n = replicas.len() as u64;
    let (low, high) = (partitions / n, partitions.div_ceil(n));
    wait_for(Duration::from_secs(120), "the partitions dealt", || async {
        if !lease_held(js, &format!("input.{INPUT}")).await {
            return None;
        }
        if partitions == 1 {
            return Some(());
        }
        let mut total = 0;
        for replica in replicas {
            let held = replica.metric("dlu_input_partitions_held").await?;
            if held < low || held > high {
                return None;
            }
            total += held;
        }
        (total == partitions).then_some(())
    })
    .await;
}

/// One run (see the module docs).
pub async fn ingest(
    nats: &Nats,
    database_url: &str,
    n: usize,
    users: usize,
    partitions: u16,
    replica_count: usize,
    routing_split: bool,
) -> Run {
    let js = fresh_ingest(nats, database_url, users).await;
    let dir = tempfile::tempdir().expect("dir");
    let (_, key_path) = key_file(dir.path());
    let replicas: Vec<Replica> = (0..replica_count)
        .map(|r| {
            let http = free_addr();
            let extra = [
                ("HOSTNAME", format!("bench-replica-{r}")),
                ("DLU_HTTP_ADDR", http.to_string()),
                ("DLU_INPUT_PARTITIONS", partitions.to_string()),
            ];
            Replica {
                worker: Worker::start_with(nats, database_url, &key_path, "", &extra),
                http,
            }
        })
        .collect();
    wait_dealt(&js, &replicas, u64::from(partitions)).await;
    let mut held = Vec::new();
    for replica in &replicas {
        held.push(
            replica
                .metric("dlu_input_partitions_held")
                .await
                .unwrap_or(0),
        );
    }

    pause(&js, INPUT, INPUT_CONSUMER, true).await;
    publish_updates(&js, n, users).await;
    let split = routing_split && partitions > 1;
    let part_consumers: Vec<String> = (0..partitions)
        .map(|p| format!("device-list-updater-part-{p}"))
        .collect();
    if split {
        for consumer in &part_consumers {
            pause(&js, PARTS, consumer, true).await;
        }
    }
    let cpu_before: Vec<Duration> = replicas.iter().map(|r| r.worker.usage().1).collect();
    let ticks = machine_ticks();
    let started = Instant::now();
    pause(&js, INPUT, INPUT_CONSUMER, false).await;
    let routing = if split {
        wait_for(Duration::from_secs(600), "every update routed", || async {
            let mut routed = 0;
            for replica in &replicas {
                routed += replica.metric("dlu_input_routed_total").await?;
            }
            (routed >= n as u64).then_some(())
        })
        .await;
        let elapsed = started.elapsed();
        let cpu: Duration = replicas
            .iter()
            .zip(&cpu_before)
            .map(|(r, before)| r.worker.usage().1 - *before)
            .sum();
        for consumer in &part_consumers {
            pause(&js, PARTS, consumer, false).await;
        }
        Some((elapsed, cpu))
    } else {
        None
    };
    wait_for(Duration::from_secs(600), "all key changes", || async {
        (stream_len(&js, "KEY_CHANGE").await >= n as u64).then_some(())
    })
    .await;
    let elapsed = started.elapsed();
    let machine_busy = busy_since(ticks);
    let mut runs = Vec::new();
    for ((replica, before), held) in replicas.iter().zip(cpu_before).zip(held) {
        let (peak_rss_kib, cpu) = replica.worker.usage();
        runs.push(ReplicaRun {
            cpu: cpu - before,
            peak_rss_kib,
            routed: replica.metric("dlu_input_routed_total").await.unwrap_or(0),
            ingested: replica.metric("dlu_updates_total").await.unwrap_or(0),
            held,
        });
    }
    for replica in replicas {
        replica.worker.stop().await;
    }
    Run {
        elapsed,
        routing,
        machine_busy,
        replicas: runs,
    }
}
