//! The initial schema: remote devices, per-user stream state, stale users,
//! cross-signing keys, the key-change outbox and service metadata.

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // Per remote user: which stream ids we know (for the prev_id rule).
        manager
            .create_table(
                Table::create()
                    .table("remote_user")
                    .if_not_exists()
                    .col(text("user_id").primary_key())
                    .col(text("server_name"))
                    .col(text("known_stream_ids"))
                    .col(big_integer("max_stream_id"))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("remote_user_server_name")
                    .table("remote_user")
                    .col("server_name")
                    .if_not_exists()
                    .to_owned(),
            )
            .await?;

        // One row per (user, device). Deleted devices stay as tombstones
        // (deleted = true, keys_json NULL) so an older update cannot revive them.
        manager
            .create_table(
                Table::create()
                    .table("remote_device")
                    .if_not_exists()
                    .col(text("user_id"))
                    .col(text("device_id"))
                    .col(text_null("display_name"))
                    .col(text_null("keys_json"))
                    .col(big_integer("stream_id"))
                    .col(boolean("deleted"))
                    .primary_key(Index::create().col("user_id").col("device_id"))
                    .to_owned(),
            )
            .await?;

        // Users whose list must be fetched again; the row's presence is the flag.
        manager
            .create_table(
                Table::create()
                    .table("stale_user")
                    .if_not_exists()
                    .col(text("user_id").primary_key())
                    .col(text("server_name"))
                    .col(big_integer("marked_at_ms"))
                    .col(text("trigger_stream_ids"))
                    .col(text_null("last_error"))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("stale_user_server_name")
                    .table("stale_user")
                    .col("server_name")
                    .if_not_exists()
                    .to_owned(),
            )
            .await?;

        manager
            .create_table(
                Table::create()
                    .table("cross_signing_key")
                    .if_not_exists()
                    .col(text("user_id"))
                    .col(text("key_usage"))
                    .col(text("key_json"))
                    .primary_key(Index::create().col("user_id").col("key_usage"))
                    .to_owned(),
            )
            .await?;

        // Key-change events written in the same transaction as the state they
        // describe, one row per transaction; the publisher sends them to
        // KEY_CHANGE and deletes the row.
        manager
            .create_table(
                Table::create()
                    .table("key_change_outbox")
                    .if_not_exists()
                    .col(big_pk_auto("id"))
                    .col(text("events"))
                    .col(integer("event_count"))
                    .col(big_integer("created_at_ms"))
                    .to_owned(),
            )
            .await?;

        manager
            .create_table(
                Table::create()
                    .table("service_meta")
                    .if_not_exists()
                    .col(text("name").primary_key())
                    .col(text("value"))
                    .to_owned(),
            )
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for table in [
            "service_meta",
            "key_change_outbox",
            "cross_signing_key",
            "stale_user",
            "remote_device",
            "remote_user",
        ] {
            manager
                .drop_table(Table::drop().table(table).if_exists().to_owned())
                .await?;
        }
        Ok(())
    }
}
