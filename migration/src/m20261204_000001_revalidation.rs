//! Revalidation (SPEC §5.7): every tracked list is fetched again once its
//! last fetch is older than `DLU_REVALIDATE_AFTER`, oldest first.
//!
//! - `remote_user.fetched_at_ms`: when the user's list was last fetched
//!   (Unix ms; 0: never, or before this migration: due at once, paced like
//!   any other due user). Indexed: the pacer reads the oldest first.
//! - `revalidation`: users picked for a revalidation and waiting for their
//!   server's fetch job, with their own back-off after an unusable answer
//!   (as `stale_user` has it).
//! - `remote_server`: per remote server, the last successful fetch and the
//!   revalidations and divergences counted (`admin servers`).
//!
//! On PostgreSQL their identifier columns compare bytewise (`COLLATE "C"`),
//! as every other table's do: the pacer's and the jobs' joins with
//! `remote_user`, `stale_user` and `room_user` then use their indexes.

use sea_orm_migration::sea_orm::{ConnectionTrait, DbBackend};
use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

const FETCHED_AT_INDEX: &str = "remote_user_by_fetched_at";
const QUEUE_INDEX: &str = "revalidation_by_server";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table("remote_user")
                    .add_column(big_integer("fetched_at_ms").default(0))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name(FETCHED_AT_INDEX)
                    .table("remote_user")
                    .col("fetched_at_ms")
                    .if_not_exists()
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table("revalidation")
                    .if_not_exists()
                    .col(text("user_id").primary_key())
                    .col(text("server_name"))
                    .col(big_integer("queued_at_ms"))
                    .col(integer("failures").default(0))
                    .col(big_integer("next_attempt_ms").default(0))
                    .col(text_null("last_error"))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name(QUEUE_INDEX)
                    .table("revalidation")
                    .col("server_name")
                    .col("next_attempt_ms")
                    .if_not_exists()
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table("remote_server")
                    .if_not_exists()
                    .col(text("server_name").primary_key())
                    .col(big_integer("last_success_ms").default(0))
                    .col(big_integer("revalidations").default(0))
                    .col(big_integer("divergences").default(0))
                    .col(big_integer("last_divergence_ms").default(0))
                    .to_owned(),
            )
            .await?;
        let db = manager.get_connection();
        if db.get_database_backend() == DbBackend::Postgres {
            for statement in [
                r#"ALTER TABLE revalidation ALTER COLUMN user_id TYPE text COLLATE "C", ALTER COLUMN server_name TYPE text COLLATE "C""#,
                r#"ALTER TABLE remote_server ALTER COLUMN server_name TYPE text COLLATE "C""#,
            ] {
                db.execute_unprepared(statement).await?;
            }
        }
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for table in ["remote_server", "revalidation"] {
            manager
                .drop_table(Table::drop().table(table).to_owned())
                .await?;
        }
        manager
            .drop_index(
                Index::drop()
                    .name(FETCHED_AT_INDEX)
                    .table("remote_user")
                    .to_owned(),
            )
            .await?;
        manager
            .alter_table(
                Table::alter()
                    .table("remote_user")
                    .drop_column("fetched_at_ms")
                    .to_owned(),
            )
            .await
    }
}
