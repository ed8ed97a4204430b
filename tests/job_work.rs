//! The questions a fetch job asks the database before it parks or ends
//! (SPEC §5.2, §5.7): is there work now (`has_fetch_work`), and what is
//! ahead once the due stale users are done (`work_ahead`: a revalidation to
//! send now, and when the next work is due). Each is one statement over
//! stale users and queued revalidations, and counts a revalidation only when
//! a job could send it (not of a stale user, whose own fetch comes first).

mod common;

use common::sql;

use device_list_updater::store::Store;
use ruma::server_name;

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
/// revalidation to send at `NOW`; the next work due.
async fn work(store: &Store) -> (bool, bool, bool, Option<i64>) {
    let server = server_name!("remote.example");
    let ahead = store.work_ahead(server, NOW).await.unwrap();
    (
        store.has_fetch_work(server, NOW).await.unwrap(),
        store.has_fetch_work(server, i64::MAX).await.unwrap(),
        ahead.revalidation_due,
        ahead.next_due_ms,
    )
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
