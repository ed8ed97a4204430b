//! The input partitions this replica ingests (SPEC §4.5).
//!
//! Every replica announces itself with a presence key in the lease bucket
//! ([`Presence`]), renewed like a lease and gone when the replica stops or
//! dies. For each input stream, a [`PartitionDealer`] looks at the live
//! replicas and the partition count the stream is routed with, computes the
//! deal ([`crate::decide::partitions::deal`], the same on every replica),
//! and runs one ingest loop per partition dealt to this replica. A loop
//! takes its partition's lease before it consumes, so two replicas that
//! briefly see different deals never consume one partition together; a
//! partition dealt elsewhere is drained and its lease let go.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use async_nats::jetstream::kv;

use super::{Feed, Ingest};
use crate::bus::lease::Lease;
use crate::bus::parts::{self, REPLICA_KEY_PREFIX};
use crate::bus::streams::InputConsumerSettings;
use crate::decide::partitions::deal;
use crate::shutdown::{Shutdown, ShutdownTrigger};

/// The longest between two looks at the deal.
const MAX_TICK: Duration = Duration::from_secs(1);

/// This replica's presence key, held while the worker runs.
pub struct Presence {
    /// The lease bucket.
    pub leases: kv::Store,
    /// This replica's id.
    pub replica: String,
    /// How long the key outlives a dead replica.
    pub ttl: Duration,
}

impl Presence {
    /// Holds the key until `stop`; takes it again if it was lost (NATS
    /// away for longer than the lease length).
    pub async fn run(self, stop: Shutdown) {
        let key = format!("{REPLICA_KEY_PREFIX}{}", self.replica);
        while !stop.is_requested() {
            let Some(lease) = Lease::try_acquire(&self.leases, &key, &self.replica, self.ttl).await
            else {
                tokio::select! {
                    () = tokio::time::sleep(self.ttl / 4) => {}
                    () = stop.requested() => {}
                }
                continue;
            };
            while !stop.is_requested() && !lease.is_lost() {
                tokio::select! {
                    () = tokio::time::sleep(self.ttl / 4) => {}
                    () = stop.requested() => {}
                }
            }
            lease.release().await;
        }
    }
}

/// Runs the ingest loops of the partitions of one input stream dealt to
/// this replica.
pub struct PartitionDealer {
    /// The ingest every partition loop is made from.
    pub template: Ingest,
    /// The input stream.
    pub stream: String,
    /// The partition-count bucket.
    pub counts: kv::Store,
    /// Settings of the partition consumers.
    pub consumer: InputConsumerSettings,
}

/// A partition loop of this replica.
struct Held {
    stop: ShutdownTrigger,
    task: tokio::task::JoinHandle<()>,
}

impl PartitionDealer {
    /// Deals and redeals until `stop`; then every partition loop drains and
    /// lets its lease go before this returns.
    pub async fn run(self, stop: Shutdown) {
        let tick = (self.template.lease_ttl / 4).min(MAX_TICK);
        let mut held: BTreeMap<u16, Held> = BTreeMap::new();
        while !stop.is_requested() {
            if let Some(wanted) = self.wanted().await {
                // Partitions dealt elsewhere: drained, then let go.
                for (partition, loop_) in &held {
                    if !wanted.contains(partition) {
                        loop_.stop.trigger();
                    }
                }
                held.retain(|_, loop_| !loop_.task.is_finished());
                for partition in wanted {
                    held.entry(partition)
                        .or_insert_with(|| self.start(partition));
                }
            }
            tokio::select! {
                () = tokio::time::sleep(tick) => {}
                () = stop.requested() => {}
            }
        }
        for loop_ in held.values() {
            loop_.stop.trigger();
        }
        for (_, loop_) in held {
            let _ = loop_.task.await;
        }
    }

    /// The partitions dealt to this replica now; None if that cannot be
    /// told (NATS away): the loops then stay as they are.
    async fn wanted(&self) -> Option<BTreeSet<u16>> {
        let count = match parts::routed_count(&self.counts, &self.stream).await {
            Ok(count) => count,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the partition count");
                return None;
            }
        };
        let Some(count) = count else {
            return Some(BTreeSet::new());
        };
        let mut replicas = match parts::live_replicas(&self.template.js).await {
            Ok(replicas) => replicas,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the live replicas");
                return None;
            }
        };
        // Before its presence key is seen, a replica still counts itself.
        replicas.push(self.template.replica.clone());
        let mut dealt = deal(count, &replicas);
        Some(
            dealt
                .remove(&self.template.replica)
                .unwrap_or_default()
                .into_iter()
                .collect(),
        )
    }

    /// Starts the loop of `partition`.
    fn start(&self, partition: u16) -> Held {
        let (trigger, stop) = Shutdown::new();
        let ingest = Ingest {
            subjects: parts::subjects(&self.stream, partition),
            feed: Feed::Partition {
                stream: self.stream.clone(),
                partition,
            },
            ..self.template.clone()
        };
        let settings = self.consumer.clone();
        let stream = self.stream.clone();
        let task = tokio::spawn(async move {
            let consumer = loop {
                match parts::consumer(&ingest.js, &stream, partition, &settings).await {
                    Ok(consumer) => break consumer,
                    Err(e) => {
                        tracing::warn!(error = %e, partition, "cannot open a partition consumer; retrying");
                        tokio::select! {
                            () = tokio::time::sleep(Duration::from_secs(1)) => {}
                            () = stop.requested() => return,
                        }
                    }
                }
            };
            ingest.run(consumer, stop).await;
        });
        Held {
            stop: trigger,
            task,
        }
    }
}
