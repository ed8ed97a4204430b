//! The pages `admin untrack-unshared` reads (SPEC §5.5.9): stored users (a
//! list, keys or a stale mark) that share no room with us, in user order,
//! page after page, each user once, whichever tables hold it and however
//! many shared users lie between them.

mod common;

use common::sql;

use device_list_updater::store::Store;

async fn remote_user(store: &Store, user: &str) {
    common::stored_user(store, user, "remote.example", 0).await;
}

async fn stale(store: &Store, user: &str) {
    sql(
        store,
        &format!(
            "INSERT INTO stale_user (user_id, server_name, marked_at_ms, trigger_stream_ids, failures, next_attempt_ms) \
             VALUES ('{user}', 'remote.example', 1, '[]', 0, 0)"
        ),
    )
    .await;
}

async fn cross_signing(store: &Store, user: &str) {
    for usage in ["master", "self_signing"] {
        sql(
            store,
            &format!(
                "INSERT INTO cross_signing_key (user_id, key_usage, key_json) VALUES ('{user}', '{usage}', '{{}}')"
            ),
        )
        .await;
    }
}

async fn shared(store: &Store, user: &str) {
    sql(
        store,
        &format!(
            "INSERT INTO shared_user (user_id, server_name, shared_rooms) VALUES ('{user}', 'remote.example', 1)"
        ),
    )
    .await;
}

/// Every page of `limit` users, read as the admin command reads them.
async fn all_pages(store: &Store, limit: u64) -> Vec<Vec<String>> {
    let mut pages = Vec::new();
    let mut after = String::new();
    loop {
        let page: Vec<String> = store
            .unshared_users(&after, limit)
            .await
            .unwrap()
            .into_iter()
            .map(|u| u.to_string())
            .collect();
        let Some(last) = page.last() else {
            return pages;
        };
        after = last.clone();
        pages.push(page);
    }
}

async fn unshared_pages(backend: common::Backend) {
    let db = common::TestDb::new(backend).await;
    let store = Store::connect(&db.url).await.unwrap();
    store.migrate().await.unwrap();
    assert!(all_pages(&store, 2).await.is_empty(), "nothing stored");

    // a: a list only; b: a list, keys and a stale mark; c: a stale mark
    // only; d: keys only (two rows); the s… users share a room and lie
    // between them in every table.
    remote_user(&store, "@a:remote.example").await;
    for user in ["@b:remote.example"] {
        remote_user(&store, user).await;
        stale(&store, user).await;
        cross_signing(&store, user).await;
    }
    stale(&store, "@c:remote.example").await;
    cross_signing(&store, "@d:remote.example").await;
    for n in 0..5 {
        for (table, prefix) in [("list", "@ba"), ("stale", "@bb"), ("keys", "@ca")] {
            let user = format!("{prefix}{n}:remote.example");
            match table {
                "list" => remote_user(&store, &user).await,
                "stale" => stale(&store, &user).await,
                _ => cross_signing(&store, &user).await,
            }
            shared(&store, &user).await;
        }
    }
    let unshared = [
        "@a:remote.example",
        "@b:remote.example",
        "@c:remote.example",
        "@d:remote.example",
    ];
    for limit in [1, 2, 3, 100] {
        let pages = all_pages(&store, limit).await;
        assert!(
            pages.iter().all(|p| p.len() as u64 <= limit),
            "{limit}: {pages:?}"
        );
        assert_eq!(pages.concat(), unshared, "pages of {limit}");
    }

    // A user that starts sharing leaves the pages.
    shared(&store, "@b:remote.example").await;
    assert_eq!(
        all_pages(&store, 2).await.concat(),
        [
            "@a:remote.example",
            "@c:remote.example",
            "@d:remote.example"
        ]
    );
}
both_backends!(pages, unshared_pages);
