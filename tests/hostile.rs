//! Hostile input at volume: 100,000 malformed messages mixed into 100,000
//! good ones (`DLU_HOSTILE_N` changes both counts). Every good one is
//! applied (one key change each), every bad one is dead-lettered under its
//! reason, and the process's memory stays bounded.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream;
use common::{Backend, Nats, TestDb};
use device_list_updater::testkit::{stream_len, wait_for};
use device_list_updater::worker;
use sea_orm::{ActiveValue::Set, EntityTrait};
use serde_json::json;

/// Good users; each gets `n / USERS` chained updates.
const USERS: usize = 1000;

/// The bad message classes, cycled: (reason the worker must give, subject, origin, body).
fn bad(i: usize) -> (&'static str, &'static str, Option<&'static str>, String) {
    let user = format!("@bad{i}:remote.example");
    let update = "devicelist.in.update";
    match i % 12 {
        0 => ("not_json", update, None, format!("{{not json {i}")),
        1 => ("invalid_shape", update, None, format!("[{i}]")),
        2 => (
            "invalid_user_id",
            update,
            None,
            json!({"user_id": format!("nobody{i}"), "device_id": "D", "stream_id": 1}).to_string(),
        ),
        3 => (
            "invalid_device_id",
            update,
            None,
            json!({"user_id": user, "device_id": "D".repeat(256), "stream_id": 1}).to_string(),
        ),
        4 => (
            "invalid_stream_id",
            update,
            None,
            json!({"user_id": user, "device_id": "D", "stream_id": "soon"}).to_string(),
        ),
        5 => (
            "invalid_prev_id",
            update,
            None,
            json!({"user_id": user, "device_id": "D", "stream_id": 2000, "prev_id": (0..1001).collect::<Vec<_>>()})
                .to_string(),
        ),
        6 => (
            "invalid_field",
            update,
            None,
            json!({"user_id": user, "device_id": "D", "stream_id": 1, "device_display_name": "n".repeat(1025)})
                .to_string(),
        ),
        7 => (
            "invalid_keys",
            update,
            None,
            json!({"user_id": user, "device_id": "D", "stream_id": 1, "keys": 5}).to_string(),
        ),
        8 => (
            "origin_mismatch",
            update,
            Some("elsewhere.example"),
            json!({"user_id": user, "device_id": "D", "stream_id": 1}).to_string(),
        ),
        9 => (
            "invalid_signing_key",
            "devicelist.in.signing_key",
            None,
            json!({"user_id": user, "master_key": {"user_id": user, "usage": ["master"], "keys": {"ed25519:x": "short"}}})
                .to_string(),
        ),
        10 => (
            "invalid_user_id",
            "devicelist.in.resync",
            None,
            json!({"user_id": 42}).to_string(),
        ),
        // A few oversized ones (64 KiB each would make a very large stream).
        _ if i % 1200 == 11 => (
            "oversized",
            update,
            None,
            json!({"user_id": user, "device_id": "D", "stream_id": 1, "pad": "x".repeat(70_000)})
                .to_string(),
        ),
        _ => ("not_json", update, None, "\u{0}".repeat(i % 64 + 1)),
    }
}

fn good(user: usize, round: usize) -> String {
    let user_id = format!("@good{user}:remote.example");
    json!({"user_id": user_id, "device_id": "PHONE", "stream_id": round, "prev_id": [round - 1],
           "device_display_name": format!("phone {round}"),
           "keys": {"user_id": user_id, "device_id": "PHONE", "keys": {"ed25519:PHONE": format!("k{round}")}}})
    .to_string()
}

/// The process's resident memory. The bound below is the point of the test,
/// so a system without `/proc` fails it rather than passing unmeasured.
fn resident_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status")
        .expect("/proc/self/status (the memory bound needs Linux)");
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .expect("VmRSS in /proc/self/status")
}

async fn publish_all(js: &jetstream::Context, messages: Vec<(String, Option<&str>, String)>) {
    let mut acks = Vec::with_capacity(2048);
    for (subject, origin, body) in messages {
        let mut headers = async_nats::HeaderMap::new();
        if let Some(origin) = origin {
            headers.insert("origin", origin);
        }
        acks.push(
            js.publish_with_headers(subject, headers, body.into())
                .await
                .expect("publish"),
        );
        if acks.len() == 2048 {
            for ack in acks.drain(..) {
                ack.await.expect("publish ack");
            }
        }
    }
    for ack in acks {
        ack.await.expect("publish ack");
    }
}

async fn good_and_bad_at_volume(backend: Backend) {
    let n: usize = std::env::var("DLU_HOSTILE_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let rounds = n.div_ceil(USERS);
    let n_good = rounds * USERS;
    let nats = Nats::start().await;
    let db = TestDb::new(backend).await;
    let js = nats.js().await;
    let store = worker::open_store(&db.url, Duration::from_secs(10))
        .await
        .expect("store");
    let seeded: Vec<_> = (0..USERS)
        .map(|u| entity::remote_user::ActiveModel {
            user_id: Set(format!("@good{u}:remote.example")),
            server_name: Set("remote.example".into()),
            known_stream_ids: Set("[0]".into()),
            max_stream_id: Set(0),
            fetched_stream_id: Set(0),
            fetched_at_ms: Set(0),
        })
        .collect();
    for chunk in seeded.chunks(500) {
        entity::remote_user::Entity::insert_many(chunk.to_vec())
            .exec_without_returning(store.connection())
            .await
            .expect("seed");
    }
    common::create_input_stream(&js).await;

    // good and bad interleaved, one bad after each good one
    let mut expected: BTreeMap<&str, u64> = BTreeMap::new();
    let mut messages = Vec::with_capacity(2 * n_good);
    let mut i = 0;
    for round in 1..=rounds {
        for user in 0..USERS {
            messages.push(("devicelist.in.update".to_owned(), None, good(user, round)));
            let (reason, subject, origin, body) = bad(i);
            *expected.entry(reason).or_default() += 1;
            messages.push((subject.to_owned(), origin, body));
            i += 1;
        }
    }
    publish_all(&js, messages).await;
    let before = resident_kib();

    let running = worker::start(common::config(&nats, &db))
        .await
        .expect("worker");
    let mut peak = before;
    wait_for(
        Duration::from_secs(600),
        "every good and bad message handled",
        || {
            let js = js.clone();
            peak = peak.max(resident_kib());
            async move {
                let changes = stream_len(&js, "KEY_CHANGE").await;
                let dead = stream_len(&js, "DEVICE_LIST_DEAD").await;
                (changes >= n_good as u64 && dead >= n_good as u64).then_some(())
            }
        },
    )
    .await;

    assert_eq!(
        stream_len(&js, "KEY_CHANGE").await,
        n_good as u64,
        "one key change per good update"
    );
    let info = js
        .get_stream("DEVICE_LIST_DEAD")
        .await
        .expect("dead stream")
        .info_with_subjects("devicelist.dead.>")
        .await
        .expect("subjects");
    let mut dead: BTreeMap<String, u64> = BTreeMap::new();
    {
        use futures::TryStreamExt as _;
        let mut subjects = info;
        while let Some((subject, count)) = subjects.try_next().await.expect("subject") {
            dead.insert(
                subject.trim_start_matches("devicelist.dead.").to_owned(),
                count as u64,
            );
        }
    }
    let expected: BTreeMap<String, u64> = expected
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    assert_eq!(dead, expected, "each bad message under its reason");
    // every good user ends at its last update
    let phones = entity::remote_device::Entity::find()
        .all(running.store.connection())
        .await
        .expect("query");
    let at_last: std::collections::BTreeSet<&str> = phones
        .iter()
        .filter(|row| row.device_id == "PHONE" && row.stream_id == rounds as i64)
        .map(|row| row.user_id.as_str())
        .collect();
    assert_eq!(phones.len(), USERS, "one device per good user");
    for user in 0..USERS {
        let user = format!("@good{user}:remote.example");
        assert!(
            at_last.contains(user.as_str()),
            "{user} is not at round {rounds}"
        );
    }
    running.stop(Duration::from_secs(10)).await;
    // Bounded memory: the worker holds batches, not the backlog. The input
    // alone is well over 100 MB; the worker's growth stays far below it.
    let grown_mib = peak.saturating_sub(before) / 1024;
    eprintln!(
        "resident before {} MiB, peak growth {grown_mib} MiB",
        before / 1024
    );
    assert!(grown_mib < 256, "resident memory grew by {grown_mib} MiB");
}
both_backends!(good_and_bad_at_volume, good_and_bad_at_volume);
