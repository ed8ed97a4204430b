//! Key-change events waiting to be published to the `KEY_CHANGE` stream.

use sea_orm::entity::prelude::*;

/// The events of one committed transaction, written in that transaction.
///
/// One row per transaction rather than one per event: a 1000-update batch
/// then costs one insert and one delete instead of a thousand of each.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "key_change_outbox")]
pub struct Model {
    /// Ascending id; rows are published in this order, events within a row
    /// in array order.
    #[sea_orm(primary_key)]
    pub id: i64,
    /// JSON array of `{"user_id", "subject", "payload"}`, where `payload` is
    /// the event body (a JSON object, stored verbatim).
    #[sea_orm(column_type = "Text")]
    pub events: String,
    /// How many events the row holds.
    pub event_count: i32,
    /// When the events were recorded (Unix milliseconds).
    pub created_at_ms: i64,
}

/// No relations are declared.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
