//! Joined identities per user and room, and whether the pair counts as a
//! shared room (SPEC §5.5.1).

use sea_orm::entity::prelude::*;

/// One user in one room.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "room_user")]
pub struct Model {
    /// The room.
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub room_id: String,
    /// The user (a key's verified link resolves to it).
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub user_id: String,
    /// Not on our server.
    pub remote: bool,
    /// The user's joined identities in the room.
    pub joined: i32,
    /// Counted in the user's `shared_user.shared_rooms`.
    pub shares: bool,
}

/// No relations are declared.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
