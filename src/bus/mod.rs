//! Bus: everything that talks to NATS JetStream — streams and consumers
//! (SPEC §4), the input lease, dead letters (§4.3), fetch jobs, and the
//! outbox publisher.

pub mod dead_letters;
pub mod fetch_jobs;
pub mod lease;
pub mod publisher;
pub mod streams;

use std::time::Duration;

/// Connects to NATS, retrying until `wait` has passed. After the first
/// connection the client reconnects by itself for as long as the process runs.
pub async fn connect(urls: &str, wait: Duration) -> Result<async_nats::Client, String> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let attempt = async_nats::ConnectOptions::new()
            .name("device-list-updater")
            .max_reconnects(None)
            .connection_timeout(Duration::from_secs(2))
            .connect(urls)
            .await;
        match attempt {
            Ok(client) => return Ok(client),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(format!("cannot connect to NATS at {urls}: {e}"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}
