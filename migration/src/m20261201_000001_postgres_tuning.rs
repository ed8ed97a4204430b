//! PostgreSQL-only storage settings for the hot tables; nothing on SQLite.
//!
//! - Identifier columns compare bytewise (`COLLATE "C"`): Matrix ids are
//!   case-sensitive strings with no meaningful locale order, and a locale
//!   comparison in every index probe cost measurable CPU in the ingest
//!   benchmark (`strcoll` in the profile).
//! - `remote_device` and `remote_user` leave room in each page
//!   (`fillfactor`), so updating a row in place (the common case: a device's
//!   new keys) is a HOT update that writes no index entry.
//! - The outbox's event list, often hundreds of kilobytes and deleted seconds
//!   later, is stored compressed with lz4 where the server has it, not pglz.

use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::{ConnectionTrait, DbBackend};

#[derive(DeriveMigrationName)]
pub struct Migration;

/// Statements run in order on PostgreSQL.
const UP: &[&str] = &[
    r#"ALTER TABLE remote_user ALTER COLUMN user_id TYPE text COLLATE "C", ALTER COLUMN server_name TYPE text COLLATE "C""#,
    r#"ALTER TABLE remote_device ALTER COLUMN user_id TYPE text COLLATE "C", ALTER COLUMN device_id TYPE text COLLATE "C""#,
    r#"ALTER TABLE stale_user ALTER COLUMN user_id TYPE text COLLATE "C", ALTER COLUMN server_name TYPE text COLLATE "C""#,
    r#"ALTER TABLE cross_signing_key ALTER COLUMN user_id TYPE text COLLATE "C", ALTER COLUMN key_usage TYPE text COLLATE "C""#,
    "ALTER TABLE remote_device SET (fillfactor = 70)",
    "ALTER TABLE remote_user SET (fillfactor = 70)",
    // lz4 exists only when the server was built with it: keep pglz otherwise.
    "DO $$ BEGIN \
       ALTER TABLE key_change_outbox ALTER COLUMN events SET COMPRESSION lz4; \
     EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN NULL; \
     END $$",
];

/// Statements that undo [`UP`].
const DOWN: &[&str] = &[
    "ALTER TABLE key_change_outbox ALTER COLUMN events SET COMPRESSION DEFAULT",
    "ALTER TABLE remote_user RESET (fillfactor)",
    "ALTER TABLE remote_device RESET (fillfactor)",
    r#"ALTER TABLE cross_signing_key ALTER COLUMN user_id TYPE text COLLATE "default", ALTER COLUMN key_usage TYPE text COLLATE "default""#,
    r#"ALTER TABLE stale_user ALTER COLUMN user_id TYPE text COLLATE "default", ALTER COLUMN server_name TYPE text COLLATE "default""#,
    r#"ALTER TABLE remote_device ALTER COLUMN user_id TYPE text COLLATE "default", ALTER COLUMN device_id TYPE text COLLATE "default""#,
    r#"ALTER TABLE remote_user ALTER COLUMN user_id TYPE text COLLATE "default", ALTER COLUMN server_name TYPE text COLLATE "default""#,
];

async fn run(manager: &SchemaManager<'_>, statements: &[&str]) -> Result<(), DbErr> {
    let db = manager.get_connection();
    if db.get_database_backend() != DbBackend::Postgres {
        return Ok(());
    }
    for sql in statements {
        db.execute_unprepared(sql).await?;
    }
    Ok(())
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        run(manager, UP).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        run(manager, DOWN).await
    }
}
