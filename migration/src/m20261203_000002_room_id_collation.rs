//! PostgreSQL only: the identifier columns of the room tables (and of
//! `fetch_server`) compare
//! bytewise (`COLLATE "C"`), as those of the user tables have since
//! `m20261201_000001_postgres_tuning`. A join between a `"C"` column and a
//! default-collation one cannot use an index on either: the due stale users
//! of a server, filtered by "shares a room now" (`room_user.user_id =
//! stale_user.user_id`), hashed all of `room_user` on every call (40 ms at
//! 100,000 pairs against 1 ms with the index; the membership benchmark's
//! fan-out took 2.5 times as long). Nothing on SQLite.

use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::{ConnectionTrait, DbBackend};

#[derive(DeriveMigrationName)]
pub struct Migration;

/// (table, its identifier columns).
const COLUMNS: &[(&str, &[&str])] = &[
    ("room", &["room_id"]),
    ("room_member", &["room_id", "identity"]),
    ("member_key_link", &["room_id", "member_key", "user_id"]),
    ("room_user", &["room_id", "user_id"]),
    ("shared_user", &["user_id", "server_name"]),
    ("fetch_server", &["server_name"]),
];

/// Sets every column of [`COLUMNS`] to `collation`.
async fn collate(manager: &SchemaManager<'_>, collation: &str) -> Result<(), DbErr> {
    let db = manager.get_connection();
    if db.get_database_backend() != DbBackend::Postgres {
        return Ok(());
    }
    for (table, columns) in COLUMNS {
        let changes: Vec<String> = columns
            .iter()
            .map(|column| format!(r#"ALTER COLUMN {column} TYPE text COLLATE "{collation}""#))
            .collect();
        db.execute_unprepared(&format!("ALTER TABLE {table} {}", changes.join(", ")))
            .await?;
    }
    Ok(())
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        collate(manager, "C").await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        collate(manager, "default").await
    }
}
