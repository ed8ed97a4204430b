//! Prometheus metrics (SPEC §7), served at `/metrics` in the text format.
//! Every metric is described in `docs/metrics.md`.
//!
//! Counters and histograms are updated where things happen; the gauges that
//! describe shared state (stale users, outbox backlog, pending fetch jobs)
//! are read from the database and JetStream when scraped, so every replica
//! reports the same truth.

use std::sync::Arc;

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

/// Buckets for latencies from milliseconds to minutes (seconds).
const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// The worker's metrics. Cheap to clone.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

struct Inner {
    registry: Registry,
    /// Input messages by outcome.
    updates: IntCounterVec,
    /// Dead letters by reason.
    dead_letters: IntCounterVec,
    /// Fetches by outcome and server.
    fetches: IntCounterVec,
    /// Federation request latency by outcome.
    federation_seconds: HistogramVec,
    /// Fetch jobs running on this replica.
    fetches_in_flight: IntGauge,
    /// Key changes published to KEY_CHANGE.
    key_changes: IntCounter,
    /// Input publish → key change published, per batch (oldest update).
    update_to_key_change: HistogramVec,
    /// Connections refused by the outbound guard.
    outbound_refused: IntCounter,
    /// Waiting fetch jobs started early, by reason.
    wakeups: IntCounterVec,
    /// Membership and member-key messages by outcome.
    membership_changes: IntCounterVec,
    /// Users untracked because they share no room with us any more.
    users_untracked: IntCounter,
    /// Input partitions and routing.
    partitions: PartitionMetrics,
    /// Revalidations and divergences (SPEC §5.7.4).
    revalidations: RevalidationMetrics,
    /// Scrape-time gauges.
    gauges: Gauges,
}

/// The gauges set at scrape time from the shared state ([`SharedState`]).
struct Gauges {
    ready: IntGauge,
    tracked_users: IntGauge,
    stale_users: IntGauge,
    outbox_backlog: IntGauge,
    fetch_jobs_pending: IntGauge,
    users_backing_off: IntGauge,
    servers_backing_off: IntGauge,
    revalidations_queued: IntGauge,
}

impl Gauges {
    /// The gauges, registered in `r`.
    fn new(r: &Registry) -> Gauges {
        Gauges {
            ready: gauge(
                r,
                "dlu_ready",
                "1 while NATS and the database answer (as /readyz), else 0.",
            ),
            tracked_users: gauge(
                r,
                "dlu_tracked_users",
                "Remote users sharing a room with us (membership on; whole deployment).",
            ),
            stale_users: gauge(
                r,
                "dlu_stale_users",
                "Users marked stale (whole deployment).",
            ),
            outbox_backlog: gauge(
                r,
                "dlu_outbox_backlog",
                "Outbox rows (transactions) not yet published (whole deployment).",
            ),
            fetch_jobs_pending: gauge(
                r,
                "dlu_fetch_jobs_pending",
                "Fetch jobs queued or in back-off in DEVICE_LIST_FETCH.",
            ),
            users_backing_off: gauge(
                r,
                "dlu_users_backing_off",
                "Stale users in their own back-off after unusable answers (whole deployment).",
            ),
            servers_backing_off: gauge(
                r,
                "dlu_servers_backing_off",
                "Remote servers in back-off after their own failures (whole deployment).",
            ),
            revalidations_queued: gauge(
                r,
                "dlu_revalidations_queued",
                "Users picked for a revalidation and waiting for their server's fetch job (whole deployment).",
            ),
        }
    }
}

/// The input partitions a replica holds and what it routed (SPEC §4.5).
struct PartitionMetrics {
    /// Input partitions this replica holds.
    held: IntGauge,
    /// Input partitions taken and given up, by event.
    moves: IntCounterVec,
    /// Input messages routed to their partitions.
    routed: IntCounter,
}

impl PartitionMetrics {
    fn new(r: &Registry) -> PartitionMetrics {
        PartitionMetrics {
            held: gauge(
                r,
                "dlu_input_partitions_held",
                "Input partitions this replica ingests now (SPEC 4.5; 0 with DLU_INPUT_PARTITIONS=1).",
            ),
            moves: counter_vec(
                r,
                "dlu_input_partition_moves_total",
                "Input partitions this replica took, handed over (drained) or lost (lease expired).",
                &["event"],
            ),
            routed: counter(
                r,
                "dlu_input_routed_total",
                "Input messages this replica routed to their partitions (SPEC 4.5).",
            ),
        }
    }
}

/// Revalidations (SPEC §5.7.4): totals only, no label per server (the
/// number of servers has no bound; `admin servers` has the figures per
/// server).
struct RevalidationMetrics {
    /// Revalidations by outcome.
    outcomes: IntCounterVec,
    /// Revalidations that found a difference.
    divergences: IntCounter,
}

impl RevalidationMetrics {
    fn new(r: &Registry) -> RevalidationMetrics {
        RevalidationMetrics {
            outcomes: counter_vec(
                r,
                "dlu_revalidations_total",
                "Revalidations (SPEC 5.7), by outcome: unchanged, diverged, failed, untracked.",
                &["outcome"],
            ),
            divergences: counter(
                r,
                "dlu_revalidation_divergences_total",
                "Revalidations whose answer differed from the stored list: updates a remote server did not send.",
            ),
        }
    }
}

/// What happened to an input partition this replica holds or held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartitionMove {
    /// Its lease was taken.
    Taken,
    /// Given up after draining what was in hand (the deal moved it, or a stop).
    HandedOver,
    /// Its lease could not be renewed in time: another replica may hold it.
    Lost,
}

/// The shared state the scrape-time gauges show (None: not read this time,
/// the gauge keeps its last value).
#[derive(Clone, Copy, Debug, Default)]
pub struct SharedState {
    /// NATS and the database answer.
    pub ready: Option<bool>,
    /// Users sharing a room with us (membership on only).
    pub tracked_users: Option<u64>,
    /// Users marked stale.
    pub stale_users: Option<u64>,
    /// Outbox rows not yet published.
    pub outbox_backlog: Option<u64>,
    /// Jobs in `DEVICE_LIST_FETCH` (queued, running or waiting).
    pub fetch_jobs: Option<u64>,
    /// Stale users in their own back-off.
    pub users_backing_off: Option<u64>,
    /// Servers in back-off after their own failures.
    pub servers_backing_off: Option<u64>,
    /// Revalidations queued.
    pub revalidations_queued: Option<u64>,
}

fn counter_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let metric = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    registry
        .register(Box::new(metric.clone()))
        .expect("unique metric");
    metric
}

fn counter(registry: &Registry, name: &str, help: &str) -> IntCounter {
    let metric = IntCounter::new(name, help).expect("valid metric");
    registry
        .register(Box::new(metric.clone()))
        .expect("unique metric");
    metric
}

fn gauge(registry: &Registry, name: &str, help: &str) -> IntGauge {
    let metric = IntGauge::new(name, help).expect("valid metric");
    registry
        .register(Box::new(metric.clone()))
        .expect("unique metric");
    metric
}

fn histogram(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> HistogramVec {
    let metric = HistogramVec::new(
        HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()),
        labels,
    )
    .expect("valid metric");
    registry
        .register(Box::new(metric.clone()))
        .expect("unique metric");
    metric
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// A fresh set of metrics in its own registry.
    pub fn new() -> Metrics {
        let r = Registry::new();
        let inner = Inner {
            updates: counter_vec(
                &r,
                "dlu_updates_total",
                "Input messages applied, by outcome.",
                &["outcome"],
            ),
            dead_letters: counter_vec(
                &r,
                "dlu_dead_letters_total",
                "Input messages dead-lettered, by reason.",
                &["reason"],
            ),
            fetches: counter_vec(
                &r,
                "dlu_fetches_total",
                "Device-list fetches, by outcome and remote server.",
                &["outcome", "server"],
            ),
            federation_seconds: histogram(
                &r,
                "dlu_federation_request_seconds",
                "Federation request duration, by outcome.",
                &["outcome"],
            ),
            fetches_in_flight: gauge(
                &r,
                "dlu_fetches_in_flight",
                "Fetch jobs (remote servers) being worked on by this replica.",
            ),
            key_changes: counter(
                &r,
                "dlu_key_changes_published_total",
                "Key-change events published to KEY_CHANGE.",
            ),
            update_to_key_change: histogram(
                &r,
                "dlu_update_to_key_change_seconds",
                "From the oldest input message of a batch entering JetStream to its key changes being published.",
                &["source"],
            ),
            outbound_refused: counter(
                &r,
                "dlu_outbound_refused_total",
                "Connections the outbound guard refused (private, loopback, ... addresses).",
            ),
            membership_changes: counter_vec(
                &r,
                "dlu_membership_changes_total",
                "Membership and member-key messages, by outcome (membership on).",
                &["outcome"],
            ),
            users_untracked: counter(
                &r,
                "dlu_users_untracked_total",
                "Users untracked because they stopped sharing every room with us.",
            ),
            wakeups: counter_vec(
                &r,
                "dlu_fetch_wakeups_total",
                "Waiting fetch jobs started early, by reason.",
                &["reason"],
            ),
            partitions: PartitionMetrics::new(&r),
            revalidations: RevalidationMetrics::new(&r),
            gauges: Gauges::new(&r),
            registry: r,
        };
        Metrics {
            inner: Arc::new(inner),
        }
    }

    /// Counts applied input messages by outcome label.
    pub fn update(&self, outcome: &str) {
        self.inner.updates.with_label_values(&[outcome]).inc();
    }

    /// Counts a membership or member-key message by outcome.
    pub fn membership_change(&self, outcome: &str) {
        self.inner
            .membership_changes
            .with_label_values(&[outcome])
            .inc();
    }

    /// Counts untracked users.
    pub fn untracked(&self, users: usize) {
        self.inner.users_untracked.inc_by(users as u64);
    }

    /// Counts an input partition taken or given up, and keeps the number
    /// held.
    pub fn partition_moved(&self, event: PartitionMove) {
        let label = match event {
            PartitionMove::Taken => {
                self.inner.partitions.held.inc();
                "taken"
            }
            PartitionMove::HandedOver => {
                self.inner.partitions.held.dec();
                "handed_over"
            }
            PartitionMove::Lost => {
                self.inner.partitions.held.dec();
                "lost"
            }
        };
        self.inner
            .partitions
            .moves
            .with_label_values(&[label])
            .inc();
    }

    /// Counts input messages routed to their partitions.
    pub fn routed(&self, messages: usize) {
        self.inner.partitions.routed.inc_by(messages as u64);
    }

    /// Counts a dead letter.
    pub fn dead_letter(&self, reason: &str) {
        self.inner.dead_letters.with_label_values(&[reason]).inc();
    }

    /// Counts a fetch and records its request time.
    pub fn fetch(&self, server: &str, outcome: &str, seconds: f64) {
        self.inner
            .fetches
            .with_label_values(&[outcome, server])
            .inc();
        self.inner
            .federation_seconds
            .with_label_values(&[outcome])
            .observe(seconds);
    }

    /// Counts a revalidation by outcome (`diverged` also counts a divergence).
    pub fn revalidation(&self, outcome: &str) {
        let revalidations = &self.inner.revalidations;
        revalidations.outcomes.with_label_values(&[outcome]).inc();
        if outcome == "diverged" {
            revalidations.divergences.inc();
        }
    }

    /// Counts a waiting fetch job started early (`back_off_ended`, `user_due`).
    pub fn wakeup(&self, reason: &str) {
        self.inner.wakeups.with_label_values(&[reason]).inc();
    }

    /// A fetch job started (+1) or ended (−1) on this replica.
    pub fn fetches_in_flight(&self, delta: i64) {
        self.inner.fetches_in_flight.add(delta);
    }

    /// Counts published key changes and observes the latency of each of
    /// their causes (`seconds`: one per input message or fetched user).
    pub fn published(&self, events: usize, source: &str, seconds: impl IntoIterator<Item = f64>) {
        self.inner.key_changes.inc_by(events as u64);
        let histogram = self.inner.update_to_key_change.with_label_values(&[source]);
        for seconds in seconds {
            histogram.observe(seconds);
        }
    }

    /// Sets the guard's refusal count (kept by the federation client).
    pub fn set_outbound_refused(&self, total: u64) {
        let now = self.inner.outbound_refused.get();
        if total > now {
            self.inner.outbound_refused.inc_by(total - now);
        }
    }

    /// Sets the scrape-time gauges.
    pub fn set_state(&self, state: SharedState) {
        let set = |gauge: &IntGauge, value: Option<u64>| {
            if let Some(v) = value {
                gauge.set(i64::try_from(v).unwrap_or(i64::MAX));
            }
        };
        set(&self.inner.gauges.ready, state.ready.map(u64::from));
        set(&self.inner.gauges.tracked_users, state.tracked_users);
        set(&self.inner.gauges.stale_users, state.stale_users);
        set(&self.inner.gauges.outbox_backlog, state.outbox_backlog);
        set(&self.inner.gauges.fetch_jobs_pending, state.fetch_jobs);
        set(
            &self.inner.gauges.users_backing_off,
            state.users_backing_off,
        );
        set(
            &self.inner.gauges.servers_backing_off,
            state.servers_backing_off,
        );
        set(
            &self.inner.gauges.revalidations_queued,
            state.revalidations_queued,
        );
    }

    /// The name of every metric family the worker exports, each family with
    /// labels given a child first (a family without one is not exported).
    /// For the tests that check the docs, the dashboard and the alert rules.
    #[cfg(any(test, feature = "testkit"))]
    pub fn family_names() -> Vec<String> {
        let metrics = Metrics::new();
        metrics.update("applied");
        metrics.membership_change("applied");
        metrics.dead_letter("not_json");
        metrics.fetch("example.org", "stored", 0.1);
        metrics.published(1, "update", [0.1]);
        metrics.revalidation("diverged");
        metrics.wakeup("user_due");
        metrics.partition_moved(PartitionMove::Taken);
        let mut names: Vec<String> = metrics
            .inner
            .registry
            .gather()
            .iter()
            .map(|family| family.name().to_owned())
            .collect();
        names.sort();
        names
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.inner.registry.gather(), &mut out) {
            tracing::warn!(error = %e, "cannot encode metrics");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/metrics.md names every metric the worker exports.
    #[test]
    fn every_metric_is_documented() {
        let doc = include_str!("../docs/metrics.md");
        let names = Metrics::family_names();
        assert!(names.len() >= 24, "{} families", names.len());
        for name in names {
            assert!(
                doc.contains(&format!("`{name}`")),
                "{name} is not in docs/metrics.md"
            );
        }
    }
}
