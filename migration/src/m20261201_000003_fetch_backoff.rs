//! Failure state for fetching (SPEC §5.2), kept in the database so it
//! survives restarts and is shared by replicas.
//!
//! - `stale_user.failures` / `stale_user.next_attempt_ms`: a user whose own
//!   answer was unusable (404, a wrong `user_id`, too large, …) backs off
//!   alone; its server's job skips it until `next_attempt_ms`.
//! - `fetch_server`: a server whose job is waiting (its own back-off, or all
//!   its stale users are in theirs), with the count of server failures in a
//!   row and the last time an update from it ended its back-off.

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // SQLite takes one column per ALTER TABLE.
        for column in [
            integer("failures").default(0),
            big_integer("next_attempt_ms").default(0),
        ] {
            manager
                .alter_table(
                    Table::alter()
                        .table("stale_user")
                        .add_column(column)
                        .to_owned(),
                )
                .await?;
        }
        manager
            .create_table(
                Table::create()
                    .table("fetch_server")
                    .if_not_exists()
                    .col(text("server_name").primary_key())
                    .col(integer("failures").default(0))
                    .col(big_integer("next_attempt_ms").default(0))
                    .col(big_integer("failed_at_ms").default(0))
                    .col(big_integer("last_wake_ms").default(0))
                    .col(text_null("last_error"))
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table("fetch_server").to_owned())
            .await?;
        for column in ["next_attempt_ms", "failures"] {
            manager
                .alter_table(
                    Table::alter()
                        .table("stale_user")
                        .drop_column(column)
                        .to_owned(),
                )
                .await?;
        }
        Ok(())
    }
}
