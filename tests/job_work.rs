//! The questions a fetch job asks the database as it starts, and before it
//! parks or ends (SPEC §5.2, §5.7): the server's wait and its first due
//! stale users (`job_start`), is there work now (`has_fetch_work`), and
//! what is ahead once the due stale users are done (`work_ahead`: a stale
//! user or a revalidation to send now, and when the next work is due). Each
//! is one statement over stale users and queued revalidations, and counts a
//! revalidation only when a job could send it (not of a stale user, whose
//! own fetch comes first).

mod common;

use common::sql;

use std::collections::BTreeSet;

use device_list_updater::store::Store;
use ruma::{OwnedServerName, server_name};

const NOW: i64 = 1_000_000;

async fn stale(store: &Store, user: &str, next_attempt_ms: i64) {
    sql(
        store,
        &format!(
            "INSERT INTO stale_user (user_id, server_name, marked_at_ms, trigger_stream_ids, failures, next_attempt_ms) \
             VALUES ('{user}', 'remote.example', 1, '[]', 0, {next_attempt_ms})"
        ),
    )
    .await;
}

async fn queued(store: &Store, user: &str, next_attempt_ms: i64) {
    sql(
        store,
        &format!(
            "INSERT INTO revalidation (user_id, server_name, queued_at_ms, failures, next_attempt_ms) \
             VALUES ('{user}', 'remote.example', 1, 0, {next_attempt_ms})"
        ),
    )
    .await;
}

/// Work of one server, at `NOW` and as the job's end looks (any time); a
/// revalidation to send at `NOW`; the next work due. A stale user due at
/// `NOW` is work now, whichever question asks.
async fn work(store: &Store) -> (bool, bool, bool, Option<i64>) {
    let server = server_name!("remote.example");
    let ahead = store.work_ahead(server, NOW).await.unwrap();
    let start = store.job_start(server, NOW, 100).await.unwrap();
    let stale_due = !store
        .due_stale_users(server, NOW, 1)
        .await
        .unwrap()
        .is_empty();
    assert_eq!(ahead.stale_due, stale_due, "work_ahead: a stale user due");
    assert_eq!(
        start.due,
        store.due_stale_users(server, NOW, 100).await.unwrap(),
        "job_start: the due stale users"
    );
    // What is ahead comes with the due users, as `work_ahead` says it.
    let start_ahead = start.ahead.map(|a| (a.revalidation_due, a.next_due_ms));
    let expected = stale_due.then_some((ahead.revalidation_due, ahead.next_due_ms));
    assert_eq!(start_ahead, expected, "job_start: what is ahead");
    starts_as_alone(store, 100).await;
    for at in [NOW, i64::MAX] {
        assert_eq!(
            store.servers_with_fetch_work(&servers(), at).await.unwrap(),
            each_with_work(store, at).await,
            "servers_with_fetch_work at {at}: as has_fetch_work answers for each"
        );
    }
    (
        store.has_fetch_work(server, NOW).await.unwrap(),
        store.has_fetch_work(server, i64::MAX).await.unwrap(),
        ahead.revalidation_due,
        ahead.next_due_ms,
    )
}

/// The servers the tests store work for, and one they never do.
fn servers() -> BTreeSet<OwnedServerName> {
    ["remote.example", "other.example", "none.example"]
        .into_iter()
        .map(|s| OwnedServerName::try_from(s).unwrap())
        .collect()
}

/// Those of [`servers`] for which `has_fetch_work` says yes at `at`.
async fn each_with_work(store: &Store, at: i64) -> BTreeSet<OwnedServerName> {
    let mut found = BTreeSet::new();
    for server in servers() {
        if store.has_fetch_work(&server, at).await.unwrap() {
            found.insert(server);
        }
    }
    found
}

/// `job_starts` over [`servers`] reads for each what `job_start` reads
/// alone (on PostgreSQL in one statement over them all), at `NOW` with
/// round `limit`.
async fn starts_as_alone(store: &Store, limit: u64) {
    let together = store.job_starts(&servers(), NOW, limit).await.unwrap();
    let mut alone = std::collections::BTreeMap::new();
    for server in servers() {
        let start = store.job_start(&server, NOW, limit).await.unwrap();
        alone.insert(server, start);
    }
    assert_eq!(together, alone, "job_starts with a limit of {limit}");
}

/// Stores `server`'s wait: `failures` in a row, its job due at `next_attempt_ms`.
async fn server_row(store: &Store, server: &str, failures: i32, next_attempt_ms: i64) {
    sql(
        store,
        &format!(
            "INSERT INTO fetch_server (server_name, failures, next_attempt_ms, failed_at_ms, last_wake_ms) \
             VALUES ('{server}', {failures}, {next_attempt_ms}, 0, 0)"
        ),
    )
    .await;
}

/// A job start's wait: failures in a row and when the job may run.
fn wait_of(start: &device_list_updater::store::JobStart) -> Option<(i32, i64)> {
    start.wait.map(|wait| (wait.failures, wait.next_attempt_ms))
}

/// The server's wait as a job starts: read with its first due users in one
/// statement, or alone when none is due; a row of another server is not
/// this one's.
async fn job_start_reads_the_wait(backend: common::Backend) {
    let db = common::TestDb::new(backend).await;
    let store = Store::connect(&db.url).await.unwrap();
    store.migrate().await.unwrap();
    let server = server_name!("remote.example");
    let start = store.job_start(server, NOW, 100).await.unwrap();
    assert_eq!(
        (wait_of(&start), start.due.len()),
        (None, 0),
        "nothing stored"
    );

    server_row(&store, "other.example", 7, 5).await;
    stale(&store, "@a:remote.example", 0).await;
    let start = store.job_start(server, NOW, 100).await.unwrap();
    assert_eq!(
        (wait_of(&start), start.due.len()),
        (None, 1),
        "no row of its own"
    );

    server_row(&store, "remote.example", 3, 42).await;
    let wait = Some((3, 42));
    let start = store.job_start(server, NOW, 100).await.unwrap();
    assert_eq!(wait_of(&start), wait, "with a due user");
    assert_eq!(start.due[0].user.as_str(), "@a:remote.example");

    // Users beyond the limit wait for the next round; a user in its own
    // back-off is not due, and the wait is read without any.
    stale(&store, "@b:remote.example", 0).await;
    assert_eq!(store.job_start(server, NOW, 1).await.unwrap().due.len(), 1);
    // Another server with a user due: one statement reads both rounds.
    sql(
        &store,
        "INSERT INTO stale_user (user_id, server_name, marked_at_ms, trigger_stream_ids, failures, next_attempt_ms) \
         VALUES ('@c:other.example', 'other.example', 1, '[]', 0, 0)",
    )
    .await;
    starts_as_alone(&store, 1).await;
    starts_as_alone(&store, 100).await;
    sql(&store, "UPDATE stale_user SET next_attempt_ms = 2000000").await;
    let start = store.job_start(server, NOW, 100).await.unwrap();
    assert_eq!((wait_of(&start), start.due.len()), (wait, 0), "no due user");
    starts_as_alone(&store, 100).await;
}

async fn job_work(backend: common::Backend) {
    let db = common::TestDb::new(backend).await;
    let store = Store::connect(&db.url).await.unwrap();
    store.migrate().await.unwrap();
    assert_eq!(
        work(&store).await,
        (false, false, false, None),
        "nothing stored"
    );

    // Another server's work is not this one's.
    sql(
        &store,
        "INSERT INTO stale_user (user_id, server_name, marked_at_ms, trigger_stream_ids, failures, next_attempt_ms) \
         VALUES ('@x:other.example', 'other.example', 1, '[]', 0, 0)",
    )
    .await;
    assert_eq!(work(&store).await, (false, false, false, None));

    // A queued revalidation in its own wait: due later.
    queued(&store, "@r:remote.example", NOW + 500).await;
    assert_eq!(work(&store).await, (false, true, false, Some(NOW + 500)));

    // A stale user in its own back-off, due sooner: the first wait wins.
    stale(&store, "@s:remote.example", NOW + 200).await;
    assert_eq!(work(&store).await, (false, true, false, Some(NOW + 200)));

    // A revalidation of a stale user is not sent (its own fetch comes
    // first): it is neither work now nor a wait to park on.
    stale(&store, "@both:remote.example", NOW + 300).await;
    queued(&store, "@both:remote.example", 0).await;
    assert_eq!(work(&store).await, (false, true, false, Some(NOW + 200)));

    // A due revalidation is work now; so is a due stale user.
    queued(&store, "@due:remote.example", NOW).await;
    assert_eq!(work(&store).await, (true, true, true, Some(NOW + 200)));
    sql(
        &store,
        "DELETE FROM revalidation WHERE user_id = '@due:remote.example'",
    )
    .await;
    stale(&store, "@now:remote.example", 0).await;
    assert_eq!(work(&store).await, (true, true, false, Some(NOW + 200)));
}

both_backends!(job_work_questions, job_work);
both_backends!(job_start_wait, job_start_reads_the_wait);
