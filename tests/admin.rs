//! `device-list-updater admin …` against the same database and NATS as a
//! running worker.

mod common;

use std::time::Duration;

use common::{Backend, Nats, TestDb, publish};
use device_list_updater::testkit::remote::{MockFederation, Reply, device_list};
use device_list_updater::testkit::stream_len;
use device_list_updater::worker;
use serde_json::{Value, json};

const ALICE: &str = "@alice:remote.example";
const BOB: &str = "@bob:down.example";

fn uid(user: &str) -> ruma::OwnedUserId {
    ruma::OwnedUserId::try_from(user).unwrap()
}

/// Runs `device-list-updater <args>` against `db` and `nats`, as an
/// operator does: no `RUST_LOG`.
async fn command(db: &TestDb, nats: &Nats, args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(common::binary())
        .args(args)
        .env("DLU_DATABASE_URL", &db.url)
        .env("DLU_NATS_URL", &nats.url)
        .env("DLU_STARTUP_TIMEOUT", "10s")
        .env_remove("RUST_LOG")
        .output()
        .await
        .expect("runs")
}

async fn admin(db: &TestDb, nats: &Nats, args: &[&str]) -> (bool, String) {
    let mut all = vec!["admin"];
    all.extend_from_slice(args);
    let output = command(db, nats, &all).await;
    // The answer stands alone: nothing on stderr unless RUST_LOG asks.
    if output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.is_empty(),
            "admin {args:?} wrote on stderr: {stderr}"
        );
    }
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

async fn admin_json(db: &TestDb, nats: &Nats, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    let (ok, out) = admin(db, nats, &all).await;
    assert!(ok, "admin {args:?} failed: {out}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("admin {args:?}: {e}: {out}"))
}

async fn admin_commands(backend: Backend) {
    let nats = Nats::start().await;
    let db = TestDb::new(backend).await;
    let mut config = common::config(&nats, &db);
    // down.example stays in its back-off while the commands look at it (the
    // tests' 200 ms would let its job run again between two of them).
    config.settings.retry_min = Duration::from_secs(60);
    config.settings.retry_max = Duration::from_secs(60);
    let fleet = MockFederation::trusting(&config, Duration::ZERO).await;
    fleet.serve(&mut config, ["remote.example", "down.example"]);
    fleet.script(
        ALICE,
        vec![Reply::Json(device_list(ALICE, 3, &[("D1", "Phone")]))],
    );
    fleet.script(BOB, vec![Reply::Status(502, json!({}), None)]);
    let running = worker::start(config).await.unwrap();
    let js = nats.js().await;
    for user in [ALICE, BOB] {
        publish(
            &js,
            "devicelist.in.resync",
            &json!({"user_id": user}).to_string(),
            None,
        )
        .await;
    }
    common::eventually(
        Duration::from_secs(20),
        "alice fetched, bob tried",
        || async {
            let bob = running.store.stale_state(&uid(BOB)).await.ok()??;
            let alice = running.store.stale_state(&uid(ALICE)).await.ok()?;
            (alice.is_none() && bob.1.is_some()).then_some(())
        },
    )
    .await;

    let user = admin_json(&db, &nats, &["user", ALICE]).await;
    assert_eq!(user["users"][ALICE]["tracked"], true);
    assert_eq!(user["users"][ALICE]["stream_id"], 3);
    assert_eq!(
        user["users"][ALICE]["devices"]["D1"]["display_name"],
        "Phone"
    );
    let (ok, text) = admin(&db, &nats, &["user", ALICE]).await;
    assert!(
        ok && text.contains("D1") && text.contains("display_name: Phone"),
        "{text}"
    );

    let stale = admin_json(&db, &nats, &["stale"]).await;
    assert_eq!(stale["total"], 1);
    assert_eq!(stale["servers"]["down.example"], 1);
    let stale = admin_json(&db, &nats, &["stale", "--server", "down.example"]).await;
    assert_eq!(stale["users"][0]["user_id"], BOB);
    assert!(stale["users"][0]["marked_at_ms"].is_i64(), "{stale}");
    // For people: a UTC time and an age; --json keeps the number.
    let (ok, text) = admin(&db, &nats, &["stale", "--server", "down.example"]).await;
    let marked = text
        .lines()
        .find_map(|line| line.trim().strip_prefix("marked_at: "))
        .unwrap_or_else(|| panic!("no marked_at line: {text}"));
    assert!(
        ok && marked.ends_with(" ago)") && marked.contains('T') && marked.contains("Z ("),
        "{text}"
    );
    assert!(!text.contains("marked_at_ms"), "{text}");
    assert!(
        stale["users"][0]["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("502")),
        "{stale}"
    );

    // Remote servers, worst first: the failing one (a stale user, backing
    // off) before the one that answered.
    let servers = admin_json(&db, &nats, &["servers"]).await;
    let down = &servers["servers"][0];
    assert_eq!(down["server_name"], "down.example", "{servers}");
    assert_eq!(down["stale_users"], 1, "{servers}");
    assert!(down["failures"].as_i64() >= Some(1), "{servers}");
    assert!(down["retry_at_ms"].is_i64(), "{servers}");
    assert!(
        down["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("502")),
        "{servers}"
    );
    assert_eq!(down["last_success_at_ms"], Value::Null, "{servers}");
    let remote = &servers["servers"][1];
    assert_eq!(remote["server_name"], "remote.example", "{servers}");
    assert_eq!(remote["tracked_users"], 1, "{servers}");
    assert!(remote["last_success_at_ms"].is_i64(), "{servers}");
    assert_eq!(remote["divergences"], 0, "{servers}");
    assert_eq!(servers["stale_users"], 1, "{servers}");
    let (ok, text) = admin(&db, &nats, &["servers"]).await;
    for line in [
        "server_name: down.example",
        "server_name: remote.example",
        "last_success_at: ",
        "retry_at: ",
        "divergences: 0",
    ] {
        assert!(ok && text.contains(line), "{line:?} not in\n{text}");
    }

    let streams = admin_json(&db, &nats, &["streams"]).await;
    assert_eq!(streams["DEVICE_LIST_INPUT"]["exists"], true);
    assert_eq!(
        streams["DEVICE_LIST_INPUT"]["consumer"]["name"],
        "device-list-updater-input"
    );
    assert_eq!(
        streams["DEVICE_LIST_FETCH"]["consumer"]["name"],
        "device-list-updater-fetch"
    );

    // A forced resync goes through the running worker: alice is asked again.
    fleet.reason(ALICE);
    let resync = admin_json(&db, &nats, &["resync", ALICE]).await;
    assert_eq!(resync["marked_stale"], true);
    common::eventually(Duration::from_secs(20), "alice fetched again", || async {
        let fresh = running.store.stale_state(&uid(ALICE)).await.ok()?.is_none();
        (fleet.requests(ALICE) == 2 && fresh).then_some(())
    })
    .await;

    // With no worker running, what a crashed one left in the outbox is
    // published by `replay-outbox`, once, and leaves the table.
    let store = running.store.clone();
    running.stop(Duration::from_secs(10)).await;
    let before = stream_len(&js, "KEY_CHANGE").await;
    let payload = common::leave_in_outbox(store.connection(), ALICE).await;
    let replay = admin_json(&db, &nats, &["replay-outbox"]).await;
    assert_eq!(replay["published"], 1, "{replay}");
    assert_eq!(store.outbox_len().await.unwrap(), 0);
    let published = common::read_stream(&js, "KEY_CHANGE").await;
    assert_eq!(published.len() as u64, before + 1);
    assert_eq!(published.last().map(|m| &m.json), Some(&payload));
    let again = admin_json(&db, &nats, &["replay-outbox"]).await;
    assert_eq!(again["published"], 0, "nothing is published twice");
}
both_backends!(commands, admin_commands);

/// A value that is not a user id is refused with exit 2 and one line, as the
/// RPCs refuse it (SPEC §5.6.5), by every command that takes one.
async fn admin_refuses_what_is_not_a_user_id(backend: Backend) {
    let nats = Nats::start().await;
    let db = TestDb::new(backend).await;
    let migrated = command(&db, &nats, &["migrate"]).await;
    assert!(migrated.status.success(), "{migrated:?}");
    for args in [
        &["admin", "user", "not-a-user"][..],
        &["admin", "user", ALICE, "bob"],
        &["admin", "rooms", "!room:our.example"],
        &["admin", "resync", "@"],
    ] {
        let output = command(&db, &nats, args).await;
        common::one_line_error(&output, &["is not a user id"]);
        assert!(output.stdout.is_empty(), "{args:?}: {output:?}");
    }
}
both_backends!(refusals, admin_refuses_what_is_not_a_user_id);

/// Only `run` and `migrate` change the schema. An `admin` command against a
/// database that is behind (never migrated here) or ahead (a newer binary
/// migrated it) is refused with one line naming `migrate`, and changes
/// nothing.
async fn admin_never_migrates(backend: Backend) {
    use sea_orm::ConnectionTrait as _;
    let nats = Nats::start().await;
    let db = TestDb::new(backend).await;
    let output = command(&db, &nats, &["admin", "user", ALICE]).await;
    common::one_line_error(&output, &["behind", "migrate"]);
    let store = device_list_updater::store::Store::connect(&db.url)
        .await
        .unwrap();
    let manager = migration::SchemaManager::new(store.connection());
    for table in ["seaql_migrations", "remote_user"] {
        assert!(
            !manager.has_table(table).await.unwrap(),
            "admin created {table}"
        );
    }

    let migrated = command(&db, &nats, &["migrate"]).await;
    assert!(migrated.status.success(), "{migrated:?}");
    let user = admin_json(&db, &nats, &["user", ALICE]).await;
    assert_eq!(user["users"][ALICE]["tracked"], false);

    // A migration this binary does not know: a newer binary ran `migrate`.
    store
        .connection()
        .execute_unprepared(
            "INSERT INTO seaql_migrations (version, applied_at) VALUES ('m29990101_000001_future', 0)",
        )
        .await
        .unwrap();
    let output = command(&db, &nats, &["admin", "stale"]).await;
    common::one_line_error(&output, &["newer", "m29990101_000001_future", "migrate"]);
}
both_backends!(no_migrations, admin_never_migrates);
