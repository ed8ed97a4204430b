//! Rooms decide who is tracked (SPEC §5.5, §5.6), end to end through a real
//! nats-server on SQLite and PostgreSQL, with a mock fleet of remote servers.
//! After every test: no federation request, key change or RPC reply names a
//! member key.

mod common;

use std::time::Duration;

use common::fetch_env::{Env, update};
use common::rooms::{
    link, lists, member, membership, query, shared_rooms, wait_rows_gone, wait_shared,
};
use common::{Backend, publish, read_stream, wait_stream};
use device_list_updater::config::Switch;
use device_list_updater::input::partition::partition_of_key;
use device_list_updater::testkit::remote::{Reply, device_list};
use serde_json::{Value, json};

const ME: &str = "@me:our.example";
const BOB: &str = "@bob:remote.example";
const CAROL: &str = "@carol:other.example";
const DAN: &str = "@dan:remote.example";
const SERVERS: &[&str] = &["remote.example", "other.example"];
/// Member keys: `@` + 43 characters of URL-safe base64.
const BOB_KEY: &str = "@l8Hft5qXKn1vfHrg3p4-W8gELQVo8N13JkluMfmn2sQ";
const MY_KEY: &str = "@AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";

async fn env(backend: Backend, member_keys: bool) -> Env {
    Env::start(backend, SERVERS, Duration::ZERO, |config| {
        config.settings.membership = Switch::On;
        if member_keys {
            config.settings.msc4430 = Switch::On;
        }
    })
    .await
}

/// No request, key change or reply named a member key.
async fn no_key_named(env: &Env) {
    for path in env.fleet.raw_paths() {
        assert!(
            !path.contains("l8Hft5") && !path.contains("AAAAAAAA"),
            "a request named a key: {path}"
        );
    }
    for event in read_stream(&env.js, "KEY_CHANGE").await {
        let text = event.json.to_string();
        assert!(!text.contains(BOB_KEY) && !text.contains(MY_KEY), "{text}");
        let user = event.header("user_id").unwrap_or_default();
        assert!(user.contains(':'), "key change for {user}");
    }
}

/// §5.5.1, 3, 4, 6: join → fetch; a second room → no fetch; the last leave
/// untracks without a key change; updates for the untracked are dropped;
/// a rejoin fetches again.
async fn join_fetch_leave_untrack_rejoin(backend: Backend) {
    let env = env(backend, false).await;
    lists(&env, BOB, 2);
    member(&env, "!a:our.example", ME, "join", 1).await;
    member(&env, "!a:our.example", BOB, "join", 2).await;
    env.wait_fresh(BOB, 1).await;
    wait_stream(&env.js, "KEY_CHANGE", 1).await;
    assert_eq!(env.devices(BOB).await, [("PHONE".to_owned(), false)]);
    assert_eq!(shared_rooms(&env, BOB).await, 1);

    member(&env, "!b:our.example", ME, "join", 1).await;
    member(&env, "!b:our.example", BOB, "join", 2).await;
    wait_shared(&env, BOB, 2).await;
    member(&env, "!a:our.example", BOB, "leave", 3).await;
    wait_shared(&env, BOB, 1).await;
    assert_eq!(env.fleet.requests(BOB), 1, "a further room fetches nothing");
    assert_eq!(env.devices(BOB).await.len(), 1, "still tracked");

    member(&env, "!b:our.example", BOB, "leave", 3).await;
    wait_shared(&env, BOB, 0).await;
    env.settled().await;
    assert!(env.devices(BOB).await.is_empty(), "untracked: devices gone");
    let view = query(&env, BOB).await;
    assert_eq!(view["tracked"], false, "{view}");
    assert_eq!(
        common::stream_len(&env.js, "KEY_CHANGE").await,
        1,
        "no key change"
    );

    // An update and a resync for an untracked user: nothing stored, no fetch.
    env.update(update(BOB, "LAPTOP", 20, &[], "Laptop")).await;
    env.resync(BOB).await;
    env.settled().await;
    assert!(env.devices(BOB).await.is_empty());
    assert!(!env.is_stale(BOB).await);
    assert_eq!(env.fleet.requests(BOB), 1);

    // Back in a shared room: its server stopped telling us, so fetch again.
    member(&env, "!b:our.example", BOB, "join", 4).await;
    env.wait_fresh(BOB, 2).await;
    common::eventually(Duration::from_secs(20), "refetched devices", || async {
        (env.devices(BOB).await.len() == 1).then_some(())
    })
    .await;
    no_key_named(&env).await;
}
both_backends!(join_leave_rejoin, join_fetch_leave_untrack_rejoin);

/// §5.5.2: a change not newer than the stored one is ignored.
async fn replayed_changes_are_ignored(backend: Backend) {
    let env = env(backend, false).await;
    lists(&env, BOB, 1);
    member(&env, "!a:our.example", ME, "join", 1).await;
    member(&env, "!a:our.example", BOB, "join", 5).await;
    member(&env, "!a:our.example", BOB, "leave", 4).await;
    member(&env, "!a:our.example", BOB, "leave", 5).await;
    env.wait_fresh(BOB, 1).await;
    env.settled().await;
    assert_eq!(
        shared_rooms(&env, BOB).await,
        1,
        "the older leaves were ignored"
    );
}
both_backends!(replays, replayed_changes_are_ignored);

/// §5.5.5: our last local identity leaving (a user id, or a key) untracks
/// every remote member of the room; a room becoming ours starts them.
async fn our_server_leaving_a_room(backend: Backend) {
    let env = env(backend, true).await;
    for user in [BOB, CAROL, DAN] {
        lists(&env, user, 1);
    }
    // Remote members first: the room is not ours yet, nobody is fetched.
    member(&env, "!a:our.example", BOB, "join", 1).await;
    member(&env, "!a:our.example", CAROL, "join", 2).await;
    env.settled().await;
    assert_eq!(env.fleet.total_requests(), 0);
    // Our user joins: the sweep starts both.
    member(&env, "!a:our.example", ME, "join", 3).await;
    env.wait_fresh(BOB, 1).await;
    env.wait_fresh(CAROL, 1).await;
    // Dan shares another room, ours through a verified member key of ME.
    link(&env, "!k:our.example", MY_KEY, Some(ME), true, 1).await;
    member(&env, "!k:our.example", MY_KEY, "join", 2).await;
    member(&env, "!k:our.example", DAN, "join", 3).await;
    env.wait_fresh(DAN, 1).await;

    member(&env, "!a:our.example", ME, "leave", 4).await;
    wait_shared(&env, BOB, 0).await;
    wait_shared(&env, CAROL, 0).await;
    // The sweep removes their rows, perhaps after the query shows them
    // untracked (it does from the leave on).
    wait_rows_gone(&env, BOB).await;
    wait_rows_gone(&env, CAROL).await;
    assert_eq!(
        shared_rooms(&env, DAN).await,
        1,
        "another room is untouched"
    );
    // The local key leaves: Dan goes too.
    member(&env, "!k:our.example", MY_KEY, "leave", 4).await;
    wait_shared(&env, DAN, 0).await;
    wait_rows_gone(&env, DAN).await;
    no_key_named(&env).await;
}
both_backends!(our_server_leaves, our_server_leaving_a_room);

/// §5.6: a key counts only through a verified link in its own room; the
/// verification flipping starts and ends sharing; a link never changes
/// user; link before or after the membership ends the same.
async fn member_key_links(backend: Backend) {
    let env = env(backend, true).await;
    lists(&env, BOB, 2);
    member(&env, "!a:our.example", ME, "join", 1).await;
    member(&env, "!b:our.example", ME, "join", 1).await;
    // Linked in room b, joined in room a: names nobody in a.
    link(&env, "!b:our.example", BOB_KEY, Some(BOB), true, 2).await;
    member(&env, "!a:our.example", BOB_KEY, "join", 2).await;
    // Joined in room c before a link is known, then an unverified link.
    member(&env, "!c:our.example", ME, "join", 1).await;
    member(&env, "!c:our.example", BOB_KEY, "join", 2).await;
    link(&env, "!c:our.example", BOB_KEY, Some(BOB), false, 3).await;
    env.settled().await;
    assert_eq!(shared_rooms(&env, BOB).await, 0);
    assert_eq!(env.fleet.requests(BOB), 0);

    // Verified: Bob shares room c and is fetched.
    link(&env, "!c:our.example", BOB_KEY, Some(BOB), true, 4).await;
    env.wait_fresh(BOB, 1).await;
    assert_eq!(shared_rooms(&env, BOB).await, 1);

    // Another user for the same key and room: dead-lettered, first link stays.
    link(&env, "!c:our.example", BOB_KEY, Some(CAROL), true, 5).await;
    let dead = wait_stream(&env.js, "DEVICE_LIST_DEAD", 1).await;
    assert_eq!(dead[0].subject, "devicelist.dead.link_conflict");
    assert_eq!(shared_rooms(&env, BOB).await, 1);
    assert_eq!(shared_rooms(&env, CAROL).await, 0);

    // Verification lost: as a leave; untracked.
    link(&env, "!c:our.example", BOB_KEY, Some(BOB), false, 6).await;
    wait_shared(&env, BOB, 0).await;
    env.settled().await;
    assert!(env.devices(BOB).await.is_empty());

    // Room b: the link came first; the membership now makes Bob share it.
    member(&env, "!b:our.example", BOB_KEY, "join", 3).await;
    env.wait_fresh(BOB, 2).await;
    wait_shared(&env, BOB, 1).await;
    no_key_named(&env).await;
}
both_backends!(member_keys, member_key_links);

/// §5.5.7, §5.6.2: each malformed message is dead-lettered alone, the good
/// ones of the same burst apply; with DLU_MSC4430=off a key is malformed.
async fn malformed_messages_alone(backend: Backend) {
    let env = env(backend, false).await;
    lists(&env, BOB, 1);
    let bad = [
        json!({"state_key": BOB, "membership": "join", "stream_ordering": 1}),
        membership("!a:our.example", "bob", "join", 1),
        membership("!a:our.example", BOB_KEY, "join", 1),
        membership("!a:our.example", BOB, "joined", 1),
        membership("!a:our.example", BOB, "join", -1),
        json!({"room_id": "!a:our.example", "state_key": BOB, "membership": "join",
               "stream_ordering": "x"}),
    ];
    publish(
        &env.js,
        "devicelist.in.membership",
        &membership("!a:our.example", ME, "join", 1).to_string(),
        None,
    )
    .await;
    for body in &bad {
        publish(&env.js, "devicelist.in.membership", &body.to_string(), None).await;
    }
    publish(
        &env.js,
        "devicelist.in.membership",
        &membership("!a:our.example", BOB, "join", 2).to_string(),
        None,
    )
    .await;
    // With member keys off, a member_key message is malformed too.
    link(&env, "!a:our.example", BOB_KEY, Some(BOB), true, 3).await;
    env.wait_fresh(BOB, 1).await;
    let dead = wait_stream(&env.js, "DEVICE_LIST_DEAD", bad.len() as u64 + 1).await;
    let mut reasons: Vec<&str> = dead.iter().map(|d| d.subject.as_str()).collect();
    reasons.sort_unstable();
    assert_eq!(
        reasons,
        [
            "devicelist.dead.invalid_identity",
            "devicelist.dead.invalid_identity",
            "devicelist.dead.invalid_identity",
            "devicelist.dead.invalid_membership",
            "devicelist.dead.invalid_room_id",
            "devicelist.dead.invalid_stream_ordering",
            "devicelist.dead.invalid_stream_ordering",
        ]
    );
    assert_eq!(shared_rooms(&env, BOB).await, 1);
}
both_backends!(malformed, malformed_messages_alone);

/// §5.5.8: with membership off, membership messages are acked and ignored
/// and every remote user is tracked as before.
async fn membership_off_ignores(backend: Backend) {
    let env = Env::start(backend, SERVERS, Duration::ZERO, |_| {}).await;
    lists(&env, BOB, 1);
    member(&env, "!a:our.example", ME, "join", 1).await;
    member(&env, "!a:our.example", BOB, "leave", 2).await;
    publish(&env.js, "devicelist.in.membership", "not json", None).await;
    env.update(update(BOB, "PHONE", 10, &[], "Phone")).await;
    env.wait_fresh(BOB, 1).await;
    env.settled().await;
    assert_eq!(common::stream_len(&env.js, "DEVICE_LIST_DEAD").await, 0);
    let view = query(&env, BOB).await;
    assert_eq!(view["tracked"], true);
    assert!(view.get("shared_rooms").is_none(), "{view}");
}
both_backends!(membership_off, membership_off_ignores);

/// §5.5.6: the resync RPC for a user sharing no room says so.
async fn resync_rpc_for_an_unshared_user(backend: Backend) {
    let env = env(backend, false).await;
    let client = env.nats.client().await;
    let body = json!({"user_id": BOB, "timeout_ms": 2000}).to_string();
    let reply = client
        .request("devicelist.rpc.resync", body.into())
        .await
        .expect("reply");
    common::assert_names_no_member_key(&reply.payload);
    let reply: Value = serde_json::from_slice(&reply.payload).expect("JSON");
    assert_eq!(reply["synced"], false);
    assert!(
        reply["error"]
            .as_str()
            .unwrap_or_default()
            .contains("shares no room"),
        "{reply}"
    );
    // `admin resync` says so too, and writes nothing.
    let resync = admin(&env, &["resync", BOB]).await;
    assert_eq!(resync["marked_stale"], false, "{resync}");
    assert!(!env.is_stale(BOB).await);
    assert_eq!(env.fleet.requests(BOB), 0);
}
both_backends!(resync_unshared, resync_rpc_for_an_unshared_user);

/// §5.5.4: a fetch in flight when its user is untracked stores nothing.
async fn untracked_during_a_fetch(backend: Backend) {
    // Every answer takes 2 s: long enough for the leave to be applied first.
    let env = Env::start(backend, SERVERS, Duration::from_secs(2), |config| {
        config.settings.membership = Switch::On;
    })
    .await;
    lists(&env, BOB, 1);
    member(&env, "!a:our.example", ME, "join", 1).await;
    member(&env, "!a:our.example", BOB, "join", 2).await;
    common::eventually(Duration::from_secs(20), "the fetch sent", || async {
        (env.fleet.requests(BOB) == 1).then_some(())
    })
    .await;
    member(&env, "!a:our.example", BOB, "leave", 3).await;
    wait_shared(&env, BOB, 0).await;
    let sample = r#"dlu_fetches_total{outcome="untracked",server="remote.example"}"#;
    common::eventually(Duration::from_secs(20), "the answer refused", || async {
        let (_, text) = common::http_get(env.worker.http_addr, "/metrics").await;
        (common::metric_sample(&text, sample) == Some(1.0)).then_some(())
    })
    .await;
    assert!(env.devices(BOB).await.is_empty(), "nothing stored");
    assert_eq!(query(&env, BOB).await["tracked"], false);
}
both_backends!(fetch_in_flight, untracked_during_a_fetch);

/// `admin …` with membership on, against the test's database and NATS.
async fn admin(env: &Env, args: &[&str]) -> Value {
    let output = tokio::process::Command::new(common::binary())
        .arg("admin")
        .args(args)
        .arg("--json")
        .env("DLU_DATABASE_URL", &env.db.url)
        .env("DLU_NATS_URL", &env.nats.url)
        .env("DLU_SERVER_NAME", common::OUR_SERVER)
        .env("DLU_MEMBERSHIP", "on")
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("runs");
    let out = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "admin {args:?} failed: {out}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("admin {args:?}: {e}: {out}"))
}

/// §5.5.3, §5.5.9: switching membership on for an existing database. Users
/// tracked before stay; those the republished members put in a room are not
/// fetched again; `admin untrack-unshared` lists the rest, `--apply`
/// untracks them. `admin rooms` shows the rooms and identities.
async fn switching_membership_on(backend: Backend) {
    let env = Env::start(backend, SERVERS, Duration::ZERO, |_| {}).await;
    lists(&env, BOB, 1);
    lists(&env, CAROL, 1);
    env.update(update(BOB, "PHONE", 10, &[], "Phone")).await;
    env.update(update(CAROL, "PHONE", 10, &[], "Phone")).await;
    env.wait_fresh(BOB, 1).await;
    env.wait_fresh(CAROL, 1).await;
    let mut env = env;
    env.config.settings.membership = Switch::On;
    env.config.settings.msc4430 = Switch::On;
    let env = env.restart(false).await;
    member(&env, "!a:our.example", ME, "join", 1).await;
    member(&env, "!a:our.example", BOB, "join", 2).await;
    link(&env, "!a:our.example", BOB_KEY, Some(BOB), true, 3).await;
    member(&env, "!a:our.example", BOB_KEY, "join", 4).await;
    wait_shared(&env, BOB, 1).await;
    env.settled().await;
    assert_eq!(
        env.fleet.requests(BOB),
        1,
        "already tracked: not fetched again"
    );

    let dry = admin(&env, &["untrack-unshared"]).await;
    assert_eq!(dry["unshared"], 1, "{dry}");
    assert_eq!(dry["users"], json!([CAROL]));
    assert_eq!(dry["applied"], false);
    assert_eq!(
        env.devices(CAROL).await.len(),
        1,
        "a dry run changes nothing"
    );
    let applied = admin(&env, &["untrack-unshared", "--apply"]).await;
    assert_eq!(applied["untracked"], 1, "{applied}");
    assert!(env.devices(CAROL).await.is_empty());
    assert_eq!(env.devices(BOB).await.len(), 1);
    let again = admin(&env, &["untrack-unshared"]).await;
    assert_eq!(again["unshared"], 0, "{again}");

    let rooms = admin(&env, &["rooms", BOB]).await;
    assert_eq!(
        rooms,
        json!({"user_id": BOB, "shared_rooms": 1, "rooms": [
            {"room_id": "!a:our.example", "shares": true, "ours": true,
             "identities": [BOB, BOB_KEY]}]})
    );
}
both_backends!(switch_on, switching_membership_on);

/// Input partitions in the membership tests.
const PARTITIONS: u16 = 8;

/// A room whose partition is not `user`'s (SPEC §4.5: membership goes by
/// room, updates by user).
fn room_apart_from(user: &str) -> String {
    (0..)
        .map(|n| format!("!r{n}:our.example"))
        .find(|room| partition_of_key(room, PARTITIONS) != partition_of_key(user, PARTITIONS))
        .unwrap_or_default()
}

/// Messages the ingest of `partition` has been delivered.
async fn delivered(env: &Env, partition: u16) -> u64 {
    let stream = env
        .js
        .get_stream("DEVICE_LIST_INPUT_PARTS")
        .await
        .expect("the partitions stream");
    let mut consumer: async_nats::jetstream::consumer::PullConsumer = stream
        .get_consumer(&format!("device-list-updater-part-{partition}"))
        .await
        .expect("the partition's consumer");
    consumer
        .info()
        .await
        .expect("info")
        .delivered
        .consumer_sequence
}

/// Bob's end state: his devices, whether he is stale, tracked, and how
/// many rooms he shares with us.
async fn bob_now(env: &Env) -> (Vec<(String, bool)>, bool, Value, Value) {
    let view = query(env, BOB).await;
    (
        env.devices(BOB).await,
        env.is_stale(BOB).await,
        view["tracked"].clone(),
        view["shared_rooms"].clone(),
    )
}

/// Waits until Bob's devices are `devices` (a fetch writes after its
/// request has been counted).
async fn wait_devices(env: &Env, devices: &[&str]) {
    let want: Vec<(String, bool)> = devices.iter().map(|d| ((*d).to_owned(), false)).collect();
    common::eventually(Duration::from_secs(20), "Bob's devices", || async {
        (env.devices(BOB).await == want).then_some(())
    })
    .await;
}

/// SPEC §4.5 with §5.5: with input partitions, Bob's join (the room's
/// partition) and his update (his own) may apply in either order. Applied
/// one way and then the other (each waited for before the next is sent),
/// Bob ends tracked with both devices: the update first is dropped (Bob is
/// not tracked yet) and the join's fetch brings the device; the join first
/// fetches, and the update then applies on top.
async fn join_and_update_in_either_order(backend: Backend) {
    let room = room_apart_from(BOB);
    let mut ends = Vec::new();
    for join_first in [true, false] {
        let env = env_partitioned(backend).await;
        member(&env, &room, ME, "join", 1).await;
        env.settled().await;
        let laptop = update(BOB, "LAPTOP", 20, &[10], "Laptop");
        if join_first {
            lists(&env, BOB, 1);
            member(&env, &room, BOB, "join", 2).await;
            env.wait_fresh(BOB, 1).await;
            wait_devices(&env, &["PHONE"]).await;
            env.update(laptop).await;
        } else {
            // What Bob's server answers once the update was made.
            let list = device_list(BOB, 20, &[("LAPTOP", "Laptop"), ("PHONE", "Phone")]);
            env.fleet.script(BOB, vec![Reply::Json(list)]);
            env.update(laptop).await;
            env.settled().await;
            assert!(env.devices(BOB).await.is_empty(), "Bob is not tracked yet");
            member(&env, &room, BOB, "join", 2).await;
            env.wait_fresh(BOB, 1).await;
        }
        env.settled().await;
        wait_devices(&env, &["LAPTOP", "PHONE"]).await;
        assert_in_two_partitions(&env, &room).await;
        ends.push(bob_now(&env).await);
    }
    assert_eq!(ends[0], ends[1], "the same end, whichever applied first");
    assert_eq!((ends[0].1, &ends[0].2), (false, &json!(true)), "{ends:?}");
}
both_backends!(partitions_join_and_update, join_and_update_in_either_order);

/// SPEC §4.5 with §5.5.4: Bob's last leave and his update, in either
/// order: he ends untracked with nothing stored.
async fn leave_and_update_in_either_order(backend: Backend) {
    let room = room_apart_from(BOB);
    let mut ends = Vec::new();
    for leave_first in [true, false] {
        let env = env_partitioned(backend).await;
        lists(&env, BOB, 1);
        member(&env, &room, ME, "join", 1).await;
        member(&env, &room, BOB, "join", 2).await;
        env.wait_fresh(BOB, 1).await;
        wait_devices(&env, &["PHONE"]).await;
        let laptop = update(BOB, "LAPTOP", 20, &[10], "Laptop");
        if leave_first {
            member(&env, &room, BOB, "leave", 3).await;
            env.settled().await;
            wait_rows_gone(&env, BOB).await;
            env.update(laptop).await;
        } else {
            env.update(laptop).await;
            env.settled().await;
            wait_devices(&env, &["LAPTOP", "PHONE"]).await;
            member(&env, &room, BOB, "leave", 3).await;
        }
        env.settled().await;
        wait_rows_gone(&env, BOB).await;
        assert_in_two_partitions(&env, &room).await;
        ends.push(bob_now(&env).await);
    }
    assert_eq!(ends[0], ends[1], "the same end, whichever applied first");
    assert_eq!(ends[0].2, json!(false), "{ends:?}");
}
both_backends!(
    partitions_leave_and_update,
    leave_and_update_in_either_order
);

/// A membership worker with input partitions.
async fn env_partitioned(backend: Backend) -> Env {
    Env::start(backend, SERVERS, Duration::ZERO, |config| {
        config.settings.membership = Switch::On;
        config.settings.input_partitions = PARTITIONS;
    })
    .await
}

/// The room's messages and Bob's update went through different partitions.
async fn assert_in_two_partitions(env: &Env, room: &str) {
    let (room_part, bob_part) = (
        partition_of_key(room, PARTITIONS),
        partition_of_key(BOB, PARTITIONS),
    );
    assert_ne!(room_part, bob_part);
    assert!(delivered(env, room_part).await >= 2, "the room's partition");
    assert!(delivered(env, bob_part).await >= 1, "Bob's partition");
}
