//! Room sharing (SPEC §5.5, §5.6): who is in which room, the member keys'
//! links, and per remote user the number of rooms it shares with us.
//!
//! - `room`: per room the joined local identities and whether a sweep is
//!   pending (our server joined or left it: every remote member's sharing
//!   is re-decided in bounded chunks, resumable after a restart).
//! - `room_member`: each identity's last membership and `stream_ordering`.
//! - `member_key_link`: each member key's link to its user, in its room.
//! - `room_user`: joined identities per (room, user), and whether the pair
//!   counts in the user's `shared_user.shared_rooms`.
//! - `shared_user`: remote users sharing at least one room, with the count.

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table("room")
                    .if_not_exists()
                    .col(text("room_id").primary_key())
                    .col(integer("local_joined").default(0))
                    .col(boolean("sweep").default(false))
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table("room_member")
                    .if_not_exists()
                    .col(text("room_id"))
                    .col(text("identity"))
                    .col(text("membership"))
                    .col(big_integer("stream_ordering"))
                    .primary_key(Index::create().col("room_id").col("identity"))
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table("member_key_link")
                    .if_not_exists()
                    .col(text("room_id"))
                    .col(text("member_key"))
                    .col(text_null("user_id"))
                    .col(boolean("erased").default(false))
                    .col(boolean("verified").default(false))
                    .col(big_integer("stream_ordering"))
                    .primary_key(Index::create().col("room_id").col("member_key"))
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table("room_user")
                    .if_not_exists()
                    .col(text("room_id"))
                    .col(text("user_id"))
                    .col(boolean("remote"))
                    .col(integer("joined").default(0))
                    .col(boolean("shares").default(false))
                    .primary_key(Index::create().col("room_id").col("user_id"))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("room_user_by_user")
                    .table("room_user")
                    .col("user_id")
                    .if_not_exists()
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table("shared_user")
                    .if_not_exists()
                    .col(text("user_id").primary_key())
                    .col(text("server_name"))
                    .col(integer("shared_rooms"))
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for table in [
            "shared_user",
            "room_user",
            "member_key_link",
            "room_member",
            "room",
        ] {
            manager
                .drop_table(Table::drop().table(table).to_owned())
                .await?;
        }
        Ok(())
    }
}
