//! `remote_user.fetched_stream_id`: the stream position of the last fetched
//! list. An update at or below it is already part of that list, so it is
//! never applied again (a redelivered old update could otherwise bring back
//! a device the fetched list no longer had).

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table("remote_user")
                    .add_column(big_integer("fetched_stream_id").default(0))
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table("remote_user")
                    .drop_column("fetched_stream_id")
                    .to_owned(),
            )
            .await
    }
}
