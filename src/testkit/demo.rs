//! The newcomer demos (`scripts/demo`, `scripts/demo rooms`): the whole
//! pipeline on one machine. A private nats-server, a SQLite file, an
//! in-process mock remote homeserver, a worker, a few updates (and, in the
//! rooms demo, room memberships), and the key changes they cause, printed as
//! they arrive.

use std::io::Write;
use std::time::Duration;

use async_nats::jetstream;
use serde_json::json;

use super::remote::{MockFederation, Reply, device_keys, device_list};
use super::{Nats, stream_len, wait_for};
use crate::config::{Config, Settings};
use crate::server_key::ServerKey;
use crate::worker;

const ALICE: &str = "@alice:remote.example";
const BOB: &str = "@bob:remote.example";
const ME: &str = "@me:our.example";
const ROOM: &str = "!room:our.example";
const UPDATE: &str = "devicelist.in.update";
const MEMBERSHIP: &str = "devicelist.in.membership";

/// What both demos run on: NATS, a SQLite file, the mock remote server and
/// the worker.
struct Stage {
    nats: Nats,
    _dir: tempfile::TempDir,
    fleet: MockFederation,
    running: worker::Running,
    js: jetstream::Context,
}

impl Stage {
    /// Starts everything; `tune` adjusts the worker's configuration.
    async fn start(say: &mut impl FnMut(String), tune: impl FnOnce(&mut Config)) -> Stage {
        let nats = Nats::start().await;
        let dir = tempfile::tempdir().expect("temporary directory");
        let key = ServerKey::generate().expect("signing key");
        let database_url = format!(
            "sqlite://{}?mode=rwc",
            dir.path().join("demo.sqlite").display()
        );
        let mut config = Config::for_tests("our.example", &nats.url, &database_url);
        config.server_key = key;
        config.settings.retry_min = Duration::from_secs(1);
        config.settings.retry_max = Duration::from_secs(10);
        config.settings.lease_ttl = Duration::from_secs(10);
        config.settings.ack_wait = Duration::from_secs(30);
        config.settings.fetch_concurrency = Settings::default().fetch_concurrency;
        tune(&mut config);
        let fleet = MockFederation::trusting(&config, Duration::from_millis(50)).await;
        fleet.serve(&mut config, ["remote.example"]);
        say(format!("nats-server with JetStream at {}", nats.url));
        say(format!(
            "mock homeserver remote.example at {} (checks X-Matrix signatures)",
            fleet.base_url()
        ));
        let running = worker::start(config).await.expect("worker starts");
        say(format!(
            "worker started; health and metrics at http://{}/metrics",
            running.http_addr
        ));
        let js = nats.js().await;
        Stage {
            nats,
            _dir: dir,
            fleet,
            running,
            js,
        }
    }

    /// The `devicelist.rpc.query` view of `user`.
    async fn query(&self, user: &str) -> serde_json::Value {
        let client = self.nats.client().await;
        let reply = client
            .request(
                "devicelist.rpc.query",
                json!({"user_ids": [user]}).to_string().into(),
            )
            .await
            .expect("query reply");
        let reply: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap_or_default();
        reply["users"][user].clone()
    }
}

/// Runs the demo, writing what happens to `out`. Panics if a step does not
/// happen within 20 seconds (it is a demo, not a service).
pub async fn run(out: &mut (impl Write + Send)) {
    let mut say = |line: String| {
        let _ = writeln!(out, "{line}");
    };
    let stage = Stage::start(&mut say, |_| {}).await;
    stage.fleet.script(
        ALICE,
        vec![Reply::Json(device_list(
            ALICE,
            1,
            &[("PHONE", "Alice's phone"), ("LAPTOP", "Alice's laptop")],
        ))],
    );
    let (js, fleet) = (&stage.js, &stage.fleet);
    let mut seen = 0;

    say(String::new());
    say(format!(
        "1. {ALICE} changes a device; we have never seen her (prev_id []),"
    ));
    say("   so her list is stale and is fetched from remote.example:".into());
    publish(js, UPDATE, json!({"user_id": ALICE, "device_id": "PHONE", "stream_id": 1, "prev_id": [],
                        "device_display_name": "Alice's phone", "keys": device_keys(ALICE, "PHONE")})).await;
    seen = print_key_changes(js, seen, 2, &mut say).await;
    say(format!(
        "   requests to remote.example: {}",
        fleet.requests(ALICE)
    ));

    say(String::new());
    say("2. She renames her phone (stream 2 follows 1): applied, no fetch:".into());
    publish(js, UPDATE, json!({"user_id": ALICE, "device_id": "PHONE", "stream_id": 2, "prev_id": [1],
                        "device_display_name": "Alice's new phone", "keys": device_keys(ALICE, "PHONE")})).await;
    seen = print_key_changes(js, seen, 1, &mut say).await;

    say(String::new());
    say("3. She deletes her laptop (stream 3 follows 2):".into());
    publish(js, UPDATE, json!({"user_id": ALICE, "device_id": "LAPTOP", "stream_id": 3, "prev_id": [2], "deleted": true})).await;
    print_key_changes(js, seen, 1, &mut say).await;
    say(format!(
        "   requests to remote.example in all: {}",
        fleet.requests(ALICE)
    ));

    say(String::new());
    say("4. What is stored now (the devicelist.rpc.query reply):".into());
    let user = stage.query(ALICE).await;
    say(format!(
        "   tracked: {}, stale: {}, stream_id: {}",
        user["tracked"], user["stale"], user["stream_id"]
    ));
    if let Some(devices) = user["devices"].as_object() {
        for (id, device) in devices {
            say(format!("   device {id}: {}", device["display_name"]));
        }
    }
    stage.running.stop(Duration::from_secs(10)).await;
    say(String::new());
    say("Done. The same flow runs in production against your homeserver's NATS.".into());
}

/// The rooms demo (`scripts/demo rooms`): with `DLU_MEMBERSHIP=on`, rooms
/// decide who is tracked (SPEC §5.5). Bob joins a room our user is in and is
/// fetched; he leaves and is untracked; an update for him is then dropped.
pub async fn rooms(out: &mut (impl Write + Send)) {
    let mut say = |line: String| {
        let _ = writeln!(out, "{line}");
    };
    let stage = Stage::start(&mut say, |config| {
        config.settings.membership = crate::config::Switch::On;
    })
    .await;
    let (js, fleet) = (&stage.js, &stage.fleet);
    fleet.script(
        BOB,
        vec![Reply::Json(device_list(
            BOB,
            1,
            &[("PHONE", "Bob's phone")],
        ))],
    );
    let membership = |who: &str, what: &str, at: i64| json!({"room_id": ROOM, "state_key": who, "membership": what, "stream_ordering": at});
    let mut seen = 0;

    say(String::new());
    say(format!(
        "1. Our user {ME} joins {ROOM}; then {BOB} joins it."
    ));
    say("   He now shares a room with us, so his devices are fetched:".into());
    publish(js, MEMBERSHIP, membership(ME, "join", 1)).await;
    publish(js, MEMBERSHIP, membership(BOB, "join", 2)).await;
    seen = print_key_changes(js, seen, 1, &mut say).await;
    let bob = stage.query(BOB).await;
    say(format!(
        "   tracked: {}, shared_rooms: {}, requests to remote.example: {}",
        bob["tracked"],
        bob["shared_rooms"],
        fleet.requests(BOB)
    ));

    say(String::new());
    say("2. He renames his phone (stream 2 follows 1): applied, no fetch:".into());
    publish(js, UPDATE, json!({"user_id": BOB, "device_id": "PHONE", "stream_id": 2, "prev_id": [1],
                        "device_display_name": "Bob's new phone", "keys": device_keys(BOB, "PHONE")})).await;
    print_key_changes(js, seen, 1, &mut say).await;

    say(String::new());
    say("3. He leaves the room: he shares none with us now, so he is untracked".into());
    say("   (devices and stream state removed, no key change):".into());
    publish(js, MEMBERSHIP, membership(BOB, "leave", 3)).await;
    let bob = wait_for(Duration::from_secs(20), "Bob untracked", || async {
        let bob = stage.query(BOB).await;
        (bob["tracked"] == false).then_some(bob)
    })
    .await;
    say(format!(
        "   tracked: {}, shared_rooms: {}, devices: {}",
        bob["tracked"], bob["shared_rooms"], bob["devices"]
    ));

    say(String::new());
    say("4. An update for him now is acked and dropped: nothing stored, nothing fetched.".into());
    publish(
        js,
        UPDATE,
        json!({"user_id": BOB, "device_id": "LAPTOP", "stream_id": 3, "prev_id": [2],
                        "device_display_name": "Bob's laptop", "keys": device_keys(BOB, "LAPTOP")}),
    )
    .await;
    super::wait_input_drained(js).await;
    let bob = stage.query(BOB).await;
    say(format!(
        "   tracked: {}, key changes in all: {}, requests to remote.example in all: {}",
        bob["tracked"],
        stream_len(js, "KEY_CHANGE").await,
        fleet.requests(BOB)
    ));
    stage.running.stop(Duration::from_secs(10)).await;
    say(String::new());
    say(
        "Done. Publish your homeserver's joined members to switch this on (docs/membership.md)."
            .into(),
    );
}

async fn publish(js: &jetstream::Context, subject: &'static str, body: serde_json::Value) {
    js.publish(subject, body.to_string().into())
        .await
        .expect("publish")
        .await
        .expect("publish ack");
}

/// Waits for `more` key changes after the first `seen`, prints them, and
/// returns the new count.
async fn print_key_changes(
    js: &jetstream::Context,
    seen: u64,
    more: u64,
    say: &mut impl FnMut(String),
) -> u64 {
    let want = seen + more;
    wait_for(Duration::from_secs(20), "key changes", || async {
        (stream_len(js, "KEY_CHANGE").await >= want).then_some(())
    })
    .await;
    let stream = js.get_stream("KEY_CHANGE").await.expect("KEY_CHANGE");
    for sequence in seen + 1..=want {
        let Ok(message) = stream.get_raw_message(sequence).await else {
            continue;
        };
        let event: serde_json::Value = serde_json::from_slice(&message.payload).unwrap_or_default();
        say(format!(
            "   {} → {} {} {}{}",
            message.subject,
            event["user_id"].as_str().unwrap_or("?"),
            event["device_id"].as_str().unwrap_or("?"),
            event["display_name"],
            if event["deleted"] == true {
                " (deleted)"
            } else {
                ""
            },
        ));
    }
    want
}
