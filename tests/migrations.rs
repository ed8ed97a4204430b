//! Migrations: they apply, roll back and apply again on both backends, and
//! the PostgreSQL storage settings of the hot tables are in place.

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
    // bytewise comparison of Matrix ids in every index probe
    for (table, column) in [
        ("remote_device", "user_id"),
        ("remote_device", "device_id"),
        ("remote_user", "user_id"),
        ("stale_user", "user_id"),
    ] {
        let collation = one_text(
            &db,
            &format!(
                "SELECT coalesce(collation_name, '') FROM information_schema.columns \
                 WHERE table_name = '{table}' AND column_name = '{column}'"
            ),
        )
        .await;
        assert_eq!(collation, "C", "{table}.{column}");
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
