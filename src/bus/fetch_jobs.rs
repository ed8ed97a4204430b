//! Fetch jobs: one pending message per remote server in `DEVICE_LIST_FETCH`,
//! and the durable consumer all replicas share.
//!
//! Subject: `devicelist.fetch.<server token>`. The token is the server name
//! with `.` replaced by `_` (`.` separates subject tokens; `_` cannot occur
//! in a server name, so two servers never share a subject).

use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::stream::{DeleteMessageErrorKind, RawMessageErrorKind};
use async_nats::jetstream::{Context, Message};
use async_nats::jetstream::{ErrorCode, stream::LastRawMessageErrorKind};
use ruma::{OwnedServerName, ServerName};
use serde::{Deserialize, Serialize};

use super::BusError;
use super::streams::FETCH_STREAM;
use crate::faults::{Fault, Faults};

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

/// A handle on the fetch-job stream without asking for its info (a round
/// trip less, for a single operation).
async fn fetch_stream_handle(
    js: &Context,
) -> Result<async_nats::jetstream::stream::Stream<()>, BusError> {
    js.get_stream_no_info(FETCH_STREAM)
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

/// Ends a finished job: removes its message from the stream, confirmed,
/// then acks it, so the server's next job can be enqueued at once.
///
/// An ack alone does not free the server's subject in a cluster: there the
/// stream removes an acked work-queue message through a proposal of its
/// own, applied after the ack's reply, and until then it refuses the
/// server's next job as a duplicate (a job lost, its users left stale). A
/// delete is answered once applied, so when this returns the subject is
/// free, and the job cannot be delivered again. The ack then clears the
/// consumer's pending entry at once rather than at its ack wait.
pub async fn finish(js: &Context, message: &Message) -> Result<(), BusError> {
    let sequence = message
        .info()
        .map_err(|e| BusError::JetStream {
            what: "a fetch job without its stream sequence".into(),
            source: e,
        })?
        .stream_sequence;
    let stream = fetch_stream_handle(js).await?;
    let removed = match stream.delete_message(sequence).await {
        Ok(true) => true,
        // Refused, or answered without success: removed already (a
        // repeated call, whose first reply was lost), or not at all.
        Ok(false) => false,
        Err(e) if matches!(e.kind(), DeleteMessageErrorKind::JetStream(_)) => false,
        Err(e) => {
            return Err(BusError::jetstream(format!(
                "cannot remove the finished fetch job {sequence}"
            ))(e));
        }
    };
    if !removed {
        // Asked of the stream's leader, which answers from what it applied.
        match stream.get_raw_message(sequence).await {
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => {}
            Ok(_) => {
                return Err(BusError::NotApplied(format!(
                    "the finished fetch job {sequence} is still in {FETCH_STREAM}"
                )));
            }
            Err(e) => {
                return Err(BusError::jetstream(format!(
                    "cannot tell whether the finished fetch job {sequence} is removed"
                ))(e));
            }
        }
    }
    // Without a reply: the delete was the confirmation.
    message.ack().await.map_err(|e| BusError::JetStream {
        what: "cannot ack a finished fetch job".into(),
        source: e,
    })
}

/// Replaces `server`'s pending job with a new one, deliverable at once: the
/// old message (which may sit in a NAK delay on any replica's consumer) is
/// deleted, which JetStream treats as the end of its delivery, and a new job
/// is published. Only for a job that is waiting, never for one that runs:
/// the caller has ended the wait in the database first. Once the old
/// message is deleted only the new one stands for the server's work, so
/// on an error the caller enqueues the job until it is stored.
pub async fn replace(
    js: &Context,
    server: &OwnedServerName,
    faults: Faults,
) -> Result<(), BusError> {
    let stream = fetch_stream_handle(js).await?;
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
    if faults.is_armed(Fault::FailWakePublish) {
        return Err(BusError::NotApplied(
            "fault injection: the replacing job was not published".into(),
        ));
    }
    enqueue(js, [server]).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In a three-node cluster, the server's next job is stored whenever
    /// it is enqueued right after [`finish`] returned (an ack alone left the
    /// finished message in the stream for a moment, and the next job was
    /// refused as a duplicate).
    #[cfg(feature = "testkit")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_finished_job_frees_its_server_at_once() {
        use futures::StreamExt as _;
        let cluster = crate::testkit::cluster::NatsCluster::start(3).await;
        let js = cluster.js().await;
        let config = async_nats::jetstream::stream::Config {
            num_replicas: 3,
            ..super::super::streams::fetch_stream_config()
        };
        crate::testkit::wait_for(Duration::from_secs(30), "the fetch stream", || async {
            js.get_or_create_stream(config.clone())
                .await
                .ok()
                .map(|_| ())
        })
        .await;
        let consumer = consumer(&js, Duration::from_secs(30))
            .await
            .expect("consumer");
        let stream = js.get_stream(FETCH_STREAM).await.expect("stream");
        let server = OwnedServerName::try_from("remote.example").expect("a server name");
        enqueue(&js, [&server]).await.expect("first job");
        for round in 0..200 {
            let mut pull = consumer
                .batch()
                .max_messages(1)
                .expires(Duration::from_secs(5))
                .messages()
                .await
                .expect("pull");
            let job = pull.next().await.expect("a job").expect("readable");
            let finished = job.info().expect("info").stream_sequence;
            finish(&js, &job).await.expect("finished");
            enqueue(&js, [&server]).await.expect("enqueued");
            let next = stream
                .get_last_raw_message_by_subject(&subject(&server))
                .await
                .map(|m| m.sequence);
            assert!(
                next.as_ref().is_ok_and(|next| *next > finished),
                "round {round}: the next job was not stored after job {finished} finished: {next:?}"
            );
        }
    }

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
