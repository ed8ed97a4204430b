//! Migrations: they apply, roll back and apply again on both backends, and
//! the PostgreSQL storage settings of the hot tables are in place: every
//! identifier column compares bytewise, and hot tables leave room for HOT
//! updates.

mod common;

use common::{Backend, TestDb};
use migration::MigratorTrait;
use sea_orm::{ConnectionTrait, Database, DbBackend, Statement};

async fn one_text(db: &sea_orm::DatabaseConnection, sql: &str) -> String {
    let row = db
        .query_one_raw(Statement::from_string(DbBackend::Postgres, sql))
        .await
        .expect("query")
        .expect("a row");
    row.try_get_by_index::<String>(0).expect("text")
}

async fn round_trip(backend: Backend) {
    let test_db = TestDb::new(backend).await;
    let db = Database::connect(&test_db.url).await.expect("connect");
    migration::Migrator::up(&db, None).await.expect("up");
    migration::Migrator::down(&db, None).await.expect("down");
    migration::Migrator::up(&db, None).await.expect("up again");
    if backend != Backend::Postgres {
        return;
    }
    // Bytewise comparison of Matrix ids in every index probe, and in every
    // table alike: a join between a "C" column and a default-collation one
    // cannot use an index (the due stale users of a server, filtered by the
    // rooms they share, hashed all of room_user on every call).
    let ids = "'user_id', 'room_id', 'server_name', 'device_id', 'identity', 'member_key'";
    let collations = one_text(
        &db,
        &format!(
            "SELECT string_agg(table_name || '.' || column_name || '=' || coalesce(collation_name, ''), ',' \
             ORDER BY table_name, column_name) FROM information_schema.columns \
             WHERE table_schema = 'public' AND column_name IN ({ids}) \
               AND table_name <> 'key_change_outbox'"
        ),
    )
    .await;
    let columns: Vec<&str> = collations.split(',').collect();
    assert!(columns.len() >= 14, "{collations}");
    for column in &columns {
        assert!(
            column.ends_with("=C"),
            "{column} is not COLLATE \"C\": {collations}"
        );
    }
    // room for HOT updates of rewritten devices and users
    for table in ["remote_device", "remote_user"] {
        let options = one_text(
            &db,
            &format!(
                "SELECT array_to_string(reloptions, ',') FROM pg_class WHERE relname = '{table}'"
            ),
        )
        .await;
        assert!(options.contains("fillfactor=70"), "{table}: {options}");
    }
}

both_backends!(up_down_up, round_trip);
