//! The outbox publisher: sends recorded key-change events to `KEY_CHANGE` in
//! id order, with `Nats-Msg-Id = <instance id>-<outbox id>`, then deletes them.
//! A crash before the delete re-sends the same ids, which the stream's
//! duplicate window drops: nothing is lost and nothing is delivered twice.

use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::Context;
use tokio::sync::{Notify, watch};

use crate::store::Store;
use crate::worker::Faults;

/// Events read per round.
const ROUND: u64 = 1000;

/// Publishes the outbox.
#[derive(Clone)]
pub struct Publisher {
    store: Store,
    js: Context,
    instance_id: Arc<str>,
    wake: Arc<Notify>,
    faults: Faults,
}

impl Publisher {
    /// A publisher for `store`'s outbox.
    pub fn new(store: Store, js: Context, instance_id: String, faults: Faults) -> Self {
        Publisher {
            store,
            js,
            instance_id: instance_id.into(),
            wake: Arc::new(Notify::new()),
            faults,
        }
    }

    /// Handle to wake the publisher after a commit that recorded events.
    pub fn waker(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    /// Runs until `shutdown` turns true, then drains once more.
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) {
        loop {
            if let Err(e) = self.drain().await {
                tracing::warn!(error = %e, "outbox publish failed; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            if *shutdown.borrow() {
                break;
            }
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = shutdown.changed() => {}
            }
        }
        if let Err(e) = self.drain().await {
            tracing::warn!(error = %e, "final outbox drain failed; events stay for the next start");
        }
    }

    /// Publishes everything in the outbox; returns how many events were sent.
    pub async fn drain(&self) -> Result<usize, String> {
        let mut sent = 0;
        loop {
            let events = self
                .store
                .outbox_pending(ROUND)
                .await
                .map_err(|e| e.to_string())?;
            if events.is_empty() {
                return Ok(sent);
            }
            let mut acks = Vec::with_capacity(events.len());
            for event in &events {
                let mut headers = HeaderMap::new();
                headers.insert("user_id", event.user_id.as_str());
                headers.insert(
                    async_nats::header::NATS_MESSAGE_ID,
                    format!("{}-{}", self.instance_id, event.id).as_str(),
                );
                let ack = self
                    .js
                    .publish_with_headers(
                        event.subject.clone(),
                        headers,
                        event.payload.clone().into(),
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                acks.push(ack);
            }
            for ack in acks {
                ack.await.map_err(|e| e.to_string())?;
            }
            if self.faults.crash_after_publish {
                tracing::error!("fault injection: crashing after publish, before outbox delete");
                std::process::abort();
            }
            let ids: Vec<i64> = events.iter().map(|e| e.id).collect();
            self.store
                .outbox_delete(&ids)
                .await
                .map_err(|e| e.to_string())?;
            sent += ids.len();
        }
    }
}
