//! Crash safety: the worker runs as a child process and aborts at a fault
//! point; after a restart every key change is in `KEY_CHANGE` exactly once.
//! Also checks that SIGTERM drains and exits 0.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{Backend, Nats, TestDb, publish, stream_len, wait_input_drained, wait_stream};
use device_list_updater::server_key::ServerKey;
use device_list_updater::store::Store;
use device_list_updater::worker;
use entity::{remote_device, remote_user};
use sea_orm::{ActiveModelTrait, ActiveValue::Set, EntityTrait};
use serde_json::json;
use tokio::process::{Child, Command};

const ALICE: &str = "@alice:remote.example";

struct Setup {
    nats: Nats,
    db: TestDb,
    key_dir: tempfile::TempDir,
    store: Store,
}

impl Setup {
    async fn new(backend: Backend) -> Setup {
        let nats = Nats::start().await;
        let db = TestDb::new(backend).await;
        let key_dir = tempfile::tempdir().unwrap();
        ServerKey::generate()
            .unwrap()
            .write_new(&key_dir.path().join("signing.key"))
            .unwrap();
        let store = worker::open_store(&db.url, Duration::from_secs(10))
            .await
            .unwrap();
        remote_user::ActiveModel {
            user_id: Set(ALICE.into()),
            server_name: Set("remote.example".into()),
            known_stream_ids: Set("[5]".into()),
            max_stream_id: Set(5),
            fetched_stream_id: Set(0),
            fetched_at_ms: Set(0),
        }
        .insert(store.connection())
        .await
        .unwrap();
        Setup {
            nats,
            db,
            key_dir,
            store,
        }
    }

    fn spawn(&self, fault: Option<&str>) -> Child {
        self.spawn_with(fault, false)
    }

    /// [`Setup::spawn`], with membership on when `membership`.
    fn spawn_with(&self, fault: Option<&str>, membership: bool) -> Child {
        let mut command = Command::new(common::binary());
        command.env("DLU_MEMBERSHIP", if membership { "on" } else { "off" });
        command
            .arg("run")
            .env("DLU_SERVER_NAME", common::OUR_SERVER)
            .env(
                "DLU_SIGNING_KEY_PATH",
                self.key_dir.path().join("signing.key"),
            )
            .env("DLU_DATABASE_URL", &self.db.url)
            .env("DLU_NATS_URL", &self.nats.url)
            .env("DLU_HTTP_ADDR", "127.0.0.1:0")
            .env("DLU_LEASE_TTL", "2s")
            .env("DLU_ACK_WAIT", "1s")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        match fault {
            Some(fault) => command.env("DLU_FAULT", fault),
            None => command.env_remove("DLU_FAULT"),
        };
        command.spawn().expect("spawn worker")
    }

    /// Starts a worker with `fault`, publishes one update once the worker has
    /// created the input stream, and waits for the fault to abort it.
    async fn crash_on_one_update(&self, js: &async_nats::jetstream::Context, fault: &str) {
        let mut crashing = self.spawn(Some(fault));
        common::eventually(Duration::from_secs(20), "input stream", || async {
            js.get_stream("DEVICE_LIST_INPUT").await.ok().map(|_| ())
        })
        .await;
        publish(
            js,
            "devicelist.in.update",
            &change(),
            Some("remote.example"),
        )
        .await;
        let status = exits(&mut crashing).await;
        assert!(!status.success(), "the fault aborts the worker");
    }

    async fn outbox_len(&self) -> u64 {
        self.store.outbox_len().await.unwrap()
    }
}

async fn exits(child: &mut Child) -> std::process::ExitStatus {
    tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("worker exits in time")
        .expect("wait")
}

async fn sigterm_exits_zero(mut child: Child) {
    let pid = child.id().expect("pid").to_string();
    let status = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .unwrap();
    assert!(status.success());
    let started = std::time::Instant::now();
    let status = exits(&mut child).await;
    assert!(status.success(), "SIGTERM must exit 0, got {status}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "drain took {:?}",
        started.elapsed()
    );
}

fn change() -> String {
    json!({"user_id": ALICE, "device_id": "D1", "stream_id": 6, "prev_id": [5],
           "device_display_name": "Phone", "keys": {"k": 1}})
    .to_string()
}

async fn crash_between_commit_and_publish(backend: Backend) {
    let setup = Setup::new(backend).await;
    let js = setup.nats.js().await;
    setup.crash_on_one_update(&js, "crash_after_commit").await;
    // committed, not published
    assert_eq!(stream_len(&js, "KEY_CHANGE").await, 0);
    assert_eq!(setup.outbox_len().await, 1);
    let stored = remote_device::Entity::find_by_id((ALICE.to_owned(), "D1".to_owned()))
        .one(setup.store.connection())
        .await
        .unwrap();
    assert_eq!(stored.map(|d| d.stream_id), Some(6));

    let restarted = setup.spawn(None);
    let events = wait_stream(&js, "KEY_CHANGE", 1).await;
    assert_eq!(events[0].json["stream_id"], 6);
    // the unacked update is redelivered and processed again: no new event
    wait_input_drained(&js).await;
    common::eventually(Duration::from_secs(10), "outbox empty", || async {
        (setup.outbox_len().await == 0).then_some(())
    })
    .await;
    assert_eq!(stream_len(&js, "KEY_CHANGE").await, 1, "exactly once");
    sigterm_exits_zero(restarted).await;
}
both_backends!(commit_then_crash, crash_between_commit_and_publish);

async fn crash_between_publish_and_outbox_delete(backend: Backend) {
    let setup = Setup::new(backend).await;
    let js = setup.nats.js().await;
    setup.crash_on_one_update(&js, "crash_after_publish").await;
    assert_eq!(
        stream_len(&js, "KEY_CHANGE").await,
        1,
        "published before the crash"
    );
    assert_eq!(setup.outbox_len().await, 1, "but still in the outbox");

    let restarted = setup.spawn(None);
    // re-sent with the same Nats-Msg-Id and dropped by the duplicate window
    common::eventually(Duration::from_secs(20), "outbox empty", || async {
        (setup.outbox_len().await == 0).then_some(())
    })
    .await;
    wait_input_drained(&js).await;
    assert_eq!(stream_len(&js, "KEY_CHANGE").await, 1, "exactly once");
    sigterm_exits_zero(restarted).await;
}
both_backends!(publish_then_crash, crash_between_publish_and_outbox_delete);

/// SPEC §5.5.5: the worker aborts after the first chunk of the sweep of a
/// room our server just joined (1,200 remote members, 1,000 per chunk); the
/// next worker finishes the sweep: every member shares the room, the flag
/// is gone.
async fn crash_during_a_room_sweep(backend: Backend) {
    use entity::{room, shared_user};
    use sea_orm::PaginatorTrait;
    const MEMBERS: u64 = 1200;
    let setup = Setup::new(backend).await;
    let js = setup.nats.js().await;
    let membership = |who: String, at: u64| {
        json!({"room_id": "!big:our.example", "state_key": who, "membership": "join",
               "stream_ordering": at})
        .to_string()
    };
    let mut crashing = setup.spawn_with(Some("crash_after_sweep_chunk"), true);
    common::eventually(Duration::from_secs(20), "input stream", || async {
        js.get_stream("DEVICE_LIST_INPUT").await.ok().map(|_| ())
    })
    .await;
    for n in 0..MEMBERS {
        let body = membership(format!("@u{n}:remote.example"), n + 1);
        publish(&js, "devicelist.in.membership", &body, None).await;
    }
    // Our user joins last: the room becomes ours, all 1,200 are swept.
    let body = membership(format!("@me:{}", common::OUR_SERVER), MEMBERS + 1);
    publish(&js, "devicelist.in.membership", &body, None).await;
    let status = exits(&mut crashing).await;
    assert!(!status.success(), "the fault aborts the worker");
    let db = setup.store.connection();
    let shared = shared_user::Entity::find().count(db).await.unwrap();
    assert!(
        shared > 0 && shared < MEMBERS,
        "aborted half-way: {shared} shared"
    );

    let worker = setup.spawn_with(None, true);
    common::eventually(Duration::from_secs(30), "the sweep finished", || async {
        let shared = shared_user::Entity::find().count(db).await.ok()?;
        let flagged = room::Entity::find_by_id("!big:our.example".to_owned())
            .one(db)
            .await
            .ok()??
            .sweep;
        (shared == MEMBERS && !flagged).then_some(())
    })
    .await;
    sigterm_exits_zero(worker).await;
}
both_backends!(sweep_then_crash, crash_during_a_room_sweep);

/// SPEC §5.5.5, the other way: our last user leaves a room of 1,200 remote
/// members and the worker aborts after the first chunk of untracking; the
/// next worker finishes it: nobody shares the room, nobody is left stale
/// (untracking removes the stale mark), the flag is gone.
async fn crash_during_a_room_leave(backend: Backend) {
    use entity::{room, shared_user, stale_user};
    use sea_orm::PaginatorTrait;
    const MEMBERS: u64 = 1200;
    const ROOM: &str = "!big:our.example";
    let setup = Setup::new(backend).await;
    let js = setup.nats.js().await;
    let db = setup.store.connection();
    let membership = |who: String, what: &str, at: u64| {
        json!({"room_id": ROOM, "state_key": who, "membership": what, "stream_ordering": at})
            .to_string()
    };
    let me = format!("@me:{}", common::OUR_SERVER);
    let joined = setup.spawn_with(None, true);
    common::eventually(Duration::from_secs(20), "input stream", || async {
        js.get_stream("DEVICE_LIST_INPUT").await.ok().map(|_| ())
    })
    .await;
    publish(
        &js,
        "devicelist.in.membership",
        &membership(me.clone(), "join", 1),
        None,
    )
    .await;
    for n in 0..MEMBERS {
        let body = membership(format!("@u{n}:remote.example"), "join", n + 2);
        publish(&js, "devicelist.in.membership", &body, None).await;
    }
    common::eventually(Duration::from_secs(30), "all members shared", || async {
        let shared = shared_user::Entity::find().count(db).await.ok()?;
        (shared == MEMBERS).then_some(())
    })
    .await;
    sigterm_exits_zero(joined).await;

    let mut crashing = setup.spawn_with(Some("crash_after_sweep_chunk"), true);
    let body = membership(me, "leave", MEMBERS + 2);
    publish(&js, "devicelist.in.membership", &body, None).await;
    let status = exits(&mut crashing).await;
    assert!(!status.success(), "the fault aborts the worker");
    let shared = shared_user::Entity::find().count(db).await.unwrap();
    assert!(
        shared > 0 && shared < MEMBERS,
        "aborted half-way: {shared} still shared"
    );

    let worker = setup.spawn_with(None, true);
    common::eventually(Duration::from_secs(30), "the leave finished", || async {
        let shared = shared_user::Entity::find().count(db).await.ok()?;
        let stale = stale_user::Entity::find().count(db).await.ok()?;
        let flagged = room::Entity::find_by_id(ROOM.to_owned())
            .one(db)
            .await
            .ok()??
            .sweep;
        (shared == 0 && stale == 0 && !flagged).then_some(())
    })
    .await;
    sigterm_exits_zero(worker).await;
}
both_backends!(leave_then_crash, crash_during_a_room_leave);
