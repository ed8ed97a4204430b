//! Ingest: the batch loop. Pull a batch → check each message (dead letters
//! out) → plan and write it in one transaction → enqueue fetch jobs → wake
//! the outbox publisher → ack. Acks come last, so a crash at any point means
//! redelivery, and redelivered updates are no-ops (SPEC §5.1.4).
//!
//! One file per step:
//! * this file: the loop, held while this replica holds the lease of what it
//!   consumes (an input stream, or one partition of it: SPEC §4.5);
//! * [`route`]: with input partitions, sending each input message to its
//!   partition instead of applying it, and agreeing on the partition count;
//! * [`partitions`]: the partitions this replica ingests, dealt out among
//!   the live replicas;
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
mod partitions;
mod pipeline;
mod pull;
mod route;

use std::time::Duration;

use async_nats::jetstream::Context;
use async_nats::jetstream::consumer::PullConsumer;
use ruma::OwnedServerName;

use crate::bus::lease::Lease;
use crate::bus::publisher::OutboxHandle;
use crate::faults::Faults;
use crate::input::{InputSubjects, Tracking};
use crate::metrics::PartitionMove;
use crate::shutdown::Shutdown;
use crate::store::Store;
pub use partitions::{PartitionDealer, Presence};
use pipeline::Pipeline;
use pull::{PullEnd, Sink};

/// What an ingest loop consumes (SPEC §4.5).
#[derive(Clone)]
pub enum Feed {
    /// A homeserver input stream, applied here (`partitions` 1) or routed
    /// to its partitions.
    Input {
        /// The stream.
        stream: String,
        /// `DLU_INPUT_PARTITIONS`.
        partitions: u16,
        /// The partition-count bucket, once any replica has used partitions.
        counts: Option<Box<async_nats::jetstream::kv::Store>>,
    },
    /// One partition of an input stream.
    Partition {
        /// The input stream.
        stream: String,
        /// The partition.
        partition: u16,
    },
}

impl Feed {
    /// Whether this is one partition of an input stream.
    pub fn is_partition(&self) -> bool {
        matches!(self, Feed::Partition { .. })
    }

    /// The lease key: one holder at a time.
    fn lease_key(&self) -> String {
        match self {
            Feed::Input { stream, .. } => format!("input.{stream}"),
            Feed::Partition { stream, partition } => format!("part.{stream}.{partition}"),
        }
    }
}

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
    /// What this loop consumes.
    pub feed: Feed,
    /// This replica's id: the holder named in its leases.
    pub replica: String,
}

impl Ingest {
    /// Consumes `consumer` while this replica holds the feed's lease, until
    /// `stop` turns true; then drains what is in hand and lets the lease go.
    pub async fn run(self, consumer: PullConsumer, stop: Shutdown) {
        let key = self.feed.lease_key();
        let poll = match self.feed {
            Feed::Input { .. } => self.lease_ttl / 4,
            // A partition handed over is taken at once by its new holder.
            Feed::Partition { .. } => (self.lease_ttl / 4).min(PARTITION_POLL),
        };
        while !stop.is_requested() {
            let Some(lease) =
                Lease::try_acquire(&self.leases, &key, &self.replica, self.lease_ttl).await
            else {
                // Another replica consumes it: as far as this loop knows,
                // this replica's fan-out has no ingest to give way to.
                self.backlog.note_idle();
                tokio::select! {
                    () = tokio::time::sleep(poll) => {}
                    () = stop.requested() => {}
                }
                continue;
            };
            self.taken(&key);
            let mut router = match self.settle_count(&lease, &stop).await {
                Some(router) => router,
                None => {
                    self.given_up(&key, lease).await;
                    continue;
                }
            };
            // Whether ingest is behind, from the last batch or count seen
            // until the next: the fan-out gives way meanwhile.
            let mut behind = None;
            self.wait_for_in_flight(&consumer, &stop, &mut behind).await;
            let mut pipeline = Pipeline::default();
            while !stop.is_requested() && !lease.is_lost() {
                let mut sink = match router.as_mut() {
                    Some(router) => Sink::Route(router, &lease),
                    None => Sink::Apply(&mut pipeline),
                };
                let end = self
                    .pull_once(&consumer, &stop, &mut sink, &mut behind)
                    .await;
                if end == PullEnd::Lost {
                    // What the lost pull sent and we never read comes back
                    // only after the ack wait; newer messages must not
                    // overtake it (per-user order), as after a takeover.
                    pipeline.finish().await;
                    self.wait_for_in_flight(&consumer, &stop, &mut behind).await;
                }
            }
            drop(behind);
            pipeline.finish().await;
            self.given_up(&key, lease).await;
        }
    }

    /// Logs and counts a lease taken.
    fn taken(&self, key: &str) {
        match self.feed {
            Feed::Input { .. } => {
                tracing::info!(lease = %key, "this replica now consumes the input stream");
            }
            Feed::Partition { partition, .. } => {
                tracing::info!(lease = %key, partition, "took an input partition");
                self.metrics.partition_moved(PartitionMove::Taken);
            }
        }
    }

    /// Lets the lease go (everything in hand is drained), and logs and
    /// counts the move.
    async fn given_up(&self, key: &str, lease: Lease) {
        let lost = lease.is_lost();
        if let Feed::Partition { partition, .. } = self.feed {
            if lost {
                tracing::warn!(lease = %key, partition, "lost an input partition (lease not renewed in time)");
                self.metrics.partition_moved(PartitionMove::Lost);
            } else {
                tracing::info!(lease = %key, partition, "handed an input partition over");
                self.metrics.partition_moved(PartitionMove::HandedOver);
            }
        }
        lease.release().await;
    }
}

/// How often a replica tries to take a partition dealt to it that another
/// still holds (it is being drained, or its holder died).
const PARTITION_POLL: Duration = Duration::from_millis(250);
