//! Fetch jobs: one pending message per remote server in `DEVICE_LIST_FETCH`,
//! and the durable consumer all replicas share.
//!
//! Subject: `devicelist.fetch.<server token>`. The token is the server name
//! with `.` replaced by `_` (`.` separates subject tokens; `_` cannot occur
//! in a server name, so two servers never share a subject).

use std::time::Duration;

use async_nats::jetstream::Context;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::{ErrorCode, stream::LastRawMessageErrorKind};
use ruma::{OwnedServerName, ServerName};
use serde::{Deserialize, Serialize};

use super::BusError;
use super::streams::FETCH_STREAM;

/// Durable name of the fetch-job consumer, shared by all replicas.
pub const FETCH_CONSUMER: &str = "device-list-updater-fetch";
/// Jobs that may be pending (delivered, or NAK-delayed) at once.
const MAX_PENDING_JOBS: i64 = 1_000_000;

/// Body of a fetch job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FetchJob {
    /// The server whose stale users should be fetched.
    pub server_name: OwnedServerName,
}

/// The job subject of a server.
pub fn subject(server: &ServerName) -> String {
    format!("devicelist.fetch.{}", server.as_str().replace('.', "_"))
}

/// Creates (or opens) the shared fetch-job consumer. A job whose replica
/// stops sending progress acks (it died) is redelivered after `ack_wait`.
pub async fn consumer(js: &Context, ack_wait: Duration) -> Result<PullConsumer, BusError> {
    let stream = fetch_stream(js).await?;
    let config = pull::Config {
        durable_name: Some(FETCH_CONSUMER.into()),
        description: Some("device-list-updater: per-server fetch jobs".into()),
        ack_policy: AckPolicy::Explicit,
        ack_wait,
        // Jobs are retried for as long as the server fails, with back-off.
        max_deliver: -1,
        max_ack_pending: MAX_PENDING_JOBS,
        ..Default::default()
    };
    stream
        .get_or_create_consumer(FETCH_CONSUMER, config)
        .await
        .map_err(BusError::jetstream(format!(
            "cannot create consumer {FETCH_CONSUMER}"
        )))
}

/// The fetch-job stream.
async fn fetch_stream(js: &Context) -> Result<async_nats::jetstream::stream::Stream, BusError> {
    js.get_stream(FETCH_STREAM)
        .await
        .map_err(BusError::jetstream(format!(
            "cannot open stream {FETCH_STREAM}"
        )))
}

/// Whether a refused publish means "this server has a pending job already":
/// the stream keeps one message per subject and refuses a second with a
/// store failure (JetStream error 10077, the only store limit it has).
fn already_queued(e: &async_nats::jetstream::context::PublishError) -> bool {
    e.kind() == PublishErrorKind::Other
        && std::error::Error::source(e)
            .and_then(|source| source.downcast_ref::<async_nats::jetstream::Error>())
            .is_some_and(|e| e.error_code() == ErrorCode::STREAM_STORE_FAILED)
}

/// Enqueues one job per server. A server that already has a pending job is
/// refused by the stream (one message per subject); that counts as success.
pub async fn enqueue<'a>(
    js: &Context,
    servers: impl IntoIterator<Item = &'a OwnedServerName>,
) -> Result<(), BusError> {
    let mut acks = Vec::new();
    for server in servers {
        let body = serde_json::to_vec(&FetchJob {
            server_name: server.clone(),
        })
        .unwrap_or_default();
        let ack = js
            .publish(subject(server), body.into())
            .await
            .map_err(BusError::jetstream(format!(
                "cannot enqueue the fetch job of {server}"
            )))?;
        acks.push((server, ack));
    }
    for (server, ack) in acks {
        match ack.await {
            Ok(_) => {}
            Err(e) if already_queued(&e) => {}
            Err(e) => {
                return Err(BusError::jetstream(format!(
                    "the fetch job of {server} was not stored"
                ))(e));
            }
        }
    }
    Ok(())
}

/// Replaces `server`'s pending job with a new one, deliverable at once: the
/// old message (which may sit in a NAK delay on any replica's consumer) is
/// deleted, which JetStream treats as the end of its delivery, and a new job
/// is published. Only for a job that is waiting, never for one that runs:
/// the caller has ended the wait in the database first.
pub async fn replace(js: &Context, server: &OwnedServerName) -> Result<(), BusError> {
    let stream = fetch_stream(js).await?;
    match stream
        .get_last_raw_message_by_subject(&subject(server))
        .await
    {
        Ok(pending) => {
            // Gone already (acked, or deleted by another replica): fine.
            let _ = stream.delete_message(pending.sequence).await;
        }
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => {}
        Err(e) => {
            return Err(BusError::jetstream(format!(
                "cannot find the fetch job of {server}"
            ))(e));
        }
    }
    enqueue(js, [server]).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_server_has_its_own_subject() {
        let subjects: std::collections::BTreeSet<String> = [
            "matrix.org",
            "matrix.org:8448",
            "example.com:8448",
            "[::1]:8448",
            "1.2.3.4",
            "a-b.c",
        ]
        .iter()
        .map(|name| subject(<&ServerName>::try_from(*name).unwrap()))
        .collect();
        assert_eq!(subjects.len(), 6);
        assert!(subjects.contains("devicelist.fetch.matrix_org"));
        // One subject token: no dot after the prefix.
        assert!(
            subjects
                .iter()
                .all(|s| s["devicelist.fetch.".len()..].find('.').is_none())
        );
    }
}
