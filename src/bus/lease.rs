//! A leader lease in a NATS KV bucket: one replica at a time consumes an
//! input stream, which keeps per-user order across replicas (SPEC §5.1.2).
//!
//! The bucket's `max_age` is the lease length. The holder renews by updating
//! the key at its revision (which resets its age) a few times per length; a
//! crashed holder's key simply expires. A clean stop deletes the key, so a
//! standby takes over at its next poll instead of after the expiry.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::jetstream::Context;
use async_nats::jetstream::kv::{self, Store};
use tokio::sync::watch;

use super::BusError;
use crate::shutdown::AbortOnDrop;

/// Bucket of leases.
pub const BUCKET: &str = "device_list_updater_leases";

/// Opens the lease bucket, creating it with `ttl` as the lease length and
/// `replicas` replicas.
pub async fn bucket(js: &Context, ttl: Duration, replicas: usize) -> Result<Store, BusError> {
    if let Ok(store) = js.get_key_value(BUCKET).await {
        return Ok(store);
    }
    match js
        .create_key_value(kv::Config {
            bucket: BUCKET.into(),
            description: "device-list-updater: which replica consumes each input stream".into(),
            history: 1,
            max_age: ttl,
            num_replicas: replicas,
            ..Default::default()
        })
        .await
    {
        Ok(store) => Ok(store),
        // Another replica starting at the same moment created it first.
        Err(e) => js
            .get_key_value(BUCKET)
            .await
            .map_err(|_| BusError::JetStream {
                what: format!("cannot create KV bucket {BUCKET}"),
                source: Box::new(e),
            }),
    }
}

/// A held lease, renewed in the background until released, lost or
/// dropped (the renewer never outlives its lease).
pub struct Lease {
    store: Store,
    key: String,
    lost: Arc<AtomicBool>,
    revision: watch::Receiver<u64>,
    /// Renews until the lease is released, lost or dropped.
    _renewer: AbortOnDrop,
}

impl Lease {
    /// Tries once to take `key` for `holder`.
    pub async fn try_acquire(
        store: &Store,
        key: &str,
        holder: &str,
        ttl: Duration,
    ) -> Option<Lease> {
        let revision = store.create(key, holder.to_owned().into()).await.ok()?;
        let lost = Arc::new(AtomicBool::new(false));
        let (tx, rx) = watch::channel(revision);
        let renewer = AbortOnDrop::spawn(renew(
            store.clone(),
            key.to_owned(),
            holder.to_owned(),
            revision,
            ttl / 4,
            lost.clone(),
            tx,
        ));
        Some(Lease {
            store: store.clone(),
            key: key.to_owned(),
            lost,
            revision: rx,
            _renewer: renewer,
        })
    }

    /// Whether the lease was lost (it could not be renewed in time).
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// Gives the lease up so a standby can take over at once.
    pub async fn release(self) {
        // Dropping `self` at the end stops the renewer; a renewal racing
        // with the delete fails on the revision and changes nothing.
        if !self.is_lost() {
            let revision = *self.revision.borrow();
            let _ = self
                .store
                .delete_expect_revision(&self.key, Some(revision))
                .await;
        }
    }
}

async fn renew(
    store: Store,
    key: String,
    holder: String,
    mut revision: u64,
    every: Duration,
    lost: Arc<AtomicBool>,
    revisions: watch::Sender<u64>,
) {
    loop {
        tokio::time::sleep(every).await;
        match store.update(&key, holder.clone().into(), revision).await {
            Ok(next) => {
                revision = next;
                let _ = revisions.send(next);
            }
            Err(e) => {
                // Someone else holds it now, or NATS has been unreachable
                // for longer than the lease may survive: stop consuming.
                tracing::warn!(error = %e, %key, "input lease lost");
                lost.store(true, Ordering::SeqCst);
                return;
            }
        }
    }
}
