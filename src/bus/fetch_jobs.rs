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
