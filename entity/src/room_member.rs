//! Each identity's last membership in a room (SPEC §5.5.2).

use sea_orm::entity::prelude::*;

/// One identity in one room.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "room_member")]
pub struct Model {
    /// The room.
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub room_id: String,
    /// A user id or a member key, as the `state_key` was.
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub identity: String,
    /// `join`, `leave`, `invite`, `knock` or `ban`.
    #[sea_orm(column_type = "Text")]
    pub membership: String,
    /// The `stream_ordering` of the change applied last.
    pub stream_ordering: i64,
}

/// No relations are declared.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
