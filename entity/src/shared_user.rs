//! Remote users that share at least one room with us (SPEC §5.5): with
//! membership on, exactly the users that are tracked.

use sea_orm::entity::prelude::*;

/// One remote user.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "shared_user")]
pub struct Model {
    /// The user.
    #[sea_orm(primary_key, auto_increment = false, column_type = "Text")]
    pub user_id: String,
    /// The user's server.
    #[sea_orm(column_type = "Text")]
    pub server_name: String,
    /// Rooms the user shares with us (above zero; the row goes at zero).
    pub shared_rooms: i32,
}

/// No relations are declared.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
