//! Setting up the bus at start-up: every stream, consumer and KV bucket
//! the worker uses, created where missing (SPEC §4; docs/interface.md).
//!
//! All of it is idempotent, so it is tried again as a whole while
//! JetStream does not answer in time: a cluster that has just started is
//! still electing its leaders, and replicas started together create the
//! same replicated streams at once, which can take longer than one
//! request's timeout. Any other refusal ends the start at once.

use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{Context, kv};

use super::streams::{self, InputConsumerSettings};
use super::{BusError, fetch_jobs, lease, parts};
use crate::config::Settings;

/// What the bus set-up gives the worker.
pub struct SetUp {
    /// One pull consumer per input stream, with the stream's name.
    pub inputs: Vec<(String, PullConsumer)>,
    /// Settings of the input and partition consumers.
    pub consumer_settings: InputConsumerSettings,
    /// The partition-count bucket, once any replica has used input
    /// partitions (SPEC §4.5).
    pub counts: Option<kv::Store>,
    /// The fetch-job consumer.
    pub fetch_consumer: PullConsumer,
    /// The lease bucket.
    pub leases: kv::Store,
    /// One line per stream in use with fewer replicas than configured.
    pub warnings: Vec<String>,
}

/// Sets the bus up, trying again for up to `wait` while JetStream times
/// out or is not available yet.
pub async fn set_up_within(
    js: &Context,
    settings: &Settings,
    wait: Duration,
) -> Result<SetUp, BusError> {
    crate::startup::retry_within_unless(
        wait,
        || async {
            set_up(js, settings).await.inspect_err(|e| {
                if e.is_transient() {
                    tracing::warn!(error = %e, "JetStream not ready; setting up the streams again");
                }
            })
        },
        |e| !e.is_transient(),
    )
    .await
}

/// Creates or opens every stream, consumer and bucket, once.
async fn set_up(js: &Context, settings: &Settings) -> Result<SetUp, BusError> {
    let streams::Ensured {
        inputs,
        mut warnings,
    } = streams::ensure_all(
        js,
        &settings.input_subjects().all(),
        settings.stream_replicas,
    )
    .await?;
    let consumer_settings = InputConsumerSettings {
        max_deliver: settings.max_deliver,
        max_ack_pending: (settings.batch_size * 4).max(1000) as i64,
        ack_wait: settings.ack_wait,
    };
    let mut consumers = Vec::new();
    for (stream, stream_subjects) in &inputs {
        let consumer =
            streams::input_consumer(js, stream, stream_subjects, &consumer_settings).await?;
        consumers.push((stream.clone(), consumer));
        if settings.input_partitions > 1 {
            parts::ensure_stream(js, stream, settings.stream_replicas).await?;
        }
    }
    // Created by the first replica with partitions; opened if it exists, so
    // a replica with one partition drains what others routed (SPEC §4.5).
    let counts =
        parts::counts_bucket(js, settings.stream_replicas, settings.input_partitions > 1).await?;
    let fetch_consumer = fetch_jobs::consumer(js, settings.ack_wait).await?;
    let leases = lease::bucket(js, settings.lease_ttl, settings.stream_replicas).await?;
    // A KV bucket is a stream named after it.
    let lease_stream = format!("KV_{}", lease::BUCKET);
    warnings.extend(streams::replica_warning(js, &lease_stream, settings.stream_replicas).await);
    Ok(SetUp {
        inputs: consumers,
        consumer_settings,
        counts,
        fetch_consumer,
        leases,
        warnings,
    })
}
