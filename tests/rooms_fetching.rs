//! Rooms and fetching agree (SPEC §5.2, §5.5.4, §5.5.6, §5.5.9, §5.6.5),
//! end to end through a real nats-server on SQLite and PostgreSQL, with the
//! mock fleet's request-loop guard on:
//!
//! - a stale user that shares no room is never asked for, and is fetched
//!   once it shares one; an update dropped for a stored user that shares
//!   nothing is not lost;
//! - a server parked for one user's back-off fetches a user that starts
//!   being tracked through a member key or a sweep at once;
//! - from the moment our server leaves a room, its members are untracked for
//!   every decision, before the sweep removes their rows;
//! - the RPCs refuse what is not a user id, and a resync answers for a user
//!   that stops sharing while it waits.

mod common;

use std::time::Duration;

use common::fetch_env::{Env, update};
use common::rooms::{link, lists, member, query, rpc};
use common::{Backend, read_stream};
use device_list_updater::config::Switch;
use device_list_updater::faults::Fault;
use device_list_updater::store::now_ms;
use device_list_updater::testkit::remote::Reply;
use sea_orm::{ActiveModelTrait as _, ActiveValue::Set, EntityTrait as _};
use serde_json::{Value, json};

const ME: &str = "@me:our.example";
const BOB: &str = "@bob:remote.example";
const CAROL: &str = "@carol:other.example";
const DAN: &str = "@dan:remote.example";
const EVE: &str = "@eve:remote.example";
const SERVERS: &[&str] = &["remote.example", "other.example"];
const ROOM: &str = "!a:our.example";
const OTHER_ROOM: &str = "!b:our.example";
const BOB_KEY: &str = "@l8Hft5qXKn1vfHrg3p4-W8gELQVo8N13JkluMfmn2sQ";

async fn env(backend: Backend, tune: impl FnOnce(&mut device_list_updater::config::Config)) -> Env {
    Env::start(backend, SERVERS, Duration::ZERO, |config| {
        config.settings.membership = Switch::On;
        config.settings.msc4430 = Switch::On;
        tune(config);
    })
    .await
}

/// Marks `user` stale in the database, as a worker with membership off left it.
async fn stale_row(db: &sea_orm::DatabaseConnection, user: &str) {
    let server = user.split_once(':').map(|(_, s)| s).unwrap_or_default();
    entity::stale_user::ActiveModel {
        user_id: Set(user.to_owned()),
        server_name: Set(server.to_owned()),
        marked_at_ms: Set(now_ms()),
        trigger_stream_ids: Set("[]".into()),
        last_error: Set(None),
        failures: Set(0),
        next_attempt_ms: Set(0),
    }
    .insert(db)
    .await
    .expect("a stale mark");
}

/// §5.2 (no request loop), §5.5.9: a database from before the switch-on
/// holds BOB stored and stale, and EVE stored. Neither shares a room: BOB
/// is never asked for, not by the start-up rescan nor by his server's job
/// when it runs for DAN, and an update for EVE is dropped. Once they share a
/// room, both are fetched: BOB's mark waited, and EVE's list was behind.
async fn unshared_stale_users_wait_for_a_room(backend: Backend) {
    let env = env(backend, |_| {}).await;
    common::known_user(env.db(), BOB).await;
    stale_row(env.db(), BOB).await;
    common::known_user(env.db(), EVE).await;
    // Started again, so the start-up rescan finds BOB's mark.
    let env = env.restart(false).await;
    for user in [BOB, EVE, DAN] {
        lists(&env, user, 1);
    }
    env.update(update(EVE, "PHONE", 1, &[0], "Phone")).await;
    member(&env, ROOM, ME, "join", 1).await;
    member(&env, ROOM, DAN, "join", 2).await;
    env.wait_fresh(DAN, 1).await;
    env.settled().await;
    assert_eq!(env.fleet.requests(BOB), 0, "BOB shares no room");
    assert_eq!(env.fleet.requests(EVE), 0, "EVE shares no room");
    assert!(env.is_stale(BOB).await, "BOB's mark waits for a room");
    assert!(
        env.devices(EVE).await.is_empty(),
        "EVE's update was dropped"
    );

    member(&env, ROOM, BOB, "join", 3).await;
    member(&env, ROOM, EVE, "join", 4).await;
    env.wait_fresh(BOB, 1).await;
    env.wait_fresh(EVE, 1).await;
    assert_eq!(env.devices(EVE).await, [("PHONE".to_owned(), false)]);
    assert!(env.fleet.loops().is_empty(), "{:?}", env.fleet.loops());
}
both_backends!(unshared_stale, unshared_stale_users_wait_for_a_room);

/// Waits until `server`'s fetch job is parked: no failure of its own, but
/// waiting at least a minute for a user's back-off.
async fn wait_parked(env: &Env, server: &str) {
    common::eventually(Duration::from_secs(20), "the job parked", || async {
        let row = entity::fetch_server::Entity::find_by_id(server.to_owned())
            .one(env.db())
            .await
            .ok()??;
        (row.failures == 0 && row.next_attempt_ms > now_ms() + 60_000).then_some(())
    })
    .await;
}

/// §5.2: DAN's server answers 404 for him, so he backs off alone for an
/// hour and the server's job is parked. BOB, who starts being tracked when
/// his member key joins, and EVE, who starts when our server joins a room
/// she is in (the room's sweep), are each fetched at once.
async fn a_parked_server_fetches_new_users_at_once(backend: Backend) {
    let env = env(backend, |config| {
        config.settings.retry_min = Duration::from_secs(3600);
        config.settings.retry_max = Duration::from_secs(7200);
    })
    .await;
    lists(&env, BOB, 1);
    lists(&env, EVE, 1);
    // First what names BOB and EVE but tracks neither: BOB's key's link
    // (the key has not joined), EVE joining a room that is not ours.
    link(&env, ROOM, BOB_KEY, Some(BOB), true, 1).await;
    member(&env, OTHER_ROOM, EVE, "join", 1).await;
    member(&env, ROOM, ME, "join", 2).await;
    member(&env, ROOM, DAN, "join", 3).await;
    wait_parked(&env, "remote.example").await;

    // Now what starts their tracking names neither by user id.
    member(&env, ROOM, BOB_KEY, "join", 4).await;
    env.wait_fresh(BOB, 1).await;
    member(&env, OTHER_ROOM, ME, "join", 2).await;
    env.wait_fresh(EVE, 1).await;
    assert_eq!(env.fleet.requests(DAN), 1, "DAN waits out his own back-off");
}
both_backends!(parked_server, a_parked_server_fetches_new_users_at_once);

/// §5.5.4: with room sweeps held, our server leaves a room. Its members are
/// untracked from that moment: an update for BOB is dropped (no key
/// change), the query shows BOB and CAROL untracked with no shared room, a
/// resync for CAROL says she shares none, and nothing of theirs is fetched.
/// Once the sweep runs, their rows are gone.
async fn our_leave_untracks_at_once(backend: Backend) {
    let env = env(backend, |config| {
        config.settings.fault = Some(Fault::HoldSweeps);
    })
    .await;
    lists(&env, BOB, 1);
    lists(&env, CAROL, 1);
    member(&env, ROOM, ME, "join", 1).await;
    member(&env, ROOM, BOB, "join", 2).await;
    member(&env, ROOM, CAROL, "join", 3).await;
    env.wait_fresh(BOB, 1).await;
    env.wait_fresh(CAROL, 1).await;
    env.settled().await;
    let events = read_stream(&env.js, "KEY_CHANGE").await.len();

    member(&env, ROOM, ME, "leave", 4).await;
    env.update(update(BOB, "LAPTOP", 11, &[10], "Laptop")).await;
    env.settled().await;
    assert_eq!(
        read_stream(&env.js, "KEY_CHANGE").await.len(),
        events,
        "the update for BOB was dropped"
    );
    for user in [BOB, CAROL] {
        let view = query(&env, user).await;
        assert_eq!(view["tracked"], false, "{user}: {view}");
        assert_eq!(view["shared_rooms"], 0, "{user}: {view}");
        assert_eq!(view["devices"], json!({}), "{user}: {view}");
    }
    env.fleet.reason(CAROL);
    let reply = rpc(
        &env,
        "devicelist.rpc.resync",
        json!({"user_id": CAROL, "timeout_ms": 5000}),
    )
    .await;
    assert_eq!(reply["synced"], false, "{reply}");
    assert_shares_no_room(&reply);
    assert_eq!(env.fleet.requests(CAROL), 1);

    let mut env = env;
    env.config.settings.fault = None;
    let env = env.restart(false).await;
    common::eventually(
        Duration::from_secs(20),
        "the sweep removed the rows",
        || async {
            let bob = env.devices(BOB).await;
            let carol = env.devices(CAROL).await;
            (bob.is_empty() && carol.is_empty()).then_some(())
        },
    )
    .await;
}
both_backends!(our_leave, our_leave_untracks_at_once);

fn assert_shares_no_room(reply: &Value) {
    let error = reply["error"].as_str().unwrap_or_default();
    assert!(error.contains("shares no room"), "{reply}");
}

/// §5.6.5: the RPCs refuse an entry that is not a user id (a member key
/// here), saying which by position and never echoing it.
async fn rpcs_refuse_what_is_not_a_user_id(backend: Backend) {
    let env = env(backend, |_| {}).await;
    let reply = rpc(
        &env,
        "devicelist.rpc.query",
        json!({"user_ids": [BOB, BOB_KEY]}),
    )
    .await;
    assert_eq!(reply, json!({"error": "user_ids[1] is not a user id"}));
    for user_id in [BOB_KEY, "bob"] {
        let reply = rpc(&env, "devicelist.rpc.resync", json!({"user_id": user_id})).await;
        assert_eq!(reply, json!({"error": "user_id is not a user id"}));
    }
    assert_eq!(env.fleet.total_requests(), 0);
}
both_backends!(rpc_refusals, rpcs_refuse_what_is_not_a_user_id);

/// §5.5.6: a resync whose user stops sharing every room while the reply
/// waits (its fetch hangs) answers `synced: false`, saying so.
async fn resync_of_a_user_untracked_while_waiting(backend: Backend) {
    let env = env(backend, |_| {}).await;
    env.fleet.script(
        BOB,
        vec![
            Reply::Json(device_list_updater::testkit::remote::device_list(
                BOB,
                10,
                &[("PHONE", "Phone")],
            )),
            Reply::Hang,
        ],
    );
    member(&env, ROOM, ME, "join", 1).await;
    member(&env, ROOM, BOB, "join", 2).await;
    env.wait_fresh(BOB, 1).await;
    env.fleet.reason(BOB);
    let client = env.nats.client().await;
    let reply = tokio::spawn(async move {
        let body = json!({"user_id": BOB, "timeout_ms": 20_000}).to_string();
        client
            .request("devicelist.rpc.resync", body.into())
            .await
            .expect("a reply")
    });
    common::eventually(
        Duration::from_secs(20),
        "the resync's fetch sent",
        || async { (env.fleet.requests(BOB) == 2).then_some(()) },
    )
    .await;
    member(&env, ROOM, BOB, "leave", 3).await;
    let reply = tokio::time::timeout(Duration::from_secs(15), reply)
        .await
        .expect("answered before its timeout")
        .expect("the request task");
    let reply: Value = serde_json::from_slice(&reply.payload).expect("JSON");
    assert_eq!(reply["synced"], false, "{reply}");
    assert_shares_no_room(&reply);
}
both_backends!(resync_untracked, resync_of_a_user_untracked_while_waiting);

/// A member key made from `n` (`@` and 43 characters of URL-safe base64).
fn member_key(n: usize) -> String {
    use base64::Engine as _;
    let mut bytes = [7_u8; 32];
    bytes[..8].copy_from_slice(&(n as u64).to_be_bytes());
    format!(
        "@{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    )
}

/// `SELECT …` on PostgreSQL at `url`, one integer.
async fn pg_count(url: &str, sql: &str) -> i64 {
    use sea_orm::ConnectionTrait as _;
    let db = sea_orm::Database::connect(url).await.expect("connect");
    let statement = sea_orm::Statement::from_string(sea_orm::DbBackend::Postgres, sql);
    let row = db
        .query_one_raw(statement)
        .await
        .expect("query")
        .expect("a row");
    row.try_get_by_index::<i64>(0).expect("an integer")
}

/// Deadlocks PostgreSQL detected in the test's database. A backend's
/// statistics reach `pg_stat_database` when it exits at the latest, so this
/// waits until no other backend is connected to it.
async fn deadlocks_once_idle(url: &str) -> i64 {
    let others = "SELECT count(*) FROM pg_stat_activity \
                  WHERE datname = current_database() AND pid <> pg_backend_pid()";
    common::eventually(
        Duration::from_secs(30),
        "every other backend gone",
        || async { (pg_count(url, others).await == 0).then_some(()) },
    )
    .await;
    pg_count(
        url,
        "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()",
    )
    .await
}

/// One lock order (docs/design.md): our server leaves a room of 3,000
/// remote members while, for half of the same users, member-key links and
/// joins flow in a room that stays ours, each followed by an update that
/// makes the user stale and fetched. Sweep chunks, ingest batches and the
/// fetch writer all lock those users: PostgreSQL detects no deadlock, and
/// the end state is right (the keyed half tracked and fresh, the rest
/// untracked with nothing stored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_big_leave_beside_member_key_traffic_never_deadlocks() {
    const MEMBERS: usize = 3_000;
    const KEYED: usize = 1_500;
    const SERVER_COUNT: usize = 20;
    const BIG: &str = "!big:our.example";
    const KEYS: &str = "!keys:our.example";
    let servers: Vec<String> = (0..SERVER_COUNT).map(|s| format!("s{s}.example")).collect();
    let names: Vec<&str> = servers.iter().map(String::as_str).collect();
    let member = |i: usize| format!("@b{i}:s{}.example", i % SERVER_COUNT);
    let env = Env::start(Backend::Postgres, &names, Duration::ZERO, |config| {
        config.settings.membership = Switch::On;
        config.settings.msc4430 = Switch::On;
    })
    .await;
    for i in 0..MEMBERS {
        lists(&env, &member(i), 2);
    }
    let membership = |room: &str, who: &str, what: &str, at: usize| {
        let body = common::rooms::membership(room, who, what, at as i64);
        ("devicelist.in.membership", body.to_string())
    };
    env.fleet.room_reason();
    let mut joins = vec![
        membership(BIG, ME, "join", 1),
        membership(KEYS, ME, "join", 1),
    ];
    joins.extend((0..MEMBERS).map(|i| membership(BIG, &member(i), "join", 2 + i)));
    common::publish_many(&env.js, joins).await;
    // Every member tracked; their fetches go on beside what follows.
    common::eventually(Duration::from_secs(120), "every member tracked", || async {
        let tracked = env.worker.store.tracked_user_count().await.ok()?;
        (tracked == MEMBERS as u64).then_some(())
    })
    .await;

    // The keyed half's links first, applied before anything else: the
    // joins by key below then name their users only through stored links.
    let links = (0..KEYED)
        .map(|i| {
            let link = json!({"room_id": KEYS, "member_key": member_key(i), "user_id": member(i),
                              "verified": true, "stream_ordering": 2 + i});
            ("devicelist.in.member_key", link.to_string())
        })
        .collect();
    common::publish_many(&env.js, links).await;
    env.settled().await;

    // The leave, then each key joining beside an update (by user id) of
    // another keyed user, so batches lock users named both ways while the
    // sweep's chunks and the fetch writer lock the same users. Its 3,001
    // messages take seconds to apply: a user fetched for its key's join
    // may be asked again for its update much later than its reason was
    // given, so reasons hold until the input is applied.
    env.fleet.hold_reasons(true);
    env.fleet.room_reason();
    let mut traffic = vec![membership(BIG, ME, "leave", 10_000)];
    for i in 0..KEYED {
        traffic.push(membership(KEYS, &member_key(i), "join", 10_000 + i));
        let other = member((i * 7 + 3) % KEYED);
        env.fleet.reason(&other);
        let stale = update(&other, "LAPTOP", 100 + i as i64, &[99], "Laptop");
        traffic.push(("devicelist.in.update", stale.to_string()));
    }
    common::publish_many(&env.js, traffic).await;
    env.settled().await;
    env.fleet.hold_reasons(false);
    common::eventually(
        Duration::from_secs(120),
        "swept, and the keyed half fresh",
        || async {
            let store = &env.worker.store;
            let swept = store.rooms_to_sweep().await.ok()?.is_empty();
            let tracked = store.tracked_user_count().await.ok()?;
            let stale = store.stale_user_count().await.ok()?;
            (swept && tracked == KEYED as u64 && stale == 0).then_some(())
        },
    )
    .await;
    for i in [0, KEYED - 1] {
        assert_eq!(env.devices(&member(i)).await, [("PHONE".to_owned(), false)]);
    }
    for i in [KEYED, MEMBERS - 1] {
        assert!(
            env.devices(&member(i)).await.is_empty(),
            "{} untracked",
            member(i)
        );
    }
    let Env { worker, db, .. } = env;
    worker.stop(Duration::from_secs(10)).await;
    // The database is the test's own, so every deadlock counted is ours.
    assert_eq!(deadlocks_once_idle(&db.url).await, 0, "deadlocks detected");
}

/// `SELECT pg_advisory_xact_lock(hashtext(key))` in `txn`: the lock a
/// writer takes for `key` (a user or room id).
async fn advisory_lock(
    txn: &sea_orm::DatabaseTransaction,
    key: &str,
) -> Result<(), sea_orm::DbErr> {
    use sea_orm::ConnectionTrait as _;
    let sql = format!("SELECT pg_advisory_xact_lock(hashtext('{key}'))");
    txn.execute_unprepared(&sql).await.map(|_| ())
}

/// One lock order, the case a batch's second round made a deadlock of
/// (docs/design.md): a batch holds an update's user V and then wants U, a
/// user it names only through a stored link (a key joining), while a
/// writer that follows the order (the fetch writer's one sorted round) holds
/// U and wants V, the next in hash order. With one round per batch the
/// batch waits for U holding nothing, and the writer gets V.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_never_holds_one_user_while_waiting_for_a_linked_one() {
    use sea_orm::TransactionTrait as _;
    let env = env(Backend::Postgres, |_| {}).await;
    // U and V in the writers' order: U's lock comes first.
    let (mut u, mut v) = (BOB.to_owned(), DAN.to_owned());
    let order =
        format!("SELECT CASE WHEN hashtext('{u}') < hashtext('{v}') THEN 1 ELSE 0 END::bigint");
    if pg_count(&env.db.url, &order).await == 0 {
        std::mem::swap(&mut u, &mut v);
    }
    lists(&env, &u, 1);
    lists(&env, &v, 2);
    member(&env, ROOM, ME, "join", 1).await;
    member(&env, ROOM, &v, "join", 2).await;
    link(&env, ROOM, BOB_KEY, Some(&u), true, 3).await;
    env.wait_fresh(&v, 1).await;
    env.settled().await;

    // The writer holds U.
    let writer = sea_orm::Database::connect(&env.db.url)
        .await
        .expect("connect");
    let txn = writer.begin().await.expect("begin");
    advisory_lock(&txn, &u).await.expect("U's lock");

    // One batch: V's update, and U's key joining (U named only by the
    // stored link). Published while no worker runs, so one pull takes both.
    let messages = vec![
        (
            "devicelist.in.update",
            update(&v, "LAPTOP", 20, &[99], "Laptop").to_string(),
        ),
        (
            "devicelist.in.membership",
            common::rooms::membership(ROOM, BOB_KEY, "join", 4).to_string(),
        ),
    ];
    let env = env
        .restart_after(async |js, fleet| {
            fleet.reason(&v);
            fleet.room_reason();
            common::publish_many(js, messages).await;
        })
        .await;

    // Wait until the batch waits for U.
    let waiting = format!(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
         AND objid::int = hashtext('{u}')"
    );
    common::eventually(Duration::from_secs(20), "the batch waits for U", || async {
        (pg_count(&env.db.url, &waiting).await > 0).then_some(())
    })
    .await;
    // The writer now takes V: the batch must not be holding it.
    let second = tokio::time::timeout(Duration::from_secs(10), advisory_lock(&txn, &v))
        .await
        .expect("V's lock within 10 s");
    assert!(
        second.is_ok(),
        "the writer's second lock failed: {second:?}"
    );
    txn.commit().await.expect("commit");

    // The batch goes on: V is marked stale and fetched again, U fetched.
    env.wait_fresh(&v, 2).await;
    env.wait_fresh(&u, 1).await;
    let Env { worker, db, .. } = env;
    worker.stop(Duration::from_secs(10)).await;
    drop(writer);
    assert_eq!(deadlocks_once_idle(&db.url).await, 0, "deadlocks detected");
}
