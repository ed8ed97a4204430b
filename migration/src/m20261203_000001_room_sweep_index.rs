//! An index for room sweeps (SPEC §5.5.5): a sweep chunk selects the
//! members of one room whose `shares` flag is wrong, in user order. Without
//! it every chunk rescans the rows earlier chunks already fixed, so a room
//! of 50,000 members cost a quadratic number of row visits.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const NAME: &str = "room_user_by_shares";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_index(
                Index::create()
                    .name(NAME)
                    .table("room_user")
                    .col("room_id")
                    .col("shares")
                    .col("user_id")
                    .if_not_exists()
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_index(Index::drop().name(NAME).table("room_user").to_owned())
            .await
    }
}
