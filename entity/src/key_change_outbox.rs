//! Key-change events waiting to be published to the `KEY_CHANGE` stream.

use sea_orm::entity::prelude::*;

/// One event, written in the same transaction as the change it describes.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "key_change_outbox")]
pub struct Model {
    /// Ascending id; events are published in this order.
    #[sea_orm(primary_key)]
    pub id: i64,
    /// Owner of the changed keys (the `user_id` header).
    #[sea_orm(column_type = "Text")]
    pub user_id: String,
    /// `key_change.device` or `key_change.cross_signing`.
    #[sea_orm(column_type = "Text")]
    pub subject: String,
    /// The JSON body to publish.
    #[sea_orm(column_type = "Text")]
    pub payload: String,
    /// When the event was recorded (Unix milliseconds).
    pub created_at_ms: i64,
}

/// No relations are declared.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
