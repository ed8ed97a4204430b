//! Reading and clearing the key-change outbox.

use entity::key_change_outbox;
use sea_orm::{ColumnTrait, DbErr, EntityTrait, QueryFilter, QueryOrder, QuerySelect};

use super::Store;

pub use key_change_outbox::Model as OutboxEvent;

impl Store {
    /// The oldest `limit` events not yet published, in id order.
    pub async fn outbox_pending(&self, limit: u64) -> Result<Vec<OutboxEvent>, DbErr> {
        key_change_outbox::Entity::find()
            .order_by_asc(key_change_outbox::Column::Id)
            .limit(limit)
            .all(&self.db)
            .await
    }

    /// Deletes published events.
    pub async fn outbox_delete(&self, ids: &[i64]) -> Result<(), DbErr> {
        for chunk in ids.chunks(1000) {
            key_change_outbox::Entity::delete_many()
                .filter(key_change_outbox::Column::Id.is_in(chunk.iter().copied()))
                .exec(&self.db)
                .await?;
        }
        Ok(())
    }

    /// How many events wait to be published.
    pub async fn outbox_len(&self) -> Result<u64, DbErr> {
        use sea_orm::PaginatorTrait;
        key_change_outbox::Entity::find().count(&self.db).await
    }
}
