//! Request-reply over core NATS (SPEC §4.4), queue group `device-list-updater`:
//!
//! * `devicelist.rpc.query`: what is stored about some users;
//! * `devicelist.rpc.resync`: mark a user stale, fetch it (one request per
//!   server still holds: the job goes through the fetch queue) and reply once
//!   it is stored or the timeout passes.
//!
//! A request that cannot be read, or that names anything but a user id (by
//! position, never by value: SPEC §5.6.5), gets `{"error": "..."}`.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt as _;
use ruma::{OwnedServerName, OwnedUserId};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::bus::BusError;
use crate::fetch::queue::FetchQueue;
use crate::fetch::resync::{self, Requested, ResyncError};
use crate::shutdown::Shutdown;
use crate::store::Store;
use crate::store::query::UserView;

/// Subject of the query RPC.
pub const QUERY_SUBJECT: &str = "devicelist.rpc.query";
/// Subject of the resync RPC.
pub const RESYNC_SUBJECT: &str = "devicelist.rpc.resync";
/// Queue group shared by all replicas.
pub const QUEUE_GROUP: &str = "device-list-updater";
/// Most users in one query.
pub const MAX_QUERY_USERS: usize = 1000;
/// The resync reply's error for a user that shares no room (SPEC §5.5.6).
const UNTRACKED: &str = "the user shares no room with us, so it is not tracked";
/// Resync wait when the request gives none.
const DEFAULT_RESYNC_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest resync wait accepted.
const MAX_RESYNC_TIMEOUT: Duration = Duration::from_secs(300);

/// What the RPC handlers need.
#[derive(Clone)]
pub struct Rpc {
    /// Core NATS (subscriptions and replies).
    pub client: async_nats::Client,
    /// The database.
    pub store: Store,
    /// Our server: its users are not fetched.
    pub own_server: OwnedServerName,
    /// Where a resync's user goes to be fetched.
    pub queue: FetchQueue,
}

#[derive(Deserialize)]
struct QueryRequest {
    user_ids: Vec<String>,
}

/// The query RPC's reply (SPEC §4.4), also what `admin user` prints.
#[derive(Serialize)]
pub struct QueryReply<'a> {
    users: BTreeMap<&'a str, UserWire<'a>>,
}

impl<'a> QueryReply<'a> {
    /// The reply for stored `views`.
    pub fn new(views: &'a BTreeMap<String, UserView>) -> QueryReply<'a> {
        QueryReply {
            users: views
                .iter()
                .map(|(user, view)| (user.as_str(), user_wire(view)))
                .collect(),
        }
    }
}

#[derive(Serialize)]
struct UserWire<'a> {
    tracked: bool,
    stale: bool,
    stream_id: Option<i64>,
    devices: BTreeMap<&'a str, DeviceWire<'a>>,
    master_key: Option<Box<RawValue>>,
    self_signing_key: Option<Box<RawValue>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    shared_rooms: Option<u32>,
}

#[derive(Serialize)]
struct DeviceWire<'a> {
    display_name: Option<&'a str>,
    keys: Option<Box<RawValue>>,
}

#[derive(Deserialize)]
struct ResyncRpcRequest {
    user_id: String,
    timeout_ms: Option<u64>,
}

#[derive(Serialize)]
struct ResyncReply<'a> {
    user_id: &'a str,
    synced: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

fn raw(json: Option<&str>) -> Option<Box<RawValue>> {
    json.and_then(|j| RawValue::from_string(j.to_owned()).ok())
}

fn error_reply(error: impl std::fmt::Display) -> Vec<u8> {
    serde_json::json!({"error": error.to_string()})
        .to_string()
        .into_bytes()
}

impl Rpc {
    /// Subscribes to both subjects. Done before the worker reports started,
    /// so a request sent right after start finds a responder.
    pub async fn subscribe(self) -> Result<Subscribed, BusError> {
        let subscribe =
            |subject: &'static str| self.client.queue_subscribe(subject, QUEUE_GROUP.to_owned());
        let query = subscribe(QUERY_SUBJECT)
            .await
            .map_err(BusError::jetstream(format!(
                "cannot subscribe to {QUERY_SUBJECT}"
            )))?;
        let resync = subscribe(RESYNC_SUBJECT)
            .await
            .map_err(BusError::jetstream(format!(
                "cannot subscribe to {RESYNC_SUBJECT}"
            )))?;
        // Make sure the server has the subscriptions before anyone asks.
        self.client
            .flush()
            .await
            .map_err(BusError::jetstream("cannot reach NATS"))?;
        Ok(Subscribed {
            rpc: self,
            query,
            resync,
        })
    }

    async fn reply(&self, message: &async_nats::Message, body: Vec<u8>) {
        let Some(reply) = &message.reply else { return };
        if let Err(e) = self.client.publish(reply.clone(), body.into()).await {
            tracing::warn!(error = %e, "cannot send an RPC reply");
        }
    }

    /// Answers a query request.
    pub async fn query(&self, body: &[u8]) -> Vec<u8> {
        let request: QueryRequest = match serde_json::from_slice(body) {
            Ok(r) => r,
            Err(e) => return error_reply(format!("expected {{\"user_ids\": [...]}}: {e}")),
        };
        if request.user_ids.len() > MAX_QUERY_USERS {
            return error_reply(format!("at most {MAX_QUERY_USERS} users per query"));
        }
        // Only user ids (SPEC §5.6.5): the error names the entry by its
        // position, never its value (it may be a member key).
        if let Some(position) = request
            .user_ids
            .iter()
            .position(|id| OwnedUserId::try_from(id.as_str()).is_err())
        {
            return error_reply(format!("user_ids[{position}] is not a user id"));
        }
        let views = match self.store.query_users(&request.user_ids).await {
            Ok(views) => views,
            Err(e) => return error_reply(format!("database: {e}")),
        };
        serde_json::to_vec(&QueryReply::new(&views)).unwrap_or_else(error_reply)
    }

    /// Answers a resync request: marks the user stale, enqueues its server's
    /// job and waits until the user is fresh or the timeout passes.
    pub async fn resync(&self, body: &[u8]) -> Vec<u8> {
        let request: ResyncRpcRequest = match serde_json::from_slice(body) {
            Ok(r) => r,
            Err(e) => return error_reply(format!("expected {{\"user_id\": \"@a:b\"}}: {e}")),
        };
        let timeout = request
            .timeout_ms
            .map(Duration::from_millis)
            .unwrap_or(DEFAULT_RESYNC_TIMEOUT)
            .min(MAX_RESYNC_TIMEOUT);
        let reply = |synced: bool, error: Option<String>| {
            serde_json::to_vec(&ResyncReply {
                user_id: &request.user_id,
                synced,
                error,
            })
            .unwrap_or_else(error_reply)
        };
        // Only a user id (SPEC §5.6.5); not echoed back (it may be a
        // member key).
        let Ok(user) = OwnedUserId::try_from(request.user_id.as_str()) else {
            return error_reply("user_id is not a user id");
        };
        if user.server_name() == self.own_server {
            return reply(false, Some("the user is on our own server".into()));
        }
        let deadline = tokio::time::Instant::now() + timeout;
        match tokio::time::timeout_at(deadline, self.resync_user(&user)).await {
            Ok(Ok(Requested::MarkedStale)) => reply(true, None),
            Ok(Ok(Requested::Untracked)) => reply(false, Some(UNTRACKED.into())),
            Ok(Err(e)) => reply(false, Some(e.to_string())),
            Err(_) => {
                let last = self.store.stale_state(&user).await.ok().flatten();
                let error = last
                    .and_then(|(_, error)| error)
                    .unwrap_or_else(|| "timed out before the list was fetched".into());
                reply(false, Some(error))
            }
        }
    }

    /// Marks `user` stale and waits until its mark is gone: `MarkedStale`
    /// when a fetch stored the list, `Untracked` when the user shares no
    /// room (at the request, or by the time its mark went: untracking
    /// removes the mark without a fetch, SPEC §5.5.4).
    async fn resync_user(&self, user: &OwnedUserId) -> Result<Requested, ResyncError> {
        // The request runs in a task of its own: the stale mark and the job
        // must be stored even when the reply's timeout passes first (a slow
        // database), or the reply would say "not synced" of a user nobody
        // fetches. Dropping the handle on timeout does not cancel the task.
        let requested = {
            let (store, queue, user) = (self.store.clone(), self.queue.clone(), user.clone());
            tokio::spawn(async move { resync::request(&store, &queue, &user).await })
        };
        match requested.await {
            Ok(Ok(Requested::MarkedStale)) => {}
            Ok(result) => return result,
            Err(e) => return Err(ResyncError::Interrupted(e.to_string())),
        }
        // The fetch may run on any replica, so the database is the place to
        // watch. Checks start fast and slow down to 4 per second.
        let mut pause = Duration::from_millis(10);
        loop {
            let mark = self.store.stale_state(user).await;
            // Sharing is read after the mark: untracking removes the mark
            // and the sharing in one transaction, so a mark seen gone here
            // with the user still sharing was ended by a fetch. A user that
            // stopped sharing is not fetched, and its mark may stay until
            // its room's sweep: it is answered for at once.
            let shares = match self.store.membership() {
                true => self.store.shared_rooms(&[user.as_str()]).await.ok(),
                false => None,
            };
            if shares.is_some_and(|shared| !shared.contains_key(user)) {
                return Ok(Requested::Untracked);
            }
            match mark {
                Ok(None) => return Ok(Requested::MarkedStale),
                Ok(Some(_)) => {}
                Err(e) => tracing::debug!(error = %e, "resync: cannot read the stale mark"),
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(250));
        }
    }
}

/// The RPC handlers with their subscriptions in place.
pub struct Subscribed {
    rpc: Rpc,
    query: async_nats::Subscriber,
    resync: async_nats::Subscriber,
}

impl Subscribed {
    /// Serves both RPCs until `shutdown` turns true.
    pub async fn run(mut self, shutdown: Shutdown) {
        let mut running = tokio::task::JoinSet::new();
        loop {
            tokio::select! {
                Some(message) = self.query.next() => {
                    let rpc = self.rpc.clone();
                    running.spawn(async move { rpc.reply(&message, rpc.query(&message.payload).await).await });
                }
                Some(message) = self.resync.next() => {
                    let rpc = self.rpc.clone();
                    running.spawn(async move { rpc.reply(&message, rpc.resync(&message.payload).await).await });
                }
                () = shutdown.requested() => break,
                else => break,
            }
            while running.try_join_next().is_some() {}
        }
        running.abort_all();
    }
}

fn user_wire(view: &UserView) -> UserWire<'_> {
    UserWire {
        tracked: view.tracked,
        stale: view.stale,
        stream_id: view.stream_id,
        devices: view
            .devices
            .iter()
            .map(|(id, d)| {
                (
                    id.as_str(),
                    DeviceWire {
                        display_name: d.display_name.as_deref(),
                        keys: raw(d.keys.as_deref()),
                    },
                )
            })
            .collect(),
        master_key: raw(view.master_key.as_deref()),
        self_signing_key: raw(view.self_signing_key.as_deref()),
        shared_rooms: view.shared_rooms,
    }
}
