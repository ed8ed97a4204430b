//! Rooms our server is or was in (SPEC §5.5).

use sea_orm::entity::prelude::*;

/// One room.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "room")]
pub struct Model {
    /// The room.
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub room_id: String,
    /// Joined local identities (our users, our users' verified keys): the
    /// room is ours while this is above zero.
    pub local_joined: i32,
    /// Our server joined or left the room: its remote members' sharing is
    /// re-decided in chunks until none is left to change.
    pub sweep: bool,
}

/// No relations are declared.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
