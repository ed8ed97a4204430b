//! Bus: everything that talks to NATS JetStream — streams and consumers
//! (SPEC §4), the input lease, dead letters (§4.3), fetch jobs, and the
//! outbox publisher.

pub mod connect;
pub(crate) mod dead_letters;
pub mod error;
pub(crate) mod fetch_jobs;
pub mod lease;
pub mod parts;
pub(crate) mod publisher;
pub mod setup;
pub(crate) mod streams;

use std::time::Duration;

use async_nats::jetstream::consumer::{PullConsumer, pull};
use futures::{Stream, StreamExt as _};

pub use connect::{NatsConnection, connect};
pub use error::BusError;

/// How long past a pull request's expiry the client still waits for it.
/// The expiry is enforced by the server; a server that restarted has
/// forgotten the request, and without this bound the client would wait for
/// it forever (found by `tests/faults.rs`, restart during a burst).
pub const PULL_GRACE: Duration = Duration::from_secs(4);

/// Starts one pull of at most `max` messages, expiring after `expiry`. If
/// JetStream refuses it (NATS away), logs, waits half a second and returns
/// None: the caller's loop tries again.
pub async fn start_pull(
    consumer: &PullConsumer,
    max: usize,
    expiry: Duration,
    what: &str,
) -> Option<pull::Batch> {
    match consumer
        .batch()
        .max_messages(max)
        .expires(expiry)
        .messages()
        .await
    {
        Ok(pull) => Some(pull),
        Err(e) => {
            tracing::warn!(error = %e, "cannot pull {what}; retrying");
            tokio::time::sleep(Duration::from_millis(500)).await;
            None
        }
    }
}

/// What waiting on a pull request gave.
pub enum Pulled<T> {
    /// The next item.
    Item(T),
    /// The pull is over: everything it delivered was received.
    Over,
    /// The pull outlived its expiry: the server that held it is gone (a
    /// restart, a lost node, a new consumer leader). Messages it sent that
    /// never arrived stay unacked until the ack wait, and are redelivered
    /// only then.
    Lost,
}

/// The next item of a pull request that expires after `expiry`. Items
/// already received are returned at once, so giving up never drops a
/// delivered message.
pub async fn next_or_lost<S, T>(pull: &mut S, expiry: Duration) -> Pulled<T>
where
    S: Stream<Item = T> + Unpin,
{
    match tokio::time::timeout(expiry + PULL_GRACE, pull.next()).await {
        Ok(Some(item)) => Pulled::Item(item),
        Ok(None) => Pulled::Over,
        Err(_) => {
            tracing::info!("a pull request outlived its expiry; starting a new one");
            Pulled::Lost
        }
    }
}

/// [`next_or_lost`], for callers to whom a lost pull is just over.
pub async fn next_of_pull<S, T>(pull: &mut S, expiry: Duration) -> Option<T>
where
    S: Stream<Item = T> + Unpin,
{
    match next_or_lost(pull, expiry).await {
        Pulled::Item(item) => Some(item),
        Pulled::Over | Pulled::Lost => None,
    }
}
