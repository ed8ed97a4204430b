//! The revalidation pick's cap per server (SPEC §5.7): a server with
//! `QUEUED_PER_SERVER` revalidations queued gets no more until its job has
//! worked some off, while other servers' users are queued as usual.

mod common;

use common::sql;

use device_list_updater::store::Store;
use device_list_updater::store::revalidate::QUEUED_PER_SERVER;

/// `n` users of `server`, never fetched (all due).
async fn users(store: &Store, server: &str, n: i64) {
    for i in 0..n {
        common::stored_user(store, &format!("@u{i}:{server}"), server, 0).await;
    }
}

async fn queued(store: &Store, server: &str) -> i64 {
    use sea_orm::{FromQueryResult, Statement};
    #[derive(FromQueryResult)]
    struct Row {
        n: i64,
    }
    let backend = store.connection().get_database_backend();
    Row::find_by_statement(Statement::from_string(
        backend,
        format!("SELECT count(*) AS n FROM revalidation WHERE server_name = '{server}'"),
    ))
    .one(store.connection())
    .await
    .unwrap()
    .map_or(0, |r| r.n)
}

async fn queue_cap(backend: common::Backend) {
    let db = common::TestDb::new(backend).await;
    let store = Store::connect(&db.url).await.unwrap();
    store.migrate().await.unwrap();
    let now = 1_000_000;
    users(&store, "full.example", QUEUED_PER_SERVER + 8).await;
    users(&store, "other.example", 5).await;
    // The first users of full.example are queued already: as many as a
    // server may have.
    sql(
        &store,
        &format!(
            "INSERT INTO revalidation (user_id, server_name, queued_at_ms, failures, next_attempt_ms) \
             SELECT user_id, server_name, 1, 0, 0 FROM remote_user \
             WHERE server_name = 'full.example' ORDER BY user_id LIMIT {QUEUED_PER_SERVER}"
        ),
    )
    .await;

    let servers = store.queue_revalidations(1, now, 100).await.unwrap();
    assert_eq!(
        servers.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
        ["other.example"],
        "a full server gets no more"
    );
    assert_eq!(queued(&store, "full.example").await, QUEUED_PER_SERVER);
    assert_eq!(queued(&store, "other.example").await, 5);

    // Its job works one off: it is queued again.
    sql(
        &store,
        "DELETE FROM revalidation WHERE user_id = (SELECT MIN(user_id) FROM revalidation WHERE server_name = 'full.example')",
    )
    .await;
    let servers = store.queue_revalidations(1, now, 100).await.unwrap();
    assert_eq!(
        servers.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
        ["full.example"]
    );
    assert!(queued(&store, "full.example").await >= QUEUED_PER_SERVER);
}
both_backends!(cap, queue_cap);
