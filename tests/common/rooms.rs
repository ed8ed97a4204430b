//! Room input for the membership tests (SPEC §5.5, §5.6): publishing
//! membership and member-key changes, and reading what the query RPC says.
//! Every change gives the fleet's request-loop guard a reason: a room change
//! may start anyone's tracking.

use std::time::Duration;

use device_list_updater::testkit::remote::{Reply, device_list};
use serde_json::{Value, json};

use super::fetch_env::Env;
use super::publish;

/// A membership change's body.
pub fn membership(room: &str, who: &str, membership: &str, at: i64) -> Value {
    json!({"room_id": room, "state_key": who, "membership": membership, "stream_ordering": at})
}

/// Publishes a membership change.
pub async fn member(env: &Env, room: &str, who: &str, what: &str, at: i64) {
    env.fleet.room_reason();
    let body = membership(room, who, what, at).to_string();
    publish(&env.js, "devicelist.in.membership", &body, None).await;
}

/// Publishes a member key's link.
pub async fn link(env: &Env, room: &str, key: &str, user: Option<&str>, verified: bool, at: i64) {
    env.fleet.room_reason();
    let body = json!({"room_id": room, "member_key": key, "user_id": user,
                      "verified": verified, "stream_ordering": at});
    publish(&env.js, "devicelist.in.member_key", &body.to_string(), None).await;
}

/// Scripts one device list for `user` per future fetch (stream ids 10, 11, …).
pub fn lists(env: &Env, user: &str, fetches: usize) {
    let replies = (0..fetches)
        .map(|n| Reply::Json(device_list(user, 10 + n as i64, &[("PHONE", "Phone")])))
        .collect();
    env.fleet.script(user, replies);
}

/// Sends an RPC request and reads its JSON reply (which never names a
/// member key).
pub async fn rpc(env: &Env, subject: &str, body: Value) -> Value {
    let client = env.nats.client().await;
    let reply = tokio::time::timeout(
        Duration::from_secs(30),
        client.request(subject.to_owned(), body.to_string().into()),
    )
    .await
    .expect("a reply in time")
    .expect("request");
    super::assert_names_no_member_key(&reply.payload);
    serde_json::from_slice(&reply.payload).expect("JSON")
}

/// What the query RPC says of `user`.
pub async fn query(env: &Env, user: &str) -> Value {
    let reply = rpc(env, "devicelist.rpc.query", json!({"user_ids": [user]})).await;
    reply["users"][user].clone()
}

/// The rooms `user` shares with us, as the query RPC says.
pub async fn shared_rooms(env: &Env, user: &str) -> Value {
    query(env, user).await["shared_rooms"].clone()
}

/// Waits until `user` shares `n` rooms (as the query RPC reports).
pub async fn wait_shared(env: &Env, user: &str, n: u64) {
    super::eventually(
        Duration::from_secs(20),
        &format!("{user} shares {n} rooms"),
        || async { (shared_rooms(env, user).await == json!(n)).then_some(()) },
    )
    .await;
}

/// Waits until nothing is stored for `user` (its devices and stale mark
/// gone): untracked, and its rows removed, perhaps by a room's sweep after
/// the query already showed it untracked.
pub async fn wait_rows_gone(env: &Env, user: &str) {
    super::eventually(
        Duration::from_secs(20),
        &format!("{user}'s rows removed"),
        || async {
            (env.devices(user).await.is_empty() && !env.is_stale(user).await).then_some(())
        },
    )
    .await;
}
