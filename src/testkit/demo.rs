//! The newcomer demo (`scripts/demo`): the whole pipeline on one machine. A
//! private nats-server, a SQLite file, an in-process mock remote homeserver,
//! a worker, a few updates, and the key changes they cause, printed as they
//! arrive.

use std::io::Write;
use std::time::Duration;

use async_nats::jetstream;
use serde_json::json;

use super::remote::{MockFederation, Reply, device_keys, device_list};
use super::{Nats, stream_len, wait_for};
use crate::config::{Config, Settings};
use crate::signing_key::SigningKey;
use crate::worker;

const ALICE: &str = "@alice:remote.example";

/// Runs the demo, writing what happens to `out`. Panics if a step does not
/// happen within 20 seconds (it is a demo, not a service).
pub async fn run(out: &mut (impl Write + Send)) {
    let mut say = |line: String| {
        let _ = writeln!(out, "{line}");
    };
    let nats = Nats::start().await;
    let dir = tempfile::tempdir().expect("temporary directory");
    let key = SigningKey::generate().expect("signing key");
    let database_url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("demo.sqlite").display()
    );
    let mut config = Config::for_tests("our.example", &nats.url, &database_url);
    config.signing_key = key;
    config.settings.retry_min = Duration::from_secs(1);
    config.settings.retry_max = Duration::from_secs(10);
    config.settings.lease_ttl = Duration::from_secs(10);
    config.settings.ack_wait = Duration::from_secs(30);
    config.settings.fetch_concurrency = Settings::default().fetch_concurrency;
    let fleet = MockFederation::trusting(&config, Duration::from_millis(50)).await;
    fleet.serve(&mut config, ["remote.example"]);
    fleet.script(
        ALICE,
        vec![Reply::Json(device_list(
            ALICE,
            1,
            &[("PHONE", "Alice's phone"), ("LAPTOP", "Alice's laptop")],
        ))],
    );
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
    let mut seen = 0;

    say(String::new());
    say(format!(
        "1. {ALICE} changes a device; we have never seen her (prev_id []),"
    ));
    say("   so her list is stale and is fetched from remote.example:".into());
    publish(&js, json!({"user_id": ALICE, "device_id": "PHONE", "stream_id": 1, "prev_id": [],
                        "device_display_name": "Alice's phone", "keys": device_keys(ALICE, "PHONE")})).await;
    seen = print_key_changes(&js, seen, 2, &mut say).await;
    say(format!(
        "   requests to remote.example: {}",
        fleet.requests(ALICE)
    ));

    say(String::new());
    say("2. She renames her phone (stream 2 follows 1): applied, no fetch:".into());
    publish(&js, json!({"user_id": ALICE, "device_id": "PHONE", "stream_id": 2, "prev_id": [1],
                        "device_display_name": "Alice's new phone", "keys": device_keys(ALICE, "PHONE")})).await;
    seen = print_key_changes(&js, seen, 1, &mut say).await;

    say(String::new());
    say("3. She deletes her laptop (stream 3 follows 2):".into());
    publish(&js, json!({"user_id": ALICE, "device_id": "LAPTOP", "stream_id": 3, "prev_id": [2], "deleted": true})).await;
    print_key_changes(&js, seen, 1, &mut say).await;
    say(format!(
        "   requests to remote.example in all: {}",
        fleet.requests(ALICE)
    ));

    say(String::new());
    say("4. What is stored now (the devicelist.rpc.query reply):".into());
    let client = nats.client().await;
    let reply = client
        .request(
            "devicelist.rpc.query",
            json!({"user_ids": [ALICE]}).to_string().into(),
        )
        .await
        .expect("query reply");
    let reply: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap_or_default();
    let user = &reply["users"][ALICE];
    say(format!(
        "   tracked: {}, stale: {}, stream_id: {}",
        user["tracked"], user["stale"], user["stream_id"]
    ));
    if let Some(devices) = user["devices"].as_object() {
        for (id, device) in devices {
            say(format!("   device {id}: {}", device["display_name"]));
        }
    }
    running.stop(Duration::from_secs(10)).await;
    say(String::new());
    say("Done. The same flow runs in production against your homeserver's NATS.".into());
}

async fn publish(js: &jetstream::Context, body: serde_json::Value) {
    js.publish("devicelist.in.update", body.to_string().into())
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
