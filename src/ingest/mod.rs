//! Ingest: the batch loop. Pull a batch → check each message (dead letters
//! out) → plan and write it in one transaction → enqueue fetch jobs → wake
//! the outbox publisher → ack. Acks come last, so a crash at any point means
//! redelivery, and redelivered updates are no-ops (SPEC §5.1.4).
//!
//! One file per step:
//! * this file: the loop, held while this replica holds the input lease;
//! * [`pull`]: pull requests, and telling a lost pull from a complete one;
//! * [`pipeline`]: gathering batches and keeping two in flight in order;
//! * [`batch`]: one batch from its messages to its acks;
//! * [`check`]: checking one message;
//! * [`apply`]: writing a batch (whole, or one by one when refused);
//! * [`dead_letters`]: every message that goes to the dead-letter stream.

mod apply;
mod batch;
mod check;
mod dead_letters;
mod pipeline;
mod pull;

use std::time::Duration;

use async_nats::jetstream::Context;
use async_nats::jetstream::consumer::PullConsumer;
use ruma::OwnedServerName;

use crate::bus::lease::Lease;
use crate::bus::publisher::OutboxHandle;
use crate::faults::Faults;
use crate::input::{InputSubjects, Tracking};
use crate::shutdown::Shutdown;
use crate::store::Store;
use pipeline::Pipeline;
use pull::PullEnd;

/// The ingest loop of one input stream.
#[derive(Clone)]
pub struct Ingest {
    /// JetStream.
    pub js: Context,
    /// The database.
    pub store: Store,
    /// Our server: its users are ignored.
    pub own_server: OwnedServerName,
    /// Which subject carries which input.
    pub subjects: InputSubjects,
    /// Messages per batch.
    pub batch_size: usize,
    /// Deliveries before a message is dead-lettered.
    pub max_deliver: i64,
    /// Takes committed events to the outbox publisher.
    pub outbox: OutboxHandle,
    /// Fault injection for crash tests.
    pub faults: Faults,
    /// The lease bucket: one replica consumes a stream at a time.
    pub leases: async_nats::jetstream::kv::Store,
    /// Lease length.
    pub lease_ttl: Duration,
    /// The input consumer's ack wait.
    pub ack_wait: Duration,
    /// Counters and histograms.
    pub metrics: crate::metrics::Metrics,
    /// Where servers with users newly stale or newly tracked go (SPEC
    /// §5.2), and input from a server may end its job's back-off.
    pub queue: crate::fetch::queue::FetchQueue,
    /// Who is tracked: whether room input (and member keys) is read.
    pub tracking: Tracking,
    /// Told when a batch leaves a room to sweep.
    pub sweeps: std::sync::Arc<tokio::sync::Notify>,
    /// Told after each batch whether ingest is behind (see `behind`), so
    /// the fan-out gives way meanwhile.
    pub backlog: crate::fetch::give_way::IngestBacklog,
}

impl Ingest {
    /// Consumes `consumer` while this replica holds the stream's lease, until
    /// `shutdown` turns true.
    pub async fn run(self, stream_name: String, consumer: PullConsumer, shutdown: Shutdown) {
        let key = format!("input.{stream_name}");
        let holder = uuid::Uuid::new_v4().to_string();
        while !shutdown.is_requested() {
            let Some(lease) = Lease::try_acquire(&self.leases, &key, &holder, self.lease_ttl).await
            else {
                // Another replica consumes the input: this one's fan-out has
                // no ingest to give way to.
                self.backlog.note_idle();
                tokio::select! {
                    () = tokio::time::sleep(self.lease_ttl / 4) => {}
                    () = shutdown.requested() => {}
                }
                continue;
            };
            tracing::info!(stream = %stream_name, "this replica now consumes the input stream");
            // Whether ingest is behind, from the last batch or count seen
            // until the next: the fan-out gives way meanwhile.
            let mut behind = None;
            self.wait_for_in_flight(&consumer, &shutdown, &mut behind)
                .await;
            let mut pipeline = Pipeline::default();
            while !shutdown.is_requested() && !lease.is_lost() {
                let end = self
                    .pull_once(&consumer, &shutdown, &mut pipeline, &mut behind)
                    .await;
                if end == PullEnd::Lost {
                    // What the lost pull sent and we never read comes back
                    // only after the ack wait; newer messages must not
                    // overtake it (per-user order), as after a takeover.
                    pipeline.finish().await;
                    self.wait_for_in_flight(&consumer, &shutdown, &mut behind)
                        .await;
                }
            }
            drop(behind);
            pipeline.finish().await;
            lease.release().await;
        }
    }
}
