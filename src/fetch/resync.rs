//! Asking for a user's list to be fetched again from outside the input
//! stream (the resync RPC of SPEC §4.4, `admin resync`): the stale mark a
//! `devicelist.in.resync` message makes, then its server's fetch job.

use async_nats::jetstream::Context;
use ruma::OwnedUserId;

use crate::bus::{BusError, fetch_jobs};
use crate::input::{InputMessage, ResyncRequest};
use crate::store::{Store, now_ms};

/// Why a resync could not be requested.
#[derive(Debug, thiserror::Error)]
pub enum ResyncError {
    /// The stale mark was not stored.
    #[error("database: {0}")]
    Database(#[from] sea_orm::DbErr),
    /// The fetch job was not enqueued (the mark is stored; a restart's
    /// rescan finds it).
    #[error(transparent)]
    Bus(#[from] BusError),
    /// The task storing the request ended without an answer (it panicked
    /// or the runtime is shutting down).
    #[error("the resync request was interrupted: {0}")]
    Interrupted(String),
}

/// Marks `user` stale and enqueues its server's job; a worker fetches it.
pub async fn request(store: &Store, js: &Context, user: &OwnedUserId) -> Result<(), ResyncError> {
    let mark = [InputMessage::Resync(ResyncRequest {
        user_id: user.clone(),
    })];
    store.apply_batch(&mark, now_ms()).await?;
    fetch_jobs::enqueue(js, [&user.server_name().to_owned()]).await?;
    Ok(())
}
