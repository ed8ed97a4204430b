//! Fetch jobs: one pending message per remote server in `DEVICE_LIST_FETCH`.
//!
//! Subject: `devicelist.fetch.<partition>.<server token>`. The token is the
//! server name with `.` replaced by `_` (reversible: `_` cannot occur in a
//! server name); the partition (FNV-1a of the name, modulo
//! [`FETCH_PARTITIONS`]) lets fetch consumers shard the queue.

use async_nats::jetstream::Context;
use ruma::{OwnedServerName, ServerName};
use serde::{Deserialize, Serialize};

/// Number of fetch-job partitions.
pub const FETCH_PARTITIONS: u32 = 16;

/// Body of a fetch job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FetchJob {
    /// The server whose stale users should be fetched.
    pub server_name: OwnedServerName,
}

/// FNV-1a (32 bit), a stable hash for partitioning.
fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5_u32, |hash, &b| {
        (hash ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// The partition of a server.
pub fn partition(server: &ServerName) -> u32 {
    fnv1a(server.as_bytes()) % FETCH_PARTITIONS
}

/// The subject token of a server name.
pub fn server_token(server: &ServerName) -> String {
    server.as_str().replace('.', "_")
}

/// The server name of a subject token.
pub fn server_from_token(token: &str) -> Option<OwnedServerName> {
    OwnedServerName::try_from(token.replace('_', ".")).ok()
}

/// The job subject of a server.
pub fn subject(server: &ServerName) -> String {
    format!(
        "devicelist.fetch.{}.{}",
        partition(server),
        server_token(server)
    )
}

/// Enqueues one job per server. A server that already has a pending job is
/// refused by the stream (one message per subject); that counts as success.
pub async fn enqueue<'a>(
    js: &Context,
    servers: impl IntoIterator<Item = &'a OwnedServerName>,
) -> Result<(), String> {
    let mut acks = Vec::new();
    for server in servers {
        let body = serde_json::to_vec(&FetchJob {
            server_name: server.clone(),
        })
        .unwrap_or_default();
        let ack = js
            .publish(subject(server), body.into())
            .await
            .map_err(|e| format!("cannot enqueue fetch job for {server}: {e}"))?;
        acks.push((server, ack));
    }
    for (server, ack) in acks {
        match ack.await {
            Ok(_) => {}
            Err(e) if e.to_string().contains("maximum messages per subject") => {}
            Err(e) => return Err(format!("fetch job for {server} not stored: {e}")),
        }
    }
    Ok(())
}

/// Replaces `server`'s pending job with a new one, deliverable at once: the
/// old message (which may sit in a NAK delay on any replica's consumer) is
/// deleted, which JetStream treats as the end of its delivery, and a new job
/// is published. Only for a job that is waiting, never for one that runs:
/// the caller has ended the wait in the database first.
pub async fn replace(js: &Context, server: &OwnedServerName) -> Result<(), String> {
    use async_nats::jetstream::stream::LastRawMessageErrorKind;
    let stream = js
        .get_stream(crate::bus::streams::FETCH_STREAM)
        .await
        .map_err(|e| format!("cannot open the fetch stream: {e}"))?;
    match stream
        .get_last_raw_message_by_subject(&subject(server))
        .await
    {
        Ok(pending) => {
            // Gone already (acked, or deleted by another replica): fine.
            let _ = stream.delete_message(pending.sequence).await;
        }
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => {}
        Err(e) => return Err(format!("cannot find the fetch job of {server}: {e}")),
    }
    enqueue(js, [server]).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_partitions_are_stable() {
        for name in [
            "matrix.org",
            "example.com:8448",
            "[::1]:8448",
            "1.2.3.4",
            "a-b.c",
        ] {
            let server = <&ServerName>::try_from(name).unwrap();
            assert!(!server_token(server).contains('.'));
            assert_eq!(
                server_from_token(&server_token(server)).as_deref(),
                Some(server)
            );
            assert_eq!(partition(server), partition(server));
            assert!(partition(server) < FETCH_PARTITIONS);
        }
        let server = <&ServerName>::try_from("matrix.org").unwrap();
        assert!(subject(server).ends_with(".matrix_org"));
    }
}
