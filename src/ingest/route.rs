//! Routing (SPEC §4.5): with `DLU_INPUT_PARTITIONS` above 1, the replica
//! holding an input stream's lease applies nothing itself. It sends each
//! message, in stream order, to its partition of the stream's partitions
//! stream ([`crate::bus::parts`]), and acks it once stored there. Order per
//! user and per room holds because routing keeps the input's order within
//! each partition and each partition has one consumer at a time.
//!
//! Before consuming, the holder agrees on the partition count: if the
//! partitions stream was last routed with another count (a change of P,
//! or a return to one partition), it waits until every message routed
//! with the old count has been ingested, then records its own. A user's
//! messages are thus never in two partitions at once.

use std::time::Duration;

use async_nats::jetstream::{AckKind, Message};

use super::pipeline::Pipeline;
use super::{Feed, Ingest};
use crate::bus::lease::Lease;
use crate::bus::parts::{self, Chain, Routed};
use crate::input::partition::partition_of;
use crate::shutdown::Shutdown;

/// How often the count agreement looks at the partitions stream again.
const DRAIN_POLL: Duration = Duration::from_millis(500);

/// The routing state of one input stream's lease holder.
pub(super) struct Router {
    chain: Chain,
    stream: String,
    partitions: u16,
    /// Never busy: a chunk is routed before the next is gathered.
    pub(super) idle: Pipeline,
}

impl Ingest {
    /// Routes `chunk` to its partitions and acks it; false if it could not
    /// be routed (it is then given back, in order, for redelivery).
    pub(super) async fn route(
        &self,
        router: &mut Router,
        chunk: Vec<Message>,
        lease: &Lease,
    ) -> bool {
        let routed: Vec<Routed> = chunk
            .iter()
            .map(|message| {
                let kind = self.subjects.kind_of(message.subject.as_str());
                let partition = partition_of(kind, &message.payload, router.partitions);
                let (id, delivered) = match message.info() {
                    Ok(info) => (
                        format!("{}:{}", info.stream, info.stream_sequence),
                        info.delivered,
                    ),
                    // Not from JetStream: an id of its own, stored once.
                    Err(_) => (uuid::Uuid::new_v4().to_string(), 1),
                };
                Routed::new(
                    parts::subject(&router.stream, partition, kind),
                    id,
                    message.subject.as_str(),
                    message.headers.as_ref(),
                    message.payload.clone(),
                    delivered > 1,
                )
            })
            .collect();
        match router.chain.publish(&routed, || lease.is_lost()).await {
            Ok(()) => {
                for message in &chunk {
                    if let Err(e) = message.ack().await {
                        tracing::warn!(error = %e, "ack failed; the message will be routed again (stored once)");
                    }
                }
                self.metrics.routed(chunk.len());
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "input not routed; it will be redelivered");
                for message in &chunk {
                    let _ = message.ack_with(AckKind::Nak(None)).await;
                }
                false
            }
        }
    }

    /// Agrees on the partition count before consuming an input stream:
    /// returns the router when this replica routes, none when it applies
    /// the input itself, and None if the lease was lost or the stop came
    /// first. Partitions only: a feed that is one partition goes on.
    pub(super) async fn settle_count(
        &self,
        lease: &Lease,
        stop: &Shutdown,
    ) -> Option<Option<Router>> {
        let Feed::Input {
            stream,
            partitions,
            counts,
        } = &self.feed
        else {
            return Some(None);
        };
        let router = (*partitions > 1).then(|| Router {
            chain: Chain::new(self.js.clone(), stream),
            stream: stream.clone(),
            partitions: *partitions,
            idle: Pipeline::default(),
        });
        // Never partitioned, and not partitioning now.
        let Some(counts) = counts else {
            return Some(router);
        };
        let wanted = (*partitions > 1).then_some(*partitions);
        let mut told = false;
        while !stop.is_requested() && !lease.is_lost() {
            match self.count_agreed(counts, stream, wanted).await {
                Ok(Agreed::Yes) => return Some(router),
                Ok(Agreed::Draining {
                    routed_with,
                    waiting,
                }) => {
                    if !told {
                        tracing::warn!(
                            %stream, ?routed_with, waiting, partitions,
                            "input partition count changed: waiting until what was routed with the old count is ingested"
                        );
                        told = true;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, %stream, "cannot check the input partition count; retrying")
                }
            }
            tokio::select! {
                () = tokio::time::sleep(DRAIN_POLL) => {}
                () = stop.requested() => {}
            }
        }
        None
    }

    /// Whether `stream`'s partitions were routed with `wanted` (None: one),
    /// recording it if nothing routed with another count is left.
    async fn count_agreed(
        &self,
        counts: &async_nats::jetstream::kv::Store,
        stream: &str,
        wanted: Option<u16>,
    ) -> Result<Agreed, crate::bus::BusError> {
        let routed_with = parts::routed_count(counts, stream).await?;
        if routed_with == wanted {
            return Ok(Agreed::Yes);
        }
        let waiting = parts::waiting(&self.js, stream).await?;
        if waiting > 0 {
            return Ok(Agreed::Draining {
                routed_with,
                waiting,
            });
        }
        parts::set_routed_count(counts, stream, wanted.unwrap_or(1)).await?;
        tracing::info!(%stream, was = ?routed_with, now = ?wanted, "input partition count recorded");
        Ok(Agreed::Yes)
    }
}

/// Where the count agreement stands.
enum Agreed {
    /// The partitions stream holds nothing routed with another count.
    Yes,
    /// Messages routed with `routed_with` partitions are still waiting.
    Draining {
        routed_with: Option<u16>,
        waiting: u64,
    },
}
