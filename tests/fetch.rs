//! Fetching stale lists end to end: real nats-server, SQLite and PostgreSQL,
//! and a mock fleet of remote servers that checks every X-Matrix signature.

mod common;

use std::time::Duration;

use common::fetch_env::{Env, update};
use common::{Backend, Nats, TestDb, stream_len, wait_stream};
use device_list_updater::testkit::remote::{MockFederation, Reply, device_list};
use device_list_updater::worker;
use entity::stale_user;
use sea_orm::{ActiveModelTrait, ActiveValue::Set, EntityTrait, PaginatorTrait};
use serde_json::json;

const ALICE: &str = "@alice:remote.example";
const REMOTE: &str = "remote.example";

/// Empty prev_id: one fetch, the list stored, one event per device, the user
/// fresh; the sender's next update applies without another fetch.
async fn empty_prev_id_fetches_once(backend: Backend) {
    let env = Env::start(backend, &[REMOTE], Duration::ZERO, |_| {}).await;
    env.fleet.script(
        ALICE,
        vec![Reply::Json(device_list(
            ALICE,
            10,
            &[("D1", "Phone"), ("D2", "Laptop")],
        ))],
    );
    env.update(update(ALICE, "D1", 10, &[], "Phone")).await;
    env.wait_fresh(ALICE, 1).await;
    let events = wait_stream(&env.js, "KEY_CHANGE", 2).await;
    let mut devices: Vec<&str> = events
        .iter()
        .map(|e| e.json["device_id"].as_str().unwrap())
        .collect();
    devices.sort();
    assert_eq!(devices, ["D1", "D2"]);
    assert!(
        events
            .iter()
            .all(|e| e.json["stream_id"] == 10 && e.header("user_id") == Some(ALICE))
    );
    // The next update follows the trigger (10): applied, no second fetch.
    env.update(update(ALICE, "D1", 11, &[10], "Phone 2")).await;
    let events = wait_stream(&env.js, "KEY_CHANGE", 3).await;
    assert_eq!(events[2].json["display_name"], "Phone 2");
    assert_eq!(env.fleet.requests(ALICE), 1);
    assert!(!env.is_stale(ALICE).await);
    assert_eq!(env.fleet.bad_signatures(), 0);
}
both_backends!(empty_prev_id, empty_prev_id_fetches_once);

/// Unknown prev_id also leads to exactly one fetch.
async fn unknown_prev_id_fetches_once(backend: Backend) {
    let env = Env::start(backend, &[REMOTE], Duration::ZERO, |_| {}).await;
    env.fleet.script(
        ALICE,
        vec![Reply::Json(device_list(ALICE, 20, &[("D1", "Phone")]))],
    );
    env.update(update(ALICE, "D1", 20, &[19], "Phone")).await;
    env.wait_fresh(ALICE, 1).await;
    wait_stream(&env.js, "KEY_CHANGE", 1).await;
    env.update(update(ALICE, "D1", 21, &[20], "Phone 2")).await;
    wait_stream(&env.js, "KEY_CHANGE", 2).await;
    assert_eq!(env.fleet.requests(ALICE), 1);
}
both_backends!(unknown_prev_id, unknown_prev_id_fetches_once);

/// A fetch that drops a device emits its deletion; an identical fetch emits nothing.
async fn refetch_diffs(backend: Backend) {
    let env = Env::start(backend, &[REMOTE], Duration::ZERO, |_| {}).await;
    env.fleet.script(
        ALICE,
        vec![
            Reply::Json(device_list(ALICE, 5, &[("D1", "Phone"), ("D2", "Laptop")])),
            Reply::Json(device_list(ALICE, 6, &[("D1", "Phone")])),
            Reply::Json(device_list(ALICE, 6, &[("D1", "Phone")])),
        ],
    );
    env.resync(ALICE).await;
    env.wait_fresh(ALICE, 1).await;
    wait_stream(&env.js, "KEY_CHANGE", 2).await;
    env.resync(ALICE).await;
    env.wait_fresh(ALICE, 2).await;
    let events = wait_stream(&env.js, "KEY_CHANGE", 3).await;
    assert_eq!(events[2].json["device_id"], "D2");
    assert_eq!(events[2].json["deleted"], true);
    assert_eq!(
        env.devices(ALICE).await,
        [("D1".into(), false), ("D2".into(), true)]
    );
    env.resync(ALICE).await;
    env.wait_fresh(ALICE, 3).await;
    // Nothing changed: still three events once everything is published.
    env.settled().await;
    assert_eq!(stream_len(&env.js, "KEY_CHANGE").await, 3);
}
both_backends!(refetch, refetch_diffs);

/// An answer about another user is not stored; the user stays stale and is
/// asked again.
async fn user_mismatch_is_refused(backend: Backend) {
    let env = Env::start(backend, &[REMOTE], Duration::ZERO, |_| {}).await;
    env.fleet.script(
        ALICE,
        vec![
            Reply::Json(device_list(
                "@mallory:remote.example",
                5,
                &[("D1", "Phone")],
            )),
            Reply::Json(device_list(ALICE, 5, &[("D1", "Phone")])),
        ],
    );
    env.resync(ALICE).await;
    env.wait_fresh(ALICE, 2).await;
    let events = wait_stream(&env.js, "KEY_CHANGE", 1).await;
    assert_eq!(events[0].json["user_id"], ALICE);
}
both_backends!(user_mismatch, user_mismatch_is_refused);

/// A device whose keys name another device is skipped; the rest are stored.
async fn mismatching_device_skipped(backend: Backend) {
    let env = Env::start(backend, &[REMOTE], Duration::ZERO, |_| {}).await;
    let mut list = device_list(ALICE, 5, &[("D1", "Phone"), ("D2", "Laptop")]);
    list["devices"][1]["keys"]["device_id"] = json!("OTHER");
    env.fleet.script(ALICE, vec![Reply::Json(list)]);
    env.resync(ALICE).await;
    env.wait_fresh(ALICE, 1).await;
    let events = wait_stream(&env.js, "KEY_CHANGE", 1).await;
    assert_eq!(events[0].json["device_id"], "D1");
    assert_eq!(env.devices(ALICE).await, [("D1".into(), false)]);
}
both_backends!(mismatching_device, mismatching_device_skipped);

/// Unusable answers (not JSON, too large, no answer in time) count as
/// failures: the user stays stale until a later try succeeds.
async fn unusable_answers_are_retried(backend: Backend) {
    let servers = ["one.example", "two.example", "three.example"];
    let env = Env::start(backend, &servers, Duration::ZERO, |c| {
        c.settings.federation_timeout = Duration::from_millis(500);
    })
    .await;
    let users = ["@a:one.example", "@b:two.example", "@c:three.example"];
    let big = vec![b' '; 11 * 1024 * 1024];
    let first = [
        Reply::Raw(b"not json".to_vec()),
        Reply::Raw(big),
        Reply::Hang,
    ];
    for (user, first) in users.iter().zip(first) {
        env.fleet.script(
            user,
            vec![first, Reply::Json(device_list(user, 3, &[("D", "Phone")]))],
        );
        env.resync(user).await;
    }
    for user in users {
        env.wait_fresh(user, 2).await;
    }
    wait_stream(&env.js, "KEY_CHANGE", 3).await;
}
both_backends!(unusable_answers, unusable_answers_are_retried);

/// 500, 500, then success: the waits grow from DLU_RETRY_MIN (300 ms), doubling;
/// the spread never shortens them.
async fn server_errors_back_off(backend: Backend) {
    let env = Env::start(backend, &[REMOTE], Duration::ZERO, |c| {
        c.settings.retry_min = Duration::from_millis(300);
        c.settings.retry_max = Duration::from_secs(5);
    })
    .await;
    let error = Reply::Status(500, json!({"errcode": "M_UNKNOWN"}), None);
    env.fleet.script(
        ALICE,
        vec![
            error.clone(),
            error,
            Reply::Json(device_list(ALICE, 3, &[("D", "P")])),
        ],
    );
    env.resync(ALICE).await;
    env.wait_fresh(ALICE, 3).await;
    let times = env.fleet.request_times(ALICE);
    let first_wait = times[1] - times[0];
    let second_wait = times[2] - times[1];
    assert!(first_wait >= Duration::from_millis(300), "{first_wait:?}");
    assert!(second_wait >= Duration::from_millis(600), "{second_wait:?}");
}
both_backends!(server_errors, server_errors_back_off);

/// 429 with retry_after_ms is not retried before that time.
async fn rate_limit_is_honoured(backend: Backend) {
    let env = Env::start(backend, &[REMOTE], Duration::ZERO, |c| {
        c.settings.retry_min = Duration::from_millis(100);
        c.settings.retry_max = Duration::from_secs(10);
    })
    .await;
    let limited = Reply::Status(
        429,
        json!({"errcode": "M_LIMIT_EXCEEDED", "retry_after_ms": 1500}),
        None,
    );
    env.fleet.script(
        ALICE,
        vec![limited, Reply::Json(device_list(ALICE, 3, &[("D", "P")]))],
    );
    env.resync(ALICE).await;
    env.wait_fresh(ALICE, 2).await;
    let times = env.fleet.request_times(ALICE);
    // The asked wait is a floor: the spread only lengthens it.
    assert!(
        times[1] - times[0] >= Duration::from_millis(1500),
        "{:?}",
        times[1] - times[0]
    );
}
both_backends!(rate_limit, rate_limit_is_honoured);

/// More devices than DLU_MAX_DEVICES: nothing stored, the user fresh.
async fn too_many_devices_not_stored(backend: Backend) {
    let env = Env::start(backend, &[REMOTE], Duration::ZERO, |c| {
        c.settings.max_devices = 2
    })
    .await;
    env.fleet.script(
        ALICE,
        vec![Reply::Json(device_list(
            ALICE,
            3,
            &[("A", "a"), ("B", "b"), ("C", "c")],
        ))],
    );
    env.resync(ALICE).await;
    env.wait_fresh(ALICE, 1).await;
    env.settled().await;
    assert!(env.devices(ALICE).await.is_empty());
    assert_eq!(stream_len(&env.js, "KEY_CHANGE").await, 0);
}
both_backends!(too_many_devices, too_many_devices_not_stored);

fn cross_signing_key(user: &str, usage: &str, seed: u8) -> serde_json::Value {
    use base64::Engine as _;
    let key = base64::engine::general_purpose::STANDARD_NO_PAD.encode([seed; 32]);
    json!({"user_id": user, "usage": [usage], "keys": {format!("ed25519:{key}"): key}})
}

/// Valid cross-signing keys are stored and emitted once; malformed ones are ignored.
async fn cross_signing_keys_checked(backend: Backend) {
    let env = Env::start(backend, &[REMOTE], Duration::ZERO, |_| {}).await;
    let mut good = device_list(ALICE, 3, &[("D", "P")]);
    good["master_key"] = cross_signing_key(ALICE, "master", 1);
    good["self_signing_key"] = cross_signing_key(ALICE, "self_signing", 2);
    let mut wrong_user = device_list(ALICE, 4, &[("D", "P")]);
    wrong_user["master_key"] = cross_signing_key("@bob:remote.example", "master", 3);
    let mut two_keys = device_list(ALICE, 5, &[("D", "P")]);
    two_keys["master_key"] = cross_signing_key(ALICE, "master", 4);
    two_keys["master_key"]["keys"]["ed25519:second"] = json!("second");
    let mut wrong_usage = device_list(ALICE, 6, &[("D", "P")]);
    wrong_usage["self_signing_key"] = cross_signing_key(ALICE, "master", 5);
    env.fleet.script(
        ALICE,
        vec![
            Reply::Json(good.clone()),
            Reply::Json(wrong_user),
            Reply::Json(two_keys),
            Reply::Json(wrong_usage),
            Reply::Json(good),
        ],
    );
    for round in 1..=5 {
        env.resync(ALICE).await;
        env.wait_fresh(ALICE, round).await;
    }
    env.settled().await;
    let events = common::read_stream(&env.js, "KEY_CHANGE").await;
    let cross: Vec<_> = events
        .iter()
        .filter(|e| e.subject == "key_change.cross_signing")
        .collect();
    assert_eq!(cross.len(), 1, "{cross:#?}");
    assert_eq!(
        cross[0].json["master_key"],
        cross_signing_key(ALICE, "master", 1)
    );
    assert_eq!(
        cross[0].json["self_signing_key"],
        cross_signing_key(ALICE, "self_signing", 2)
    );
    let stored = entity::cross_signing_key::Entity::find()
        .count(env.db())
        .await
        .unwrap();
    assert_eq!(stored, 2);
}
both_backends!(cross_signing, cross_signing_keys_checked);

/// Users left stale by an earlier run (no job in the queue) are fetched at
/// start-up, spread over DLU_STARTUP_SPREAD.
async fn stale_users_fetched_at_start(backend: Backend) {
    let nats = Nats::start().await;
    let db = TestDb::new(backend).await;
    let servers = ["one.example", "two.example"];
    let users = ["@a:one.example", "@b:two.example"];
    {
        let store = worker::open_store(&db.url, Duration::from_secs(10))
            .await
            .unwrap();
        for user in users {
            stale_user::ActiveModel {
                user_id: Set(user.into()),
                server_name: Set(user.split_once(':').unwrap().1.into()),
                marked_at_ms: Set(0),
                trigger_stream_ids: Set("[]".into()),
                last_error: Set(None),
                ..Default::default()
            }
            .insert(store.connection())
            .await
            .unwrap();
        }
    }
    let mut config = common::config(&nats, &db);
    config.settings.startup_spread = Duration::from_secs(1);
    let fleet = MockFederation::trusting(&config, Duration::ZERO).await;
    fleet.serve(&mut config, servers);
    for user in users {
        fleet.script(user, vec![Reply::Json(device_list(user, 1, &[("D", "P")]))]);
    }
    let running = worker::start(config).await.unwrap();
    common::eventually(Duration::from_secs(20), "both users fetched", || async {
        let left = stale_user::Entity::find()
            .count(running.store.connection())
            .await
            .ok()?;
        (left == 0 && users.iter().all(|u| fleet.requests(u) == 1)).then_some(())
    })
    .await;
    // Two servers over one second: the second job starts half a second later.
    let mut firsts: Vec<std::time::Instant> =
        users.iter().map(|u| fleet.request_times(u)[0]).collect();
    firsts.sort();
    assert!(
        firsts[1] - firsts[0] >= Duration::from_millis(450),
        "not spread: {:?}",
        firsts[1] - firsts[0]
    );
}
both_backends!(startup_rescan, stale_users_fetched_at_start);
